"""One spec per FLUX.1 component: the single source of names, dtypes, symbolic axes, sample inputs,
validation tolerances and shape ranges. Export (dynamic axes, dummy inputs), build (TensorRT profiles)
and run (buffer shapes) all derive their shapes from here; nothing else restates them.

Symbols used in `dims` (all derived from a `ShapePoint` and the model's `Geometry`):
  batch          images per call
  image_tokens   (H / 16) * (W / 16): packed 2x2 latent patches, the transformer's image sequence, plus the
                 reference image's tokens where a workflow appends them (Kontext: `ShapePoint.reference`)
  latent_height  H / 8, latent_width W / 8 (the VAE's latent grid; 8 = vae_scale_factor for FLUX)
  image_height   H, image_width W (pixels)
Text lengths are fixed per model (CLIP 77; T5 512 for dev, 256 for schnell) and appear as numbers.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from . import wrappers

SYMBOLS = ("batch", "image_tokens", "latent_height", "latent_width", "image_height", "image_width")
T5_LENGTH = {"dev": 512, "schnell": 256}
CLIP_LENGTH = 77


@dataclass(frozen=True)
class Geometry:
    """The sizes of one FLUX.1 model that shapes depend on, read from its config files."""

    variant: str  # "dev" (guidance-distilled) or "schnell"
    clip_length: int
    clip_hidden: int
    clip_vocab: int
    t5_length: int
    t5_hidden: int
    t5_vocab: int
    in_channels: int  # transformer input channels: latent_channels * 4 (2x2 packing), + conditioning (Fill, Control)
    latent_channels: int
    vae_scale_factor: int
    out_channels: int = 0  # transformer output channels (0: as in_channels)
    model_class: str = "FluxPipeline"  # model_index.json's class: which workflows the model serves (core/workflows.py)
    transformer_dim: int = 0  # the transformer's hidden width (heads x head dim): its blocks' activations

    @property
    def guidance(self) -> bool:
        return self.variant == "dev"

    @property
    def latent_channels_x2(self) -> int:
        """The VAE encoder's output channels: mean and logvar."""
        return 2 * self.latent_channels

    @property
    def pixel_multiple(self) -> int:
        """Height and width must be multiples of this (VAE downsampling x 2x2 packing): 16 for FLUX."""
        return self.vae_scale_factor * 2

    @classmethod
    def from_folder(cls, folder: Path) -> "Geometry":
        """A model's sizes from its configs (untrusted: a model or engine folder comes from elsewhere); one line
        naming the folder when a config is unreadable or its sizes are not positive integers."""
        from .errors import FluxtrtError

        try:
            geo = cls._from_folder(folder)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            what = f"lacks {e}" if isinstance(e, KeyError) else f"is unreadable ({type(e).__name__})"
            raise FluxtrtError(f"a config in {folder} {what}; it is not a diffusers FLUX.1 folder (rebuild or "
                               "re-download it)") from None
        sizes = [v for v in dataclasses.astuple(geo) if not isinstance(v, str)]
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v < 1 << 20 for v in sizes) \
                or not isinstance(geo.model_class, str):
            raise FluxtrtError(f"the configs in {folder} give sizes {sizes} that no FLUX.1 model has; rebuild or "
                               "re-download the folder")
        return geo

    @classmethod
    def _from_folder(cls, folder: Path) -> "Geometry":
        def cfg(sub: str, name: str = "config.json") -> dict:
            return json.loads((Path(folder) / sub / name).read_text())

        tr, clip, t5, vae = cfg("transformer"), cfg("text_encoder"), cfg("text_encoder_2"), cfg("vae")
        variant = "dev" if tr.get("guidance_embeds", False) else "schnell"
        index = Path(folder) / "model_index.json"
        model_class = json.loads(index.read_text()).get("_class_name", "FluxPipeline") if index.exists() else "FluxPipeline"
        return cls(
            variant=variant,
            clip_length=CLIP_LENGTH,
            clip_hidden=clip["hidden_size"],
            clip_vocab=clip["vocab_size"],
            t5_length=T5_LENGTH[variant],
            t5_hidden=t5["d_model"],
            t5_vocab=t5["vocab_size"],
            in_channels=tr["in_channels"],
            latent_channels=vae["latent_channels"],
            vae_scale_factor=2 ** (len(vae["block_out_channels"]) - 1),
            out_channels=tr.get("out_channels") or tr["in_channels"],
            model_class=model_class,
            # absent keys take FluxTransformer2DModel's defaults, as diffusers loads such a config
            transformer_dim=tr.get("num_attention_heads", 24) * tr.get("attention_head_dim", 128),
        )

    @property
    def packed_channels(self) -> int:
        """Channels of the packed latents (what the transformer predicts): latent_channels * 4."""
        return self.latent_channels * 4


