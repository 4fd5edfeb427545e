"""The `fluxtrt` command line. Each command parses its options, makes one call into `fluxtrt.api` and renders
the result (`render.py`); every decision lives in the library. Heavy imports (torch, onnx, TensorRT) happen
inside the library calls, so `fluxtrt --help` is instant and needs no GPU."""

from __future__ import annotations

import errno
import functools
import os
import sys
from pathlib import Path
from typing import Optional

import typer
import typer.core as _typer_core

from . import __version__
from . import render as r
from .errors import FluxtrtError

app = typer.Typer(
    name="fluxtrt",
    help="Build TensorRT engines for FLUX.1 models (text-to-image, img2img, Fill, Canny/Depth control, Kontext) and "
    "run them. Every --model accepts a local diffusers folder or an embedded random-weight model: `tiny`, "
    "`tiny-schnell`, `tiny-fill`, `tiny-control`, `tiny-kontext`.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
_STATE = {"debug": False}
OOM_HINT = ("try `--low-vram`, a smaller batch or size, or a lower precision (`fluxtrt build -p fp8`, or per "
            "component `-p transformer=fp8`)")


def _version(value: bool):
    if value:
        r.out.print(f"fluxtrt {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks instead of one-line errors."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
):
    _STATE["debug"] = debug or bool(os.environ.get("FLUXTRT_DEBUG"))


def _one_line(e: BaseException) -> str | None:
    """The one line for an error the user can fix, or None (a bug: keep the traceback)."""
    if isinstance(e, FluxtrtError):
        return " ".join(str(e).splitlines())  # a name read from a file may hold a newline: still one line
    if isinstance(e, MemoryError):
        return f"out of memory; {OOM_HINT}"
    if isinstance(e, RuntimeError) and (type(e).__name__ == "OutOfMemoryError" or any(
            s in str(e).lower() for s in ("out of memory", "cudaerrormemoryallocation"))):
        return f"out of GPU memory; {OOM_HINT}"
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return (f"no space left on the device while writing {e.filename or 'a file'}; free some space or use --out "
                "on another disk (nothing half-written was kept)")
    if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR):
        return (f"cannot write {e.filename or 'a file'}: {e.strerror}; pass --out in a writable folder "
                "(nothing half-written was kept)")
    return None


def friendly(fn):
    """An error the user can fix is one red line and exit code 2 (a traceback only with --debug)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            by = "stopped by SIGTERM" if _STATE.get("terminated") else "interrupted"
            r.console.print(f"[yellow]{by}[/]: nothing half-written was left behind")
            raise typer.Exit(143 if _STATE.get("terminated") else 130) from None
        except Exception as e:
            line = None if _STATE["debug"] else _one_line(e)
            if line is None:
                raise
            r.error(line)
            raise typer.Exit(2) from None

    wrapper.__doc__ = " ".join((fn.__doc__ or "").split())  # one paragraph: the help wraps it to the terminal
    return wrapper


def _quiet_libraries():
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import warnings

    warnings.filterwarnings("ignore")


def _opt(default, *names, help: str):
    return typer.Option(default, *names, help=help)


_shown_type = getattr(_typer_core.TyperOption, "display_type_rich", None)  # typer 0.2x; older ones have none


def _flag_type(self, ctx):
    """The help's type column: none for on/off flags (typer 0.2x shows `<bool>` for them, --help included)."""
    return None if getattr(self, "is_flag", False) else _shown_type(self, ctx)


if _shown_type is not None:
    _typer_core.TyperOption.display_type_rich = _flag_type


MODEL_HELP = ("Local FLUX.1 diffusers folder (dev, schnell, Fill, Canny, Depth, Kontext), or an embedded "
              "random-weight model: tiny, tiny-schnell, tiny-fill, tiny-control, tiny-kontext.")
