"""Precision placement for strongly typed TensorRT networks, on the ONNX proto after the graph passes.

`place_precision(model, dtype)` casts weights and activations of an fp32 graph to fp16/bf16 and keeps fp32
islands where low precision hurts or TensorRT lacks a kernel: normalizations and softmax outside attention
(statistics in fp32; attention's MatMul-Softmax-MatMul stays in the graph's precision so TensorRT fuses it),
`Resize` in bf16 (TensorRT has no bf16 Resize), the timestep / guidance embeddings' and the rotary
embedding's sinusoids with what feeds them (in fp32 as diffusers computes them: a bf16 frequency table times
t * 1000 is off by radians), and the graph outputs (the Euler update and VAE post-processing read fp32). Each island is
Cast(to fp32) -> ops -> Cast(back), with no cast between two of its nodes; weights feeding only islands stay
fp32. Works on the proto (not onnx-graphsurgeon), because graphsurgeon widens bf16 constants it reads."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import FluxtrtError

LOW = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
PLACEMENT_VERSION = 2  # 2: sinusoids and what feeds them in fp32 (a graph placed by 1 is rebuilt)
KEEP_FP32 = {"LayerNormalization", "RMSNormalization", "InstanceNormalization", "GroupNormalization", "Softmax"}
KEEP_FP32_BF16_ONLY = {"Resize"}
SINUSOID = {"Sin", "Cos"}
# inputs that are indices, shapes or conditions, never activations to cast
NOT_DATA = {"Unsqueeze": {1}, "Squeeze": {1}, "Reshape": {1}, "Expand": {1}, "Gather": {1}, "Slice": {1, 2, 3, 4},
            "Tile": {1}, "Resize": {1, 2, 3}, "ConstantOfShape": {0}, "Where": {0}, "Range": {0, 1, 2}}
# T5 overflows fp16 (activations exceed 65504): refuse rather than produce NaNs.
NO_FP16 = {"t5"}


def _convert(t: TensorProto, to: int) -> None:
    from ..core import weightmap

    weightmap.derive(t.name, {"op": "cast", "to": "float16" if to == TensorProto.FLOAT16 else "bfloat16"}, t.name)
    arr = numpy_helper.to_array(t).astype(np.float32)
    with np.errstate(over="ignore"):  # float32 min/max (attention masks) become -inf/inf, as intended
        _store(t, arr, to)


def _store(t: TensorProto, arr, to: int) -> None:
    if to == TensorProto.FLOAT16:
        new = numpy_helper.from_array(arr.astype(np.float16), t.name)
    else:
        import ml_dtypes

        new = numpy_helper.from_array(arr.astype(ml_dtypes.bfloat16), t.name)
    t.CopyFrom(new)


def place_precision(model: onnx.ModelProto, dtype: str, component: str = "") -> onnx.ModelProto:
    if dtype == "fp32":
        return model
    if dtype not in LOW:
        raise FluxtrtError(f"unknown dtype '{dtype}'; choose fp32, fp16 or bf16")
    if dtype == "fp16" and component in NO_FP16:
        raise FluxtrtError(f"{component} overflows in plain fp16; use bf16 (the default) or fp32 for it")
    low = LOW[dtype]
    g = model.graph
    keep_ops = KEEP_FP32 | (KEEP_FP32_BF16_ONLY if dtype == "bf16" else set())
    consumers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    producers = {o: n for n in g.node for o in n.output}
    island = _islands(g, keep_ops, producers, consumers)

    def stays_fp32(name: str) -> bool:
        """Read only by fp32 islands, or a Resize's roi/scales (which are float32 by definition)."""
        users = consumers.get(name, [])
        return bool(users) and all(id(u) in island or (u.op_type == "Resize" and list(u.input).index(name) > 0)
                                   for u in users)

    # 1. weights: to low precision unless only fp32 islands read them
    fp32_inits = set()
    for t in g.initializer:
        if t.data_type != TensorProto.FLOAT:
            continue
        if stays_fp32(t.name):
            fp32_inits.add(t.name)
        else:
            _convert(t, low)
    # 2. constants and casts inside the graph (an island's own casts to fp32 stay)
    for n in g.node:
        if n.op_type == "Constant" and all(stays_fp32(o) for o in n.output):
            fp32_inits.update(n.output)
            continue
        if id(n) in island:
            continue
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.FLOAT:
                _convert(a.t, low)
            elif a.type == onnx.AttributeProto.INT and a.name == "to" and n.op_type == "Cast" and a.i == TensorProto.FLOAT:
                a.i = low
    # 3. graph inputs in low precision; outputs stay fp32 through a final cast
    for vi in g.input:
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = low
    del g.value_info[:]
    new_nodes = []
    inside = {o for n in g.node if id(n) in island for o in n.output if o}  # island outputs, renamed below
    graph_outputs = {o.name for o in g.output}
    not_float = {t.name for t in g.initializer if t.data_type not in (TensorProto.FLOAT, low)}
    not_float |= {n.output[0] for n in g.node if n.op_type == "Constant" and any(
        a.type == onnx.AttributeProto.TENSOR and a.t.data_type not in (TensorProto.FLOAT, low) for a in n.attribute)}
    for n in g.node:
        if id(n) in island:
            for k, name in enumerate(n.input):
                if name in inside:  # from another node of the island: its fp32 value, no cast between
                    n.input[k] = f"{name}__fp32"
                    continue
                if not name or name in fp32_inits or name in not_float or k in NOT_DATA.get(n.op_type, ()):
                    continue  # weights kept fp32, and indices, shapes, Resize's roi/scales/sizes: not activations
                cast_out = f"{name}__fp32_for_{n.name}"
                new_nodes.append(helper.make_node("Cast", [name], [cast_out], to=TensorProto.FLOAT,
                                                  name=f"{n.name}__in{k}_fp32"))
                n.input[k] = cast_out
            new_nodes.append(n)
            for k, name in enumerate(list(n.output)):  # every output read outside back to the graph's precision
                if not name:
                    continue  # an optional output nobody reads
                n.output[k] = f"{name}__fp32"
                if name in graph_outputs or any(id(u) not in island for u in consumers.get(name, [])):
                    new_nodes.append(helper.make_node("Cast", [f"{name}__fp32"], [name], to=low,
                                                      name=f"{n.name}__out{k}_back"))
            continue
        new_nodes.append(n)
    ordered = new_nodes
    outs = {o.name for o in g.output if o.type.tensor_type.elem_type == TensorProto.FLOAT}
    final = []
    for n in ordered:
        for k, name in enumerate(n.output):
            if name in outs:
                n.output[k] = f"{name}__low"
                final.append(helper.make_node("Cast", [f"{name}__low"], [name], to=TensorProto.FLOAT,
                                              name=f"{name}__to_fp32"))
    for n in ordered:  # an output the graph also reads on (a First-Block Cache head's temb): its low value
        for k, name in enumerate(n.input):
            if name in outs:
                n.input[k] = f"{name}__low"
    del g.node[:]
    g.node.extend(ordered + final)
    return model


