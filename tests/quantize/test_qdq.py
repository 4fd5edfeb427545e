"""Quantization: Q/DQ recipes on the tiny transformer, their error and its sensitivity, calibration cache,
and TensorRT-RTX engines built from the quantized graphs."""

import copy

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from fluxtrt.components import ShapePoint, specs_for
from fluxtrt.optimize.graph import optimize_model
from fluxtrt.quantize.qdq import plan, quantize_model
from fluxtrt.records import CalibrationSettings  # noqa: E402

# max|quantized - fp32 graph| / max|fp32 graph| on fresh random inputs (tiny transformer, ONNX Runtime)
BOUNDS = {"fp8": 5e-2, "fp8-attn": 5e-2, "int8": 5e-2, "int8-wo": 2e-2, "int4-wo": 5e-2, "fp4": 5e-2}
# a layer whose error alone exceeds this many times the median quantized layer's would be kept in bf16
FP4_OUTLIER = 10.0
# the same, as built: everything the recipe leaves is placed in bf16 (bf16 alone is the reference row)
BUILT_BOUNDS = {"bf16": 1e-1, "fp8": 1e-1, "fp8-attn": 1e-1, "int8": 1e-1, "int8-wo": 1e-1, "int4-wo": 1e-1,
                "fp4": 1.5e-1}


@pytest.fixture(scope="module")
def fp32_transformer(exported):
    src, out, _ = exported("tiny")
    model, _ = optimize_model(onnx.load(str(out / "transformer.onnx")), None, "fp32", "transformer")
    return src, model


def _samples(src):
    spec = specs_for(src.geometry)["transformer"]
    return [{k: v.numpy() for k, v in spec.sample_inputs(ShapePoint(1, 64, 96), src.geometry, s).items()}
            for s in range(3)]


def _ranges(src, model, recipe="fp8-attn"):
    """(per-tensor, per-channel) ranges of every tensor the recipes quantize."""
    from fluxtrt.quantize.calibration import activation_ranges

    names = sorted(set(plan(model, recipe).calibration_inputs(model)) | set(plan(model, "fp4").calibration_inputs(model)))
    return activation_ranges(model, names, _samples(src), per_channel=True)


def _error(src, reference, candidate, seed=123):
    import onnxruntime as ort

    spec = specs_for(src.geometry)["transformer"]
    feeds = {k: v.numpy() for k, v in spec.sample_inputs(ShapePoint(2, 48, 80), src.geometry, seed).items()}
    from fluxtrt.core.sessions import upcast_bf16
    from fluxtrt.nvfp4 import emulate

    if any(t.data_type == onnx.TensorProto.FLOAT4E2M1 for t in candidate.graph.initializer):
        candidate = emulate(candidate)  # ONNX Runtime has no FP4 kernels: the recipe in standard ops
    candidate = upcast_bf16(copy.deepcopy(candidate))  # bf16 placement: bf16 weights and casts, run in fp32
    a = ort.InferenceSession(reference.SerializeToString()).run(None, feeds)[0]
    b = ort.InferenceSession(candidate.SerializeToString()).run(None, feeds)[0]
    return float(np.abs(a - b).max() / np.abs(a).max())


def test_plan_keeps_the_sensitive_layers(fp32_transformer):
    _, model = fp32_transformer
    p = plan(model, "fp8")
    reasons = sorted(p.kept.values())
    assert reasons.count("reads a model input (x_embedder / context_embedder)") == 2
    assert reasons.count("writes the model output (proj_out)") == 1
    assert len(p.quantized) >= 16 and not set(p.quantized) & set(p.kept)
    gemms = [n for n in model.graph.node if n.op_type == "Gemm"]
    assert gemms  # embedders and AdaLN modulation (2-D, once per sample) are Gemms and are never planned


