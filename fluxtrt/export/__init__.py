"""Export stage: each FLUX.1 component from a local diffusers folder to ONNX with the dynamo exporter.

Names, dynamic axes and example inputs come from `components.py`. Each file is written in a staging folder, then
renamed into place (weights over the external-data threshold go to `<component>.onnx.data` beside it); the stage
runner (stages/base.run_step: `fluxtrt export` and `fluxtrt build` alike) validates it against PyTorch and
records it in `export.json`."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import __version__
from ..components import ComponentSpec
from ..errors import FluxtrtError
from ..fileio import publish, sha256_file, staging_dir
from ..models.source import ModelSource
from .trace import example_point, has_safetensors

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
    max_rel_err: float | None = None  # ONNX Runtime vs PyTorch, set by the stage runner's validation
    dtype: str = "fp32"
    zero_copy: dict | None = None  # zerocopy.ZeroCopyRecord.as_json()
    module: object = None  # the fp32 module the export traced, which validation reuses (None: it loads one)


def export_component(source: ModelSource, spec: ComponentSpec, out_dir: Path, dtype: str = "fp32",
                     opset: int = DEFAULT_OPSET, *, external_data_bytes: int | None = None,
                     on_phase: Callable[[str], None] = lambda _: None, zero_copy: bool = False,
                     replicate_blocks: bool = True) -> ExportResult:
    """Export one component in its mode (modes.py) into a staging folder, then publish it beside the others (links
    or external data first, the .onnx last). Not validated here: the stage runner does (stages/base.run_step)."""
    from ..onnxio import linked_dir
    from .modes import mode_for

    t0 = time.perf_counter()
    on_phase("load")
    threshold = EXTERNAL_DATA_BYTES if external_data_bytes is None else external_data_bytes
    mode = mode_for(source, spec, dtype, zero_copy, replicate_blocks, external_threshold=threshold)
    args = mode.example_args(example_point(source.geometry), source.geometry)
    out_dir = Path(out_dir)
    with staging_dir(out_dir, spec.name) as tmp:
        onnx_file = tmp / f"{spec.name}.onnx"
        on_phase("trace")
        mode.write(onnx_file, args, opset, replicate_blocks, on_phase)
        published = publish(sorted(tmp.iterdir(), key=lambda p: p.suffix == ".onnx"), out_dir)
        stale = linked_dir(out_dir / f"{spec.name}.onnx")
        if not mode.zero_copy and stale.is_dir():
            shutil.rmtree(stale)  # links of an earlier zero-copy export of this component
    size = sum(_written_bytes(p) for p in published)
    return ExportResult(component=spec.name, path=out_dir / onnx_file.name, bytes=size, seconds=time.perf_counter() - t0,
                        external_data=mode.external, dtype=mode.dtype,
                        zero_copy=mode.record.as_json() if mode.record else None,
                        module=mode.module if mode.dtype == "fp32" else None)


def _written_bytes(path: Path) -> int:
    """Bytes this export put on disk (links count as their own size, not their target's)."""
    if path.is_dir() and not path.is_symlink():
        return sum(os.lstat(p).st_size for p in path.iterdir())
    return os.lstat(path).st_size


def zero_copy_refusal(source: ModelSource, spec: ComponentSpec, dtype: str) -> str | None:
    """Why `spec` cannot be exported zero-copy at `dtype` (None: it can — its folder holds safetensors in exactly
    that dtype, so the graph's weights are the stored tensors byte for byte)."""
    from ..checkpoint import checkpoint_dtype, checkpoint_index

    folder = source.path / spec.subfolder
    if not has_safetensors(source, spec):
        return f"{spec.name}: no safetensors weights on disk"
    try:
        stored = checkpoint_dtype(checkpoint_index(folder), folder)
    except FluxtrtError as e:
        return f"{spec.name}: {e}"
    return None if stored == dtype else f"{spec.name} is stored in {stored} (--dtype {stored} exports it zero-copy)"


def write_export_info(out_dir: Path, source: ModelSource, dtype: str, opset: int, results: list[ExportResult],
                      *, zero_copy: bool = False):
    """export.json. A zero-copy export identifies the model by its layout (safetensors headers, sizes, mtimes,
    small files' contents) instead of hashing every weight byte: it never reads the weights otherwise."""
    from ..records import StageInfo, StageRecord

    info_path = Path(out_dir) / EXPORT_INFO
    info = StageInfo.read(info_path)
    model_hash = source.layout_hash if zero_copy else source.content_hash
    if info.header.get("model_hash") != model_hash or info.header.get("dtype") != dtype:
        info = StageInfo()
    info.header.update({
        "fluxtrt": __version__, "model": source.id, "model_hash": model_hash,
        "model_hash_kind": "layout" if zero_copy else "content",
        "variant": source.variant, "dtype": dtype, "opset": opset,
    })
    for r in results:
        info.components[r.component] = StageRecord(
            sha256=sha256_file(r.path), max_rel_err=r.max_rel_err, file=r.path.name, bytes=r.bytes,
            external_data=r.external_data, seconds=round(r.seconds, 3), dtype=r.dtype, zero_copy=r.zero_copy)
    info.write(info_path)
    return info
