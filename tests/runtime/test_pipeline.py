"""The runtime: `fluxtrt run` semantics against diffusers' FluxPipeline, executor checks, request errors."""

import numpy as np
import pytest
import torch

from fluxtrt.errors import BackendUnavailableError, FluxtrtError
from fluxtrt.records import ManifestError

pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx not installed (pip install -e '.[rtx]')")

from fluxtrt.gpus import load_gpu  # noqa: E402
from fluxtrt.runtime.assembly import open_pipeline  # noqa: E402
from fluxtrt.runtime.executors import ShapeError, check_gpu_for  # noqa: E402
from fluxtrt.runtime.pipeline import RequestError
from fluxtrt.stages.build import build_gpu  # noqa: E402

MAX_UINT8_DIFF = 2  # of 255, image vs diffusers
_ENGINES = {}


@pytest.fixture(scope="module")
def fp32_engines(engines):
    """(source, GPU folder) of conftest's fp32 engines: ONNX Runtime over them compares with fp32 diffusers."""
    return lambda model: engines(model)[:2]


def reference(src, prompts, h, w, steps, guidance, seed, **extra):
    pipe = src.load_pipeline()
    latents = []

    def keep(p, i, t, kw):
        latents.append(kw["latents"].clone())
        return {}

    # schnell runs T5 at 256 tokens, as its model card's example passes max_sequence_length=256
    img = pipe(prompts, height=h, width=w, num_inference_steps=steps, guidance_scale=guidance,
               max_sequence_length=src.geometry.t5_length, generator=torch.Generator().manual_seed(seed), output_type="np",
               callback_on_step_end=keep, **extra).images
    return (img * 255).round().astype("uint8"), latents


@pytest.mark.parametrize("model", ["tiny", "tiny-schnell"])
def test_true_cfg_matches_diffusers(fp32_engines, model):
    """--negative-prompt / --true-cfg: diffusers' FluxPipeline with negative_prompt and true_cfg_scale, step for
    step (latents < 1e-3, images within MAX_UINT8_DIFF/255), and it changes the image."""
    src, engines = fp32_engines(model)
    seed = int(np.random.default_rng().integers(0, 2**31))
    prompts, negative, steps = ["a red fox in the snow", "a bowl of ramen"], "blurry, low quality", 3
    ref, ref_latents = reference(src, prompts, 256, 256, steps, 3.5, seed, negative_prompt=negative,
                                 true_cfg_scale=4.0)
    pipe = open_pipeline(engines, backend="onnxruntime")
    res = pipe.generate(prompts, 256, 256, steps, 3.5, seed=seed, trace=True, negative_prompts=[negative] * 2,
                        true_cfg=4.0)
    for i, (a, b) in enumerate(zip(res.latents_per_step, ref_latents)):
        err = float((a - b).abs().max())
        assert err < 1e-3, f"latents diverge from diffusers at step {i}: {err:.2e}"
    assert int(np.abs(res.images.astype(int) - ref.astype(int)).max()) <= MAX_UINT8_DIFF
    plain = pipe.generate(prompts, 256, 256, steps, 3.5, seed=seed).images
    assert int(np.abs(plain.astype(int) - res.images.astype(int)).max()) > 10  # guidance did something
    with pytest.raises(RequestError, match="1 negative prompts for 2 prompts"):
        pipe.generate(prompts, 256, 256, steps, negative_prompts=["x"], true_cfg=2.0)


