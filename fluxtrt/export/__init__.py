"""Export stage: each FLUX.1 component from a local diffusers folder to ONNX with the dynamo exporter.

Names, dynamic axes and example inputs come from `components.py`. Each file is written in a staging folder,
validated against PyTorch with ONNX Runtime, then renamed into place (weights over the external-data
threshold go to `<component>.onnx.data` beside it). `export.json` records what was exported from what."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import __version__
from ..components import ComponentSpec, Geometry, ShapePoint, specs_for
from ..dtypes import torch_dtype
from ..errors import FluxtrtError, ValidationError
from ..fileio import publish, sha256_file, staging_dir, write_json_atomic
from ..models.source import ModelSource

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
    dtype: str = "fp32"
    zero_copy: dict | None = None  # zerocopy.ZeroCopyRecord.as_json()


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


def _trace(module, args, spec: ComponentSpec, opset: int):
    """torch.onnx.export (dynamo) with the ONNX optimizer kept off the weights: shape arithmetic is folded,
    but a node that reads an initializer is left alone, so weights keep their checkpoint names and stored
    layout (`Transpose` of a linear weight stays a graph op; the optimize stage folds it and records how).
    Initializers are renamed to the checkpoint's keys (the wrapper's attribute prefix dropped)."""
    import onnxscript.optimizer
    import onnxscript.rewriter.onnx_fusions
    import torch

    with export_patches(module), torch.no_grad(), _quiet_exporter():
        program = torch.onnx.export(
            module, args, dynamic_shapes=dynamic_shapes(spec), dynamo=True, opset_version=opset,
            input_names=[t.name for t in spec.inputs], output_names=[t.name for t in spec.outputs],
            verbose=False, optimize=False,
        )
        graph = program.model.graph

        def should_fold(node):
            return False if any(v is not None and v.name in graph.initializers for v in node.inputs) else None

        # the optimizer never sees weight values (on the meta device there are none)
        hidden = {v.name: v.const_value for v in graph.initializers.values()}
        for v in graph.initializers.values():
            v.const_value = None
        try:
            onnxscript.optimizer.optimize_ir(program.model, should_fold=should_fold)
            onnxscript.rewriter.onnx_fusions.fuse(program.model)
        finally:
            for v in graph.initializers.values():
                if v.name in hidden:  # (the optimizer adds folded shape constants of its own)
                    v.const_value = hidden[v.name]
    prefix = wrapper_prefix(module)
    for value in list(graph.initializers.values()):
        if value.name.startswith(prefix):
            graph.initializers.pop(value.name)
            value.name = value.name[len(prefix):]
            graph.register_initializer(value)
    return program


def _has_safetensors(source: ModelSource, spec: ComponentSpec) -> bool:
    return not source.random_weights and any((source.path / spec.subfolder).glob("*.safetensors"))


def _index_or_none(source: ModelSource, spec: ComponentSpec):
    from ..checkpoint import checkpoint_index

    return checkpoint_index(source.path / spec.subfolder) if _has_safetensors(source, spec) else None


def _block_depths(source: ModelSource, spec: ComponentSpec) -> tuple[dict, dict]:
    """(config overrides that trace 3 blocks of each repeated kind, {kind: real depth}) — empty when the
    component has no blocks deep enough to replicate (replicate.reduced_depths)."""
    import json

    from .replicate import reduced_depths

    config = json.loads((source.path / spec.subfolder / "config.json").read_text())
    return reduced_depths(config, spec.repeated_blocks)


def record_provenance(ir_model, raw, index) -> dict:
    """Weight map, first link: each parameter initializer is a checkpoint tensor (cast when the export dtype
    differs from the stored one). Stored in the model's metadata for the later stages (see weightmap.py)."""
    import json

    from .. import weightmap
    from ..checkpoint import numpy_name
    from .zerocopy import parameter_aliases, stored_key

    aliases = parameter_aliases(raw)
    params = set(aliases)
    prov = {}
    for name, value in ir_model.graph.initializers.items():
        if index is None:
            if name in params:
                prov[name] = {"tensor": name}
            continue
        key = stored_key(name, aliases, index)
        if key is None:
            continue
        recipe = {"tensor": key}
        graph_dtype = str(value.dtype.numpy())
        stored = numpy_name(index[key])
        if stored != graph_dtype:
            recipe = {"op": "cast", "to": graph_dtype, "of": recipe}
        prov[name] = recipe
    ir_model.metadata_props[weightmap.KEY] = json.dumps(prov, sort_keys=True, separators=(",", ":"))
    return prov


