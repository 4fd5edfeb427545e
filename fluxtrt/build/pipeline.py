"""`fluxtrt build`: export -> optimize -> build per component for one GPU config, incremental by content hashes.

Layout under the output root:
  onnx/<model hash[:12]>-fp32/<component>.onnx + export.json     the validated fp32 export
  onnx/<model hash[:12]>-<dtype>-opt/<component>.onnx + optimize.json   optimized, precision placed; both
                                                                  shared by every GPU built from this model
  <gpu>/<component>.engine, manifest.json, build.log, timing.cache
A stage is skipped when its inputs' hashes match what the previous run recorded and its output file still
has the recorded sha256. Engines are written to a temp name and renamed; the manifest is updated after
each engine, so an interrupted build resumes with the remaining components."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import __version__
from ..components import specs_for
from ..errors import FluxtrtError
from ..export import DEFAULT_OPSET, EXPORT_INFO, export_component, write_export_info
from ..fileio import (
    exclusive_lock,
    peak_rss_mb,
    remove_stale_staging,
    sha256_file,
    sha256_json,
    write_json_atomic,
)
from ..gpus import QUANTIZED, GpuConfig
from ..models.source import ModelSource
from .backends import get_backend
from .engine import build_engine
from .manifest import MANIFEST, SCHEMA, read_manifest


@dataclass
class StageResult:
    component: str
    stage: str  # "export", "optimize", "quantize" (quantized precisions) or "build"
    status: str  # "built", "reused", "skipped" (no graph passes on the zero-copy path)
    seconds: float
    detail: str = ""
    bytes_written: int = 0
    peak_rss_mb: float = 0.0  # the process's peak RSS when the stage ended (a running maximum)
    info: dict | None = None  # quantize: the quantization record (recipe, calibration, kept layers)

    def footprint(self) -> dict:
        return {"status": self.status, "seconds": round(self.seconds, 3), "bytes_written": self.bytes_written,
                "peak_rss_mb": round(self.peak_rss_mb, 1)}


def _files_bytes(onnx_path: Path) -> int:
    """Bytes of an ONNX file and its external data."""
    data = Path(f"{onnx_path}.data")
    return onnx_path.stat().st_size + (data.stat().st_size if data.exists() else 0)


def onnx_dir_for(out_root: Path, source: ModelSource, dtype: str) -> Path:
    return Path(out_root) / "onnx" / f"{source.content_hash[:12]}-{dtype}"


def ensure_onnx(source: ModelSource, component: str, dtype: str, out_root: Path, force: bool = False,
                on_phase: Callable[[str], None] = lambda _: None, calib=None, zero_copy: bool = True,
                validate: bool = True) -> tuple[Path, list[StageResult]]:
    """The component's ONNX for the engine. From a checkpoint stored in the engine's dtype (and `zero_copy`):
    the zero-copy path (build/native.py). Otherwise the fp32 export, then the optimize stage at `dtype`. Each
    step is validated against PyTorch (unless `validate` is off) and reused when its inputs are unchanged."""
    from .native import ensure_native, native_refusal

    if zero_copy and native_refusal(source, component, dtype) is None:
        return ensure_native(source, component, dtype, out_root, force, on_phase, dict(calib or {}), validate)
    fp32_path, export_res = _ensure_export(source, component, out_root, force, on_phase, validate)
    opt_path, opt_res = _ensure_optimized(source, component, dtype, fp32_path, out_root, force, on_phase, calib,
                                          validate)
    return opt_path, [export_res, *opt_res]


def recorded(folder: Path, info_name: str, component: str, inputs: dict, validate: bool = False) -> dict | None:
    """The entry recorded for `component` in `folder/info_name` if the stage can be reused: the inputs match
    (an optimize.json entry's own `inputs`, or export.json's top-level fields), its file still has the recorded
    hash, and — when `validate` asks for it — it was validated against PyTorch."""
    info_path = folder / info_name
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    entry = info.get("components", {}).get(component)
    path = folder / f"{component}.onnx"
    if not entry or not path.exists() or sha256_file(path) != entry["sha256"]:
        return None
    if any(entry.get("inputs", info).get(k) != v for k, v in inputs.items()):
        return None
    return None if validate and entry.get("max_rel_err") is None else entry


def export_inputs(model_hash: str) -> dict:
    """What an export depends on, as export.json records it (recorded() compares them)."""
    return {"model_hash": model_hash, "fluxtrt": __version__, "opset": DEFAULT_OPSET}


def validation_text(max_err: float | None) -> str:
    return f"max rel err {max_err:.1e}" if max_err is not None else "not validated"


def record_entry(folder: Path, component: str, entry: dict) -> None:
    """Set `component`'s entry in `folder/optimize.json` (written atomically)."""
    info_path = folder / OPTIMIZE_INFO
    info = json.loads(info_path.read_text()) if info_path.exists() else {"components": {}}
    info["components"][component] = entry
    write_json_atomic(info_path, info)