@pytest.mark.parametrize("recipe", ["fp8", "fp8-attn", "int8", "int8-wo", "int4-wo", "fp4", "bf16"])
def test_recipe_error_is_bounded_and_the_check_is_sensitive(fp32_transformer, recipe):
    """The recipes' error against the fp32 graph (README's quantization table; bf16 placement alone as the
    reference), and a corrupted weight scale fails the same check."""
    from fluxtrt.optimize.placement import place_precision

    src, model = fp32_transformer
    amax, channel = _ranges(src, model)
    if recipe == "bf16":
        built = _error(src, model, place_precision(copy.deepcopy(model), "bf16", "transformer"))
        print(f"{recipe}: rel err vs fp32 graph, as built {built:.2e} (bound {BUILT_BOUNDS[recipe]:.0e})")
        assert 0 < built <= BUILT_BOUNDS[recipe]
        return
    q, p = quantize_model(copy.deepcopy(model), recipe, amax, channel_amax=channel, alpha=0.5)
    built = _error(src, model, place_precision(copy.deepcopy(q), "bf16", "transformer"))
    if recipe == "fp8-attn":
        assert len(p.attention) == 8  # q.k^T and p.v in each of the 4 blocks
    if recipe == "int8":
        assert sum(n.op_type == "Mul" and n.name.endswith("__smooth") for n in q.graph.node) == len(p.quantized)
    err = _error(src, model, q)
    print(f"{recipe}: rel err vs fp32 graph {err:.2e} (bound {BOUNDS[recipe]:.0e}), as built {built:.2e} "
          f"(bound {BUILT_BOUNDS[recipe]:.0e})")
    assert 0 < err <= BOUNDS[recipe] and 0 < built <= BUILT_BOUNDS[recipe]
    # corrupt the weight scale of one quantized layer (the last: no RMSNorm after it to cancel a scale):
    # the same check must fail
    ops = {n.name: n.op_type for n in q.graph.node}
    last = [m for m in p.quantized if ops[m] == "MatMul"][-1]  # a MatMul (fp4 also quantizes AdaLN Gemms)
    if recipe == "fp4":  # the weight's global scale (its E4M3 block scales multiply it)
        mm = next(n for n in q.graph.node if n.name == last)
        name = mm.input[1][: -len("_dq_t")] + "_f8_scale_f32_scale"
    else:
        name = next(n.input[1] for n in q.graph.node if n.name == f"{last}__w_dq")
    for t in q.graph.initializer:
        if t.name == name:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * 16, t.name))
    assert _error(src, model, q) > BOUNDS[recipe]


