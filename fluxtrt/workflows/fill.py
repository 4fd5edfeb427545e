"""Inpainting and outpainting: diffusers' FluxFillPipeline on FLUX.1-Fill-dev. The transformer sees, beside
the packed latents, the packed latents of the masked image (image * (1 - mask)) and the packed mask (each
8x8 pixel block of the binarised mask as 64 channels, then 2x2 packing): in_channels 64 + 64 + 256 = 384."""

from __future__ import annotations

import logging

import torch

from ..flux_math import pack_latents
from .base import (
    Context,
    ImageInputs,
    Prepared,
    Workflow,
    encoded,
    ids,
    image_processor,
    load_image,
    noised,
    repeat_to,
)

log = logging.getLogger("fluxtrt")


class Fill(Workflow):
    name = "fill"
    pipeline = "FluxFillPipeline"
    model_class = "FluxFillPipeline"
    model_name = "FLUX.1-Fill-dev"
    needs_encoder = True
    flags = ("--image", "--mask", "--strength")
    required = ("--image", "--mask")
    steps = 50
    guidance = 30.0
    strength = 1.0

    def extra_channels(self, latent_channels: int, vae_scale_factor: int) -> int:
        return latent_channels * 4 + vae_scale_factor * vae_scale_factor * 4

    def diffusers_kwargs(self, inputs: ImageInputs) -> dict:
        return {"image": load_image(inputs.image, "--image"), "mask_image": load_image(inputs.mask, "--mask"),
                "strength": self.strength_of(inputs)}

    def prepare(self, ctx: Context) -> Prepared:
        img, mask_img = load_image(ctx.inputs.image, "--image"), load_image(ctx.inputs.mask, "--mask")
        if img.size != mask_img.size:  # diffusers resizes both to the output size; say so
            log.warning("--mask is %dx%d and --image %dx%d: both are resized to %dx%d (as diffusers does)",
                        *mask_img.size, *img.size, ctx.width, ctx.height)
        image = image_processor(ctx.geo).preprocess(img, height=ctx.height, width=ctx.width).float()
        latents, timesteps, sigmas = noised(ctx, image, self.strength_of(ctx.inputs))

        mask = image_processor(ctx.geo, mask=True).preprocess(mask_img, height=ctx.height, width=ctx.width).float()
        masked = image * (1 - mask)
        masked_latents = encoded(ctx, masked, ctx.generator)
        vsf = ctx.geo.vae_scale_factor
        h, w = 2 * (ctx.height // (vsf * 2)), 2 * (ctx.width // (vsf * 2))
        mask = repeat_to(mask, ctx.batch)[:, 0].view(ctx.batch, h, vsf, w, vsf).permute(0, 2, 4, 1, 3)
        mask = pack_latents(mask.reshape(ctx.batch, vsf * vsf, h, w))
        return Prepared(latents, timesteps, sigmas, ids(ctx), channels=torch.cat([masked_latents, mask], dim=-1),
                        height=ctx.height, width=ctx.width)
