"""Text-to-image: diffusers' FluxPipeline (FLUX.1-dev / -schnell)."""

from __future__ import annotations

from .base import Context, Prepared, Workflow, ids, noise, schedule


class TextToImage(Workflow):
    name = "txt2img"
    pipeline = "FluxPipeline"
    model_class = "FluxPipeline"
    model_name = "FLUX.1-dev or FLUX.1-schnell"

    def prepare(self, ctx: Context) -> Prepared:
        latents = noise(ctx)
        timesteps, sigmas = schedule(ctx)
        return Prepared(latents, timesteps, sigmas, ids(ctx), height=ctx.height, width=ctx.width)
