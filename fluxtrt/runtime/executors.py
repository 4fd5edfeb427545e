"""Executors: one component each, behind one small interface. The pipeline above them is identical.

    activate()          load (engine into device memory / ONNX Runtime session)
    infer(feeds)        {input name: torch tensor} -> {output name: torch tensor}, on the executor's device
    deactivate()        free it (used by --low-vram between stages)
    check_shapes(feeds) refuse shapes outside the engine's profile with the range in the message

TensorRTExecutor (runtime/tensorrt.py) runs engines (tensorrt or tensorrt_rtx) on an NVIDIA GPU;
OnnxRuntimeExecutor runs the very ONNX files the engines were built from (CPU, or CUDA with onnxruntime-gpu);
TorchExecutor runs the PyTorch modules."""

from __future__ import annotations

from pathlib import Path

from ..checkpoint import CheckpointReader
from ..dtypes import from_ort_type, onnx_enum, torch_dtype
from ..errors import (
    BackendUnavailableError,
    FluxtrtError,
    ShapeError,  # noqa: F401 - defined in errors.py, raised here
)
from ..records import ComponentEntry, ManifestError


class Executor:
    kind = ""

    def __init__(self, component: str, entry: ComponentEntry | None):
        self.component = component
        self.entry = entry  # the manifest entry: I/O names and dtypes, profile (None: a PyTorch module)
        self.active = False

    @property
    def device(self):
        import torch

        return torch.device("cpu")

    def check_shapes(self, shapes: dict[str, tuple]) -> None:
        for name, shape in shapes.items():
            prof = self.entry.profile.get(name) if self.entry is not None else None
            if prof is None:
                continue
            lo, hi = prof["min"], prof["max"]
            if len(shape) != len(lo) or any(not lo[i] <= shape[i] <= hi[i] for i in range(len(shape))):
                raise ShapeError(f"{self.component}: input {name} of shape {list(shape)} is outside the engine's "
                                 f"profile {lo}..{hi}; rebuild with a wider profile or ask for a size inside it")

    def io_dtype(self, name: str):
        """The torch dtype of this executor's input or output `name`, as its engine or ONNX declares it."""
        import torch

        from ..dtypes import torch_dtype_of_engine

        t = next((t for t in self.entry.inputs + self.entry.outputs if t["name"] == name), None)
        return torch_dtype_of_engine(t["dtype"]) if t is not None else torch.float32

    def activate(self) -> None:
        self.active = True

    def deactivate(self) -> None:
        self.active = False

    def infer(self, feeds: dict) -> dict:
        if not self.active:
            self.activate()
        return self.infer_impl(feeds)

    def infer_impl(self, feeds: dict) -> dict:
        raise NotImplementedError


class WeightSource:
    """Weights from the user's checkpoint instead of the engine/ONNX: the build's weight map applied to the
    checkpoint's safetensors (see weightmap.py)."""

    def __init__(self, component: str, folder: Path, weight_map: dict, lora=None, weightfree_onnx: Path | None = None):
        self.component, self.folder, self.weight_map, self.lora = component, Path(folder), weight_map, lora
        self.weightfree_onnx = weightfree_onnx

    @classmethod
    def for_component(cls, source, engine_dir: Path, entry: ComponentEntry, name: str, lora=None):
        from ..core import weightmap
        from ..fileio import inside

        if source is None:
            if entry.weightless:
                raise FluxtrtError(f"{name}: the engine carries no weights (built with --weightless); pass "
                                   "--weights YOUR_FLUX_FOLDER to fill them from your checkpoint")
            return None
        if not entry.weight_map:
            raise ManifestError(f"{name}: these engines have no weight map (built before fluxtrt recorded one); "
                                "rebuild with `fluxtrt build` to use --weights")
        wmap = weightmap.read_map(inside(engine_dir, entry.weight_map, f"{name}.weight_map"))
        if not wmap["refittable"]:
            raise FluxtrtError(f"{name} cannot take weights from a checkpoint: {wmap['reason']} "
                               f"(`fluxtrt build --model {source.path}`)")
        free = (inside(engine_dir, entry.weightfree_onnx, f"{name}.weightfree_onnx") if entry.weightfree_onnx
                else None)
        folder = inside(source.path, wmap["subfolder"], "the weight map's subfolder")
        from ..components import family

        return cls(name, folder, wmap, lora if family(name) == "transformer" else None, free)

    def graph_constants(self) -> dict:
        """The weight-free ONNX's own initializers (shape constants, epsilons, rotary tables): what a stripped
        engine may still ask for beyond the mapped weights."""
        from onnx import numpy_helper

        from ..onnxio import load_onnx

        if self.weightfree_onnx is None or not self.weightfree_onnx.exists():
            return {}
        mapped = {e["name"] for e in self.weight_map["weights"]}
        model = load_onnx(self.weightfree_onnx, skip=mapped)
        return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name not in mapped}

    def arrays(self) -> dict:
        from ..core import weightmap

        get = CheckpointReader(self.folder)
        if self.lora is None:
            return weightmap.materialize(self.weight_map, get)
        out = weightmap.materialize(self.weight_map, self.lora.wrap(get))
        self.lora.check_all_used(() if self.component == "transformer" else get.index)
        return out