def test_cli_true_cfg_needs_a_negative_prompt(fp32_engines, tmp_path):
    from PIL import Image
    from typer.testing import CliRunner

    from fluxtrt.cli import app

    _, engines = fp32_engines("tiny-schnell")
    res = CliRunner().invoke(app, ["run", "--engines", str(engines), "--prompt", "x", "--true-cfg", "3"])
    assert res.exit_code == 2 and "needs --negative-prompt" in res.output
    res = CliRunner().invoke(app, ["run", "--engines", str(engines), "--prompt", "a cat", "--true-cfg", "3",
                                   "--negative-prompt", "", "--height", "256", "--width", "256",
                                   "--out", str(tmp_path / "c.png")])
    assert res.exit_code == 0, res.output
    meta = Image.open(tmp_path / "c.png").text
    assert meta["negative_prompt"] == "" and meta["true_cfg"] == "3.0"
    res = CliRunner().invoke(app, ["run", "--engines", str(engines), "--prompt", "a cat", "--negative-prompt", "dog",
                                   "--height", "256", "--width", "256", "--out", str(tmp_path / "d.png")])
    assert res.exit_code == 0 and "no effect without --true-cfg" in " ".join(res.output.split())


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "tiny-schnell"])
@pytest.mark.parametrize("prompts,h,w", [
    (["a red fox in the snow"], 256, 256),
    (["a lighthouse on a rocky coast at night"], 256, 384),
    (["an oil painting of a lake", "a bowl of ramen"], 320, 256),
], ids=["square", "non-square", "batch2"])
def test_onnxruntime_run_matches_diffusers(fp32_engines, model, prompts, h, w):
    src, engines = fp32_engines(model)
    seed = int(np.random.default_rng().integers(0, 2**31))
    steps = 4 if model == "tiny-schnell" else 5
    ref, ref_latents = reference(src, prompts, h, w, steps, 3.5, seed)
    res = open_pipeline(engines, backend="onnxruntime").generate(prompts, h, w, steps, 3.5, seed=seed, trace=True)
    assert len(res.latents_per_step) == steps == len(ref_latents)
    for i, (a, b) in enumerate(zip(res.latents_per_step, ref_latents)):
        err = float((a - b).abs().max())
        assert err < 1e-3, f"latents diverge from diffusers at step {i}: {err:.2e}"
    assert res.images.shape == ref.shape == (len(prompts), h, w, 3)
    diff = int(np.abs(res.images.astype(int) - ref.astype(int)).max())
    assert diff <= MAX_UINT8_DIFF, diff
    assert res.images.std() > 1  # not a constant image


@pytest.mark.slow
def test_default_precision_engines_run_on_onnxruntime(tmp_path, tiny_schnell):
    """The shipped 4090 config (fp16 CLIP, bf16 T5/transformer, fp32 VAE) runs end to end on ONNX Runtime."""
    build_gpu(tiny_schnell, load_gpu("4090"), tmp_path, components=["clip", "t5", "transformer", "vae_decoder"])
    res = open_pipeline(tmp_path / "4090", backend="onnxruntime").generate(["a cat"], 256, 256, 2, seed=3)
    assert res.images.shape == (1, 256, 256, 3) and res.images.std() > 1
    assert len(res.timings.steps) == 2 and all(t > 0 for t in res.timings.steps)


@pytest.mark.parametrize("kwargs, message", [
    (dict(height=250), "height 250 is not a positive multiple of 16; use 256$"),
    (dict(width=1000), "width 1000 is not a positive multiple of 16; use 992 or 1008"),
    (dict(height=2048), "outside the engines' range 256..1536 px"),
    (dict(steps=0), "steps must be at least 1"),
    (dict(batch=5), "batch 5 is outside the engines' profile \\(1..4\\)"),
])
def test_request_errors(fp32_engines, kwargs, message):
    _, engines = fp32_engines("tiny-schnell")
    pipe = open_pipeline(engines, backend="onnxruntime")
    req = dict(batch=1, height=256, width=256, steps=2) | kwargs
    with pytest.raises(RequestError, match=message):
        pipe.check_request(**req)


def test_profile_check_of_an_executor(fp32_engines):
    _, engines = fp32_engines("tiny-schnell")
    ex = open_pipeline(engines, backend="onnxruntime").executors["transformer"]
    ex.check_shapes({"hidden_states": (2, 1024, 16)})
    with pytest.raises(ShapeError, match="outside the engine's profile \\[1, 256, 16\\]..\\[4, 9216, 16\\]"):
        ex.check_shapes({"hidden_states": (1, 10000, 16)})


