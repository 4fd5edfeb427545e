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
and what runs on a CPU). `fluxtrt::gelu_quantize` is a torch custom op: torch.compile, CUDA graphs and AOTInductor
packages keep it whole (a package calls it, as it calls FlashInfer's, with Triton on the machine that runs it).
The Triton kernel is kernels/triton_gelu_quantize.py, imported only where it runs."""

import importlib.util
from typing import Optional

import torch


def gelu_tanh(m: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation in the input's dtype (computed in fp32): nn.GELU(approximate="tanh")."""
    return torch.nn.functional.gelu(m.float(), approximate="tanh").to(m.dtype)


def reference(m: torch.Tensor, scale, a: Optional[torch.Tensor] = None) -> torch.Tensor:
    """What the kernel computes, in PyTorch: E4M3 codes of cat([a, gelu_tanh(m)], -1) / scale."""
    from ..fp8 import to_e4m3

    x = gelu_tanh(m)
    return to_e4m3(x if a is None else torch.cat([a.to(m.dtype), x], dim=-1), scale)


TRITON = importlib.util.find_spec("triton") is not None


def runs_on(device) -> bool:
    """Whether the Triton kernel computes gelu_quantize on `device`: a CUDA device with Triton installed."""
    return torch.device(device).type == "cuda" and TRITON


@torch.library.custom_op("fluxtrt::gelu_quantize", mutates_args=())
def gelu_quantize(m: torch.Tensor, scale: torch.Tensor, a: Optional[torch.Tensor] = None) -> torch.Tensor:
    """E4M3 codes [rows, na + nm] of cat([a, gelu_tanh(m)], -1) / scale: m [..., nm] and a [..., na] (same leading
    dimensions, each contiguous in its last one; a's rows may lie at two strides, as a transposed [B, S, na]),
    scale a 0-d fp32 tensor (the layer's static input scale). On a CUDA GPU one Triton kernel; elsewhere
    `reference`. A custom op registered on import (registered inside a
    trace, it would break the compiled graph at every block)."""
    if runs_on(m.device):
        from .triton_gelu_quantize import launch

        return launch(m, scale, a)
    return reference(m, scale, a).reshape(-1, m.shape[-1] + (0 if a is None else a.shape[-1]))


@gelu_quantize.register_fake
def _(m, scale, a=None):
    nm = m.shape[-1]
    return m.new_empty((m.numel() // nm, nm + (0 if a is None else a.shape[-1])), dtype=torch.float8_e4m3fn)
