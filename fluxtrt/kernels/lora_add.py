"""A low-rank term added into the output columns it touches, in place: y[:, :, lo:hi] += h @ up per sample.

Written out as `y[..., lo:hi].add_(torch.bmm(h, up))`, Inductor materialises the product (for a single block's
joined projection at 512², batch 8, 0.5 GB) and reads it again; a custom op that mutates `y` keeps it one cuBLAS
call whose C is the slice itself (beta 1, ldc the row width): the touched columns are read and written once. The
op is `fluxtrt::lora_add_`, registered on import; torch.compile re-places it on the GEMM's output buffer."""

import torch


@torch.library.custom_op("fluxtrt::lora_add_", mutates_args=("y",))
def lora_add_(y: torch.Tensor, h: torch.Tensor, up: torch.Tensor, lo: int, hi: int) -> None:
    """y [n*L, out] or [n, L, out] += h [n, L, r] @ up [n, r, hi - lo] on columns lo:hi, in place."""
    n = h.shape[0]
    y.view(n, -1, y.shape[-1])[..., lo:hi].baddbmm_(h, up)


@lora_add_.register_fake
def _(y, h, up, lo, hi):
    return None
