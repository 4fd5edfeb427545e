"""Image-to-image: diffusers' FluxImg2ImgPipeline on the base FLUX.1-dev / -schnell models. The image is
resized to the requested size, VAE-encoded (a sample drawn with the request's generator), the schedule is
truncated by `strength`, and the starting latents are `sigma * noise + (1 - sigma) * image latents`."""

from __future__ import annotations

from .base import (
    Context,
    ImageInputs,
    Prepared,
    Workflow,
    ids,
    image_processor,
    load_image,
    load_resized,
    noised,
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
                "strength": self.strength_of(inputs)}

    def prepare(self, ctx: Context) -> Prepared:
        img = load_resized(ctx.inputs.image, "--image", ctx.height, ctx.width)
        image = image_processor(ctx.geo).preprocess(img, height=ctx.height, width=ctx.width).float()
        latents, timesteps, sigmas = noised(ctx, image, self.strength_of(ctx.inputs))
        return Prepared(latents, timesteps, sigmas, ids(ctx), height=ctx.height, width=ctx.width)
