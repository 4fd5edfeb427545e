"""Every FLUX.1 workflow over built engines, with diffusers' pipeline semantics (flux_math.py, core/workflows.py).

The same code drives every executor and workflow: tokenize -> CLIP pooled + T5 hidden states (cached per
prompt) -> the workflow's preparation (CPU-generator noise; for image workflows the VAE encoder's latents) ->
FlowMatch Euler loop over the transformer (the workflow's conditioning appended to the latents every step) ->
unpack, unscale -> VAE decode -> uint8. Inside the denoising loop nothing reads back from the device:
timesteps, dt, guidance and conditioning are uploaded once."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from .. import flux_math as fm
from ..components import ShapePoint, specs_for
from ..core.workflows import ImageInputs, select
from ..errors import FluxtrtError, NonFiniteError, RequestError  # noqa: F401 - defined in errors.py, raised here
from .executors import (
    OnnxRuntimeExecutor,
)
from .prepare import Context, Prepared, prepare_workflow
from .prompts import PromptEncoder
from .steps import TransformerStep
from .tensorrt import TensorRTExecutor

log = logging.getLogger("fluxtrt")


def _check_finite(t, component: str) -> None:
    if not bool(t.isfinite().all()):
        raise NonFiniteError(f"{component} produced NaN/Inf (fp16 overflow?); build it in bf16 "
                             f"(`fluxtrt build --precision {component}=bf16`) or run it in fp32")


@dataclass
class Timings:
    text_encoders: float = 0.0
    image_encoder: float = 0.0  # the workflow's preparation (image preprocessing and VAE encoding)
    steps: list = field(default_factory=list)
    vae: float = 0.0
    total: float = 0.0
    peak_memory_gb: float | None = None
    cache: dict | None = None  # First-Block Cache: {"threshold", "computed", "skipped"} steps (None: off)


@dataclass
class Result:
    images: object  # uint8 [B, H, W, 3]
    timings: Timings
    latents_per_step: list = field(default_factory=list)  # packed latents after each step (when traced)
    workflow: str = "txt2img"
    height: int = 0  # the output size (Kontext rescales the requested one to its area)
    width: int = 0


def nearest_multiples(value: int, m: int, lo_limit: int = 1, hi_limit: int | None = None) -> str:
    """The multiples of m around `value` that lie inside [lo_limit, hi_limit] (the engines' range)."""
    lo, hi = (value // m) * m, (value // m + 1) * m
    ok = [v for v in (lo, hi) if v >= max(lo_limit, 1) and (hi_limit is None or v <= hi_limit)]
    if not ok:  # both neighbours outside the range: the nearest multiple inside it
        edge = -(-lo_limit // m) * m if value < lo_limit else (hi_limit // m) * m
        ok = [edge]
    return " or ".join(map(str, ok))


def check_request(geo, manifest, executors: dict, *, batch: int, height: int, width: int, steps: int,
                  reference=(0, 0)) -> None:
    """A request's size and steps against the pixel multiple, the engines' profile (`manifest`, None for PyTorch
    modules) and each shaped executor; one line (RequestError) naming what to use instead."""
    m = geo.pixel_multiple
    for what, v in (("height", height), ("width", width)):
        if v <= 0 or v % m:
            i = 1 if what == "height" else 2
            rng = manifest.shape_range if manifest is not None else None
            limits = (rng["min"][i], rng["max"][i]) if rng else (1, None)
            raise RequestError(f"{what} {v} is not a positive multiple of {m}; use "
                               f"{nearest_multiples(max(v, 1), m, *limits)}")
    if steps <= 0:
        raise RequestError(f"steps must be at least 1, got {steps}")
    if manifest is None:
        return  # PyTorch modules take any size that is a multiple of the pixel multiple
    lo, _, hi = (manifest.shape_range[k] for k in ("min", "opt", "max"))
    if not lo[0] <= batch <= hi[0]:
        raise RequestError(f"batch {batch} is outside the engines' profile ({lo[0]}..{hi[0]}); "
                           f"use --batch {hi[0]} or less, or rebuild with a larger profile")
    for what, v, i in (("height", height, 1), ("width", width, 2)):
        if not lo[i] <= v <= hi[i]:
            raise RequestError(f"{what} {v} is outside the engines' range {lo[i]}..{hi[i]} px; "
                               f"pick a size inside it or rebuild with a wider profile")
    point = ShapePoint(batch, height, width, tuple(reference))
    for name in ("transformer", "vae_decoder"):
        if name not in executors:
            continue
        spec = specs_for(geo, [name])[name]
        executors[name].check_shapes(spec.input_shapes(point, geo))


class Pipeline:
    """The pipeline over one set of executors: engines of one GPU folder (TensorRT), the ONNX they were built
    from (ONNX Runtime), or the model's PyTorch modules (torch), mixed per component with `fallback`."""

    def __init__(self, assembly, options, notes=()):
        """The loop over `assembly`'s executors (runtime/assembly.py: open_pipeline makes both)."""
        import torch

        self.options, self.notes = options, list(notes)
        self.low_vram, self.cuda_graph = options.low_vram, options.cuda_graph
        self.backend_name = assembly.backend
        self.executors, self.manifest, self.stream = assembly.executors, assembly.manifest, None
        self.dir, self.assets, self.geo = assembly.dir, assembly.assets, assembly.geo
        self.scheduler_config = assembly.scheduler_config
        self.context = assembly.context  # runtime/parallel.Rank of a split transformer, None otherwise
        self.with_loras = assembly.with_loras  # the transformer's engines with LoRAs merged (a server's, per request)
        self.scaling_factor, self.shift_factor = assembly.scaling_factor, assembly.shift_factor
        self._memory_base = None
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info()
            self._memory_base = (total - free, torch.cuda.memory_allocated())  # before any executor loads
            self.stream = torch.cuda.Stream()  # the one stream everything runs on
            for ex in self.executors.values():
                if isinstance(ex, (TensorRTExecutor, OnnxRuntimeExecutor)):
                    ex.stream = self.stream
        self.prompts = PromptEncoder(self.assets, self.geo, self.executors)
        self.steps = TransformerStep(self.executors, self.geo, self.cuda_graph, self.stream)

    def close(self, abort: bool = False) -> None:
        """End what outlives a call: the followers of a split transformer (runtime/parallel.py), told to stop,
        or ended at once with `abort` (after Ctrl-C or a failure, when they may be inside a call)."""
        from . import parallel

        if self.context is not None and self.context.rank == 0:
            parallel.stop(abort)

    def release(self, *names) -> None:
        """--low-vram: free these stages' executors (a TensorRT executor may say its cache was not saved)."""
        for name in names:
            note = self.executors[name].deactivate()
            if note:
                log.warning(note)

    @property
    def device(self):
        return self.executors["transformer"].device

    sync_check = False  # tests set it: any host-device synchronisation inside the loop then raises

    def on_stream(self):
        import contextlib

        import torch

        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def plan(self, height: int, width: int, inputs: ImageInputs | None = None):
        """(workflow, output height, output width, reference size) for a request's image inputs; one line
        when these engines' model cannot serve them or the VAE encoder they need is missing."""
        inputs = inputs or ImageInputs()
        wf = select(self.geo, inputs)
        if wf.needs_encoder and "vae_encoder" not in self.executors:
            raise RequestError(f"{wf.name} needs the vae_encoder engine, which these engines lack; build it with "
                               "`fluxtrt build --components vae_encoder` (or run it in PyTorch: --fallback vae_encoder)")
        height, width = wf.output_size(height, width, inputs)
        return wf, height, width, wf.reference_size(inputs, self.geo)

    def check_request(self, batch: int, height: int, width: int, steps: int, reference=(0, 0)) -> None:
        """One line (RequestError) for a request these executors cannot compute (check_request below)."""
        check_request(self.geo, self.manifest, self.executors, batch=batch, height=height, width=width, steps=steps,
                      reference=reference)

    def generate(self, prompts: list[str], height: int, width: int, steps: int, guidance: float = 3.5,
                 *, seed: int = 0, trace: bool = False, on_step=None, negative_prompts: list[str] | None = None,
                 true_cfg: float = 1.0, inputs: ImageInputs | None = None, cache_threshold: float = 0.0) -> Result:
        """Images for `prompts`. `inputs`: the image workflows' images and settings (core/workflows.py); the model and
        these pick the workflow. True classifier-free guidance as diffusers' `true_cfg_scale`: with `true_cfg` > 1
        and `negative_prompts`, each step also runs the transformer on the negative prompts and uses
        neg + true_cfg * (pos - neg) (in the transformer's output dtype, as diffusers does). `cache_threshold` > 0:
        First-Block Cache with diffusers' semantics (stepcache.py)."""

        batch = len(prompts)
        if batch == 0 or any(not isinstance(p, str) for p in prompts):
            raise RequestError("give at least one prompt (text)")
        cfg = true_cfg > 1 and negative_prompts is not None
        if cfg and len(negative_prompts) != batch:
            raise RequestError(f"{len(negative_prompts)} negative prompts for {batch} prompts; give one per prompt")
        inputs = inputs or ImageInputs()
        wf, height, width, reference = self.plan(height, width, inputs)
        self.check_request(batch, height, width, steps, reference)
        cache = self.steps.step_cache(cache_threshold)
        dev = self.device
        timings = Timings()
        memory = MemoryWatch(self._memory_base) if dev.type == "cuda" else None
        t_start = time.perf_counter()

        with self.on_stream():
            pooled, text = self.prompts.encode(prompts)
            if cfg:
                neg_pooled, neg_text = self.prompts.encode(negative_prompts)
        timings.text_encoders = _elapsed(t_start, dev)  # synchronizes: the encoders are done with their weights
        if memory is not None:
            memory.sample()
        _check_finite(pooled, "clip")
        _check_finite(text, "t5")
        if self.low_vram:
            self.release("clip", "t5")

        t_prep = time.perf_counter()
        prep = self.prepare(wf, batch, height, width, steps, seed=seed, inputs=inputs)
        timings.image_encoder = time.perf_counter() - t_prep
        if self.low_vram and wf.needs_encoder:
            self.release("vae_encoder")
        negative = (neg_pooled, neg_text) if cfg else None
        latents, trace_latents = self._denoise(prep, pooled, text, guidance, negative, true_cfg=true_cfg, trace=trace,
                                               on_step=on_step,
                                               timings=timings, cache=cache)
        _check_finite(latents, "transformer")  # after the loop: the loop itself never reads the device
        if memory is not None:
            memory.sample()
        if self.low_vram:
            self.release("transformer")

        t_vae = time.perf_counter()
        images, finite = self.decode(latents, height, width)
        if memory is not None:
            memory.sample()
        if self.low_vram:  # finite/uint8 above waited for the decode
            self.release("vae_decoder")
        timings.vae = time.perf_counter() - t_vae
        timings.total = time.perf_counter() - t_start
        if memory is not None:
            timings.peak_memory_gb = memory.peak_gb()
        for ex in self.executors.values():  # persist TensorRT-RTX's JIT kernel cache for the next run
            if isinstance(ex, TensorRTExecutor) and ex.active:
                note = ex.save_runtime_cache()  # never fatal: the images are done
                if note:
                    log.warning(note)
        if not (images.size and finite):
            raise NonFiniteError("vae_decoder produced NaN/Inf; build it in fp32 (`--precision vae_decoder=fp32`)")
        timings.cache = cache.summary() if cache is not None else None
        return Result(images=images, timings=timings, latents_per_step=trace_latents, workflow=wf.name, height=height,
                      width=width)

    def decode(self, latents, height: int, width: int):
        """Packed latents [B, N, C] -> (uint8 images [B, H, W, 3], whether the VAE's output was finite): the one
        decode of `generate` and the continuous batcher, on the pipeline's stream."""
        with self.on_stream():  # all device work, including unpacking, on the one stream
            lat = fm.unpack_latents(latents, height, width, self.geo.vae_scale_factor)
            lat = fm.latents_for_vae(lat, self.scaling_factor, self.shift_factor)
            image = self.executors["vae_decoder"].infer({"latent": lat})["image"].float()
            images = fm.to_uint8(image)  # the copy to the host is ordered after the decode on our stream
            return images, bool(image.isfinite().all())

    def step_inputs(self, hidden_states, text, pooled, timestep, img_ids, *, guidance=None) -> dict:
        """The transformer's inputs for one step, by name (the one place `generate` and the batcher build
        them): per-sample `timestep` / `guidance` [B], text [B, T, D], pooled [B, D], shared ids."""
        feeds = {"hidden_states": hidden_states, "encoder_hidden_states": text, "pooled_projections": pooled,
                 "timestep": timestep, "img_ids": img_ids, "txt_ids": fm.text_ids(self.geo.t5_length).to(self.device)}
        if self.geo.guidance:
            feeds["guidance"] = guidance
        return feeds

    def prepare(self, wf, batch: int, height: int, width: int, steps: int, *, seed: int, inputs: ImageInputs) -> Prepared:
        """The workflow's starting state for a request (CPU tensors), its noise from a CPU generator seeded
        `seed` as diffusers' (the image workflows also run the VAE encoder here)."""
        import torch

        generator = torch.Generator("cpu").manual_seed(seed)
        return prepare_workflow(wf, Context(geo=self.geo, scheduler_config=self.scheduler_config,
                                            scaling_factor=self.scaling_factor, shift_factor=self.shift_factor,
                                            encode=self._encode, generator=generator, batch=batch, height=height,
                                            width=width, steps=steps, inputs=inputs, noise_dtype=self.noise_dtype()))

    def noise_dtype(self):
        """The dtype of the diffusers pipeline these components reproduce, which its noise is drawn in: the
        transformer's (its engine's or ONNX's latents input, or the PyTorch module's): fp32 engines match
        FluxPipeline in fp32, bf16 and quantized ones FluxPipeline in bf16."""
        return self.executors["transformer"].io_dtype("hidden_states")

    def _encode(self, images):
        """The workflows' VAE encoder: images [b, 3, H, W] float32 -> latent parameters [b, 2C, H/8, W/8] (CPU)."""
        ex = self.executors["vae_encoder"]
        ex.check_shapes({"image": tuple(images.shape)})
        with self.on_stream():
            out = ex.infer({"image": images.to(ex.device)})["latent_parameters"].float().cpu()  # waits for the stream
        _check_finite(out, "vae_encoder")
        return out

    def _denoise(self, prep: Prepared, pooled, text, guidance, negative, *, true_cfg, trace, on_step, timings,
                 cache=None):
        """The FlowMatch Euler loop of every workflow: (final packed latents, latents after each step if traced).
        Everything the loop needs is on the device before it starts; inside it nothing is read back, except
        First-Block Cache's one number per step when `cache` is on."""
        import torch

        dev, batch, steps = self.device, prep.latents.shape[0], len(prep.timesteps)
        with self.on_stream():
            cond = prep.to(dev)
            latents = cond.latents
            t_in = (prep.timesteps / 1000).to(dev)
            dts = (prep.sigmas[1:] - prep.sigmas[:-1]).to(dev)
            feeds = self.step_inputs(cond.model_input(latents), text.to(dev), pooled.to(dev), t_in[0].expand(batch),
                                     cond.img_ids, guidance=torch.full([batch], guidance, dtype=torch.float32).to(dev))
            step = (self.steps.step_function(feeds, refresh=negative is not None, schedule=t_in) if cache is None
                    else self.steps.cached_step(feeds, cache, "cond", schedule=t_in))
            if negative is not None:  # the same call with the negative prompts' embeddings
                neg_feeds = dict(feeds, encoder_hidden_states=negative[1].to(dev),
                                 pooled_projections=negative[0].to(dev))
                step_neg = (self.steps.step_function(neg_feeds, refresh=True, schedule=t_in) if cache is None
                            else self.steps.cached_step(neg_feeds, cache, "uncond", schedule=t_in))
            tokens = latents.shape[1]  # Kontext: the output's first tokens are the target's
            trace_latents = []
            step_marks = [_mark(dev)]
            try:
                with _sync_guard(dev, self.sync_check and cache is None):
                    for i in range(steps):
                        model_input = cond.model_input(latents)
                        noise_pred = step(model_input, t_in[i].expand(batch))[:, :tokens]
                        if negative is not None:  # the executor reuses its output buffer next call: keep this one
                            pos = noise_pred.clone()
                            neg = step_neg(model_input, t_in[i].expand(batch))[:, :tokens]
                            noise_pred = neg + true_cfg * (pos - neg)
                        latents = fm.euler_step(latents, noise_pred.float(), dts[i])
                        step_marks.append(_mark(dev))
                        if on_step is not None:
                            on_step(i)  # host-side callback (progress bar); reads nothing from the device
                        if trace:
                            trace_latents.append(latents.detach().to("cpu", copy=True))
            finally:
                self.steps.end()  # the transformer's calls outside a generation compute their modulation
        timings.steps = _intervals(step_marks, dev)
        return latents, trace_latents


class MemoryWatch:
    """Peak device memory of the pipeline during a generation: torch's own peak, and the device's used memory
    sampled between stages (TensorRT's weights and workspaces are allocated outside torch, so
    max_memory_allocated misses them), less what was in use before the pipeline loaded anything (`baseline`:
    (device used, torch allocated) when it was made). Sampled outside the denoising loop: no query inside it."""

    def __init__(self, baseline: tuple | None = None, mem_get_info=None, max_allocated=None, reset=None,
                 allocated=None):
        import torch

        self.mem_get_info = mem_get_info or torch.cuda.mem_get_info
        self.max_allocated = max_allocated or torch.cuda.max_memory_allocated
        (reset or torch.cuda.reset_peak_memory_stats)()
        free, total = self.mem_get_info()
        self.baseline, self.torch_baseline = baseline or (total - free, (allocated or torch.cuda.memory_allocated)())
        self.used = total - free

    def sample(self) -> None:
        free, total = self.mem_get_info()
        self.used = max(self.used, total - free)

    def peak_gb(self) -> float:
        self.sample()
        device = self.used - self.baseline  # everything this process added, TensorRT's allocations included
        return max(device, self.max_allocated() - self.torch_baseline, 0) / 2**30


def _sync_guard(dev, enabled: bool):
    """torch.cuda.set_sync_debug_mode("error") around the loop when asked: a hidden sync raises."""
    import contextlib

    if not enabled or dev.type != "cuda":
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def guard():
        import torch

        old = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(old)

    return guard()


def _elapsed(t0: float, dev) -> float:
    if dev.type == "cuda":
        import torch

        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _mark(dev):
    """A timestamp that costs no host sync: a recorded CUDA event on the GPU, the clock on the CPU."""
    if dev.type == "cuda":
        import torch

        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def _intervals(marks: list, dev) -> list[float]:
    """Seconds per step from the marks (read after the loop, so the loop itself never waits)."""
    if not marks:
        return []
    if dev.type == "cuda":
        import torch

        torch.cuda.synchronize()
        return [a.elapsed_time(b) / 1000 for a, b in zip(marks, marks[1:])]
    return [b - a for a, b in zip(marks, marks[1:])]
