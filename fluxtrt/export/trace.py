"""The tracing core every export mode shares: example inputs and dynamic axes from the component spec, the
dynamo exporter with the ONNX optimizer kept off the weights, the spec's names on the graph's I/O, the weight
provenance (first link of the weight map), and tracing on `meta` with repeated blocks replicated."""

from __future__ import annotations

import contextlib
from pathlib import Path

from .. import __version__
from ..components import ComponentSpec, Geometry, ShapePoint
from ..dtypes import torch_dtype
from ..onnxio import load_header


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


@contextlib.contextmanager
def quiet_exporter():
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


def param_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def finalize_graph(onnx_file: Path, spec: ComponentSpec) -> None:
    """Give the graph's inputs and outputs the spec's symbol names (the exporter invents its own) and drop
    the exporter's per-node debug metadata (FX node text, class paths: most of a small graph's bytes)."""
    import onnx

    model = load_header(onnx_file)
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


def trace(module, args, spec: ComponentSpec, opset: int):
    """torch.onnx.export (dynamo) with the ONNX optimizer kept off the weights: shape arithmetic is folded,
    but a node that reads an initializer is left alone, so weights keep their checkpoint names and stored
    layout (`Transpose` of a linear weight stays a graph op; the optimize stage folds it and records how).
    Initializers are renamed to the checkpoint's keys (the wrapper's attribute prefix dropped)."""
    import onnxscript.optimizer
    import onnxscript.rewriter.onnx_fusions
    import torch

    with export_patches(module), torch.no_grad(), quiet_exporter():
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


def wrapper_prefix(module) -> str:
    """The spec wrappers hold the diffusers/transformers module as their one child (`model.` / `vae.`)."""
    children = [n for n, _ in module.named_children()]
    return f"{children[0]}." if len(children) == 1 else ""


def has_safetensors(source, spec: ComponentSpec) -> bool:
    return not source.random_weights and any((source.path / spec.subfolder).glob("*.safetensors"))


def index_or_none(source, spec: ComponentSpec):
    from ..checkpoint import checkpoint_index

    return checkpoint_index(source.path / spec.subfolder) if has_safetensors(source, spec) else None


def block_depths(source, spec: ComponentSpec) -> tuple[dict, dict]:
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

    from ..checkpoint import numpy_name
    from ..core import weightmap
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


@contextlib.contextmanager
def constants_keep_values():
    """A zero-copy trace runs on `meta`, so a constant the module makes from Python numbers on its activations'
    device (transformers 5.17's eager attention mask: `torch.tensor(0.0, device=mask.device)`) has no value:
    the exporter lifts it to an initializer that no checkpoint holds ("has no tensor 'encoder.lifted_tensor_0'").
    While tracing, such scalars are made on the CPU instead (a 0-d CPU tensor mixes with tensors on any
    device), so they keep their values and stay graph constants."""
    import torch

    make = torch.tensor

    def tensor(data, *args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "meta":
            t = make(data, *args, device="cpu", **kwargs)
            if t.dim() == 0:
                return t
        return make(data, *args, device=device, **kwargs)

    torch.tensor = tensor
    try:
        yield
    finally:
        torch.tensor = make


def trace_on_meta(source, spec: ComponentSpec, dtype: str, args, opset: int, *, replicate_blocks: bool):
    """Trace the component built on `meta`; with repeated blocks, trace three of each and replicate the middle
    one to the real depth (replicate.py), falling back to a full trace where the pattern does not hold.
    Returns (program, module traced, its buffers, {family: depth replicated to})."""
    from . import zerocopy
    from .replicate import ReplicationError, replicate

    overrides, depths = block_depths(source, spec) if replicate_blocks else ({}, {})
    if depths:
        raw, buffers = zerocopy.empty_component(source.path, spec.subfolder, torch_dtype(dtype), overrides)
        module = spec.wrap(raw).eval()
        with constants_keep_values():
            program = trace(module, args, spec, opset)
        try:
            replicate(program.model, depths, wrapper_prefix(module))
            return program, raw, buffers, depths
        except ReplicationError as e:
            import warnings

            warnings.warn(f"{spec.name}: block replication does not apply ({e}); tracing every block", stacklevel=2)
    raw, buffers = zerocopy.empty_component(source.path, spec.subfolder, torch_dtype(dtype))
    with constants_keep_values():
        return trace(spec.wrap(raw).eval(), args, spec, opset), raw, buffers, {}
