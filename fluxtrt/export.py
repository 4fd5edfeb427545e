"""Export stage: each FLUX.1 component from a local diffusers folder to ONNX with the dynamo exporter.

Names, dynamic axes and example inputs come from `components.py`. Each file is written in a staging folder,
validated against PyTorch with ONNX Runtime, then renamed into place (weights over the external-data
threshold go to `<component>.onnx.data` beside it). `export.json` records what was exported from what."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import __version__
from .components import ComponentSpec, Geometry, ShapePoint, specs_for
from .errors import FluxtrtError, ValidationError
from .fileio import publish, sha256_file, staging_dir, write_json_atomic
from .models.source import ModelSource

DTYPES = ("fp32", "fp16", "bf16")
DEFAULT_OPSET = 19
# Protobuf cannot hold more than 2 GiB; stay clear of it. FLUXTRT_EXTERNAL_DATA_BYTES lowers it (tests).
EXTERNAL_DATA_BYTES = int(os.environ.get("FLUXTRT_EXTERNAL_DATA_BYTES", 1_800_000_000))
EXPORT_INFO = "export.json"


@dataclass
class ExportResult:
    component: str
    path: Path
    bytes: int
    seconds: float
    external_data: bool
    max_rel_err: float | None


def torch_dtype(name: str):
    import torch

    try:
        return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]
    except KeyError:
        raise FluxtrtError(f"unknown dtype '{name}'; choose one of {', '.join(DTYPES)}") from None


def example_point(geo: Geometry) -> ShapePoint:
    """Batch 2 and a non-square image: torch.export specialises dims traced at size 0 or 1."""
    m = geo.pixel_multiple
    return ShapePoint(2, 4 * m, 6 * m)


def dynamic_shapes(spec: ComponentSpec) -> tuple:
    """torch.export Dims per input, one Dim object per symbol so shared axes stay tied together."""
    from torch.export import Dim

    dims: dict[str, object] = {}

    def dim(sym: str):
        if sym not in dims:
            dims[sym] = Dim(sym, min=1, max=1 << 20)
        return dims[sym]

    return tuple({ax: dim(s) for ax, s in t.symbolic_axes().items()} or None for t in spec.inputs)


@contextlib.contextmanager
def export_patches(module):
    """Reversible export quirks. T5: the SDPA path's decomposition loses a transpose's layout under a
    dynamic batch ("Cannot view a tensor ..."); the eager attention path exports, and is the matmul-softmax-
    matmul form TensorRT fuses anyway."""
    patched = []
    for sub in module.modules():
        cfg = getattr(sub, "config", None)
        if cfg is not None and getattr(cfg, "model_type", None) == "t5" and hasattr(sub, "set_attn_implementation"):
            patched.append((sub, cfg._attn_implementation))
            sub.set_attn_implementation("eager")
    try:
        yield module
    finally:
        for sub, impl in patched:
            sub.set_attn_implementation(impl)


def _param_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def _finalize_graph(onnx_file: Path, spec: ComponentSpec) -> None:
    """Give the graph's inputs and outputs the spec's symbol names (the exporter invents its own) and drop
    the exporter's per-node debug metadata (FX node text, class paths: most of a small graph's bytes)."""
    import onnx

    model = onnx.load(str(onnx_file), load_external_data=False)
    by_name = {t.name: t for t in spec.inputs + spec.outputs}
    for vi in list(model.graph.input) + list(model.graph.output):
        t = by_name.get(vi.name)
        if t is None:
            continue
        for axis, sym in t.symbolic_axes().items():
            d = vi.type.tensor_type.shape.dim[axis]
            d.ClearField("dim_value")
            d.dim_param = sym
    for node in model.graph.node:
        del node.metadata_props[:]
    model.producer_name = "fluxtrt"
    model.producer_version = __version__
    onnx.save(model, str(onnx_file))


def export_component(source: ModelSource, spec: ComponentSpec, out_dir: Path, dtype: str = "fp32",
                     opset: int = DEFAULT_OPSET, validate: bool = True, external_data_bytes: int | None = None,
                     on_phase: Callable[[str], None] = lambda _: None) -> ExportResult:
    import torch

    geo = source.geometry
    t0 = time.perf_counter()
    on_phase("load")
    raw = source.load_component(spec.subfolder, torch_dtype(dtype))
    module = spec.wrap(raw).eval()
    example = spec.sample_inputs(example_point(geo), geo, seed=0)
    args = tuple(v.to(torch_dtype(dtype)) if v.is_floating_point() else v for v in example.values())
    threshold = EXTERNAL_DATA_BYTES if external_data_bytes is None else external_data_bytes
    external = _param_bytes(module) > threshold
    out_dir = Path(out_dir)
    with staging_dir(out_dir, spec.name) as tmp:
        onnx_file = tmp / f"{spec.name}.onnx"
        on_phase("trace")
        with export_patches(module), torch.no_grad(), _quiet_exporter():
            program = torch.onnx.export(
                module, args, dynamic_shapes=dynamic_shapes(spec), dynamo=True, opset_version=opset,
                input_names=[t.name for t in spec.inputs], output_names=[t.name for t in spec.outputs],
                verbose=False, optimize=True,
            )
        on_phase("save")
        program.save(str(onnx_file), external_data=external)
        del program
        _finalize_graph(onnx_file, spec)
        max_err = None
        if validate:
            on_phase("validate")
            if dtype != "fp32":
                module = spec.wrap(source.load_component(spec.subfolder)).eval()
            with export_patches(module):
                report = validate_onnx(onnx_file, module, spec, geo, dtype)
            if not report.ok:
                raise ValidationError(
                    f"exported {spec.name} disagrees with PyTorch: " + "; ".join(report.failures())
                )
            max_err = report.max_rel_err
        staged = sorted(tmp.iterdir(), key=lambda p: p.suffix == ".onnx")  # external data first, .onnx last
        published = publish(staged, out_dir)
    size = sum(p.stat().st_size for p in published)
    return ExportResult(spec.name, out_dir / onnx_file.name, size, time.perf_counter() - t0, external, max_err)


def validate_onnx(*args, **kwargs):
    from .validate import validate_onnx as _v

    return _v(*args, **kwargs)


@contextlib.contextmanager
def _quiet_exporter():
    """The dynamo exporter prints progress lines and warnings for optional ops; keep our output clean."""
    import io
    import logging
    import warnings

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        level = logging.getLogger("torch.onnx").level
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        try:
            yield
        finally:
            logging.getLogger("torch.onnx").setLevel(level)


def export_model(source: ModelSource, out_dir: Path, components=None, dtype: str = "fp32",
                 opset: int = DEFAULT_OPSET, validate: bool = True, external_data_bytes: int | None = None,
                 progress=None) -> list[ExportResult]:
    """Export the named components (default: all) and update `export.json` in `out_dir`."""
    torch_dtype(dtype)
    specs = specs_for(source.geometry, components)
    out_dir = Path(out_dir)
    results = []
    for spec in specs.values():
        phase = (lambda p, n=spec.name: progress(n, p)) if progress else (lambda _: None)
        results.append(export_component(source, spec, out_dir, dtype, opset, validate, external_data_bytes, phase))
        if progress:
            progress(spec.name, "done")
    write_export_info(out_dir, source, dtype, opset, results)
    return results


def write_export_info(out_dir: Path, source: ModelSource, dtype: str, opset: int, results: list[ExportResult]):
    import json

    info_path = Path(out_dir) / EXPORT_INFO
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    if info.get("model_hash") != source.content_hash or info.get("dtype") != dtype:
        info = {}
    info.update({
        "fluxtrt": __version__, "model": source.id, "model_hash": source.content_hash,
        "variant": source.variant, "dtype": dtype, "opset": opset,
    })
    comps = info.setdefault("components", {})
    for r in results:
        comps[r.component] = {
            "file": r.path.name, "sha256": sha256_file(r.path), "bytes": r.bytes,
            "external_data": r.external_data, "seconds": round(r.seconds, 3), "max_rel_err": r.max_rel_err,
        }
    write_json_atomic(info_path, info)
    return info
