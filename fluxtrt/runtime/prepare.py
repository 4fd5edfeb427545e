"""How each workflow starts its denoising loop, with diffusers' semantics: the prepared loop state (initial
latents, schedule, what joins the latents every step) from a request. One function per workflow of
core/workflows.py (the declarations), found by its name in PREPARE; the pieces several share (VAE latent
sampling, noise, schedule) first."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from .. import flux_math as fm
from ..components import Geometry
from ..core.image_inputs import image_processor, load_image, load_resized
from ..core.workflows import ImageInputs, Workflow
from ..errors import WorkflowError

log = logging.getLogger("fluxtrt")


@dataclass
class Prepared:
    """The denoising loop's starting state for one request (CPU tensors, float32)."""

    latents: torch.Tensor  # packed [B, N, C]
    timesteps: torch.Tensor  # [n]
    sigmas: torch.Tensor  # [n + 1]
    img_ids: torch.Tensor  # [N (+ R), 3]
    channels: torch.Tensor | None = None  # [B, N, C'] appended to the latents' channels every step (Fill, Control)
    tokens: torch.Tensor | None = None  # [B, R, C] appended to the latents' tokens every step (Kontext)
    height: int = 0
    width: int = 0
    reference: tuple[int, int] = (0, 0)

    def to(self, device) -> "Prepared":
        """The same state with its tensors on `device` (the runtime uploads everything before the loop)."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(self, latents=move(self.latents), img_ids=move(self.img_ids), channels=move(self.channels),
                       tokens=move(self.tokens))

    def model_input(self, latents: torch.Tensor) -> torch.Tensor:
        """The transformer's hidden_states for these latents (what diffusers' loop builds every step)."""
        if self.channels is not None:
            latents = torch.cat([latents, self.channels], dim=2)
        if self.tokens is not None:
            latents = torch.cat([latents, self.tokens], dim=1)
        return latents


@dataclass
class Context:
    """What a workflow's `prepare` gets from the runtime."""

    geo: Geometry
    scheduler_config: dict
    scaling_factor: float
    shift_factor: float
    encode: Callable  # images [b, 3, H, W] float32 in [-1, 1] -> VAE latent parameters [b, 2C, H/8, W/8] (CPU)
    generator: torch.Generator
    batch: int
    height: int
    width: int
    steps: int
    inputs: ImageInputs = field(default_factory=ImageInputs)
    noise_dtype: torch.dtype = torch.float32  # the dtype diffusers' pipeline would draw the noise in


def sample_latents(parameters: torch.Tensor, generator: torch.Generator | None, ctx: Context) -> torch.Tensor:
    """diffusers' `retrieve_latents(vae.encode(x), generator)` then `(x - shift) * scale`: a sample of the VAE's
    diagonal Gaussian (mean + std * noise from the generator, drawn in the matched pipeline's dtype as its
    randn_tensor does: see flux_math.initial_noise), or its mean when `generator` is None (argmax)."""
    mean, logvar = torch.chunk(parameters.float(), 2, dim=1)
    if generator is None:
        latents = mean
    else:
        std = torch.exp(0.5 * torch.clamp(logvar, -30.0, 20.0))
        latents = mean + std * torch.randn(mean.shape, generator=generator, dtype=ctx.noise_dtype).float()
    return (latents - ctx.shift_factor) * ctx.scaling_factor


