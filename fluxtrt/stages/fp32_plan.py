"""The copying (fp32) plan: export the fp32 graph, run the graph passes at the engine's dtype, and for
quantized recipes calibrate and insert Q/DQ. Every step is recorded beside its output and reused when its
inputs are unchanged (stages/base.py)."""

from __future__ import annotations

import time
from pathlib import Path

from .. import __version__
from ..fileio import peak_rss_mb, sha256_file
from ..precisions import REGISTRY, is_quantized
from .base import (
    Made,
    StageResult,
    Step,
    calibration_inputs,
    export_step,
    run_step,
)


def ensure_fp32_plan(source, component: str, dtype: str, out_root: Path, force: bool, *, on_phase, calib,
                     validate: bool = True):
    """-> (the engine's ONNX, [export, optimize(, quantize) results]) on the copying path."""
    fp32_path, export_res = _ensure_export(source, component, out_root, force, on_phase, validate=validate)
    opt_path, opt_res = _ensure_optimized(source, component, dtype, fp32_path, out_root, force=force,
                                          on_phase=on_phase, calib=calib, validate=validate)
    return opt_path, [export_res, *opt_res]


def onnx_dir_for(out_root: Path, source, dtype: str) -> Path:
    return Path(out_root) / "onnx" / f"{source.content_hash[:12]}-{dtype}"


def _ensure_export(source, component, out_root, force, on_phase, *, validate: bool = True):
    step = export_step(source, component, onnx_dir_for(out_root, source, "fp32"), "fp32", zero_copy=False,
                       on_phase=on_phase)
    path, entry, made = run_step(source, component, step, force=force, on_phase=on_phase, validate=validate)
    return path, (StageResult(component, "export", "reused", 0.0, step.reused) if entry else made[0])


def _ensure_optimized(source, component, dtype, fp32_path, out_root, *, force, on_phase, calib=None,
                      validate: bool = True):
    """Optimize passes, then (for fp8 / int8-wo / int4-wo) calibration and Q/DQ, then precision placement."""
    from ..optimize.passes import DEFAULT_PASSES

    folder = Path(out_root) / "onnx" / f"{source.content_hash[:12]}-{dtype}-opt"
    from ..optimize.placement import PLACEMENT_VERSION

    inputs = {"source_sha256": sha256_file(fp32_path), "passes": list(DEFAULT_PASSES), "dtype": dtype,
              "fluxtrt": __version__, "placement": PLACEMENT_VERSION}
    if is_quantized(dtype):
        from ..fp8 import RECIPE_VERSION

        inputs["recipe_version"] = RECIPE_VERSION  # 2: fp8 weights and scales as the zero-copy path's (fp8.py)
        # weight-only recipes read no prompts: only a calibrated recipe depends on them
        inputs["calibration"] = calibration_inputs(calib) if REGISTRY[dtype].calibrated else None

    def make() -> Made:
        out_path, report, quant, quant_seconds = optimize_component(source, component, dtype, fp32_path, folder,
                                                                    out_root=out_root, calib=calib, on_phase=on_phase)
        nodes = [report.rows[0][1], report.rows[-1][2]]
        extra = [] if quant is None else [  # calibration + Q/DQ, timed inside; its bytes are the optimize output's
            StageResult(component=component, stage="quantize", status="built", seconds=quant_seconds,
                        detail=f"{quant['quantized_layers']} layers {dtype}",
                        bytes_written=0, peak_rss_mb=peak_rss_mb(), info=quant)]
        return Made(out_path, {"nodes": nodes, "quantization": quant}, f"{nodes[0]} -> {nodes[1]} nodes",
                    extra=extra, seconds_excluded=quant_seconds)

    step = Step(stage="optimize", folder=folder, inputs=inputs, make=make, dtype=dtype, what="optimized",
                reused="unchanged ONNX")
    path, entry, made = run_step(source, component, step, force=force, on_phase=on_phase, validate=validate)
    if not entry:
        return path, made
    res = [StageResult(component, "optimize", "reused", 0.0, step.reused)]
    if is_quantized(dtype):
        res.append(StageResult(component, "quantize", "reused", 0.0, "unchanged ONNX and calibration",
                               info=entry.quantization))
    return path, res


def optimize_component(source, component, dtype, fp32_path, folder, *, out_root, calib, on_phase):
    """-> (path, optimize report, quantization record or None, seconds spent calibrating and quantizing).
    Quantized recipes: passes at fp32, calibrate (fp8, cached), insert Q/DQ, then place everything else in bf16."""
    from ..onnxio import load_onnx
    from ..optimize.graph import optimize_model, save_model
    from ..optimize.placement import place_precision

    if not is_quantized(dtype):
        from ..optimize.graph import optimize_file

        report = optimize_file(fp32_path, folder / f"{component}.onnx", component, dtype=dtype, count_layers=False)
        return report.path, report, None, 0.0
    from ..quantize.qdq import quantize_model

    model, report = optimize_model(load_onnx(fp32_path), None, "fp32", component)
    record = {"recipe": dtype}
    amax = channel = None
    t0 = time.perf_counter()
    if REGISTRY[dtype].calibrated:
        on_phase("calibrate")
        cal = calibrate_graph(source, model, dtype, out_root, calib)
        amax, channel = cal.amax, cal.channel_amax
        record.update(calibration=cal.key, calibration_cached=cal.cached, calibration_samples=cal.samples,
                      calibration_file=str(cal.path.relative_to(Path(out_root))))
    on_phase("quantize")
    alpha = calib.alpha
    model, plan = quantize_model(model, dtype, amax, alpha=alpha, channel_amax=channel)
    quant_seconds = time.perf_counter() - t0
    if dtype == "int8":
        record["smoothquant_alpha"] = alpha
    if plan.attention:
        record["fp8_attention_matmuls"] = len(plan.attention)
    model = place_precision(model, "bf16", component)
    record.update(quantized_layers=len(plan.quantized), kept_in_high_precision=plan.kept,
                  other_layers="bf16")
    path = folder / f"{component}.onnx"
    save_model(model, path)
    return path, report, record, quant_seconds


def calibrate_graph(source, model, recipe: str, out_root: Path, calib):
    """Calibration of the optimized fp32 transformer `model`, cached in OUT/calibration/ under a key that
    includes the graph's hash: `fluxtrt calibrate` and `fluxtrt build` both come through here, so one fills
    the cache the other reads."""
    import hashlib

    from ..quantize.calibration import calibrate

    return calibrate(source, model, hashlib.sha256(model.SerializeToString()).hexdigest(), recipe,
                     Path(out_root) / "calibration", prompts_file=calib.prompts_file, size=calib.size,
                     steps=calib.steps, opt_resolution=calib.opt_resolution)


def optimized_fp32_transformer(source, out_root: Path):
    """The transformer's validated fp32 export (reused if present) through the default passes, in memory."""
    from ..onnxio import load_onnx
    from ..optimize.graph import optimize_model

    fp32_path, _ = _ensure_export(source, "transformer", out_root, False, lambda p: None)
    return optimize_model(load_onnx(fp32_path), None, "fp32", "transformer")[0]

