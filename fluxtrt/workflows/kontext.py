"""Image editing: diffusers' FluxKontextPipeline on FLUX.1-Kontext-dev. The reference image is resized to
the preferred Kontext resolution nearest its aspect ratio, VAE-encoded (the distribution's mean) and packed;
its tokens follow the latents' in the transformer's sequence with their own ids (first coordinate 1), and
only the first part of the output (the target's tokens) is used. The output keeps the requested aspect ratio
at `max_area` pixels (default 1024²). Engine profiles cover target + reference tokens."""

from __future__ import annotations

import torch

from ..components import Geometry, ShapePoint, ShapeRange
from ..flux_math import latent_image_ids
from .base import (
    Context,
    ImageInputs,
    Prepared,
    Workflow,
    encoded,
    ids,
    image_processor,
    load_image,
    noise,
    schedule,
    with_reference,
)

MAX_AREA = 1024**2  # FluxKontextPipeline's default


def preferred_resolutions() -> list[tuple[int, int]]:
    """(width, height) pairs Kontext was trained on (diffusers' list, not a copy)."""
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    return list(PREFERRED_KONTEXT_RESOLUTIONS)


class Kontext(Workflow):
    name = "kontext"
    pipeline = "FluxKontextPipeline"
    model_class = "FluxKontextPipeline"
    model_name = "FLUX.1-Kontext-dev"
    needs_encoder = True
    flags = ("--image", "--max-area")
    required = ("--image",)

    def output_size(self, height: int, width: int, inputs: ImageInputs) -> tuple[int, int]:
        """The requested aspect ratio at max_area pixels, floored to multiples of 16 (as diffusers)."""
        area = inputs.max_area or MAX_AREA
        aspect = width / height
        w, h = round((area * aspect) ** 0.5), round((area / aspect) ** 0.5)
        return h // 16 * 16, w // 16 * 16

    def reference_size(self, inputs: ImageInputs, geo: Geometry) -> tuple[int, int]:
        img = load_image(inputs.image, "--image")
        h, w = image_processor(geo, latent_channels=False).get_default_height_width(img)
        _, w, h = min((abs(w / h - pw / ph), pw, ph) for pw, ph in preferred_resolutions())
        m = geo.pixel_multiple
        return h // m * m, w // m * m

    def component_range(self, name: str, rng: ShapeRange) -> ShapeRange:
        sizes = sorted(((h // 16) * (w // 16), (h, w)) for w, h in preferred_resolutions())
        if name == "transformer":
            return with_reference(rng, sizes[0][1], (1024, 1024), sizes[-1][1])
        if name == "vae_encoder":  # encodes the reference only, at any preferred resolution
            sides = [s for _, hw in sizes for s in hw]
            lo, hi = min(sides), max(sides)
            return ShapeRange(ShapePoint(rng.min.batch, lo, lo), ShapePoint(rng.opt.batch, 1024, 1024),
                              ShapePoint(rng.max.batch, hi, hi))
        return rng

    def diffusers_kwargs(self, inputs: ImageInputs) -> dict:
        return {"image": load_image(inputs.image, "--image"), "max_area": inputs.max_area or MAX_AREA}

    def prepare(self, ctx: Context) -> Prepared:
        rh, rw = self.reference_size(ctx.inputs, ctx.geo)
        proc = image_processor(ctx.geo, latent_channels=False)
        img = proc.resize(load_image(ctx.inputs.image, "--image"), rh, rw)
        image = proc.preprocess(img, rh, rw).float()
        tokens = encoded(ctx, image, None)  # the distribution's mean (diffusers' sample_mode="argmax")
        m = ctx.geo.pixel_multiple
        ref_ids = latent_image_ids(rh // m, rw // m)
        ref_ids[:, 0] = 1  # the reference's ids: the latents' grid with first coordinate 1
        latents = noise(ctx)
        timesteps, sigmas = schedule(ctx)
        return Prepared(latents, timesteps, sigmas, torch.cat([ids(ctx), ref_ids]), tokens=tokens,
                        height=ctx.height, width=ctx.width, reference=(rh, rw))
