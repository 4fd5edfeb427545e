"""The zero-copy build path: engines straight from a checkpoint stored in the engine's dtype.

When a component's safetensors hold exactly the dtype its engine computes in (a bf16 FLUX.1 checkpoint built
at bf16, or at fp8 whose other layers are bf16), `fluxtrt build` never makes an fp32 copy:
  export    zero-copy graph (weights are links into the checkpoint)     OUT/onnx/<hash>-<dtype>-zc/
  optimize  the graph passes, matrices never read: a linked weight's rewrites (q/k/v joined, transposed)
            are graph ops TensorRT folds at build; changed vectors are written  OUT/onnx/<hash>-<dtype>-zc-opt/
  quantize  fp8 / fp4: calibrate by module (cached; fp4 reads fp8's ranges), then quantize.zerocopy writes
            the E4M3 (NVFP4) weights one at a time (one per fused projection), every other weight stays a
            link                                                   OUT/onnx/<hash>-<recipe>-zc/
Memory stays near one weight tensor until TensorRT's builder. `--copy-weights` takes the fp32 path instead
(graph passes, every recipe). Each stage is reused when its recorded inputs are unchanged (stages/base.py)."""

from __future__ import annotations

import os
from pathlib import Path

from .. import __version__
from ..components import specs_for
from ..errors import FluxtrtError
from ..fileio import sha256_file
from ..precisions import REGISTRY
from ..records import CalibrationSettings
from .base import (
    Made,
    StageResult,
    Step,
    calibration_inputs,
    export_step,
    recorded,
    run_step,
)


def graph_dtype(precision: str) -> str | None:
    """The zero-copy graph's dtype for an engine precision (the registry's), None where there is none."""
    p = REGISTRY.get(precision)
    return p.zero_copy_graph if p is not None else None


def zero_copy_plan_refusal(source, component: str, precision: str) -> str | None:
    """None when `component` at `precision` builds from its zero-copy graph; otherwise why not."""
    from ..export import zero_copy_refusal

    graph = graph_dtype(precision)
    if graph is None:
        return f"{component} at {precision} is built from the fp32 graph"
    return zero_copy_refusal(source, specs_for(source.geometry, [component])[component], graph)


def _reusable(folder: Path, info_name: str, component: str, inputs: dict, validate: bool) -> dict | None:
    """base.recorded, and every link of the zero-copy graph still reaches its checkpoint file."""
    from ..onnxio import linked_dir

    entry = recorded(folder, info_name, component, inputs, validate)
    links = linked_dir(folder / f"{component}.onnx")
    return entry if entry and links.is_dir() and all(os.path.exists(link) for link in links.iterdir()) else None


def ensure_zero_copy(source, component: str, precision: str, out_root: Path, force: bool, *, on_phase, calib: CalibrationSettings,
                  validate: bool = True):
    """-> (the engine's ONNX, [export, optimize(, quantize) results]) on the zero-copy path."""
    graph = graph_dtype(precision)
    base = Path(out_root) / "onnx" / f"{source.content_hash[:12]}-{graph}-zc"
    step = export_step(source, component, base, graph, zero_copy=True, on_phase=on_phase, reusable=_reusable)
    path, entry, made = run_step(source, component, step, force=force, on_phase=on_phase, validate=validate)
    export_res = StageResult(component, "export", "reused", 0.0, step.reused) if entry else made[0]
    opt_path, opt_res = _ensure_optimized(source, component, graph, path, out_root, force=force, on_phase=on_phase,
                                          validate=validate)
    if not REGISTRY[precision].recipe:
        return opt_path, [export_res, opt_res]
    q_path, quant_res = _ensure_quantized(source, component, precision, opt_path, out_root, force=force, on_phase=on_phase,
                                          calib=calib,
                                          validate=validate)
    return q_path, [export_res, opt_res, quant_res]


