"""The `fluxtrt` command line. Each command is a thin wrapper over one library call; heavy imports
(torch, onnx, TensorRT) happen inside the commands, so `fluxtrt --help` is instant and needs no GPU."""

from __future__ import annotations

import functools
import os
import time
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from . import __version__
from .errors import FluxtrtError

app = typer.Typer(
    name="fluxtrt",
    help="Build TensorRT engines for FLUX.1 text-to-image models and run them. "
    "Every --model accepts a local diffusers folder or the embedded random-weight models `tiny` / `tiny-schnell`.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Tables are wide: when writing to a file or pipe (logs, CI), do not cut them at 80 columns.
console = Console(stderr=True, width=None if sys.stderr.isatty() else 200)
out = Console(width=None if sys.stdout.isatty() else 200)
_STATE = {"debug": False}


def _version(value: bool):
    if value:
        out.print(f"fluxtrt {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks instead of one-line errors."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
):
    _STATE["debug"] = debug or bool(os.environ.get("FLUXTRT_DEBUG"))


def friendly(fn):
    """Turn FluxtrtError into one red line and exit code 2 (a traceback only with --debug)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except FluxtrtError as e:
            if _STATE["debug"]:
                raise
            from rich.markup import escape

            console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except MemoryError:
            if _STATE["debug"]:
                raise
            console.print("[bold red]error:[/] out of memory; try `--low-vram`, a smaller batch or size, or a lower "
                          "precision (`fluxtrt build --precision transformer=fp8`)")
            raise typer.Exit(2) from None
        except RuntimeError as e:  # torch.cuda.OutOfMemoryError and TensorRT allocation failures
            if _STATE["debug"] or not _is_oom(e):
                raise
            console.print("[bold red]error:[/] out of GPU memory; try `--low-vram`, a smaller batch or size, or a "
                          "lower precision (`fluxtrt build --precision transformer=fp8`)")
            raise typer.Exit(2) from None
        except OSError as e:
            if e.errno != 28 or _STATE["debug"]:  # ENOSPC: say which file and what to do
                raise
            console.print(f"[bold red]error:[/] no space left on the device while writing {e.filename or 'a file'}; "
                          "free some space or use --out on another disk (nothing half-written was kept)")
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            console.print("[yellow]interrupted[/]: nothing half-written was left behind")
            raise typer.Exit(130) from None

    return wrapper


def _is_oom(e: BaseException) -> bool:
    text = str(e).lower()
    return type(e).__name__ == "OutOfMemoryError" or "out of memory" in text or "cudaerrormemoryallocation" in text


def _split(values: Optional[list[str]]) -> Optional[list[str]]:
    if not values:
        return None
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


def _quiet_libraries():
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import warnings

    warnings.filterwarnings("ignore")


MODEL_HELP = "Local FLUX.1 diffusers folder, or `tiny` / `tiny-schnell` (embedded random weights)."
COMPONENTS_HELP = "Components, comma-separated: clip, t5, transformer, vae_decoder, vae_encoder (default: all)."


@app.command()
@friendly
def export(
    model: str = typer.Option("tiny", "--model", "-m", help=MODEL_HELP),
    out_dir: Path = typer.Option(Path("onnx"), "--out", "-o", help="Folder for <component>.onnx files."),
    components: Optional[list[str]] = typer.Option(None, "--components", "-c", help=COMPONENTS_HELP),
    dtype: str = typer.Option("fp32", "--dtype", help="Weight/activation dtype of the exported graph: fp32, fp16, bf16."),
    opset: int = typer.Option(19, "--opset", help="ONNX opset."),
    validate: bool = typer.Option(True, "--validate/--no-validate", help="Compare with PyTorch in ONNX Runtime."),
    zero_copy: Optional[bool] = typer.Option(
        None, "--zero-copy/--copy-weights",
        help="Zero-copy: trace without loading weights; the ONNX points into the model folder's safetensors (nothing "
             "copied; the graph keeps the stored dtype). Default: zero-copy for each component whose safetensors are "
             "stored in --dtype, weights copied for the others."),
):
    """Export each component to ONNX (dynamic batch and image size) and validate it against PyTorch.

    With --zero-copy the weights are never loaded: the graph is traced on PyTorch's meta device and every
    initializer is external data pointing into the checkpoint's own safetensors files, through links in
    <out>/<component>.weights/ (keep the model folder where it is). It is the default wherever the checkpoint already
    holds the exact tensors (safetensors stored in --dtype). Little memory and nothing copied at any size
    (full FLUX.1-dev transformer on 16 cores: 42 s, 1.05 GB peak RSS, 2.3 MB written: three blocks of each kind are
    traced and replicated; a later export of the same architecture reuses the cached graph: 6 s)."""
    _quiet_libraries()
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from .export import export_model
    from .models.source import resolve_model

    source = resolve_model(model)
    names = _split(components)
    copied = []
    if zero_copy is None:  # per component: zero-copy where the stored tensors are exactly the graph's
        from .components import specs_for
        from .export import torch_dtype, zero_copy_refusal

        torch_dtype(dtype)
        refusals = {n: zero_copy_refusal(source, s, dtype) for n, s in specs_for(source.geometry, names).items()}
        zero_copy = frozenset(n for n, why in refusals.items() if why is None)
        copied = [why for why in refusals.values() if why is not None]
    phases = ["load", "trace", "save", "validate", "done"] if validate else ["load", "trace", "save", "done"]
    with Progress(SpinnerColumn(), TextColumn("{task.description:<12}"), BarColumn(), TextColumn("{task.fields[phase]}"),
                  TimeElapsedColumn(), console=console, transient=False) as bar:
        from .components import specs_for

        tasks = {n: bar.add_task(n, total=len(phases) - 1, phase="waiting")
                 for n in specs_for(source.geometry, names)}

        def progress(name, phase):
            bar.update(tasks[name], completed=phases.index(phase), phase=phase)

        results = export_model(source, out_dir, names, dtype, opset, validate, progress=progress, zero_copy=zero_copy)
    title = "zero-copy " if all(r.zero_copy for r in results) else ""
    table = Table(title=f"ONNX {title}export of {source.id} ({source.variant}) -> {out_dir}")
    for col in ("component", "file", "dtype", "written", "seconds", "max rel err vs PyTorch"):
        table.add_column(col)
    for r in results:
        err = f"{r.max_rel_err:.1e}" if r.max_rel_err is not None else "not validated"
        name = r.path.name + (" (+ .data)" if r.external_data else "")
        if r.zero_copy:
            name += f" -> {r.zero_copy['linked_tensors']} tensors, {_human(r.zero_copy['linked_bytes'])} in the checkpoint"
            if r.zero_copy["graph"] == "from cache":
                name += " (graph from cache)"
        table.add_row(r.component, name, r.dtype, _human(r.bytes), f"{r.seconds:.1f}", err)
    out.print(table)
    if copied:
        out.print("weights copied, not zero-copy: " + "; ".join(copied))


def _precision_overrides(values: Optional[list[str]], components) -> dict:
    """`bf16` (every component) or `transformer=fp16,t5=bf16`."""
    from .components import ALL

    out = {}
    for item in _split(values) or []:
        if "=" in item:
            comp, prec = item.split("=", 1)
            out[comp.strip()] = prec.strip()
        else:
            out.update({c: item for c in (components or ALL)})
    return out


@app.command()
@friendly
def build(
    gpu: Optional[str] = typer.Option(None, "--gpu", "-g", help="Target GPU: a name in configs/ (3090, 4090, 5090, a100, l40s, h100, h200)."),
    config: Optional[Path] = typer.Option(None, "--config", help="A custom GPU config YAML instead of --gpu."),
    model: str = typer.Option("tiny", "--model", "-m", help=MODEL_HELP),
    out_dir: Path = typer.Option(Path("engines"), "--out", "-o", help="Output root: engines go to OUT/<gpu>/, ONNX to OUT/onnx/."),
    components: Optional[list[str]] = typer.Option(None, "--components", "-c", help=COMPONENTS_HELP),
    precision: Optional[list[str]] = typer.Option(None, "--precision", "-p", help="Override the config's precision: `bf16` for all, or `transformer=fp16,t5=bf16`."),
    static_shape: Optional[bool] = typer.Option(None, "--static-shape/--dynamic-shape", help="Pin the profile to the config's opt batch and resolution (default: the config's choice)."),
    force: bool = typer.Option(False, "--force", help="Rebuild every stage even if its inputs are unchanged."),
    calibration_size: int = typer.Option(32, "--calibration-size", help="fp8: prompts from the calibration file."),
    calibration_steps: int = typer.Option(4, "--calibration-steps", help="fp8: denoising steps per calibration prompt."),
    calibration_prompts: Optional[Path] = typer.Option(None, "--calibration-prompts", help="fp8: prompt file (default calibration/prompts.txt)."),
    smoothquant_alpha: float = typer.Option(0.5, "--smoothquant-alpha", help="int8 (W8A8): SmoothQuant migration strength, 0..1."),
    weightless: bool = typer.Option(False, "--weightless", help="Weight-stripped, refittable engines that `fluxtrt run --weights` fills from a checkpoint (needs a GPU on the build machine: TensorRT-RTX 1.7 refuses it on CPU)."),
    zero_copy: bool = typer.Option(True, "--zero-copy/--copy-weights", help="Build a component straight from its checkpoint when it is stored in the engine's dtype (bf16 FLUX.1 at bf16 or fp8: no fp32 copy, weights read one at a time); --copy-weights takes the fp32 path (graph passes, every recipe) for all."),
    validate: bool = typer.Option(True, "--validate/--no-validate", help="Compare every ONNX with PyTorch in ONNX Runtime (needs the fp32 model in memory: turn it off for full-size models on small machines)."),
):
    """Export, optimize (and quantize), then build serialized TensorRT engines for one GPU, reusing every
    unchanged stage. Each component also gets a weight map (<name>.weights.json: every engine weight's source
    tensors in the checkpoint) and a weight-free ONNX, so engines and ONNX can take the user's own weights."""
    _quiet_libraries()
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from .build.backends import get_backend
    from .build.pipeline import build_gpu
    from .components import specs_for
    from .gpus import load_gpu
    from .models.source import resolve_model

    cfg = load_gpu(gpu, config)
    get_backend(cfg.backend).check_target(cfg.compute_capability)  # fail before any work
    names = _split(components)
    cfg = cfg.with_precision(_precision_overrides(precision, names)) if precision else cfg
    source = resolve_model(model)
    with Progress(SpinnerColumn(), TextColumn("{task.description:<12}"), TextColumn("{task.fields[phase]}"),
                  TimeElapsedColumn(), console=console) as bar:
        tasks = {n: bar.add_task(n, phase="waiting") for n in specs_for(source.geometry, names)}
        manifest, results = build_gpu(source, cfg, out_dir, names, static_shape, force,
                                      progress=lambda n, p: bar.update(tasks[n], phase=p),
                                      calibration={"size": calibration_size, "steps": calibration_steps,
                                                   "prompts_file": calibration_prompts, "alpha": smoothquant_alpha},
                                      weightless=weightless, zero_copy=zero_copy, validate=validate)
    table = Table(title=f"{cfg.key}: {manifest['backend']} {manifest['backend_version']} for "
                        f"sm{cfg.compute_capability.replace('.', '')}, model {source.id} ({source.variant}) -> {out_dir / cfg.key}")
    for col in ("component", "precision", "export", "optimize", "quantize", "build", "layers", "engine size",
                "seconds", "bytes written", "peak RSS"):
        table.add_column(col)
    by = {(r.component, r.stage): r for r in results}
    for name in tasks:
        e = manifest["components"][name]
        stages = [by[(name, s)] for s in ("export", "optimize", "quantize", "build") if (name, s) in by]
        cells = {r.stage: f"{r.status} {r.seconds:.1f}s" if r.status == "built" else r.status for r in stages}
        table.add_row(name, e["precision"], *(cells.get(s, "-") for s in ("export", "optimize", "quantize", "build")),
                      str(e["layers"]), _human(e["bytes"]),
                      f"{sum(r.seconds for r in stages):.1f}", _human(sum(r.bytes_written for r in stages)),
                      f"{max(r.peak_rss_mb for r in stages):.0f} MB")
    out.print(table)
    if all(r.status in ("reused", "skipped") for r in results):
        out.print("Nothing to do: every engine is up to date (use --force to rebuild).")
    out.print(f"manifest: {out_dir / cfg.key / 'manifest.json'}; log: {out_dir / cfg.key / 'build.log'}")


@app.command()
@friendly
def calibrate(
    model: str = typer.Option("tiny", "--model", "-m", help=MODEL_HELP),
    out_dir: Path = typer.Option(Path("engines"), "--out", "-o", help="Output root (the cache goes to OUT/calibration/)."),
    recipe: str = typer.Option("fp8", "--recipe", help="Recipe to calibrate for (fp8; weight-only recipes need none)."),
    size: int = typer.Option(32, "--calibration-size", help="Prompts used from the file."),
    steps: int = typer.Option(4, "--calibration-steps", help="Denoising steps per prompt."),
    prompts: Optional[Path] = typer.Option(None, "--calibration-prompts", help="Prompt file (default calibration/prompts.txt)."),
    resolution: int = typer.Option(1024, "--resolution", help="The profile's opt size; a smaller non-square size is added."),
    zero_copy: bool = typer.Option(True, "--zero-copy/--copy-weights", help="As for build: calibrate for the engine built straight from a bf16 checkpoint (ranges per linear layer, measured in PyTorch), or for the fp32 path."),
    device: Optional[str] = typer.Option(None, "--device", help="zero-copy path: where PyTorch runs the pipeline, cpu or cuda (default: cuda if present). A cache made on a GPU serves builds on CPU-only machines: copy OUT/calibration/."),
):
    """Run calibration alone: run diffusers' pipeline over the prompts, measure activation ranges, and cache them
    (a later `fluxtrt build --precision transformer=fp8` reuses the cache)."""
    _quiet_libraries()
    from .build.native import calibrate_native, native_refusal
    from .build.pipeline import calibrate_graph, optimized_fp32_transformer
    from .models.source import resolve_model
    from .quantize.qdq import CALIBRATED

    if recipe not in CALIBRATED:
        raise FluxtrtError(f"only {', '.join(CALIBRATED)} need calibration (activation ranges); "
                           f"'{recipe}' is weight-only or unknown")
    if size < 1 or steps < 1:
        raise FluxtrtError("--calibration-size and --calibration-steps must be at least 1")
    if device not in (None, "cpu", "cuda"):
        raise FluxtrtError(f"--device {device}: choose cpu or cuda")
    source = resolve_model(model)
    calib = {"prompts_file": prompts, "size": size, "steps": steps, "opt_resolution": resolution, "device": device}
    if zero_copy and native_refusal(source, "transformer", recipe) is None:
        with console.status("calibrating (PyTorch, max |input| of every linear layer over the prompts)...") as st:
            cal = calibrate_native(source, out_dir, calib, lambda d, n: st.update(f"calibrating: {d}/{n} prompts"))
    else:
        graph = optimized_fp32_transformer(source, out_dir)
        with console.status("calibrating (running the reference pipeline over the prompts)..."):
            cal = calibrate_graph(source, graph, recipe, out_dir, calib)
    state = "reused the cache" if cal.cached else f"measured {cal.samples} transformer calls"
    out.print(f"{recipe} calibration for {source.id}: {len(cal.amax)} activation ranges, {state} -> {cal.path}")


@app.command()
@friendly
def artifacts(
    gpus: str = typer.Option("4090", "--gpus", help="GPU targets, comma-separated (TensorRT-RTX ones build here, GPU or not)."),
    model: str = typer.Option("tiny", "--model", "-m", help=MODEL_HELP),
    engines: Path = typer.Option(Path("engines"), "--engines", help="Build root (engines are built or reused there)."),
    out_dir: Path = typer.Option(Path("dist"), "--out", "-o", help="Folder for the archives and their .sha256 files."),
    precision: Optional[list[str]] = typer.Option(None, "--precision", "-p", help="As for build."),
):
    """Build engines for each GPU target and pack each target into one archive with a sha256 file."""
    _quiet_libraries()
    from .artifacts import pack
    from .build.pipeline import build_gpu
    from .gpus import load_gpu
    from .models.source import resolve_model

    targets = [g.strip() for g in gpus.split(",") if g.strip()]
    configs = [load_gpu(g) for g in targets]  # all names checked before any work
    source = resolve_model(model)
    for cfg in configs:
        cfg = cfg.with_precision(_precision_overrides(precision, None)) if precision else cfg
        with console.status(f"building {cfg.key} ({cfg.sm})..."):
            build_gpu(source, cfg, engines)
        archive, sha = pack(engines / cfg.key, out_dir)
        out.print(f"{cfg.key}: {archive} ({_human(archive.stat().st_size)}), {sha.name}")


@app.command()
@friendly
def unpack(
    archive: Path = typer.Argument(..., help="An archive made by `fluxtrt artifacts` (its .sha256 file beside it)."),
    out_dir: Path = typer.Option(Path("engines"), "--out", "-o", help="Where the GPU folder is placed."),
    sha256: Optional[Path] = typer.Option(None, "--sha256", help="The checksum file, if not ARCHIVE.sha256."),
):
    """Verify an engine archive's checksum and extract it safely (plain files only, no paths out)."""
    from .artifacts import unpack as do_unpack

    folder = do_unpack(archive, out_dir, sha256)
    out.print(f"verified and unpacked {archive.name} -> {folder} (run: fluxtrt run --engines {folder} --prompt ...)")


@app.command()
@friendly
def inspect(engine_dir: Path = typer.Argument(..., help="A folder written by `fluxtrt build` (OUT/<gpu>).")):
    """Print an engine folder's manifest and, with TensorRT-RTX, whether this machine can run its engines."""
    from rich.table import Table

    from .build.backends import get_backend
    from .build.manifest import read_manifest
    from .errors import BackendUnavailableError

    m = read_manifest(engine_dir)
    out.print(f"[bold]{m['gpu_name']}[/] ({m['gpu']}, sm{m['compute_capability'].replace('.', '')}) built by "
              f"{m['backend']} {m['backend_version']}, fluxtrt {m['fluxtrt']}; model {m['model']['id']} "
              f"({m['model']['variant']}, {m['model']['hash'][:12]}); shapes {m['shape_range']}")
    backend = get_backend(m["backend"])
    table = Table()
    for col in ("component", "precision", "size", "layers", "inputs (min..max)", "this machine"):
        table.add_column(col)
    for name, e in m["components"].items():
        prof = ", ".join(f"{k} {v['min']}..{v['max']}" for k, v in e["profile"].items())
        try:
            validity = backend.runtime_validity(Path(engine_dir) / e["engine"]) or "unknown"
        except BackendUnavailableError as err:
            validity = f"cannot check: {err}"
        table.add_row(name, e["precision"], _human(e["bytes"]), str(e["layers"]), prof, validity)
    out.print(table)


def _read_prompts(prompt: Optional[str], prompts_file: Optional[Path]) -> list[str]:
    from .errors import FluxtrtError

    if (prompt is None) == (prompts_file is None):
        raise FluxtrtError("pass exactly one of --prompt TEXT or --prompts-file FILE")
    if prompts_file is not None:
        try:
            text = Path(prompts_file).read_bytes().decode("utf-8")
        except OSError as e:
            raise FluxtrtError(f"cannot read {prompts_file}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise FluxtrtError(f"{prompts_file} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
        prompts = [line.strip() for line in text.splitlines() if line.strip()]
        if not prompts:
            raise FluxtrtError(f"{prompts_file} has no prompts (one per line)")
        return prompts
    if not prompt.strip():
        raise FluxtrtError("the prompt is empty; describe the image with --prompt TEXT")
    return [prompt]


def _pick_backend(backend: str, engines: Optional[Path]) -> tuple[str, list[str]]:
    """(backend, components that fall back to PyTorch). `auto`: the TensorRT executor where this GPU can run
    the engines; else PyTorch on a CUDA GPU (e.g. TensorRT-RTX on Hopper); else ONNX Runtime. Components the
    manifest lacks fall back to PyTorch. Each choice is said once."""
    from .build.manifest import read_manifest
    from .runtime.pipeline import RUN_COMPONENTS

    if engines is None:
        return "torch", []
    manifest = read_manifest(engines)
    missing = [c for c in RUN_COMPONENTS if c not in manifest["components"]]
    if missing:
        console.print(f"[yellow]note:[/] no engine for {', '.join(missing)}: running PyTorch for it", highlight=False)
    if backend != "auto":
        return backend, missing
    from .build.backends import get_backend, local_gpu_capabilities
    from .errors import FluxtrtError
    from .runtime.executors import check_gpu_for

    try:
        check_gpu_for(manifest, get_backend(manifest["backend"]))
    except FluxtrtError as e:
        if local_gpu_capabilities():
            console.print(f"[yellow]note:[/] running the PyTorch modules on this GPU instead ({e})", highlight=False)
            return "torch", missing
        console.print(f"[yellow]note:[/] using ONNX Runtime on the engines' source ONNX ({e})", highlight=False)
        return "onnxruntime", missing
    too_big = engines_that_do_not_fit(manifest, missing)
    if too_big:
        console.print(f"[yellow]note:[/] {', '.join(too_big)} engine(s) do not fit the free GPU memory and were "
                      "not built with weight streaming: running them with PyTorch on the CPU", highlight=False)
    return "tensorrt", missing + [f"{c}@cpu" for c in too_big]


def engines_that_do_not_fit(manifest: dict, skip=()) -> list[str]:
    """Components whose engine is larger than the GPU's free memory (weight-streaming engines excepted)."""
    import torch

    free = torch.cuda.mem_get_info()[0]
    return [c for c, e in manifest["components"].items()
            if c not in skip and c != "vae_encoder" and not e.get("weight_streaming") and e["bytes"] > free]


@app.command()
@friendly
def run(
    prompt: Optional[str] = typer.Option(None, "--prompt", help="What to draw."),
    prompts_file: Optional[Path] = typer.Option(None, "--prompts-file", help="UTF-8 file, one prompt per line."),
    engines: Optional[Path] = typer.Option(None, "--engines", "-e", help="Folder written by `fluxtrt build` (OUT/<gpu>)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="With --backend torch and no --engines: " + MODEL_HELP),
    backend: str = typer.Option("auto", "--backend", help="tensorrt (engines on an NVIDIA GPU), onnxruntime (the ONNX they were built from), torch (the PyTorch modules), or auto."),
    fallback: Optional[list[str]] = typer.Option(None, "--fallback", help="Components to run in PyTorch instead, e.g. t5,transformer."),
    torch_dtype: str = typer.Option("bf16", "--torch-dtype", help="dtype of PyTorch components: bf16, fp16, fp32."),
    compile: bool = typer.Option(False, "--compile", help="torch.compile the PyTorch components."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Denoising steps (default: 28 dev, 4 schnell)."),
    guidance: float = typer.Option(3.5, "--guidance", help="Distilled guidance scale (dev only; ignored by schnell)."),
    height: Optional[int] = typer.Option(None, "--height", help="Pixels, a multiple of 16 (default: the profile's opt)."),
    width: Optional[int] = typer.Option(None, "--width", help="Pixels, a multiple of 16 (default: the profile's opt)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the CPU generator (same seed, same image as diffusers)."),
    batch: int = typer.Option(1, "--batch", help="Images per call; one prompt is repeated, a prompts file is chunked."),
    out_path: Path = typer.Option(Path("fluxtrt.png"), "--out", "-o", help="PNG path; several images get -0, -1, ... suffixes."),
    low_vram: bool = typer.Option(False, "--low-vram", help="Load and free engines stage by stage."),
    weight_streaming_budget: Optional[int] = typer.Option(None, "--weight-streaming-budget", help="MB of transformer weights kept on the GPU (engines built with weight streaming)."),
    cuda_graph: bool = typer.Option(False, "--cuda-graph", help="Capture the transformer step as a CUDA graph (TensorRT-RTX's whole-graph strategy)."),
    allow_host_code: bool = typer.Option(False, "--allow-host-code", help="Let engines with embedded host code load (only for engines you trust)."),
    weights: Optional[Path] = typer.Option(None, "--weights", help="Your FLUX.1 folder (diffusers layout, safetensors): weights come from it through the build's weight map (weightless engines are refitted; ONNX Runtime fills the weight-free ONNX)."),
    lora: Optional[Path] = typer.Option(None, "--lora", help="A transformer LoRA (diffusers/peft safetensors) merged into --weights as they load: no rebuild."),
    lora_scale: float = typer.Option(1.0, "--lora-scale", help="Strength of --lora."),
):
    """Generate images from built engines (diffusers' FluxPipeline semantics, seed for seed)."""
    _quiet_libraries()
    import logging

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from .build.manifest import read_manifest
    from .errors import FluxtrtError
    from .runtime.pipeline import FluxEngines

    prompts = _read_prompts(prompt, prompts_file)
    if batch < 1:
        raise FluxtrtError(f"--batch must be at least 1, got {batch}")
    if seed < 0 or seed >= 2**63:
        raise FluxtrtError(f"--seed must be in 0..2^63-1, got {seed}")
    if out_path.suffix.lower() != ".png":
        raise FluxtrtError(f"--out must end in .png, got {out_path}")
    if engines is None and model is None:
        engines = Path("engines/4090")
    source = None
    if engines is None:
        from .models.source import resolve_model

        source = resolve_model(model)
        variant, opt = source.variant, [1, 1024, 1024]
    else:
        manifest = read_manifest(engines)
        variant, opt = manifest["model"]["variant"], manifest["shape_range"]["opt"]
    height, width = height or opt[1], width or opt[2]
    steps = steps if steps is not None else (28 if variant == "dev" else 4)
    chosen, missing = _pick_backend(backend, engines)
    logging.getLogger("fluxtrt").addHandler(_WarningLine())
    pipe = FluxEngines(engines, chosen, low_vram, weight_streaming_budget and weight_streaming_budget << 20, cuda_graph,
                       model=source, fallback=sorted(set(_split(fallback) or []) | set(missing)),
                       torch_dtype=torch_dtype, compile=compile, allow_host_code=allow_host_code, weights=weights,
                       lora=lora, lora_scale=lora_scale)
    chunks = [prompts[i:i + batch] for i in range(0, len(prompts), batch)] if len(prompts) > 1 else [prompts * batch]
    pipe.check_request(max(len(c) for c in chunks), height, width, steps)  # fail before any work
    paths, all_timings = [], []
    many = sum(len(c) for c in chunks) > 1
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as bar:
        task = bar.add_task(f"{chosen} {height}x{width}, {len(chunks)} call(s) x {steps} steps",
                            total=len(chunks) * steps)
        for k, chunk in enumerate(chunks):
            res = pipe.generate(chunk, height, width, steps, guidance, seed + k, on_step=lambda i: bar.advance(task))
            for j, img in enumerate(res.images):
                idx = sum(len(c) for c in chunks[:k]) + j
                dest = out_path.with_name(f"{out_path.stem}-{idx}{out_path.suffix}") if many else out_path
                _save_png(img, dest)
                paths.append(dest)
            all_timings.append(res.timings)
    table = Table(title="timings (seconds)")
    for col in ("call", "text encoders", "step mean", "step min", "step max", "VAE decode", "total", "peak GPU GB"):
        table.add_column(col)
    for k, t in enumerate(all_timings):
        st = t.steps or [0.0]
        mem = f"{t.peak_memory_gb:.2f}" if t.peak_memory_gb is not None else "-"
        table.add_row(str(k), f"{t.text_encoders:.3f}", f"{sum(st) / len(st):.3f}", f"{min(st):.3f}", f"{max(st):.3f}",
                      f"{t.vae:.3f}", f"{t.total:.3f}", mem)
    out.print(table)
    for p in paths:
        out.print(f"wrote {p}")


@app.command()
@friendly
def bench(
    engines: Optional[Path] = typer.Option(None, "--engines", "-e", help="Folder written by `fluxtrt build`."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="With --backend torch: " + MODEL_HELP + " Also random:flux.1-dev / random:flux.1-schnell (full size, random weights)."),
    backend: str = typer.Option("auto", "--backend", help="tensorrt, onnxruntime, torch or auto (as for run)."),
    sizes: str = typer.Option("512", "--sizes", help="Square image sizes in pixels, comma-separated."),
    batches: str = typer.Option("1", "--batch", help="Batch sizes, comma-separated."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Denoising steps (default: 28 dev, 4 schnell)."),
    runs: int = typer.Option(3, "--runs", help="Measured runs per row (median and spread)."),
    warmup: int = typer.Option(1, "--warmup", help="Unmeasured runs first."),
    baseline: str = typer.Option("none", "--baseline", help="diffusers: also run diffusers' FluxPipeline in this process and print ratios; none."),
    torch_dtype: str = typer.Option("bf16", "--torch-dtype", help="dtype for PyTorch components and the diffusers baseline on a GPU (CPU: fp32)."),
    compile: bool = typer.Option(False, "--compile", help="torch.compile our PyTorch transformer and the baseline's, alike."),
    cuda_graph: bool = typer.Option(False, "--cuda-graph", help="CUDA-graph the transformer step (torch on GPU; TensorRT-RTX's strategy)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the table as JSON."),
    plot_out: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG chart (needs matplotlib)."),
):
    """Measure latency per component, seconds per image and peak memory, optionally against diffusers."""
    _quiet_libraries()
    import json

    import torch
    from rich.table import Table

    from . import __version__
    from .bench import add_ratios, bench_diffusers, bench_fluxtrt, plot, to_json
    from .errors import FluxtrtError
    from .fileio import write_json_atomic
    from .models.source import resolve_model
    from .runtime.pipeline import FluxEngines

    try:
        size_list = [int(v) for v in sizes.split(",") if v.strip()]
        batch_list = [int(v) for v in batches.split(",") if v.strip()]
    except ValueError:
        raise FluxtrtError(f"--sizes and --batch take comma-separated integers, got {sizes!r} / {batches!r}") from None
    if runs < 1 or warmup < 0:
        raise FluxtrtError("--runs must be at least 1 and --warmup at least 0")
    if baseline not in ("diffusers", "none"):
        raise FluxtrtError(f"--baseline is diffusers or none, got {baseline!r}")
    if plot_out is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise FluxtrtError("--plot needs matplotlib: pip install matplotlib") from None
    if engines is None and model is None:
        raise FluxtrtError("pass --engines DIR, or --backend torch --model MODEL")
    source = resolve_model(model) if engines is None else None
    chosen, missing = _pick_backend(backend, engines)
    pipe = FluxEngines(engines, chosen, model=source, fallback=missing, torch_dtype=torch_dtype,
                       compile=compile, cuda_graph=cuda_graph)
    variant = pipe.geo.variant
    steps = steps if steps is not None else (28 if variant == "dev" else 4)
    label = f"fluxtrt ({chosen})"
    dpipe = None
    if baseline == "diffusers":
        src = source or resolve_model(pipe.manifest["model"]["id"])
        on_gpu = pipe.device.type == "cuda"
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[torch_dtype] if on_gpu else torch.float32
        dpipe = src.load_pipeline(dt, pipe.device.type)
        dpipe.set_progress_bar_config(disable=True)
        if compile:
            dpipe.transformer = torch.compile(dpipe.transformer, fullgraph=False, dynamic=False)
    rows = []
    for size in size_list:
        for b in batch_list:
            console.print(f"measuring {label} {size}x{size} batch {b}, {steps} steps ...", highlight=False)
            ours = bench_fluxtrt(pipe, label, size, size, b, steps, runs, warmup)
            rows.append(ours)
            if dpipe is not None:
                console.print(f"measuring diffusers {size}x{size} batch {b} ...", highlight=False)
                base = bench_diffusers(dpipe, pipe.geo, size, size, b, steps, runs, warmup, pipe.device)
                add_ratios(ours, base)
                rows.append(base)
    table = Table(title=f"fluxtrt bench: {pipe.geo.variant}, {steps} steps, {runs} runs (median \\[min-max])")
    for col in ("system", "size", "batch", "text enc s", "step s", "VAE s", "end-to-end s", "s/image", "img/min",
                "outside transformer", "peak GB", "speedup vs diffusers"):
        table.add_column(col)

    def fmt(m):
        return f"{m.median:.3f} [{m.min:.3f}-{m.max:.3f}]"

    for r in rows:
        speed = f"{r.ratios['end_to_end_s']:.2f}x (step {r.ratios['transformer_step_s']:.2f}x)" if r.ratios else ""
        table.add_row(r.system, f"{r.width}x{r.height}", str(r.batch), fmt(r.text_encoders_s), fmt(r.transformer_step_s),
                      fmt(r.vae_decode_s), fmt(r.end_to_end_s), f"{r.seconds_per_image:.3f}", f"{r.images_per_minute:.1f}",
                      f"{100 * r.outside_transformer_share:.1f}%", "-" if r.peak_memory_gb is None else f"{r.peak_memory_gb:.1f}",
                      speed)
    out.print(table)
    meta = {"fluxtrt": __version__, "torch": torch.__version__, "device": torch.cuda.get_device_name() if
            pipe.device.type == "cuda" else "cpu", "backend": chosen, "steps": steps, "runs": runs, "warmup": warmup,
            "compile": compile, "cuda_graph": cuda_graph, "torch_dtype": torch_dtype,
            "model": source.id if source else pipe.manifest["model"]["id"], "date": time.strftime("%Y-%m-%d")}
    if json_out is not None:
        write_json_atomic(json_out, to_json(rows, meta))
        out.print(f"wrote {json_out}")
    if plot_out is not None:
        plot(rows, plot_out)
        out.print(f"wrote {plot_out}")
    del json


class _WarningLine:
    """Route the runtime's warnings (e.g. prompt truncation) to one yellow line each."""

    level = 30

    def handle(self, record):
        console.print(f"[yellow]warning:[/] {record.getMessage()}", highlight=False)

    def __getattr__(self, name):  # the logging module probes a few attributes
        import logging

        return getattr(logging.Handler(), name)


def _save_png(image, dest: Path) -> None:
    import os
    import tempfile

    from PIL import Image

    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".png", dir=dest.parent)
    os.close(fd)
    try:
        Image.fromarray(image).save(tmp, format="PNG")
        from .fileio import _umask_mode

        os.chmod(tmp, _umask_mode())
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@app.command()
@friendly
def optimize(
    in_dir: Path = typer.Option(..., "--in", help="Folder written by `fluxtrt export` (fp32)."),
    out_dir: Path = typer.Option(..., "--out", help="Folder for the optimized ONNX files."),
    passes: Optional[list[str]] = typer.Option(None, "--passes", help="Passes, comma-separated (default: cleanup, fold_constants, infer_shapes, fuse_projections, fuse_rmsnorm, fuse_gelu_tanh, cleanup)."),
    dtype: str = typer.Option("fp32", "--dtype", help="Precision placement: fp32, fp16 or bf16 (norms, softmax, outputs stay fp32)."),
    components: Optional[list[str]] = typer.Option(None, "--components", "-c", help=COMPONENTS_HELP),
):
    """Run graph passes and precision placement; print node counts per pass and TensorRT layers before/after."""
    _quiet_libraries()
    import json

    from rich.table import Table

    from .components import specs_for
    from .errors import FluxtrtError
    from .models.source import resolve_model
    from .optimize.pipeline import check_passes, optimize_file
    from .validate import bound_for, compare_onnx

    info_path = in_dir / "export.json"
    if not info_path.exists():
        raise FluxtrtError(f"{in_dir} has no export.json; export first with `fluxtrt export --out {in_dir}`")
    info = json.loads(info_path.read_text())
    if info.get("dtype") != "fp32":
        raise FluxtrtError(f"optimize takes an fp32 export (its precision placement casts); {in_dir} is {info.get('dtype')}")
    pass_names = check_passes(_split(passes))
    geo = resolve_model(info["model"]).geometry
    names = _split(components) or list(info["components"])
    for name, spec in specs_for(geo, names).items():
        src = in_dir / info["components"][name]["file"]
        rep = optimize_file(src, out_dir / src.name, name, pass_names, dtype)
        check = compare_onnx(src, rep.path, spec, geo, bound_for(name, dtype, 1e-5))
        if not check.ok:
            raise FluxtrtError(f"optimized {name} disagrees with the export: " + "; ".join(check.failures()))
        table = Table(title=f"{name}: TensorRT layers {rep.trt_layers_before} -> {rep.trt_layers_after}; "
                            f"max rel err vs export {check.max_rel_err:.1e}")
        for col in ("pass", "nodes before", "nodes after", "seconds"):
            table.add_column(col)
        for p, before, after, sec in rep.rows:
            table.add_row(p, str(before), str(after), f"{sec:.2f}")
        out.print(table)
    out.print(f"wrote {out_dir}")


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def run_cli():  # entry point
    try:
        app()
    except BrokenPipeError:
        sys.exit(1)


if __name__ == "__main__":
    run_cli()