MODEL = _opt("tiny", "--model", "-m", help=MODEL_HELP)
COMPONENTS = _opt(None, "--components", "-c", help="Components, comma-separated: clip, t5, transformer, "
                  "vae_decoder, vae_encoder (default: all).")
PRECISION = _opt(None, "--precision", "-p", help="Override the config's precision: `bf16` for every component, "
                 "`fp8` / `fp4` (RTX 50) / `int8-wo` / `int4-wo` for every component that has the recipe (the config's precision "
                 "for the rest), or per component `transformer=fp8,t5=bf16`.")
VALIDATE = _opt(True, "--validate/--no-validate", help="Compare every ONNX with PyTorch in ONNX Runtime (needs the "
                "fp32 model in memory: turn it off for full-size models on small machines).")
CAL_SIZE = _opt(32, "--calibration-size", help="Calibrated recipes: prompts from the calibration file.")
CAL_STEPS = _opt(4, "--calibration-steps", help="Calibrated recipes: denoising steps per calibration prompt.")
CAL_PROMPTS = _opt(None, "--calibration-prompts", help="Calibrated recipes: prompt file (default: the prompts "
                   "shipped with fluxtrt, calibration/prompts.txt in a checkout).")
IMAGE = _opt(None, "--image", help="img2img (FLUX.1-dev/schnell engines): the image to change; Fill: the image to "
             "inpaint/outpaint; Kontext: the reference image to edit.")
MASK = _opt(None, "--mask", help="Fill (FLUX.1-Fill-dev engines): white = repaint, black = keep.")
CONTROL_IMAGE = _opt(None, "--control-image", help="Control (FLUX.1-Canny-dev / -Depth-dev engines): your Canny edge "
                     "map or depth map.")
STRENGTH = _opt(None, "--strength", help="img2img / Fill: share of the schedule that runs, in (0, 1] (default 0.6 / "
                "1.0, as diffusers); 1 ignores the image's content.")
MAX_AREA = _opt(None, "--max-area", help="Kontext: output area in px² (default 1048576 = 1024²); --height/--width give "
                "its aspect ratio.")
ENGINES = _opt(None, "--engines", "-e", help="Folder written by `fluxtrt build` (OUT/<gpu>).")
BACKEND = _opt("auto", "--backend", help="tensorrt (engines on an NVIDIA GPU), onnxruntime (the ONNX they were "
               "built from), torch (the PyTorch modules), or auto.")
ORT_PROVIDER = _opt("auto", "--ort-provider", help="With --backend onnxruntime: cpu, cuda (onnxruntime-gpu), tensorrt, "
                    "tensorrt-rtx, or auto (cuda where onnxruntime-gpu and a GPU are here, else cpu).")
TORCH_DTYPE = _opt("bf16", "--torch-dtype", help="dtype of PyTorch components (and the diffusers baseline) on a "
                   "GPU: bf16, fp16, fp32.")
COMPILE = _opt(False, "--compile", help="torch.compile the PyTorch components (and the baseline's).")
CUDA_GRAPH = _opt(False, "--cuda-graph", help="Capture the transformer step as a CUDA graph.")
CACHE_THRESHOLD = _opt(0.0, "--cache-threshold", help="First-Block Cache as diffusers' (e.g. 0.12-0.2): skip the "
                       "remaining blocks when the first block's residual changed less; 0: off. Engines need "
                       "`build --first-block-cache`.")
STEPS = _opt(None, "--steps", help="Denoising steps (default: 28 dev, 4 schnell; at most 1000).")
PARALLEL = _opt(1, "--parallel", help="Split the PyTorch transformer's tokens over N ranks (one GPU each, or CPU "
               "processes): context parallelism, 1 to 8.")
PARALLEL_ATTENTION = _opt("auto", "--parallel-attention", help="How split attention sees the whole sequence: auto "
                          "(ulysses where the heads divide by N, else gather), ulysses or gather.")