def wrapper_prefix(module) -> str:
    """The spec wrappers hold the diffusers/transformers module as their one child (`model.` / `vae.`)."""
    children = [n for n, _ in module.named_children()]
    return f"{children[0]}." if len(children) == 1 else ""


def export_component(source: ModelSource, spec: ComponentSpec, out_dir: Path, dtype: str = "fp32",
                     opset: int = DEFAULT_OPSET, validate: bool = True, external_data_bytes: int | None = None,
                     on_phase: Callable[[str], None] = lambda _: None, zero_copy: bool = False,
                     replicate_blocks: bool = True) -> ExportResult:
    from ..checkpoint import checkpoint_dtype, checkpoint_index
    from ..onnxio import linked_dir
    from . import zerocopy

    geo = source.geometry
    t0 = time.perf_counter()
    on_phase("load")
    record = None
    if zero_copy:
        if source.random_weights:
            raise FluxtrtError(f"{source.id} has no weights on disk to point at; write it as a checkpoint first "
                               "(scripts/write_random_checkpoint.py) or export without --zero-copy")
        index = checkpoint_index(source.path / spec.subfolder)
        dtype = checkpoint_dtype(index, source.path / spec.subfolder)
        module = raw = None  # built at trace time: only as deep as block replication needs
        device = "meta"
    elif replicate_blocks and _replicable(source, spec):
        # traced on meta with replicated blocks like zero-copy, then given the checkpoint's values in `dtype`
        index = checkpoint_index(source.path / spec.subfolder)
        module = raw = None
        device = "meta"
    else:
        index = None
        raw = source.load_component(spec.subfolder, torch_dtype(dtype))
        module = spec.wrap(raw).eval()
        device = "cpu"
    example = spec.sample_inputs(example_point(geo), geo, seed=0)
    args = tuple((v.to(torch_dtype(dtype)) if v.is_floating_point() else v).to(device) for v in example.values())
    threshold = EXTERNAL_DATA_BYTES if external_data_bytes is None else external_data_bytes
    weight_bytes = _param_bytes(module) if module is not None else _stored_bytes(index, dtype)
    external = not zero_copy and weight_bytes > threshold
    out_dir = Path(out_dir)
    with staging_dir(out_dir, spec.name) as tmp:
        onnx_file = tmp / f"{spec.name}.onnx"
        on_phase("trace")
        if zero_copy:
            key = zerocopy.template_key(source.path / spec.subfolder, spec, geo, opset, dtype)
            record = zerocopy.relink(key, index, onnx_file)
        if record is None:
            replicated = {}
            if device == "meta":
                program, raw, buffers, replicated = _trace_zero_copy(source, spec, dtype, args, opset,
                                                                     replicate_blocks)
            else:
                program = _trace(module, args, spec, opset)
            prov = record_provenance(program.model, raw, index if device == "meta" else _index_or_none(source, spec))
            if device == "meta" and not zero_copy:
                _fill_weights(program.model, prov, index, buffers)
            on_phase("save")
            if zero_copy:
                import onnx
                import onnx_ir as ir

                record = zerocopy.link_initializers(program.model, raw, index, buffers, onnx_file)
                record.replicated = replicated
                onnx.save(ir.serde.serialize_model(program.model), str(onnx_file))
            else:
                program.save(str(onnx_file), external_data=external)
            del program
            _finalize_graph(onnx_file, spec)
            if zero_copy:
                zerocopy.save_template(onnx_file, record, key)
        max_err = None
        if validate:
            on_phase("validate")
            if dtype != "fp32" or module is None:  # (traced on meta: the checkpoint's own weights, read only now)
                module = spec.wrap(source.load_component(spec.subfolder)).eval()
            with export_patches(module):
                report = validate_onnx(onnx_file, module, spec, geo, dtype)
            if not report.ok:
                raise ValidationError(
                    f"exported {spec.name} disagrees with PyTorch: " + "; ".join(report.failures())
                )
            max_err = report.max_rel_err
        # external data / links first, the .onnx (what readers look for) last
        staged = sorted(tmp.iterdir(), key=lambda p: p.suffix == ".onnx")
        published = publish(staged, out_dir)
        stale = linked_dir(out_dir / f"{spec.name}.onnx")
        if not zero_copy and stale.is_dir():
            shutil.rmtree(stale)  # links of an earlier zero-copy export of this component
    size = sum(_written_bytes(p) for p in published)
    return ExportResult(spec.name, out_dir / onnx_file.name, size, time.perf_counter() - t0, external, max_err,
                        dtype, record.as_json() if record else None)


