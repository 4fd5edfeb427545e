"""Refit: fill a refittable (weight-stripped) TensorRT engine with weights from the user's checkpoint.

Contract (TensorRT-RTX 1.7 `Refitter` docstrings): `set_named_weights` refuses a name that is not refittable or
whose size or dtype differs from `get_weights_prototype(name)`; `refit_cuda_engine` fails while
`get_missing_weights()` is not empty (with STRIP_PLAN every refittable weight was stripped, graph constants
included). So: set what the weight map provides, converted to the prototype's dtype; then fill what is still
missing from the weight-free ONNX's own constants; refuse with the names and TensorRT's errors otherwise."""

from __future__ import annotations

from typing import Callable

from ..dtypes import BY_TENSORRT, np_dtype
from ..errors import FluxtrtError


def _trt_name(dtype) -> str:
    return str(dtype).split(".")[-1].lower()


def _weights(trt, arr, prototype_dtype):
    """trt.Weights over `arr` converted to the engine's dtype (bf16 and fp8 as raw buffers with their type)."""
    import numpy as np

    name = _trt_name(prototype_dtype)
    want = BY_TENSORRT.get(name)
    if want is None:
        raise FluxtrtError(f"the engine stores a weight as {name}, which fluxtrt cannot produce; rebuild it")
    arr = np.ascontiguousarray(arr.astype(np_dtype(want.numpy), copy=False))
    if want.numpy in ("bfloat16", "float8_e4m3fn"):  # numpy has no such dtype of its own: hand over the buffer
        return arr, trt.Weights(prototype_dtype, arr.ctypes.data, arr.size)
    return arr, trt.Weights(arr)


def _errors(logger) -> str:
    errs = list(getattr(logger, "errors", []) or [])
    return f" ({'; '.join(errs[-3:])})" if errs else ""


def _names(names) -> str:
    shown = [n or "<unnamed>" for n in names[:5]]
    return ", ".join(shown) + (" ..." if len(names) > 5 else "")


def refit_engine(engine, trt, logger, weights: dict, graph_constants: Callable[[], dict] | None = None) -> None:
    """Set every refittable weight of `engine` from `weights` (name -> array, the weight map's), then those still
    missing from `graph_constants()` (the weight-free ONNX's inline constants), and refit."""
    refitter = trt.Refitter(engine, logger)
    refittable = set(refitter.get_all_weights())
    keep = []  # TensorRT reads these host buffers until refit_cuda_engine returns

    def put(name, arr, source):
        proto = refitter.get_weights_prototype(name)
        held, w = _weights(trt, arr, proto.dtype)
        if proto.size != held.size:
            raise FluxtrtError(f"weight {name} from {source} has {held.size} values, the engine's {proto.size}; "
                               "rebuild the engine and its weight map together")
        keep.append(held)
        if not refitter.set_named_weights(name, w):
            raise FluxtrtError(f"TensorRT refused weight {name} {list(held.shape)} {held.dtype} from {source}"
                               + _errors(logger))

    for name in sorted(refittable & set(weights)):
        put(name, weights[name], "your checkpoint")
    missing = list(refitter.get_missing_weights())
    if missing and graph_constants is not None:
        constants = graph_constants()
        for name in [n for n in missing if n in constants]:
            put(name, constants[name], "the weight-free ONNX")
        missing = list(refitter.get_missing_weights())
    if missing:
        raise FluxtrtError(f"the engine still needs weights the weight map does not provide: {_names(missing)}; "
                           "rebuild the engine and its map together" + _errors(logger))
    if not refitter.refit_cuda_engine():
        raise FluxtrtError("TensorRT could not refit the engine with your checkpoint's weights" + _errors(logger))
