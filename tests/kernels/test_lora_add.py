import pytest
import torch

from fluxtrt.kernels.lora_add import lora_add_


@pytest.mark.parametrize("compiled", [False, True])
def test_the_term_lands_in_its_columns_only_and_in_place(compiled):
    """y[..., lo:hi] += h @ up per sample and the other columns untouched (fp32, the written-out arithmetic within
    1e-5 relative), eager and under torch.compile (the mutation of the GEMM's output kept)."""
    g = torch.Generator().manual_seed(7)
    n, length, fin, out, r, lo, hi = 3, 20, 24, 40, 5, 8, 30
    w, x = torch.randn(out, fin, generator=g), torch.randn(n, length, fin, generator=g)
    h, up = torch.randn(n, length, r, generator=g), torch.randn(n, r, hi - lo, generator=g)

    def f(x, h, up):
        y = x @ w.T
        lora_add_(y, h, up, lo, hi)
        return y

    want = x @ w.T
    want[..., lo:hi] += torch.bmm(h, up)
    got = (torch.compile(f, fullgraph=True) if compiled else f)(x, h, up)
    assert got.shape == (n, length, out)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert torch.equal(got[..., :lo], (x @ w.T)[..., :lo]) and torch.equal(got[..., hi:], (x @ w.T)[..., hi:])


def test_a_flat_output_takes_the_term_of_its_one_sample():
    """A [n*L, out] output (a Linear's on flattened tokens) with n = 1: the whole width (LoraSide's use)."""
    g = torch.Generator().manual_seed(8)
    y, h, up = torch.randn(12, 16, generator=g), torch.randn(1, 12, 3, generator=g), torch.randn(3, 16, generator=g)
    want = y + h[0] @ up
    lora_add_(y, h, up.T.contiguous().T[None], 0, 16)
    assert (y - want).abs().max().item() <= 1e-5 * want.abs().max().item()
