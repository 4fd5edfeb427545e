"""`fluxtrt bench`: per-component latency, end-to-end seconds per image, images per minute and peak device
memory for fluxtrt's pipeline, and the same measured on diffusers' FluxPipeline in the same process.
Device timings use CUDA events, CPU timings a monotonic clock; every number is a median over `runs` runs
after `warmup` runs, with min and max as spread; ratios are computed from numbers of the same run."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

from .runtime.options import PipelineOptions

PROMPT = "a photo of a red fox sitting in fresh snow, morning light, 85mm"


@dataclass
class Measure:
    median: float
    min: float
    max: float

    @classmethod
    def of(cls, values):
        values = list(values)
        return cls(statistics.median(values), min(values), max(values))


@dataclass
class Row:
    system: str  # "fluxtrt (<backend>)" or "diffusers"
    height: int
    width: int
    batch: int
    steps: int
    text_encoders_s: Measure
    transformer_step_s: Measure
    vae_decode_s: Measure
    end_to_end_s: Measure
    seconds_per_image: float
    images_per_minute: float
    outside_transformer_share: float  # of end-to-end time: text encoders, scheduler, VAE, Python
    peak_memory_gb: float | None
    ratios: dict = field(default_factory=dict)  # diffusers time / ours, per measure (> 1: we are faster)
    cache: dict | None = None  # First-Block Cache: threshold and the median computed / skipped steps of the runs


def _peak_gb(device) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_fluxtrt(pipe, label: str, h: int, w: int, batch: int, *, steps: int, runs: int, warmup: int,
                  inputs=None, cache_threshold: float = 0.0) -> Row:
    import torch

    prompts = [PROMPT] * batch
    samples = []
    for k in range(warmup + runs):
        pipe.prompts.forget()  # time the text encoders every run
        if pipe.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        _sync(pipe.device)
        res = pipe.generate(prompts, h, w, steps, seed=k, inputs=inputs, cache_threshold=cache_threshold)
        if k >= warmup:
            samples.append(res.timings)
    total = Measure.of(t.total for t in samples)
    inside = statistics.median(sum(t.steps) for t in samples)
    cache = None if samples[0].cache is None else {
        "threshold": cache_threshold, **{k: statistics.median(t.cache[k] for t in samples) for k in ("computed", "skipped")}}
    peak = max((t.peak_memory_gb or 0) for t in samples) if samples[0].peak_memory_gb is not None else None
    return Row(system=label, height=h, width=w, batch=batch, steps=steps,
               text_encoders_s=Measure.of(t.text_encoders for t in samples),
               transformer_step_s=Measure.of(statistics.median(t.steps) for t in samples),
               vae_decode_s=Measure.of(t.vae for t in samples), end_to_end_s=total,
               seconds_per_image=total.median / batch, images_per_minute=60 * batch / total.median,
               outside_transformer_share=1 - inside / total.median, peak_memory_gb=peak, cache=cache)


class _CallTimer:
    """Times every call of a module with hooks: CUDA events on the GPU (read after the run), else the clock."""

    def __init__(self, module, device):
        self.device, self.marks = device, []
        self.handles = [module.register_forward_pre_hook(lambda *a: self._mark()),
                        module.register_forward_hook(lambda *a: self._mark())]

    def _mark(self):
        import torch

        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def take(self) -> list[float]:
        _sync(self.device)
        pairs = list(zip(self.marks[0::2], self.marks[1::2]))
        self.marks = []
        if self.device.type == "cuda":
            return [a.elapsed_time(b) / 1000 for a, b in pairs]
        return [b - a for a, b in pairs]

    def close(self):
        for h in self.handles:
            h.remove()


def bench_diffusers(dpipe, geo, h: int, w: int, batch: int, *, steps: int, runs: int, warmup: int, device,
                    extra: dict | None = None) -> Row:
    import torch

    timers = {"transformer": _CallTimer(dpipe.transformer, device), "vae": _CallTimer(dpipe.vae.decoder, device),
              "clip": _CallTimer(dpipe.text_encoder, device), "t5": _CallTimer(dpipe.text_encoder_2, device)}
    rows = []
    try:
        for k in range(warmup + runs):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            _sync(device)
            t0 = time.perf_counter()
            dpipe(prompt=[PROMPT] * batch, height=h, width=w, num_inference_steps=steps, guidance_scale=3.5,
                  max_sequence_length=geo.t5_length, generator=torch.Generator().manual_seed(k), output_type="np",
                  **(extra or {}))
            _sync(device)
            total = time.perf_counter() - t0
            t = {name: tm.take() for name, tm in timers.items()}
            if k >= warmup:
                rows.append((total, sum(t["clip"]) + sum(t["t5"]), t["transformer"], sum(t["vae"]), _peak_gb(device)))
    finally:
        for tm in timers.values():
            tm.close()
    total = Measure.of(r[0] for r in rows)
    inside = statistics.median(sum(r[2]) for r in rows)
    return Row(system="diffusers", height=h, width=w, batch=batch, steps=steps,
               text_encoders_s=Measure.of(r[1] for r in rows),
               transformer_step_s=Measure.of(statistics.median(r[2]) for r in rows),
               vae_decode_s=Measure.of(r[3] for r in rows), end_to_end_s=total,
               seconds_per_image=total.median / batch, images_per_minute=60 * batch / total.median,
               outside_transformer_share=1 - inside / total.median, peak_memory_gb=rows[0][4])


def add_ratios(ours: Row, base: Row) -> None:
    for key in ("text_encoders_s", "transformer_step_s", "vae_decode_s", "end_to_end_s"):
        ours.ratios[key] = getattr(base, key).median / max(getattr(ours, key).median, 1e-12)


def to_json(rows: list[Row], meta: dict) -> dict:
    return {"meta": meta, "rows": [asdict(r) for r in rows]}


def plot(rows: list[Row], path) -> None:
    """A PNG bar chart: end-to-end seconds per image and transformer step, per system and size."""
    import matplotlib.pyplot as plt

    fig = figure(rows)
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


def figure(rows: list[Row]):
    """Horizontal bars, one row per measurement: the labels stack down the y axis with room for each (two lines:
    system, then size and batch), however many rows there are."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.system}\n{r.width}x{r.height} b{r.batch}" for r in rows]
    y = list(range(len(rows)))[::-1]  # first row on top
    fig, axes = plt.subplots(1, 2, figsize=(10, 1.0 + 0.5 * len(rows)), sharey=True)
    axes[0].barh(y, [r.seconds_per_image for r in rows], color="tab:blue")
    axes[0].set_title("seconds per image (end to end)")
    axes[1].barh(y, [r.transformer_step_s.median * 1000 for r in rows], color="tab:orange")
    axes[1].set_title("transformer step (ms)")
    axes[0].set_yticks(y, labels, fontsize=8)
    fig.tight_layout()
    return fig


