"""Image-to-image: diffusers' FluxImg2ImgPipeline on the base FLUX.1-dev / -schnell models. The image is
resized to the requested size, VAE-encoded (a sample drawn with the request's generator), the schedule is
truncated by `strength`, and the starting latents are `sigma * noise + (1 - sigma) * image latents`."""

from __future__ import annotations

from ..flux_math import pack_latents
from .base import (
    Context,
    ImageInputs,
    Prepared,
    Workflow,
    ids,
    image_processor,
    load_image,
    noise,
    repeat_to,
    sample_latents,
    schedule,
)


class ImageToImage(Workflow):
    name = "img2img"
    pipeline = "FluxImg2ImgPipeline"
    model_class = "FluxPipeline"
    model_name = "FLUX.1-dev or FLUX.1-schnell"
    needs_encoder = True
    flags = ("--image", "--strength")
    required = ("--image",)
    guidance = 7.0
    strength = 0.6

    def diffusers_kwargs(self, inputs: ImageInputs) -> dict:
        return {"image": load_image(inputs.image, "--image"),
                "strength": self.strength if inputs.strength is None else inputs.strength}

    def prepare(self, ctx: Context) -> Prepared:
        strength = self.strength if ctx.inputs.strength is None else ctx.inputs.strength
        image = image_processor(ctx.geo).preprocess(load_image(ctx.inputs.image, "--image"), height=ctx.height,
                                                    width=ctx.width).float()
        timesteps, sigmas = schedule(ctx, strength)
        image_latents = pack_latents(repeat_to(sample_latents(ctx.encode(image), ctx.generator, ctx), ctx.batch))
        sigma = sigmas[0]
        latents = sigma * noise(ctx) + (1.0 - sigma) * image_latents  # FlowMatchEulerDiscreteScheduler.scale_noise
        return Prepared(latents, timesteps, sigmas, ids(ctx), height=ctx.height, width=ctx.width)
