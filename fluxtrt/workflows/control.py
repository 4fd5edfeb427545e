"""Structural control: diffusers' FluxControlPipeline on FLUX.1-Canny-dev / FLUX.1-Depth-dev. The control
image (the user's edge or depth map) is resized, repeated for the batch, VAE-encoded (a sample drawn with the
request's generator) and packed; the transformer sees it beside the latents: in_channels 64 + 64 = 128."""

from __future__ import annotations

from .base import (
    Context,
    ImageInputs,
    Prepared,
    Workflow,
    encoded,
    ids,
    image_processor,
    load_image,
    load_resized,
    noise,
    schedule,
)


class Control(Workflow):
    name = "control"
    pipeline = "FluxControlPipeline"
    model_class = "FluxControlPipeline"
    model_name = "FLUX.1-Canny-dev or FLUX.1-Depth-dev"
    needs_encoder = True
    flags = ("--control-image",)
    required = ("--control-image",)

    def extra_channels(self, latent_channels: int, vae_scale_factor: int) -> int:
        return latent_channels * 4

    def diffusers_kwargs(self, inputs: ImageInputs) -> dict:
        return {"control_image": load_image(inputs.control_image, "--control-image")}

    def prepare(self, ctx: Context) -> Prepared:
        img = load_resized(ctx.inputs.control_image, "--control-image", ctx.height, ctx.width)
        control = image_processor(ctx.geo).preprocess(img, height=ctx.height, width=ctx.width).float()
        control = control.repeat_interleave(ctx.batch, dim=0)  # encoded as a batch, as diffusers does
        channels = encoded(ctx, control, ctx.generator)  # already one per sample: nothing to repeat
        latents = noise(ctx)
        timesteps, sigmas = schedule(ctx)
        return Prepared(latents, timesteps, sigmas, ids(ctx), channels=channels, height=ctx.height, width=ctx.width)
