"""NVFP4 weights (issue 21, first piece; not yet wired into `fluxtrt build`): E2M1 values with one E4M3 scale per
block of 16 along the input dimension and one fp32 global scale per tensor, as NVIDIA's ModelOpt writes them
and TensorRT reads them (two DequantizeLinear: E4M3 scales x global -> block scales; E2M1 x block scales ->
weights). tests/test_nvfp4.py builds that form with TensorRT-RTX for sm120 on a CPU (sm89 refuses fp4).

Recipe (ModelOpt's): global = amax|w| / (6 * 448); block scale = amax|block| / 6 / global, rounded to E4M3;
values = w / (block scale * global), clipped to +-6 and rounded to E2M1 (nearest, ties to even, as ONNX Cast).
`fake_quant` computes the dequantized weight with the very arithmetic of the two DequantizeLinear nodes (fp32),
so the bytes written can be checked bit for bit (`check_written`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import FluxtrtError

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0


@dataclass
class NVFP4Weight:
    """One weight [out, in] in NVFP4: E2M1 codes packed two per byte (first element in the low nibble, as ONNX
    FLOAT4E2M1), E4M3 block scales [out, in / 16] (as uint8 bytes) and the fp32 global scale."""

    packed: np.ndarray  # uint8 [out * in / 2]
    scales: np.ndarray  # uint8 (E4M3 bits) [out, in / 16]
    global_scale: np.float32
    shape: tuple[int, int]


def _types():
    import ml_dtypes

    return ml_dtypes.float4_e2m1fn, ml_dtypes.float8_e4m3fn


def quantize(w: np.ndarray, block: int = BLOCK) -> NVFP4Weight:
    """NVFP4 of a 2-D weight [out, in] whose `in` is a multiple of `block`."""
    f4, f8 = _types()
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % block:
        raise FluxtrtError(f"NVFP4 takes a [out, in] weight with in a multiple of {block}; got {list(w.shape)}")
    out, inp = w.shape
    amax = float(np.abs(w).max())
    global_scale = np.float32(amax / (E2M1_MAX * E4M3_MAX)) if amax > 0 else np.float32(1.0)
    blocks = w.reshape(out, inp // block, block)
    scale = (np.abs(blocks).max(-1) / np.float32(E2M1_MAX) / global_scale).astype(np.float32)
    scale_f8 = np.clip(scale, 0, E4M3_MAX).astype(f8)
    step = scale_f8.astype(np.float32) * global_scale  # what the first DequantizeLinear computes
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, blocks / step[..., None], 0.0).astype(np.float32)
    codes = np.clip(q, -E2M1_MAX, E2M1_MAX).astype(f4).view(np.uint8).reshape(-1) & 0x0F
    packed = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)
    return NVFP4Weight(packed, scale_f8.view(np.uint8), global_scale, (out, inp))


def dequantize(q: NVFP4Weight, block: int = BLOCK) -> np.ndarray:
    """The weight the two DequantizeLinear nodes produce (fp32): E2M1 value x (E4M3 scale x global)."""
    f4, f8 = _types()
    out, inp = q.shape
    codes = np.empty(out * inp, dtype=np.uint8)
    codes[0::2], codes[1::2] = q.packed & 0x0F, q.packed >> 4
    values = codes.view(f4).astype(np.float32).reshape(out, inp // block, block)
    step = q.scales.view(f8).astype(np.float32) * q.global_scale
    return (values * step[..., None]).reshape(out, inp)


def fake_quant(w: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """quantize then dequantize: the PyTorch-side reference of the recipe (same scales, same rounding)."""
    return dequantize(quantize(w, block), block)


def check_written(q: NVFP4Weight, expected: np.ndarray, name: str = "weight") -> None:
    """The stored codes and scales dequantize to `expected` bit for bit (a corrupted block scale or value is
    one line naming the first block that differs)."""
    got = dequantize(q)
    if got.shape != expected.shape or not np.array_equal(got.view(np.uint32), expected.view(np.uint32)):
        bad = np.argwhere(got.view(np.uint32) != expected.view(np.uint32)) if got.shape == expected.shape else [[0, 0]]
        row, col = (int(v) for v in bad[0])
        raise FluxtrtError(f"{name}: NVFP4 bytes do not reproduce the recipe at [{row}, {col}] (block {col // BLOCK});"
                           " the file is corrupt: rebuild with `fluxtrt build --force`")


def onnx_tensors(q: NVFP4Weight, name: str):
    """The three initializers of the ModelOpt form: `<name>_f4` (FLOAT4E2M1 [out, in]), `<name>_f8_scale`
    (FLOAT8E4M3FN [out, in / 16]) and `<name>_f8_scale_f32_scale` (FLOAT scalar)."""
    from onnx import TensorProto, helper

    out, inp = q.shape
    return (helper.make_tensor(f"{name}_f4", TensorProto.FLOAT4E2M1, [out, inp], q.packed.tobytes(), raw=True),
            helper.make_tensor(f"{name}_f8_scale", TensorProto.FLOAT8E4M3FN, list(q.scales.shape),
                               q.scales.tobytes(), raw=True),
            helper.make_tensor(f"{name}_f8_scale_f32_scale", TensorProto.FLOAT, [], [float(q.global_scale)]))


def dequantize_nodes(name: str, output: str, block: int = BLOCK):
    """The two DequantizeLinear nodes that turn `onnx_tensors(q, name)` into the weight `output`."""
    from onnx import helper

    return [helper.make_node("DequantizeLinear", [f"{name}_f8_scale", f"{name}_f8_scale_f32_scale"],
                             [f"{name}_scale"], name=f"{name}_DequantizeLinear"),
            helper.make_node("DequantizeLinear", [f"{name}_f4", f"{name}_scale"], [output], axis=-1,
                             block_size=block, name=f"{name}_DequantizeLinear_1")]
