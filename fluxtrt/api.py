"""fluxtrt from Python: one function per CLI command, taking the same options and returning typed results that
the CLI only renders. Every policy the commands apply (which components go zero-copy, which backend runs, how
`-p fp8` spreads over components, which calibration runs) lives here or below, tested without the CLI.

    from fluxtrt import api
    built = api.build(gpu="4090", model="tiny", out_dir="engines", precision=["fp8"])
    done = api.generate(["a red fox in the snow"], engines=built.gpu_dir, steps=4, height=512, width=512,
                        out="fox.png")
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

from .core.limits import MAX_CACHE_THRESHOLD, MAX_GUIDANCE, MAX_SIDE, MAX_STEPS, check_number
from .errors import FluxtrtError
from .records import BuildRequest, CalibrationSettings, Manifest
from .runtime.options import PipelineOptions


def split_list(values, unique: bool = True) -> list[str]:
    """Repeated and comma-separated option values as one list (`-c clip,t5 -c vae_decoder`).

    Args: values: the option's values (None: none); unique: refuse a value given twice (a typo or a
        contradiction; False where repeats mean something: graph passes).
    Returns: the values in order. Raises: FluxtrtError naming a repeated value."""
    out = [v.strip() for item in (values or []) for v in str(item).split(",") if v.strip()]
    twice = sorted({v for v in out if out.count(v) > 1}) if unique else []
    if twice:
        raise FluxtrtError(f"{', '.join(twice)} given twice in one option; list each value once")
    return out


MIN_OPSET, MAX_OPSET = 18, 22  # torch's ONNX exporter writes opset 18 and up; TensorRT parses up to 22


# -- export ---------------------------------------------------------------------------------------------------
@dataclass
class ExportSummary:
    source: object  # ModelSource
    out_dir: Path
    results: list  # export.ExportResult per component
    copied: list = field(default_factory=list)  # why a component asked zero-copy had its weights copied
    zero_copy: bool = False


def export(model: str, out_dir: Path, components=None, dtype: str = "fp32", opset: int = 19, *, validate: bool = True,
           zero_copy: bool = False, progress: Callable[[str, str], None] | None = None) -> ExportSummary:
    """`fluxtrt export`: standard ONNX (weights in the file or `<name>.onnx.data`) that any ONNX tool opens.

    Args:
        model: a FLUX.1 folder, `tiny...` or `random:...`; out_dir: where the ONNX goes; components: names (all
        five by default); dtype: fp32 / fp16 / bf16; opset: 18..22; validate: compare each graph with PyTorch;
        zero_copy: link the weights into the checkpoint's safetensors where they are stored in `dtype` (only
        fluxtrt and TensorRT's parser read such files; the other components are copied, with the reason);
        progress: (component, phase) callback.
    Returns: ExportSummary (source, out_dir, per-component results, what was copied and why).
    Raises: FluxtrtError (one line) for a bad model, option or output folder, or a graph that disagrees."""
    from .components import specs_for
    from .dtypes import check_float
    from .export import write_export_info, zero_copy_refusal
    from .fileio import check_out_folder
    from .models.source import resolve_model
    from .stages.base import export_step, run_step

    check_float(dtype)
    check_number("--opset", opset, MIN_OPSET, MAX_OPSET)
    check_out_folder(Path(out_dir))
    source = resolve_model(model)
    names = split_list(components) or None
    specs = specs_for(source.geometry, names)
    linked, copied = frozenset(), []
    if zero_copy:
        refusals = {n: zero_copy_refusal(source, s, dtype) for n, s in specs.items()}
        linked = frozenset(n for n, why in refusals.items() if why is None)
        copied = [why for why in refusals.values() if why is not None]
    results: list = []  # each component through the stage runner (export, validate), as a build exports it
    for name in specs:
        on_phase = (lambda p, n=name: progress(n, p)) if progress else (lambda _: None)
        step = export_step(source, name, Path(out_dir), dtype, zero_copy=name in linked, on_phase=on_phase, opset=opset,
                           exported=results)
        run_step(source, name, step, force=True, on_phase=on_phase, validate=validate)
        if progress:
            progress(name, "done")
    stored = {r.dtype for r in results}  # zero-copy keeps each component's stored dtype
    write_export_info(Path(out_dir), source, stored.pop() if len(stored) == 1 else dtype, opset, results,
                      zero_copy=all(r.zero_copy for r in results))
    return ExportSummary(source, Path(out_dir), results, copied, bool(linked))


# -- build ----------------------------------------------------------------------------------------------------
@dataclass
class BuildSummary:
    config: object  # gpus.GpuConfig (with -p applied)
    source: object
    out_dir: Path
    manifest: Manifest
    results: list  # stages.base.StageResult
    notes: list = field(default_factory=list)

    @property
    def gpu_dir(self) -> Path:
        return self.out_dir / self.config.key

    @property
    def up_to_date(self) -> bool:
        return all(r.status in ("reused", "skipped") for r in self.results)


def resolve_target(gpu: str | None, config: Path | None, precision=None, components=None, backend: str | None = None):
    """The build target with `-p` applied.

    Args: gpu: a shipped config's name, or config: a GPU config file (one of the two); precision: `-p` values;
        components: the components asked for (`-p fp8` spreads over those that have the recipe); backend: None (the
        config's) or another (`torch`: compiled PyTorch packages for that GPU, in `<gpu>-torch/`).
    Returns: (GpuConfig, notes). A precision other than the config's gets its own folder (`4090-fp8`), so a
        build with `-p` never replaces the engines of another precision.
    Raises: ConfigError / FluxtrtError for an unknown GPU, both or neither given, a precision the target lacks."""
    import dataclasses

    from .gpus import load_gpu
    from .precisions import apply_overrides
    from .stages.build import check_target

    if gpu and config is not None:
        raise FluxtrtError("pass --gpu or --config, not both (--config FILE is a custom GPU config)")
    cfg = load_gpu(gpu, config).for_backend(backend)
    check_target(cfg)  # fail before any work
    notes: list[str] = []
    if precision:
        merged, notes = apply_overrides(cfg.precision, split_list(precision), split_list(components) or None)
        changed = {c: p for c, p in merged.items() if cfg.precision.get(c) != p}
        if changed:
            kinds = sorted(set(changed.values()))
            tag = kinds[0] if len(kinds) == 1 else "-".join(f"{c}-{p}" for c, p in sorted(changed.items()))
            notes.append(f"engines of these precisions go to {cfg.key}-{tag}/; {cfg.key}/ keeps the config's")
            cfg = dataclasses.replace(cfg.with_precision(changed), key=f"{cfg.key}-{tag}")
    return cfg, notes


def build(request: BuildRequest | None = None, *, progress: Callable[[str, str], None] = lambda c, p: None,
          **fields) -> BuildSummary:
    """`fluxtrt build`: export, optimize (and quantize), then build every requested engine for one GPU.

    Args: request: a records.BuildRequest, or **fields its fields (gpu / config: the target, see resolve_target;
        model: the checkpoint, default `tiny`, said in the notes; out_dir: the build root; components, precision:
        the CLI's -c / -p; static_shape; force; calibration: CalibrationSettings; weightless; zero_copy; validate;
        first_block_cache; backend: None or `torch`, compiled PyTorch packages; parallel, parallel_attention: those
        packages' transformer split over ranks, `run --parallel N`); progress: (component, phase) callback.
    Returns: BuildSummary (config, source, manifest, stage results, notes; gpu_dir, up_to_date).
    Raises: FluxtrtError (one line) for bad input; a failed build says what it kept for the next one."""
    import dataclasses

    from .models.source import resolve_model
    from .stages.build import build_gpu

    req = request or BuildRequest.of(**fields)
    cfg, notes = resolve_target(req.gpu, req.config, list(req.precision), list(req.components), req.backend)
    if req.model is None:
        notes.append("no --model given: built the embedded random-weight `tiny` model (its images are noise)")
    source = resolve_model(req.model or "tiny")
    if source.embedded and cfg.backend != "torch":  # compiled packages carry their weights
        notes.append(f"the embedded model {source.id} is a diffusers folder at {source.path}: pass it to `run --weights` "
                     "(or make a LoRA for it) to try your own weights on these engines")
    req = dataclasses.replace(req, components=tuple(split_list(list(req.components))),
                              calibration=req.calibration.check())
    if req.parallel != 1:  # packages split over ranks: their own folder, `<gpu>[-torch]-parallelN/`
        from .stages.package import check_parallel

        check_parallel(req, cfg)
        cfg = dataclasses.replace(cfg, key=f"{cfg.key}-parallel{req.parallel}")
    manifest, results = build_gpu(source, cfg, req, progress=progress)
    return BuildSummary(config=cfg, source=source, out_dir=req.out_dir, manifest=manifest, results=results, notes=notes)


class CalibrationSummary(NamedTuple):
    source: object  # ModelSource
    calibration: object  # quantize.calibration.Calibration: amax, path, key, cached, samples
    graph: object = None  # the copying path's graph ranges (an fp32 checkpoint's build reuses them), or None


def calibrate(model: str, out_dir: Path, recipe: str = "fp8", settings: CalibrationSettings | None = None,
              zero_copy: bool = True, *, on_prompt: Callable[[int, int], None] = lambda d, n: None) -> CalibrationSummary:
    """`fluxtrt calibrate`: activation ranges for `recipe`, cached in OUT/calibration/ where a later build (and
    `run --calibration`) finds them.

    Args: model; out_dir: the build root; recipe: a calibrated recipe (fp8, fp8-attn, int8, fp4); settings:
        CalibrationSettings; zero_copy: from a bf16 checkpoint, ranges per nn.Linear measured in PyTorch
        (fp8-attn: and per attention, for `run --backend torch --calibration`; else ranges of the optimized fp32
        graph measured in ONNX Runtime, which an fp8-attn build reads); on_prompt: (done, total) callback.
    Returns: CalibrationSummary (source, calibration, graph): `calibration` is the file `run --backend torch
        --calibration` takes (fp8: ranges by module, whatever the checkpoint's dtype); for a checkpoint the zero-copy
        plan refuses (e.g. stored in fp32), `graph` holds the graph's ranges the build reuses.
    Raises: FluxtrtError for a weight-only or unknown recipe, a bad model, output folder or prompts file."""
    from .models.source import resolve_model
    from .precisions import CALIBRATED
    from .stages.fp32_plan import calibrate_graph, optimized_fp32_transformer
    from .stages.zerocopy_plan import calibrate_zero_copy, zero_copy_plan_refusal

    if recipe not in CALIBRATED:
        raise FluxtrtError(f"only {', '.join(CALIBRATED)} need calibration (activation ranges); "
                           f"'{recipe}' is weight-only or unknown")
    from .fileio import check_out_folder

    settings = (settings or CalibrationSettings()).check()
    check_out_folder(Path(out_dir))
    source = resolve_model(model)
    if zero_copy and recipe == "fp8-attn":  # what `run --backend torch --calibration` computes it from
        return CalibrationSummary(source, calibrate_zero_copy(source, Path(out_dir), settings, on_prompt, recipe))
    if zero_copy and zero_copy_plan_refusal(source, "transformer", recipe) is None:
        return CalibrationSummary(source, calibrate_zero_copy(source, Path(out_dir), settings, on_prompt))
    graph = optimized_fp32_transformer(source, Path(out_dir))
    graph_ranges = calibrate_graph(source, graph, recipe, Path(out_dir), settings)
    if recipe != "fp8":  # the PyTorch transformer computes fp8 alone: no module ranges for the others
        return CalibrationSummary(source, graph_ranges)
    # the PyTorch path (`run --backend torch --calibration`) reads ranges by module, measured in PyTorch
    return CalibrationSummary(source, calibrate_zero_copy(source, Path(out_dir), settings, on_prompt), graph_ranges)


class Optimized(NamedTuple):
    component: str
    report: object  # optimize.graph.OptimizeReport
    check: object  # compare.Check against the export


def optimize(in_dir: Path, out_dir: Path, passes=None, dtype: str = "fp32", components=None) -> list[Optimized]:
    """`fluxtrt optimize`: graph passes and precision placement on an fp32 export.

    Args: in_dir: an fp32 `fluxtrt export` folder; out_dir: another folder; passes: names (default: the build's);
        dtype: fp32 / fp16 / bf16 placement; components: names (default: the export's).
    Returns: [Optimized(component, report, check)], each checked against the export.
    Raises: FluxtrtError for a folder that is not an fp32 export, --out equal to --in, an unknown pass, or an
        optimized graph that disagrees with the export."""
    from .compare import bound_for, compare_onnx
    from .components import specs_for
    from .fileio import check_out_folder, sha256_file
    from .models.source import resolve_model
    from .onnxio import load_header
    from .optimize.graph import check_passes, optimize_file
    from .records import StageInfo

    check_out_folder(Path(out_dir))
    if Path(out_dir).resolve() == Path(in_dir).resolve():
        raise FluxtrtError(f"--out {out_dir} is the --in folder: optimizing would replace the export; pass another --out")
    info = StageInfo.read(Path(in_dir) / "export.json")
    if not info.components:
        raise FluxtrtError(f"{in_dir} has no export.json of this fluxtrt; export first with `fluxtrt export --out "
                           f"{in_dir}`")
    dtype_in = info.header.get("dtype")
    if dtype_in != "fp32":
        raise FluxtrtError(f"optimize takes an fp32 export (its precision placement casts); {in_dir} is {dtype_in}")
    pass_names = check_passes(split_list(passes, unique=False) or None)
    geo = resolve_model(info.header["model"]).geometry
    specs = specs_for(geo, split_list(components) or list(info.components))
    for name in specs:  # every input checked before anything is written
        if name not in info.components:
            raise FluxtrtError(f"{in_dir} holds no {name} export (it has {', '.join(info.components)}); export it "
                               f"with `fluxtrt export -c {name} --out {in_dir}`")
        src = Path(in_dir) / info.components[name].file
        if not src.is_file() or sha256_file(src) != info.components[name].sha256:
            raise FluxtrtError(f"{src} is not the ONNX that export.json records (missing, truncated or edited); export "
                               f"again with `fluxtrt export --out {in_dir}` (nothing was written)")
        load_header(src)
    out = []
    for name, spec in specs.items():
        src = Path(in_dir) / info.components[name].file
        rep = optimize_file(src, Path(out_dir) / src.name, name, pass_names, dtype)
        check = compare_onnx(src, rep.path, spec, geo, bound_for(name, dtype, 1e-5))
        if not check.ok:
            raise FluxtrtError(f"optimized {name} disagrees with the export: " + "; ".join(check.failures()))
        out.append((name, rep, check))
    return out


# -- run ------------------------------------------------------------------------------------------------------
MAX_PROMPTS_BYTES = 16 << 20  # a prompts file of more is not prompts (e.g. /dev/zero or a model file)


@dataclass
class Generated:
    paths: list
    timings: list  # runtime.pipeline.Timings per call
    backend: str
    notes: list = field(default_factory=list)


def read_prompts(prompt: str | None, prompts_file: Path | None) -> list[str]:
    """The prompts of `--prompt` or `--prompts-file` (exactly one).

    Args: prompt: one prompt; prompts_file: UTF-8, one prompt per line (at most 16 MB, a regular file).
    Returns: the prompts. Raises: FluxtrtError for both or neither, or an unreadable, empty or oversized file."""
    if (prompt is None) == (prompts_file is None):
        raise FluxtrtError("pass exactly one of --prompt TEXT or --prompts-file FILE")
    if prompts_file is not None:
        path = Path(prompts_file)
        if not path.exists():
            raise FluxtrtError(f"--prompts-file {prompts_file}: no such file; pass a UTF-8 file, one prompt per line")
        if not path.is_file() or path.stat().st_size > MAX_PROMPTS_BYTES:
            raise FluxtrtError(f"--prompts-file {prompts_file} is not a text file of at most "
                               f"{MAX_PROMPTS_BYTES >> 20} MB; pass one prompt per line")
        try:
            text = path.read_bytes().decode("utf-8")
        except OSError as e:
            raise FluxtrtError(f"cannot read {prompts_file}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise FluxtrtError(f"{prompts_file} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
        # a BOM (Windows editors write one) and CR line ends are the file's encoding, not the prompt's text
        lines = (line.replace("\ufeff", "").replace("\r", "").strip() for line in text.splitlines())
        prompts = [line for line in lines if line]
        if not prompts:
            raise FluxtrtError(f"{prompts_file} has no prompts (one per line)")
        return prompts
    if not prompt.strip():
        raise FluxtrtError("the prompt is empty; describe the image with --prompt TEXT")
    return [prompt]


@dataclass
class RunOptions:
    """What `fluxtrt run` takes besides the prompts: how the pipeline opens (`pipeline`: runtime.options.
    PipelineOptions) and the request's settings (defaults as the CLI's). `RunOptions.of(**flat)` takes both kinds
    of field by name."""

    pipeline: PipelineOptions = field(default_factory=PipelineOptions)
    steps: int | None = None
    guidance: float | None = None  # None: the workflow's default (diffusers')
    height: int | None = None
    width: int | None = None
    seed: int = 0
    batch: int = 1
    out: Path = Path("fluxtrt.png")
    negative_prompt: str | None = None  # true CFG (diffusers' negative_prompt / true_cfg_scale)
    true_cfg: float = 1.0
    image: Path | None = None  # the image workflows' inputs (core/workflows.py): img2img, Fill, Kontext
    mask: Path | None = None  # Fill
    control_image: Path | None = None  # Control (Canny / Depth)
    strength: float | None = None  # img2img / Fill
    max_area: int | None = None  # Kontext
    cache_threshold: float = 0.0  # First-Block Cache (stepcache.py): 0 off

    @classmethod
    def of(cls, **options) -> "RunOptions":
        """RunOptions from flat keywords: the pipeline's fields (PipelineOptions) and the request's."""
        from .runtime.options import FIELDS

        return cls(pipeline=PipelineOptions(**{k: v for k, v in options.items() if k in FIELDS}),
                   **{k: v for k, v in options.items() if k not in FIELDS})

    def inputs(self) -> dict:
        """The request's input files by flag (an output may replace none of them)."""
        from .runtime.lora import LoraRef

        loras = [LoraRef.parse(v).path for v in ((self.pipeline.lora,) if isinstance(self.pipeline.lora, (str, Path))
                                                 else self.pipeline.lora or ())]
        return {"--image": self.image, "--mask": self.mask, "--control-image": self.control_image,
                **{"--lora" + (f" #{i + 1}" if i else ""): path for i, path in enumerate(loras)}}

    def input_folders(self) -> dict:
        """The request's input folders by flag (no output is written inside them)."""
        return {"--engines": self.pipeline.engines, "--weights": self.pipeline.weights}

    def image_inputs(self):
        return image_inputs(self.image, self.mask, self.control_image, self.strength, self.max_area)

    def check(self) -> "RunOptions":
        import math

        for flag, value, lo, hi in (("--guidance", self.guidance, 0.0, MAX_GUIDANCE),
                                    ("--true-cfg", self.true_cfg, 1.0, MAX_GUIDANCE),
                                    ("--strength", self.strength, -math.inf, math.inf),  # (0, 1]: the workflow says
                                    ("--cache-threshold", self.cache_threshold, 0.0, MAX_CACHE_THRESHOLD),
                                    ("--height", self.height, 1, MAX_SIDE), ("--width", self.width, 1, MAX_SIDE),
                                    ("--max-area", self.max_area, 1, MAX_SIDE * MAX_SIDE)):
            check_number(flag, value, lo, hi)
        self.out = Path(self.out)
        self.pipeline = self.pipeline.check()
        if self.batch < 1:
            raise FluxtrtError(f"--batch must be at least 1, got {self.batch}")
        if self.seed < 0 or self.seed >= 2**63:
            raise FluxtrtError(f"--seed must be in 0..2^63-1, got {self.seed}")
        if self.steps is not None and self.steps < 1:  # --height / --width: check_number above
            raise FluxtrtError(f"--steps must be at least 1, got {self.steps}")
        if self.steps is not None and self.steps > MAX_STEPS:
            raise FluxtrtError(f"--steps {self.steps} is more than {MAX_STEPS}; FLUX.1-dev uses 28-50, schnell 4")
        if self.true_cfg < 1:
            raise FluxtrtError(f"--true-cfg is a scale of at least 1 (1: off), got {self.true_cfg}")
        if self.true_cfg > 1 and self.negative_prompt is None:
            raise FluxtrtError(f"--true-cfg {self.true_cfg} needs --negative-prompt TEXT (what to steer away from; "
                               "\"\" is allowed)")
        return self


def image_inputs(image=None, mask=None, control_image=None, strength=None, max_area=None):
    """A request's images, read now (an unreadable file fails before any work), and their settings.

    Args: image, mask, control_image: paths or None; strength (img2img / Fill), max_area (Kontext).
    Returns: workflows.ImageInputs. Raises: WorkflowError for an unreadable or oversized image."""
    from .core.image_inputs import load_image
    from .core.workflows import ImageInputs

    def read(value, flag):
        return None if value is None else load_image(value, flag)

    return ImageInputs(read(image, "--image"), read(mask, "--mask"), read(control_image, "--control-image"), strength,
                       max_area)


def generate(prompts: list[str], opts: RunOptions | None = None, on_step=None, say=lambda line: None,
             **options) -> Generated:
    """`fluxtrt run`: images for `prompts` (diffusers' FluxPipeline semantics, seed for seed) written as PNGs with
    their settings in text chunks. One prompt is repeated `batch` times; several are chunked by `batch`.

    Args: prompts; opts (or **options): RunOptions; on_step: (step index) callback; say: one line per note.
    Returns: Generated (paths, timings per call, backend, notes).
    Raises: FluxtrtError / RequestError (one line) for anything the engines or the options cannot do, before
        any image is written."""
    from .runtime.images import check_output_path

    opts = (opts or RunOptions.of(**options)).check()
    n_images = opts.batch if len(prompts) == 1 else len(prompts)
    for dest in _destinations(opts.out, n_images):  # before any work: a read-only folder fails now, not after
        check_output_path(dest, opts.inputs(), opts.input_folders())
    from .runtime.assembly import open_pipeline

    pipe = open_pipeline(options=opts.pipeline)
    try:
        done = _generate(pipe, prompts, opts, on_step, say)
    except BaseException:  # Ctrl-C or a failure may leave the followers inside a call: end them
        pipe.close(abort=True)
        raise
    pipe.close()  # the followers of a split transformer (--parallel) told to stop
    return done


def _generate(pipe, prompts: list[str], opts: RunOptions, on_step, say) -> Generated:
    from .runtime.images import save_png

    if opts.cache_threshold > 0 and opts.pipeline.cuda_graph:
        pipe.notes.append("--cuda-graph has no effect with --cache-threshold: the cache decides on the host every step")
    if opts.negative_prompt is not None and opts.true_cfg <= 1:
        pipe.notes.append("--negative-prompt has no effect without --true-cfg > 1 (as in diffusers' FluxPipeline)")
    for note in pipe.notes:
        say(note)
    opt = pipe.manifest.shape_range["opt"] if pipe.manifest is not None else [1, 1024, 1024]
    inputs = opts.image_inputs()
    wf, height, width, reference = pipe.plan(opts.height or opt[1], opts.width or opt[2], inputs)
    steps = opts.steps if opts.steps is not None else wf.default_steps(pipe.geo)
    guidance = opts.guidance if opts.guidance is not None else wf.guidance
    if opts.guidance is not None and not pipe.geo.guidance:
        say("--guidance has no effect: FLUX.1-schnell has no guidance input")
    chunks = ([prompts[i:i + opts.batch] for i in range(0, len(prompts), opts.batch)] if len(prompts) > 1
              else [prompts * opts.batch])
    pipe.check_request(max(len(c) for c in chunks), height, width, steps, reference)  # fail before any work
    dests, paths, timings = _destinations(opts.out, sum(len(c) for c in chunks)), [], []
    for k, chunk in enumerate(chunks):
        negatives = [opts.negative_prompt] * len(chunk) if opts.negative_prompt is not None else None
        res = pipe.generate(chunk, opts.height or opt[1], opts.width or opt[2], steps, guidance, seed=opts.seed + k,
                            on_step=on_step, negative_prompts=negatives, true_cfg=opts.true_cfg, inputs=inputs,
                            cache_threshold=opts.cache_threshold)
        for j, img in enumerate(res.images):
            idx = sum(len(c) for c in chunks[:k]) + j
            dest = dests[idx]
            meta = _png_metadata(pipe, chunk[j], opts.seed + k, steps, guidance, height=height, width=width,
                                 backend=pipe.backend_name)
            meta.update(_workflow_metadata(wf, opts))
            if opts.true_cfg > 1:
                meta.update(negative_prompt=opts.negative_prompt, true_cfg=opts.true_cfg)
            if res.timings.cache is not None:
                meta.update(cache_threshold=opts.cache_threshold, steps_computed=res.timings.cache["computed"],
                            steps_skipped=res.timings.cache["skipped"])
            save_png(img, dest, meta)
            paths.append(dest)
        timings.append(res.timings)
    for note in transformer_notes(pipe):
        say(note)
    return Generated(paths, timings, pipe.backend_name, pipe.notes)


def transformer_notes(pipe) -> list[str]:
    """How the PyTorch transformer computed the fp8 recipe (tensor cores or emulated) and took its LoRAs (merged,
    or beside the fp8 GEMMs), once it has run.

    Args: pipe: a Pipeline. Returns: one line each. Raises: nothing."""
    return [note for ex in pipe.executors.values() for note in (getattr(ex, "fp8_note", None),
                                                                getattr(ex, "lora_note", None),
                                                                getattr(ex, "parallel_note", None)) if note]


def _destinations(out: Path, n: int) -> list[Path]:
    """The PNG paths of n images: `out` itself for one, `out-0`, `out-1`, ... for several."""
    return [out] if n == 1 else [out.with_name(f"{out.stem}-{i}{out.suffix}") for i in range(n)]


def _workflow_metadata(wf, opts: RunOptions) -> dict:
    meta = {"workflow": wf.name}
    for flag in wf.flags:
        value = getattr(opts, flag[2:].replace("-", "_"))
        if flag == "--strength" and value is None:
            value = wf.strength
        if value is not None:
            meta[flag[2:]] = Path(value).name if isinstance(value, Path) else value
    return meta


def _png_metadata(pipe, prompt, seed, steps, guidance, *, height, width, backend) -> dict:
    meta = {"prompt": prompt, "seed": seed, "steps": steps, "guidance": guidance if pipe.geo.guidance else "n/a",
            "size": f"{width}x{height}", "backend": backend, "software": "fluxtrt"}
    if pipe.manifest is not None:
        meta["model"] = pipe.manifest.model.id
        meta["model_hash"] = pipe.manifest.model.hash[:12]
        meta["engines"] = ", ".join(f"{n}:{e.sha256[:12]}" for n, e in pipe.manifest.components.items())
    return meta


class BenchResult(NamedTuple):
    rows: list  # bench.Row: ours, and diffusers' with --baseline diffusers
    meta: dict  # versions, device, settings
    written: list  # the JSON / PNG paths written


def bench(engines: Path | None, model: str | None, backend: str, opts, say=lambda line: None,
          *, json_out: Path | None = None, plot_out: Path | None = None, calibration: Path | None = None) -> BenchResult:
    """`fluxtrt bench` (bench.py): latency per component, end to end, images per minute, peak memory.

    Args: engines, or model with backend "torch"; opts: bench.BenchOptions; say: one line per measurement;
        json_out / plot_out: also write the table as JSON / a PNG chart; calibration: the fp8 recipe (torch).
    Returns: BenchResult (rows, meta, written).
    Raises: FluxtrtError for bad options, an unwritable output, or what `fluxtrt run` would refuse."""
    from .bench import plot, run_bench, to_json
    from .fileio import write_json_atomic
    from .models.source import resolve_model
    from .runtime.assembly import open_pipeline

    opts.check()
    if plot_out is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise FluxtrtError("--plot needs matplotlib: pip install matplotlib") from None
    for flag, path in (("--json", json_out), ("--plot", plot_out)):
        if path is not None:
            from .runtime.images import check_writable

            check_writable(Path(path), flag=flag)
    if engines is None and model is None:
        raise FluxtrtError("pass --engines DIR, or --backend torch --model MODEL")
    source = resolve_model(model) if engines is None else None
    pipe = open_pipeline(engines, opts.pipeline, model=source, backend=backend, calibration=calibration)
    for note in pipe.notes:
        say(note)
    rows, meta = run_bench(pipe, source, pipe.backend_name, opts, say)
    meta["transformer"] = transformer_notes(pipe)
    if json_out is not None:
        write_json_atomic(Path(json_out), to_json(rows, meta))
    if plot_out is not None:
        plot(rows, Path(plot_out))
    return BenchResult(rows, meta, [p for p in (json_out, plot_out) if p is not None])


# -- engine folders -------------------------------------------------------------------------------------------
@dataclass
class EngineCheck:
    component: str
    entry: object  # records.ComponentEntry
    file: str  # "ok", or what is wrong with the file on disk (size, sha256, missing)
    runtime: str  # what the installed TensorRT says of it for this machine


class Inspection(NamedTuple):
    manifest: Manifest
    checks: list  # EngineCheck per component
    problems: list = []  # what makes the folder unusable beyond the files: a stopped build, a broken weight map


def inspect(engine_dir: Path) -> Inspection:
    """`fluxtrt inspect`: an engine folder's manifest and, per engine, whether the file on disk is the one it
    lists (size and sha256) and what the installed TensorRT runtime says of it for this machine.

    Args: engine_dir: a GPU folder written by `fluxtrt build` or `fluxtrt unpack`.
    Returns: Inspection (manifest, checks).
    Raises: ManifestError for a missing or malformed manifest (untrusted input, checked)."""
    from .core.backends import get_backend
    from .errors import BackendUnavailableError
    from .records import read_manifest
    from .runtime.executors import check_gpu_for

    m = read_manifest(engine_dir)
    if m.backend == "torch":
        return Inspection(m, _package_checks(engine_dir, m), _folder_problems(engine_dir, m))
    backend = get_backend(m.backend)
    try:
        check_gpu_for(m, backend)
        why_not = ""
    except BackendUnavailableError as err:
        why_not = str(err).split(";")[0]
    rows = []
    for name, e in m.components.items():
        path = Path(engine_dir) / e.engine
        state = _file_state(path, e.bytes, e.sha256)
        try:
            validity = backend.runtime_validity(path) or "unknown" if state == "ok" else "-"
        except BackendUnavailableError as err:
            validity = f"cannot check: {err}"
        if why_not and validity != "-" and not validity.startswith("VALID"):
            validity = f"{validity.split(' (')[0]}: {why_not}"
        rows.append(EngineCheck(name, e, state, validity))
    return Inspection(m, rows, _folder_problems(engine_dir, m))


def _file_state(path: Path, size: int, sha256: str, *, tree: bool = False) -> str:
    """An engine folder's file against its manifest (its sha256, or with `tree` its tree_sha256): ok, or what is
    wrong and the fix."""
    from .fileio import sha256_file, tree_sha256

    if not path.exists():
        return "MISSING"
    if path.stat().st_size != size:
        return f"WRONG SIZE ({path.stat().st_size} bytes, manifest {size}): rebuild or unpack again"
    if (tree_sha256 if tree else sha256_file)(path) != sha256:
        return "SHA256 MISMATCH (corrupt or replaced): rebuild or unpack again"
    return "ok"


def _package_checks(engine_dir: Path, m: Manifest) -> list:
    """Compiled PyTorch packages: each package and its weights file against the manifest, and whether this
    machine's torch, CUDA and device are the ones they were compiled for."""
    from .core.packages import run_device, runtime_problem
    from .fileio import inside

    rows = []
    for name, e in m.components.items():
        state = _file_state(Path(engine_dir) / e.engine, e.bytes, e.sha256)
        if state == "ok" and e.constants:
            weights = _file_state(inside(engine_dir, e.constants["file"], f"{name}.constants"), e.constants["bytes"],
                                  e.constants["tree_sha256"], tree=True)
            state = "ok" if weights == "ok" else f"weights {e.constants['file']}: {weights}"
        device = run_device(m.runtime)
        try:
            problem = runtime_problem(m.runtime or {}, device)
        except Exception as err:  # no CUDA device here for a GPU package
            problem = f"this machine cannot run {device} packages ({type(err).__name__})"
        rows.append(EngineCheck(name, e, state, f"CANNOT RUN: {problem}" if problem else "VALID (this torch and device)"))
    return rows


def _folder_problems(engine_dir: Path, m: Manifest) -> list:
    """What `inspect` finds wrong beside the engine files: components a stopped build never made, weight maps that
    do not read, a manifest whose model disagrees with the model assets beside it."""
    from .components import Geometry
    from .core.weightmap import read_map
    from .models.source import check_model_ref

    problems = []
    if m.pending:
        problems.append(f"incomplete: the build stopped before {', '.join(m.pending)}; run the same `fluxtrt build` "
                        "again to finish it")
    for name, e in m.components.items():
        if e.weight_map is not None:
            try:
                read_map(Path(engine_dir) / e.weight_map)
            except FluxtrtError as err:
                problems.append(f"{name}: {err}")
    try:
        check_model_ref(m.model, Geometry.from_folder(Path(engine_dir) / "model"), m.workflows)
    except FluxtrtError as err:
        problems.append(str(err))
    return problems


class Archive(NamedTuple):
    config: object  # gpus.GpuConfig
    archive: Path
    sha256_file: Path


def artifacts(gpus: str, model: str, engines: Path, out_dir: Path, precision=None, *,
              say=lambda line: None) -> list[Archive]:
    """`fluxtrt artifacts`: build (or reuse) each target's engines and pack each into a reproducible archive.

    Args: gpus: comma-separated targets; model; engines: the build root; out_dir: where archives go; precision:
        `-p` values; say: progress lines.
    Returns: [Archive(config, archive, sha256_file)].
    Raises: FluxtrtError for an unknown target or an unwritable folder (all checked before any work)."""
    from .artifacts import pack
    from .fileio import check_out_folder
    from .models.source import resolve_model
    from .runtime.images import check_writable
    from .stages.build import build_gpu

    check_out_folder(Path(out_dir))
    check_out_folder(Path(engines), "--engines")
    targets = split_list([gpus])
    configs = [resolve_target(g, None, precision)[0] for g in targets]  # all checked before any work
    check_writable(Path(out_dir) / "archive.tar.gz")
    check_writable(Path(engines) / "manifest.json")
    source = resolve_model(model)
    out = []
    for cfg in configs:
        say(f"building {cfg.key} ({cfg.sm})...")
        build_gpu(source, cfg, Path(engines))
        archive, sha = pack(Path(engines) / cfg.key, Path(out_dir))
        out.append(Archive(cfg, archive, sha))
    return out


def validate_engines(engines: Path, components=None, ort_provider: str = "auto", device: str | None = None,
                     model: str | None = None, *, json_out: Path | None = None, say=lambda line: None,
                     fp32: bool = False):
    """`fluxtrt validate` (validate.py): each component's ONNX in ONNX Runtime against its PyTorch module.

    Args: engines: a GPU folder whose build root holds the ONNX; components; ort_provider; device (torch's);
        model: the checkpoint (default: the manifest's); json_out: JSON lines written atomically; say: progress;
        fp32: bf16 graphs widened to fp32 against the fp32 module.
    Returns: [validate.Row] (error, reference, bound, whether it decides and passes).
    Raises: FluxtrtError for a bad folder, model or provider, or an unwritable --json."""
    from .fileio import write_bytes_atomic
    from .validate import cross_check

    if json_out is not None:
        from .runtime.images import check_writable

        check_writable(Path(json_out), flag="--json")
    rows = cross_check(engines, components, ort_provider, device, model, say=say, fp32=fp32)
    if json_out is not None:
        import json

        text = "".join(json.dumps(r.to_json()) + "\n" for r in rows)
        write_bytes_atomic(Path(json_out), text.encode(), check_free=False)
    return rows
