"""kernels/gelu_quantize.py: what the fp8 GEMMs after a GELU read is the layers' arithmetic (nn.GELU with the tanh
approximation in the activation's dtype, the concatenation, the recipe's quantize), as codes [rows, na + nm]."""

import torch

from fluxtrt.fp8 import to_e4m3
from fluxtrt.kernels import gelu_quantize


def test_codes_are_the_layers_arithmetic():
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    wide = (torch.randn(2, 33, 80, generator=g) * 3).bfloat16()
    m, a = wide[..., 16:], (torch.randn(2, 33, 24, generator=g) * 3).bfloat16()
    scale = torch.tensor(float(torch.rand((), generator=g)) * 0.02 + 0.005)
    act = torch.nn.GELU(approximate="tanh")
    got = gelu_quantize.gelu_quantize(m, scale, a)  # on a CPU: its PyTorch arithmetic
    want = to_e4m3(torch.cat([a, act(m)], dim=-1), scale).reshape(66, 88)
    assert got.dtype == torch.float8_e4m3fn and got.shape == (66, 88)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    alone = gelu_quantize.gelu_quantize(m, scale)
    assert torch.equal(alone.view(torch.uint8), want[:, 24:].view(torch.uint8))
