"""FLUX.1 pipeline math as pure functions, reproducing diffusers' FluxPipeline and
FlowMatchEulerDiscreteScheduler exactly (tests compare each with diffusers' own). Imports no backend."""

from __future__ import annotations

import torch


def latent_image_ids(packed_height: int, packed_width: int) -> torch.Tensor:
    """[h*w, 3] float32 position ids of the packed latent grid: (0, row, col)."""
    ids = torch.zeros(packed_height, packed_width, 3)
    ids[..., 1] = ids[..., 1] + torch.arange(packed_height)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(packed_width)[None, :]
    return ids.reshape(packed_height * packed_width, 3)


def text_ids(length: int) -> torch.Tensor:
    """[T, 3] float32 text position ids: all zeros in FLUX.1."""
    return torch.zeros(length, 3)