@dataclass(frozen=True)
class ShapePoint:
    """One concrete request size: batch and image size in pixels, and the size of a reference image whose
    tokens the transformer sees beside the image's (Kontext; (0, 0): none)."""

    batch: int
    height: int
    width: int
    reference: tuple[int, int] = (0, 0)

    def symbols(self, geo: Geometry) -> dict[str, int]:
        vsf, m = geo.vae_scale_factor, geo.pixel_multiple
        ref_tokens = (self.reference[0] // m) * (self.reference[1] // m)
        return {
            "batch": self.batch,
            "image_tokens": (self.height // m) * (self.width // m) + ref_tokens,
            "latent_height": self.height // vsf,
            "latent_width": self.width // vsf,
            "image_height": self.height,
            "image_width": self.width,
        }


@dataclass(frozen=True)
class ShapeRange:
    """min/opt/max request sizes: what an optimization profile covers."""

    min: ShapePoint
    opt: ShapePoint
    max: ShapePoint


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy name: "float32" (cast by --dtype) or "int64"
    dims: tuple  # ints and symbol names (see SYMBOLS) or geometry attribute names prefixed with "geo."

    def shape(self, point: ShapePoint, geo: Geometry) -> tuple[int, ...]:
        return self.shape_from(point.symbols(geo), geo)

    def shape_from(self, sym: dict[str, int], geo: Geometry) -> tuple[int, ...]:
        out = []
        for d in self.dims:
            if isinstance(d, int):
                out.append(d)
            elif d.startswith("geo."):
                out.append(int(getattr(geo, d[4:])))
            else:
                out.append(sym[d])
        return tuple(out)

    @property
    def is_float(self) -> bool:
        return self.dtype.startswith("float")

    def symbolic_axes(self) -> dict[int, str]:
        return {i: d for i, d in enumerate(self.dims) if isinstance(d, str) and not d.startswith("geo.")}

    @property
    def token_axis(self) -> int | None:
        """The axis of the transformer's tokens (image or text), which context parallelism splits; None if none."""
        return next((i for i, d in enumerate(self.dims) if d in ("image_tokens", "geo.t5_length")), None)


@dataclass(frozen=True)
class ComponentSpec:
    name: str
    subfolder: str  # folder in the diffusers model layout that holds the weights
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    rtol_fp32: float  # ONNX Runtime vs PyTorch bound, max|a-b| / max|b|, fp32
    wrap: Callable  # (diffusers/transformers module) -> torch.nn.Module taking inputs in order
    needs_guidance: bool = False
    # (module list, config key of its depth) of identical blocks that zero-copy export traces three of and
    # replicates (replicate.py)
    repeated_blocks: tuple[tuple[str, str], ...] = ()

    def input_shapes(self, point: ShapePoint, geo: Geometry) -> dict[str, tuple[int, ...]]:
        return {t.name: t.shape(point, geo) for t in self.inputs}

    def output_shapes(self, point: ShapePoint, geo: Geometry) -> dict[str, tuple[int, ...]]:
        return {t.name: t.shape(point, geo) for t in self.outputs}

    def output_shapes_for(self, input_shapes: dict[str, tuple], geo: Geometry) -> dict[str, tuple[int, ...]]:
        """The outputs' shapes for these concrete input shapes (an executor preallocating its outputs): the
        symbols read off the inputs, pixel and latent sizes related by the VAE's scale factor."""
        sym: dict[str, int] = {}
        for t in self.inputs:
            for d, n in zip(t.dims, input_shapes.get(t.name, ())):
                if isinstance(d, str) and not d.startswith("geo."):
                    sym[d] = int(n)
        for px, lat in (("image_height", "latent_height"), ("image_width", "latent_width")):
            if lat in sym:
                sym.setdefault(px, sym[lat] * geo.vae_scale_factor)
            if px in sym:
                sym.setdefault(lat, sym[px] // geo.vae_scale_factor)
        return {t.name: t.shape_from(sym, geo) for t in self.outputs}

    def profile(self, rng: ShapeRange, geo: Geometry) -> dict[str, tuple[tuple[int, ...], ...]]:
        """TensorRT optimization profile: input name -> (min, opt, max) shapes."""
        return {
            t.name: (t.shape(rng.min, geo), t.shape(rng.opt, geo), t.shape(rng.max, geo))
            for t in self.inputs
        }

    def sample_inputs(self, point: ShapePoint, geo: Geometry, seed: int) -> dict:
        """Fresh random inputs of the right shapes and value ranges (torch tensors, fp32/int64)."""
        import torch

        from .flux_math import latent_image_ids, text_ids

        g = torch.Generator().manual_seed(seed)
        shapes = self.input_shapes(point, geo)
        vocab = {"clip": geo.clip_vocab, "t5": geo.t5_vocab}
        out = {}
        for t in self.inputs:
            shape = shapes[t.name]
            if t.name == "input_ids":
                out[t.name] = torch.randint(0, vocab[self.name], shape, generator=g)
            elif t.name == "img_ids":
                m = geo.pixel_multiple
                out[t.name] = latent_image_ids(point.height // m, point.width // m)
                if point.reference != (0, 0):  # Kontext: the reference's ids follow, first coordinate 1
                    ref = latent_image_ids(point.reference[0] // m, point.reference[1] // m)
                    ref[:, 0] = 1
                    out[t.name] = torch.cat([out[t.name], ref])
            elif t.name == "txt_ids":
                out[t.name] = text_ids(shape[0])
            elif t.name == "timestep":
                out[t.name] = torch.rand(shape, generator=g) * 0.98 + 0.01  # sigma in (0, 1)
            elif t.name == "guidance":
                out[t.name] = torch.rand(shape, generator=g) * 4.0 + 1.0
            elif t.name == "image":
                out[t.name] = torch.rand(shape, generator=g) * 2.0 - 1.0
            else:
                out[t.name] = torch.randn(shape, generator=g)
        return out


_F = "float32"
_LAT = ("batch", "geo.latent_channels", "latent_height", "latent_width")

CLIP = ComponentSpec(
    name="clip", subfolder="text_encoder", rtol_fp32=1e-4, wrap=wrappers.clip,
    inputs=(TensorSpec("input_ids", "int64", ("batch", "geo.clip_length")),),
    outputs=(TensorSpec("pooled_embeds", _F, ("batch", "geo.clip_hidden")),),
)
T5 = ComponentSpec(
    name="t5", subfolder="text_encoder_2", rtol_fp32=1e-4, wrap=wrappers.t5,
    repeated_blocks=(("encoder.block", "num_layers"),),
    inputs=(TensorSpec("input_ids", "int64", ("batch", "geo.t5_length")),),
    outputs=(TensorSpec("text_embeds", _F, ("batch", "geo.t5_length", "geo.t5_hidden")),),
)
TRANSFORMER = ComponentSpec(
    name="transformer", subfolder="transformer", rtol_fp32=1e-4, wrap=wrappers.transformer, needs_guidance=True,
    repeated_blocks=(("transformer_blocks", "num_layers"), ("single_transformer_blocks", "num_single_layers")),
    inputs=(
        TensorSpec("hidden_states", _F, ("batch", "image_tokens", "geo.in_channels")),
        TensorSpec("encoder_hidden_states", _F, ("batch", "geo.t5_length", "geo.t5_hidden")),
        TensorSpec("pooled_projections", _F, ("batch", "geo.clip_hidden")),
        TensorSpec("timestep", _F, ("batch",)),
        TensorSpec("img_ids", _F, ("image_tokens", 3)),
        TensorSpec("txt_ids", _F, ("geo.t5_length", 3)),
        TensorSpec("guidance", _F, ("batch",)),
    ),
    outputs=(TensorSpec("noise_pred", _F, ("batch", "image_tokens", "geo.out_channels")),),
)
VAE_DECODER = ComponentSpec(
    name="vae_decoder", subfolder="vae", rtol_fp32=1e-4, wrap=wrappers.vae_decoder,
    inputs=(TensorSpec("latent", _F, _LAT),),
    outputs=(TensorSpec("image", _F, ("batch", 3, "image_height", "image_width")),),
)
VAE_ENCODER = ComponentSpec(
    name="vae_encoder", subfolder="vae", rtol_fp32=1e-4, wrap=wrappers.vae_encoder,
    inputs=(TensorSpec("image", _F, ("batch", 3, "image_height", "image_width")),),
    outputs=(TensorSpec("latent_parameters", _F, ("batch", "geo.latent_channels_x2", "latent_height",
                                                  "latent_width")),),
)

_HIDDEN = ("batch", "image_tokens", "geo.transformer_dim")
_TEXT = ("batch", "geo.t5_length", "geo.transformer_dim")
_TEMB = ("batch", "geo.transformer_dim")
TRANSFORMER_HEAD = ComponentSpec(
    name="transformer_head", subfolder="transformer", rtol_fp32=1e-4, wrap=wrappers.transformer_head,
    needs_guidance=True, inputs=TRANSFORMER.inputs,
    outputs=(TensorSpec("head_hidden", _F, _HIDDEN), TensorSpec("head_encoder", _F, _TEXT),
             TensorSpec("temb", _F, _TEMB), TensorSpec("head_residual", _F, _HIDDEN)),
)
TRANSFORMER_TAIL = ComponentSpec(
    name="transformer_tail", subfolder="transformer", rtol_fp32=1e-4, wrap=wrappers.transformer_tail,
    inputs=(TensorSpec("head_hidden", _F, _HIDDEN), TensorSpec("head_encoder", _F, _TEXT),
            TensorSpec("temb", _F, _TEMB), TensorSpec("img_ids", _F, ("image_tokens", 3)),
            TensorSpec("txt_ids", _F, ("geo.t5_length", 3))),
    outputs=(TensorSpec("tail_hidden", _F, _HIDDEN),),
)
TRANSFORMER_OUT = ComponentSpec(
    name="transformer_out", subfolder="transformer", rtol_fp32=1e-4, wrap=wrappers.transformer_out,
    inputs=(TensorSpec("hidden", _F, _HIDDEN), TensorSpec("temb", _F, _TEMB)),
    outputs=(TensorSpec("noise_pred", _F, ("batch", "image_tokens", "geo.out_channels")),),
)
# The transformer as First-Block Cache's three parts (stepcache.py); the runtime runs them where caching is on.
TRANSFORMER_PARTS: Mapping[str, ComponentSpec] = {
    s.name: s for s in (TRANSFORMER_HEAD, TRANSFORMER_TAIL, TRANSFORMER_OUT)}
# the tensors between the parts: outputs of a part's graph that are not the model's (recipes treat them as inner)
PART_BOUNDARY = frozenset(t.name for s in (TRANSFORMER_HEAD, TRANSFORMER_TAIL) for t in s.outputs)

ALL: Mapping[str, ComponentSpec] = {s.name: s for s in (CLIP, T5, TRANSFORMER, VAE_DECODER, VAE_ENCODER)}
# What `fluxtrt run` needs for text-to-image; the VAE encoder is exported for image-to-image.
DEFAULT_COMPONENTS = ("clip", "t5", "transformer", "vae_decoder", "vae_encoder")


def for_variant(spec: ComponentSpec, geo: Geometry) -> ComponentSpec:
    """schnell has no guidance input: drop it from the transformer's spec."""
    if spec.needs_guidance and not geo.guidance:
        from dataclasses import replace

        return replace(spec, inputs=tuple(t for t in spec.inputs if t.name != "guidance"))
    return spec


def specs_for(geo: Geometry, names=None) -> dict[str, ComponentSpec]:
    """The specs of `names` (default: the five components; the transformer's parts are asked for by name)."""
    names = list(names or DEFAULT_COMPONENTS)
    known = {**ALL, **TRANSFORMER_PARTS}
    unknown = [n for n in names if n not in known]
    if unknown:
        from .errors import FluxtrtError

        raise FluxtrtError(f"unknown component(s) {', '.join(unknown)}; choose from {', '.join(ALL)}")
    return {n: for_variant(known[n], geo) for n in names}


def family(name: str) -> str:
    """The component whose precision, recipe, tolerances, profile and LoRA a part shares: "transformer" for the
    transformer's First-Block Cache parts, the name itself otherwise."""
    return "transformer" if name in TRANSFORMER_PARTS else name


def transformer_parts(geo: Geometry) -> dict[str, ComponentSpec]:
    """The transformer's First-Block Cache parts for this model (schnell's head has no guidance input)."""
    return {n: for_variant(s, geo) for n, s in TRANSFORMER_PARTS.items()}
