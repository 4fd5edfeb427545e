"""The zero-copy build path (stages/zerocopy_plan.py, quantize/zerocopy.py): engines straight from a checkpoint stored in
bf16, fp8 weights quantized one at a time, activation ranges by module from PyTorch."""

import hashlib
import json

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch

from fluxtrt.components import specs_for
from fluxtrt.fp8 import FP8_MAX
from fluxtrt.quantize.qdq import linear_weight, plan
from fluxtrt.quantize.zerocopy import quantize_weight_fp8
from fluxtrt.records import CalibrationSettings  # noqa: E402

E4M3_REL = 2.0 ** -4  # 3 mantissa bits: round to nearest is within half a step, 2^-4 of the value
E4M3_MIN_NORMAL = 2.0 ** -6


def _bf16_bytes(w: torch.Tensor):
    return w.to(torch.bfloat16).view(torch.int16).numpy().tobytes()


@pytest.mark.parametrize("transposed", [True, False])
def test_fp8_weight_is_e4m3_of_the_bf16_weight(transposed):
    g = torch.Generator().manual_seed(int(np.random.default_rng().integers(2**31)))
    w = (torch.randn(48, 80, generator=g) * torch.rand(48, 1, generator=g) * 3).to(torch.bfloat16)
    q, scale = quantize_weight_fp8([(_bf16_bytes(w), tuple(w.shape))], transposed)
    assert float(torch.tensor(scale).to(torch.bfloat16).float()) == scale  # the graph's bf16 scale is exact
    want = (w.float().t() if transposed else w.float()).numpy()
    assert q.shape == want.shape
    deq = q.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
    big = np.abs(want) >= E4M3_MIN_NORMAL * scale
    assert np.all(np.abs(deq - want)[big] <= E4M3_REL * np.abs(want)[big] + 1e-12)
    assert np.all(np.abs(deq - want)[~big] <= 2.0 ** -10 * scale)  # subnormal steps are 2^-9 * scale
    assert np.abs(deq).max() <= FP8_MAX * scale
    assert np.abs(q.view(ml_dtypes.float8_e4m3fn).astype(np.float32)).max() >= 0.9 * FP8_MAX


# A fused projection (q/k/v, or the single-stream block's q/k/v/mlp) gets one weight scale, the max over its
# parts, because TensorRT's FP8 GEMM takes one per-tensor weight scale. Its cost against one scale per part on
# the tiny model's bf16 weights, measured by test_fused_weight_scale_costs_little (mean relative weight error):
# about 3-4% for both, the joint scale at most 1.3x the per-part error on any fused weight.
JOINT_SCALE_MAX_RATIO = 1.3