CALIBRATION = _opt(None, "--calibration", help="With --backend torch --model: the file `fluxtrt calibrate` wrote; the "
                   "PyTorch transformer computes the fp8 recipe (E4M3 tensor cores on sm89+, emulated elsewhere). "
                   "Engines built with fp8 need none: their graph holds the scales.")

GUIDANCE = _opt(None, "--guidance", help="Distilled guidance scale (dev only; default: the workflow's, as diffusers: "
                "3.5; img2img 7; Fill 30).")
HEIGHT = _opt(None, "--height", help="Pixels, a multiple of 16 (default: the profile's opt).")
WIDTH = _opt(None, "--width", help="Pixels, a multiple of 16 (default: the profile's opt).")
WS_BUDGET = _opt(None, "--weight-streaming-budget", help="MB of transformer weights kept on the GPU (engines built "
                 "with weight streaming).")
LORA = _opt(None, "--lora", help="FILE[:SCALE]: a transformer LoRA (diffusers/peft or kohya), repeatable (stacked): merged "
            "into --weights for engines and ONNX, into the PyTorch transformer (bf16) or beside its fp8 GEMMs.")
WEIGHTS = _opt(None, "--weights", help="Your FLUX.1 folder: weights come from it through the build's weight map "
               "(weightless engines are refitted; ONNX Runtime fills them).")
TRUE_CFG = _opt(1.0, "--true-cfg", help="True classifier-free guidance scale, > 1 to use --negative-prompt (diffusers' "
                "true_cfg_scale; two transformer calls per step).")


@app.command()
@friendly
def export(
    model: str = MODEL, out_dir: Path = _opt(Path("onnx"), "--out", "-o", help="Folder for <component>.onnx files."),
    components: Optional[list[str]] = COMPONENTS,
    dtype: str = _opt("fp32", "--dtype", help="Weight/activation dtype of the exported graph: fp32, fp16, bf16."),
    opset: int = _opt(19, "--opset", help="ONNX opset."), validate: bool = VALIDATE,
    zero_copy: bool = _opt(False, "--zero-copy/--copy-weights", help="Zero-copy: trace without loading weights; the "
                           "ONNX's external data are links into the model folder's safetensors (nothing copied; only "
                           "fluxtrt and TensorRT's parser read it). Default: standard ONNX with its weights."),
):
    """Export each component to ONNX (dynamic batch and image size) and validate it against PyTorch."""
    _quiet_libraries()
    from . import api
    from .components import specs_for
    from .models.source import resolve_model

    names = list(specs_for(resolve_model(model).geometry, api.split_list(components) or None))
    with r.phases(names, with_bar=True, total=6 if validate else 5) as update:  # export, load, trace, save, [validate], done
        summary = api.export(model, out_dir, components, dtype, opset, validate=validate, zero_copy=zero_copy, progress=update)
    r.export_summary(summary)