def encoded(ctx: Context, images: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Preprocessed images -> packed latents for every sample of the batch (VAE encoder, then a sample drawn
    with `generator` or the mean, scaled and shifted, repeated for the batch, packed)."""
    return fm.pack_latents(repeat_to(sample_latents(ctx.encode(images), generator, ctx), ctx.batch))


def noised(ctx: Context, image: torch.Tensor, strength: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(latents, timesteps, sigmas) of the img2img pipelines: the schedule truncated by `strength`, the image's
    latents drawn first, then the noise, mixed as FlowMatchEulerDiscreteScheduler.scale_noise at the first sigma."""
    timesteps, sigmas = schedule(ctx, strength)
    image_latents = encoded(ctx, image, ctx.generator)
    sigma = sigmas[0]
    return sigma * noise(ctx) + (1.0 - sigma) * image_latents, timesteps, sigmas


def repeat_to(latents: torch.Tensor, batch: int) -> torch.Tensor:
    """One image's latents for every sample of the batch (diffusers' cat / repeat of a single image)."""
    return torch.cat([latents] * (batch // latents.shape[0]), dim=0) if latents.shape[0] < batch else latents


def noise(ctx: Context) -> torch.Tensor:
    """The packed starting noise [B, N, 4C], drawn from the CPU generator as diffusers' randn_tensor. (Packing is
    a permutation: mixing it with packed image latents equals diffusers' mix-then-pack bit for bit.)"""
    g = ctx.geo
    return fm.initial_noise(ctx.batch, g.latent_channels, ctx.height, ctx.width, g.vae_scale_factor, generator=ctx.generator,
                            dtype=ctx.noise_dtype)


def schedule(ctx: Context, strength: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(timesteps, sigmas) of FluxPipeline, truncated by `strength` as the img2img pipelines' get_timesteps."""
    m = ctx.geo.pixel_multiple
    timesteps, sigmas = fm.flow_match_sigmas(ctx.steps, (ctx.height // m) * (ctx.width // m), ctx.scheduler_config)
    if strength is None:
        return timesteps, sigmas
    init = min(ctx.steps * strength, ctx.steps)
    start = int(max(ctx.steps - init, 0))
    if ctx.steps - start < 1:
        raise WorkflowError(f"--strength {strength} with {ctx.steps} steps leaves no step to run; raise --strength "
                            f"or --steps")
    return timesteps[start:], sigmas[start:]


def ids(ctx: Context) -> torch.Tensor:
    m = ctx.geo.pixel_multiple
    return fm.latent_image_ids(ctx.height // m, ctx.width // m)


# --- one function per workflow ---------------------------------------------------------------------------


def txt2img(wf: Workflow, ctx: Context) -> Prepared:
    """FluxPipeline: noise and the full schedule."""
    latents = noise(ctx)
    timesteps, sigmas = schedule(ctx)
    return Prepared(latents, timesteps, sigmas, ids(ctx), height=ctx.height, width=ctx.width)


def img2img(wf: Workflow, ctx: Context) -> Prepared:
    """FluxImg2ImgPipeline: the image's latents noised at the schedule truncated by strength."""
    img = load_resized(ctx.inputs.image, "--image", ctx.height, ctx.width)
    image = image_processor(ctx.geo).preprocess(img, height=ctx.height, width=ctx.width).float()
    latents, timesteps, sigmas = noised(ctx, image, wf.strength_of(ctx.inputs))
    return Prepared(latents, timesteps, sigmas, ids(ctx), height=ctx.height, width=ctx.width)


def fill(wf: Workflow, ctx: Context) -> Prepared:
    """FluxFillPipeline: img2img's start, plus the masked image's latents and the packed mask as channels."""
    img, mask_img = load_image(ctx.inputs.image, "--image"), load_image(ctx.inputs.mask, "--mask")
    if img.size != mask_img.size:  # diffusers resizes both to the output size; say so
        log.warning("--mask is %dx%d and --image %dx%d: both are resized to %dx%d (as diffusers does)",
                    *mask_img.size, *img.size, ctx.width, ctx.height)
    image = image_processor(ctx.geo).preprocess(img, height=ctx.height, width=ctx.width).float()
    latents, timesteps, sigmas = noised(ctx, image, wf.strength_of(ctx.inputs))

    mask = image_processor(ctx.geo, mask=True).preprocess(mask_img, height=ctx.height, width=ctx.width).float()
    masked = image * (1 - mask)
    masked_latents = encoded(ctx, masked, ctx.generator)
    vsf = ctx.geo.vae_scale_factor
    h, w = 2 * (ctx.height // (vsf * 2)), 2 * (ctx.width // (vsf * 2))
    mask = repeat_to(mask, ctx.batch)[:, 0].view(ctx.batch, h, vsf, w, vsf).permute(0, 2, 4, 1, 3)
    mask = fm.pack_latents(mask.reshape(ctx.batch, vsf * vsf, h, w))
    return Prepared(latents, timesteps, sigmas, ids(ctx), channels=torch.cat([masked_latents, mask], dim=-1),
                    height=ctx.height, width=ctx.width)


def control(wf: Workflow, ctx: Context) -> Prepared:
    """FluxControlPipeline: noise, and the control image's latents as channels."""
    img = load_resized(ctx.inputs.control_image, "--control-image", ctx.height, ctx.width)
    image = image_processor(ctx.geo).preprocess(img, height=ctx.height, width=ctx.width).float()
    image = image.repeat_interleave(ctx.batch, dim=0)  # encoded as a batch, as diffusers does
    channels = encoded(ctx, image, ctx.generator)  # already one per sample: nothing to repeat
    latents = noise(ctx)
    timesteps, sigmas = schedule(ctx)
    return Prepared(latents, timesteps, sigmas, ids(ctx), channels=channels, height=ctx.height, width=ctx.width)


def kontext(wf: Workflow, ctx: Context) -> Prepared:
    """FluxKontextPipeline: noise, and the reference image's latents (its mean) as tokens."""
    rh, rw = wf.reference_size(ctx.inputs, ctx.geo)
    proc = image_processor(ctx.geo, latent_channels=False)
    img = proc.resize(load_image(ctx.inputs.image, "--image"), rh, rw)
    image = proc.preprocess(img, rh, rw).float()
    tokens = encoded(ctx, image, None)  # the distribution's mean (diffusers' sample_mode="argmax")
    m = ctx.geo.pixel_multiple
    ref_ids = fm.latent_image_ids(rh // m, rw // m)
    ref_ids[:, 0] = 1  # the reference's ids: the latents' grid with first coordinate 1
    latents = noise(ctx)
    timesteps, sigmas = schedule(ctx)
    return Prepared(latents, timesteps, sigmas, torch.cat([ids(ctx), ref_ids]), tokens=tokens,
                    height=ctx.height, width=ctx.width, reference=(rh, rw))


PREPARE: dict[str, Callable[[Workflow, Context], Prepared]] = {
    "txt2img": txt2img, "img2img": img2img, "fill": fill, "control": control, "kontext": kontext}


def prepare_workflow(wf: Workflow, ctx: Context) -> Prepared:
    """The request's starting state for workflow `wf`."""
    return PREPARE[wf.name](wf, ctx)
