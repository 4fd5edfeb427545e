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


def test_the_fp8_transformer_compiles_as_one_graph(tiny_dev):
    """The tiny transformer with the fp8 recipe on torch._scaled_mm (which runs on a CPU too), every GEMM after a
    GELU reading this op's codes: one graph for torch.compile (dynamo.explain). The op registered lazily, inside
    the trace, broke the H100's compiled step at every double block (19 recompiles, the rest eager: 154 ms a step
    against 88). The compiled call equals the eager one."""
    import numpy as np
    import torch._dynamo as dynamo

    from fluxtrt import fp8, fp8_layers
    from fluxtrt.components import ShapePoint, specs_for

    spec = specs_for(tiny_dev.geometry, ["transformer"])["transformer"]
    feeds = spec.sample_inputs(ShapePoint(1, 256, 256), tiny_dev.geometry, int(np.random.default_rng().integers(1 << 30)))
    args = [feeds[t.name] for t in spec.inputs if t.name in feeds]
    module = tiny_dev.load_component("transformer", torch.float32, "cpu").eval()
    groups = fp8.linear_groups(spec.wrap(module), args, root=module)
    amax = {m: float(np.random.default_rng().uniform(0.5, 8.0)) for group in groups for m in group}
    note = fp8_layers.quantize_module(module, fp8.scales_from_calibration(module, amax, groups), "cpu", scaled_mm=True)
    assert "GELU and input quantize" in note, note
    wrapped = spec.wrap(module)
    dynamo.reset()
    with torch.inference_mode():
        eager = wrapped(*args).float()
        explained = dynamo.explain(wrapped)(*args)
        compiled = torch.compile(wrapped, backend="eager")(*args).float()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [b.reason for b in explained.break_reasons]
    ops = [n for n in explained.graphs[0].graph.nodes if n.target is torch.ops.fluxtrt.gelu_quantize.default]
    assert len(ops) == 2 * module.config.num_layers + module.config.num_single_layers  # ff, ff_context; proj_out
    assert float((compiled - eager).abs().max() / eager.abs().max()) <= 1e-6