def _ensure_export(source, component, out_root, force, on_phase, validate: bool = True):
    folder = onnx_dir_for(out_root, source, "fp32")
    inputs = export_inputs(source.content_hash)
    if not force and recorded(folder, EXPORT_INFO, component, inputs, validate):
        return folder / f"{component}.onnx", StageResult(component, "export", "reused", 0.0,
                                                         "unchanged model and exporter")
    on_phase("export")
    spec = specs_for(source.geometry, [component])[component]
    res = export_component(source, spec, folder, "fp32", validate=validate, on_phase=on_phase)
    write_export_info(folder, source, "fp32", DEFAULT_OPSET, [res])
    return res.path, StageResult(component, "export", "built", res.seconds, validation_text(res.max_rel_err),
                                 res.bytes, peak_rss_mb())


OPTIMIZE_INFO = "optimize.json"


def _ensure_optimized(source, component, dtype, fp32_path, out_root, force, on_phase, calib=None,
                      validate: bool = True):
    """Optimize passes, then (for fp8 / int8-wo / int4-wo) calibration and Q/DQ, then precision placement."""
    from ..gpus import QUANTIZED
    from ..optimize.passes import DEFAULT_PASSES

    calib = dict(calib or {})
    folder = Path(out_root) / "onnx" / f"{source.content_hash[:12]}-{dtype}-opt"
    inputs = {"source_sha256": sha256_file(fp32_path), "passes": list(DEFAULT_PASSES), "dtype": dtype,
              "fluxtrt": __version__}
    if dtype in QUANTIZED:
        from ..quantize.calibration import DEFAULT_PROMPTS

        prompts = Path(calib.get("prompts_file") or DEFAULT_PROMPTS)
        inputs["calibration"] = {"prompts_sha256": sha256_file(prompts), "size": calib.get("size", 32),
                                 "steps": calib.get("steps", 4), "alpha": calib.get("alpha", 0.5)}
    entry = None if force else recorded(folder, OPTIMIZE_INFO, component, inputs, validate)
    if entry:
        res = [StageResult(component, "optimize", "reused", 0.0, "unchanged ONNX")]
        if dtype in QUANTIZED:
            res.append(StageResult(component, "quantize", "reused", 0.0, "unchanged ONNX and calibration",
                                   info=entry.get("quantization")))
        return folder / f"{component}.onnx", res
    on_phase("optimize")
    t0 = time.perf_counter()
    out_path, report, quant, quant_seconds = optimize_component(source, component, dtype, fp32_path, folder,
                                                                out_root, calib, on_phase)
    max_err = None
    if validate:
        on_phase("validate")
        try:
            max_err = validate_against_pytorch(source, component, out_path, dtype, "optimized")
        except FluxtrtError:
            out_path.unlink()
            raise
    record_entry(folder, component, {"inputs": inputs, "sha256": sha256_file(out_path), "max_rel_err": max_err,
                                     "nodes": [report.rows[0][1], report.rows[-1][2]], "quantization": quant})
    seconds = time.perf_counter() - t0 - quant_seconds
    res = [StageResult(component, "optimize", "built", seconds,
                       f"{report.rows[0][1]} -> {report.rows[-1][2]} nodes, {validation_text(max_err)}",
                       _files_bytes(out_path), peak_rss_mb())]
    if quant is not None:  # calibration + Q/DQ, timed inside the optimize stage; its bytes are the optimize output's
        res.append(StageResult(component, "quantize", "built", quant_seconds,
                               f"{quant['quantized_layers']} layers {dtype}", 0, peak_rss_mb(), quant))
    return out_path, res


def validate_against_pytorch(source, component: str, onnx_path: Path, dtype: str, what: str) -> float:
    """ONNX Runtime on `onnx_path` vs the fp32 PyTorch module loaded from the checkpoint, at `dtype`'s bound;
    returns the max relative error or raises."""
    from ..export import export_patches
    from ..validate import validate_onnx

    spec = specs_for(source.geometry, [component])[component]
    module = spec.wrap(source.load_component(spec.subfolder)).eval()
    with export_patches(module):
        check = validate_onnx(onnx_path, module, spec, source.geometry, dtype)
    if not check.ok:
        raise FluxtrtError(f"{what} {component} ({dtype}) disagrees with PyTorch: " + "; ".join(check.failures()))
    return check.max_rel_err