@dataclass
class BenchOptions:
    sizes: list = field(default_factory=lambda: [512])
    batches: list = field(default_factory=lambda: [1])
    steps: int | None = None  # default: 28 dev, 4 schnell
    runs: int = 3
    warmup: int = 1
    baseline: str = "none"  # or "diffusers"
    pipeline: PipelineOptions = field(default_factory=PipelineOptions)  # how fluxtrt's pipeline opens
    inputs: object = None  # workflows.ImageInputs: img2img, Fill, Control or Kontext instead of text-to-image
    cache_threshold: float = 0.0  # First-Block Cache on fluxtrt's rows (diffusers' baseline stays uncached)

    def check(self) -> "BenchOptions":
        from .errors import FluxtrtError

        if not self.sizes or not self.batches or min(self.sizes) < 1 or min(self.batches) < 1:
            raise FluxtrtError("--sizes and --batch take comma-separated positive integers")
        if self.runs < 1 or self.warmup < 0:
            raise FluxtrtError("--runs must be at least 1 and --warmup at least 0")
        if self.baseline not in ("diffusers", "none"):
            raise FluxtrtError(f"--baseline is diffusers or none, got {self.baseline!r}")
        if not 0 <= self.cache_threshold <= 10:
            raise FluxtrtError(f"--cache-threshold is between 0 (off) and 10, got {self.cache_threshold}")
        return self


def run_bench(pipe, source, backend: str, opts: BenchOptions, say=lambda line: None) -> tuple[list[Row], dict]:
    """Rows for fluxtrt's pipeline `pipe` (and diffusers', with baseline=diffusers, plus ratios) and the run's
    metadata. `say` gets one line per measurement as it starts."""
    import torch

    from . import __version__
    from .dtypes import torch_dtype

    wf = pipe.plan(opts.sizes[0], opts.sizes[0], opts.inputs)[0]
    steps = opts.steps if opts.steps is not None else wf.default_steps(pipe.geo)
    label, dpipe, baselines = f"fluxtrt ({backend})", None, []
    if opts.baseline == "diffusers":
        from .models.source import resolve_model

        src = source or resolve_model(pipe.manifest.model.id)
        on_gpu = pipe.device.type == "cuda"
        dpipe = src.load_pipeline(torch_dtype(opts.pipeline.torch_dtype) if on_gpu else torch.float32, pipe.device.type,
                                  diffusers_pipeline=wf.diffusers_pipeline)
        dpipe.set_progress_bar_config(disable=True)
        # diffusers eager is the baseline of the ratios; with --compile diffusers compiled is measured too
        baselines = [("diffusers", dpipe.transformer)]
        if opts.pipeline.compile:
            baselines.append(("diffusers (compiled)", torch.compile(dpipe.transformer, fullgraph=False, dynamic=False)))
    rows = []
    for size in opts.sizes:
        for b in opts.batches:
            say(f"measuring {label} {size}x{size} batch {b}, {steps} steps ...")
            ours = bench_fluxtrt(pipe, label, size, size, b, steps=steps, runs=opts.runs, warmup=opts.warmup, inputs=opts.inputs,
                                 cache_threshold=opts.cache_threshold)
            rows.append(ours)
            for name, transformer in baselines:
                say(f"measuring {name} {size}x{size} batch {b} ...")
                dpipe.transformer = transformer
                base = bench_diffusers(dpipe, pipe.geo, size, size, b, steps=steps, runs=opts.runs, warmup=opts.warmup,
                                       device=pipe.device,
                                       extra=wf.diffusers_kwargs(opts.inputs) if opts.inputs is not None else None)
                base.system = name
                if name == "diffusers":
                    add_ratios(ours, base)
                else:
                    ours.ratios["end_to_end_s_vs_compiled"] = base.end_to_end_s.median / max(ours.end_to_end_s.median,
                                                                                             1e-12)
                rows.append(base)
    meta = {"fluxtrt": __version__, "torch": torch.__version__, "device": torch.cuda.get_device_name() if
            pipe.device.type == "cuda" else "cpu", "backend": backend, "steps": steps, "runs": opts.runs,
            "warmup": opts.warmup, "compile": opts.pipeline.compile, "cuda_graph": opts.pipeline.cuda_graph,
            "torch_dtype": opts.pipeline.torch_dtype, "model": source.id if source else pipe.manifest.model.id,
            "cache_threshold": opts.cache_threshold,
            "date": time.strftime("%Y-%m-%d"), "variant": pipe.geo.variant, "workflow": wf.name}
    return rows, meta
