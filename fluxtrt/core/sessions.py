"""ONNX Runtime sessions over any graph fluxtrt writes, for the build's checks and the runtime alike: bf16
graphs widened to fp32 where a provider lacks the kernels, NVFP4 graphs emulated in standard ops, weights given
from arrays (a weight-free graph filled from a checkpoint) without serializing them."""

from __future__ import annotations

from pathlib import Path


def upcast_bf16(model, skip=frozenset()):
    """ONNX Runtime has no CPU kernels for bf16 (and no bf16 QuantizeLinear/DequantizeLinear anywhere). Run a
    bf16 graph as fp32 instead: bf16 weights are widened exactly, bf16 casts become fp32 casts. What is checked
    is the graph and its bf16-rounded weights; bf16 arithmetic rounding itself is not simulated (TensorRT
    accumulates in fp32 anyway). Initializers named in `skip` are left alone (passed in widened elsewhere)."""
    import onnx
    from onnx import TensorProto, numpy_helper

    bf16, f32 = TensorProto.BFLOAT16, TensorProto.FLOAT

    def widen(t):
        if t.data_type == bf16 and t.name not in skip:
            arr = numpy_helper.to_array(t).astype("float32")
            t.CopyFrom(numpy_helper.from_array(arr, t.name))

    def fix_graph(g):
        for t in g.initializer:
            widen(t)
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            if vi.type.tensor_type.elem_type == bf16:
                vi.type.tensor_type.elem_type = f32
        for node in g.node:
            for a in node.attribute:
                if a.type == onnx.AttributeProto.TENSOR:
                    widen(a.t)
                elif a.type == onnx.AttributeProto.INT and a.name in ("to", "dtype") and a.i == bf16:
                    a.i = f32
                elif a.type == onnx.AttributeProto.GRAPH:
                    fix_graph(a.g)

    fix_graph(model.graph)
    return model


def has_bf16_qdq(model) -> bool:
    """Q/DQ with bf16 scales (fp8 graphs quantized from a bf16 checkpoint): ONNX Runtime has no such kernel on
    any provider (CUDA's take float and float16), so those graphs run widened to fp32 everywhere."""
    from onnx import TensorProto

    bf16 = {t.name for t in model.graph.initializer if t.data_type == TensorProto.BFLOAT16}
    return any(n.op_type in ("QuantizeLinear", "DequantizeLinear") and len(n.input) > 1 and n.input[1] in bf16
               for n in model.graph.node)


def _has_bf16(model) -> bool:
    from onnx import TensorProto

    g = model.graph
    return any(vi.type.tensor_type.elem_type == TensorProto.BFLOAT16 for vi in list(g.input) + list(g.output)) or \
        any(t.data_type == TensorProto.BFLOAT16 for t in g.initializer)


def _widened_session(onnx_path: Path, header, providers, overrides: dict):
    """A session over `header` (the graph without its data) widened to fp32: every initializer that lives in a
    file (or is overridden) is handed to ONNX Runtime as an OrtValue over a numpy array, bf16 ones widened;
    nothing is serialized with its weights, so a graph of any size works (protobuf stops at 2 GB)."""
    import numpy as np
    from onnx import TensorProto, helper

    from ..onnxio import external_info, onnxruntime, ort_value, read_external

    ort = onnxruntime()
    arrays = {}
    for t in header.graph.initializer:
        if t.name in overrides:
            arr = np.asarray(overrides[t.name])
        elif external_info(t) is not None:
            dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
            arr = np.frombuffer(read_external(onnx_path, t), dtype=dtype).reshape(tuple(t.dims))
        else:
            continue
        if t.data_type == TensorProto.BFLOAT16 or arr.dtype.name == "bfloat16":
            arr = arr.astype(np.float32)
            t.data_type = TensorProto.FLOAT
        arrays[t.name] = np.ascontiguousarray(arr)  # its file reference stays: ONNX Runtime takes the OrtValue
    upcast_bf16(header, skip=set(arrays))
    options = ort.SessionOptions()
    # no graph optimizations: constant folding would add a transposed copy of every linked matrix beside these
    # arrays (the full-size transformer in fp32 then took 124.7 GB of host memory and was killed)
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.add_external_initializers(list(arrays), [ort_value(a) for a in arrays.values()])
    session = ort.InferenceSession(header.SerializeToString(), options, providers=list(providers))
    session._fluxtrt_keepalive = arrays  # the session reads these buffers for its whole life
    session._fluxtrt_widened = True  # computes in fp32 (what a comparison should take as its dtype)
    return session


def cpu_session(onnx_path: Path, overrides: dict | None = None):
    """An ONNX Runtime CPU session (see runnable_session)."""
    return runnable_session(onnx_path, overrides=overrides)


def runnable_session(onnx_path: Path, providers=("CPUExecutionProvider",), overrides: dict | None = None,
                     widen: bool = False):
    """An ONNX Runtime session over any graph fluxtrt writes. Widened to fp32 first (see upcast_bf16): bf16
    graphs on the CPU provider (it has no bf16 kernels) and, on every provider, graphs with bf16 Q/DQ (no
    provider has that kernel); a GPU provider runs other bf16 graphs as they are, or widened where it lacks a
    bf16 kernel for one of their ops. NVFP4 graphs are emulated in standard ops everywhere (nvfp4.emulate:
    ONNX Runtime has no FP4 kernels). `overrides` (name -> array) replaces initializers, e.g. weights filled
    from a checkpoint into a weight-free ONNX. `providers`: ONNX Runtime's list (names or (name, options)
    pairs), the first one preferred. `widen`: run a bf16 graph widened to fp32 on any provider (`fluxtrt
    validate --fp32`: the graph's arithmetic checked apart from bf16 rounding)."""
    from onnx import TensorProto, numpy_helper

    from ..onnxio import load_header, load_onnx, onnxruntime, ort_session

    ort = onnxruntime()
    on_cpu = [p if isinstance(p, str) else p[0] for p in providers][0] == "CPUExecutionProvider"
    header = load_header(onnx_path)
    widen = ((widen or on_cpu) and _has_bf16(header)) or has_bf16_qdq(header)
    has_fp4 = any(t.data_type == TensorProto.FLOAT4E2M1 for t in header.graph.initializer)
    if not has_fp4:
        if widen:
            return _widened_session(Path(onnx_path), header, providers, overrides or {})
        try:
            return ort_session(onnx_path, providers, overrides=overrides)
        except Exception as e:  # a bf16 op no provider implements (ONNX Runtime's NOT_IMPLEMENTED): run it as fp32
            if "NOT_IMPLEMENTED" not in str(e) or not _has_bf16(header):
                raise
            return _widened_session(Path(onnx_path), header, providers, overrides or {})
    overrides = overrides or {}
    model = load_onnx(onnx_path, skip=set(overrides))
    for t in model.graph.initializer:
        if t.name in overrides:
            t.CopyFrom(numpy_helper.from_array(overrides[t.name], t.name))
    if widen:
        model = upcast_bf16(model)
    from ..nvfp4 import emulate

    return ort.InferenceSession(emulate(model).SerializeToString(), providers=list(providers))