# --ort-provider -> ONNX Runtime's execution providers, preferred first (CUDA also backs the TensorRT EP's gaps)
ORT_PROVIDERS = {
    "cpu": ("CPUExecutionProvider",),
    "cuda": ("CUDAExecutionProvider", "CPUExecutionProvider"),
    "tensorrt": ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"),
    "tensorrt-rtx": ("NvTensorRTRTXExecutionProvider", "CPUExecutionProvider"),
}


class OnnxRuntimeExecutor(Executor):
    """The ONNX an engine was built from, in ONNX Runtime. Inputs and outputs are bound to torch tensors on the
    executor's device (IOBinding: no numpy, any graph dtype, bf16 included), outputs preallocated from the
    component's spec. On a GPU provider the session runs on the pipeline's stream (`user_compute_stream`) and
    does not synchronise the host at the end of a run, so the denoising loop queues work like the other
    executors. TF32 is off (`use_tf32=0`): ONNX Runtime's CUDA default, unlike PyTorch's, would round fp32
    matmuls to 10-bit mantissas."""

    kind = "onnxruntime"

    def __init__(self, component: str, entry: ComponentEntry, onnx_path: Path, spec, geo, *, provider: str = "cpu",
                 weights: WeightSource | None = None, device_id: int = 0, widen: bool = False):
        super().__init__(component, entry)
        if provider not in ORT_PROVIDERS:
            raise FluxtrtError(f"ONNX Runtime provider {provider}: choose {', '.join(ORT_PROVIDERS)}")
        self.onnx_path, self.provider, self.device_id = Path(onnx_path), provider, device_id
        self.spec, self.geo = spec, geo  # the component's spec and the model's sizes: output shapes
        self.session = None
        self.weights = weights
        self.stream = None  # the pipeline's torch CUDA stream (GPU providers)
        self.widen = widen  # a bf16 graph computed in fp32 on every provider (core.sessions.runnable_session)

    @property
    def device(self):
        import torch

        return torch.device("cpu") if self.provider == "cpu" else torch.device("cuda", self.device_id)

    def providers(self) -> list:
        """ONNX Runtime's provider list for this executor, options included."""
        opts = {"device_id": str(self.device_id)}
        if self.stream is not None:
            opts.update(has_user_compute_stream="1", user_compute_stream=str(self.stream.cuda_stream))
        named = {"CUDAExecutionProvider": dict(opts, use_tf32="0"), "TensorrtExecutionProvider": opts,
                 "NvTensorRTRTXExecutionProvider": opts}
        return [(p, named[p]) if p in named else p for p in ORT_PROVIDERS[self.provider]]

    def activate(self) -> None:
        from ..core.sessions import runnable_session
        from ..fileio import sha256_file
        from ..onnxio import onnxruntime

        if not self.onnx_path.exists():
            raise ManifestError(f"{self.component}: the ONNX file {self.onnx_path} the engine was built from is gone; "
                                "rebuild with `fluxtrt build`")
        want = self.entry.weightfree_sha256 if self.weights is not None else self.entry.onnx_sha256
        if sha256_file(self.onnx_path) != want:
            raise ManifestError(f"{self.component}: {self.onnx_path} does not match the manifest's sha256; "
                                "rebuild with `fluxtrt build --force`")
        overrides = self.weights.arrays() if self.weights is not None else None
        self.session = runnable_session(self.onnx_path, self.providers(), overrides, self.widen)
        self.run_options = onnxruntime().RunOptions()
        # no cudaStreamSynchronize at the end of each run: the pipeline's stream orders the work
        self.run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        # name -> (torch dtype, ONNX type enum), looked up once: infer binds every call
        self.io = {i.name: (torch_dtype(d.name), onnx_enum(d)) for i in self.session.get_inputs()
                   + self.session.get_outputs() for d in [from_ort_type(i.type)]}
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.active = True

    def deactivate(self) -> None:
        self.session = None
        self.active = False

    def infer_impl(self, feeds: dict) -> dict:
        import contextlib

        import torch

        dev = self.device
        on_stream = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with on_stream:
            binding = self.session.io_binding()
            bound = {}  # the tensors ONNX Runtime reads and writes: alive until the run has been queued
            for name, t in feeds.items():
                dtype, onnx_type = self.io[name]
                bound[name] = t.to(dev, dtype, non_blocking=True).contiguous()
                binding.bind_input(name, dev.type, self.device_id, onnx_type, list(bound[name].shape),
                                   bound[name].data_ptr())
            outs = {}
            for name, shape in self.spec.output_shapes_for({n: tuple(t.shape) for n, t in feeds.items()},
                                                           self.geo).items():
                dtype, onnx_type = self.io[name]
                outs[name] = torch.empty(shape, dtype=dtype, device=dev)
                binding.bind_output(name, dev.type, self.device_id, onnx_type, list(shape), outs[name].data_ptr())
            self.session.run_with_iobinding(binding, self.run_options)
        if self.stream is not None:  # whoever reads the outputs next waits for this stream, on the device
            torch.cuda.current_stream().wait_stream(self.stream)
        return outs


