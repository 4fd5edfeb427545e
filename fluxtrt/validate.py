"""`fluxtrt validate`: each built component's ONNX (what TensorRT was given) in ONNX Runtime against its PyTorch
module, on the same inputs and device, at the profile's opt and min shapes.

So that an error means something, every row also says how much two correct computations of the same module
differ: the module run again with another attention backend (SDPA's math kernel against the default one), in
the same dtype. A deep network with random weights amplifies rounding (measured: full-size FLUX.1-dev with
N(0, 0.02) weights, PyTorch bf16 against fp32 differ by 43-55%), so a fixed bound alone says little at full
size: a row passes when the error is within the component's bound, or within twice that reference pair.

fp32 graphs are compared with the fp32 module with TF32 off on both sides (ONNX Runtime's `use_tf32=0`, PyTorch's
matmul and cuDNN flags); bf16 graphs with the bf16 module, or with the fp32 one where ONNX Runtime runs them
widened to fp32 (core.sessions.runnable_session: on its CPU provider, or for an op without a bf16 kernel). An fp8
graph quantized from a bf16 checkpoint (quantize/zerocopy.py: it records which modules each Q/DQ'd MatMul computes)
runs widened to fp32 (ONNX Runtime has no bf16 Q/DQ kernel) and is compared with the fp32 module fake-quantized
with the graph's own scales, which proves the Q/DQ graph computes what the recipe says; its error against the
unquantized fp32 module (the recipe's error) is reported beside it and does not decide. A fake-quant row is
judged on its mean error, not its max: where ONNX Runtime's fp32 sum and PyTorch's differ in the last bit, an
activation can round to the neighbouring E4M3 value on one side only, which moves a few elements by a whole
quantization step; how many is chance, so the bound is the fp32 one or a tenth of the recipe's own error on the
same inputs (compare.fake_quant_bound). Other quantized graphs are compared with the unquantized bf16 module
only.

`--fp32` (fp32=True) runs bf16 graphs widened to fp32 on every provider (weights widened exactly, bf16 casts made
fp32) against the fp32 module: the graph's own arithmetic, apart from bf16 rounding, judged by the fp32 bound.
Where an fp32 graph is compared with its own fp32 module, the reference is that module against itself in fp64
(how far one correct fp32 computation is from the exact one), which every op's rounding enters, not only
attention's (this is what showed the bf16 graphs' attention scale off by 0.29%: optimize.passes.
exact_attention_scale). Fake-quant rows, whose rounding to E4M3 dominates, and a module that never calls SDPA
in bf16 keep the attention pair (T5's is then 0: only the bound decides)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import FluxtrtError


@dataclass
class CrossCheckRow:
    component: str
    precision: str  # the graph's (the manifest's)
    torch_dtype: str
    batch: int
    height: int
    width: int
    onnx_error: float  # max |onnx - torch| / max |torch|
    onnx_mean_error: float  # mean |onnx - torch| / mean |torch|
    reference: float  # max |math - default attention| / max |default|, the same module twice
    reference_mean: float  # mean |math - default| / mean |default|
    bound: float  # the component's validation bound for this precision
    ok: bool
    against: str  # "module", "fake-quant module" or "unquantized module"
    decides: bool = True  # False: reported only (an fp8 graph's error against the unquantized module)
    metric: str = "max"  # what decides: "max" errors, or "mean" ones (fake-quant rows, below)
    reference_kind: str = "attention"  # the pair: SDPA's math vs default kernel, or "fp64": fp32 vs fp64 module

    @property
    def ratio(self) -> float:
        return self.onnx_error / self.reference if self.reference > 0 else float("inf")

    def to_json(self) -> dict:
        return asdict(self) | {"ratio": self.ratio}


def relative_errors(a, b) -> tuple[float, float]:
    """(max |a - b| / max |b|, mean |a - b| / mean |b|), in float64."""
    a, b = a.double(), b.double()
    d = (a - b).abs()
    return float(d.max() / b.abs().max().clamp_min(1e-30)), float(d.mean() / b.abs().mean().clamp_min(1e-30))


def shape_points(manifest, geo) -> list:
    """The profile's opt shape and its min (batch 2 where the profile allows: batch and size both change)."""
    from .components import ShapePoint

    opt, lo, hi = (manifest.shape_range[k] for k in ("opt", "min", "max"))
    return [ShapePoint(*opt), ShapePoint(min(2, hi[0]), lo[1], lo[2])]


