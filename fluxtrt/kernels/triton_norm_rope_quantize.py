"""The Triton kernel of kernels/norm_rope_quantize.py (imports triton: loaded only where a CUDA GPU runs it)."""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK_R, NUM_WARPS = 32, 4  # a tile: 32 heads of one token range, each a row of D values


@triton.jit
def _norm_rope_quantize(X, W, Cos, Sin, Out, rows, S, H, stride_b, stride_s, eps, factor, scale,
                        BLOCK_R: tl.constexpr, D: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # row = (b * S + s) * H + h
    mask = (r < rows)[:, None]
    h = r % H
    bs = r // H
    s = bs % S
    b = bs // S
    d = tl.arange(0, D)
    src = b.to(tl.int64) * stride_b + s.to(tl.int64) * stride_s + h * D
    x = tl.load(X + src[:, None] + d[None, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)
    # RMSNorm (F.rms_norm): in fp32, times the weight, rounded to x's dtype
    inv = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)
    w = tl.load(W + d).to(tl.float32)
    y = (xf * inv[:, None] * w[None, :]).to(x.dtype).to(tl.float32)
    # RoPE on pairs (y0, y1) -> (y0 cos - y1 sin, y1 cos + y0 sin), in fp32, rounded to x's dtype
    trig = s.to(tl.int64)[:, None] * D + d[None, :]
    c = tl.load(Cos + trig, mask=mask, other=0.0)
    sn = tl.load(Sin + trig, mask=mask, other=0.0)
    y0, y1 = tl.split(tl.reshape(y, (BLOCK_R, D // 2, 2)))
    c0, c1 = tl.split(tl.reshape(c, (BLOCK_R, D // 2, 2)))
    s0, s1 = tl.split(tl.reshape(sn, (BLOCK_R, D // 2, 2)))
    o = tl.reshape(tl.join(y0 * c0 + (-y1) * s0, y1 * c1 + y0 * s1), (BLOCK_R, D))
    o = o.to(x.dtype).to(tl.float32)
    q = tl.math.div_rn(o * factor, scale)  # the recipe's fp32 divide, rounded to nearest
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    # FlashInfer's layout [S, B*H, D]: token s, head b*H + h
    dst = s.to(tl.int64) * (rows // S) * D + (b * H + h) * D
    tl.store(Out + dst[:, None] + d[None, :], q.to(Out.dtype.element_ty), mask=mask)


def launch(x, weight, cos, sin, *, eps: float, factor: float, scale: float, out_dtype=None,
           block_r: int = BLOCK_R, num_warps: int = NUM_WARPS):
    """E4M3 codes [S, B*H, D] of RoPE(RMSNorm(x)) * factor / scale (kernels/norm_rope_quantize.py). `out_dtype`
    float32 writes the clamped quotient unrounded (Triton's interpreter converts to E4M3 inexactly)."""
    import torch

    b, s, h, d = x.shape
    if x.stride(3) != 1 or x.stride(2) != d:
        x = x.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    rows = b * s * h
    out = torch.empty((s, b * h, d), dtype=out_dtype or torch.float8_e4m3fn, device=x.device)
    _norm_rope_quantize[(triton.cdiv(rows, block_r),)](
        x, weight.contiguous(), cos, sin, out, rows, s, h, x.stride(0), x.stride(1), eps, factor, scale,
        BLOCK_R=block_r, D=d, num_warps=num_warps)
    return out
