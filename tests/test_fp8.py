"""The build's fp8 recipe on the torch executor (fluxtrt/fp8.py): the scales an fp8 graph recorded equal the ones a
calibration gives the PyTorch module; the torch executor's transformer matches the fp8 graph in ONNX Runtime; the
torch._scaled_mm layers compute the emulated recipe; images match ONNX Runtime's on the same engines and differ
from the unquantized ones; what cannot run is one line."""

import numpy as np
import onnx
import pytest
import torch
from typer.testing import CliRunner

from fluxtrt import fp8
from fluxtrt.cli import app
from fluxtrt.components import ShapePoint, specs_for
from fluxtrt.records import read_manifest

MAX_UINT8_DIFF = 2  # images: within 2/255


def graph_of(root):
    manifest = read_manifest(root / "4090")
    return root / manifest.components["transformer"].onnx


def calibration_of(src, root, calib):
    from fluxtrt.stages.zerocopy_plan import calibrate_zero_copy

    cal = calibrate_zero_copy(src, root, calib)
    assert cal.cached  # the build's own calibration
    return cal


def test_scales_from_the_graph_equal_scales_from_the_calibration(fp8_build):
    """The recipe without a graph (calibrate, then run) is the recipe the graph holds: same layers, same groups
    (fused q/k/v share a weight scale), same bf16 scales, bit for bit."""
    src, _, root, _, _, _, calib = fp8_build
    from_graph = fp8.scales_from_graph(onnx.load(str(graph_of(root)), load_external_data=False))
    spec = specs_for(src.geometry, ["transformer"])["transformer"]
    raw = src.load_component("transformer", torch.float32, "cpu").eval()
    feeds = spec.sample_inputs(ShapePoint(1, 64, 64), src.geometry, 0)
    groups = fp8.linear_groups(spec.wrap(raw), [feeds[t.name] for t in spec.inputs if t.name in feeds], root=raw)
    from_cal = fp8.scales_from_calibration(raw, calibration_of(src, root, calib).amax, groups)
    assert from_graph == from_cal and len(from_graph) > 20
    assert not any(k.split(".")[0] in fp8.KEPT or "norm" in k or "time_text_embed" in k for k in from_graph)
    assert any(len(g) == 4 for g in groups) and any(len(g) == 3 for g in groups)  # single: q/k/v/mlp; double: q/k/v


def test_torch_executor_transformer_matches_the_fp8_graph(fp8_build):
    """One transformer call: the torch executor (emulated recipe, fp32) against the fp8 graph in ONNX Runtime
    (CPU: computed in fp32) within the fake-quant bound of `fluxtrt validate`, on fresh random inputs; the
    unquantized module is far outside it."""
    from fluxtrt.compare import bound_for, fake_quant_bound
    from fluxtrt.runtime.executors import OnnxRuntimeExecutor, TorchExecutor

    src, _, root, manifest, *_ = fp8_build
    spec = specs_for(src.geometry, ["transformer"])["transformer"]
    entry = manifest.components["transformer"]
    seed = int(np.random.default_rng().integers(1 << 30))
    feeds = spec.sample_inputs(ShapePoint(2, 256, 256), src.geometry, seed)
    out = spec.outputs[0].name
    ort = OnnxRuntimeExecutor("transformer", entry, graph_of(root), spec, src.geometry, provider="cpu").infer(feeds)[out].float()
    scales = fp8.scales_from_graph(onnx.load(str(graph_of(root)), load_external_data=False))
    ex = TorchExecutor("transformer", src, spec, "cpu", "fp32", fp8={"scales": scales})
    got = ex.infer(feeds)[out].float()
    plain = TorchExecutor("transformer", src, spec, "cpu", "fp32").infer(feeds)[out].float()
    rel = lambda a, b: float((a - b).abs().mean() / b.abs().mean())  # noqa: E731
    bound = fake_quant_bound(bound_for("transformer", "fp32", spec.rtol_fp32), rel(plain, ort))
    assert rel(got, ort) <= bound and rel(got, ort) * 20 <= rel(plain, ort), (seed, rel(got, ort), rel(plain, ort))
    assert "emulated" in ex.fp8_note


