"""kernels/cudnn_fp8_attention.py, cuDNN's FP8 flash attention on fp8-attn's operands, against the arithmetic it
shares with our Triton kernel (kernels/fp8_attention.kernel_arithmetic). It runs where a Hopper or newer GPU and
the `cudnn` module (pip nvidia-cudnn-frontend) are; elsewhere `available()` says why in one line and the kernel
test skips with that line."""

import pytest
import torch

from fluxtrt.kernels import cudnn_fp8_attention, fp8_attention
from tests.kernels.test_fp8_attention import calibrated

WHY = cudnn_fp8_attention.available()


def test_available_says_what_is_missing():
    """None exactly where a Hopper+ GPU and the cudnn module are both here; else a line naming the missing one."""
    gpu = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
    try:
        import cudnn  # noqa: F401

        module = True
    except ImportError:
        module = False
    if not gpu:
        assert WHY == "cuDNN's FP8 attention needs a Hopper or newer GPU"
    elif not module:
        assert WHY.startswith("the cudnn module (pip nvidia-cudnn-frontend) is not here")
    else:
        assert WHY is None


@pytest.mark.skipif(WHY is not None, reason=WHY or "")
@pytest.mark.parametrize("b,h,s,d", [(1, 2, 300, 128), (2, 3, 577, 128)])
def test_cudnn_computes_the_kernels_arithmetic(b, h, s, d):
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    q, k, v = (torch.randn(b, h, s, d, generator=g) for _ in range(3))
    scales, _ = calibrated(q, k, v)
    t = (1, 2)
    got = cudnn_fp8_attention.attention(*(x.transpose(*t).cuda() for x in (q, k, v)), scales).transpose(*t)
    want = fp8_attention.kernel_arithmetic(q, k, v, scales)
    rel = float((got.float().cpu() - want).abs().mean() / want.abs().mean())
    # cuDNN's block order, exp2 and its bf16 (or E4M3) output move values by rounding steps, as the Triton
    # kernel's bound says; a wrong scale or layout is O(1)
    assert rel <= 1e-2, rel
