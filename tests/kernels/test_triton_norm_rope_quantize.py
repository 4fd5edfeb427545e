"""kernels/triton_norm_rope_quantize.py, the RMSNorm + RoPE + E4M3 quantize kernel, against its arithmetic in
PyTorch (kernels/norm_rope_quantize.reference). On a CUDA GPU: the E4M3 codes themselves, and the op under
torch.compile. On a CPU it needs Triton's interpreter (`pip install triton`, then `TRITON_INTERPRET=1 python -m pytest
tests/kernels/test_triton_norm_rope_quantize.py`), which converts to bf16 by truncating and to E4M3 inexactly: there
the kernel writes the clamped fp32 quotient. CI has neither and skips it."""

import os

import pytest
import torch

from fluxtrt.kernels import norm_rope_quantize as nrq

triton = pytest.importorskip("triton", reason="Triton is not installed (it comes with CUDA builds of torch)")
GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
if not GPU and not os.environ.get("TRITON_INTERPRET"):
    pytest.skip("no sm89+ GPU; on a CPU set TRITON_INTERPRET=1 to run the kernel in Triton's interpreter",
                allow_module_level=True)


def operands(b: int, s: int, h: int, device):
    """x [b, s, h, 128] bf16 in N(0, 3) as the middle slice of a joined projection (batch and sequence strides of
    the wide output), a norm weight, FLUX-like rotary (cos, sin of random angles, pairs repeated), and a scale from
    the result's range (a few values saturate)."""
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    d = 128
    wide = (torch.randn(b, s, 3 * h * d, generator=g) * 3).bfloat16()
    x = wide[..., h * d:2 * h * d].unflatten(-1, (h, d))
    weight = (torch.rand(d, generator=g) + 0.5).bfloat16()
    angles = torch.rand(s, d // 2, generator=g) * 6.28
    cos, sin = angles.cos().repeat_interleave(2, 1), angles.sin().repeat_interleave(2, 1)
    y = nrq.rope(torch.nn.functional.rms_norm(x, (d,), weight, 1e-6), cos, sin)
    scale = float(y.float().abs().max()) * 0.3 / 448 * 0.9
    return (t.to(device) for t in (x, weight, cos, sin)), scale


@pytest.mark.parametrize("b,s,h", [(1, 37, 3), (3, 20, 2)])
def test_kernel_computes_its_arithmetic(b, s, h):
    from fluxtrt.kernels.triton_norm_rope_quantize import launch

    device = "cuda" if GPU else "cpu"
    (x, weight, cos, sin), scale = operands(b, s, h, device)
    assert not x.is_contiguous()
    want = nrq.reference(x, weight, cos, sin, eps=1e-6, factor=0.3, scale=scale).float().cpu()
    if GPU:
        got = launch(x, weight, cos, sin, eps=1e-6, factor=0.3, scale=scale).float().cpu()
        # the norm's sum in another order (and an FMA) moves a bf16 rounding now and then: one E4M3 step at most
        far = (got - want).abs() > want.abs() / 8 + 2.0 ** -9
        assert not bool(far.any()), int(far.sum())
        assert float((got != want).float().mean()) <= 2e-3
    else:
        got = launch(x, weight, cos, sin, eps=1e-6, factor=0.3, scale=scale, out_dtype=torch.float32, block_r=8)
        normed = torch.nn.functional.rms_norm(x, (128,), weight, 1e-6)
        y = nrq.rope(normed, cos, sin)
        quotient = (y.float() * 0.3 / scale).clamp(-448, 448).transpose(0, 1).reshape(s, b * h, 128)
        # the interpreter truncates to bf16 twice (the norm, then RoPE): two bf16 steps of the pair's magnitude
        # (RoPE adds two products of it, which can cancel), plus E4M3's least step
        pair = normed.float().unflatten(-1, (64, 2)).abs().sum(-1, keepdim=True).expand(b, s, h, 64, 2).flatten(-2)
        bound = (pair * 0.3 / scale).transpose(0, 1).reshape(s, b * h, 128) * 2.0 ** -6 + 2.0 ** -9
        assert bool(((got - quotient).abs() <= bound).all()), float(((got - quotient).abs() - bound).max())
        # and a wrong walk (a head or a token out of place) is far off: the codes are not a permutation's
        assert float((got - quotient).abs().mean()) <= 0.01 * float(quotient.abs().mean())


@pytest.mark.skipif(not GPU, reason="torch.compile of the op needs a CUDA GPU")
def test_compiled_op_equals_eager():
    (x, weight, cos, sin), scale = operands(2, 64, 4, "cuda")
    eager = nrq.norm_rope_quantize(x, weight, cos, sin, [1e-6, 0.3, scale])
    compiled = torch.compile(nrq.norm_rope_quantize, fullgraph=True)(x, weight, cos, sin, [1e-6, 0.3, scale])
    assert torch.equal(eager.view(torch.uint8), compiled.view(torch.uint8))
