"""fp8-attn's q and k operands of a single-stream block as one kernel each: RMSNorm, RoPE and the E4M3 quantize.

In a single-stream block the processor normalizes q and k (torch.nn.RMSNorm over the head dim), rotates them
(diffusers' apply_rotary_emb: pairs (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin), in fp32, rounded to the
activation's dtype) and FlashInfer's operands are then E4M3 codes of x * c / s in its [S, B*H, D] layout
(flashinfer_fp8_attention.operands). Inductor fuses these into one kernel per block that the H100 profile found at
93 us for 127 MB (1.37 TB/s, 3.5 ms of an 86.5 ms step at 1024²; docs/benchmarks.md). `norm_rope_quantize` is the
same arithmetic as one Triton kernel over tiles of whole heads (a row of D values: its norm, its pairs), reading
the projection where it lies (a slice of the joined projection's output) and writing the codes in FlashInfer's
layout; `reference` is the processor's code path in PyTorch and what runs on a CPU. `fluxtrt::norm_rope_quantize`
is a torch custom op registered on import, as kernels/gelu_quantize.py's is; the Triton kernel is
kernels/triton_norm_rope_quantize.py, imported only where it runs."""

import importlib.util

import torch


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' apply_rotary_emb(x, (cos, sin), sequence_dim=1) for FLUX (use_real, pairs unbound on the last
    dim): x [B, S, H, D], cos and sin [S, D] fp32; computed in fp32, returned in x's dtype."""
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (x.float() * c + rotated.float() * s).to(x.dtype)


def reference(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, eps: float,
              factor: float, scale: float) -> torch.Tensor:
    """What the kernel computes, in PyTorch: x [B, S, H, D] -> RMSNorm (torch.nn.RMSNorm's F.rms_norm) -> RoPE ->
    E4M3 codes of x * factor / scale, as [S, B*H, D] (flashinfer_fp8_attention.operands' layout and arithmetic)."""
    from ..fp8 import to_e4m3

    b, s, h, d = x.shape
    y = rope(torch.nn.functional.rms_norm(x, (d,), weight, eps), cos, sin)
    return to_e4m3(y.float() * factor, scale).transpose(0, 1).contiguous().view(s, b * h, d)


TRITON = importlib.util.find_spec("triton") is not None


def runs_on(device) -> bool:
    """Whether the Triton kernel computes norm_rope_quantize on `device`: a CUDA device with Triton installed."""
    return torch.device(device).type == "cuda" and TRITON


@torch.library.custom_op("fluxtrt::norm_rope_quantize", mutates_args=())
def norm_rope_quantize(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       numbers: list[float]) -> torch.Tensor:
    """E4M3 codes [S, B*H, D] of RoPE(RMSNorm(x)) * factor / scale: x [B, S, H, D] (heads contiguous in D, each
    head's D values contiguous; batch and sequence at any strides), weight [D], cos and sin [S, D] fp32, numbers
    [eps, factor, scale]. On a CUDA GPU one Triton kernel; elsewhere `reference`."""
    eps, factor, scale = numbers
    if runs_on(x.device):
        from .triton_norm_rope_quantize import launch

        return launch(x, weight, cos, sin, eps=eps, factor=factor, scale=scale)
    return reference(x, weight, cos, sin, eps=eps, factor=factor, scale=scale)


@norm_rope_quantize.register_fake
def _(x, weight, cos, sin, numbers):
    b, s, h, d = x.shape
    return x.new_empty((s, b * h, d), dtype=torch.float8_e4m3fn)


def codes(x: torch.Tensor, norm, rotary, factor: float, scale: float) -> torch.Tensor:
    """norm_rope_quantize with a torch.nn.RMSNorm module's weight and eps (its eps None: the dtype's, as
    F.rms_norm takes it) and the processor's rotary (cos, sin)."""
    d = x.shape[-1]
    weight = norm.weight if norm.weight is not None else torch.ones(d, dtype=x.dtype, device=x.device)
    eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    cos, sin = rotary
    return norm_rope_quantize(x, weight, cos, sin, [float(eps), factor, scale])