def test_tensorrt_executor_refuses_without_gpu(fp32_engines, monkeypatch):
    _, engines = fp32_engines("tiny-schnell")
    monkeypatch.setattr("fluxtrt.core.backends.local_gpu_capabilities", lambda: [])
    with pytest.raises(BackendUnavailableError, match="needs an NVIDIA GPU.*--backend onnxruntime"):
        open_pipeline(engines, backend="tensorrt")


def test_tensorrt_executor_refuses_other_gpu_or_version(fp32_engines, monkeypatch):
    from fluxtrt.core.backends import TensorRTRTX
    from fluxtrt.records import read_manifest

    _, engines = fp32_engines("tiny-schnell")
    manifest = read_manifest(engines)
    monkeypatch.setattr("fluxtrt.core.backends.local_gpu_capabilities", lambda: ["8.6"])
    with pytest.raises(BackendUnavailableError, match="built for sm89 .* this GPU is sm86"):
        check_gpu_for(manifest, TensorRTRTX())
    monkeypatch.setattr("fluxtrt.core.backends.local_gpu_capabilities", lambda: ["8.9"])
    check_gpu_for(manifest, TensorRTRTX())  # right GPU, right version: accepted
    with pytest.raises(BackendUnavailableError, match="built by tensorrt-rtx .* but 0.0 is installed"):
        check_gpu_for(manifest, type("B", (), {"version": "0.0"})())


def test_corrupt_onnx_or_manifest_is_refused(fp32_engines, tmp_path):
    import json
    import shutil

    _, engines = fp32_engines("tiny-schnell")
    copy = tmp_path / "onnx"
    shutil.copytree(engines.parent / "onnx", copy)
    shutil.copytree(engines, tmp_path / "4090")
    from fluxtrt.records import read_manifest

    clip = tmp_path / read_manifest(tmp_path / "4090").components["clip"].onnx  # the ONNX it was built from (the
    clip.write_bytes(clip.read_bytes()[:-10])  # shared build root holds other dtypes' ONNX too)
    pipe = open_pipeline(tmp_path / "4090", backend="onnxruntime")
    with pytest.raises(ManifestError, match="does not match the manifest's sha256"):
        pipe.generate(["x"], 256, 256, 1)
    (tmp_path / "4090" / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="unreadable"):
        open_pipeline(tmp_path / "4090", backend="onnxruntime")
    (tmp_path / "4090" / "manifest.json").write_text(json.dumps({"schema": 99}))
    with pytest.raises(ManifestError, match="not a fluxtrt manifest"):
        open_pipeline(tmp_path / "4090", backend="onnxruntime")