@pytest.mark.slow
def test_run_torch_fp8_equals_onnxruntime_and_the_calibrated_route(fp8_build, tmp_path):
    """`fluxtrt run --backend torch` on fp8 engines matches `--backend onnxruntime` on them within 2/255 (PyTorch
    in fp32, as ONNX Runtime computes on a CPU), differs from the unquantized transformer, and `--model M
    --calibration FILE` (calibrate, then run: no engines) gives the same image bit for bit."""
    from PIL import Image

    src, _, root, _, _, _, calib = fp8_build
    engines = root / "4090"
    common = ["--prompt", "a red fox in the snow", "--steps", "3", "--height", "256", "--width", "320",
              "--torch-dtype", "fp32", "--seed", str(int(np.random.default_rng().integers(1000)))]
    images = {}
    for name, args in {"torch": ["--engines", engines, "--backend", "torch"],
                       "onnxruntime": ["--engines", engines, "--backend", "onnxruntime"],
                       "calibrated": ["--model", src.path, "--backend", "torch", "--calibration",
                                      calibration_of(src, root, calib).path],
                       "plain": ["--model", src.path, "--backend", "torch"]}.items():
        res = CliRunner().invoke(app, ["run", *map(str, args), *common, "--out", str(tmp_path / f"{name}.png")])
        assert res.exit_code == 0, res.output
        assert ("fp8 recipe emulated" in res.output) == (name in ("torch", "calibrated")), res.output
        images[name] = np.asarray(Image.open(tmp_path / f"{name}.png")).astype(int)
    diff = lambda a, b: int(np.abs(images[a] - images[b]).max())  # noqa: E731
    assert diff("torch", "onnxruntime") <= MAX_UINT8_DIFF, diff("torch", "onnxruntime")
    assert diff("torch", "calibrated") == 0
    mean = lambda a, b: float(np.abs(images[a] - images[b]).mean())  # noqa: E731
    # it really quantizes: further from the unquantized image than from ONNX Runtime's fp8 one (tiny's VAE makes
    # pixel differences small; test_torch_executor_transformer_matches_the_fp8_graph sees the transformer's 20x)
    assert mean("torch", "plain") > 1.5 * mean("torch", "onnxruntime") > 0, (mean("torch", "plain"),
                                                                          mean("torch", "onnxruntime"))


def test_what_the_torch_executor_cannot_run_is_one_line(fp8_build, tmp_path):
    import json
    import shutil

    src, _, root, *_ = fp8_build
    other = tmp_path / "4090"
    shutil.copytree(root / "4090", other)
    shutil.copytree(root / "onnx", tmp_path / "onnx", symlinks=True)
    base = ["run", "--prompt", "x", "--steps", "1", "--out", str(tmp_path / "o.png")]
    res = CliRunner().invoke(app, [*base, "--engines", str(other), "--backend", "torch", "--calibration", "c.json"])
    assert res.exit_code == 2 and "already holds its scales" in res.output, res.output
    m = json.loads((other / "manifest.json").read_text())
    m["components"]["transformer"]["precision"] = "fp4"
    (other / "manifest.json").write_text(json.dumps(m))
    res = CliRunner().invoke(app, [*base, "--engines", str(other), "--backend", "torch"])
    assert res.exit_code == 2 and "not fp4" in res.output and "Traceback" not in res.output, res.output
    (tmp_path / "cal.json").write_text(json.dumps({"method": "linear-inputs", "model_hash": "0" * 64, "amax": {}}))
    res = CliRunner().invoke(app, [*base, "--model", str(src.path), "--backend", "torch", "--calibration",
                                   str(tmp_path / "cal.json")])
    assert res.exit_code == 2 and "another model" in res.output, res.output
    res = CliRunner().invoke(app, [*base, "--model", str(src.path), "--backend", "onnxruntime", "--calibration",
                                   str(tmp_path / "cal.json")])
    assert res.exit_code == 2 and "--backend torch" in res.output, res.output
    assert not (tmp_path / "o.png").exists()


# --- fp8-attn: attention's MatMul inputs in E4M3 too ------------------------------------------------------------

def test_torch_executor_computes_the_fp8_attn_graph(fp8_attn_build):
    """One transformer call on fresh random inputs: the torch executor with the fp8-attn recipe (emulated, fp32)
    against the fp8-attn graph in ONNX Runtime, within the fake-quant bound and 4x closer than the same executor
    with the linear layers' fp8 alone (which leaves attention unquantized; 7x to over 10x over the seeds seen).
    The manifest records the attention scales the graph holds (an unpacked archive has them), one quadruple per
    attention."""
    from fluxtrt.compare import bound_for, fake_quant_bound
    from fluxtrt.onnxio import load_header
    from fluxtrt.runtime.assembly import built_onnx
    from fluxtrt.runtime.executors import OnnxRuntimeExecutor, TorchExecutor

    src, folder, manifest = fp8_attn_build
    spec = specs_for(src.geometry, ["transformer"])["transformer"]
    entry = manifest.components["transformer"]
    header = load_header(built_onnx(folder, entry))
    attention = fp8.attention_scales_from_graph(header)
    assert entry.recipe["name"] == "fp8-attn" and entry.recipe["attention"] == [list(a) for a in attention]
    assert len(attention) == 4 and all(0 < s < 1 for a in attention for s in a)  # tiny: 2 double + 2 single blocks
    seed = int(np.random.default_rng().integers(1 << 30))
    feeds = spec.sample_inputs(ShapePoint(2, 256, 256), src.geometry, seed)
    out = spec.outputs[0].name
    ort = OnnxRuntimeExecutor("transformer", entry, built_onnx(folder, entry), spec, src.geometry,
                              provider="cpu").infer(feeds)[out].float()
    scales = fp8.scales_from_record(entry.recipe)
    rel = lambda a, b: float((a - b).abs().mean() / b.abs().mean())  # noqa: E731
    ex = TorchExecutor("transformer", src, spec, "cpu", "fp32", fp8={"scales": scales, "attention": attention})
    got = rel(ex.infer(feeds)[out].float(), ort)
    linear_only = rel(TorchExecutor("transformer", src, spec, "cpu", "fp32", fp8={"scales": scales}).infer(feeds)[out]
                      .float(), ort)
    plain = rel(TorchExecutor("transformer", src, spec, "cpu", "fp32").infer(feeds)[out].float(), ort)
    bound = fake_quant_bound(bound_for("transformer", "fp32", spec.rtol_fp32), plain)
    assert got <= bound and got * 4 <= linear_only, (seed, got, linear_only, plain)
    assert "attention in E4M3" in ex.fp8_note


