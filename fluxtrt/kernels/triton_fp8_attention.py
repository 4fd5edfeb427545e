"""The Triton kernel of kernels/fp8_attention.py (imports triton: loaded only where a CUDA GPU runs it)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _forward(Q, K, VT, Out, qk_scale, out_scale,
             stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vd,
             stride_ob, stride_oh, stride_os, H, S_Q, S_K,
             D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, P_SCALE_C: tl.constexpr,
             QUANTIZE_P: tl.constexpr):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                mask=offs_m[:, None] < S_Q, other=0.0)  # [M, D] E4M3
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = VT + b * stride_vb + h * stride_vh
    for start_n in range(0, S_K, BLOCK_N):
        cols = start_n + offs_n
        valid = cols[None, :] < S_K
        kt = tl.load(k_base + cols[None, :] * stride_ks + offs_d[:, None], mask=valid, other=0.0)  # [D, N]
        s = tl.dot(q, kt) * qk_scale  # fp32, log2 units: S * log2(e)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v_base + offs_d[:, None] * stride_vd + cols[None, :], mask=valid, other=0.0)  # [D, N]
        if QUANTIZE_P:
            acc = acc * alpha[:, None] + tl.dot((p * P_SCALE_C).to(vt.dtype), tl.trans(vt))
        else:  # p unquantized (fp32 MatMul of dequantized V): checks the rest where fp8 rounding is not exact
            acc = acc * alpha[:, None] + tl.dot(p * P_SCALE_C, tl.trans(vt).to(tl.float32))
        m_i = m_new
    out = acc * (out_scale / l_i)[:, None]
    tl.store(Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=offs_m[:, None] < S_Q)


def launch(q8, k8, vt8, out_dtype, *, qk_scale: float, out_scale: float, p_scale: float, block_m: int = 128,
           block_n: int = 128, num_warps: int = 8, num_stages: int = 3, quantize_p: bool = True):
    """q8, k8 [B, H, S, D] and vt8 [B, H, D, S] E4M3 codes (each contiguous in its last dimension) -> attention
    [B, H, S_q, D] in `out_dtype`: qk_scale = sq sk log2(e), out_scale = sv / p_scale, p quantized as
    exp(S - m) * p_scale (kernels/fp8_attention.run computes them). quantize_p=False leaves p unquantized (Triton's
    interpreter converts to E4M3 inexactly: tests check the rest of the kernel so)."""
    import torch

    b, h, s_q, d = q8.shape
    s_k = k8.shape[2]
    out = torch.empty((b, h, s_q, d), dtype=out_dtype, device=q8.device)
    grid = (triton.cdiv(s_q, block_m), b * h)
    _forward[grid](q8, k8, vt8, out, qk_scale, out_scale,
                   q8.stride(0), q8.stride(1), q8.stride(2), k8.stride(0), k8.stride(1), k8.stride(2),
                   vt8.stride(0), vt8.stride(1), vt8.stride(2), out.stride(0), out.stride(1), out.stride(2),
                   h, s_q, s_k, D=d, BLOCK_M=block_m, BLOCK_N=block_n, P_SCALE_C=p_scale, QUANTIZE_P=quantize_p,
                   num_warps=num_warps, num_stages=num_stages)
    return out