def test_cli_run_writes_png(fp32_engines, tmp_path):
    """`run` writes PNGs with their settings, also when the engine folder is reached through a symbolic link (its
    ONNX is found in the linked build's root)."""
    from PIL import Image
    from typer.testing import CliRunner

    from fluxtrt.cli import app

    _, engines = fp32_engines("tiny-schnell")
    link = tmp_path.parent / f"{tmp_path.name}-engines-link"  # an engine folder reached through a symbolic link
    link.symlink_to(engines, target_is_directory=True)
    out = tmp_path / "img.png"
    res = CliRunner().invoke(app, ["run", "--prompt", "a cat", "--engines", str(link), "--height", "256",
                                   "--width", "384", "--batch", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    for i in range(2):
        img = Image.open(tmp_path / f"img-{i}.png")
        assert img.size == (384, 256)
        meta = img.text  # the settings travel with the image
        assert meta["prompt"] == "a cat" and meta["seed"] == "0" and meta["steps"] == "4" and meta["size"] == "384x256"
        assert meta["model"] == "tiny-schnell" and "transformer:" in meta["engines"] and meta["backend"] == "onnxruntime"
    assert "timings" in res.output and "step mean" in res.output
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("args, message", [
    (["--prompt", "   "], "the prompt is empty"),
    (["--prompt", "x", "--height", "100"], "not a positive multiple of 16"),
    (["--prompt", "x", "--batch", "0"], "--batch must be at least 1"),
    (["--prompt", "x", "--out", "x.jpg"], "must end in .png"),
    ([], "pass exactly one of --prompt"),
])
def test_cli_run_bad_input_is_one_line(fp32_engines, args, message):
    from typer.testing import CliRunner

    from fluxtrt.cli import app

    _, engines = fp32_engines("tiny-schnell")
    res = CliRunner().invoke(app, ["run", "--engines", str(engines), *args])
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output


def test_cli_prompts_file_not_utf8(fp32_engines, tmp_path):
    from typer.testing import CliRunner

    from fluxtrt.cli import app

    _, engines = fp32_engines("tiny-schnell")
    bad = tmp_path / "p.txt"
    bad.write_bytes(b"caf\xe9 au lait\n")
    res = CliRunner().invoke(app, ["run", "--engines", str(engines), "--prompts-file", str(bad)])
    assert res.exit_code == 2 and "is not UTF-8" in res.output


def test_tensorrt_executor_checks_engine_validity_before_loading(fp32_engines, tmp_path):
    """TensorRT-RTX's get_engine_validity reads the engine header without a GPU: here it says INVALID, and
    the executor refuses before deserializing."""
    from fluxtrt.core.backends import TensorRTRTX
    from fluxtrt.records import read_manifest
    from fluxtrt.runtime.tensorrt import TensorRTExecutor

    _, engines = fp32_engines("tiny-schnell")
    entry = read_manifest(engines).components["clip"]
    ex = TensorRTExecutor("clip", entry, engines / entry.engine, TensorRTRTX())
    with pytest.raises(BackendUnavailableError, match="says clip.engine cannot run on this machine \\(INVALID"):
        ex.activate()
    bad = tmp_path / "bad.engine"  # the engines folder is shared: nothing is written into it
    bad.write_bytes(b"x" * 100)
    with pytest.raises(ManifestError, match="does not match the manifest's size and sha256"):
        TensorRTExecutor("clip", entry, bad, TensorRTRTX()).activate()


def test_torch_executor_on_cpu_matches_diffusers(tiny_schnell):
    """The torch backend runs the same pipeline over the PyTorch modules (here fp32 on the CPU)."""
    prompts, h, w, steps, seed = ["a bowl of ramen"], 256, 384, 4, 5
    pipe = open_pipeline(None, backend="torch", model=tiny_schnell, torch_dtype="fp32", device="cpu")
    ours = pipe.generate(prompts, h, w, steps, seed=seed, trace=True)
    ref, latents = reference(tiny_schnell, prompts, h, w, steps, 3.5, seed)
    assert max(float((a - b).abs().max()) for a, b in zip(ours.latents_per_step, latents)) < 1e-4
    assert int(np.abs(ours.images.astype(int) - ref.astype(int)).max()) <= MAX_UINT8_DIFF


def test_fallback_mixes_engines_and_torch(fp32_engines):
    from fluxtrt.runtime.executors import OnnxRuntimeExecutor, TorchExecutor

    src, engines = fp32_engines("tiny-schnell")
    pipe = open_pipeline(engines, backend="onnxruntime", fallback=["transformer"], torch_dtype="fp32", device="cpu")
    assert isinstance(pipe.executors["transformer"], TorchExecutor)
    assert isinstance(pipe.executors["clip"], OnnxRuntimeExecutor)
    mixed = pipe.generate(["a cat"], 256, 256, 2, seed=4)
    plain = open_pipeline(engines, backend="onnxruntime").generate(["a cat"], 256, 256, 2, seed=4)
    assert int(np.abs(mixed.images.astype(int) - plain.images.astype(int)).max()) <= MAX_UINT8_DIFF
    with pytest.raises(Exception, match="--fallback takes"):
        open_pipeline(engines, backend="onnxruntime", fallback=["unet"])


def test_auto_backend_choice(fp32_engines, monkeypatch):
    from fluxtrt.runtime.choice import choose_backend

    def pick(requested="auto"):
        c = choose_backend(requested, engines)
        return c.backend, c.fallback

    _, engines = fp32_engines("tiny-schnell")
    monkeypatch.setattr("fluxtrt.core.backends.local_gpu_capabilities", lambda: [])
    assert pick() == ("onnxruntime", [])
    assert "ONNX Runtime" in choose_backend("auto", engines).notes[0]  # the choice is said, not silent
    monkeypatch.setattr("fluxtrt.core.backends.local_gpu_capabilities", lambda: ["9.0"])  # an H100/H200
    assert pick() == ("torch", [])  # TensorRT-RTX refuses sm90: PyTorch on the GPU
    monkeypatch.setattr("fluxtrt.core.backends.local_gpu_capabilities", lambda: ["8.9"])
    monkeypatch.setattr("torch.cuda.mem_get_info", lambda: (24 << 30, 24 << 30))
    assert pick() == ("tensorrt", [])
    assert pick("onnxruntime") == ("onnxruntime", [])  # an explicit choice is kept
    with pytest.raises(FluxtrtError, match="choose auto, tensorrt"):
        pick("tensorrtt")


def test_cli_bench_json_and_plot(fp32_engines, tmp_path):
    import json

    from typer.testing import CliRunner

    from fluxtrt.cli import app

    _, engines = fp32_engines("tiny-schnell")
    res = CliRunner().invoke(app, ["bench", "--engines", str(engines), "--backend", "onnxruntime", "--sizes", "256",
                                   "--batch", "1,2", "--steps", "2", "--runs", "2", "--warmup", "0",
                                   "--baseline", "diffusers", "--json", str(tmp_path / "b.json"),
                                   "--plot", str(tmp_path / "b.png")])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "b.json").read_text())
    rows = data["rows"]
    assert [r["system"] for r in rows] == ["fluxtrt (onnxruntime)", "diffusers"] * 2
    assert [r["batch"] for r in rows] == [1, 1, 2, 2]
    for ours, base in zip(rows[0::2], rows[1::2]):
        for key in ("text_encoders_s", "transformer_step_s", "vae_decode_s", "end_to_end_s"):
            assert 0 < ours[key]["min"] <= ours[key]["median"] <= ours[key]["max"]
            assert base[key]["median"] > 0
            assert ours["ratios"][key] == pytest.approx(base[key]["median"] / ours[key]["median"])
        assert ours["images_per_minute"] == pytest.approx(60 * ours["batch"] / ours["end_to_end_s"]["median"])
        assert 0 < ours["outside_transformer_share"] < 1
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert data["meta"]["backend"] == "onnxruntime" and data["meta"]["steps"] == 2


