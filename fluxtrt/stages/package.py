"""The compiled-PyTorch engine stage (`fluxtrt build --backend torch`, or a config with `backend: torch`): each
component's PyTorch module, at the config's precision (the fp8 recipe applied from a calibration), compiled into an
AOTInductor package `<component>.pt2` (engine/aoti.py) beside the usual manifest. No ONNX is made: the package is
traced from the same wrapped module (`ComponentSpec.wrap`) the ONNX export traces. Reused, like an engine, while
its build key (model content, precision, profile, recipe, torch and device) is unchanged and the file keeps its
sha256."""

from __future__ import annotations

import time
from pathlib import Path

from .. import __version__
from ..components import family
from ..core.workflows import profile_range
from ..dtypes import torch_dtype
from ..fileio import peak_rss_mb, sha256_json, tree_sha256
from ..records import ComponentEntry
from .base import StageResult, calibration_inputs, unchanged


def module_dtype(precision: str, device: str) -> str:
    """What the package computes in: the precision itself, or the fp8 recipe's other layers (bf16 on a GPU; on a
    CPU fp32, as the torch executor emulates the recipe there)."""
    from ..precisions import REGISTRY

    p = REGISTRY[precision]
    return (p.rest if device == "cuda" else "fp32") if p.recipe else precision


def fp8_scales(source, calib, out_root: Path, raw, *, device: str, dtype: str, recipe: str = "fp8") -> tuple:
    """The fp8 recipe's scales for the transformer (and its First-Block Cache parts alike): calibrated ranges by
    module (OUT/calibration/, as `fluxtrt calibrate` leaves them; measured now if not there), applied to the
    module's weights, projections grouped as the whole transformer joins them: ({module: (sx, sw)}, attention),
    attention (`recipe` fp8-attn) [(sq, sk, sp, sv)] in forward order, else None."""
    from .. import fp8, fp8_layers
    from ..components import specs_for
    from .zerocopy_plan import calibrate_zero_copy

    cal = calibrate_zero_copy(source, Path(out_root), calib, recipe=recipe)
    spec = specs_for(source.geometry, ["transformer"])["transformer"]
    scales = fp8_layers.calibrated_scales(raw, spec, source.geometry, cal.amax, device=device,
                                          dtype=torch_dtype(dtype))
    return scales, fp8.read_calibration(cal.path, source.content_hash).get("attention") if recipe == "fp8-attn" else None


def check_parallel(request, cfg) -> None:
    """`build --parallel N`: one line each for a rank count out of 2..8, a backend other than compiled PyTorch,
    a profile that is not one size, an unknown attention mode, a build without the transformer."""
    from ..attention import ATTENTION, MAX_RANKS
    from ..errors import FluxtrtError

    n = request.parallel
    if not isinstance(n, int) or isinstance(n, bool) or not 2 <= n <= MAX_RANKS:
        raise FluxtrtError(f"build --parallel takes 2 to {MAX_RANKS} ranks, got {n}")
    if cfg.backend != "torch":
        raise FluxtrtError("build --parallel compiles PyTorch packages whose transformer runs split over ranks: add "
                           "--backend torch (TensorRT engines and ONNX run it whole; `run --parallel` also splits the "
                           "PyTorch module of --model)")
    rng = cfg.shape_range(request.static_shape)
    if rng.min != rng.max:
        raise FluxtrtError("build --parallel compiles each rank's share of one image size: add --static-shape")
    if request.parallel_attention not in ATTENTION:
        raise FluxtrtError(f"--parallel-attention takes {', '.join(ATTENTION)}, got {request.parallel_attention!r}")
    if request.components and not any(family(c) == "transformer" for c in request.components):
        raise FluxtrtError("build --parallel splits the transformer: build it too (--components transformer,...)")