def optimize_component(source, component, dtype, fp32_path, folder, out_root, calib, on_phase):
    """-> (path, optimize report, quantization record or None, seconds spent calibrating and quantizing).
    Quantized recipes: passes at fp32, calibrate (fp8, cached), insert Q/DQ, then place everything else in bf16."""
    from ..gpus import QUANTIZED
    from ..onnxio import load_onnx
    from ..optimize.pipeline import optimize_model, save_model
    from ..optimize.precision import place_precision

    if dtype not in QUANTIZED:
        from ..optimize.pipeline import optimize_file

        report = optimize_file(fp32_path, folder / f"{component}.onnx", component, dtype=dtype, count_layers=False)
        return report.path, report, None, 0.0
    from ..quantize.qdq import CALIBRATED, quantize_model

    model, report = optimize_model(load_onnx(fp32_path), None, "fp32", component)
    record = {"recipe": dtype}
    amax = channel = None
    t0 = time.perf_counter()
    if dtype in CALIBRATED:
        on_phase("calibrate")
        cal = calibrate_graph(source, model, dtype, out_root, calib)
        amax, channel = cal.amax, cal.channel_amax
        record.update(calibration=cal.key, calibration_cached=cal.cached, calibration_samples=cal.samples,
                      calibration_file=str(cal.path.relative_to(Path(out_root))))
    on_phase("quantize")
    alpha = calib.get("alpha", 0.5)
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


def calibrate_graph(source, model, recipe: str, out_root: Path, calib: dict):
    """Calibration of the optimized fp32 transformer `model`, cached in OUT/calibration/ under a key that
    includes the graph's hash: `fluxtrt calibrate` and `fluxtrt build` both come through here, so one fills
    the cache the other reads."""
    import hashlib

    from ..quantize.calibration import calibrate

    return calibrate(source, model, hashlib.sha256(model.SerializeToString()).hexdigest(), recipe,
                     Path(out_root) / "calibration", calib.get("prompts_file"), calib.get("size", 32),
                     calib.get("steps", 4), calib.get("opt_resolution", 1024))


def optimized_fp32_transformer(source, out_root: Path):
    """The transformer's validated fp32 export (reused if present) through the default passes, in memory."""
    from ..onnxio import load_onnx
    from ..optimize.pipeline import optimize_model

    fp32_path, _ = _ensure_export(source, "transformer", out_root, False, lambda p: None)
    return optimize_model(load_onnx(fp32_path), None, "fp32", "transformer")[0]


ASSET_DIRS = ("tokenizer", "tokenizer_2", "scheduler")
ASSET_CONFIGS = ("text_encoder", "text_encoder_2", "transformer", "vae")


def copy_model_assets(source: ModelSource, gpu_dir: Path) -> None:
    """Tokenizers, scheduler and component configs (no weights) beside the engines: `fluxtrt run` needs
    nothing else from the model folder."""
    import shutil

    from ..fileio import staging_dir

    with staging_dir(gpu_dir, "model") as tmp:
        for d in ASSET_DIRS:
            shutil.copytree(source.path / d, tmp / d)
        for c in ASSET_CONFIGS:
            (tmp / c).mkdir()
            shutil.copy2(source.path / c / "config.json", tmp / c / "config.json")
        shutil.copy2(source.path / "model_index.json", tmp / "model_index.json")
        final = gpu_dir / "model"
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        tmp.mkdir()  # staging_dir removes it again


def build_key(onnx_sha: str, backend: str, backend_version: str, cfg: GpuConfig, profile: dict,
              weight_streaming: bool, weightless: bool = False) -> str:
    return sha256_json({
        "onnx": onnx_sha, "backend": backend, "backend_version": backend_version, "cc": cfg.compute_capability,
        "profile": profile, "weight_streaming": weight_streaming, "level": cfg.builder_optimization_level,
        "fluxtrt": __version__, "weightless": weightless,
    })


def write_weight_files(onnx_path: Path, gpu_dir: Path, name: str, subfolder: str, quantized: bool) -> dict:
    """The component's weight map (engine weight -> checkpoint tensors) and, when every weight can come from
    a checkpoint, the weight-free ONNX that ONNX Runtime fills from the user's checkpoint at load."""
    from .. import weightmap
    from ..onnxio import load_onnx

    wmap = weightmap.build_map(load_onnx(onnx_path, load_data=False), name, subfolder, quantized)
    write_json_atomic(gpu_dir / f"{name}.weights.json", wmap)
    out = {"weight_map": f"{name}.weights.json", "refittable": wmap["refittable"]}
    if wmap["refittable"]:
        weightmap.write_weightfree(onnx_path, wmap, gpu_dir / f"{name}.weightfree.onnx")
        out["weightfree_onnx"] = f"{name}.weightfree.onnx"
        out["weightfree_sha256"] = sha256_file(gpu_dir / out["weightfree_onnx"])
    return out


