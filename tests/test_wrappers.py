"""wrappers.py: each component's PyTorch module with positional inputs in its spec's order; the transformer's
First-Block Cache parts compose to the whole transformer."""

import os

import torch

from fluxtrt import wrappers
from fluxtrt.compare import validation_points
from fluxtrt.components import specs_for
from fluxtrt.models.source import resolve_model


def test_head_tail_and_out_compose_to_the_transformer():
    src = resolve_model("tiny")
    geo = src.geometry
    raw = src.load_component("transformer").eval()
    spec = specs_for(geo, ["transformer"])["transformer"]
    feeds = spec.sample_inputs(validation_points(geo)[1], geo, int.from_bytes(os.urandom(2), "little"))
    args = [feeds[t.name] for t in spec.inputs if t.name in feeds]
    with torch.no_grad():
        whole = wrappers.transformer(raw)(*args)
        hidden, encoder, temb, residual = wrappers.transformer_head(raw)(*args)
        tail = wrappers.transformer_tail(raw)(hidden, encoder, temb, feeds["img_ids"], feeds["txt_ids"])
        parts = wrappers.transformer_out(raw)(tail, temb)
        direct = raw(hidden_states=feeds["hidden_states"], encoder_hidden_states=feeds["encoder_hidden_states"],
                     pooled_projections=feeds["pooled_projections"], timestep=feeds["timestep"],
                     img_ids=feeds["img_ids"], txt_ids=feeds["txt_ids"], guidance=feeds.get("guidance"),
                     return_dict=False)[0]
    assert torch.equal(whole, direct)  # the wrapper only orders the inputs
    assert torch.allclose(parts, whole, rtol=1e-5, atol=1e-6) and residual.abs().max() > 0