@app.command()
@friendly
def build(
    gpu: Optional[str] = _opt(None, "--gpu", "-g", help="Target GPU: a shipped config (3090, 4090, 5090, a100, "
                              "l40s, h100, h200)."),
    config: Optional[Path] = _opt(None, "--config", help="A custom GPU config YAML instead of --gpu."),
    model: Optional[str] = _opt(None, "--model", "-m", help=MODEL_HELP + " (default: tiny, said in the table)"),
    out_dir: Path = _opt(Path("engines"), "--out", "-o", help="Output root: engines to OUT/<gpu>/, ONNX to OUT/onnx/."),
    components: Optional[list[str]] = COMPONENTS, precision: Optional[list[str]] = PRECISION,
    static_shape: Optional[bool] = _opt(None, "--static-shape/--dynamic-shape", help="Pin the profile to the "
                                        "config's opt batch and resolution (default: the config's choice)."),
    force: bool = _opt(False, "--force", help="Rebuild every stage even if its inputs are unchanged."),
    calibration_size: int = CAL_SIZE, calibration_steps: int = CAL_STEPS, calibration_prompts: Optional[Path] = CAL_PROMPTS,
    smoothquant_alpha: float = _opt(0.5, "--smoothquant-alpha", help="int8 (W8A8): SmoothQuant strength, 0..1."),
    weightless: bool = _opt(False, "--weightless", help="Weight-stripped, refittable engines that `fluxtrt run "
                            "--weights` fills from a checkpoint (TensorRT-RTX 1.7 needs a GPU to build them)."),
    zero_copy: bool = _opt(True, "--zero-copy/--copy-weights", help="Build a component straight from its checkpoint "
                           "when it is stored in the engine's dtype (no fp32 copy); --copy-weights takes the fp32 "
                           "path (graph passes, every recipe) for all."),
    validate: bool = VALIDATE,
    first_block_cache: bool = _opt(False, "--first-block-cache", help="Also build the transformer as First-Block "
                                   "Cache's parts (head, tail, out) for `run --cache-threshold`."),
    backend: Optional[str] = _opt(None, "--backend", help="torch: compiled PyTorch engines (AOTInductor .pt2 "
                                  "packages) for this machine's GPU (or --gpu cpu), into OUT/<gpu>-torch/; default: "
                                  "the config's TensorRT backend."),
    parallel: int = _opt(1, "--parallel", help="With --backend torch --static-shape: compile the transformer to run "
                         "split over N ranks (`run --parallel N`), context parallelism, 2 to 8."),
    parallel_attention: str = PARALLEL_ATTENTION,
):
    """Export, optimize (and quantize), then build serialized TensorRT engines for one GPU, reusing every
    unchanged stage; each engine also gets a weight map and a weight-free ONNX for the user's own weights."""
    _quiet_libraries()
    from . import api
    from .records import BuildRequest, CalibrationSettings

    calib = CalibrationSettings(calibration_size, calibration_steps, calibration_prompts, smoothquant_alpha)
    request = BuildRequest.of(gpu=gpu, config=config, model=model, out_dir=out_dir, components=components,
                              precision=precision, static_shape=static_shape, force=force, calibration=calib,
                              weightless=weightless, zero_copy=zero_copy, validate=validate,
                              first_block_cache=first_block_cache, backend=backend, parallel=parallel,
                              parallel_attention=parallel_attention)
    with r.phases([]) as update:
        summary = api.build(request, progress=update)
    r.build_summary(summary)


@app.command()
@friendly
def calibrate(
    model: str = MODEL, out_dir: Path = _opt(Path("engines"), "--out", "-o", help="Output root (the cache goes to "
                                             "OUT/calibration/)."),
    recipe: str = _opt("fp8", "--recipe", help="Recipe to calibrate for (fp8, fp8-attn, int8)."),
    size: int = CAL_SIZE, steps: int = CAL_STEPS, prompts: Optional[Path] = CAL_PROMPTS,
    resolution: int = _opt(1024, "--resolution", help="The profile's opt size; a smaller non-square one is added."),
    zero_copy: bool = _opt(True, "--zero-copy/--copy-weights", help="As for build: ranges per linear layer of a "
                           "bf16 checkpoint (PyTorch), or of the fp32 path's graph (ONNX Runtime)."),
    device: Optional[str] = _opt(None, "--device", help="zero-copy path: cpu or cuda (default: cuda if present). "
                                 "A cache made on a GPU serves builds on CPU-only machines: copy OUT/calibration/."),
):
    """Run calibration alone and cache the activation ranges (a later quantized `fluxtrt build` reuses them)."""
    _quiet_libraries()
    from . import api
    from .records import CalibrationSettings

    settings = CalibrationSettings(size, steps, prompts, opt_resolution=resolution, device=device)
    with r.console.status("calibrating (running the reference pipeline over the prompts)...") as st:
        done = api.calibrate(model, out_dir, recipe, settings, zero_copy,
                             on_prompt=lambda d, n: st.update(f"calibrating: {d}/{n} prompts"))
    for cal in (done.graph, done.calibration):
        if cal is not None:
            state = "reused the cache" if cal.cached else f"measured {cal.samples} transformer calls"
            what = "graph ranges for `fluxtrt build`" if cal is done.graph else "activation ranges"
            use = {"fp8": " (for `fluxtrt build`, and `run --backend torch --calibration`)",
                   "fp8-attn": " (for `run --backend torch --calibration`)"}.get(recipe, "") \
                if cal is done.calibration else ""
            r.out.print(f"{recipe} calibration for {done.source.id}: {len(cal.amax)} {what}, {state} -> {cal.path}{use}")