def rank_share(spec, feeds: dict, ranks: int) -> dict:
    """What one rank of `ranks` computes of whole-model `feeds`: every token axis (image and text tokens) cut in
    `ranks` equal slices, per-sample inputs whole (runtime/parallel.shard's cut, here where every slice is alike).
    BuildError in one line where the tokens do not divide (every rank runs the one package)."""
    from ..errors import BuildError

    out = {}
    for t in spec.inputs:
        v, axis = feeds[t.name], t.token_axis
        if axis is not None:
            if v.shape[axis] % ranks:
                raise BuildError(f"{spec.name}: {v.shape[axis]} {t.dims[axis].removeprefix('geo.')} of {t.name} do "
                                 f"not divide over {ranks} ranks: build --parallel with 2, 4 or 8 ranks, or a size "
                                 "whose tokens divide (each rank runs the same package)")
            v = v.narrow(axis, 0, v.shape[axis] // ranks)
        out[t.name] = v
    return out


def shipped_module_intact(gpu_dir: Path, recipe: dict | None, component: str) -> bool:
    """Whether the FlashInfer kernel module a package's recipe records (fp8-attn built on Hopper) is in the folder as
    recorded; True where it records none. A package is reused only with it."""
    from ..kernels.flashinfer_fp8_attention import shipped_file

    module = (recipe or {}).get("attention_module")
    return not module or shipped_file(gpu_dir, module, component) is not None


def package_stage(source, cfg, request, *, spec, rng, manifest, gpu_dir: Path, log, on_phase, calib, device: str,
                  runtime: dict) -> StageResult:
    """Compile (or reuse) one component's package into `gpu_dir` and record it in `manifest`."""
    from .. import fp8, fp8_layers
    from ..core.packages import EXTENSION
    from ..engine.aoti import compile_package

    name, geo, precision = spec.name, source.geometry, cfg.precision[family(spec.name)]
    dtype = module_dtype(precision, device)
    rng = profile_range(geo, family(name), rng)
    profile = spec.profile(rng, geo)
    fp8_recipe = precision in ("fp8", "fp8-attn")  # fp8-attn: its attention kernel (or emulation) compiled in too
    recipe_inputs = calibration_inputs(calib) if fp8_recipe else None
    ranks = request.parallel if family(name) == "transformer" else 1  # context parallelism: the transformer's
    split = {"ranks": ranks, "attention": request.parallel_attention} if ranks > 1 else None
    key = sha256_json({"model": source.content_hash, "precision": precision, "dtype": dtype, "profile": profile,
                       "runtime": runtime, "calibration": recipe_inputs, "fluxtrt": __version__,
                       **({"parallel": split} if split else {})})
    path = gpu_dir / f"{name}{EXTENSION}"
    prev = manifest.components.get(name)
    if not request.force and prev is not None and prev.constants and unchanged(
            path, prev.sha256, {"build_key": prev.build_key}, {"build_key": key}) and \
            (gpu_dir / prev.constants["file"]).is_file() and \
            tree_sha256(gpu_dir / prev.constants["file"]) == prev.constants.get("tree_sha256") and \
            shipped_module_intact(gpu_dir, prev.recipe, name):
        on_phase("reused")
        return StageResult(name, "package", "reused", 0.0, "same model, precision, profile and torch")
    on_phase("load")
    t0 = time.perf_counter()
    raw = source.load_component(spec.subfolder, torch_dtype(dtype), device)
    recipe, note = None, ""
    if fp8_recipe:
        on_phase("calibrate")
        scales, attention = fp8_scales(source, calib, request.out_dir, raw, device=device, dtype=dtype,
                                       recipe=precision)
        note = fp8_layers.quantize_module(raw, scales, device, attention=attention)
        recipe = fp8.recipe_record(scales, attention)
        if attention:  # the kernel compiled in: a FlashInfer op needs the flashinfer package where it runs
            recipe["attention_kernel"] = fp8_layers.attention_kernel(device)
    elif precision == "fp8-wo":
        note = fp8_layers.weight_only(raw)
    share = None
    if split:  # each attention an op that runs the ranks' collectives when the package is called
        from ..attention import attention_mode, split_attention

        split["attention"] = attention_mode(request.parallel_attention, raw.config.num_attention_heads, ranks)
        split_attention(raw, ranks, split["attention"])
        note += ("; " if note else "") + f"split over {ranks} ranks ({split['attention']} attention)"
        share = lambda feeds: rank_share(spec, feeds, ranks)  # noqa: E731
    module = spec.wrap(raw).eval()
    on_phase("compile")
    built = compile_package(module, spec, geo, rng, device=device, dtype=torch_dtype(dtype), package_path=path,
                            share=share)
    if recipe and recipe.get("attention_kernel") == "flashinfer":  # its kernel module ships beside the package
        from ..kernels.flashinfer_fp8_attention import ship_module

        recipe["attention_module"] = ship_module(gpu_dir, raw.config.attention_head_dim)
    del module, raw
    seconds = time.perf_counter() - t0
    result = StageResult(component=name, stage="package", status="built", seconds=seconds,
                         detail=f"export {built.export_seconds:.1f} s, compile {built.compile_seconds:.1f} s"
                                + (f"; {note}" if note else ""), bytes_written=built.bytes, peak_rss_mb=peak_rss_mb())
    manifest.components[name] = ComponentEntry(
        engine=path.name, sha256=built.sha256, bytes=built.bytes, precision=precision, onnx="", onnx_sha256="",
        build_key=key, layers=0, inputs=built.inputs, outputs=built.outputs, profile=built.profile,
        build_seconds=round(seconds, 3), peak_rss_mb=round(peak_rss_mb(), 1), stages={"package": result.footprint()},
        recipe=recipe, constants=built.constants, parallel=split)
    manifest.write(gpu_dir)
    log.write(f"compiled {name}: {built.bytes} bytes (weights {built.constants['bytes']}), export "
              f"{built.export_seconds:.1f} s, compile {built.compile_seconds:.1f} s ({dtype}{', ' + note if note else ''})\n")
    on_phase("done")
    return result
