"""The FLUX.1 workflows fluxtrt runs, declared once for the build and the runtime: text-to-image, img2img,
Fill, Control (Canny / Depth), Kontext. A model folder's `model_index.json` class says which it serves; the
request's flags pick among them.

A workflow declares, for one diffusers pipeline: the model class it runs on, the flags it takes, its defaults,
the channels and tokens it adds to the transformer's input, how it widens the engines' profiles and the same
request's arguments for diffusers. How it starts the denoising loop (initial latents, schedule, conditioning)
is the runtime's (runtime/prepare.py, one function per workflow); nothing else in fluxtrt knows a workflow by
name."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..components import Geometry, ShapePoint, ShapeRange
from ..errors import WorkflowError
from .image_inputs import image_processor, load_image


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


class Workflow:
    """One FLUX.1 workflow; subclasses set the attributes and override what differs from text-to-image."""

    name = ""
    diffusers_pipeline = ""  # the diffusers pipeline class it reproduces
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

    def diffusers_kwargs(self, inputs: ImageInputs) -> dict:
        """The same request's arguments for the diffusers pipeline (tests and `fluxtrt bench` compare with it)."""
        return {}


def with_reference(rng: ShapeRange, smallest: tuple, opt: tuple, largest: tuple) -> ShapeRange:
    return ShapeRange(replace(rng.min, reference=smallest), replace(rng.opt, reference=opt),
                      replace(rng.max, reference=largest))


# --- the workflows -------------------------------------------------------------------------------------


class TextToImage(Workflow):
    """Text-to-image: diffusers' FluxPipeline (FLUX.1-dev / -schnell)."""

    name = "txt2img"
    diffusers_pipeline = "FluxPipeline"
    model_class = "FluxPipeline"
    model_name = "FLUX.1-dev or FLUX.1-schnell"


class ImageToImage(Workflow):
    """Image-to-image: diffusers' FluxImg2ImgPipeline on the base FLUX.1-dev / -schnell models. The image is
    resized to the requested size, VAE-encoded (a sample drawn with the request's generator), the schedule is
    truncated by `strength`, and the starting latents are `sigma * noise + (1 - sigma) * image latents`."""

    name = "img2img"
    diffusers_pipeline = "FluxImg2ImgPipeline"
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


class Fill(Workflow):
    """Inpainting and outpainting: diffusers' FluxFillPipeline on FLUX.1-Fill-dev. The transformer sees, beside
    the packed latents, the packed latents of the masked image (image * (1 - mask)) and the packed mask (each
    8x8 pixel block of the binarised mask as 64 channels, then 2x2 packing): in_channels 64 + 64 + 256 = 384."""

    name = "fill"
    diffusers_pipeline = "FluxFillPipeline"
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


class Control(Workflow):
    """Structural control: diffusers' FluxControlPipeline on FLUX.1-Canny-dev / FLUX.1-Depth-dev. The control
    image (the user's edge or depth map) is resized, repeated for the batch, VAE-encoded (a sample drawn with the
    request's generator) and packed; the transformer sees it beside the latents: in_channels 64 + 64 = 128."""

    name = "control"
    diffusers_pipeline = "FluxControlPipeline"
    model_class = "FluxControlPipeline"
    model_name = "FLUX.1-Canny-dev or FLUX.1-Depth-dev"
    needs_encoder = True
    flags = ("--control-image",)
    required = ("--control-image",)

    def extra_channels(self, latent_channels: int, vae_scale_factor: int) -> int:
        return latent_channels * 4

    def diffusers_kwargs(self, inputs: ImageInputs) -> dict:
        return {"control_image": load_image(inputs.control_image, "--control-image")}


MAX_AREA = 1024**2  # FluxKontextPipeline's default


def preferred_resolutions() -> list[tuple[int, int]]:
    """(width, height) pairs Kontext was trained on (diffusers' list, not a copy)."""
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    return list(PREFERRED_KONTEXT_RESOLUTIONS)


class Kontext(Workflow):
    """Image editing: diffusers' FluxKontextPipeline on FLUX.1-Kontext-dev. The reference image is resized to
    the preferred Kontext resolution nearest its aspect ratio, VAE-encoded (the distribution's mean) and packed;
    its tokens follow the latents' in the transformer's sequence with their own ids (first coordinate 1), and
    only the first part of the output (the target's tokens) is used. The output keeps the requested aspect ratio
    at `max_area` pixels (default 1024²). Engine profiles cover target + reference tokens."""

    name = "kontext"
    diffusers_pipeline = "FluxKontextPipeline"
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


WORKFLOWS: dict[str, Workflow] = {w.name: w for w in (TextToImage(), ImageToImage(), Fill(), Control(), Kontext())}
MODEL_CLASSES = tuple(dict.fromkeys(w.model_class for w in WORKFLOWS.values()))


def for_model(geo: Geometry) -> list[Workflow]:
    """The workflows a model serves (from its model_index.json class)."""
    found = [w for w in WORKFLOWS.values() if w.model_class == geo.model_class]
    if not found:
        raise WorkflowError(f"the model's model_index.json names {geo.model_class}; fluxtrt runs "
                            f"{', '.join(MODEL_CLASSES)} models")
    return found


def check_model(geo: Geometry) -> None:
    """The model's class and its transformer's in_channels agree (e.g. Fill-dev: 64 + 64 + 256 = 384)."""
    wf = for_model(geo)[0]
    want = geo.packed_channels + wf.extra_channels(geo.latent_channels, geo.vae_scale_factor)
    if geo.in_channels != want or geo.out_channels != geo.packed_channels:
        raise WorkflowError(f"a {geo.model_class} model's transformer takes {want} channels and predicts "
                            f"{geo.packed_channels}; this one has in_channels {geo.in_channels}, out_channels "
                            f"{geo.out_channels}: check the model folder")


def select(geo: Geometry, inputs: ImageInputs) -> Workflow:
    """The workflow for a request: the model's one that takes exactly the given flags. Otherwise one line
    naming the flag and the model that would serve it."""
    given = set(inputs.given())
    served = for_model(geo)
    for wf in sorted(served, key=lambda w: -len(w.required)):
        if set(wf.required) <= given and given <= set(wf.flags):
            wf.check(inputs)
            return wf
    names = ", ".join(w.name for w in served)
    model = served[0].model_name
    for flag in sorted(given):
        if not any(flag in w.flags for w in served):
            other = next((w for w in WORKFLOWS.values() if flag in w.flags), None)
            need = f"; it needs a {other.model_name} model ({other.name})" if other else ""
            raise WorkflowError(f"{flag} cannot be used with these engines: they are {model} ({names}){need}")
    wf = next(w for w in served if given <= set(w.flags))
    missing = [f for f in wf.required if f not in given]
    raise WorkflowError(f"{model} ({wf.name}) needs {' and '.join(missing)}: pass "
                        f"{' '.join(f'{f} FILE.png' for f in missing)}")


def profile_range(geo: Geometry, name: str, rng):
    """One component's profile: the config's request sizes as the model's workflows widen them (the workflows
    of one model share its engines; text-to-image and img2img widen nothing)."""
    return for_model(geo)[-1].component_range(name, rng)