@app.command()
@friendly
def artifacts(
    gpus: str = _opt("4090", "--gpus", help="GPU targets, comma-separated (TensorRT-RTX ones build here, GPU or not)."),
    model: str = MODEL, engines: Path = _opt(Path("engines"), "--engines", help="Build root (engines built or reused)."),
    out_dir: Path = _opt(Path("dist"), "--out", "-o", help="Folder for the archives and their .sha256 files."),
    precision: Optional[list[str]] = PRECISION,
):
    """Build engines for each GPU target and pack each target into one archive with a sha256 file."""
    _quiet_libraries()
    from . import api

    for cfg, archive, sha in api.artifacts(gpus, model, engines, out_dir, precision, say=r.console.print):
        r.out.print(f"{cfg.key}: {archive} ({r.human(archive.stat().st_size)}), {sha.name}")


@app.command()
@friendly
def unpack(
    archive: Path = typer.Argument(..., help="An archive made by `fluxtrt artifacts` (its .sha256 file beside it)."),
    out_dir: Path = _opt(Path("engines"), "--out", "-o", help="Where the GPU folder is placed."),
    sha256: Optional[Path] = _opt(None, "--sha256", help="The checksum file, if not ARCHIVE.sha256."),
):
    """Verify an engine archive's checksum and extract it safely (plain files only, no paths out)."""
    from .artifacts import unpack as do_unpack

    folder = do_unpack(archive, out_dir, sha256, on_moved=lambda old, new: r.note(
        f"{old} existed: moved it to {new} (nothing deleted; remove it when you no longer need it)"))
    r.out.print(f"verified and unpacked {archive.name} -> {folder} (run: fluxtrt run --engines {folder} --prompt ...)")


@app.command()
@friendly
def inspect(engine_dir: Path = typer.Argument(..., help="A folder written by `fluxtrt build` (OUT/<gpu>).")):
    """Print an engine folder's manifest, check each engine file's size and sha256, and say whether this
    machine's TensorRT can run it (and why not). Exit 2 when a file does not match the manifest."""
    from . import api

    found = api.inspect(engine_dir)
    r.inspection(found.manifest, found.checks)
    bad = [f"{row.component}: {row.file.split(' (')[0].split(':')[0]}" for row in found.checks if row.file != "ok"]
    if found.problems:
        raise FluxtrtError("; ".join(found.problems[:3]))
    if bad:
        raise FluxtrtError(f"{len(bad)} engine file(s) do not match the manifest ({', '.join(bad)}); rebuild with "
                           "`fluxtrt build` or unpack the archive again")


class _WarningLine:
    """Route the runtime's warnings (e.g. prompt truncation) to one yellow line each."""

    level = 30

    def handle(self, record):
        r.warning(record.getMessage())

    def __getattr__(self, name):  # the logging module probes a few attributes
        import logging

        return getattr(logging.Handler(), name)