def check_gpu_for(manifest, backend) -> None:
    """Refuse to run engines this GPU/driver/TensorRT cannot: no GPU, another compute capability, another
    TensorRT version."""
    from ..core.backends import local_gpu_capabilities

    caps = local_gpu_capabilities()
    if not caps:
        raise BackendUnavailableError("the tensorrt executor needs an NVIDIA GPU and this machine has none; "
                                      "run with --backend onnxruntime")
    cc = manifest.compute_capability
    if cc not in caps:
        raise BackendUnavailableError(
            f"these engines were built for sm{cc.replace('.', '')} ({manifest.gpu_name}) but this GPU is "
            f"{', '.join('sm' + c.replace('.', '') for c in caps)}; build for it with `fluxtrt build --gpu ...`")
    if backend.version != manifest.backend_version:
        raise BackendUnavailableError(
            f"these engines were built by {manifest.backend} {manifest.backend_version} but "
            f"{backend.version} is installed; rebuild, or install {manifest.backend}=={manifest.backend_version}")


def use_compile_cache() -> str:
    """Where torch.compile keeps what it compiled (Inductor's and Triton's on-disk caches): the user's
    TORCHINDUCTOR_CACHE_DIR, else fluxtrt's cache folder (FLUXTRT_CACHE, ~/.cache/fluxtrt), which outlives /tmp, so a
    later start reuses the kernels (fp8 at 1024² on the H200: first call 148 s cold, 37 s warm)."""
    import os

    from ..models.tiny import cache_root

    return os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))


