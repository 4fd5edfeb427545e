"""NVFP4 weights (nvfp4.py): the bytes written dequantize, in ONNX's own reference implementation, to
the recipe's fake-quant bit for bit; values are the nearest E2M1 points; a corrupted block scale is caught;
TensorRT-RTX builds the ModelOpt NVFP4 form for sm120 on this CPU (slow)."""

import json

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx.reference import ReferenceEvaluator

from fluxtrt import nvfp4
from fluxtrt.errors import FluxtrtError

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def random_weight(rng, out=48, inp=96):
    """Gaussian weights with an outlier and an all-zero block, as real layers have."""
    w = (rng.standard_normal((out, inp)) * rng.uniform(0.01, 0.1)).astype(np.float32)
    w[int(rng.integers(out)), int(rng.integers(inp))] = np.float32(rng.uniform(1, 4))
    w[int(rng.integers(out)), :16] = 0
    return w


def dequantize_graph(q, name="w"):
    g = h.make_graph(nvfp4.dequantize_nodes(name, "y"), "nvfp4", [],
                     [h.make_tensor_value_info("y", T.FLOAT, list(q.shape))], list(nvfp4.onnx_tensors(q, name)))
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 23)])
    onnx.checker.check_model(model)
    return model


def test_written_bytes_dequantize_like_onnx_reference_bit_for_bit():
    rng = np.random.default_rng()
    for shape in ((48, 96), (16, 16), (64, 256)):
        w = random_weight(rng, *shape)
        q = nvfp4.quantize(w)
        fake = nvfp4.fake_quant(w)
        ref = ReferenceEvaluator(dequantize_graph(q)).run(None, {})[0]
        assert ref.dtype == np.float32 and np.array_equal(ref.view(np.uint32), fake.view(np.uint32))
        assert np.isfinite(fake).all() and q.packed.size == w.size // 2 and q.scales.shape == (shape[0], shape[1] // 16)
        nvfp4.check_written(q, fake)


def test_values_are_the_nearest_e2m1_points_and_error_is_bounded():
    rng = np.random.default_rng()
    w = random_weight(rng, 64, 128)
    q = nvfp4.quantize(w)
    fake = nvfp4.fake_quant(w)
    codes = np.empty(w.size, np.uint8)
    codes[0::2], codes[1::2] = q.packed & 0x0F, q.packed >> 4
    magnitude = E2M1[codes & 7].reshape(w.shape)  # what each stored code means
    step = np.repeat(q.scales.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * q.global_scale, 16, 1)
    target = np.clip(np.divide(np.abs(w), step, out=np.zeros_like(w), where=step > 0), 0, 6)
    nearest = np.abs(target[..., None] - E2M1).min(-1)
    assert (np.abs(magnitude - target) <= nearest + 1e-5 * np.maximum(target, 1)).all()  # the nearest E2M1 point
    assert ((codes >> 3).reshape(w.shape)[magnitude > 0] == (w[magnitude > 0] < 0)).all()  # and its sign
    rel = float(np.abs(fake - w).mean() / np.abs(w).mean())
    assert rel < 0.12, rel  # 4-bit with block-16 scales: ~0.09 on Gaussian weights


def test_a_corrupted_block_scale_fails_the_check():
    rng = np.random.default_rng()
    w = random_weight(rng)
    q = nvfp4.quantize(w)
    expected = nvfp4.fake_quant(w)
    row, block = int(rng.integers(q.scales.shape[0])), int(rng.integers(q.scales.shape[1]))
    while q.scales[row, block] == 0:  # a block that holds values
        row, block = int(rng.integers(q.scales.shape[0])), int(rng.integers(q.scales.shape[1]))
    q.scales[row, block] ^= 0x08
    with pytest.raises(FluxtrtError, match=f"\\[{row}, \\d+\\] \\(block {block}\\).*corrupt"):
        nvfp4.check_written(q, expected)
    with pytest.raises(FluxtrtError, match="multiple of 16"):
        nvfp4.quantize(np.ones((4, 20), np.float32))