@app.command()
@friendly
def run(
    prompt: Optional[str] = _opt(None, "--prompt", help="What to draw."),
    prompts_file: Optional[Path] = _opt(None, "--prompts-file", help="UTF-8 file, one prompt per line."),
    engines: Optional[Path] = ENGINES, backend: str = BACKEND, ort_provider: str = ORT_PROVIDER,
    torch_dtype: str = TORCH_DTYPE, compile: bool = COMPILE,
    model: Optional[str] = _opt(None, "--model", "-m", help="With --backend torch and no --engines: " + MODEL_HELP),
    fallback: Optional[list[str]] = _opt(None, "--fallback", help="Components to run in PyTorch, e.g. t5,transformer."),
    steps: Optional[int] = STEPS, seed: int = _opt(0, "--seed", help="Seed of the CPU generator (as diffusers)."),
    guidance: Optional[float] = GUIDANCE, height: Optional[int] = HEIGHT, width: Optional[int] = WIDTH,
    image: Optional[Path] = IMAGE, mask: Optional[Path] = MASK, control_image: Optional[Path] = CONTROL_IMAGE,
    strength: Optional[float] = STRENGTH, max_area: Optional[int] = MAX_AREA,
    batch: int = _opt(1, "--batch", help="Images per call; one prompt is repeated, a prompts file is chunked."),
    out_path: Path = _opt(Path("fluxtrt.png"), "--out", "-o", help="PNG path; several images get -0, -1, ... suffixes."),
    low_vram: bool = _opt(False, "--low-vram", help="Load and free engines stage by stage."),
    weight_streaming_budget: Optional[int] = WS_BUDGET, cuda_graph: bool = CUDA_GRAPH,
    allow_host_code: bool = _opt(False, "--allow-host-code", help="Let engines with embedded host code load."),
    weights: Optional[Path] = WEIGHTS,
    lora: Optional[list[str]] = LORA,
    negative_prompt: Optional[str] = _opt(None, "--negative-prompt", help="What to steer away from (with --true-cfg)."),
    true_cfg: float = TRUE_CFG,
    calibration: Optional[Path] = CALIBRATION, cache_threshold: float = CACHE_THRESHOLD,
    parallel: int = PARALLEL, parallel_attention: str = PARALLEL_ATTENTION,
):
    """Generate images from built engines, with the diffusers pipeline's semantics seed for seed: text-to-image,
    img2img (--image), Fill (--image --mask), Control (--control-image), Kontext (--image), as the engines serve."""
    _quiet_libraries()
    import logging

    from . import api

    prompts = api.read_prompts(prompt, prompts_file)
    opts = api.RunOptions.of(
        engines=engines, model=model, backend=backend, ort_provider=ort_provider, fallback=tuple(fallback or ()),
        torch_dtype=torch_dtype, compile=compile, steps=steps, guidance=guidance, height=height, width=width, seed=seed,
        batch=batch, out=out_path, low_vram=low_vram, weight_streaming_budget=weight_streaming_budget,
        cuda_graph=cuda_graph, allow_host_code=allow_host_code, weights=weights, lora=tuple(lora or ()),
        negative_prompt=negative_prompt, true_cfg=true_cfg, image=image, mask=mask, control_image=control_image,
        strength=strength, max_area=max_area, calibration=calibration, cache_threshold=cache_threshold,
        parallel=parallel, parallel_attention=parallel_attention)
    logging.getLogger("fluxtrt").addHandler(_WarningLine())
    with r.phases(["denoise"]) as update:
        done = api.generate(prompts, opts, on_step=lambda i: update("denoise", f"step {i + 1}"), say=r.note)
    r.timings(done)