def test_fused_weight_is_the_parts_under_one_scale(tiny_bf16):
    """Fused parts quantized under one scale = each part quantized with that scale, joined along the output."""
    from safetensors.torch import load_file

    sd = load_file(next((tiny_bf16.path / "transformer").glob("*.safetensors")))
    parts = [sd[f"transformer_blocks.0.attn.to_{p}.weight"] for p in "qkv"]
    q, scale = quantize_weight_fp8([(_bf16_bytes(w), tuple(w.shape)) for w in parts], True)
    assert scale == float(torch.tensor(max(float(w.float().abs().max()) for w in parts) / FP8_MAX)
                          .to(torch.bfloat16).float())
    joined = torch.cat([w.float() for w in parts], 0).t()
    deq = q.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
    assert deq.shape == tuple(joined.shape)
    want = (joined / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float().numpy() * scale
    assert np.array_equal(deq, want)


def test_fused_weight_scale_costs_little(tiny_bf16):
    from safetensors.torch import load_file

    def err(ws, joint):
        scales = [max(float(w.abs().max()) for w in ws)] * len(ws) if joint else [float(w.abs().max()) for w in ws]
        num = sum(float(((w / (s / FP8_MAX)).to(torch.float8_e4m3fn).float() * (s / FP8_MAX) - w).abs().sum())
                  for w, s in zip(ws, scales))
        return num / sum(float(w.abs().sum()) for w in ws)

    sd = {k: v.float() for k, v in load_file(next((tiny_bf16.path / "transformer").glob("*.safetensors"))).items()}
    groups = [[f"transformer_blocks.{i}.attn.{p}.weight" for p in ("to_q", "to_k", "to_v")] for i in range(2)]
    groups += [[f"single_transformer_blocks.{i}.{p}.weight" for p in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")]
               for i in range(2)]
    for keys in groups:
        ws = [sd[k] for k in keys]
        per_part, joint = err(ws, False), err(ws, True)
        assert per_part < 0.05 and joint <= JOINT_SCALE_MAX_RATIO * per_part, (keys[0], per_part, joint)


@pytest.mark.slow
def test_module_ranges_match_onnx_runtime_ranges(tiny_dev, tmp_path):
    """The PyTorch hook on each nn.Linear measures the same tensor ONNX Runtime sees at the MatMul that the
    linear layer became (fused q/k/v included, found through the weight map), on the same prompts."""
    from fluxtrt.core import weightmap
    from fluxtrt.quantize.calibration import activation_ranges, collect_inputs, linear_input_ranges
    from fluxtrt.quantize.zerocopy import module_of
    from fluxtrt.stages.fp32_plan import optimized_fp32_transformer

    prompts, sizes = ["a red fox in the snow", "a lighthouse at night"], [(64, 64), (48, 80)]
    amax, calls, _ = linear_input_ranges(tiny_dev, prompts, sizes, 2, "fp32", device="cpu")
    assert calls == 4
    model = optimized_fp32_transformer(tiny_dev, tmp_path)
    p = plan(model, "fp8")
    prov = weightmap.read(model)
    inits = {t.name: t for t in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}
    nodes = {n.name: n for n in model.graph.node}
    onnx_amax = activation_ranges(model, p.calibration_inputs(model), collect_inputs(tiny_dev, prompts, sizes, 2))
    checked = 0
    for name in p.quantized:
        n = nodes[name]
        ws, _ = linear_weight(n, inits, producers)
        modules = [module_of(k) for w in ws for k in weightmap.source_keys(prov[w])]
        hooked = max(amax[m] for m in modules)
        assert abs(hooked - onnx_amax[n.input[0]]) <= 1e-4 * onnx_amax[n.input[0]], (name, modules)
        checked += 1
    assert checked == len(p.quantized) > 10


def _sha_files(folder):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.glob("*.safetensors"))}


def test_fp8_build_takes_the_zero_copy_path(fp8_build):
    src, cfg, root, manifest, results, before, _ = fp8_build
    e = manifest.components["transformer"]
    q = e.quantization
    assert q["path"] == "zero-copy" and q["recipe"] == "fp8" and not q["calibration_cached"]
    assert {k: v["status"] for k, v in e.stages.items()} == \
        {"export": "built", "optimize": "built", "quantize": "built", "build": "built"}
    assert e.stages["quantize"]["bytes_written"] >= q["fp8_weight_bytes"] > 0
    assert e.onnx.endswith("-fp8-zc/transformer.onnx")
    opt = json.loads((root / "onnx" / e.onnx.split("/")[1] / "optimize.json").read_text())
    assert 0 < opt["components"]["transformer"]["max_rel_err"] <= 1.5e-1  # ONNX Runtime vs fp32 PyTorch
    assert _sha_files(src.path / "transformer") == before  # the checkpoint is only read
    zc = onnx.load(str(next((root / "onnx").glob("*-bf16-zc-opt")) / "transformer.onnx"), load_external_data=False)
    fused = [n for n in zc.graph.node if n.op_type == "Concat" and n.name.startswith("fused_w_")]
    assert len(fused) == 6  # image and text q/k/v of 2 double-stream blocks, q/k/v/mlp of 2 single-stream ones
    assert q["quantized_layers"] == len(plan(zc, "fp8").quantized) > 10 and len(q["kept_in_high_precision"]) == 3
    spec = specs_for(src.geometry)["transformer"]
    assert [i["name"] for i in e.inputs] == [t.name for t in spec.inputs]
    for name, (lo, opt, hi) in spec.profile(cfg.shape_range(None), src.geometry).items():
        assert e.profile[name] == {"min": list(lo), "opt": list(opt), "max": list(hi)}, name