def _replicable(source: ModelSource, spec: ComponentSpec) -> bool:
    """Whether a copying export can trace on meta with replicated blocks: the component has blocks deep enough
    and safetensors weights to fill the graph from."""
    return _has_safetensors(source, spec) and bool(_block_depths(source, spec)[1])


def _stored_bytes(index, dtype: str) -> int:
    import math

    import torch

    size = torch.empty((), dtype=torch_dtype(dtype)).element_size()
    return sum(math.prod(t.shape) * size for t in index.values())


def _fill_weights(ir_model, prov: dict, index, buffers: dict) -> None:
    """Give every weight of a graph traced on meta its value (a copying export): the checkpoint tensor its
    recorded provenance names, cast to the graph's dtype (weightmap.evaluate, as weights-from-checkpoint does),
    or the module's buffer."""
    import numpy as np
    import onnx_ir as ir

    from ..checkpoint import missing_tensor, read_stored
    from ..weightmap import evaluate
    from .zerocopy import is_meta

    for name, value in ir_model.graph.initializers.items():
        if name in prov:
            arr = evaluate(prov[name], lambda key: read_stored(index[key]))
            if tuple(arr.shape) != tuple(int(d) for d in value.shape):
                raise FluxtrtError(f"{name}: checkpoint has shape {list(arr.shape)}, the graph wants "
                                   f"{[int(d) for d in value.shape]}; the model's config does not match its weights")
            value.const_value = ir.tensor(np.ascontiguousarray(arr), name=name)
        elif name in buffers:
            value.const_value = ir.tensor(np.ascontiguousarray(buffers[name].numpy()), name=name)
        elif is_meta(value.const_value):
            raise missing_tensor(index, name)
        # else: the graph's own constants (folded shape arithmetic)


def _trace_zero_copy(source: ModelSource, spec: ComponentSpec, dtype: str, args, opset: int, replicate_blocks: bool):
    """Trace the component built on `meta`; with repeated blocks, trace three of each and replicate the middle
    one to the real depth (replicate.py), falling back to a full trace where the pattern does not hold.
    Returns (program, module traced, its buffers, {family: depth replicated to})."""
    from . import zerocopy
    from .replicate import ReplicationError, replicate

    overrides, depths = _block_depths(source, spec) if replicate_blocks else ({}, {})
    if depths:
        raw, buffers = zerocopy.empty_component(source.path, spec.subfolder, torch_dtype(dtype), overrides)
        module = spec.wrap(raw).eval()
        program = _trace(module, args, spec, opset)
        try:
            replicate(program.model, depths, wrapper_prefix(module))
            return program, raw, buffers, depths
        except ReplicationError as e:
            import warnings

            warnings.warn(f"{spec.name}: block replication does not apply ({e}); tracing every block", stacklevel=2)
    raw, buffers = zerocopy.empty_component(source.path, spec.subfolder, torch_dtype(dtype))
    return _trace(spec.wrap(raw).eval(), args, spec, opset), raw, buffers, {}


