"""The fp8 recipe's activation quantize fused with the GELU before it (issue 42: quantize epilogues fused).

Two E4M3 GEMMs of the transformer read a GELU's output: a double-stream block's `ff.net.2` (and `ff_context`'s)
reads GELU(tanh)(ff.net.0.proj(x)), and a single-stream block's `proj_out` reads cat([attention, GELU(tanh)(mlp)]).
Inductor fuses the GELU, the concatenation and the quantize (x / sx, saturate, E4M3) into one pointwise kernel,
which the H100 profile found at about half of HBM speed (a single block's: 132 us for 212 MB): it walks the
[rows, 15360] output as one flat index (a divide and a modulo per element) and computes tanh through libdevice.
`gelu_quantize` is the same arithmetic as one Triton kernel over 2-D tiles, each tile in one part (no per-element
index arithmetic, no masked double loads), the GELU's tanh as 2 sigmoid(2u) - 1 on exp2:

    out = E4M3(clamp(cat([a, dtype(gelu_tanh(m))]) / sx, -448, 448))

with the GELU rounded to the activation's dtype first, as the layer computes it (`reference` is this in PyTorch,
and what runs on a CPU). `fluxtrt::gelu_quantize` is a torch.library.triton_op: torch.compile and AOTInductor see
the kernel and keep it whole (a compiled package carries it); CUDA graphs capture it. The Triton kernel is
kernels/triton_gelu_quantize.py, imported only where it runs."""

from __future__ import annotations

import torch

SQRT_2_OVER_PI = 0.7978845608028654
KAPPA = 0.044715


def gelu_tanh(m: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation in the input's dtype (computed in fp32): nn.GELU(approximate="tanh")."""
    return torch.nn.functional.gelu(m.float(), approximate="tanh").to(m.dtype)


def reference(m: torch.Tensor, scale, a: torch.Tensor | None = None) -> torch.Tensor:
    """What the kernel computes, in PyTorch: E4M3 codes of cat([a, gelu_tanh(m)], -1) / scale."""
    from ..fp8 import to_e4m3

    x = gelu_tanh(m)
    return to_e4m3(x if a is None else torch.cat([a.to(m.dtype), x], dim=-1), scale)


def runs_on(device) -> bool:
    """Whether the Triton kernel computes gelu_quantize on `device`: a CUDA device with Triton importable."""
    if torch.device(device).type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def gelu_quantize(m: torch.Tensor, scale: torch.Tensor, a: torch.Tensor | None = None) -> torch.Tensor:
    """E4M3 codes [rows, na + nm] of cat([a, gelu_tanh(m)], -1) / scale: m [..., nm] and a [..., na] (same leading
    dimensions, each contiguous in its last one), scale a 0-d fp32 tensor (the layer's static input scale). On a
    CUDA GPU one Triton kernel; elsewhere `reference`."""
    if runs_on(m.device):
        return _op()(m, scale, a)
    return reference(m, scale, a).reshape(-1, m.shape[-1] + (0 if a is None else a.shape[-1]))


_OP = []


def _op():
    """`fluxtrt::gelu_quantize`, registered on first use (a triton_op, so Inductor and AOTInductor see the kernel)."""
    if _OP:
        return _OP[0]
    from torch.library import triton_op, wrap_triton

    from .triton_gelu_quantize import launch

    @triton_op("fluxtrt::gelu_quantize", mutates_args=())
    def op(m: torch.Tensor, scale: torch.Tensor, a: torch.Tensor | None = None) -> torch.Tensor:
        return launch(m, scale, a, wrap=wrap_triton)

    _OP.append(op)
    return op