@pytest.mark.parametrize("recipe", ["fp8", "fp4"])
def test_sensitivity_names_what_degrades_most(fp32_transformer, recipe):
    """Quantize one layer at a time; the layers we keep in high precision are among the most sensitive, and
    (fp4) no other layer stands out: none above FP4_OUTLIER x the median of the quantized layers, the rule by
    which one would join the kept set."""
    from fluxtrt.quantize.calibration import activation_ranges
    from fluxtrt.quantize.qdq import sensitivity

    src, model = fp32_transformer
    p = plan(model, recipe)
    nodes = {n.name: n for n in model.graph.node}
    graph_inputs = {i.name for i in model.graph.input}
    names = sorted({nodes[m].input[0] for m in p.quantized + list(p.kept)} - graph_inputs)
    samples = _samples(src)
    amax = activation_ranges(model, names, samples)
    amax.update({k: float(np.abs(v).max()) for k, v in samples[0].items()})  # kept layers reading model inputs
    rows = sensitivity(model, amax, samples[:2], top=30, recipe=recipe)
    for err, node, why in rows:
        print(f"{recipe} {err:.2e}  {node}  {why}")
    errs = {node: err for err, node, _ in rows}
    kept = [node for _, node, why in rows if why]
    assert len(kept) == 3 and all(e > 0 for e in errs.values())
    median = sorted(errs.values())[len(errs) // 2]
    assert max(errs[k] for k in kept) > median  # x_embedder / context_embedder / proj_out: above the median
    quantized = sorted(e for _, n, why in rows for e in [errs[n]] if not why)
    assert quantized[-1] <= FP4_OUTLIER * quantized[len(quantized) // 2], quantized


def test_fp8_without_calibration_is_refused(fp32_transformer):
    from fluxtrt.errors import FluxtrtError

    _, model = fp32_transformer
    with pytest.raises(FluxtrtError, match="no calibrated range .* run `fluxtrt calibrate`"):
        quantize_model(copy.deepcopy(model), "fp8", {})


@pytest.mark.slow
def test_quantized_engines_build_and_calibration_is_cached(tiny_dev, tmp_path, fp8_attn_build):
    pytest.importorskip("tensorrt_rtx")
    from fluxtrt.gpus import load_gpu
    from fluxtrt.stages.build import build_gpu

    calib = CalibrationSettings(size=3, steps=2)
    for recipe in ("fp8", "fp8-attn", "int8-wo", "int4-wo"):
        cfg = load_gpu("4090").with_precision({"transformer": recipe})
        if recipe == "fp8-attn":  # the shared build (tests/test_fp8.py runs it on the torch executor)
            manifest = fp8_attn_build[2]
        else:
            manifest, results = build_gpu(tiny_dev, cfg, tmp_path, components=["transformer"], calibration=calib)
        e = manifest.components["transformer"]
        q = e.quantization
        assert e.precision == recipe and q["recipe"] == recipe and e.bytes > 10_000
        assert "writes the model output (proj_out)" in q["kept_in_high_precision"].values()
        assert set(e.stages) == {"export", "optimize", "quantize", "build"}  # the quantize stage timed apart
        assert e.stages["quantize"]["status"] == "built" and e.stages["quantize"]["seconds"] > 0
        if recipe == "fp8":
            assert q["calibration_cached"] is False and len(q["calibration"]) == 64
            first_key = q["calibration"]
    # a rebuild that must redo the optimize stage reuses the calibration cache...
    cfg = load_gpu("4090").with_precision({"transformer": "fp8"})
    manifest, _ = build_gpu(tiny_dev, cfg, tmp_path, components=["transformer"], force=True, calibration=calib)
    q = manifest.components["transformer"].quantization
    assert q["calibration_cached"] is True and q["calibration"] == first_key
    # ...and another prompt file invalidates it
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a teapot on a table\na mountain road at night\nan owl in the rain\n")
    manifest, results = build_gpu(tiny_dev, cfg, tmp_path, components=["transformer"],
                                  calibration=calib.replace(prompts_file=prompts))
    q = manifest.components["transformer"].quantization
    assert q["calibration_cached"] is False and q["calibration"] != first_key
    assert {(r.stage, r.status) for r in results} >= {("optimize", "built"), ("quantize", "built"), ("build", "built")}


@pytest.mark.slow
def test_cli_calibrate_caches(tmp_path):
    from typer.testing import CliRunner

    from fluxtrt.cli import app

    args = ["calibrate", "--model", "tiny-schnell", "--out", str(tmp_path), "--calibration-size", "2",
            "--calibration-steps", "1", "--resolution", "256"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "measured" in res.output and "activation ranges" in res.output
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0 and "reused the cache" in res.output


@pytest.mark.slow
def test_cli_calibrate_fills_the_cache_build_reads(tmp_path, tiny_schnell):
    """`fluxtrt calibrate` and `fluxtrt build --precision transformer=fp8` share one cache key."""
    pytest.importorskip("tensorrt_rtx")
    from typer.testing import CliRunner

    from fluxtrt.cli import app
    from fluxtrt.gpus import load_gpu
    from fluxtrt.stages.build import build_gpu

    cfg = load_gpu("4090").with_precision({"transformer": "fp8"})
    res = CliRunner().invoke(app, ["calibrate", "--model", "tiny-schnell", "--out", str(tmp_path),
                                   "--calibration-size", "2", "--calibration-steps", "1",
                                   "--resolution", str(cfg.resolution[1])])
    assert res.exit_code == 0 and "measured" in res.output, res.output
    manifest, _ = build_gpu(tiny_schnell, cfg, tmp_path, components=["transformer"],
                            calibration=CalibrationSettings(size=2, steps=1))
    assert manifest.components["transformer"].quantization["calibration_cached"] is True
