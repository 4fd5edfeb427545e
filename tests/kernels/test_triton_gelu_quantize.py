"""kernels/triton_gelu_quantize.py, the GELU + E4M3 quantize kernel, against its arithmetic in PyTorch
(kernels/gelu_quantize.reference). On a CUDA GPU (scripts/gpu_check.sh runs it): the E4M3 codes themselves, and the
op under torch.compile. On a CPU it needs Triton's interpreter (`pip install triton`, then
`TRITON_INTERPRET=1 python -m pytest tests/kernels/test_triton_gelu_quantize.py`), which converts to bf16 by truncating
and to E4M3 inexactly: there the kernel writes the clamped fp32 quotient (the tiles, both parts, the masks of
partial tiles, the strides of a sliced input). CI has neither and skips it."""

import os

import pytest
import torch

from fluxtrt.kernels import gelu_quantize

triton = pytest.importorskip("triton", reason="Triton is not installed (it comes with CUDA builds of torch)")
GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
if not GPU and not os.environ.get("TRITON_INTERPRET"):
    pytest.skip("no sm89+ GPU; on a CPU set TRITON_INTERPRET=1 to run the kernel in Triton's interpreter",
                allow_module_level=True)


def operands(rows: int, na: int, nm: int, device, batch: int = 1):
    """m as a slice of a wider activation (a joined GEMM's output, as a single block's MLP input is), a beside it,
    both bf16 of spread N(0, 2), and the recipe's scale from their range. batch > 1: [batch, rows / batch, ...], a
    transposed from [rows / batch, batch, na] as FlashInfer's attention output comes (its rows at two strides)."""
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    wide = (torch.randn(rows, 64 + nm, generator=g) * 2).bfloat16()
    m = wide.to(device).view(batch, rows // batch, 64 + nm)[:, :, 64:]  # row stride 64 + nm
    a = (torch.randn(rows // batch, batch, na, generator=g) * 2).bfloat16().to(device).transpose(0, 1) if na else None
    top = max(float(gelu_quantize.gelu_tanh(m).abs().max()), float(a.abs().max()) if na else 0.0)
    return m, a, torch.tensor(top / 448 * 0.9, device=device)  # a few values saturate


@pytest.mark.parametrize("rows,na,nm,batch", [(37, 0, 300, 1), (45, 96, 700, 1), (45, 96, 200, 3)])
def test_kernel_computes_its_arithmetic(rows, na, nm, batch):
    from fluxtrt.kernels.triton_gelu_quantize import launch

    device = "cuda" if GPU else "cpu"
    m, a, scale = operands(rows, na, nm, device, batch)
    assert batch == 1 or not a.is_contiguous()
    want = gelu_quantize.reference(m, scale, a).reshape(rows, na + nm).float().cpu()
    if GPU:
        got = launch(m, scale, a).float().cpu()
        # exp2's sigmoid for libdevice's tanh moves a GELU across a bf16 rounding boundary now and then, which
        # can move its code by one E4M3 step (1/8 of the value; 2^-9 among the subnormals)
        far = (got - want).abs() > want.abs() / 8 + 2.0 ** -9
        assert not bool(far.any()), int(far.sum())
        assert float((got != want).float().mean()) <= 1e-3
    else:
        got = launch(m, scale, a, out_dtype=torch.float32, block_r=8, block_c=64)
        x = torch.cat([a.float(), gelu_quantize.gelu_tanh(m).float()], -1) if na else gelu_quantize.gelu_tanh(m)
        quotient = (x.float() / scale).clamp(-448, 448).reshape(rows, na + nm)
        # a: exact. GELU: the interpreter truncates to bf16 (one bf16 step, 2^-7 of the value), and where PyTorch's
        # 1 + tanh(u) cancels (x below -4) the sigmoid form differs far under E4M3's least step (2^-9)
        assert torch.equal(got[:, :na], quotient[:, :na])
        bound = quotient[:, na:].abs() * 2.0 ** -7 + 2.0 ** -10
        assert bool(((got[:, na:] - quotient[:, na:]).abs() <= bound).all())


@pytest.mark.skipif(not GPU, reason="torch.compile of the op needs a CUDA GPU")
def test_compiled_op_equals_eager():
    """fluxtrt::gelu_quantize under torch.compile (Inductor inlines the triton_op's kernel) writes the same codes."""
    m, a, scale = operands(300, 128, 512, "cuda")
    eager = gelu_quantize.gelu_quantize(m, scale, a)
    compiled = torch.compile(gelu_quantize.gelu_quantize, fullgraph=True)(m, scale, a)
    assert torch.equal(eager.view(torch.uint8), compiled.view(torch.uint8))