def test_engine_that_does_not_fit_falls_back_to_cpu(fp32_engines, monkeypatch):
    from fluxtrt.records import read_manifest
    from fluxtrt.runtime.choice import choose_backend
    from fluxtrt.runtime.executors import TorchExecutor

    _, engines = fp32_engines("tiny-schnell")
    manifest = read_manifest(engines)
    comps = manifest.components
    free = comps["vae_decoder"].bytes - 1  # the VAE decoder engine is 1 byte too big
    assert comps["transformer"].weight_streaming and comps["transformer"].bytes < free
    monkeypatch.setattr("fluxtrt.core.backends.local_gpu_capabilities", lambda: ["8.9"])
    monkeypatch.setattr("torch.cuda.mem_get_info", lambda: (free, 2 * free))
    choice = choose_backend("auto", engines)
    assert choice.backend == "tensorrt" and choice.fallback == ["vae_decoder@cpu"]
    monkeypatch.setattr("torch.cuda.mem_get_info", lambda: (1000, 2000))  # nothing fits...
    # ...but weight streaming lets the transformer run anyway
    assert "transformer@cpu" not in choose_backend("auto", engines).fallback
    pipe = open_pipeline(engines, backend="onnxruntime", fallback=["vae_decoder@cpu"], device="cpu")
    ex = pipe.executors["vae_decoder"]
    assert isinstance(ex, TorchExecutor) and ex.device.type == "cpu" and ex.dtype_name == "fp32"