def cross_check(engines: Path, components=None, provider: str = "auto", device: str | None = None,
                model: str | None = None, *, seed: int | None = None, say=lambda line: None,
                fp32: bool = False) -> list[CrossCheckRow]:
    import torch

    from .components import specs_for
    from .models.source import resolve_model
    from .records import read_manifest
    from .runtime.choice import ort_provider

    engines = Path(engines)
    manifest = read_manifest(engines)
    names = list(components or manifest.components)
    unknown = [c for c in names if c not in manifest.components]
    if unknown:
        raise FluxtrtError(f"-c {', '.join(unknown)}: these engines have {', '.join(manifest.components)}")
    provider = ort_provider(provider)
    device = device or ("cuda" if provider != "cpu" else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise FluxtrtError("--device cuda needs a CUDA GPU; this machine has none: --device cpu")
    src = resolve_model(model or manifest.model.id)
    geo = src.geometry
    specs = specs_for(geo, names)
    seed = seed if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
    say(f"ONNX Runtime on {provider.upper()}, PyTorch on {device}; seed {seed}" + ("; bf16 graphs in fp32" if fp32 else ""))
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        rows = []
        for name in names:
            new = _component(engines, manifest, name, specs[name], src, geo=geo, provider=provider, device=device, seed=seed,
                             fp32=fp32)
            for r in new:
                say(f"{name} {r.batch}x{r.height}x{r.width}: {r.onnx_error:.2e} (reference {r.reference:.2e})")
            rows += new
        return rows
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def _component(engines, manifest, name, spec, src, *, geo, provider, device, seed, fp32=False) -> list[CrossCheckRow]:
    from .compare import bound_for, fake_quant_bound
    from .dtypes import FLOAT_NAMES, torch_dtype
    from .fp8 import read_qdq
    from .onnxio import load_header
    from .records import built_onnx
    from .runtime.executors import OnnxRuntimeExecutor

    entry = manifest.component(name)
    onnx_path = built_onnx(engines, entry)
    ex = OnnxRuntimeExecutor(name, entry, onnx_path, spec, geo, provider=provider, widen=fp32)
    if device == "cuda":
        import torch

        ex.stream = torch.cuda.current_stream()
    header = load_header(onnx_path) if entry.precision == "fp8" else None
    # the fake-quant reference where the graph's weights are the checkpoint's own bf16 bytes (zero-copy path); a
    # copying build of an fp32 checkpoint rounds its weights to bf16, which the fp32 module does not
    zero_copy = (entry.quantization or {}).get("path") == "zero-copy"
    record = read_qdq(header) if header is not None and zero_copy else {}
    points = shape_points(manifest, geo)
    feeds = [{n: v.to(device) for n, v in spec.sample_inputs(point, geo, seed + k).items()}
             for k, point in enumerate(points)]
    got = [ex.infer(f)[spec.outputs[0].name] for f in feeds]
    widened = getattr(ex.session, "_fluxtrt_widened", False)  # ONNX Runtime computed it in fp32
    ex.deactivate()
    tname = "fp32" if widened else entry.precision if entry.precision in FLOAT_NAMES else "bf16"
    module = src.load_component(spec.subfolder, torch_dtype(tname), device).eval()
    quantized = entry.precision not in FLOAT_NAMES
    bound = bound_for(name, "fp32" if widened and not quantized else entry.precision, spec.rtol_fp32)
    rows, bounds = [], [bound] * len(points)
    if record:  # the recipe's error first, then the same module fake-quantized with the graph's scales
        rows += _rows(name, entry.precision, tname, spec, module, feeds=feeds, got=got, points=points, bounds=bounds,
                      against="unquantized module",
                      metric="max", decides=False)
        _fake_quantize(module, onnx_path, header, record)
        fp32_bound = bound_for(name, "fp32", spec.rtol_fp32)
        bounds = [fake_quant_bound(fp32_bound, r.onnx_mean_error) for r in rows]
    against = "fake-quant module" if record else "module" if entry.precision in FLOAT_NAMES else "unquantized module"
    rows += _rows(name, entry.precision, tname, spec, module, feeds=feeds, got=got, points=points, bounds=bounds,
                  against=against, metric="mean" if record else "max")
    del module
    return rows


def _fake_quantize(module, onnx_path: Path, header, record: dict) -> None:
    """`module` made to compute what the fp8 graph (`header`: the graph without its weights) computes."""
    from onnx import numpy_helper

    from .fp8 import fake_quantize_fp8

    wanted = {r[k] for r in record.values() for k in ("act_scale", "weight_scale") if k in r}
    scales = {t.name: float(numpy_helper.to_array(t).astype("float32")) for t in header.graph.initializer
              if t.name in wanted}
    if fake_quantize_fp8(module, record, scales) == 0:
        raise FluxtrtError(f"{onnx_path}: its fp8 record names no quantized layer; rebuild with --force")


def _rows(name, precision, tname, spec, module, *, feeds, got, points, bounds, against, metric, decides=True):
    """One row per shape point: the ONNX outputs `got` against `module` on the same `feeds`, beside the module
    against itself with SDPA's math kernel, or, for an fp32 module compared as it is (or one the kernels do not
    change), against itself in fp64."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    wrapped = spec.wrap(module)
    dtype = next(module.parameters()).dtype

    def args_for(f, dt):
        return [(f[t.name].to(dt) if f[t.name].is_floating_point() else f[t.name]) for t in spec.inputs if t.name in f]

    refs, pairs = [], []
    for f in feeds:
        with torch.inference_mode():
            ref = wrapped(*args_for(f, dtype))
            with sdpa_kernel([SDPBackend.MATH]):
                alt = wrapped(*args_for(f, dtype))
        refs.append(ref)
        pairs.append(relative_errors(alt, ref))
        del alt
    kind = "attention"
    if dtype == torch.float32 and (against == "module" or all(p == (0.0, 0.0) for p in pairs)):  # fp32 vs exact
        kind, pairs = "fp64", []
        module.to(torch.float64)
        for f, ref in zip(feeds, refs):
            with torch.inference_mode():
                pairs.append(relative_errors(ref, wrapped(*args_for(f, torch.float64))))
        module.to(dtype)
    rows = []
    for out, ref, (pair, pair_mean), point, bound in zip(got, refs, pairs, points, bounds):
        err, mean = relative_errors(out.to(ref.device), ref)
        e, r = (mean, pair_mean) if metric == "mean" else (err, pair)
        ok = bool(torch.isfinite(out).all()) and (e <= bound or e <= 2 * r)
        rows.append(CrossCheckRow(component=name, precision=precision, torch_dtype=tname, batch=point.batch,
                                  height=point.height, width=point.width, onnx_error=err, onnx_mean_error=mean,
                                  reference=pair, reference_mean=pair_mean, bound=bound, ok=ok, against=against,
                                  decides=decides, metric=metric, reference_kind=kind))
    return rows
