"""Drop-in for diffusers: modules that stand in for a FluxPipeline's components and run fluxtrt's executors
(TensorRT engines, the ONNX they were built from in ONNX Runtime, or the PyTorch modules), so a user's own
diffusers code runs unchanged on them.

    from fluxtrt.dropin import load_pipeline
    pipe = load_pipeline("engines/4090")            # the manifest's class: FluxPipeline, FluxFillPipeline, ...
    image = pipe("a cat", num_inference_steps=28).images[0]

or swap one module of a pipeline you already have: `pipe.transformer = EngineTransformer.load("engines/4090")`.

Each module answers what diffusers' pipelines read (`config`, `dtype`, `device`, `.to()` to where it already runs,
`cache_context`) and computes exactly its component: the transformer's call with `return_dict` (diffusers'
output classes), the CLIP pooled output, the T5 hidden states, the VAE's `decode` and `encode` (a
DiagonalGaussianDistribution of the encoder's parameters). Shapes outside the engines' profile are refused in one
line naming the profile. What an engine cannot do (LoRA loading, attention processors, offload, VAE tiling) fails
in one line naming the fluxtrt way; nothing is silently ignored."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from .errors import (
    DropInError,  # noqa: F401 - defined in errors.py, raised here
    )

log = logging.getLogger("fluxtrt")

LORA = "LoRA: load_pipeline(DIR, lora=['FILE:SCALE', ...]) merges or adds them at load (`fluxtrt run --lora`)"
FIXED = "the engine's graph is fixed at build time ({what}); use the diffusers module for it, or rebuild"
OFFLOAD = "offloading engines: load_pipeline(DIR, low_vram=True) frees each component after its stage (`--low-vram`)"


def _refuse(message: str):
    def method(self, *args, **kwargs):
        raise DropInError(message)

    return method


class EngineModule(torch.nn.Module):
    """One component of a Pipeline behind the torch.nn.Module face diffusers expects. It holds no parameters:
    the executor holds the weights, on its own device and in its own dtypes."""

    def __init__(self, engines, name: str, config_folder: str, dtype_input: str):
        from diffusers.configuration_utils import FrozenDict

        from .fileio import read_json

        super().__init__()
        self.engines, self.component = engines, name
        cfg = read_json(Path(engines.assets) / config_folder / "config.json", f"the {config_folder} config",
                        "rebuild with `fluxtrt build`")
        self.config = FrozenDict(cfg if isinstance(cfg, dict) else {})
        self._dtype_input = dtype_input

    @property
    def executor(self):
        return self.engines.executors[self.component]

    @property
    def device(self) -> torch.device:
        return self.executor.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the component computes in: its engine's (or ONNX's) input of that name, or the module's."""
        return self.executor.io_dtype(self._dtype_input)

    def to(self, *args, **kwargs):
        """Where it already runs: a no-op (what `pipe.to(...)` calls); elsewhere one line."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        here = self.device
        if device is not None and (device.type != here.type or (device.index is not None and here.index is not None
                                                                 and device.index != here.index)):
            raise DropInError(f"{self.component} runs on {here} ({self.executor.kind}); it cannot move to {device}: "
                              "choose the device with load_pipeline(DIR, backend=..., ort_provider=...)")
        if dtype is not None and dtype != self.dtype:
            raise DropInError(f"{self.component} computes in {self.dtype} as built; it cannot become {dtype}: build "
                              "it with another precision (`fluxtrt build -p {self.component}=...`)")
        return self

    def _run(self, feeds: dict, component: str | None = None) -> dict:
        """One call of the component's executor (`component`: another of the engines, e.g. the VAE encoder)."""
        from .components import specs_for

        name = component or self.component
        if name not in self.engines.executors:
            raise DropInError(f"these engines lack the {name}; build it (`fluxtrt build --components {name}`)")
        spec, ex = specs_for(self.engines.geo, [name])[name], self.engines.executors[name]
        feeds = {t.name: feeds[t.name] for t in spec.inputs if t.name in feeds}
        ex.check_shapes({k: tuple(v.shape) for k, v in feeds.items()})
        if self.engines.low_vram:  # one component on the device at a time, whatever order the pipeline calls
            self.engines.release(*[n for n, e in self.engines.executors.items() if n != name and e.active])
        stream = self.engines.stream
        if stream is None:
            return ex.infer(feeds)
        caller = torch.cuda.current_stream()  # the pipeline's tensors come from the caller's stream: order both ways
        stream.wait_stream(caller)
        with self.engines.on_stream():
            out = ex.infer(feeds)
        caller.wait_stream(stream)
        return out

    def _out(self, t: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
        return t.to(like.device if like is not None else self.device, like.dtype if like is not None else self.dtype)

    def extra_repr(self) -> str:
        return f"{self.component} on {self.executor.kind}, {self.device}, {self.dtype}"

    def train(self, mode: bool = True):
        """eval() is what diffusers calls: allowed; training is refused."""
        if mode:
            raise DropInError("engines run inference only; train with the diffusers modules")
        return self

    # what diffusers' modules offer and an engine cannot
    load_state_dict = _refuse("weights come from the engines or load_pipeline(DIR, weights=FOLDER) (`--weights`)")
    enable_gradient_checkpointing = _refuse("engines run inference only; train with the diffusers modules")


class EngineTransformer(EngineModule):
    """Stands in for FluxTransformer2DModel: `forward(hidden_states, encoder_hidden_states, pooled_projections,
    timestep, img_ids, txt_ids, guidance, joint_attention_kwargs, ..., return_dict)`."""

    def __init__(self, engines):
        super().__init__(engines, "transformer", "transformer", "hidden_states")

    @classmethod
    def load(cls, engines=None, **options) -> "EngineTransformer":
        """The transformer of the engines in `engines` (see `open_engines` for the options)."""
        return cls(open_engines(engines, **options))

    @contextlib.contextmanager
    def cache_context(self, name: str):
        yield  # diffusers' pipelines name the branch for step caches; the engine keeps none

    def forward(self, hidden_states, encoder_hidden_states=None, pooled_projections=None, timestep=None,
                img_ids=None, txt_ids=None, guidance=None, joint_attention_kwargs=None, controlnet_block_samples=None,
                controlnet_single_block_samples=None, return_dict: bool = True, controlnet_blocks_repeat=False):
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        if joint_attention_kwargs:
            raise DropInError(LORA if "scale" in joint_attention_kwargs else
                              FIXED.format(what=f"joint_attention_kwargs {sorted(joint_attention_kwargs)}"))
        if controlnet_block_samples is not None or controlnet_single_block_samples is not None:
            raise DropInError(FIXED.format(what="ControlNet residuals; FLUX.1 Control models run as their own "
                                                "engines: build a -Canny/-Depth model"))
        if self.engines.geo.guidance and guidance is None:
            raise DropInError("these engines are guidance-distilled (FLUX.1-dev): pass guidance, as FluxPipeline does")
        ids = [i[0] if i is not None and i.ndim == 3 else i for i in (img_ids, txt_ids)]  # diffusers' old 3-D ids
        feeds = {"hidden_states": hidden_states, "encoder_hidden_states": encoder_hidden_states,
                 "pooled_projections": pooled_projections, "timestep": timestep, "img_ids": ids[0], "txt_ids": ids[1]}
        if guidance is not None and self.engines.geo.guidance:
            feeds["guidance"] = guidance
        from .components import specs_for

        spec = specs_for(self.engines.geo, ["transformer"])["transformer"]
        missing = [t.name for t in spec.inputs if feeds.get(t.name) is None]
        if missing:
            raise DropInError(f"the transformer needs {', '.join(missing)} (FluxTransformer2DModel's arguments)")
        out = self._out(self._run(feeds)["noise_pred"], hidden_states)
        return Transformer2DModelOutput(sample=out) if return_dict else (out,)

    @property
    def encoder_hid_proj(self):
        raise DropInError(FIXED.format(what="no IP-Adapter"))

    load_lora_adapter = set_adapters = fuse_lora = unfuse_lora = _refuse(LORA)
    set_attn_processor = _refuse(FIXED.format(what="its attention"))
    set_attention_backend = _refuse(FIXED.format(what="its attention kernels"))
    fuse_qkv_projections = _refuse(FIXED.format(what="the build already joins q/k/v"))
    enable_cache = _refuse(FIXED.format(what="no step cache in this engine"))
    enable_forward_chunking = _refuse(FIXED.format(what="no chunking"))


class EngineCLIP(EngineModule):
    """Stands in for CLIPTextModel where FluxPipeline calls it: the pooled output."""

    def __init__(self, engines):
        super().__init__(engines, "clip", "text_encoder", "input_ids")

    @property
    def dtype(self) -> torch.dtype:
        return self.executor.io_dtype("pooled_embeds")

    def forward(self, input_ids, attention_mask=None, output_hidden_states: bool = False, return_dict: bool = True,
                **kwargs):
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        if output_hidden_states or attention_mask is not None:
            raise DropInError(FIXED.format(what="the CLIP engine returns the pooled output only"))
        pooled = self._out(self._run({"input_ids": input_ids})["pooled_embeds"])
        return BaseModelOutputWithPooling(pooler_output=pooled) if return_dict else (None, pooled)


class EngineT5(EngineCLIP):
    """Stands in for T5EncoderModel where FluxPipeline calls it: the last hidden states."""

    def __init__(self, engines):
        EngineModule.__init__(self, engines, "t5", "text_encoder_2", "input_ids")

    @property
    def dtype(self) -> torch.dtype:
        return self.executor.io_dtype("text_embeds")

    def forward(self, input_ids, attention_mask=None, output_hidden_states: bool = False, return_dict: bool = True,
                **kwargs):
        from transformers.modeling_outputs import BaseModelOutput

        if output_hidden_states or attention_mask is not None:
            raise DropInError(FIXED.format(what="the T5 engine returns the last hidden states only"))
        text = self._out(self._run({"input_ids": input_ids})["text_embeds"])
        return BaseModelOutput(last_hidden_state=text) if return_dict else (text,)


class EngineVAE(EngineModule):
    """Stands in for AutoencoderKL: `decode(z)` on the vae_decoder, `encode(x)` on the vae_encoder."""

    def __init__(self, engines):
        super().__init__(engines, "vae_decoder", "vae", "latent")

    def decode(self, z, return_dict: bool = True, generator=None):
        from diffusers.models.autoencoders.vae import DecoderOutput

        image = self._out(self._run({"latent": z})["image"], z)
        return DecoderOutput(sample=image) if return_dict else (image,)

    def encode(self, x, return_dict: bool = True):
        from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKLOutput
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        params = self._run({"image": x}, "vae_encoder")["latent_parameters"]
        dist = DiagonalGaussianDistribution(self._out(params, x))
        return AutoencoderKLOutput(latent_dist=dist) if return_dict else (dist,)

    def forward(self, sample, **kwargs):
        raise DropInError("call vae.encode(...) and vae.decode(...), as diffusers' pipelines do")

    enable_tiling = enable_slicing = _refuse(FIXED.format(what="the VAE engine decodes the whole image; the "
                                                               "profile's size range is what fits"))
    set_attn_processor = _refuse(FIXED.format(what="its attention"))


def open_engines(engines=None, **options):
    """A Pipeline over the engines folder `engines` (or, with backend="torch", model=M and no engines, the
    model's PyTorch modules) with `fluxtrt run`'s options (runtime.options.PipelineOptions' fields: backend,
    ort_provider, low_vram, cuda_graph, compile, weights, lora, fallback, calibration, model,
    torch_dtype, ...); the notes `fluxtrt run` prints are logged."""
    from .runtime.assembly import open_pipeline
    from .runtime.options import FIELDS

    unknown = sorted(set(options) - set(FIELDS))
    if unknown:  # the request's own settings (steps, size, seed, images) are the diffusers pipeline's arguments
        raise DropInError(f"unknown option {', '.join(unknown)}; the engines take {', '.join(FIELDS)}")
    pipe = open_pipeline(Path(engines) if engines is not None else None, **options)
    for note in pipe.notes:
        log.warning(note)
    return pipe


def load_pipeline(engines=None, diffusers_pipeline: str | None = None, **options):
    """A ready diffusers pipeline on the engines in `engines`: the class their manifest records (FluxPipeline,
    FluxFillPipeline, FluxControlPipeline, FluxKontextPipeline), or `diffusers_pipeline` (e.g. "FluxImg2ImgPipeline" on
    FLUX.1-dev engines that include the vae_encoder), with the engines' tokenizers and scheduler config and
    engine-backed modules. `options`: `fluxtrt run`'s (see `open_engines`)."""
    import diffusers

    pipe = open_engines(engines, **options)
    name = diffusers_pipeline or pipe.geo.model_class
    cls = getattr(diffusers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline) and name.startswith("Flux")):
        raise DropInError(f"{name} is not a diffusers FLUX pipeline; pass one of FluxPipeline, FluxImg2ImgPipeline, "
                          "FluxFillPipeline, FluxControlPipeline, FluxKontextPipeline")
    clip_tok, t5_tok = pipe.prompts.tokenizers()
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler_config)
    engine_cls = type(f"Engine{name}", (cls,), REFUSED_ON_PIPELINES)
    return engine_cls(scheduler=scheduler, tokenizer=clip_tok, tokenizer_2=t5_tok, text_encoder=EngineCLIP(pipe),
                      text_encoder_2=EngineT5(pipe), transformer=EngineTransformer(pipe), vae=EngineVAE(pipe))


REFUSED_ON_PIPELINES = {
    "load_lora_weights": _refuse(LORA), "fuse_lora": _refuse(LORA), "set_adapters": _refuse(LORA),
    "enable_model_cpu_offload": _refuse(OFFLOAD), "enable_sequential_cpu_offload": _refuse(OFFLOAD),
    "enable_vae_tiling": _refuse(FIXED.format(what="the VAE decodes whole images")),
    "enable_vae_slicing": _refuse(FIXED.format(what="the VAE decodes whole batches")),
}