def test_onnxruntime_dequantizes_fp4_where_it_can():
    """ONNX Runtime 1.32's CPU provider has no blocked FP4 DequantizeLinear (NOT_IMPLEMENTED): then the graph's
    weights are checked with onnx.reference above; where it has one, it must agree bit for bit."""
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng()
    w = random_weight(rng)
    q = nvfp4.quantize(w)
    try:
        sess = ort.InferenceSession(dequantize_graph(q).SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001
        if "NOT_IMPLEMENTED" in str(e) or "NotImplemented" in type(e).__name__:
            pytest.skip(f"ONNX Runtime {ort.__version__} cannot run FP4 DequantizeLinear: {str(e)[:120]}")
        raise
    out = sess.run(None, {})[0]
    assert np.array_equal(out.view(np.uint32), nvfp4.fake_quant(w).view(np.uint32))


@pytest.mark.slow
def test_tensorrt_rtx_builds_nvfp4_matmul_for_sm120_only():
    """Weights through nvfp4.py, activations through TRT_FP4DynamicQuantize: an sm120 engine on this
    CPU; sm89 refuses (fp4 is Blackwell-only)."""
    trt = pytest.importorskip("tensorrt_rtx")
    rng = np.random.default_rng()
    m, k, n = 32, 64, 48
    q = nvfp4.quantize(random_weight(rng, n, k))
    nodes = nvfp4.dequantize_nodes("w", "w_dq") + [
        h.make_node("Transpose", ["w_dq"], ["w_t"], perm=[1, 0]),
        h.make_node("TRT_FP4DynamicQuantize", ["x", "x_g"], ["x_f4", "x_s_f8"], domain="trt", axis=-1, block_size=16,
                    scale_type=T.FLOAT8E4M3FN),
        h.make_node("DequantizeLinear", ["x_s_f8", "x_g"], ["x_s"]),
        h.make_node("DequantizeLinear", ["x_f4", "x_s"], ["x_dq"], axis=-1, block_size=16),
        h.make_node("MatMul", ["x_dq", "w_t"], ["y"])]
    g = h.make_graph(nodes, "nvfp4", [h.make_tensor_value_info("x", T.FLOAT, [m, k])],
                     [h.make_tensor_value_info("y", T.FLOAT, [m, n])],
                     [*nvfp4.onnx_tensors(q, "w"), h.make_tensor("x_g", T.FLOAT, [], [4.0 / (6 * 448)])])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 23), h.make_opsetid("trt", 1)])
    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    net = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(net, logger)
    assert parser.parse(model.SerializeToString()), [str(parser.get_error(i)) for i in range(parser.num_errors)]
    sizes = {}
    for cc in ("SM120", "SM89"):
        config = builder.create_builder_config()
        config.num_compute_capabilities = 1
        config.set_compute_capability(getattr(trt.ComputeCapability, cc), 0)
        plan = builder.build_serialized_network(net, config)
        sizes[cc] = None if plan is None else plan.nbytes
    assert sizes["SM120"] and sizes["SM120"] > 10_000 and sizes["SM89"] is None, sizes


def fp4_matmul_model(q, x_global, k, n, dtype=T.FLOAT):
    """x [-1, k] -> NVFP4 activation (TRT_FP4DynamicQuantize) @ NVFP4 weight^T, in the recipe's graph form."""
    scale_dtype = ml_dtypes.bfloat16 if dtype == T.BFLOAT16 else np.float32
    act, x_dq = nvfp4.activation_nodes("x", "act", "x_g")
    nodes = nvfp4.dequantize_nodes("w", "w_dq") + [h.make_node("Transpose", ["w_dq"], ["w_t"], perm=[1, 0])] + act \
        + [h.make_node("MatMul", [x_dq, "w_t"], ["y"])]
    inits = [*nvfp4.onnx_tensors(q, "w", scale_dtype),
             onnx.numpy_helper.from_array(np.asarray(x_global, np.float32).astype(scale_dtype), "x_g")]
    g = h.make_graph(nodes, "nvfp4", [h.make_tensor_value_info("x", dtype, [-1, k])],
                     [h.make_tensor_value_info("y", dtype, [-1, n])], inits)
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 19)])
    nvfp4.ensure_opsets(model)
    return model


def test_emulated_graph_computes_the_recipe():
    """ONNX Runtime runs `emulate`'s copy of an NVFP4 graph: equal to the numpy recipe (activation fake-quant per
    block of 16 with an E4M3 scale, E2M1 rounding with ties to even, dequantized weights) within fp32 rounding of
    the matmul; ties and all-zero blocks included."""
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng()
    k, n = 64, 48
    q = nvfp4.quantize(random_weight(rng, n, k))
    x = (rng.standard_normal((24, k)) * rng.uniform(0.5, 3)).astype(np.float32)
    x[0, :16] = 0  # a block of zeros
    x[1, :16] = np.repeat(np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]), 2)  # E2M1 ties, scale 1
    g = nvfp4.global_scale_of(float(np.abs(x).max()))
    model = nvfp4.emulate(fp4_matmul_model(q, g, k, n))
    assert not {n.op_type for n in model.graph.node} & {"TRT_FP4DynamicQuantize", "DequantizeLinear"}
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    xq = nvfp4.fake_quant_activation(x, g)
    want = xq @ nvfp4.dequantize(q).T
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert not xq[0, :16].any()
    # the rounding itself, on the values chosen as ties: half-way points go to the even E2M1 code
    tie_x = np.repeat(np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]), 2)[None]
    assert np.array_equal(nvfp4.fake_quant_activation(tie_x, 1 / 448)[0, ::2], np.float32([0, 1, 1, 2, 2, 4, 4, 6]))


