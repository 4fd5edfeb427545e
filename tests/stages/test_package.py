"""stages/package.py: `fluxtrt build --gpu cpu` (compiled PyTorch engines), run from the packages alone: images
equal to the JIT torch executor's and ONNX Runtime's, reuse, and one line for a package that cannot run here."""

import json
import shutil

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from fluxtrt.cli import app
from fluxtrt.components import TRANSFORMER_PARTS
from fluxtrt.runtime.assembly import open_pipeline

MAX_UINT8_DIFF = 2  # of 255


def _image(pipe, prompt, seed, steps=3, height=256, width=320, **kw):
    return pipe.generate([prompt], height, width, steps, 3.5, seed=seed, **kw).images[0].astype(int)


@pytest.mark.parametrize("model", ["tiny", "tiny-schnell"])
def test_cpu_packages_equal_the_jit_torch_executor_and_onnxruntime(packages, engines, model):
    """tiny fully packaged, tiny-schnell's transformer alone (the rest runs in PyTorch, said in the notes): each
    image within 2/255 of the JIT torch executor in fp32 and of ONNX Runtime on the same model's fp32 engines."""
    components = ("clip", "t5", "transformer", "vae_decoder") if model == "tiny" else ("transformer",)
    src, folder, manifest = packages(model, components, first_block_cache=model == "tiny-schnell")
    assert manifest.backend == "torch" and manifest.runtime["target"] == "cpu" and not manifest.pending
    parts = tuple(TRANSFORMER_PARTS) if model == "tiny-schnell" else ()
    assert {e.engine for e in manifest.components.values()} == {f"{c}.pt2" for c in components + parts}
    # the kernels in the package, the weights beside it (read once at load, handed to the package)
    assert all((folder / e.constants["file"]).stat().st_size == e.constants["bytes"] for e in manifest.components.values())
    seed = int(np.random.default_rng().integers(1000))
    prompt = "a lighthouse at dusk"
    pipe = open_pipeline(folder, backend="torch", fallback=[c for c in ("clip", "t5", "vae_decoder") if c not in components],
                    torch_dtype="fp32")
    assert {n: ex.kind for n, ex in pipe.executors.items() if n in components} == {c: "pt2" for c in components}
    got = _image(pipe, prompt, seed)
    jit = _image(open_pipeline(None, backend="torch", model=src, torch_dtype="fp32"), prompt, seed)
    ort = _image(open_pipeline(engines(model)[1], backend="onnxruntime"), prompt, seed)
    assert np.abs(got - jit).max() <= MAX_UINT8_DIFF and np.abs(got - ort).max() <= MAX_UINT8_DIFF
    assert got.std() > 5  # an image, not a constant


def test_fill_transformer_package_runs_the_fill_workflow(packages, tmp_path):
    """An image workflow from a package: tiny-fill's transformer (its 384 input channels) through `fluxtrt run
    --image --mask` equals the JIT torch executor's image within 2/255."""
    from PIL import Image

    src, folder, _ = packages("tiny-fill", ("transformer",))
    rng = np.random.default_rng()
    Image.fromarray(rng.integers(0, 255, (256, 256, 3), dtype=np.uint8)).save(tmp_path / "in.png")
    mask = np.zeros((256, 256), np.uint8)
    mask[64:192, 32:160] = 255
    Image.fromarray(mask).save(tmp_path / "mask.png")
    common = ["--prompt", "a door", "--image", str(tmp_path / "in.png"), "--mask", str(tmp_path / "mask.png"),
              "--steps", "2", "--seed", str(int(rng.integers(1000))), "--torch-dtype", "fp32"]
    images = {}
    runs = {"pt2": ["--engines", str(folder), "--fallback", "vae_encoder"],
            "jit": ["--model", str(src.path), "--backend", "torch"]}
    for name, args in runs.items():
        res = CliRunner().invoke(app, ["run", *args, *common, "--out", str(tmp_path / f"{name}.png")])
        assert res.exit_code == 0, res.output
        images[name] = np.asarray(Image.open(tmp_path / f"{name}.png")).astype(int)
    assert np.abs(images["pt2"] - images["jit"]).max() <= MAX_UINT8_DIFF


