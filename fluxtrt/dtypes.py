"""The one dtype table: every name fluxtrt meets for a tensor type, and how to turn one into another.

Columns: our short name (configs, `--dtype`, `--torch-dtype`), numpy / ml_dtypes name, ONNX TensorProto enum
name, safetensors name, and the name TensorRT's `DataType` prints (what manifests record for engine I/O)."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import FluxtrtError


@dataclass(frozen=True)
class DType:
    name: str  # ours: fp32, fp16, bf16, int64, ...
    numpy: str  # numpy / ml_dtypes name; also torch's attribute name
    onnx: str  # onnx.TensorProto.DataType name
    safetensors: str | None
    tensorrt: str | None  # str(trt.DataType.X).split(".")[-1].lower()


TABLE = (
    DType("fp32", "float32", "FLOAT", "F32", "float"),
    DType("fp16", "float16", "FLOAT16", "F16", "half"),
    DType("bf16", "bfloat16", "BFLOAT16", "BF16", "bf16"),
    DType("fp8", "float8_e4m3fn", "FLOAT8E4M3FN", "F8_E4M3", "fp8"),
    DType("int64", "int64", "INT64", "I64", "int64"),
    DType("int32", "int32", "INT32", "I32", "int32"),
    DType("int8", "int8", "INT8", "I8", "int8"),
    DType("uint8", "uint8", "UINT8", "U8", "uint8"),
    DType("bool", "bool", "BOOL", "BOOL", "bool"),
)
BY_NAME = {d.name: d for d in TABLE}
BY_SAFETENSORS = {d.safetensors: d for d in TABLE if d.safetensors}
BY_TENSORRT = {d.tensorrt: d for d in TABLE if d.tensorrt}
FLOAT_NAMES = ("fp32", "fp16", "bf16")  # what a graph or a PyTorch module computes in
# safetensors dtypes a zero-copy graph can point at (the ONNX type is the stored type, byte for byte)
LINKABLE = ("F32", "F16", "BF16", "I64", "I32")


def check_float(name: str, flag: str = "--dtype") -> str:
    if name not in FLOAT_NAMES:
        raise FluxtrtError(f"unknown dtype '{name}' for {flag}; choose one of {', '.join(FLOAT_NAMES)}")
    return name


def torch_dtype(name: str):
    """Our name (fp32, bf16, ...) or the numpy name -> torch.dtype."""
    import torch

    d = BY_NAME.get(name) or next((d for d in TABLE if d.numpy == name), None)
    if d is None:
        raise FluxtrtError(f"unknown dtype '{name}'; choose one of {', '.join(FLOAT_NAMES)}")
    return getattr(torch, d.numpy)


def torch_dtype_of_engine(trt_name: str):
    """A manifest's engine I/O dtype (TensorRT's name: float, half, bf16, int64, bool, ...) -> torch.dtype."""
    import torch

    try:
        return getattr(torch, BY_TENSORRT[trt_name].numpy)
    except KeyError:
        raise FluxtrtError(f"engine tensor type '{trt_name}' has no torch equivalent here; rebuild the engine") from None


def from_ort_type(ort_type: str) -> DType:
    """An ONNX Runtime type string ("tensor(float)", "tensor(bfloat16)", ...) -> our row."""
    inner = ort_type.removeprefix("tensor(").removesuffix(")")
    d = next((d for d in TABLE if d.numpy == {"float": "float32"}.get(inner, inner)), None)
    if d is None:
        raise FluxtrtError(f"ONNX Runtime tensor type {ort_type} is not one fluxtrt runs; re-export the ONNX")
    return d


def onnx_enum(d: DType) -> int:
    """Our row -> onnx.TensorProto's integer for it."""
    from onnx import TensorProto

    return int(getattr(TensorProto, d.onnx))


def np_dtype(name: str):
    """numpy name (bfloat16 and float8 through ml_dtypes) -> numpy dtype."""
    import numpy as np

    if name in ("bfloat16", "float8_e4m3fn"):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def cast(x, to: str):
    """numpy cast to a numpy name, overflow to inf allowed (as ONNX Cast does)."""
    import numpy as np

    with np.errstate(over="ignore"):
        return x.astype(np_dtype(to))