@app.command()
@friendly
def bench(
    engines: Optional[Path] = ENGINES, backend: str = BACKEND, ort_provider: str = ORT_PROVIDER,
    torch_dtype: str = TORCH_DTYPE, compile: bool = COMPILE,
    model: Optional[str] = _opt(None, "--model", "-m", help="With --backend torch: " + MODEL_HELP + " Also "
                                "random:flux.1-dev / random:flux.1-schnell (full size, random weights)."),
    sizes: str = _opt("512", "--sizes", help="Square image sizes in pixels, comma-separated."),
    batches: str = _opt("1", "--batch", help="Batch sizes, comma-separated."), steps: Optional[int] = STEPS,
    runs: int = _opt(3, "--runs", help="Measured runs per row (median and spread)."),
    warmup: int = _opt(1, "--warmup", help="Unmeasured runs first."),
    baseline: str = _opt("none", "--baseline", help="diffusers: also run diffusers' FluxPipeline here; none."),
    cuda_graph: bool = CUDA_GRAPH,
    image: Optional[Path] = IMAGE, mask: Optional[Path] = MASK, control_image: Optional[Path] = CONTROL_IMAGE,
    json_out: Optional[Path] = _opt(None, "--json", help="Write the table as JSON."),
    plot_out: Optional[Path] = _opt(None, "--plot", help="Write a PNG chart (needs matplotlib)."),
    calibration: Optional[Path] = CALIBRATION, cache_threshold: float = CACHE_THRESHOLD,
    lora: Optional[list[str]] = LORA,
):
    """Measure latency per component, seconds per image and peak memory, optionally against diffusers' pipeline
    of the same workflow."""
    _quiet_libraries()
    from . import api
    from .bench import BenchOptions
    from .runtime.options import PipelineOptions

    try:
        size_list, batch_list = ([int(v) for v in api.split_list([x])] for x in (sizes, batches))
        opts = BenchOptions(sizes=size_list, batches=batch_list, steps=steps, runs=runs, warmup=warmup,
                            baseline=baseline, inputs=api.image_inputs(image, mask, control_image),
                            pipeline=PipelineOptions(torch_dtype=torch_dtype, compile=compile, cuda_graph=cuda_graph,
                                                     ort_provider=ort_provider, lora=tuple(lora or ())),
                            cache_threshold=cache_threshold)
    except ValueError:
        raise FluxtrtError(f"--sizes and --batch take comma-separated integers, got {sizes!r} / {batches!r}") from None
    rows, meta, written = api.bench(engines, model, backend, opts, say=lambda line: r.console.print(line),
                                    json_out=json_out, plot_out=plot_out, calibration=calibration)
    r.bench_rows(rows, meta)
    for path in written:
        r.out.print(f"wrote {path}")


@app.command()
@friendly
def validate(
    engines: Path = _opt(Path("engines/4090"), "--engines", help="A folder written by `fluxtrt build` (its ONNX in "
                         "the build root's onnx/)."),
    ort_provider: str = ORT_PROVIDER,
    components: Optional[list[str]] = _opt(None, "--component", "-c", help="Components, comma-separated (default: "
                                           "every one built)."),
    device: Optional[str] = _opt(None, "--device", help="Where PyTorch runs: cuda or cpu (default: with ONNX Runtime)."),
    model: Optional[str] = _opt(None, "--model", "-m", help="The PyTorch side (default: the model the engines were "
                                "built from)."),
    json_out: Optional[Path] = _opt(None, "--json", help="Also write the rows as JSON lines."),
    fp32: bool = _opt(False, "--fp32", help="Run bf16 graphs widened to fp32 against the fp32 module (TF32 off): "
                      "the graph's own arithmetic, apart from bf16 rounding, within the fp32 bound."),
):
    """Check each built component's ONNX in ONNX Runtime against its PyTorch module on the same inputs and device,
    at the profile's opt and min shapes, beside how much the module differs from itself with another attention
    kernel (or, for an fp32 module without one, from itself in fp64). Exit 1 when a row fails."""
    _quiet_libraries()
    from . import api

    comps = api.split_list(components) if components else None
    rows = api.validate_engines(engines, comps, ort_provider, device, model, json_out=json_out, say=r.console.print, fp32=fp32)
    r.validate_rows(rows)
    if not all(row.ok for row in rows if row.decides):
        raise typer.Exit(1)


