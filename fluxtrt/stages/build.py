"""`fluxtrt build`: export -> optimize -> build per component for one GPU config, incremental by content hashes.

Layout under the output root:
  onnx/<model hash[:12]>-fp32/<component>.onnx + export.json     the validated fp32 export
  onnx/<model hash[:12]>-<dtype>-opt/<component>.onnx + optimize.json   optimized, precision placed; both
                                                                  shared by every GPU built from this model
  <gpu>/<component>.engine, manifest.json, build.log (+ timing.cache with full TensorRT)
A stage is skipped when its inputs' hashes match what the previous run recorded and its output file still
has the recorded sha256. Engines are written to a temp name and renamed; the manifest is updated after
each engine, so an interrupted build resumes with the remaining components."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Callable

from .. import __version__
from ..components import TRANSFORMER_PARTS, family, specs_for
from ..core.backends import get_backend
from ..core.workflows import for_model, profile_range
from ..engine.build import build_engine
from ..errors import FluxtrtError
from ..fileio import (
    check_out_folder,
    exclusive_lock,
    peak_rss_mb,
    remove_stale_staging,
    sha256_file,
    sha256_json,
    write_json_atomic,
)
from ..gpus import GpuConfig
from ..models.source import ModelSource
from ..precisions import is_quantized
from ..records import BuildRequest, ComponentEntry, Manifest, ModelRef, read_manifest
from .base import StageResult, unchanged
from .fp32_plan import ensure_fp32_plan
from .zerocopy_plan import ensure_zero_copy, zero_copy_plan_refusal


def ensure_onnx(source: ModelSource, component: str, dtype: str, out_root: Path, force: bool = False,
                *, on_phase: Callable[[str], None] = lambda _: None, calib=None, zero_copy: bool = True,
                validate: bool = True) -> tuple[Path, list[StageResult]]:
    """The component's ONNX for the engine. From a checkpoint stored in the engine's dtype (and `zero_copy`):
    the zero-copy plan (stages/zerocopy_plan.py). Otherwise the fp32 export, then the optimize stage at `dtype`. Each
    step is validated against PyTorch (unless `validate` is off) and reused when its inputs are unchanged."""
    if zero_copy and zero_copy_plan_refusal(source, component, dtype) is None:
        return ensure_zero_copy(source, component, dtype, out_root, force, on_phase=on_phase, calib=calib, validate=validate)
    return ensure_fp32_plan(source, component, dtype, out_root, force, on_phase=on_phase, calib=calib, validate=validate)


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
              *, weight_streaming: bool, weightless: bool = False) -> str:
    return sha256_json({
        "onnx": onnx_sha, "backend": backend, "backend_version": backend_version, "cc": cfg.compute_capability,
        "profile": profile, "weight_streaming": weight_streaming, "level": cfg.builder_optimization_level,
        "fluxtrt": __version__, "weightless": weightless and "strip+refit",
    })


def write_weight_files(onnx_path: Path, gpu_dir: Path, name: str, subfolder: str, quantized: bool) -> dict:
    """The component's weight map (engine weight -> checkpoint tensors) and, when every weight can come from
    a checkpoint, the weight-free ONNX that ONNX Runtime fills from the user's checkpoint at load."""
    from ..core import weightmap
    from ..onnxio import load_onnx

    wmap = weightmap.build_map(load_onnx(onnx_path, load_data=False), name, subfolder, quantized)
    write_json_atomic(gpu_dir / f"{name}.weights.json", wmap)
    out = {"weight_map": f"{name}.weights.json", "refittable": wmap["refittable"]}
    if wmap["refittable"]:
        weightmap.write_weightfree(onnx_path, wmap, gpu_dir / f"{name}.weightfree.onnx")
        out["weightfree_onnx"] = f"{name}.weightfree.onnx"
        out["weightfree_sha256"] = sha256_file(gpu_dir / out["weightfree_onnx"])
    return out


def recorded_recipe(onnx_path: Path, precision: str) -> dict | None:
    """The recipe's numbers the manifest carries, so that a runtime needs no build ONNX to compute it (fp8: the
    scales by module that the graph's Q/DQ hold, which the torch executor applies to the model's weights; fp8-attn:
    its attentions' scales too)."""
    if precision not in ("fp8", "fp8-attn"):
        return None
    from ..fp8 import attention_scales_from_graph, recipe_record, scales_from_graph
    from ..onnxio import load_header

    header = load_header(onnx_path)
    return recipe_record(scales_from_graph(header),
                         attention_scales_from_graph(header) if precision == "fp8-attn" else None)


