"""kernels/fp8_attention.py: the FP8 attention kernel's arithmetic (in PyTorch, fp32) against the fp8-attn recipe
the graph computes (fp8.attention_recipe) and against exact attention, on fresh random inputs at FLUX's head
size."""

import torch

from fluxtrt import fp8
from fluxtrt.kernels import fp8_attention


def calibrated(q, k, v):
    """The recipe's scales (sq, sk, sp, sv) as calibration takes them: bf16(amax / 448) of q c, k c, P and v."""
    c = float(fp8.sdpa_root_scale(q.shape[-1]))
    p = (q @ k.transpose(-1, -2) * c * c).softmax(-1)
    return tuple(fp8.activation_scale(float(x.abs().max())) for x in (q * c, k * c, p, v)), p @ v


def test_kernel_arithmetic_is_as_close_to_attention_as_the_recipe():
    """B 1, 3 heads, 700 tokens (not a multiple of the key block), d 128, N(0, 1) inputs: the kernel's result (p
    quantized as exp(S - m) * 448 per key block) is no further from exact attention than the recipe's (the
    normalized P quantized with its calibrated scale), within 10%, and the two differ by less than either's error
    (about 5% mean relative each here: E4M3 q and k move the logits)."""
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    q, k, v = (torch.randn(1, 3, 700, 128, generator=g) for _ in range(3))
    scales, exact = calibrated(q, k, v)
    recipe = fp8.attention_recipe(q, k, v, scales)
    kernel = fp8_attention.kernel_arithmetic(q, k, v, scales)
    rel = lambda a, b: float((a - b).abs().mean() / b.abs().mean())  # noqa: E731
    assert 0 < rel(kernel, exact) <= 1.1 * rel(recipe, exact) <= 0.1, (rel(kernel, exact), rel(recipe, exact))
    assert rel(kernel, recipe) < rel(recipe, exact), (rel(kernel, recipe), rel(recipe, exact))
    # the operands the kernel reads are the recipe's E4M3 codes, laid out [B, H, S, D] and V as [B, H, D, S]
    t = (1, 2)
    q8, k8, vt8 = fp8_attention.operands(q.transpose(*t), k.transpose(*t), v.transpose(*t), scales)
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == q.shape and vt8.shape == (1, 3, 128, 700)
    c = float(fp8.sdpa_root_scale(128))
    assert torch.equal(q8.float() * scales[0], fp8.fp8_fake_quant(q * c, scales[0]))
    assert torch.equal(vt8.transpose(-1, -2).float() * scales[3], fp8.fp8_fake_quant(v, scales[3]))