def test_a_second_build_reuses_every_package(packages, tmp_path):
    from fluxtrt.gpus import load_gpu
    from fluxtrt.stages.build import build_gpu

    src, folder, manifest = packages("tiny-schnell", ("transformer",), first_block_cache=True)
    shutil.copytree(folder.parent, tmp_path / "root", symlinks=True)
    again, results = build_gpu(src, load_gpu("cpu"), tmp_path / "root", components=["transformer"])
    assert [(r.stage, r.status) for r in results] == [("package", "reused")]
    assert again.components["transformer"].sha256 == manifest.components["transformer"].sha256


def test_a_package_that_cannot_run_here_is_refused_in_one_line(packages, tmp_path):
    """Another torch version, a flipped byte and another model's package: each one line naming both sides or the
    fix, exit 2, nothing compiled in its place and no image written."""
    _, folder, _ = packages("tiny-schnell", ("transformer",), first_block_cache=True)
    _, tiny, _ = packages("tiny")
    base = ["run", "--prompt", "x", "--steps", "1", "--height", "256", "--width", "256", "--fallback", "clip,t5,vae_decoder"]

    def run(where, *extra):
        res = CliRunner().invoke(app, [*base, "--engines", str(where), "--out", str(tmp_path / "o.png"), *extra])
        lines = res.output.strip().splitlines()  # the choice of backend may add its note first
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        assert [line for line in lines if not line.startswith("note: ")] == [lines[-1]], res.output
        assert not (tmp_path / "o.png").exists()
        return lines[-1]

    other = tmp_path / "torch" / "cpu"
    shutil.copytree(folder, other)
    m = json.loads((other / "manifest.json").read_text())
    m["runtime"]["torch"] = "2.4.0"
    (other / "manifest.json").write_text(json.dumps(m))
    out = run(other)
    assert "compiled for torch 2.4.0, this machine has torch" in out and "fluxtrt build --gpu cpu --backend torch" in out
    for libstdcxx, says in (("99.0.0", "compiled against libstdc++ 99.0.0, this machine's torch runs on the older"),
                            ("6.0.x; rm", "runtime")):  # linked to a newer libstdc++ than here; a damaged record
        (other / "manifest.json").write_text(json.dumps(dict(m, runtime=dict(
            m["runtime"], torch=torch.__version__, **{"libstdc++": libstdcxx}))))
        assert says in run(other)
    (other / "manifest.json").write_text(json.dumps(m))
    flipped = tmp_path / "flip" / "cpu"
    shutil.copytree(folder, flipped)
    data = bytearray((flipped / "transformer.pt2").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (flipped / "transformer.pt2").write_bytes(bytes(data))
    assert "is not the package the manifest records" in run(flipped)
    shutil.copy(folder / "transformer.pt2", flipped / "transformer.pt2")  # now its weights
    data = bytearray((flipped / "transformer.constants.safetensors").read_bytes())
    data[-8] ^= 0xFF
    (flipped / "transformer.constants.safetensors").write_bytes(bytes(data))
    assert "is not the file the manifest records (tree_sha256 differs" in run(flipped)
    swapped = tmp_path / "swap" / "cpu"  # tiny-dev's folder with tiny-schnell's transformer package and entry
    shutil.copytree(tiny, swapped)
    shutil.copy(folder / "transformer.pt2", swapped / "transformer.pt2")
    m = json.loads((swapped / "manifest.json").read_text())
    m["components"]["transformer"] = json.loads((folder / "manifest.json").read_text())["components"]["transformer"]
    (swapped / "manifest.json").write_text(json.dumps(m))
    assert "was compiled for another model" in run(swapped)
    assert "compiled PyTorch engines" in run(folder, "--backend", "onnxruntime")
    from fluxtrt import api  # `inspect` says the same of each folder, without loading anything

    state = lambda f: {c.component: (c.file, c.runtime) for c in api.inspect(f).checks}["transformer"]  # noqa: E731
    assert state(folder) == ("ok", "VALID (this torch and device)")
    assert state(other)[1].startswith("CANNOT RUN: it was compiled for torch 2.4.0")
    assert state(flipped)[0].startswith("weights transformer.constants.safetensors: SHA256 MISMATCH")


def test_an_archive_of_packages_unpacks_and_runs_the_same(packages, tmp_path):
    """`artifacts`' pack and `unpack` carry the packages and their weights: the unpacked folder's image is the packed
    folder's, bit for bit."""
    from fluxtrt.artifacts import pack, unpack

    _, folder, _ = packages("tiny-schnell", ("transformer",), first_block_cache=True)
    archive, sha = pack(folder, tmp_path / "dist")
    assert archive.name.endswith("-cpu-cpu.tar.gz")
    unpacked = unpack(archive, tmp_path / "engines", sha)
    assert (unpacked / "transformer.constants.safetensors").is_file()
    seed = int(np.random.default_rng().integers(1000))
    images = [_image(open_pipeline(f, backend="torch", fallback=["clip", "t5", "vae_decoder"], torch_dtype="fp32"),
                     "a kite", seed, steps=2) for f in (folder, unpacked)]
    assert np.array_equal(images[0], images[1])


def test_serve_bench_and_the_drop_in_open_a_package_folder(packages):
    """The same package folder behind `fluxtrt serve` (the Service, batch 2 through the package), `fluxtrt bench`
    and the drop-in diffusers pipeline: served images equal single runs within 2/255; the drop-in's latents
    equal diffusers' fp32 FluxPipeline's step for step (tests/test_dropin.compare's bounds)."""
    import asyncio
    import base64
    import io

    from PIL import Image

    from fluxtrt import api
    from fluxtrt.bench import BenchOptions
    from fluxtrt.dropin import load_pipeline
    from fluxtrt.runtime.options import PipelineOptions
    from fluxtrt.serving import Service
    from tests.test_dropin import compare

    src, folder, _ = packages("tiny-schnell", ("transformer",), first_block_cache=True)
    svc = Service(PipelineOptions(engines=folder, torch_dtype="fp32"), max_batch=2, max_queue=2)
    try:
        assert svc.backend == "torch" and svc.pipe.executors["transformer"].kind == "pt2"
        seed = int(np.random.default_rng().integers(1000))
        body = json.dumps({"prompt": "a cat", "size": "320x256", "n": 2, "steps": 2, "seed": seed}).encode()
        status, payload, _ = asyncio.run(svc.generate(body))
        assert status == 200 and [d["seed"] for d in payload["data"]] == [seed, seed + 1]
        for d in payload["data"]:
            img = np.asarray(Image.open(io.BytesIO(base64.b64decode(d["b64_json"])))).astype(int)
            alone = svc.pipe.generate(["a cat"], 256, 320, 2, 3.5, seed=d["seed"]).images[0].astype(int)
            assert np.abs(img - alone).max() <= MAX_UINT8_DIFF
    finally:
        svc.close()
    rows, meta, _ = api.bench(folder, None, "auto", BenchOptions(sizes=[256], steps=2, runs=1, warmup=0,
                                                                 pipeline=PipelineOptions(torch_dtype="fp32")))
    assert len(rows) == 1 and rows[0].end_to_end_s.median > 0 and meta["model"] == "tiny-schnell"
    ours = load_pipeline(folder, torch_dtype="fp32")
    assert ours.transformer.executor.kind == "pt2"
    compare(ours, src.load_pipeline(), src, "txt2img", "torch")


def test_first_block_cache_runs_on_the_packaged_parts_as_on_the_jit_module(packages):
    """`fluxtrt build --gpu cpu --first-block-cache`: the transformer's head, tail and out as packages of their own;
    with a cache threshold the pipeline runs them and decides as the JIT module's parts do: the same steps
    computed and skipped, the image within 2/255."""
    src, folder, _ = packages("tiny-schnell", ("transformer",), first_block_cache=True)
    pipe = open_pipeline(folder, backend="torch", torch_dtype="fp32")
    assert {n: pipe.executors[n].kind for n in TRANSFORMER_PARTS} == {n: "pt2" for n in TRANSFORMER_PARTS}
    jit = open_pipeline(None, backend="torch", model=src, torch_dtype="fp32", device="cpu")
    seed = int(np.random.default_rng().integers(1000))
    got = pipe.generate(["a lighthouse"], 256, 256, 6, seed=seed, cache_threshold=0.3)
    want = jit.generate(["a lighthouse"], 256, 256, 6, seed=seed, cache_threshold=0.3)
    assert got.timings.cache == want.timings.cache and got.timings.cache["computed"] >= 1
    assert np.abs(got.images.astype(int) - want.images.astype(int)).max() <= MAX_UINT8_DIFF


def test_loras_merge_into_the_packages_weights_as_on_the_jit_module(packages, tmp_path):
    """`run --lora A --lora B:0.5` on tiny-schnell's packages (the transformer and its First-Block Cache parts,
    each merging the layers its weights file holds): the image equals the JIT torch executor's with the same
    LoRAs (fp32) within 2/255, uncached and cached, and differs from the image without them; a LoRA for layers
    no package holds is one line before anything loads."""
    from safetensors.torch import save_file

    from fluxtrt.errors import FluxtrtError
    from tests.test_serving import write_loras

    src, folder, _ = packages("tiny-schnell", ("transformer",), first_block_cache=True)
    loras = write_loras(tmp_path / "loras", ["a", "b"])
    refs = [str(loras / "a.safetensors"), f"{loras / 'b.safetensors'}:0.5"]
    pipe = open_pipeline(folder, backend="torch", torch_dtype="fp32", lora=refs)
    jit = open_pipeline(None, backend="torch", model=src, torch_dtype="fp32", device="cpu", lora=refs)
    seed = int(np.random.default_rng().integers(1000))
    for threshold in (0.0, 0.3):
        got = pipe.generate(["a lighthouse"], 256, 256, 4, seed=seed, cache_threshold=threshold)
        want = jit.generate(["a lighthouse"], 256, 256, 4, seed=seed, cache_threshold=threshold)
        assert got.timings.cache == want.timings.cache
        assert np.abs(got.images.astype(int) - want.images.astype(int)).max() <= MAX_UINT8_DIFF, threshold
    assert pipe.executors["transformer"].lora_note.startswith("LoRA merged into")
    plain = open_pipeline(folder, backend="torch", torch_dtype="fp32").generate(["a lighthouse"], 256, 256, 4, seed=seed)
    assert np.abs(got.images.astype(int) - plain.images.astype(int)).max() > 10
    served_loras_equal_their_runs(folder, loras, seed)
    save_file({"transformer.no_such.lora_A.weight": torch.randn(2, 8), "transformer.no_such.lora_B.weight":
               torch.randn(8, 2)}, tmp_path / "foreign.safetensors")
    with pytest.raises(FluxtrtError, match="targets no_such, which the cpu packages do not hold"):
        open_pipeline(folder, backend="torch", lora=[tmp_path / "foreign.safetensors"])


def served_loras_equal_their_runs(folder, loras, seed):
    """`fluxtrt serve --engines PACKAGES --lora-dir DIR`: one LoRA stack per call, each stack's packages with
    their weights merged; every image equals `run --lora` on the packages within 2/255."""
    import asyncio
    import base64
    import io
    import json

    from PIL import Image

    from fluxtrt.runtime.options import PipelineOptions
    from fluxtrt.serving import Service

    svc = Service(PipelineOptions(engines=folder, backend="torch", torch_dtype="fp32"), max_batch=2, max_queue=8,
                  lora_dir=loras)
    requests = [None, "a", [{"name": "b", "scale": 0.5}, {"name": "a"}], "a"]
    try:
        async def scenario():
            return await asyncio.gather(*(svc.generate(json.dumps(
                {"prompt": "a lighthouse", "size": "256x256", "steps": 3, "seed": seed + i,
                 **({"lora": r} if r else {})}).encode()) for i, r in enumerate(requests)))

        answers = asyncio.run(scenario())
        assert [a[0] for a in answers] == [200] * 4, [a[1] for a in answers]
        assert svc.health()["lora"]["mixed_calls"] == 0
    finally:
        svc.close()
    for i, r in enumerate(requests):
        stack = [r] if isinstance(r, str) else r or []
        refs = [f"{loras / (x if isinstance(x, str) else x['name'])}.safetensors:"
                f"{1.0 if isinstance(x, str) else x.get('scale', 1.0)}" for x in stack]
        alone = _image(open_pipeline(folder, backend="torch", torch_dtype="fp32", lora=refs), "a lighthouse",
                       seed + i, steps=3, height=256, width=256)
        got = np.asarray(Image.open(io.BytesIO(base64.b64decode(answers[i][1]["data"][0]["b64_json"])))).astype(int)
        assert np.abs(got - alone).max() <= MAX_UINT8_DIFF, (i, r)


def test_t5_fp8_weight_only_package_holds_e4m3_weights_and_computes_the_recipe(packages, tmp_path):
    """`-p t5=fp8-wo` on a CPU: the T5 package's weights file holds its linear weights in E4M3 (a quarter of their
    fp32 bytes and a scale per row; the rest as in the fp32 package), the package computes what the eager fp8-wo
    module computes (1e-5 relative) and its embedding stays within 5% (relative, RMS) of the fp32 T5's while
    differing from it. TensorRT builds refuse it in one line."""
    from fluxtrt.components import ShapePoint, specs_for
    from fluxtrt.errors import ConfigError
    from fluxtrt.fp8_layers import weight_only
    from fluxtrt.gpus import load_gpu
    from fluxtrt.records import read_manifest
    from fluxtrt.stages.build import build_gpu

    src, full, full_manifest = packages("tiny")
    build_gpu(src, load_gpu("cpu").with_precision({"t5": "fp8-wo"}), tmp_path, components=["t5"])
    folder = tmp_path / "cpu"
    entry = read_manifest(folder).components["t5"]
    assert entry.precision == "fp8-wo"
    from safetensors import safe_open

    with safe_open(folder / entry.constants["file"], "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert "F8_E4M3" in dtypes
    spec = specs_for(src.geometry, ["t5"])["t5"]
    raw = src.load_component(spec.subfolder, torch.float32, "cpu")
    linear = sum(m.weight.numel() * 4 for m in raw.modules() if isinstance(m, torch.nn.Linear))
    # E4M3: 3/4 of the linear weights' bytes saved, less an fp32 scale per row
    assert entry.constants["bytes"] < full_manifest.components["t5"].constants["bytes"] - 0.66 * linear
    feeds = spec.sample_inputs(ShapePoint(1, 256, 256), src.geometry, seed=int(np.random.default_rng().integers(1000)))
    pipe = open_pipeline(folder, backend="torch", fallback=["clip", "transformer", "vae_decoder"], torch_dtype="fp32")
    got = next(iter(pipe.executors["t5"].infer(dict(feeds)).values()))
    with torch.no_grad():
        exact = spec.wrap(raw)(*[feeds[t.name] for t in spec.inputs])
        exact = exact[0] if isinstance(exact, (tuple, list)) else exact
        weight_only(raw)
        want = spec.wrap(raw)(*[feeds[t.name] for t in spec.inputs])
        want = want[0] if isinstance(want, (tuple, list)) else want
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    rel = float((got - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt())
    assert 0 < rel < 0.05, rel
    with pytest.raises(ConfigError, match="fp8-wo is computed by compiled PyTorch engines only"):
        build_gpu(src, load_gpu("4090").with_precision({"t5": "fp8-wo"}), tmp_path / "trt", components=["t5"])


def test_opening_a_package_folder_reads_the_weights_ahead_unless_low_vram(packages):
    """Every package's weights are read on a background thread from the moment the folder is opened (in the order
    the components run) and handed to the package at its first call; --low-vram reads each at its stage only."""
    _, folder, _ = packages("tiny")
    pipe = open_pipeline(folder, backend="torch", torch_dtype="fp32")
    reads = {n: ex._reading for n, ex in pipe.executors.items()}
    assert all(r is not None for r in reads.values())
    weights = {n: r.result() for n, r in reads.items()}
    assert weights["transformer"] and all(t.device.type == "cpu" for t in weights["transformer"].values())
    _image(pipe, "a kite", int(np.random.default_rng().integers(1000)), steps=1)
    assert all(ex._reading is None and ex._weights is weights[n] for n, ex in pipe.executors.items())
    low = open_pipeline(folder, backend="torch", torch_dtype="fp32", low_vram=True)
    assert all(ex._reading is None for ex in low.executors.values())


def test_fp8_attn_transformer_package_computes_the_recipe_as_the_jit_executor(packages, tmp_path):
    """`-p transformer=fp8-attn --backend torch` on a CPU (3 prompts, 2 steps of calibration): the package records
    the recipe with each attention's four scales, and its image equals the JIT torch executor's on the same
    calibration file within 2/255 (both emulate the recipe in fp32 here; on Hopper the package holds FlashInfer's
    op, on other sm89+ GPUs the Triton kernel). A package recorded as calling FlashInfer's op is refused in one
    line where flashinfer cannot run."""
    from fluxtrt.attention import attention_modules
    from fluxtrt.errors import FluxtrtError
    from fluxtrt.gpus import load_gpu
    from fluxtrt.records import CalibrationSettings, read_manifest
    from fluxtrt.stages.build import build_gpu

    src, _, _ = packages("tiny")  # its fp32 packages of the other components
    build_gpu(src, load_gpu("cpu").with_precision({"transformer": "fp8-attn"}), tmp_path, components=["transformer"],
              calibration=CalibrationSettings(size=3, steps=2))
    entry = read_manifest(tmp_path / "cpu").components["transformer"]
    raw = src.load_component("transformer", torch.float32, "cpu")
    assert entry.precision == "fp8-attn" and entry.recipe["name"] == "fp8-attn"
    assert len(entry.recipe["attention"]) == len(attention_modules(raw)) and all(
        len(a) == 4 and min(a) > 0 for a in entry.recipe["attention"])
    (calibration,) = (tmp_path / "calibration").glob("*.json")
    seed = int(np.random.default_rng().integers(1000))
    got = _image(open_pipeline(tmp_path / "cpu", backend="torch", fallback=["clip", "t5", "vae_decoder"],
                               torch_dtype="fp32"), "a lighthouse at dusk", seed)
    jit = _image(open_pipeline(None, backend="torch", model=src, torch_dtype="fp32", calibration=calibration),
                 "a lighthouse at dusk", seed)
    assert np.abs(got - jit).max() <= MAX_UINT8_DIFF and got.std() > 5
    # a package that calls FlashInfer's op (recorded by a Hopper build) where flashinfer cannot run: one line
    assert entry.recipe["attention_kernel"] is None  # emulated on this CPU
    manifest = json.loads((tmp_path / "cpu" / "manifest.json").read_text())
    manifest["components"]["transformer"]["recipe"]["attention_kernel"] = "flashinfer"
    (tmp_path / "cpu" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FluxtrtError, match=r"transformer: transformer.pt2 calls FlashInfer's FP8 attention, and .*: "
                       r"pip install flashinfer-python, or build the package again here$"):
        _image(open_pipeline(tmp_path / "cpu", backend="torch", fallback=["clip", "t5", "vae_decoder"],
                             torch_dtype="fp32"), "a lighthouse at dusk", seed)


def test_a_package_is_reused_only_with_its_shipped_flashinfer_module(tmp_path):
    """shipped_module_intact: a recipe without a FlashInfer module needs none; with one (fp8-attn built on Hopper),
    the file must be there with its recorded sha256, so a rebuild after it was deleted or changed ships it again."""
    import hashlib

    from fluxtrt.stages.package import shipped_module_intact

    data = np.random.default_rng().integers(0, 255, 2048).astype(np.uint8).tobytes()
    rel = "flashinfer/m/m.so"
    recipe = {"name": "fp8-attn", "scales": {}, "attention_module": {
        "file": rel, "sha256": hashlib.sha256(data).hexdigest(), "flashinfer": "0.7.4", "head_dim": 128}}
    assert shipped_module_intact(tmp_path, None, "transformer")
    assert shipped_module_intact(tmp_path, {"name": "fp8", "scales": {}}, "transformer")
    assert not shipped_module_intact(tmp_path, recipe, "transformer")
    (tmp_path / rel).parent.mkdir(parents=True)
    (tmp_path / rel).write_bytes(data)
    assert shipped_module_intact(tmp_path, recipe, "transformer")
    (tmp_path / rel).write_bytes(data[:-1])
    assert not shipped_module_intact(tmp_path, recipe, "transformer")
