"""The Triton kernel of kernels/gelu_quantize.py (imports triton: loaded only where a CUDA GPU runs it)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

BLOCK_R, BLOCK_C, NUM_WARPS = 16, 512, 4  # a tile: 16 rows of 512 columns, all in one part (scripts/fast_torch.py
# kernels measures these against others and against Inductor's kernel)


@triton.jit
def _gelu_quantize(M, A, Out, Scale, rows, NM, NA, stride_m, inner_a, stride_a_outer, stride_a, stride_o,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, HAS_A: tl.constexpr, EXACT_TANH: tl.constexpr,
                   RECIPROCAL: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r64 = r[:, None].to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    scale = tl.load(Scale)
    if HAS_A:
        blocks_a = tl.cdiv(NA, BLOCK_C)
    else:
        blocks_a = 0
    if pid_c < blocks_a:  # a tile of the first part: copied
        cols = pid_c * BLOCK_C + c
        mask = (r[:, None] < rows) & (cols[None, :] < NA)
        row_a = (r64 // inner_a) * stride_a_outer + (r64 % inner_a) * stride_a  # a's rows: [outer, inner] strided
        x = tl.load(A + row_a + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        out_cols = cols
    else:  # a tile of m: GELU(tanh) in fp32, rounded to m's dtype as the layer's output is
        cols = (pid_c - blocks_a) * BLOCK_C + c
        mask = (r[:, None] < rows) & (cols[None, :] < NM)
        m = tl.load(M + r64 * stride_m + cols[None, :], mask=mask, other=0.0)
        x = m.to(tl.float32)
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        if EXACT_TANH:  # PyTorch's formula and tanh (libdevice's tanhf, as its CUDA GELU)
            g = 0.5 * x * (1.0 + libdevice.tanh(u))
        else:  # 0.5 (1 + tanh u) = sigmoid(2u): one exp2
            g = x / (1.0 + tl.math.exp2(-2.8853900817779268 * u))
        x = g.to(m.dtype).to(tl.float32)
        out_cols = NA + cols
    if RECIPROCAL:  # x * (1 / sx): a multiply for the divide, within one fp32 rounding of it
        y = x * (1.0 / scale)
    else:
        y = tl.math.div_rn(x, scale)  # the recipe's fp32 divide, rounded to nearest
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    tl.store(Out + r64 * stride_o + out_cols[None, :], y.to(Out.dtype.element_ty), mask=mask)


def launch(m, scale, a=None, *, out_dtype=None, block_r: int = BLOCK_R, block_c: int = BLOCK_C,
           num_warps: int = NUM_WARPS, exact_tanh: bool = False, reciprocal: bool = False):
    """E4M3 codes [rows, na + nm] of cat([a, gelu_tanh(m)], -1) / scale (kernels/gelu_quantize.py). `out_dtype`
    float32 writes the clamped quotient unrounded (Triton's interpreter converts to E4M3 inexactly: tests check
    the rest so); `exact_tanh`: PyTorch's formula with libdevice's tanh, `reciprocal`: x * (1/sx) for x / sx
    (scripts/fast_torch.py kernels measures both)."""
    import torch

    nm = m.shape[-1]
    m2 = m.reshape(-1, nm)
    if m2.stride(-1) != 1:
        m2 = m2.contiguous()
    rows = m2.shape[0]
    na = 0 if a is None else a.shape[-1]
    # a read where it lies as [outer, inner, na] (its rows need not be one stride apart): the attention output of a
    # batch above 1 is [B, S, na] with S's stride B*na (FlashInfer's [S, B*H, D], transposed), which reshape(-1, na)
    # would copy first (113 MB a single block at 1024², batch 4)
    a3 = m2.view(1, rows, nm) if a is None else (a.view(1, *a.shape) if a.dim() == 2 else a.flatten(0, -3))
    if a3.stride(-1) != 1:
        a3 = a3.contiguous()
    out = torch.empty((rows, na + nm), dtype=out_dtype or torch.float8_e4m3fn, device=m.device)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(na, block_c) + triton.cdiv(nm, block_c))
    _gelu_quantize[grid](m2, a3, out, scale, rows, nm, na, m2.stride(0), a3.shape[1], a3.stride(0), a3.stride(1),
                         out.stride(0),
                         BLOCK_R=block_r, BLOCK_C=block_c, HAS_A=a is not None, EXACT_TANH=exact_tanh,
                         RECIPROCAL=reciprocal, num_warps=num_warps)
    return out