@app.command()
@friendly
def serve(
    engines: Optional[Path] = ENGINES, backend: str = BACKEND, torch_dtype: str = TORCH_DTYPE,
    model: Optional[str] = _opt(None, "--model", "-m", help="With --backend torch and no --engines: " + MODEL_HELP),
    host: str = _opt("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = _opt(8000, "--port", help="HTTP port."),
    replicas: int = _opt(1, "--replicas", help="Copies of the engines, one GPU each (spread over a Ray cluster)."),
    max_batch: Optional[int] = _opt(None, "--max-batch", help="Largest transformer batch (default: the profile's)."),
    max_queue: int = _opt(64, "--max-queue", help="Images accepted per replica before answering 503 (Retry-After)."),
    address: Optional[str] = _opt(None, "--address", help="Join this Ray cluster (e.g. ray://head:10001 or auto); "
                                  "default: start Ray inside this process."),
    calibration: Optional[Path] = CALIBRATION, cache_threshold: float = CACHE_THRESHOLD, compile: bool = COMPILE,
    size: Optional[str] = _opt(None, "--size", help="WIDTHxHEIGHT of requests that name none, and the size "
                               "--compile compiles for (default: the profile's, 1024x1024 with --model)."),
    lora: Optional[list[str]] = LORA, weights: Optional[Path] = WEIGHTS,
    lora_dir: Optional[Path] = _opt(None, "--lora-dir", help="Serve the LoRA files of this folder per request: "
                                    "\"lora\": \"name\" (DIR/name.safetensors); mixed in one batch on --backend torch, "
                                    "merged into --weights per call on engines."),
    lora_cache_gb: float = _opt(4.0, "--lora-cache-gb", help="GPU memory for the LoRAs in use; least recently used "
                                "evicted."),
    parallel: int = PARALLEL, parallel_attention: str = PARALLEL_ATTENTION,
):
    """Serve text-to-image over HTTP (Ray Serve) with step-level continuous batching: POST /v1/images/generations,
    GET /health. Prints the URL when ready; Ctrl-C stops."""
    _quiet_libraries()
    from .serving import ServeArgs, serve_forever

    args = ServeArgs.of(engines=engines, model=model, backend=backend, max_batch=max_batch, max_queue=max_queue,
                        replicas=replicas, torch_dtype=torch_dtype, calibration=calibration,
                        cache_threshold=cache_threshold, compile=compile, size=size, lora=tuple(lora or ()), weights=weights,
                        lora_dir=str(lora_dir) if lora_dir is not None else None, lora_cache_gb=lora_cache_gb,
                        parallel=parallel, parallel_attention=parallel_attention)
    serve_forever(args, host, port, address, r.out.print)


@app.command()
@friendly
def optimize(
    in_dir: Path = _opt(..., "--in", help="Folder written by `fluxtrt export` (fp32)."),
    out_dir: Path = _opt(..., "--out", help="Folder for the optimized ONNX files."),
    passes: Optional[list[str]] = _opt(None, "--passes", help="Passes, comma-separated (default: all of "
                                       "optimize.passes.DEFAULT_PASSES, the ones `build` runs; the report lists "
                                       "them; a wrong name lists the available ones)."),
    dtype: str = _opt("fp32", "--dtype", help="Precision placement: fp32, fp16 or bf16 (norms, softmax, outputs fp32)."),
    components: Optional[list[str]] = COMPONENTS,
):
    """Run graph passes and precision placement; print node counts per pass and TensorRT layers before/after."""
    _quiet_libraries()
    from . import api

    r.optimize_reports(api.optimize(in_dir, out_dir, passes, dtype, components), out_dir)


def _terminated(signum, frame):
    """SIGTERM (Kubernetes, CI, `kill`) stops a command as Ctrl-C does: temp files and locks are removed on the
    way out, one line is printed, and the exit code is 143."""
    _STATE["terminated"] = True
    raise KeyboardInterrupt


def run_cli():  # entry point
    import signal

    signal.signal(signal.SIGTERM, _terminated)
    try:
        app()
    except BrokenPipeError:
        sys.exit(1)


if __name__ == "__main__":
    run_cli()