def test_shared_activation_buffer_grows_to_the_largest_engine():
    """Buffer planning of the TensorRT executor (the logic runs on any device; on a GPU it is CUDA memory)."""
    from fluxtrt.runtime.tensorrt import SharedActivations

    shared = SharedActivations(device="cpu")
    p1 = shared.pointer(1000)
    assert shared.pointer(10) == p1 and shared.buffer.numel() == 1000  # smaller engines reuse it
    shared.pointer(5000)
    assert shared.buffer.numel() == 5000  # a larger engine grows it once
    assert shared.pointer(4000) == shared.pointer(5000)


def test_nan_from_a_component_is_reported_by_name(fp32_engines):
    from fluxtrt.runtime.pipeline import NonFiniteError

    _, engines = fp32_engines("tiny-schnell")
    pipe = open_pipeline(engines, backend="onnxruntime")
    ex = pipe.executors["t5"]
    orig = ex.infer
    ex.infer = lambda feeds: {k: v * float("nan") for k, v in orig(feeds).items()}
    with pytest.raises(NonFiniteError, match="t5 produced NaN/Inf .*--precision t5=bf16"):
        pipe.generate(["a cat"], 256, 256, 2)


def test_cli_refuses_an_onnx_runtime_provider_it_lacks(fp32_engines, tmp_path):
    """--ort-provider cuda with the CPU onnxruntime: one line naming the fix, exit 2, no image."""
    from typer.testing import CliRunner

    from fluxtrt.cli import app

    _, engines = fp32_engines("tiny-schnell")
    res = CliRunner().invoke(app, ["run", "--engines", str(engines), "--backend", "onnxruntime", "--ort-provider",
                                   "cuda", "--prompt", "a cat", "--steps", "1", "--out", str(tmp_path / "no.png")])
    assert res.exit_code == 2 and "--ort-provider cuda" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "no.png").exists()


def test_validate_command_checks_each_graph_against_pytorch(fp32_engines, tmp_path, reweighted_copy):
    """`fluxtrt validate`: every row at the profile's opt and min shapes, error within the component's bound,
    a reference beside it (fp32 graphs: the fp32 module against itself in fp64); against a model with other
    weights every row fails and the exit code is 1."""
    import json

    from typer.testing import CliRunner

    from fluxtrt.cli import app
    from fluxtrt.compare import bound_for

    src, engines = fp32_engines("tiny")
    comps = "t5,transformer,vae_decoder"
    res = CliRunner().invoke(app, ["validate", "--engines", str(engines), "-c", comps, "--json", str(tmp_path / "v.jsonl")])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in (tmp_path / "v.jsonl").read_text().splitlines()]
    manifest = json.loads((engines / "manifest.json").read_text())
    opt, lo = manifest["shape_range"]["opt"], manifest["shape_range"]["min"]
    assert [(r["component"], [r["batch"], r["height"], r["width"]]) for r in rows] == [
        (c, s) for c in comps.split(",") for s in (opt, [2, lo[1], lo[2]])]
    for r in rows:
        assert 0 < r["onnx_error"] <= bound_for(r["component"], "fp32", 1) and r["ok"] and r["reference"] >= 0
        # fp32 against exact: nonzero, well inside the fp32 bound (the VAE decoder: ~1e-5)
        assert r["reference_kind"] == "fp64" and 0 < r["reference"] <= 1e-4 and r["reference_mean"] > 0, r
    other = reweighted_copy(src, tmp_path / "other", seed=int(np.random.default_rng().integers(1, 1000)))
    res = CliRunner().invoke(app, ["validate", "--engines", str(engines), "-c", "transformer", "-m", str(other.path)])
    assert res.exit_code == 1 and "FAIL" in res.output