class TorchExecutor(Executor):
    """A component's PyTorch module from the model folder on the pipeline's device (bf16 by default), the
    fallback where no engine can run (e.g. TensorRT-RTX on Hopper). Optionally torch.compile'd."""

    kind = "torch"

    def __init__(self, component: str, source, spec, device: str = "cuda", dtype: str = "bf16",
                 *, compile: bool = False, fp8=None, batch_buckets: tuple = (), loras=(), context=None):
        super().__init__(component, None)
        self.context = context  # runtime/parallel.Rank: this rank's slice of the tokens (context parallelism)
        self.source, self.spec, self.compile = source, spec, compile
        self.loras = list(loras)  # [(runtime/lora.LoraFile, scale)]: the transformer's LoRAs, stacked
        self.lora_note = None
        self.parallel_note = self.parallel_mode = None  # context parallelism: what attention does
        # a server's compiled transformer (batching.warm_up_batches sets them): batches padded to the smallest of
        # these that holds them, so the compiled module sees a few batch sizes, each compiled once
        self.batch_buckets = tuple(sorted(batch_buckets))
        # the transformer's fp8 recipe: {"scales": {module: (sx, sw)}} or {"amax": {module: amax}}; fp8-attn adds
        # "attention": [(sq, sk, sp, sv)] in forward order
        self.fp8 = fp8
        self.fp8_note = None
        self._device = device
        self.dtype_name = dtype
        self.module = None
        self._cpu_copy = None
        self._parts: dict = {}  # First-Block Cache's parts over the same module, made when first asked
        self.modulation = None  # runtime/modulation.ScheduleModulation: the transformer's, in `generate`

    @property
    def device(self):
        import torch

        return torch.device(self._device)

    @property
    def dtype(self):
        return torch_dtype(self.dtype_name)

    def io_dtype(self, name: str):
        return self.dtype  # a PyTorch module takes and gives its own dtype

    def activate(self) -> None:
        if self._cpu_copy is not None:  # --low-vram brought it back to the CPU: move, do not reload
            self.module = self._cpu_copy.to(self.device)
            self._cpu_copy = None
        else:
            from . import lora

            raw = self.source.load_component(self.spec.subfolder, self.dtype, self._device)
            plan = None
            if self.loras and self.fp8 is None:  # bf16/fp32: merged, nothing added to the step
                n = lora.merge_into(raw, self.loras)
                self.lora_note = f"LoRA merged into {n} linear layer{'s' if n != 1 else ''}"
            elif self.loras:  # fp8: the base stays quantized, the low-rank terms go beside its GEMMs
                plan = lora.side_path_plan(raw, self.loras)
            if self.fp8 is not None:
                self.fp8_note = self._quantize(raw)  # fuses q/k/v where it runs on tensor cores
            elif self.compile and self.device.type == "cuda":
                from ..fp8_layers import fuse_projections

                fuse_projections(raw)  # one GEMM per shared input, as the optimize stage fuses them
            if plan:
                hosts = lora.add_side_paths(raw, plan, self.dtype)
                self.lora_note = f"LoRA as low-rank terms beside {hosts} fp8 GEMMs ({len(plan)} linear layers)"
            if self.context is not None:  # attention over the whole sequence: Ulysses, or keys and values gathered
                from ..attention import context_parallel
                from .parallel import attention_mode, call_sizes

                mode = attention_mode(self.context.attention, raw.config.num_attention_heads, self.context.size)
                context_parallel(raw, self.context.group, mode, sizes=call_sizes)
                self.parallel_mode = mode
                self.parallel_note = f"the transformer split over {self.context.size} ranks ({mode} attention)"
            elif hasattr(raw, "time_text_embed"):  # every step's modulation computed before the loop
                from .modulation import ScheduleModulation

                self.modulation = ScheduleModulation(raw)
            self.module = self.spec.wrap(raw).eval()
        self._fn = self.module
        if self.compile:
            import torch

            use_compile_cache()
            self._fn = torch.compile(self.module, fullgraph=False, dynamic=False)
        self.active = True

    def serve_loras(self, bank) -> int:
        """Per-request LoRAs (runtime/lora.LoraBank) on this transformer: its layers get the bank's mixed low-rank
        terms, before anything is compiled. Returns the bank's slots."""
        if not self.active:
            self.activate()
        slots = bank.attach(self.module.model, self.dtype)
        self._parts = {}
        if self.compile:
            import torch

            self._fn = torch.compile(self.module, fullgraph=False, dynamic=False)
        return slots

    def schedule_rows(self, feeds: dict, timesteps):
        """The AdaLN modulation of every step of a generation (runtime/modulation.Rows), or None where this
        transformer computes it each call."""
        if not self.active:
            self.activate()
        if self.modulation is None:
            return None
        batch = feeds["pooled_projections"].shape[0]
        padded = next((b for b in self.batch_buckets if b >= batch), batch)
        return self.modulation.rows(timesteps.to(self.device), {k: v.to(self.device) for k, v in feeds.items()},
                                    self.dtype, padded)

    def modulation_off(self) -> None:
        if self.modulation is not None:
            self.modulation.off()

    def _quantize(self, raw) -> str:
        """The build's fp8 recipe on the PyTorch transformer (fp8.py): scales recorded by the build, or from a
        calibration and the module's weights, grouped as the graph fuses its projections."""
        from .. import fp8_layers

        scales = self.fp8.get("scales")
        if scales is None:
            scales = fp8_layers.calibrated_scales(raw, self.spec, self.source.geometry, self.fp8["amax"],
                                                  device=self.device, dtype=self.dtype)
        return fp8_layers.quantize_module(raw, scales, self.device, attention=self.fp8.get("attention"))

    def infer_part(self, spec, feeds: dict) -> dict:
        """One of the transformer's First-Block Cache parts (components.TRANSFORMER_PARTS) on this module:
        {output name: tensor}."""
        import torch

        if not self.active:
            self.activate()
        if spec.name not in self._parts:
            part = spec.wrap(self.module.model).eval()
            self._parts[spec.name] = torch.compile(part, fullgraph=False, dynamic=False) if self.compile else part
        return self._call(spec, self._parts[spec.name], feeds)

    def _call(self, spec, fn, feeds: dict) -> dict:
        """fn (the module, or one of its parts) on `feeds` padded to a batch bucket: {output name: tensor}. With
        context parallelism the leader sends the call to the followers, each rank computes its slice of the
        tokens and the outputs are gathered (runtime/parallel.py)."""
        import torch

        feeds, batch = self.padded(spec, feeds)

        def run(feeds):
            args = [feeds[t.name].to(self.device, self.dtype, non_blocking=True) if feeds[t.name].is_floating_point()
                    else feeds[t.name].to(self.device, non_blocking=True) for t in spec.inputs if t.name in feeds]
            with torch.inference_mode():
                out = fn(*args)
            return dict(zip((t.name for t in spec.outputs), out if isinstance(out, tuple) else (out,)))

        if self.context is None:
            out = run(feeds)
        else:
            from .parallel import split_call

            out = split_call(self.context, spec, feeds, run)
        return {k: v[:batch] if batch else v for k, v in out.items()}

    def padded(self, spec, feeds: dict) -> tuple[dict, int | None]:
        """`feeds` with their batch padded to the smallest batch bucket that holds it (the last sample repeated;
        samples never mix in FLUX's transformer, so the real ones compute as they would alone), and the real
        batch to cut the outputs back to (None: nothing padded)."""
        import torch

        if not self.batch_buckets:
            return feeds, None
        batched = [t.name for t in spec.inputs if t.name in feeds and t.dims and t.dims[0] == "batch"]
        if not batched:
            return feeds, None
        batch = feeds[batched[0]].shape[0]
        size = next((b for b in self.batch_buckets if b >= batch), batch)
        if size == batch:
            return feeds, None
        out = dict(feeds)
        for name in batched:
            v = feeds[name]
            out[name] = torch.cat([v, v[-1:].expand(size - batch, *v.shape[1:])])
        return out, batch

    def deactivate(self) -> None:
        import torch

        self._parts = {}
        if self.module is not None:
            self._cpu_copy = self.module.to("cpu")
        self.module = self._fn = None
        self.active = False
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def infer_impl(self, feeds: dict) -> dict:
        return self._call(self.spec, self._fn, feeds)


