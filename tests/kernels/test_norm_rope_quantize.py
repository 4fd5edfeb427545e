"""kernels/norm_rope_quantize.py without a GPU: `reference` is the processor's code path (torch.nn.RMSNorm,
diffusers' apply_rotary_emb, flashinfer_fp8_attention.operands' codes), and the custom op traces."""

import numpy as np
import torch

from fluxtrt.kernels import flashinfer_fp8_attention as fi
from fluxtrt.kernels import norm_rope_quantize as nrq
from fluxtrt.kernels.fp8_attention import root_scale


def test_reference_writes_the_processors_codes():
    """B 2, 3 heads, 40 tokens, d 128, bf16 q in N(0, 3) as a slice of a wider projection, a trained-looking norm
    weight, FLUX's rotary (cos, sin of random angles): the codes equal those of RMSNorm -> apply_rotary_emb ->
    fi.operands exactly, and differ from the same without the norm or without RoPE."""
    from diffusers.models.transformers.transformer_flux import apply_rotary_emb

    seed = int(np.random.default_rng().integers(1 << 30))
    g = torch.Generator().manual_seed(seed)
    b, s, h, d = 2, 40, 3, 128
    wide = (torch.randn(b, s, 2 * h * d, generator=g) * 3).bfloat16()
    x = wide[..., h * d:].unflatten(-1, (h, d))  # the k part of a joined projection: not contiguous
    norm = torch.nn.RMSNorm(d, eps=1e-6).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(torch.rand(d, generator=g) + 0.5)
    angles = torch.rand(s, d // 2, generator=g) * 6.28
    rotary = (angles.cos().repeat_interleave(2, 1), angles.sin().repeat_interleave(2, 1))
    scale = 0.02
    with torch.inference_mode():
        want = fi.operands(apply_rotary_emb(norm(x), rotary, sequence_dim=1), x, x, (scale, 1, 1, 1))[0]
        got = nrq.codes(x, norm, rotary, root_scale(d), scale)
    assert got.dtype == torch.float8_e4m3fn and got.shape == (s, b * h, d)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), seed
    plain = nrq.reference(x, torch.ones(d, dtype=x.dtype), *rotary, eps=1e-6, factor=1.0, scale=scale)
    unrotated = nrq.reference(x, norm.weight, torch.ones(s, d), torch.zeros(s, d), eps=1e-6, factor=1.0, scale=scale)
    assert not torch.equal(plain.view(torch.uint8), got.view(torch.uint8))
    assert not torch.equal(unrotated.view(torch.uint8), got.view(torch.uint8))


def test_the_op_traces_with_its_fake():
    """torch.compile (aot_eager) takes the op as one node with the fake's shape; the call equals eager."""
    x = torch.randn(1, 24, 2, 128).bfloat16()
    w, cos, sin = torch.rand(128).bfloat16() + 0.5, torch.rand(24, 128), torch.rand(24, 128)

    def f(x):
        return nrq.norm_rope_quantize(x, w, cos, sin, [1e-6, 0.3, 0.01]).float() * 2

    eager = f(x)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    assert eager.shape == (24, 2, 128) and torch.equal(eager, compiled)
