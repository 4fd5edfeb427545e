"""Compare an exported ONNX graph with its PyTorch module on fresh random inputs.

Checks, in order, and collects every failure before reporting: input/output names, symbolic axes,
output shapes against the spec, and values (relative error = max|onnx - torch| / max|torch|)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .components import ComponentSpec, Geometry, ShapePoint
from .core.sessions import cpu_session

# Bounds on the relative error against fp32 PyTorch for graphs in lower precision (weights and activations
# cast; bf16 is checked with its weights' rounding, see upcast_bf16). Per component where it differs.
RTOL_BY_DTYPE = {"fp16": 2e-2, "bf16": 5e-2}
RTOL_BY_COMPONENT = {("transformer", "fp16"): 5e-2, ("transformer", "bf16"): 1e-1,
                     # quantized linear layers on top of bf16 placement
                     ("transformer", "fp8"): 1.5e-1, ("transformer", "fp8-attn"): 1.5e-1,
                     ("transformer", "int8"): 1.5e-1, ("transformer", "int8-wo"): 1.5e-1,
                     ("transformer", "int4-wo"): 2e-1, ("transformer", "fp4"): 2e-1}


def bound_for(component: str, dtype: str, fp32_bound: float) -> float:
    if dtype == "fp32":
        return fp32_bound
    from .components import family

    if (family(component), dtype) in RTOL_BY_COMPONENT:
        return RTOL_BY_COMPONENT[(family(component), dtype)]
    return RTOL_BY_DTYPE[dtype]


def fake_quant_bound(fp32_bound: float, recipe_error: float) -> float:
    """What an fp8 graph's mean error against the module fake-quantized with its own scales may reach: the fp32
    bound or a tenth of the recipe's own mean error (the graph against the unquantized module) on the same inputs,
    whichever is larger. Where two correct fp32 computations differ in the last bit, an activation on an E4M3
    rounding boundary rounds to the other neighbour on one side only, and how many do is chance (on tiny over
    245 seeds: the mean 2e-7 to 1.3e-4, above 1e-4 on 4 seeds, always 43x or more below the recipe's 4e-3 to
    7e-3; weight scales 5% off put it above the recipe's)."""
    return max(fp32_bound, recipe_error / 10)


@dataclass
class Check:
    point: ShapePoint | None
    output: str
    ok: bool
    detail: str
    rel_err: float | None = None


@dataclass
class ValidationReport:
    component: str
    bound: float
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def max_rel_err(self) -> float:
        errs = [c.rel_err for c in self.checks if c.rel_err is not None]
        return max(errs) if errs else float("nan")

    def failures(self) -> list[str]:
        return [f"{self.component}/{c.output}" + (f" at {_fmt(c.point)}" if c.point else "") + f": {c.detail}"
                for c in self.checks if not c.ok]


def _fmt(p: ShapePoint) -> str:
    return f"batch {p.batch}, {p.height}x{p.width}"


def validation_points(geo: Geometry) -> list[ShapePoint]:
    """Two shapes unlike the export example: batch 1 square, and batch 2 non-square."""
    m = geo.pixel_multiple
    return [ShapePoint(1, 4 * m, 4 * m), ShapePoint(2, 3 * m, 5 * m)]


def relative_error(actual, expected) -> float:
    import numpy as np

    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    scale = max(float(np.abs(expected).max()), 1e-12)
    return float(np.abs(actual - expected).max()) / scale


def graph_io(onnx_path: Path):
    """(inputs, outputs) of an ONNX file as lists of (name, [dims]) without loading its weights."""
    from .onnxio import load_header

    model = load_header(onnx_path)

    def dims(vi):
        return [d.dim_param if d.HasField("dim_param") else d.dim_value for d in vi.type.tensor_type.shape.dim]

    inits = {i.name for i in model.graph.initializer}
    ins = [(i.name, dims(i)) for i in model.graph.input if i.name not in inits]
    outs = [(o.name, dims(o)) for o in model.graph.output]
    return ins, outs


def validate_onnx(onnx_path: Path, module, spec: ComponentSpec, geo: Geometry, dtype: str = "fp32",
                  *, points: list[ShapePoint] | None = None, seed: int | None = None) -> ValidationReport:
    """Run ONNX Runtime (CPU) and the fp32 PyTorch module on the same fresh inputs and compare."""
    import numpy as np
    import torch

    bound = bound_for(spec.name, dtype, spec.rtol_fp32)
    report = ValidationReport(spec.name, bound)
    ins, outs = graph_io(onnx_path)
    want_in = [(t.name, list(t.dims)) for t in spec.inputs]
    want_out = [(t.name, list(t.dims)) for t in spec.outputs]
    for kind, got, want in (("inputs", ins, want_in), ("outputs", outs, want_out)):
        got_names, want_names = [n for n, _ in got], [n for n, _ in want]
        if got_names != want_names:
            report.checks.append(Check(None, kind, False, f"names {got_names}, expected {want_names}"))
            continue
        for (name, gd), (_, wd) in zip(got, want):
            sym = [d if isinstance(d, str) and not d.startswith("geo.") else None for d in wd]
            got_sym = [d if isinstance(d, str) else None for d in gd]
            ok = sym == got_sym
            report.checks.append(Check(None, name, ok, "symbolic axes " + ("match" if ok else f"{gd}, expected {wd}")))

    session = cpu_session(onnx_path)
    np_types = {i.name: i.type for i in session.get_inputs()}
    seed = seed if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
    for k, point in enumerate(points or validation_points(geo)):
        feeds = spec.sample_inputs(point, geo, seed + k)
        with torch.no_grad():
            ref = module(*feeds.values())
        ref = ref if isinstance(ref, (tuple, list)) else (ref,)
        onnx_feeds = {}
        for name, t in feeds.items():
            arr = t.numpy()
            if t.is_floating_point() and np_types.get(name) == "tensor(float16)":
                arr = arr.astype(np.float16)
            onnx_feeds[name] = arr
        got = session.run([t.name for t in spec.outputs], onnx_feeds)
        want_shapes = spec.output_shapes(point, geo)
        for t, g, r in zip(spec.outputs, got, ref):
            r = r.float().numpy()
            if tuple(g.shape) != want_shapes[t.name]:
                report.checks.append(Check(point, t.name, False, f"shape {tuple(g.shape)}, spec says {want_shapes[t.name]}"))
                continue
            g32 = np.asarray(g, dtype=np.float32)
            if not np.isfinite(g32).all():
                report.checks.append(Check(point, t.name, False, "non-finite values in ONNX Runtime output"))
                continue
            err = relative_error(g32, r)
            report.checks.append(Check(point, t.name, err <= bound, f"rel err {err:.2e} (bound {bound:.0e})", err))
    return report


def compare_onnx(reference: Path, candidate: Path, spec: ComponentSpec, geo: Geometry, bound: float,
                 *, points: list[ShapePoint] | None = None, seed: int | None = None) -> ValidationReport:
    """ONNX Runtime on two graphs of one component (e.g. before and after optimization), same fresh inputs."""
    import numpy as np
    import torch

    report = ValidationReport(spec.name, bound)
    ref_s, cand_s = cpu_session(reference), cpu_session(candidate)
    seed = seed if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
    names = [t.name for t in spec.outputs]
    for k, point in enumerate(points or validation_points(geo)):
        feeds = spec.sample_inputs(point, geo, seed + k)
        outs = []
        for s in (ref_s, cand_s):
            types = {i.name: i.type for i in s.get_inputs()}
            f = {n: t.numpy().astype(np.float16) if types[n] == "tensor(float16)" else t.numpy() for n, t in feeds.items()}
            outs.append(s.run(names, f))
        for name, r, c in zip(names, *outs):
            err = relative_error(np.asarray(c, np.float32), np.asarray(r, np.float32))
            report.checks.append(Check(point, name, err <= bound, f"rel err {err:.2e} (bound {bound:.0e})", err))
    return report
