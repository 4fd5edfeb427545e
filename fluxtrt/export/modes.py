"""The three export modes, small classes over one tracing core (trace.py). Each writes `<component>.onnx` into a
staging folder and says what it wrote; export_component (the stage, __init__.py) stages, validates, publishes.

  Copying     load the module in the export dtype, trace it, save the weights into the graph (or .onnx.data)
  Replicated  a copying export of a deep component: trace 3 blocks of each kind on `meta`, replicate them to
              the real depth, fill every weight from the checkpoint in the export dtype (no module loaded)
  ZeroCopy    trace on `meta` (or relink the cached graph of this architecture); every weight is external data
              pointing into the checkpoint's safetensors, in the stored dtype (only fluxtrt and TensorRT read it)
"""

from __future__ import annotations

from pathlib import Path

from ..components import ComponentSpec
from ..dtypes import torch_dtype
from ..errors import FluxtrtError
from .trace import (
    block_depths,
    finalize_graph,
    has_safetensors,
    index_or_none,
    param_bytes,
    record_provenance,
    trace,
    trace_on_meta,
)


class Mode:
    """dtype: what the graph computes in; external: weights go to <component>.onnx.data; zero_copy: the record
    of a linked export (None otherwise); module: the loaded PyTorch module, when one was loaded."""

    zero_copy = False

    def __init__(self, source, spec: ComponentSpec, dtype: str):
        self.source, self.spec, self.dtype = source, spec, dtype
        self.module = None
        self.external = False
        self.record = None

    @property
    def device(self) -> str:
        return "meta"

    def example_args(self, point, geo):
        example = self.spec.sample_inputs(point, geo, seed=0)
        return tuple((v.to(torch_dtype(self.dtype)) if v.is_floating_point() else v).to(self.device)
                     for v in example.values())

    def write(self, onnx_file: Path, args, opset: int, replicate_blocks: bool, on_phase) -> None:
        raise NotImplementedError


class Copying(Mode):
    def __init__(self, source, spec, dtype, external_threshold: int):
        super().__init__(source, spec, dtype)
        raw = source.load_component(spec.subfolder, torch_dtype(dtype))
        self.raw, self.module = raw, spec.wrap(raw).eval()
        self.external = param_bytes(self.module) > external_threshold

    @property
    def device(self) -> str:
        return "cpu"

    def write(self, onnx_file, args, opset, replicate_blocks, on_phase):
        program = trace(self.module, args, self.spec, opset)
        record_provenance(program.model, self.raw, index_or_none(self.source, self.spec))
        on_phase("save")
        program.save(str(onnx_file), external_data=self.external)
        finalize_graph(onnx_file, self.spec)


class Replicated(Mode):
    def __init__(self, source, spec, dtype, external_threshold: int):
        from ..checkpoint import checkpoint_index

        super().__init__(source, spec, dtype)
        self.index = checkpoint_index(source.path / spec.subfolder)
        self.external = stored_bytes(self.index, dtype) > external_threshold

    def write(self, onnx_file, args, opset, replicate_blocks, on_phase):
        program, raw, buffers, _ = trace_on_meta(self.source, self.spec, self.dtype, args, opset,
                                                 replicate_blocks=replicate_blocks)
        prov = record_provenance(program.model, raw, self.index)
        fill_weights(program.model, prov, self.index, buffers)
        on_phase("save")
        program.save(str(onnx_file), external_data=self.external)
        finalize_graph(onnx_file, self.spec)


class ZeroCopy(Mode):
    zero_copy = True

    def __init__(self, source, spec):  # the graph's dtype is the stored one
        from ..checkpoint import checkpoint_dtype, checkpoint_index

        if source.random_weights:
            raise FluxtrtError(f"{source.id} has no weights on disk to point at; write it as a checkpoint first "
                               "(scripts/write_random_checkpoint.py) or export without --zero-copy")
        self.index = checkpoint_index(source.path / spec.subfolder)
        super().__init__(source, spec, checkpoint_dtype(self.index, source.path / spec.subfolder))

    def write(self, onnx_file, args, opset, replicate_blocks, on_phase):
        import onnx
        import onnx_ir as ir

        from . import zerocopy

        key = zerocopy.template_key(self.source.path / self.spec.subfolder, self.spec, self.source.geometry, opset,
                                    self.dtype)
        self.record = zerocopy.relink(key, self.index, onnx_file)  # the architecture's cached graph, if any
        if self.record is not None:
            return
        program, raw, buffers, replicated = trace_on_meta(self.source, self.spec, self.dtype, args, opset,
                                                          replicate_blocks=replicate_blocks)
        record_provenance(program.model, raw, self.index)
        on_phase("save")
        self.record = zerocopy.link_initializers(program.model, raw, self.index, buffers, onnx_file)
        self.record.replicated = replicated
        onnx.save(ir.serde.serialize_model(program.model), str(onnx_file))
        finalize_graph(onnx_file, self.spec)
        zerocopy.save_template(onnx_file, self.record, key)


def mode_for(source, spec: ComponentSpec, dtype: str, zero_copy: bool, replicate_blocks: bool,
             *, external_threshold: int) -> Mode:
    if zero_copy:
        return ZeroCopy(source, spec)
    if replicate_blocks and replicable(source, spec):
        return Replicated(source, spec, dtype, external_threshold)
    return Copying(source, spec, dtype, external_threshold)


def replicable(source, spec: ComponentSpec) -> bool:
    """Whether a copying export can trace on meta with replicated blocks: the component has blocks deep enough
    and safetensors weights to fill the graph from."""
    return has_safetensors(source, spec) and bool(block_depths(source, spec)[1])


def stored_bytes(index, dtype: str) -> int:
    import math

    import torch

    size = torch.empty((), dtype=torch_dtype(dtype)).element_size()
    return sum(math.prod(t.shape) * size for t in index.values())


def fill_weights(ir_model, prov: dict, index, buffers: dict) -> None:
    """Give every weight of a graph traced on meta its value (a copying export): the checkpoint tensor its
    recorded provenance names, cast to the graph's dtype (weightmap.evaluate, as weights-from-checkpoint does),
    or the module's buffer."""
    import numpy as np
    import onnx_ir as ir

    from ..checkpoint import missing_tensor, read_stored
    from ..core.weightmap import evaluate
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