class LoadProbe:
    """A folder's CUDA packages ({component: (path, sha256)}) loaded once in one child process
    (core/packages.probe_load) before any loads in this one: some torch builds crash the process there, and a
    crash must be one line. Started by the first package's activation, beside its weights' read; each package
    waits for it before its own load. Packages that loaded are remembered per sha256 and torch build (the cache
    folder), so a later process skips them; so are packages whose libraries link the shared libstdc++
    (core/packages.links_shared_libstdcxx): the crash seen was a statically linked one, and the child costs a
    fresh process seconds (torch imported and every package loaded twice)."""

    def __init__(self, packages: dict, device):
        self.packages, self.device = packages, device
        self._pool = self._done = None

    def start(self) -> None:
        if self._done is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(1)
            self._done = self._pool.submit(self._run)

    def wait(self) -> None:
        self.start()
        self._done.result()

    def _marker(self, sha256: str):
        import torch

        from ..models.tiny import cache_root

        return cache_root() / "pt2-loads" / f"{sha256[:24]}-{torch.__version__}"

    def _run(self) -> None:
        from ..core.packages import links_shared_libstdcxx, probe_load

        todo = {name: path for name, (path, sha) in self.packages.items()
                if not self._marker(sha).exists() and not links_shared_libstdcxx(path)}
        if todo:
            probe_load(todo, self.device)
        for _, sha in self.packages.values():
            self._marker(sha).parent.mkdir(parents=True, exist_ok=True)
            self._marker(sha).touch()


