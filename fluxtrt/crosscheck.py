"""`fluxtrt validate`: each built component's ONNX (what TensorRT was given) in ONNX Runtime against its PyTorch
module, on the same inputs and device, at the profile's opt and min shapes.

So that an error means something, every row also says how much two correct computations of the same module
differ: the module run again with another attention backend (SDPA's math kernel against the default one), in
the same dtype. A deep network with random weights amplifies rounding (measured: full-size FLUX.1-dev with
N(0, 0.02) weights, PyTorch bf16 against fp32 differ by 43-55%), so a fixed bound alone says little at full
size: a row passes when the error is within the component's bound, or within twice that reference pair.

fp32 graphs are compared with the fp32 module with TF32 off on both sides (ONNX Runtime's `use_tf32=0`,
PyTorch's matmul and cuDNN flags); bf16 graphs with the bf16 module; quantized graphs (fp8, int8, int4, fp4)
with the unquantized bf16 module, which is the recipe's error, not a check of its Q/DQ arithmetic."""

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
    bound: float  # the component's validation bound for this precision
    ok: bool
    against: str  # "module" or "unquantized module"

    @property
    def ratio(self) -> float:
        return self.onnx_error / self.reference if self.reference > 0 else float("inf")

    def to_json(self) -> dict:
        return asdict(self) | {"ratio": self.ratio}


def _rel(a, b) -> tuple[float, float]:
    a, b = a.double(), b.double()
    d = (a - b).abs()
    return float(d.max() / b.abs().max().clamp_min(1e-30)), float(d.mean() / b.abs().mean().clamp_min(1e-30))


def shape_points(manifest, geo) -> list:
    """The profile's opt shape and its min (batch 2 where the profile allows: batch and size both change)."""
    from .components import ShapePoint

    opt, lo, hi = (manifest.shape_range[k] for k in ("opt", "min", "max"))
    return [ShapePoint(*opt), ShapePoint(min(2, hi[0]), lo[1], lo[2])]


def cross_check(engines: Path, components=None, provider: str = "auto", device: str | None = None,
                model: str | None = None, seed: int | None = None, say=lambda line: None) -> list[CrossCheckRow]:
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
    say(f"ONNX Runtime on {provider.upper()}, PyTorch on {device}; seed {seed}")
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        rows = []
        for name in names:
            new = _component(engines, manifest, name, specs[name], src, geo, provider, device, seed)
            for r in new:
                say(f"{name} {r.batch}x{r.height}x{r.width}: {r.onnx_error:.2e} (reference {r.reference:.2e})")
            rows += new
        return rows
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def _component(engines, manifest, name, spec, src, geo, provider, device, seed) -> list[CrossCheckRow]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .dtypes import FLOAT_NAMES, torch_dtype
    from .runtime.executors import OnnxRuntimeExecutor
    from .validate import bound_for

    entry = manifest.component(name)
    ex = OnnxRuntimeExecutor(name, entry, engines.parent / entry.onnx, spec, geo, provider)
    if device == "cuda":
        ex.stream = torch.cuda.current_stream()
    tname = entry.precision if entry.precision in FLOAT_NAMES else "bf16"  # quantized: the unquantized bf16
    dtype = torch_dtype(tname)
    module = spec.wrap(src.load_component(spec.subfolder, dtype, device)).eval()
    out = spec.outputs[0].name
    rows = []
    for k, point in enumerate(shape_points(manifest, geo)):
        feeds = {n: (v.to(dtype) if v.is_floating_point() else v).to(device)
                 for n, v in spec.sample_inputs(point, geo, seed + k).items()}
        got = ex.infer(feeds)[out]
        args = [feeds[t.name] for t in spec.inputs if t.name in feeds]
        with torch.inference_mode():
            ref = module(*args)
            with sdpa_kernel([SDPBackend.MATH]):
                alt = module(*args)
        err, mean = _rel(got.to(ref.device), ref)
        pair, _ = _rel(alt, ref)
        bound = bound_for(name, entry.precision, spec.rtol_fp32)
        finite = bool(torch.isfinite(got).all())
        rows.append(CrossCheckRow(name, entry.precision, tname, point.batch, point.height, point.width, err, mean,
                                  pair, bound, finite and (err <= bound or err <= 2 * pair),
                                  "module" if entry.precision in FLOAT_NAMES else "unquantized module"))
    ex.deactivate()
    del module
    return rows