def torch_nvfp4(w: "torch.Tensor") -> "torch.Tensor":  # noqa: F821
    """An independent PyTorch fake-quant of the recipe: bf16 global scale, E4M3 block scales, E2M1 on its three
    rounding grids (torch.round is half-to-even)."""
    import torch

    w = w.float()
    out, inp = w.shape
    g = (w.abs().max() / (6 * 448)).to(torch.bfloat16).float()
    blocks = w.reshape(out, inp // 16, 16)
    step = (blocks.abs().amax(-1) / 6 / g).clamp(max=448).to(torch.float8_e4m3fn).float() * g
    q = torch.where(step[..., None] > 0, blocks / step[..., None], torch.zeros(())).clamp(-6, 6)
    e2m1 = torch.where(q.abs() < 2, torch.round(q * 2) / 2, torch.where(q.abs() < 4, torch.round(q), torch.round(q / 2) * 2))
    return (e2m1 * step[..., None]).reshape(out, inp)


@pytest.fixture(scope="module")
def fp4_zero_copy(tiny_bf16, tmp_path_factory):
    pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx not installed (pip install -e '.[rtx]')")
    from fluxtrt.gpus import load_gpu
    from fluxtrt.records import CalibrationSettings
    from fluxtrt.stages.build import build_gpu

    root = tmp_path_factory.mktemp("fp4-zc")
    cfg = load_gpu("5090").with_precision({"transformer": "fp4"})
    manifest, _ = build_gpu(tiny_bf16, cfg, root, components=["transformer"], calibration=CalibrationSettings(size=3, steps=2))
    return tiny_bf16, root, manifest


def test_fp4_from_a_bf16_checkpoint_is_the_recipe_bit_for_bit(fp4_zero_copy):
    """The zero-copy fp4 build (sm120 engine from the bf16 checkpoint): every NVFP4 weight in the file
    dequantizes to the PyTorch fake-quant of its checkpoint tensors (fused projections: their parts joined)
    bit for bit; codes and block scales live in transformer.onnx.data, the rest stays linked; validated
    against fp32 PyTorch (activations emulated) within the fp4 bound."""
    import torch
    from safetensors.torch import load_file

    from fluxtrt.compare import bound_for
    from fluxtrt.onnxio import external_info, load_onnx
    from fluxtrt.quantize.qdq import linear_weight

    src, root, manifest = fp4_zero_copy
    e = manifest.components["transformer"]
    assert e.precision == "fp4" and manifest.compute_capability == "12.0" and e.bytes > 10_000
    q = e.quantization
    assert q["recipe"] == "fp4" and q["path"] == "zero-copy" and q["quantized_layers"] == 26  # 20 MatMuls + 6 AdaLN Gemms
    opt = json.loads((root / e.onnx).with_name("optimize.json").read_text())["components"]["transformer"]
    assert 0 < opt["max_rel_err"] <= bound_for("transformer", "fp4", 0.0)
    path = root / e.onnx
    header = onnx.load(str(path), load_external_data=False)
    f4 = [t for t in header.graph.initializer if t.data_type == T.FLOAT4E2M1]
    assert len(f4) == 26 and all(external_info(t)["location"] == "transformer.onnx.data" for t in f4)
    assert {n.op_type for n in header.graph.node} >= {"TRT_FP4DynamicQuantize", "DequantizeLinear"}
    model = load_onnx(path)
    inits = {t.name: t for t in model.graph.initializer}
    zc = onnx.load(str(next((root / "onnx").glob("*-bf16-zc-opt")) / "transformer.onnx"), load_external_data=False)
    zc_inits = {t.name: t for t in zc.graph.initializer}
    zc_producers = {o: n for n in zc.graph.node for o in n.output}
    sd = load_file(next((src.path / "transformer").glob("*.safetensors")))
    checked = 0
    for n in zc.graph.node:
        parts = linear_weight(n, zc_inits, zc_producers) if n.op_type in ("MatMul", "Gemm") else None
        if parts is None or f"{parts[0][0]}__fp4_f4" not in inits:
            continue
        name = f"{parts[0][0]}__fp4"
        t4, t8, tg = inits[f"{name}_f4"], inits[f"{name}_f8_scale"], inits[f"{name}_f8_scale_f32_scale"]
        written = nvfp4.dequantize(nvfp4.NVFP4Weight(
            np.frombuffer(t4.raw_data, np.uint8), np.frombuffer(t8.raw_data, np.uint8).reshape(tuple(t8.dims)),
            np.float32(onnx.numpy_helper.to_array(tg).astype(np.float32)), tuple(t4.dims)))
        want = torch_nvfp4(torch.cat([sd[k] for k in parts[0]], 0)).numpy()
        assert np.array_equal(written.view(np.uint32), want.view(np.uint32)), name
        checked += 1
    assert checked == 26


def test_fp4_needs_blackwell_and_says_fp8_otherwise(tmp_path):
    from typer.testing import CliRunner

    from fluxtrt.cli import app

    res = CliRunner().invoke(app, ["build", "--gpu", "4090", "--model", "tiny", "-c", "transformer", "-p",
                                   "transformer=fp4", "-o", str(tmp_path)])
    assert res.exit_code == 2 and "use fp8" in res.output and "Traceback" not in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and not (tmp_path / "onnx").exists()


@pytest.mark.slow
def test_tiny_fp4_engine_for_5090_from_the_cli(tmp_path):
    """The README's command: a real sm120 NVFP4 engine of `tiny` (fp32 path), built on this CPU."""
    pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx not installed (pip install -e '.[rtx]')")
    from typer.testing import CliRunner

    from fluxtrt.cli import app
    from fluxtrt.records import read_manifest

    res = CliRunner().invoke(app, ["build", "--gpu", "5090", "--model", "tiny", "-c", "transformer", "-p",
                                   "transformer=fp4", "-o", str(tmp_path), "--calibration-size", "2",
                                   "--calibration-steps", "1"])
    assert res.exit_code == 0, res.output
    m = read_manifest(tmp_path / "5090-fp4")
    e = m.components["transformer"]
    assert m.compute_capability == "12.0" and e.precision == "fp4" and e.quantization["recipe"] == "fp4"
    assert (tmp_path / "5090-fp4" / e.engine).stat().st_size == e.bytes > 10_000
    header = onnx.load(str(tmp_path / e.onnx), load_external_data=False)
    assert sum(t.data_type == T.FLOAT4E2M1 for t in header.graph.initializer) == e.quantization["quantized_layers"]


# `fluxtrt run --backend onnxruntime` on fp4 engines (the emulated graph) against diffusers in fp32, tiny, 3
# steps at 256x320: the whole pipeline's latents and image differ by the recipe's error only. Measured (two
# runs, 2026-12-01): latents max |diff| / max |ref| 6.8e-3, 1.3e-2, 2.3e-2 by step; image mean |diff| 0.86/255.
# Bounds ~2.5x that:
FP4_LATENT_REL, FP4_IMAGE_MEAN = 6e-2, 2.0


@pytest.mark.slow
def test_fp4_engines_run_on_onnx_runtime_close_to_diffusers(tmp_path):
    pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx not installed (pip install -e '.[rtx]')")
    from fluxtrt.gpus import load_gpu
    from fluxtrt.models.source import resolve_model
    from fluxtrt.records import CalibrationSettings
    from fluxtrt.runtime.assembly import open_pipeline
    from fluxtrt.stages.build import build_gpu
    from tests.runtime.test_pipeline import reference

    src = resolve_model("tiny")
    cfg = load_gpu("5090").with_precision({"transformer": "fp4"})
    build_gpu(src, cfg, tmp_path, components=["clip", "t5", "transformer", "vae_decoder"],
              calibration=CalibrationSettings(size=3, steps=2))
    seed = int(np.random.default_rng().integers(0, 2**31))
    ref, ref_latents = reference(src, ["a red fox in the snow"], 256, 320, 3, 3.5, seed)
    pipe = open_pipeline(tmp_path / cfg.key, backend="onnxruntime")
    res = pipe.generate(["a red fox in the snow"], 256, 320, 3, 3.5, seed=seed, trace=True)
    errs = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(res.latents_per_step, ref_latents)]
    mean = float(np.abs(res.images.astype(int) - ref.astype(int)).mean())
    print(f"fp4 latents rel err per step {['%.1e' % e for e in errs]}, image mean |diff| {mean:.2f}/255")
    assert 0 < max(errs) <= FP4_LATENT_REL and mean <= FP4_IMAGE_MEAN