_READER = None


def _reader():
    """The one thread that prefetches packages' weights (PackageExecutor.prefetch), in the order asked."""
    global _READER
    if _READER is None:
        from concurrent.futures import ThreadPoolExecutor

        _READER = ThreadPoolExecutor(1, thread_name_prefix="fluxtrt-weights")
    return _READER


def wait_for_reads() -> None:
    """Return once the reader thread has nothing left to read. Its reads allocate device memory and copy to the
    GPU: one that runs while a CUDA graph is being captured invalidates the capture ("operation failed due to a
    previous error during capture"), so CudaGraphStep waits here first. A read's own error stays its
    activate()'s."""
    if _READER is not None:
        _READER.submit(lambda: None).result()


class PackageExecutor(Executor):
    """A compiled PyTorch engine: an AOTInductor package (`<component>.pt2`, `fluxtrt build --backend torch`),
    checked before it loads (the manifest's sha256, and the torch, CUDA and device it was compiled for) and run
    without tracing or compiling. Its weights file beside it holds the fp8 recipe's E4M3 weights as they were
    quantized: nothing of higher precision is loaded."""

    kind = "pt2"

    def __init__(self, component: str, entry: ComponentEntry, path: Path, spec, *, runtime: dict | None,
                 device: str | None = None, probe: LoadProbe | None = None, loras=()):
        super().__init__(component, entry)
        self.path, self.spec, self.runtime = Path(path), spec, runtime or {}
        self.loras = list(loras)  # [(runtime/lora.LoraFile, scale)]: merged into the weights as they are read
        self.lora_note = None
        self._reading = None  # prefetch(): the weights' read under way (a Future of read_constants' dict)
        from ..core.packages import run_device

        self.probe = probe  # the folder's CUDA packages loaded once in a child process first (LoadProbe)
        self._device = device or run_device(self.runtime)
        self.stream = None
        self.context = None  # runtime/parallel.Rank: a package split over ranks (`build --parallel N`) runs on it
        self._fn = self._weights = None
        has, wants = [t["name"] for t in entry.inputs], [t.name for t in spec.inputs]
        if has != wants:
            raise ManifestError(f"{component}: {self.path.name} was compiled for another model (its inputs are "
                                f"{', '.join(has)}; this model's are {', '.join(wants)}): build the packages again for "
                                "this model with `fluxtrt build --backend torch`")

    @property
    def device(self):
        import torch

        return torch.device(self._device)

    def check(self) -> None:
        """One line naming both sides and the build command for a package that cannot run here."""
        from ..core.packages import runtime_problem
        from ..fileio import sha256_file

        problem = runtime_problem(self.runtime, self.device)
        if problem:
            target = self.runtime.get("target")
            gpu = "cpu" if target == "cpu" else "<your gpu>"
            raise FluxtrtError(f"{self.component}: {self.path.name} cannot run here: {problem}; compile packages "
                               f"here with `fluxtrt build --gpu {gpu} --backend torch` (nothing was compiled in its "
                               "place)")
        if not self.path.is_file():
            raise ManifestError(f"{self.component}: {self.path} is missing; build it again with `fluxtrt build "
                                "--backend torch`")
        recipe = self.entry.recipe if isinstance(self.entry.recipe, dict) else {}
        if recipe.get("attention_kernel") == "flashinfer":
            from ..kernels.flashinfer_fp8_attention import available

            why = available()
            if why:
                raise FluxtrtError(f"{self.component}: {self.path.name} calls FlashInfer's FP8 attention, and {why}: "
                                   "pip install flashinfer-python, or build the package again here")

        size = self.path.stat().st_size
        if size != self.entry.bytes or sha256_file(self.path) != self.entry.sha256:
            raise ManifestError(f"{self.component}: {self.path} is not the package the manifest records (size or "
                                "sha256 differ: truncated, corrupted or replaced); build it again with `fluxtrt "
                                "build --backend torch`, or unpack the archive again")

    def _weights_file(self) -> Path:
        from ..fileio import inside

        if not self.entry.constants:
            raise ManifestError(f"{self.component}: the manifest names no weights file for {self.path.name}; build "
                                "it again with `fluxtrt build --backend torch`")
        return inside(self.path.parent, self.entry.constants["file"], f"{self.component}.constants")

    def prefetch(self) -> None:
        """Start reading the weights now, on a background thread that reads a folder's packages one after another
        in the order asked, so that a fresh process's loads overlap its imports, tokenizers and text encoders
        instead of waiting in turn at each first call. activate() takes the result (or its one-line error)."""
        if self._fn is None and self._reading is None:
            from ..core.packages import read_constants

            def read():  # what activate() checks first is checked here first too: its error is activate()'s
                self.check()
                return read_constants(self._weights_file(), self.entry.constants, self.device, self.component)

            self._reading = _reader().submit(read)

    def activate(self) -> None:
        from ..core.packages import open_package

        if self._fn is None:
            read, self._reading = self._reading, None
            if read is None:  # a prefetch checked it already: its error comes with read.result()
                self.check()
            weights = self._weights_file()
            if self.entry.parallel and self.context is not None:  # its attention calls this op by name: registered,
                # on this rank's group (open_pipeline refused split packages without --parallel)
                from ..attention import bind_context, context_attention_op
                from .parallel import call_sizes

                context_attention_op()
                bind_context(self.context.group, self.context.size, call_sizes)
            recipe = self.entry.recipe or {}
            module = recipe.get("attention_module")
            if recipe.get("attention_kernel") == "flashinfer" and module:  # the FlashInfer kernel module the package
                # calls, compiled at build time (check() found flashinfer here)
                from ..kernels.flashinfer_fp8_attention import use_shipped

                use_shipped(self.path.parent, module, self.component)
            if self.probe is not None:
                self.probe.start()  # its child loads the kernels while this process reads the weights
            adjust = None
            if self.loras:
                from .lora import merge_into_constants

                def adjust(tensors):
                    n = merge_into_constants(tensors, self.loras, self.component)
                    self.lora_note = f"LoRA merged into {n} weight{'s' if n != 1 else ''} of {self.path.name}"
            self._fn, self._weights = open_package(self.path, weights, self.entry.constants, self.device,
                                                   self.component, before_load=self.probe and self.probe.wait,
                                                   adjust=adjust, read=read.result() if read is not None else None)
        self.active = True

    def infer_impl(self, feeds: dict) -> dict:
        if self.context is not None:  # the call sent to the followers, this rank's slice run, the slices gathered
            from .parallel import split_call

            return split_call(self.context, self.spec, feeds, self._run)
        return self._run(feeds)

    def _run(self, feeds: dict) -> dict:
        import contextlib

        import torch

        args = []
        for t in self.spec.inputs:
            if t.name not in feeds:
                continue
            v = feeds[t.name]
            dtype = self.io_dtype(t.name)
            args.append(v.to(self.device, dtype, non_blocking=True).contiguous())
        on_stream = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with on_stream, torch.inference_mode():
            out = self._fn(*args)
        out = out if isinstance(out, (list, tuple)) else (out,)
        return {t.name: v for t, v in zip(self.spec.outputs, out)}

    def deactivate(self) -> None:
        import torch

        if self._reading is not None:  # a prefetch under way: let it end, drop what it read
            self._reading.exception()
        self._fn = self._weights = self._reading = None
        self.active = False
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
