"""fluxtrt/attention.py: the FLUX attention processor with the attention a function computes what diffusers'
processor computes (double- and single-stream blocks, projections joined or not), and is put on the attention
modules in forward order."""

import pytest
import torch

from fluxtrt import attention
from fluxtrt.components import ShapePoint, specs_for


@pytest.fixture(scope="module")
def tiny_transformer():
    from fluxtrt.models.source import resolve_model

    src = resolve_model("tiny")
    spec = specs_for(src.geometry, ["transformer"])["transformer"]
    return src, spec


def _run(module, spec, feeds):
    out = module(*[feeds[t.name] for t in spec.inputs if t.name in feeds])
    return out[0] if isinstance(out, (tuple, list)) else out


@pytest.mark.parametrize("joined", [False, True])
def test_processor_with_sdpa_is_diffusers_processor(tiny_transformer, joined):
    """fp32, fresh random inputs: the transformer with every attention through Processor(sdpa) equals the
    transformer with diffusers' own processor within 1e-6 relative; a function that is not attention changes it."""
    from fluxtrt.fp8_layers import fuse_projections

    src, spec = tiny_transformer
    raw = src.load_component("transformer", torch.float32, "cpu").eval()
    if joined:
        fuse_projections(raw)
    feeds = spec.sample_inputs(ShapePoint(2, 64, 96), src.geometry, int(torch.randint(1 << 30, ())))
    module = spec.wrap(raw)
    with torch.inference_mode():
        want = _run(module, spec, feeds)
        names = attention.attention_modules(raw)
        assert attention.use_attention(raw, [attention.sdpa] * len(names)) == len(names) == 4
        got = _run(module, spec, feeds)
        attention.use_attention(raw, [lambda q, k, v: attention.sdpa(k, q, v)] * len(names))  # q and k swapped
        off = _run(module, spec, feeds)
    rel = lambda a: float((a - want).abs().max() / want.abs().max())  # noqa: E731
    assert rel(got) <= 1e-6 and rel(off) > 1e-3, (rel(got), rel(off))
    assert names == ["transformer_blocks.0.attn", "transformer_blocks.1.attn", "single_transformer_blocks.0.attn",
                     "single_transformer_blocks.1.attn"]
    with pytest.raises(ValueError, match="3 attention functions for 4 attention modules"):
        attention.use_attention(raw, [attention.sdpa] * 3)
