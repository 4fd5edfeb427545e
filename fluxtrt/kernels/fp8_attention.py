"""fp8-attn's attention on FP8 tensor cores (sm89+): a Triton flash-attention forward over E4M3 operands.

Q and K arrive as E4M3 codes of q*c / sq and k*c / sk (c = sqrt(1/sqrt(d)), fp8.sdpa_root_scale), V as codes of
v / sv, transposed ([B, H, D, S]: the second MatMul's operand K-major, as Hopper's FP8 wgmma wants it). Per block
of 128 queries the kernel walks the keys in blocks: S = Q8 K8^T * sq sk (fp32 accumulation), the online softmax
in fp32 (running max m, running sum l of the unquantized probabilities), p = exp(S - m) in (0, 1] quantized to
E4M3 with the fixed scale 1/448 (p * 448 in E4M3's range), acc += p8 V8 (fp32), and at the end
out = acc * sv / 448 / l. It differs from the graph's arithmetic (fp8.attention_recipe: the normalized P
quantized with its calibrated scale sp) only in where P's roundings fall: `kernel_arithmetic` is this kernel in
PyTorch, and tests/kernels/test_fp8_attention.py bounds it against the recipe.

The kernel itself is kernels/triton_fp8_attention.py, imported only when `attention` runs (on a CUDA GPU)."""

from __future__ import annotations

import math

import torch

P_SCALE = 448.0  # p in (0, 1] times this fills E4M3's range (largest finite 448)
LOG2E = 1.4426950408889634


@torch.compiler.assume_constant_result
def root_scale(head_dim: int) -> float:
    """fp8.sdpa_root_scale(head_dim) as a Python float (the same fp32 value): a constant to torch.compile, where
    float() of the tensor would break the graph (Tensor.item) at every attention."""
    from ..fp8 import sdpa_root_scale

    return float(sdpa_root_scale(head_dim))


def operands(q, k, v, scales, v_transposed: bool = True):
    """The kernel's operands from q, k, v [B, S, H, D] (after RoPE) and the recipe's (sq, sk, sp, sv): E4M3 codes
    of q*c/sq and k*c/sk as [B, H, S, D], of v/sv as [B, H, D, S] (or [B, H, S, D]: not `v_transposed`, as
    cuDNN's FP8 attention takes it)."""
    from ..fp8 import to_e4m3

    sq, sk, _, sv = scales
    c = root_scale(q.shape[-1])
    q8 = to_e4m3(q.float() * c, sq).transpose(1, 2).contiguous()
    k8 = to_e4m3(k.float() * c, sk).transpose(1, 2).contiguous()
    v8 = to_e4m3(v, sv).permute(0, 2, 3, 1) if v_transposed else to_e4m3(v, sv).transpose(1, 2)
    return q8, k8, v8.contiguous()


def kernel_arithmetic(q, k, v, scales, *, block_n: int = 128, quantize_p: bool = True, reverse: bool = False):
    """What the kernel computes, in PyTorch (fp32): q, k, v [..., S, D] after RoPE, scales (sq, sk, sp, sv);
    keys in blocks of `block_n` with the running max (`reverse`: the last block first), p quantized as
    exp(S - m) * 448 in E4M3 (or not: quantize_p, as the kernel's)."""
    from ..fp8 import sdpa_root_scale, to_e4m3

    sq, sk, _, sv = scales
    c = sdpa_root_scale(q.shape[-1])
    return on_codes(to_e4m3(q.float() * c, sq), to_e4m3(k.float() * c, sk), to_e4m3(v.float(), sv), sq * sk, sv,
                    block_n=block_n, quantize_p=quantize_p, reverse=reverse)


def on_codes(q8, k8, v8, qk_scale: float, v_scale: float, *, block_n: int = 128, quantize_p: bool = True,
             reverse: bool = False):
    """kernel_arithmetic's loop on E4M3 codes q8, k8, v8 [..., S, D] (fp32): S = q8 k8^T * qk_scale, keys in
    blocks of `block_n` (starting at 0; `reverse`: visited from the last, as FlashAttention-3's mainloop walks
    them), out = sum p8 v8 * v_scale / 448 / l. Where P's roundings fall follows the running max m, so the block
    size and order are part of the arithmetic."""
    import torch

    from ..fp8 import to_e4m3

    q8, k8, v8 = q8.float(), k8.float(), v8.float()
    s = (q8 @ k8.transpose(-1, -2)) * qk_scale
    m = torch.full(s.shape[:-1], -math.inf, device=s.device)
    l_sum = torch.zeros(s.shape[:-1], device=s.device)
    acc = torch.zeros(*s.shape[:-1], v8.shape[-1], device=s.device)
    starts = range(0, s.shape[-1], block_n)
    for j in reversed(starts) if reverse else starts:
        blk = s[..., j: j + block_n]
        m_new = torch.maximum(m, blk.amax(-1))
        p = torch.exp(blk - m_new[..., None])
        alpha = torch.exp(m - m_new)
        l_sum = l_sum * alpha + p.sum(-1)
        p8 = to_e4m3(p * P_SCALE, 1.0).float() if quantize_p else p * P_SCALE
        acc = acc * alpha[..., None] + p8 @ v8[..., j: j + block_n, :]
        m = m_new
    return acc * (v_scale / P_SCALE) / l_sum[..., None]


def attention(q, k, v, scales, **launch):
    """fp8-attn's attention on FP8 tensor cores: q, k, v [B, S, H, D] (after RoPE, as diffusers' processor holds
    them), scales (sq, sk, sp, sv) -> [B, S, H, D] in q's dtype. `launch`: the kernel's block sizes, warps, stages."""
    q8, k8, vt8 = operands(q, k, v, scales)
    return run(q8, k8, vt8, scales, q.dtype, **launch).transpose(1, 2)


def run(q8, k8, vt8, scales, out_dtype, **launch):
    """The kernel on operands(...)'s E4M3 codes with the recipe's (sq, sk, sp, sv): [B, H, S_q, D] in `out_dtype`."""
    from .triton_fp8_attention import launch as start

    sq, sk, _, sv = (float(s) for s in scales)
    return start(q8, k8, vt8, out_dtype, qk_scale=sq * sk * LOG2E, out_scale=sv / P_SCALE, p_scale=P_SCALE, **launch)