def test_fp8_graph_stores_only_fp8_weights(fp8_build):
    """E4M3 weights are written to transformer.onnx.data; every other weight is a link into the checkpoint."""
    from fluxtrt.onnxio import external_info

    src, cfg, root, manifest, *_ = fp8_build
    path = root / manifest.components["transformer"].onnx
    model = onnx.load(str(path), load_external_data=False)
    q = manifest.components["transformer"].quantization
    fp8 = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT8E4M3FN and t.dims]
    assert len(fp8) == q["quantized_layers"]
    assert all(external_info(t)["location"] == "transformer.onnx.data" for t in fp8)
    assert sum(int(external_info(t)["length"]) for t in fp8) == q["fp8_weight_bytes"]
    assert path.with_suffix(".onnx.data").stat().st_size < q["fp8_weight_bytes"] + 64 * len(fp8)
    others = [t for t in model.graph.initializer if external_info(t) and t.data_type != onnx.TensorProto.FLOAT8E4M3FN]
    assert others and all(external_info(t)["location"].startswith("transformer.weights/") for t in others)
    links = path.with_suffix(".weights")
    assert all((links / f).is_symlink() for f in {external_info(t)["location"].split("/")[1] for t in others})


def test_fp8_activation_scales_come_from_the_module_ranges(fp8_build):
    from fluxtrt.core import weightmap
    from fluxtrt.quantize.zerocopy import module_of

    src, cfg, root, manifest, *_ = fp8_build
    e = manifest.components["transformer"]
    amax = json.loads((root / e.quantization["calibration_file"]).read_text())["amax"]
    zc = onnx.load(str(next((root / "onnx").glob("*-bf16-zc-opt")) / "transformer.onnx"), load_external_data=False)
    prov = weightmap.read(zc)
    zc_inits = {t.name: t for t in zc.graph.initializer}
    zc_nodes = {n.name: n for n in zc.graph.node}
    zc_producers = {o: n for n in zc.graph.node for o in n.output}
    model = onnx.load(str(root / e.onnx), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    nodes = {n.name: n for n in model.graph.node}
    checked = 0
    for n in model.graph.node:
        if n.op_type == "MatMul" and n.input[1].endswith("__dq") and n.input[0].endswith("__act__dq"):
            parts, _ = linear_weight(zc_nodes[n.name], zc_inits, zc_producers)
            assert n.input[1] == f"{parts[0]}__dq"
            modules = {module_of(k) for w in parts for k in weightmap.source_keys(prov[w])}
            module = max(modules, key=lambda m: amax[m])
            scale = onnx.numpy_helper.to_array(inits[nodes[n.input[0][: -len("__dq")] + "__q"].input[1]])
            assert scale.dtype == ml_dtypes.bfloat16
            want = float(torch.tensor(amax[module] / FP8_MAX).to(torch.bfloat16).float())
            assert float(scale) == want, (n.name, module)
            checked += 1
    assert checked == e.quantization["quantized_layers"]


def test_validate_checks_the_fp8_graph_against_a_fake_quant_with_its_scales(fp8_build, monkeypatch):
    """`fluxtrt validate` on an fp8 graph from a bf16 checkpoint: ONNX Runtime (widened to fp32: it has no bf16
    Q/DQ) equals the fp32 module fake-quantized with the graph's own scales far more closely than the
    unquantized module (the recipe's error, reported only); the same check with every weight scale 1.25x
    wrong fails."""
    from fluxtrt import fp8
    from fluxtrt.compare import fake_quant_bound
    from fluxtrt.validate import cross_check

    src, cfg, root, manifest, *_ = fp8_build
    rows = cross_check(root / "4090-fp8" if (root / "4090-fp8").is_dir() else root / "4090", ["transformer"],
                       "cpu", "cpu", str(src.path))
    fake = [r for r in rows if r.against == "fake-quant module"]
    plain = [r for r in rows if r.against == "unquantized module"]
    assert len(fake) == len(plain) == 2 and all(r.torch_dtype == "fp32" for r in rows)
    assert all(r.decides and r.ok for r in fake) and not any(r.decides for r in plain)
    for f, p in zip(fake, plain):  # judged on the mean: a few activations round to the other E4M3 neighbour
        assert f.metric == "mean" and f.bound == fake_quant_bound(1e-4, p.onnx_mean_error), (f, p)
        assert f.onnx_mean_error <= 3e-4 and f.onnx_mean_error * 20 <= p.onnx_mean_error, (f, p)
        assert f.onnx_error <= 1e-2 and p.onnx_error <= 1.5e-1, (f, p)

    real = fp8.fake_quantize_fp8

    def wrong(module, record, scales):
        return real(module, record, {k: v * (1.25 if "wscale" in k else 1.0) for k, v in scales.items()})

    monkeypatch.setattr(fp8, "fake_quantize_fp8", wrong)
    bad = cross_check(root / "4090-fp8" if (root / "4090-fp8").is_dir() else root / "4090", ["transformer"],
                      "cpu", "cpu", str(src.path))
    print(*bad, sep="\n")
    assert not any(r.ok for r in bad if r.against == "fake-quant module")


def test_rebuild_reuses_every_stage_and_the_calibration(fp8_build):
    from fluxtrt.stages.build import build_gpu

    src, cfg, root, manifest, _, _, calib = fp8_build
    _, results = build_gpu(src, cfg, root, components=["transformer"], calibration=calib)
    assert [(r.stage, r.status) for r in results] == \
        [("export", "reused"), ("optimize", "reused"), ("quantize", "reused"), ("build", "reused")]


@pytest.mark.slow
def test_calibrate_cli_fills_the_cache_the_build_reads(tiny_bf16, tmp_path):
    pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx not installed (pip install -e '.[rtx]')")
    from typer.testing import CliRunner

    from fluxtrt.cli import app
    from fluxtrt.gpus import load_gpu
    from fluxtrt.stages.build import build_gpu

    res = CliRunner().invoke(app, ["calibrate", "-m", str(tiny_bf16.path), "-o", str(tmp_path), "--device", "cpu",
                                   "--calibration-size", "2", "--calibration-steps", "1", "--resolution", "1024"])
    assert res.exit_code == 0 and "linear" not in res.output and "measured" in res.output, res.output
    cfg = load_gpu("4090").with_precision({"transformer": "fp8"})
    manifest, _ = build_gpu(tiny_bf16, cfg, tmp_path, components=["transformer"], calibration=CalibrationSettings(size=2,
                                                                                                                  steps=1),
                            validate=False)
    q = manifest.components["transformer"].quantization
    assert q["calibration_cached"] and q["path"] == "zero-copy"
    res = CliRunner().invoke(app, ["calibrate", "-m", str(tiny_bf16.path), "--device", "tpu"])
    assert res.exit_code == 2 and "--device tpu" in res.output
    if not torch.cuda.is_available():
        res = CliRunner().invoke(app, ["calibrate", "-m", str(tiny_bf16.path), "-o", str(tmp_path / "x"), "--device",
                                       "cuda"])
        assert res.exit_code == 2 and "no CUDA GPU" in res.output and not (tmp_path / "x" / "calibration").exists()


@pytest.mark.slow
def test_copy_weights_takes_the_fp32_path(tiny_bf16, tmp_path):
    pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx not installed (pip install -e '.[rtx]')")
    from fluxtrt.gpus import load_gpu
    from fluxtrt.stages.build import build_gpu
    from fluxtrt.stages.zerocopy_plan import zero_copy_plan_refusal

    assert zero_copy_plan_refusal(tiny_bf16, "transformer", "bf16") is None
    assert "fp32 graph" in zero_copy_plan_refusal(tiny_bf16, "transformer", "int8")
    assert "stored in fp32" in zero_copy_plan_refusal(tiny_bf16, "clip", "fp16")
    manifest, _ = build_gpu(tiny_bf16, load_gpu("4090"), tmp_path, components=["transformer"], zero_copy=False)
    assert manifest.components["transformer"].onnx.endswith("-bf16-opt/transformer.onnx")


@pytest.mark.slow
def test_zero_copy_engines_run_like_diffusers(tiny_bf16, tmp_path, reweighted_copy):
    """T5 and the transformer from their bf16 checkpoint (zero-copy, graph passes on the linked graph), CLIP and the VAE through
    the fp32 path: `fluxtrt run`'s pipeline on ONNX Runtime matches diffusers (fp32 compute on the same stored
    weights) step by step."""
    pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx not installed (pip install -e '.[rtx]')")
    from fluxtrt.flux_math import initial_noise
    from fluxtrt.gpus import load_gpu
    from fluxtrt.runtime.assembly import open_pipeline
    from fluxtrt.stages.build import build_gpu
    from tests.runtime.test_pipeline import MAX_UINT8_DIFF, reference

    cfg = load_gpu("4090").with_precision({"clip": "fp32", "t5": "bf16", "transformer": "bf16", "vae_decoder": "fp32"})
    manifest, _ = build_gpu(tiny_bf16, cfg, tmp_path, components=["clip", "t5", "transformer", "vae_decoder"])
    paths = {n: e.onnx for n, e in manifest.components.items()}
    assert paths["t5"].endswith("-bf16-zc-opt/t5.onnx") and paths["transformer"].endswith("-bf16-zc-opt/transformer.onnx")
    assert paths["clip"].endswith("-fp32-opt/clip.onnx")
    seed = int(np.random.default_rng().integers(0, 2**31))
    pipe = open_pipeline(tmp_path / "4090", backend="onnxruntime")
    assert pipe.noise_dtype() == torch.bfloat16  # bf16 engines draw the noise as FluxPipeline in bf16 does
    geo = tiny_bf16.geometry  # diffusers' fp32 reference (widened ONNX on this CPU) starts from the same noise
    noise = initial_noise(1, geo.latent_channels, 256, 320, geo.vae_scale_factor, generator=torch.Generator().manual_seed(seed),
                          dtype=torch.bfloat16)
    ref, ref_latents = reference(tiny_bf16, ["a red fox in the snow"], 256, 320, 4, 3.5, seed, latents=noise)
    res = pipe.generate(["a red fox in the snow"], 256, 320, 4, 3.5, seed=seed, trace=True)
    for i, (a, b) in enumerate(zip(res.latents_per_step, ref_latents)):
        err = float((a - b).abs().max())
        assert err < 1e-3, f"latents diverge from diffusers at step {i}: {err:.2e}"
    assert int(np.abs(res.images.astype(int) - ref.astype(int)).max()) <= MAX_UINT8_DIFF
    # the fused, still-linked graphs keep taking their weights from a checkpoint (the weight map): the same
    # checkpoint gives the same image bit for bit, another checkpoint another image
    def image(weights):
        return open_pipeline(tmp_path / "4090", backend="onnxruntime", weights=weights).generate(
            ["a red fox in the snow"], 256, 320, 3, 3.5, seed=seed).images

    normal = image(None)
    assert np.array_equal(image(tiny_bf16.path), normal)
    # `fluxtrt validate --fp32`: both bf16 graphs computed in fp32 against the fp32 module, within the fp32 bound
    from fluxtrt.api import validate_engines

    rows = validate_engines(tmp_path / "4090", ["t5", "transformer"], "cpu", "cpu", fp32=True)
    assert [(r.component, r.torch_dtype, r.bound) for r in rows] == [(c, "fp32", 1e-4) for c in ("t5", "t5",
                                                                       "transformer", "transformer")]
    assert all(r.ok and 0 < r.onnx_error <= 1e-4 for r in rows), rows
    assert all(r.reference_kind == "fp64" and 0 < r.reference <= 1e-4 for r in rows), rows  # fp32 vs fp64 module
    other = reweighted_copy(tiny_bf16, tmp_path / "other", seed=seed % 1000 + 1)
    assert np.abs(image(other.path).astype(int) - normal.astype(int)).max() > 10


@pytest.mark.slow
def test_zero_copy_graph_is_fused_like_the_fp32_path(tiny_bf16, tmp_path):
    """The optimize stage runs on the zero-copy graph: its TensorRT network computes no more layers per
    inference than the fp32 path's (layers that read only weights fold at build time), its fusions are there,
    and its matrices are still links into the checkpoint (only vectors were written)."""
    pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx not installed (pip install -e '.[rtx]')")
    from fluxtrt.gpus import load_gpu
    from fluxtrt.onnxio import external_info
    from fluxtrt.stages.build import build_gpu

    zc, _ = build_gpu(tiny_bf16, load_gpu("4090"), tmp_path / "zc", components=["transformer"], validate=False)
    fp32, _ = build_gpu(tiny_bf16, load_gpu("4090"), tmp_path / "fp32", components=["transformer"], zero_copy=False,
                        validate=False)
    a, b = zc.components["transformer"], fp32.components["transformer"]
    assert a.onnx.endswith("-bf16-zc-opt/transformer.onnx") and a.stages["optimize"]["status"] == "built"
    assert a.computed_layers <= b.computed_layers, (a.computed_layers, b.computed_layers)
    assert a.layers < 0.75 * 2203  # the unfused zero-copy network parsed 2,203 layers (issue 24)
    zc_record = a.stages["optimize"]["zero_copy"]  # the manifest says what was written and why
    assert zc_record["linked_tensors"] > 0 and set(zc_record["written"]) == {
        "a fused projection's joined bias", "a vector cast for an op that computes in fp32 (RMSNorm's scale)",
        "a vector read from the checkpoint as stored"}
    assert zc_record["written"]["a fused projection's joined bias"]["tensors"] == 6
    model = onnx.load(str(tmp_path / "zc" / a.onnx), load_external_data=False)
    ops = {n.op_type for n in model.graph.node}
    assert {"RMSNormalization", "Gelu"} <= ops and "Pow" not in ops and "Tanh" not in ops
    matrices = [t for t in model.graph.initializer if len(t.dims) == 2 and t.data_type == onnx.TensorProto.BFLOAT16]
    assert matrices and all(external_info(t)["location"].startswith("transformer.weights/") for t in matrices)


@pytest.mark.slow
def test_weights_from_memory_maps_give_the_same_engine(fp8_build, tmp_path, monkeypatch):
    """Handing the parser pointers into memory maps (whose pages are dropped while TensorRT builds) gives the
    engine that parsing the file gives, byte for byte."""
    import fluxtrt.engine.build as engine
    from fluxtrt.core.backends import get_backend

    src, cfg, root, manifest, *_ = fp8_build
    spec = specs_for(src.geometry)["transformer"]
    onnx_path = root / manifest.components["transformer"].onnx
    backend, rng = get_backend(cfg.backend), cfg.shape_range(None)

    def build(path):
        return engine.build_engine(backend, onnx_path, spec, src.geometry, rng, compute_capability=cfg.compute_capability,
                                   engine_path=path)

    monkeypatch.setattr(engine.MappedWeights, "interval", 0.01)  # pages dropped every 10 ms
    mapped = build(tmp_path / "mapped.engine")
    monkeypatch.setattr(engine, "_parse", lambda parser, p: engine.MappedWeights() if parser.parse_from_file(str(p))
                        else None)
    parsed = build(tmp_path / "parsed.engine")
    assert mapped.sha256 == parsed.sha256 and mapped.bytes == parsed.bytes > 0


def test_graph_passes_never_read_a_linked_matrix(tiny_bf16, tmp_path, monkeypatch):
    """optimize_zero_copy reads vectors only: reading any linked matrix (through onnxio or onnx-graphsurgeon's
    lazy values) fails the test, so the full-size graph's 24 GB stay in the checkpoint."""
    import onnx_graphsurgeon as gs

    import fluxtrt.onnxio as onnxio
    from fluxtrt.export import export_component
    from fluxtrt.optimize.graph import optimize_zero_copy

    spec = specs_for(tiny_bf16.geometry, ["transformer"])["transformer"]
    zc = export_component(tiny_bf16, spec, tmp_path / "zc", "bf16", zero_copy=True).path
    read, load = onnxio.read_external, gs.ir.tensor.LazyValues.load

    def guarded_read(path, t):
        assert len(t.dims) <= 1, f"read the linked matrix {t.name}"
        return read(path, t)

    def guarded_load(self):
        assert self.tensor.data_location != onnx.TensorProto.EXTERNAL, f"loaded the linked matrix {self.tensor.name}"
        return load(self)

    monkeypatch.setattr(onnxio, "read_external", guarded_read)
    monkeypatch.setattr(gs.ir.tensor.LazyValues, "load", guarded_load)
    report = optimize_zero_copy(zc, tmp_path / "opt" / "transformer.onnx", "transformer")
    assert report.rows[-1][2] < 0.75 * report.rows[0][1]  # 745 -> 506 nodes on tiny
    assert report.zero_copy["linked_tensors"] >= 40
