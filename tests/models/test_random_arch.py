"""models/random_arch.py: the real FLUX.1 architectures with random weights (full size on demand)."""

import torch


def test_random_architecture_is_full_size():
    from fluxtrt.models.source import resolve_model

    src = resolve_model("random:flux.1-dev")
    geo = src.geometry
    assert (geo.t5_hidden, geo.clip_hidden, geo.in_channels, geo.latent_channels, geo.t5_length) == (4096, 768, 64, 16, 512)
    assert src.random_weights and resolve_model("random:flux.1-schnell").variant == "schnell"
    vae = src.load_component("vae", torch.float32)  # 84M parameters: small enough for the CPU
    assert sum(p.numel() for p in vae.parameters()) > 80e6
