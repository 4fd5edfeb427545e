"""fp8_layers.py: the fp8 recipe as PyTorch layers: torch._scaled_mm (which also runs on a CPU) computes what the
emulation computes, and the joined projections compute diffusers' blocks."""

import numpy as np
import pytest
import torch

from fluxtrt import fp8, fp8_layers
from fluxtrt.components import ShapePoint, specs_for


@pytest.fixture(scope="module")
def transformer(tiny_bf16):
    src = tiny_bf16
    spec = specs_for(src.geometry, ["transformer"])["transformer"]
    return src, spec


def inputs(src, spec, point):
    feeds = spec.sample_inputs(point, src.geometry, int(np.random.default_rng().integers(1 << 30)))
    return [feeds[t.name] for t in spec.inputs if t.name in feeds]


def test_scaled_mm_layers_compute_the_emulated_recipe(transformer):
    """In fp32 (where a dequantized E4M3 value is exact), q/k/v fused, with scales from random activation ranges
    and the module's own weights: the same arithmetic up to the order of the fp32 sums."""
    src, spec = transformer
    args = inputs(src, spec, ShapePoint(1, 256, 256))
    raw = src.load_component("transformer", torch.float32, "cpu").eval()
    groups = fp8.linear_groups(spec.wrap(raw), args, root=raw)
    rng = np.random.default_rng()
    amax = {m: float(rng.uniform(0.5, 8.0)) for group in groups for m in group}
    scales = fp8.scales_from_calibration(raw, amax, groups)
    outs = {}
    for mode in ("emulated", "scaled_mm", "none"):
        raw = src.load_component("transformer", torch.float32, "cpu").eval()
        if mode != "none":
            note = fp8_layers.quantize_module(raw, scales, "cpu", scaled_mm=mode == "scaled_mm")
            assert ("_scaled_mm" in note) == (mode == "scaled_mm")
        with torch.inference_mode():
            outs[mode] = spec.wrap(raw)(*args).float()
        if mode == "scaled_mm":  # q/k/v joined, and a single block's q/k/v/mlp, as the graph joins them
            gemms = sum(type(m).__name__ == "Fp8Linear" for m in raw.modules())
            singles = sum(hasattr(m, "proj_qkv_mlp") for m in raw.modules())
            assert singles == raw.config.num_single_layers and f"in {gemms} GEMMs" in note
            assert gemms == len(scales) - 3 * singles - 2 * 2 * raw.config.num_layers
            # every GEMM after a GELU reads the codes of kernels/gelu_quantize (its PyTorch arithmetic on a CPU)
            gelus = 2 * raw.config.num_layers + singles
            assert f"GELU and input quantize of {gelus} GEMMs as PyTorch" in note, note
    rel = lambda a, b: float((a - b).abs().mean() / b.abs().mean())  # noqa: E731
    assert rel(outs["scaled_mm"], outs["emulated"]) <= min(1e-4, rel(outs["none"], outs["emulated"]) / 50), \
        (rel(outs["scaled_mm"], outs["emulated"]), rel(outs["none"], outs["emulated"]))


def test_joined_projections_equal_the_modules_they_replace(transformer):
    """The compiled bf16 path's joined GEMMs (q/k/v; a single-stream block's q/k/v + MLP input, with its own
    forward) compute diffusers' blocks: fp32, fresh inputs, equal up to the order of the fp32 sums."""
    src, spec = transformer
    args = inputs(src, spec, ShapePoint(2, 128, 192))
    raw = src.load_component("transformer", torch.float32, "cpu").eval()
    with torch.inference_mode():
        ref = spec.wrap(raw)(*args).float()
        joined = fp8_layers.fuse_projections(raw)
        got = spec.wrap(raw)(*args).float()
    assert joined == 2 * raw.config.num_layers + raw.config.num_single_layers
    assert not any(hasattr(m, "proj_mlp") or hasattr(m, "to_q") for m in raw.modules())
    assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-5