def _islands(g, keep_ops: set, producers: dict, consumers: dict) -> set:
    """ids of the nodes computed in fp32: normalizations and softmax outside attention (and Resize in bf16), and
    every sinusoid (Sin, Cos) with all that feeds it (the frequency tables computed from constants, the position
    ids' gathers), as diffusers computes them in fp32. The cone stops at nodes that read a graph input: the
    timestep's `* 1000` stays in the graph's precision, as diffusers computes it."""
    graph_inputs = {i.name for i in g.input}
    island = {id(n) for n in g.node if n.op_type in keep_ops and not _attention_softmax(n, producers, consumers)}
    todo = [n for n in g.node if n.op_type in SINUSOID]
    while todo:
        n = todo.pop()
        if id(n) in island:
            continue
        island.add(id(n))
        for name in n.input:
            src = producers.get(name)
            if src is not None and not any(i in graph_inputs for i in src.input):
                todo.append(src)
    return island


def _attention_softmax(n, producers: dict, consumers: dict) -> bool:
    """Softmax between two MatMuls (scores -> weights -> values): left in the graph's precision so TensorRT
    can fuse the attention into one kernel (its fused kernels keep softmax statistics in fp32)."""
    if n.op_type != "Softmax":
        return False
    src = producers.get(n.input[0])
    while src is not None and src.op_type == "Add":
        src = next((producers.get(i) for i in src.input if producers.get(i) is not None
                    and producers[i].op_type in ("MatMul", "Add")), None)
    users = consumers.get(n.output[0], [])
    return src is not None and src.op_type == "MatMul" and bool(users) and all(u.op_type == "MatMul" for u in users)
