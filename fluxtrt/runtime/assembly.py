"""Opening a pipeline: the one place an engines folder (TensorRT plans, their ONNX, `.pt2` packages) or a model's
PyTorch modules become executors. `open_pipeline(engines, options)` chooses the backend (runtime/choice.py), reads
the assets (tokenizers and configs beside the engines, or the model folder), builds an executor per component of
the kind its engine is (TensorRTExecutor, OnnxRuntimeExecutor, PackageExecutor, or TorchExecutor where there is
no engine or the user asked for PyTorch) and hands them to runtime/pipeline.Pipeline, which runs the loop."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from .. import flux_math as fm
from ..components import TRANSFORMER_PARTS, Geometry, family, specs_for
from ..errors import FluxtrtError
from ..records import IMAGE_COMPONENTS, RUN_COMPONENTS, ManifestError, built_onnx, is_number, read_manifest
from .executors import LoadProbe, OnnxRuntimeExecutor, PackageExecutor, TorchExecutor, WeightSource, check_gpu_for
from .options import FIELDS, PipelineOptions
from .tensorrt import SharedActivations, TensorRTExecutor

log = logging.getLogger("fluxtrt")
ASSETS = "model"  # tokenizers and config files copied beside the engines at build time


def open_pipeline(engines=None, options: PipelineOptions | None = None, **fields):
    """The pipeline over `engines` (an engines folder; None: `model` in PyTorch) with `options` (or its fields as
    keywords; both: the keywords replace those fields). The backend `auto` picks, PyTorch for what the engines
    lack; what the options do not do on it is in `pipe.notes`.
    Raises FluxtrtError / ManifestError / BackendUnavailableError (one line) for what cannot run here."""
    from .choice import choose_backend, known_ort_provider, ort_provider
    from .pipeline import Pipeline

    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise FluxtrtError(f"unknown option {', '.join(unknown)}; a pipeline takes {', '.join(FIELDS)}")
    options = dataclasses.replace(options or PipelineOptions(), **fields)
    if engines is not None:
        options = dataclasses.replace(options, engines=engines)
    options = options.check()
    if options.engines is None and options.model is None:
        raise FluxtrtError("pass --engines DIR (built by `fluxtrt build`), or --backend torch with --model")
    if options.engines is None and isinstance(options.model, (str, Path)):
        from ..models.source import resolve_model

        options = dataclasses.replace(options, model=resolve_model(options.model))
    choice = choose_backend(options.backend, options.engines, options.fallback)
    if choice.backend == "onnxruntime":
        provider = ort_provider(options.ort_provider)
        choice.notes.append(f"ONNX Runtime runs on the {provider.upper()} execution provider")
    else:
        provider = "cpu"
        if known_ort_provider(options.ort_provider) != "auto":
            choice.notes.append(f"--ort-provider has no effect with the {choice.backend} backend")
    choice.notes += options.notes(choice.backend, provider)
    fallback = tuple(sorted(set(options.fallback) | set(choice.fallback)))
    try:
        assembly = Assembly(dataclasses.replace(options, fallback=fallback), choice.backend, provider)
        return Pipeline(assembly, options, choice.notes)
    except BaseException:
        from . import parallel

        parallel.stop()  # the followers a split pipeline started, if it got so far
        raise


class Assembly:
    """The assets and executors of one pipeline (the executor factory: one kind per engine file)."""

    def __init__(self, options, backend: str, ort_provider: str = "cpu"):
        """Every executor these options ask for (`backend`: what runtime/choice.py chose; the options' fallback
        includes what it added)."""
        o = options
        engine_dir, model, fallback, device, torch_dtype = o.engines, o.model, o.fallback, o.device, o.torch_dtype
        compile, calibration = o.compile, o.calibration
        budget = o.weight_streaming_budget << 20 if o.weight_streaming_budget is not None else None
        self.low_vram, self.backend = o.low_vram, backend
        self.context = None  # context parallelism: this process's rank (runtime/parallel.py)
        if o.parallel > 1 and backend != "torch":
            raise FluxtrtError("--parallel splits the PyTorch transformer: add --backend torch (engines, ONNX and "
                               "compiled packages run it whole)")
        self.executors: dict = {}
        self.manifest = self.dir = None
        self._open_assets(engine_dir, model)
        from .lora import read_loras

        self.loras = read_loras(o.lora)  # each file read and checked once, before any weights load
        # compiled PyTorch engines (.pt2 packages; choose_backend runs them on torch), PyTorch modules for what they lack
        packages = self.manifest is not None and self.manifest.backend == "torch"
        # the VAE encoder (image workflows) runs where it was built, or in PyTorch with the rest
        everything = RUN_COMPONENTS + IMAGE_COMPONENTS
        modules = backend == "torch" and not packages  # every component a PyTorch module
        names = [n for n in everything if modules or n in RUN_COMPONENTS or n in self.manifest.components
                 or any(f.split("@")[0] == n for f in fallback)]
        # "name@cpu" runs that component's PyTorch module on the CPU (an engine that does not fit the GPU)
        torch_names = {f.split("@")[0] for f in fallback}
        torch_names |= set(names) if modules else {n for n in names if packages and n not in self.manifest.components}
        unknown = torch_names - set(everything)
        if unknown:
            raise FluxtrtError(f"--fallback takes {', '.join(everything)}; got {', '.join(sorted(unknown))}")
        if torch_names:
            on_cpu = {f.split("@")[0] for f in fallback if f.endswith("@cpu")}
            self._torch_executors(sorted(torch_names), on_cpu, model, device, torch_dtype, compile=compile,
                                  calibration=calibration)
        elif calibration is not None:
            raise FluxtrtError("--calibration gives the PyTorch transformer the fp8 recipe: add --backend torch")
        engine_names = [n for n in names if n not in torch_names]
        missing = self.manifest.missing(engine_names) if engine_names else []
        if missing:
            raise self.manifest.lacking(missing, self.dir)
        if "transformer" in engine_names:  # First-Block Cache's parts, where the build made them
            engine_names += [p for p in TRANSFORMER_PARTS if p in self.manifest.components]
        if "transformer" in engine_names:
            self._check_split(engine_names, o, packages)
        self.options, self.ort_provider, self.budget = o, ort_provider, budget
        if engine_names and packages:
            made = self._package_executors(engine_names, device, self.loras)
            self.executors.update(made)
            if not self.low_vram:  # every package stays loaded: read their weights now, in the order they run
                for ex in made.values():
                    ex.prefetch()
        elif engine_names:
            self.executors.update(self._engine_executors(engine_names, o.lora))
        if o.parallel > 1:  # last: nothing above may refuse once the followers run
            from . import parallel

            if parallel.current() is None:  # the leader: start the followers, each opens these options too
                parallel.start(o, open_pipeline)
            self.context = parallel.current()
            for name in [n for n in engine_names if family(n) == "transformer"] or ["transformer"]:
                self.executors[name].context = self.context

    def _open_assets(self, engine_dir, model) -> None:
        """Tokenizers and configs: copied beside the engines at build time, or the model folder (torch only)."""
        if engine_dir is not None:
            self.dir = Path(engine_dir)
            self.manifest = read_manifest(self.dir)
            assets = self.dir / ASSETS
            if not (assets / "tokenizer").is_dir():
                raise ManifestError(f"{assets} lacks the tokenizers copied at build time; rebuild with `fluxtrt build`")
        else:  # a model's PyTorch modules (open_pipeline and choose_backend refused anything else)
            assets = model.path
        self.assets = assets
        self.geo = Geometry.from_folder(assets)
        if self.manifest is not None:
            from ..models.source import check_model_ref

            check_model_ref(self.manifest.model, self.geo, self.manifest.workflows)
        self.scheduler_config = _json(assets / "scheduler" / "scheduler_config.json")
        vae = _json(assets / "vae" / "config.json")
        try:
            fm.check_scheduler_config(self.scheduler_config)
            self.scaling_factor, self.shift_factor = vae["scaling_factor"], vae.get("shift_factor") or 0.0
            if not all(is_number(v) and abs(v) < 1e3 for v in (self.scaling_factor, self.shift_factor)):
                raise ValueError("the VAE's scaling_factor / shift_factor are not finite numbers")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ManifestError(f"the configs in {assets} are not a FLUX.1 model's ({e}); rebuild with `fluxtrt "
                                "build`") from None

    def _torch_executors(self, names, on_cpu, model, device, torch_dtype, *, compile, calibration=None) -> None:
        import torch

        if model is None:
            from ..models.source import resolve_model

            model = resolve_model(self.manifest.model.id)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        specs = specs_for(self.geo, names)
        for name in names:
            dev_name = "cpu" if name in on_cpu else device
            dtype = "fp32" if dev_name == "cpu" and name in on_cpu else torch_dtype
            recipe = self._fp8_recipe(model, calibration) if name == "transformer" else None
            self.executors[name] = TorchExecutor(name, model, specs[name], dev_name, dtype, compile=compile, fp8=recipe,
                                                 loras=self.loras if name == "transformer" else ())

    def _fp8_recipe(self, model, calibration: Path | None) -> dict | None:
        """The transformer's fp8 recipe for PyTorch: the scales the engines' fp8 graph recorded, or a calibration
        (`fluxtrt calibrate`) applied to the model's weights; None for other precisions."""
        from .. import fp8

        entry = self.manifest.components.get("transformer") if self.manifest is not None else None
        if entry is not None and entry.precision == "fp4":
            raise FluxtrtError("the PyTorch transformer runs the fp8 and fp8-attn recipes but not fp4 (NVFP4 tensor "
                               "cores, sm100/sm120): use --backend onnxruntime or TensorRT engines")
        if entry is not None and entry.precision in ("fp8", "fp8-attn"):
            if calibration is not None:
                raise FluxtrtError(f"--calibration: these engines' {entry.precision} graph already holds its scales; "
                                   "drop it")
            attention = entry.precision == "fp8-attn"
            if entry.recipe is not None and (entry.recipe.get("attention") or not attention):
                # recorded by the build: an unpacked archive has them too
                return {"scales": fp8.scales_from_record(entry.recipe), "attention": entry.recipe.get("attention")}
            from ..onnxio import load_header

            path = built_onnx(self.dir, entry)
            if not path.is_file():
                raise ManifestError(f"the {entry.precision} transformer's ONNX {path} is not here (an unpacked archive "
                                    "of a build that recorded no scales in its manifest): build it again with this "
                                    "fluxtrt")
            header = load_header(path)
            return {"scales": fp8.scales_from_graph(header),
                    "attention": fp8.attention_scales_from_graph(header) if attention else None}
        if calibration is not None:
            return fp8.read_calibration(calibration, model.content_hash)
        return None

    def _engine_executors(self, names, refs) -> dict:
        """TensorRT or ONNX Runtime executors of `names` (choose_backend named one of them), with the LoRAs `refs`
        merged into the checkpoint's weights as they load."""
        sources = self._weight_sources(names, self.options.weights, refs)
        if self.backend == "tensorrt":
            return self._tensorrt_executors(names, sources)
        return self._onnxruntime_executors(names, sources)

    def with_loras(self, refs) -> dict:
        """The transformer's engine or package executors (its First-Block Cache parts' too) with the LoRAs `refs`
        merged: a server's per-request LoRAs on engines (runtime/lora.EngineAdapters)."""
        names = [n for n in self.executors if family(n) == "transformer"]
        if self.manifest.backend == "torch":  # compiled packages: merged into their weights files' tensors
            from .lora import read_loras

            return self._package_executors(names, self.options.device, read_loras(refs))
        return self._engine_executors(names, refs)

    def _weight_sources(self, engine_names, weights, refs) -> dict:
        """name -> WeightSource (or None): the user's checkpoint through the build's weight maps, LoRAs merged
        where the transformer runs from engines or ONNX (a PyTorch transformer takes them itself)."""
        weight_source = self._weight_source(weights) if weights is not None and engine_names else None
        lora = None
        if refs and "transformer" in engine_names:
            from .lora import Lora

            if weight_source is None:
                raise FluxtrtError("--lora on engines or ONNX needs --weights (your checkpoint, which the LoRA is "
                                   "merged into), or run the transformer in PyTorch (--backend torch)")
            lora = Lora(refs)
        return {n: WeightSource.for_component(weight_source, self.dir, self.manifest.component(n), n, lora)
                for n in engine_names}

    def _tensorrt_executors(self, names, sources) -> dict:
        from ..core.backends import get_backend

        o, made = self.options, {}
        trt_backend = get_backend(self.manifest.backend)
        _ = trt_backend.trt  # clear error if the package is missing
        check_gpu_for(self.manifest, trt_backend)
        shared = SharedActivations()
        for name in names:
            e = self.manifest.component(name)
            if sources[name] is not None and not e.weightless:
                raise FluxtrtError(f"{name}: these engines carry their weights and are not refittable; --weights "
                                   "works with engines built with `fluxtrt build --weightless`, or with --backend "
                                   "onnxruntime")
            made[name] = TensorRTExecutor(
                name, e, self.dir / e.engine, trt_backend, None, shared_memory=shared, weight_streaming_budget=self.budget,
                cuda_graph=o.cuda_graph and name == "transformer", allow_host_code=o.allow_host_code,
                weights=sources[name], kernel_specialization=o.kernel_specialization, low_vram=self.low_vram)
        return made

    def _check_split(self, names, o, packages: bool) -> None:
        """The transformer's engines against --parallel: packages compiled split over N ranks (`build --parallel
        N`) run with --parallel N and their compiled attention mode; whole ones, engines and ONNX, with none."""
        from ..attention import ATTENTION, MAX_RANKS

        build = (f"`fluxtrt build --backend torch --static-shape --parallel {o.parallel}`" if o.parallel > 1
                 else "`fluxtrt build --backend torch` (no --parallel)")
        if not packages:
            if o.parallel > 1:
                raise FluxtrtError("--parallel splits the PyTorch transformer: add --backend torch (engines and ONNX "
                                   f"run it whole), or compile split packages with {build}")
            return
        for name in [n for n in names if family(n) == "transformer"]:
            split = self.manifest.component(name).parallel
            if split is not None and not (isinstance(split, dict) and type(split.get("ranks")) is int
                                          and 2 <= split["ranks"] <= MAX_RANKS
                                          and split.get("attention") in ATTENTION[1:]):  # a mode, not "auto"
                raise ManifestError(f"{self.dir}/manifest.json: {name}'s parallel record is damaged; build the "
                                    "packages again with `fluxtrt build --backend torch --parallel N`")
            ranks = split["ranks"] if split else 1
            if ranks != o.parallel:
                have = f"compiled split over {ranks} ranks" if ranks > 1 else "compiled to run whole"
                fix = f"run them with --parallel {ranks}" if ranks > 1 else "run them without --parallel"
                what = f"packages for {o.parallel} ranks" if o.parallel > 1 else "whole packages"
                raise FluxtrtError(f"--parallel {o.parallel}: the {self.dir.name} packages' {name} is {have}; {fix}, "
                                   f"or compile {what} with {build}")
            if split and o.parallel_attention not in ("auto", split["attention"]):
                raise FluxtrtError(f"--parallel-attention {o.parallel_attention}: the {self.dir.name} packages compiled "
                                   f"{split['attention']} attention in; drop --parallel-attention, or build with "
                                   f"`--parallel-attention {o.parallel_attention}`")

    def _package_executors(self, names, device, loras) -> dict:
        """PackageExecutors of `names`, the transformer's (and its parts') with `loras` merged as they load."""
        from ..core.packages import run_device

        specs = specs_for(self.geo, names)
        entries = {name: self.manifest.component(name) for name in names}
        probe = None if (device or run_device(self.manifest.runtime)) == "cpu" else LoadProbe(
            {name: (self.dir / e.engine, e.sha256) for name, e in entries.items()}, device or "cuda")
        family_names = [n for n in names if family(n) == "transformer"]
        if loras and family_names:  # every LoRA layer in one of the transformer's weights files, now
            from ..checkpoint import read_header
            from ..fileio import inside
            from .lora import check_package_targets

            keys = set()
            for n in family_names:
                if entries[n].constants:
                    keys |= set(read_header(inside(self.dir, entries[n].constants["file"], f"{n}.constants")))
            check_package_targets(keys, loras, f"the {self.dir.name} packages")
        return {name: PackageExecutor(name, e, self.dir / e.engine, specs[name], runtime=self.manifest.runtime,
                                      device=device, probe=probe, loras=loras if name in family_names else ())
                for name, e in entries.items()}

    def _onnxruntime_executors(self, names, sources) -> dict:
        specs, made = specs_for(self.geo, names), {}
        for name in names:
            e, ws = self.manifest.component(name), sources[name]
            onnx_path = self.dir / e.weightfree_onnx if ws is not None else built_onnx(self.dir, e)
            if ws is None and not onnx_path.exists() and e.weightfree_onnx and (self.dir / e.weightfree_onnx).exists():
                raise ManifestError(f"{name}: this engine folder has no ONNX of its build machine (an unpacked "
                                    "archive?); ONNX Runtime runs its weight-free ONNX with your checkpoint: "
                                    "--backend onnxruntime --weights YOUR_FLUX_FOLDER")
            made[name] = OnnxRuntimeExecutor(name, e, onnx_path, specs[name], self.geo, provider=self.ort_provider,
                                             weights=ws)
        return made

    def _weight_source(self, weights: Path):
        """The user's checkpoint folder, checked against what the engines were built for."""
        from ..models.source import resolve_model

        src = resolve_model(weights)
        if src.random_weights:
            raise FluxtrtError(f"--weights {weights}: an architecture-only model has no weights to read")
        if src.variant != self.manifest.model.variant:
            raise FluxtrtError(f"--weights {weights} is FLUX.1-{src.variant}, the engines were built for "
                               f"FLUX.1-{self.manifest.model.variant}; pass a matching checkpoint")
        return src



def _json(path: Path) -> dict:
    from ..fileio import read_json

    return read_json(path, "a model config", "rebuild with `fluxtrt build`", ManifestError)