def build_gpu(source: ModelSource, cfg: GpuConfig, request: BuildRequest | Path, *,
              progress: Callable[[str, str], None] = lambda c, p: None, **fields) -> tuple[Manifest, list[StageResult]]:
    """Build (or reuse) every requested component's engine for one GPU config: the request's components into
    request.out_dir (a Path instead of a request: the build root, with **fields the request's other fields).
    `zero_copy`: from the checkpoint's own bytes where it is stored in the engine's dtype (zerocopy_plan);
    `validate`: every ONNX against PyTorch (off for models whose fp32 copy does not fit in memory);
    `first_block_cache`: also the transformer's First-Block Cache parts (head, tail, out: stepcache.py), each at
    the transformer's precision and profile. Returns (manifest, stage results)."""
    request = request if isinstance(request, BuildRequest) else BuildRequest.of(out_dir=request, **fields)
    out_root = request.out_dir
    backend = check_target(cfg)
    names = list(request.components or specs_for(source.geometry))
    if request.first_block_cache:
        if "transformer" not in names:
            raise FluxtrtError("--first-block-cache splits the transformer: build it too (--components transformer)")
        names += [p for p in TRANSFORMER_PARTS if p not in names]
    specs = specs_for(source.geometry, names)
    rng = cfg.shape_range(request.static_shape)
    gpu_dir = Path(out_root) / cfg.key
    check_out_folder(Path(out_root))
    check_same_model(gpu_dir, source, force=request.force)
    new_dir = not gpu_dir.exists()
    gpu_dir.mkdir(parents=True, exist_ok=True)
    try:
        return _build_locked(source, cfg, request, backend=backend, specs=specs, rng=rng, gpu_dir=gpu_dir,
                             progress=progress)
    except BaseException as e:
        _after_failure(e, gpu_dir, new_dir, Path(out_root))
        raise


class CompiledTorch:
    """The target of compiled PyTorch engines (stages/package.py): the device they are compiled on here and the
    runtime they need, where a TensorRT backend stands for TensorRT engines."""

    name = "torch"

    def __init__(self, compute_capability: str):
        from ..core.packages import package_runtime
        from ..engine.aoti import check_target, cxx_compiler

        self.device = check_target(compute_capability)
        self.runtime = dict(package_runtime(self.device), **{"libstdc++": cxx_compiler()[1]})
        self.version = self.runtime["torch"]


def check_target(cfg: GpuConfig):
    """The config's backend, checked against its target before any work."""
    if cfg.backend == "torch":
        return CompiledTorch(cfg.compute_capability)
    backend = get_backend(cfg.backend)
    backend.check_target(cfg.compute_capability)
    return backend


def check_same_model(gpu_dir: Path, source: ModelSource, *, force: bool) -> None:
    """A GPU folder holding another model's engines is never replaced silently: refused unless `force`. The same
    model is the same name (its weights may have changed) or the same content (under another path)."""
    old = read_manifest(gpu_dir, required=False)
    if force or old is None or not old.components:
        return
    if old.model.id != source.id and old.model.hash != source.content_hash:
        raise FluxtrtError(f"{gpu_dir} holds engines of {old.model.id}, not {source.id}: pass another --out (nothing "
                           "was replaced), or --force to replace them")


def _after_failure(e: BaseException, gpu_dir: Path, new_dir: bool, out_root: Path) -> None:
    """A failed build leaves no new GPU folder without engines; one that keeps engines (the next build resumes
    from them) or the finished ONNX stages says so in its error line."""
    done = read_manifest(gpu_dir, required=False)
    n = len(done.components) if done is not None else 0
    if new_dir and n == 0:
        shutil.rmtree(gpu_dir, ignore_errors=True)
    if isinstance(e, FluxtrtError) and e.args:
        kept = [f"{gpu_dir} with {n} finished engine(s)"] if n else []
        kept += [f"{out_root / 'onnx'} (finished stages)"] if (out_root / "onnx").is_dir() else []
        if kept:
            e.args = (f"{e.args[0]} (kept {' and '.join(kept)}: the next build reuses them)", *e.args[1:])