@pytest.mark.slow
def test_run_torch_fp8_attn_equals_onnxruntime_and_differs_from_fp8(fp8_attn_build, tmp_path):
    """`fluxtrt run --backend torch` on fp8-attn engines (PyTorch in fp32) equals `--backend onnxruntime` on them
    within 2/255; the final latents of the same run with the linear layers' fp8 alone (attention unquantized)
    differ from it (tiny's VAE squeezes that into a fraction of a pixel level)."""
    from PIL import Image

    from fluxtrt.runtime.assembly import open_pipeline

    _, folder, manifest = fp8_attn_build
    seed = int(np.random.default_rng().integers(1000))
    common = ["--prompt", "a red fox in the snow", "--steps", "3", "--height", "256", "--width", "320",
              "--torch-dtype", "fp32", "--seed", str(seed)]
    images = {}
    for backend in ("torch", "onnxruntime"):
        res = CliRunner().invoke(app, ["run", "--engines", str(folder), "--backend", backend, *common, "--out",
                                       str(tmp_path / f"{backend}.png")])
        assert res.exit_code == 0, res.output
        assert ("attention in E4M3 emulated" in res.output) == (backend == "torch"), res.output
        images[backend] = np.asarray(Image.open(tmp_path / f"{backend}.png")).astype(int)
    assert np.abs(images["torch"] - images["onnxruntime"]).max() <= MAX_UINT8_DIFF

    latents = {}  # both in PyTorch (fp32): ONNX Runtime's bf16 engine draws its starting noise in bf16
    for name in ("fp8-attn", "fp8"):
        pipe = open_pipeline(folder, backend="torch", torch_dtype="fp32")
        if name == "fp8":
            pipe.executors["transformer"].fp8 = {"scales": fp8.scales_from_record(manifest.components["transformer"].recipe)}
        latents[name] = pipe.generate(["a red fox in the snow"], 256, 320, 3, 3.5, seed=seed,
                                      trace=True).latents_per_step[-1].float()
    rel = float((latents["fp8-attn"] - latents["fp8"]).abs().mean() / latents["fp8"].abs().mean())
    assert rel > 1e-4, rel  # 1.3e-3 seen: the attention recipe acts on the whole run


@pytest.mark.slow
def test_calibrate_fp8_attn_then_run_torch(tmp_path):
    """`fluxtrt calibrate --recipe fp8-attn` (the PyTorch path: ranges by module and by attention) then `fluxtrt run
    --backend torch --calibration FILE` computes fp8-attn (the note says so) and its image differs from the fp8
    calibration's; a file whose attention ranges are damaged is one line."""
    import json

    from PIL import Image

    files = {}
    for recipe in ("fp8", "fp8-attn"):
        res = CliRunner().invoke(app, ["calibrate", "--model", "tiny", "--out", str(tmp_path), "--recipe", recipe,
                                       "--calibration-size", "2", "--calibration-steps", "1", "--resolution", "256"])
        assert res.exit_code == 0, res.output
        files[recipe] = next(p for p in (tmp_path / "calibration").glob("*.json")  # the ranges by module
                             if json.loads(p.read_text())["recipe"] == recipe
                             and json.loads(p.read_text()).get("method") == "linear-inputs")
    assert len(json.loads(files["fp8-attn"].read_text())["attention_amax"]) == 4
    images = {}
    for recipe, path in files.items():
        res = CliRunner().invoke(app, ["run", "--model", "tiny", "--backend", "torch", "--calibration", str(path),
                                       "--prompt", "a fox", "--steps", "2", "--height", "256", "--width", "256",
                                       "--torch-dtype", "fp32", "--out", str(tmp_path / f"{recipe}.png")])
        assert res.exit_code == 0, res.output
        assert ("attention in E4M3 emulated in 4 attentions" in res.output) == (recipe == "fp8-attn"), res.output
        images[recipe] = np.asarray(Image.open(tmp_path / f"{recipe}.png")).astype(int)
    assert np.abs(images["fp8"] - images["fp8-attn"]).max() > 0
    data = json.loads(files["fp8-attn"].read_text())
    data["attention_amax"][1] = [1.0, "x", 1.0, 1.0]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    res = CliRunner().invoke(app, ["run", "--model", "tiny", "--backend", "torch", "--calibration",
                                   str(tmp_path / "bad.json"), "--prompt", "a fox", "--out", str(tmp_path / "o.png")])
    assert res.exit_code == 2 and "holds no ranges by module" in res.output and "Traceback" not in res.output