def build_gpu(source: ModelSource, cfg: GpuConfig, out_root: Path, components=None, static: bool | None = None,
              force: bool = False, progress: Callable[[str, str], None] = lambda c, p: None,
              calibration: dict | None = None, weightless: bool = False, zero_copy: bool = True,
              validate: bool = True) -> tuple[dict, list]:
    """Build (or reuse) every requested component's engine for one GPU config. Returns (manifest, stage results).
    `zero_copy`: build from the checkpoint's own bytes where it is stored in the engine's dtype (native.py);
    `validate`: check every ONNX against PyTorch (off for models whose fp32 copy does not fit in memory)."""
    backend = get_backend(cfg.backend)
    backend.check_target(cfg.compute_capability)
    geo = source.geometry
    specs = specs_for(geo, components)
    rng = cfg.shape_range(static)
    gpu_dir = Path(out_root) / cfg.key
    gpu_dir.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(Path(out_root)):
        remove_stale_staging(Path(out_root))
        calib = dict(calibration or {}, opt_resolution=rng.opt.height)
        return _build_locked(source, cfg, out_root, gpu_dir, backend, geo, specs, rng, force, progress, calib,
                             weightless, zero_copy, validate)


def _build_locked(source, cfg, out_root, gpu_dir, backend, geo, specs, rng, force, progress, calib, weightless,
                  zero_copy, validate):
    old = read_manifest(gpu_dir, required=False) or {}
    if old.get("model", {}).get("hash") not in (None, source.content_hash):
        old = {}  # another model was built here before: nothing of it can be reused
    manifest = {
        "schema": SCHEMA, "fluxtrt": __version__, "backend": backend.name, "backend_version": backend.version,
        "gpu": cfg.key, "gpu_name": cfg.name, "compute_capability": cfg.compute_capability, "config_hash": cfg.config_hash,
        "vram_gb": cfg.vram_gb,
        "model": {"id": source.id, "hash": source.content_hash, "variant": source.variant},
        "static_shape": rng.min == rng.max,
        "shape_range": {k: [p.batch, p.height, p.width] for k, p in zip(("min", "opt", "max"), (rng.min, rng.opt, rng.max))},
        "pixel_multiple": geo.pixel_multiple,
        "components": dict(old.get("components", {})),
    }
    results = []
    copy_model_assets(source, gpu_dir)
    with open(gpu_dir / "build.log", "a") as log:
        log.write(f"== fluxtrt {__version__} build {cfg.key} ({backend.name} {backend.version}) "
                  f"model {source.id} at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        for name, spec in specs.items():
            dtype = cfg.precision[name]
            onnx_path, res = ensure_onnx(source, name, dtype, out_root, force, lambda p, n=name: progress(n, p), calib,
                                         zero_copy, validate)
            results.extend(res)
            quantization = next((r.info for r in res if r.info), None)
            onnx_sha = sha256_file(onnx_path)
            ws = name in cfg.weight_streaming
            profile = spec.profile(rng, geo)
            key = build_key(onnx_sha, backend.name, backend.version, cfg, profile, ws, weightless)
            engine_path = gpu_dir / f"{name}.engine"
            prev = manifest["components"].get(name, {})
            if (not force and prev.get("build_key") == key and engine_path.exists()
                    and sha256_file(engine_path) == prev.get("sha256")):
                results.append(StageResult(name, "build", "reused", 0.0, "same ONNX, config and backend"))
                progress(name, "reused")
                continue  # the manifest keeps the footprint measured when the engine was built
            progress(name, "build")
            t0 = time.perf_counter()
            built = build_engine(backend, onnx_path, spec, geo, rng, cfg.compute_capability, engine_path, ws,
                                 cfg.builder_optimization_level, gpu_dir / "timing.cache", log, weightless)
            seconds = time.perf_counter() - t0
            res.append(StageResult(name, "build", "built", seconds, f"{built.layers} layers", built.bytes,
                                   peak_rss_mb()))
            results.append(res[-1])
            manifest["components"][name] = {
                "engine": engine_path.name, "sha256": built.sha256, "bytes": built.bytes,
                "precision": dtype, "onnx": str(onnx_path.relative_to(Path(out_root))), "onnx_sha256": onnx_sha,
                "build_key": key, "weight_streaming": ws, "layers": built.layers,
                "inputs": built.inputs, "outputs": built.outputs, "profile": built.profile,
                "build_seconds": round(seconds, 3), "peak_rss_mb": round(peak_rss_mb(), 1),
                "stages": {r.stage: r.footprint() for r in res},
                "quantization": quantization, "weightless": weightless,
                **write_weight_files(onnx_path, gpu_dir, name, spec.subfolder, dtype in QUANTIZED),
            }
            write_json_atomic(gpu_dir / MANIFEST, manifest)
            log.write(f"built {name}: {built.layers} layers, {built.bytes} bytes, {seconds:.1f} s\n")
            progress(name, "done")
    write_json_atomic(gpu_dir / MANIFEST, manifest)
    return manifest, results