def _ensure_optimized(source, component, graph, zc_path, out_root, *, force, on_phase, validate):
    """The graph passes on the zero-copy graph (optimize.graph.optimize_zero_copy): fused, still linked."""
    from ..optimize.graph import optimize_zero_copy
    from ..optimize.passes import DEFAULT_PASSES

    folder = Path(out_root) / "onnx" / f"{source.content_hash[:12]}-{graph}-zc-opt"

    def make() -> Made:
        report = optimize_zero_copy(zc_path, folder / f"{component}.onnx", component)
        nodes = [report.rows[0][1], report.rows[-1][2]]
        return Made(report.path, {"nodes": nodes, "zero_copy": report.zero_copy},
                    f"{nodes[0]} -> {nodes[1]} nodes (zero-copy)", report.zero_copy)

    inputs = {"source_sha256": sha256_file(zc_path), "passes": list(DEFAULT_PASSES), "dtype": graph,
              "fluxtrt": __version__}
    step = Step(stage="optimize", folder=folder, inputs=inputs, make=make, dtype=graph, what="optimized (zero-copy)",
                reused="unchanged zero-copy graph", reusable=_reusable)
    path, entry, made = run_step(source, component, step, force=force, on_phase=on_phase, validate=validate)
    if entry:
        return path, StageResult(component, "optimize", "reused", 0.0, step.reused, info=entry.zero_copy)
    return path, made[0]


def _ensure_quantized(source, component, recipe, zc_path, out_root, *, force, on_phase, calib, validate):
    from ..quantize.zerocopy import quantize_zero_copy

    folder = Path(out_root) / "onnx" / f"{source.content_hash[:12]}-{recipe}-zc"

    def make() -> Made:
        on_phase("calibrate")
        cal = calibrate_zero_copy(source, out_root, calib, lambda d, n: on_phase(f"calibrate {d}/{n} prompts"))
        on_phase("quantize")
        q = quantize_zero_copy(zc_path, folder, recipe, cal.amax, lambda d, n: on_phase(f"quantize {d}/{n} weights"))
        record = {"recipe": recipe, "path": "zero-copy", "calibration": cal.key, "calibration_cached": cal.cached,
                  "calibration_samples": cal.samples, "calibration_file": str(cal.path.relative_to(Path(out_root))),
                  "quantized_layers": q.quantized, "kept_in_high_precision": q.kept, "other_layers": "bf16",
                  f"{recipe}_weight_bytes": q.weight_bytes, "linked_weight_bytes": q.linked_bytes}
        return Made(q.path, {"quantization": record}, f"{q.quantized} {recipe} layers", record)

    inputs = {"source_sha256": sha256_file(zc_path), "recipe": recipe, "fluxtrt": __version__, "qdq_record": 1,
              "calibration": calibration_inputs(calib)}
    step = Step(stage="quantize", folder=folder, inputs=inputs, make=make, dtype=recipe, what="quantized (zero-copy)",
                reused="unchanged zero-copy graph and calibration", reusable=_reusable)
    path, entry, made = run_step(source, component, step, force=force, on_phase=on_phase, validate=validate)
    if entry:
        return path, StageResult(component, "quantize", "reused", 0.0, step.reused, info=entry.quantization)
    return path, made[0]


def calibrate_zero_copy(source, out_root: Path, calib: CalibrationSettings, on_prompt=lambda done, total: None,
                        recipe: str = "fp8"):
    """Module calibration for the zero-copy fp8 and fp4 paths (fp4 reads fp8's ranges), cached in
    OUT/calibration/ (`fluxtrt calibrate` and `fluxtrt build` both come through here); recipe "fp8-attn": the
    attentions' ranges too, for `run --backend torch --calibration` (no zero-copy graph computes it)."""
    import torch

    from ..quantize.calibration import calibrate_modules

    device = calib.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise FluxtrtError("--device cuda: this machine has no CUDA GPU (or this torch has no CUDA); use --device "
                           "cpu, or calibrate on a GPU machine and copy its OUT/calibration/ here")
    return calibrate_modules(source, recipe, Path(out_root) / "calibration", calib.prompts_file,
                             calib.size, steps=calib.steps, opt_resolution=calib.opt_resolution,
                             dtype=graph_dtype("fp8"), device=device, on_prompt=on_prompt)