def _written_bytes(path: Path) -> int:
    """Bytes this export put on disk (links count as their own size, not their target's)."""
    if path.is_dir() and not path.is_symlink():
        return sum(os.lstat(p).st_size for p in path.iterdir())
    return os.lstat(path).st_size


def validate_onnx(*args, **kwargs):
    from ..validate import validate_onnx as _v

    return _v(*args, **kwargs)


@contextlib.contextmanager
def _quiet_exporter():
    """The dynamo exporter prints progress lines and warnings for optional ops; keep our output clean."""
    import io
    import logging
    import warnings

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        loggers = [logging.getLogger(n) for n in ("torch.onnx", "onnxscript", "onnx_ir")]
        levels = [lg.level for lg in loggers]
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


def zero_copy_refusal(source: ModelSource, spec: ComponentSpec, dtype: str) -> str | None:
    """Why `spec` cannot be exported zero-copy at `dtype` (None: it can — its folder holds safetensors in exactly
    that dtype, so the graph's weights are the stored tensors byte for byte)."""
    from ..checkpoint import checkpoint_dtype, checkpoint_index

    folder = source.path / spec.subfolder
    if not _has_safetensors(source, spec):
        return f"{spec.name}: no safetensors weights on disk"
    try:
        stored = checkpoint_dtype(checkpoint_index(folder), folder)
    except FluxtrtError as e:
        return f"{spec.name}: {e}"
    return None if stored == dtype else f"{spec.name} is stored in {stored} (--dtype {stored} exports it zero-copy)"


def export_model(source: ModelSource, out_dir: Path, components=None, dtype: str = "fp32",
                 opset: int = DEFAULT_OPSET, validate: bool = True, external_data_bytes: int | None = None,
                 progress=None, zero_copy: bool | frozenset = False, replicate_blocks: bool = True) -> list[ExportResult]:
    """Export the named components (default: all) and update `export.json` in `out_dir`. `zero_copy`: True/False
    for every component, or the set of component names to export zero-copy."""
    torch_dtype(dtype)
    specs = specs_for(source.geometry, components)
    out_dir = Path(out_dir)
    results = []
    for spec in specs.values():
        phase = (lambda p, n=spec.name: progress(n, p)) if progress else (lambda _: None)
        linked = zero_copy if isinstance(zero_copy, bool) else spec.name in zero_copy
        results.append(export_component(source, spec, out_dir, dtype, opset, validate, external_data_bytes, phase,
                                        zero_copy=linked, replicate_blocks=replicate_blocks))
        if progress:
            progress(spec.name, "done")
    stored = {r.dtype for r in results}  # zero-copy keeps each component's stored dtype
    write_export_info(out_dir, source, stored.pop() if len(stored) == 1 else dtype, opset, results,
                      all(r.zero_copy for r in results))
    return results


def write_export_info(out_dir: Path, source: ModelSource, dtype: str, opset: int, results: list[ExportResult],
                      zero_copy: bool = False):
    """export.json. A zero-copy export identifies the model by its layout (safetensors headers, sizes, mtimes,
    small files' contents) instead of hashing every weight byte: it never reads the weights otherwise."""
    import json

    info_path = Path(out_dir) / EXPORT_INFO
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    model_hash = source.layout_hash if zero_copy else source.content_hash
    if info.get("model_hash") != model_hash or info.get("dtype") != dtype:
        info = {}
    info.update({
        "fluxtrt": __version__, "model": source.id, "model_hash": model_hash,
        "model_hash_kind": "layout" if zero_copy else "content",
        "variant": source.variant, "dtype": dtype, "opset": opset,
    })
    comps = info.setdefault("components", {})
    for r in results:
        comps[r.component] = {
            "file": r.path.name, "sha256": sha256_file(r.path), "bytes": r.bytes,
            "external_data": r.external_data, "seconds": round(r.seconds, 3), "max_rel_err": r.max_rel_err,
            "dtype": r.dtype, "zero_copy": r.zero_copy,
        }
    write_json_atomic(info_path, info)
    return info