def _build_locked(source, cfg, request: BuildRequest, *, backend, specs, rng, gpu_dir, progress):
    out_root = request.out_dir
    with exclusive_lock(Path(out_root)):
        remove_stale_staging(Path(out_root))
        calib = request.calibration.replace(opt_resolution=rng.opt.height)
        manifest = _new_manifest(source, cfg, backend, rng, gpu_dir)
        results = []
        copy_model_assets(source, gpu_dir)
        manifest.pending = list(specs)  # until each is built: `inspect` and `run` name what a stopped build lacks
        manifest.write(gpu_dir)
        with open(gpu_dir / "build.log", "a") as log:
            log.write(f"== fluxtrt {__version__} build {cfg.key} ({backend.name} {backend.version}) "
                      f"model {source.id} at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            log.flush()
            try:
                _build_each(source, cfg, request, specs=specs, backend=backend, rng=rng, gpu_dir=gpu_dir,
                            progress=progress, calib=calib, manifest=manifest, results=results, log=log)
            except BaseException as e:  # Ctrl-C, SIGTERM, an error: the log says where the build stopped
                log.write(f"== stopped ({type(e).__name__}: {str(e)[:200]}); not built: {', '.join(manifest.pending)}\n")
                raise
        manifest.write(gpu_dir)
        return manifest, results


def _build_each(source, cfg, request: BuildRequest, *, specs, backend, rng, gpu_dir, progress, calib, manifest,
                results, log) -> None:
    out_root = request.out_dir
    for name, spec in specs.items():
        on_phase = lambda p, n=name: progress(n, p)  # noqa: E731
        if isinstance(backend, CompiledTorch):
            from .package import package_stage

            results.append(package_stage(source, cfg, request, spec=spec, rng=rng, manifest=manifest, gpu_dir=gpu_dir,
                                         log=log, on_phase=on_phase, calib=calib, device=backend.device,
                                         runtime=backend.runtime))
            manifest.pending.remove(name)
            manifest.write(gpu_dir)
            continue
        onnx_path, res = ensure_onnx(source, name, cfg.precision[family(name)], out_root, request.force,
                                     on_phase=on_phase, calib=calib, zero_copy=request.zero_copy,
                                     validate=request.validate)
        results.extend(res)
        results.append(_engine_stage(source, cfg, request, spec=spec, backend=backend, rng=rng,
                                     onnx_path=onnx_path, res=res, manifest=manifest, gpu_dir=gpu_dir,
                                     log=log, on_phase=on_phase))
        manifest.pending.remove(name)
        manifest.write(gpu_dir)


def _new_manifest(source, cfg, backend, rng, gpu_dir) -> Manifest:
    """The manifest to fill, keeping the entries of an earlier build of the same model in this folder."""
    old = read_manifest(gpu_dir, required=False)
    keep = old.components if old is not None and old.model.hash == source.content_hash else {}
    return Manifest(
        fluxtrt=__version__, backend=backend.name, backend_version=backend.version, gpu=cfg.key, gpu_name=cfg.name,
        compute_capability=cfg.compute_capability, config_hash=cfg.config_hash, vram_gb=cfg.vram_gb,
        model=ModelRef(source.id, source.content_hash, source.variant, source.geometry.model_class),
        workflows=[w.name for w in for_model(source.geometry)], static_shape=rng.min == rng.max,
        shape_range={k: [p.batch, p.height, p.width] for k, p in zip(("min", "opt", "max"), (rng.min, rng.opt, rng.max))},
        pixel_multiple=source.geometry.pixel_multiple, components=dict(keep),
        runtime=getattr(backend, "runtime", None))


def _engine_stage(source, cfg, request: BuildRequest, *, spec, backend, rng, onnx_path, res, manifest, gpu_dir, log,
                  on_phase) -> StageResult:
    """The engine build stage: its inputs are the ONNX's hash, the target, the profile and the backend version
    (build_key); reused when they match the manifest's entry and the engine file still has its sha256."""
    name, geo, dtype = spec.name, source.geometry, cfg.precision[family(spec.name)]
    onnx_sha = sha256_file(onnx_path)
    ws = family(name) in cfg.weight_streaming
    rng = profile_range(geo, family(name), rng)  # e.g. Kontext: the transformer's tokens cover target + reference
    profile = spec.profile(rng, geo)
    key = build_key(onnx_sha, backend.name, backend.version, cfg, profile, weight_streaming=ws, weightless=request.weightless)
    engine_path = gpu_dir / f"{name}.engine"
    prev = manifest.components.get(name)
    if not request.force and prev is not None and unchanged(engine_path, prev.sha256, {"build_key": prev.build_key},
                                                            {"build_key": key}):
        on_phase("reused")
        return StageResult(name, "build", "reused", 0.0, "same ONNX, config and backend")
    on_phase("build")
    t0 = time.perf_counter()
    built = build_engine(backend, onnx_path, spec, geo, rng, compute_capability=cfg.compute_capability,
                         engine_path=engine_path, weight_streaming=ws,
                         optimization_level=cfg.builder_optimization_level, timing_cache=gpu_dir / "timing.cache",
                         log_file=log, weightless=request.weightless)
    seconds = time.perf_counter() - t0
    result = StageResult(component=name, stage="build", status="built", seconds=seconds,
                         detail=f"{built.layers} layers ({built.computed_layers} computed)",
                         bytes_written=built.bytes, peak_rss_mb=peak_rss_mb())
    manifest.components[name] = ComponentEntry(
        engine=engine_path.name, sha256=built.sha256, bytes=built.bytes, precision=dtype,
        onnx=str(onnx_path.relative_to(Path(gpu_dir).parent)), onnx_sha256=onnx_sha, build_key=key,
        weight_streaming=ws, layers=built.layers, computed_layers=built.computed_layers, inputs=built.inputs,
        outputs=built.outputs, profile=built.profile, memory=built.memory,
        build_seconds=round(seconds, 3), peak_rss_mb=round(peak_rss_mb(), 1),
        stages={r.stage: r.footprint() for r in [*res, result]},
        quantization=next((r.info for r in res if r.info and r.stage == "quantize"), None), weightless=request.weightless,
        recipe=recorded_recipe(onnx_path, dtype),
        **write_weight_files(onnx_path, gpu_dir, name, spec.subfolder, is_quantized(dtype)))
    manifest.write(gpu_dir)  # after each engine: an interrupted build resumes with the rest
    log.write(f"built {name}: {built.layers} layers ({built.computed_layers} computed), {built.bytes} bytes, "
              f"{seconds:.1f} s\n")
    on_phase("done")
    return result
