"""kernels/triton_fp8_attention.py, the Triton kernel itself, against its arithmetic in PyTorch
(kernels/fp8_attention.kernel_arithmetic). On a CUDA GPU of compute capability 8.9+ (scripts/gpu_check.sh runs
it): the whole kernel, E4M3 P included. On a CPU it needs Triton's interpreter (`pip install triton`, then
`TRITON_INTERPRET=1 python -m pytest tests/kernels/test_triton_fp8_attention.py`), whose E4M3 conversion is not
exact (1.97 -> 1.0, no saturation, subnormals flushed): there it checks the kernel with P unquantized (indexing,
masking of a partial key block, the online softmax). CI has neither and skips it."""

import os

import pytest
import torch

from fluxtrt.kernels import fp8_attention
from tests.kernels.test_fp8_attention import calibrated

triton = pytest.importorskip("triton", reason="Triton is not installed (it comes with CUDA builds of torch)")
GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
if not GPU and not os.environ.get("TRITON_INTERPRET"):
    pytest.skip("no sm89+ GPU; on a CPU set TRITON_INTERPRET=1 to run the kernel in Triton's interpreter",
                allow_module_level=True)


@pytest.mark.parametrize("b,h,s,d", [(1, 2, 300, 64), (2, 3, 577, 128)])
def test_kernel_computes_its_arithmetic(b, h, s, d):
    device = "cuda" if GPU else "cpu"
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    q, k, v = (torch.randn(b, h, s, d, generator=g) for _ in range(3))
    scales, _ = calibrated(q, k, v)
    t = (1, 2)
    q8, k8, vt8 = (x.to(device) for x in fp8_attention.operands(q.transpose(*t), k.transpose(*t), v.transpose(*t),
                                                                   scales))
    small = {} if GPU else {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 1}
    got = fp8_attention.run(q8, k8, vt8, scales, torch.float32, quantize_p=GPU, **small).cpu()
    want = fp8_attention.kernel_arithmetic(q, k, v, scales, block_n=small.get("block_n", 128), quantize_p=GPU)
    rel = float((got - want).abs().mean() / want.abs().mean())
    # GPU: exp2 vs exp and the order of fp32 sums move P across an E4M3 rounding boundary here and there (a 1/16
    # step of that element); the H200 measured 3.0e-3 at (2, 3, 577, 128), against the recipe's own 5.3e-2 vs fp32
    assert rel <= (5e-3 if GPU else 1e-5), rel
