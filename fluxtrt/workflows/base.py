"""What every workflow shares: the request's image inputs, the prepared loop state, and the pieces of
diffusers' Flux pipelines that several workflows use (VAE latent sampling, image loading).

A workflow (one file in this package each) declares, for one diffusers pipeline: the model class it runs on
(model_index.json), the flags it takes, its defaults, how it prepares the denoising loop (initial latents,
schedule, what is appended to the latents every step) and how it widens the engines' profiles. The runtime
runs every workflow with the same loop; nothing else in fluxtrt knows a workflow by name."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from .. import flux_math as fm
from ..components import Geometry, ShapeRange
from ..errors import (
    WorkflowError,  # noqa: F401 - defined in errors.py, raised here
)


@dataclass
class ImageInputs:
    """What a request brings besides prompts: images (paths or PIL images) and their settings. None: the
    workflow's default (diffusers' pipeline default)."""

    image: object = None  # img2img / Fill: the image to change; Kontext: the reference image
    mask: object = None  # Fill: white = repaint
    control_image: object = None  # Canny / Depth: the preprocessed edge or depth map
    strength: float | None = None  # img2img / Fill: how much of the schedule runs (0, 1]
    max_area: int | None = None  # Kontext: output area in px² (the requested size gives the aspect ratio)

    def given(self) -> dict[str, object]:
        """The inputs set on the request, by their CLI flag."""
        flags = {"--image": self.image, "--mask": self.mask, "--control-image": self.control_image,
                 "--strength": self.strength, "--max-area": self.max_area}
        return {k: v for k, v in flags.items() if v is not None}


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


class Workflow:
    """One FLUX.1 workflow; subclasses set the attributes and override what differs from text-to-image."""

    name = ""
    pipeline = ""  # the diffusers pipeline class it reproduces
    model_class = ""  # model_index.json `_class_name` of the models it runs on
    model_name = ""  # what to tell a user whose model is another one
    needs_encoder = False  # runs the vae_encoder
    flags: tuple[str, ...] = ()  # ImageInputs flags it takes
    required: tuple[str, ...] = ()  # ... of which these must be given
    steps = 28
    guidance = 3.5
    strength: float | None = None

    def strength_of(self, inputs: ImageInputs) -> float | None:
        """The request's strength, or the workflow's default (diffusers')."""
        return self.strength if inputs.strength is None else inputs.strength

    def default_steps(self, geo: Geometry) -> int:
        return self.steps if geo.guidance else 4  # schnell: 4 steps, as its model card

    def extra_channels(self, latent_channels: int, vae_scale_factor: int) -> int:
        """Channels the transformer sees beside the packed latents (its in_channels - latent_channels * 4)."""
        return 0

    def output_size(self, height: int, width: int, inputs: ImageInputs) -> tuple[int, int]:
        return height, width

    def reference_size(self, inputs: ImageInputs, geo: Geometry) -> tuple[int, int]:
        """(height, width) of the reference image whose tokens join the sequence; (0, 0): none."""
        return (0, 0)

    def component_range(self, name: str, rng: ShapeRange) -> ShapeRange:
        """The request sizes a component's engine profile must cover (the config's range, widened where the
        workflow feeds a component other sizes)."""
        return rng

    def check(self, inputs: ImageInputs) -> None:
        if inputs.strength is not None and not 0 < inputs.strength <= 1:
            raise WorkflowError(f"--strength must be in (0, 1] (the share of the schedule that runs), got "
                                f"{inputs.strength}")
        if inputs.max_area is not None and inputs.max_area < 256 * 256:
            raise WorkflowError(f"--max-area is the output's area in px², at least 65536; got {inputs.max_area}")

    def prepare(self, ctx: Context) -> Prepared:
        raise NotImplementedError

    def diffusers_kwargs(self, inputs: ImageInputs) -> dict:
        """The same request's arguments for the diffusers pipeline (tests and `fluxtrt bench` compare with it)."""
        return {}


# --- pieces shared by several workflows (diffusers' semantics) ---------------------------------------------


def image_processor(geo: Geometry, mask: bool = False, latent_channels: bool = True):
    """diffusers' VaeImageProcessor as the Flux pipelines build theirs (resizing, normalising, binarising)."""
    from diffusers.image_processor import VaeImageProcessor

    kwargs = {"vae_latent_channels": geo.latent_channels} if latent_channels else {}
    if mask:
        kwargs.update(do_normalize=False, do_binarize=True, do_convert_grayscale=True)
    return VaeImageProcessor(vae_scale_factor=geo.vae_scale_factor * 2, **kwargs)


MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # 64 MP: far over what FLUX takes (about 4 MP), far under a decompression bomb
MIN_IMAGE_SIDE = 16  # the pixel multiple: a smaller image holds no latent pixel


def load_image(value, flag: str):
    """An RGB PIL image from a path (or a PIL image as is), checked as untrusted input: a pixel limit read from the
    header before decoding, at least 16 px a side, 16-bit and float images scaled to 8 bits (not clipped), alpha
    dropped as diffusers' load_image does. One line naming the flag otherwise."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value
    path = Path(value)
    if not path.is_file():
        raise WorkflowError(f"{flag} {path}: no such file; pass a PNG or JPEG image")
    try:
        with Image.open(path) as img:
            w, h = img.size
            if w * h > MAX_IMAGE_PIXELS:
                raise WorkflowError(f"{flag} {path} is {w}x{h} px, over the {MAX_IMAGE_PIXELS >> 20} MP limit; "
                                    "pass an image of at most a few megapixels")
            if min(w, h) < MIN_IMAGE_SIDE:
                raise WorkflowError(f"{flag} {path} is {w}x{h} px; pass an image at least {MIN_IMAGE_SIDE} px a side")
            img.load()
            return _to_rgb(img)
    except WorkflowError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError, EOFError) as e:
        raise WorkflowError(f"{flag} {path} is not a readable image ({type(e).__name__}); pass a PNG or JPEG") from None


def _to_rgb(img):
    """8-bit RGB: 16-bit integer images scaled by 255/65535, float images by 255 (clipped to 0..1)."""
    import numpy as np
    from PIL import Image

    if img.mode.startswith("I;16") or img.mode == "I":
        arr = np.asarray(img, dtype=np.float64)
        top = 65535.0 if img.mode.startswith("I;16") or arr.max(initial=0) > 255 else 255.0
        return Image.fromarray(np.clip(np.rint(arr * 255.0 / top), 0, 255).astype(np.uint8), "L").convert("RGB")
    if img.mode == "F":
        arr = np.nan_to_num(np.asarray(img, dtype=np.float64), nan=0.0)
        return Image.fromarray(np.rint(np.clip(arr, 0.0, 1.0) * 255.0).astype(np.uint8), "L").convert("RGB")
    return img.convert("RGB")


def load_resized(value, flag: str, height: int, width: int):
    """load_image, saying (one warning line) when the image is resized to the output size, as diffusers does."""
    img = load_image(value, flag)
    if img.size != (width, height):
        logging.getLogger("fluxtrt").warning("%s is %dx%d: resized to %dx%d (as diffusers does)", flag, *img.size,
                                             width, height)
    return img


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


def with_reference(rng: ShapeRange, smallest: tuple, opt: tuple, largest: tuple) -> ShapeRange:
    return ShapeRange(replace(rng.min, reference=smallest), replace(rng.opt, reference=opt),
                      replace(rng.max, reference=largest))

