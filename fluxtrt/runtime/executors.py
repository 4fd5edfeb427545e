"""Executors: one component each, behind one small interface. The pipeline above them is identical.

    activate()          load (engine into device memory / ONNX Runtime session)
    infer(feeds)        {input name: torch tensor} -> {output name: torch tensor}, on the executor's device
    deactivate()        free it (used by --low-vram between stages)
    check_shapes(feeds) refuse shapes outside the engine's profile with the range in the message

TensorRTExecutor runs engines (tensorrt or tensorrt_rtx) on an NVIDIA GPU; OnnxRuntimeExecutor runs the very
ONNX files the engines were built from (CPU, or CUDA with onnxruntime-gpu)."""

from __future__ import annotations

from pathlib import Path

from ..checkpoint import CheckpointReader
from ..dtypes import torch_dtype, torch_dtype_of_engine
from ..errors import BackendUnavailableError, FluxtrtError
from ..records import ComponentEntry, ManifestError


class ShapeError(FluxtrtError):
    """A request does not fit an engine's optimization profile."""


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

    def __init__(self, component: str, folder: Path, weight_map: dict, lora=None):
        self.component, self.folder, self.weight_map, self.lora = component, Path(folder), weight_map, lora

    @classmethod
    def for_component(cls, source, engine_dir: Path, entry: ComponentEntry, name: str, lora=None):
        import json

        if source is None:
            if entry.weightless:
                raise FluxtrtError(f"{name}: the engine carries no weights (built with --weightless); pass "
                                   "--weights YOUR_FLUX_FOLDER to fill them from your checkpoint")
            return None
        if not entry.weight_map:
            raise ManifestError(f"{name}: these engines have no weight map (built before fluxtrt recorded one); "
                                "rebuild with `fluxtrt build` to use --weights")
        wmap = json.loads((Path(engine_dir) / entry.weight_map).read_text())
        if not wmap["refittable"]:
            raise FluxtrtError(f"{name} cannot take weights from a checkpoint: {wmap['reason']} "
                               f"(`fluxtrt build --model {source.path}`)")
        return cls(name, source.path / wmap["subfolder"], wmap, lora if name == "transformer" else None)

    def arrays(self) -> dict:
        from .. import weightmap

        get = CheckpointReader(self.folder)
        if self.lora is None:
            return weightmap.materialize(self.weight_map, get)
        out = weightmap.materialize(self.weight_map, self.lora.wrap(get))
        self.lora.check_all_used()
        return out


class OnnxRuntimeExecutor(Executor):
    kind = "onnxruntime"

    def __init__(self, component: str, entry: ComponentEntry, onnx_path: Path, providers: list[str] | None = None,
                 weights: WeightSource | None = None):
        super().__init__(component, entry)
        self.onnx_path = Path(onnx_path)
        self.providers = providers or ["CPUExecutionProvider"]
        self.session = None
        self.weights = weights

    def activate(self) -> None:
        from ..fileio import sha256_file
        from ..validate import cpu_session

        if not self.onnx_path.exists():
            raise ManifestError(f"{self.component}: the ONNX file {self.onnx_path} the engine was built from is gone; "
                                "rebuild with `fluxtrt build`")
        want = self.entry.weightfree_sha256 if self.weights is not None else self.entry.onnx_sha256
        if sha256_file(self.onnx_path) != want:
            raise ManifestError(f"{self.component}: {self.onnx_path} does not match the manifest's sha256; "
                                "rebuild with `fluxtrt build --force`")
        overrides = self.weights.arrays() if self.weights is not None else None
        if self.providers == ["CPUExecutionProvider"]:
            self.session = cpu_session(self.onnx_path, overrides)
        else:
            from ..onnxio import ort_session

            self.session = ort_session(self.onnx_path, self.providers, overrides=overrides)
        self.types = {i.name: i.type for i in self.session.get_inputs()}
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.active = True

    def deactivate(self) -> None:
        self.session = None
        self.active = False

    def infer_impl(self, feeds: dict) -> dict:
        import numpy as np
        import torch

        np_feeds = {}
        for name, t in feeds.items():
            arr = t.detach().cpu().numpy()
            if self.types[name] == "tensor(float16)":
                arr = arr.astype(np.float16)
            elif self.types[name] == "tensor(float)":
                arr = arr.astype(np.float32)
            np_feeds[name] = arr
        outs = self.session.run(self.output_names, np_feeds)
        return {n: torch.from_numpy(np.asarray(o)) for n, o in zip(self.output_names, outs)}




class TensorRTExecutor(Executor):
    """Deserializes an engine straight into device memory and runs it with pre-allocated torch CUDA buffers
    on the pipeline's one stream (execute_async_v3: no host synchronisation)."""

    kind = "tensorrt"

    def __init__(self, component: str, entry: ComponentEntry, engine_path: Path, backend, stream=None,
                 shared_memory=None, weight_streaming_budget: int | None = None, cuda_graph: bool = False,
                 allow_host_code: bool = False, weights: WeightSource | None = None):
        super().__init__(component, entry)
        self.allow_host_code = allow_host_code
        self.weights = weights
        self.engine_path = Path(engine_path)
        self.backend = backend
        self.stream = stream
        self.shared_memory = shared_memory  # a SharedActivations, or None for per-context memory
        self.weight_streaming_budget = weight_streaming_budget
        self.cuda_graph = cuda_graph
        self.engine = self.context = None
        self._outputs: dict[tuple, dict] = {}  # output buffers per input-shape signature, reused across calls
        self._inputs: dict[tuple, object] = {}  # cast input buffers per (name, shape), reused across calls

    @property
    def device(self):
        import torch

        return torch.device("cuda")

    def activate(self) -> None:
        from ..fileio import sha256_file

        trt = self.backend.trt
        data = self.engine_path.read_bytes()
        if sha256_file(self.engine_path) != self.entry.sha256:
            raise ManifestError(f"{self.engine_path} does not match the manifest's sha256 (corrupt or replaced); "
                                "rebuild with `fluxtrt build --force`")
        validity = self.backend.runtime_validity(self.engine_path)
        if validity is not None and validity.startswith("INVALID"):
            raise BackendUnavailableError(f"{self.backend.name} says {self.engine_path.name} cannot run on this "
                                          f"machine ({validity}); build for this GPU with `fluxtrt build`")
        runtime = trt.Runtime(self.backend.logger)
        if hasattr(runtime, "engine_host_code_allowed"):  # engines with embedded host code run only if asked
            runtime.engine_host_code_allowed = self.allow_host_code
        self.backend.logger.errors = []
        engine = runtime.deserialize_cuda_engine(data)
        if engine is None:
            detail = "; ".join(self.backend.logger.errors) or "no detail"
            hint = ("" if self.allow_host_code or "host code" not in detail.lower()
                    else "; it embeds host code: pass --allow-host-code only if you trust where it came from")
            raise FluxtrtError(f"{self.backend.name} could not load {self.engine_path.name}: {detail}{hint}")
        if self.weights is not None:  # weightless engine (or new weights): refit from the user's checkpoint
            from ..engine.refit import refit_engine

            refit_engine(engine, trt, self.backend.logger, self.weights.arrays())
        if self.weight_streaming_budget is not None and self.entry.weight_streaming:
            engine.weight_streaming_budget_v2 = int(self.weight_streaming_budget)
        if hasattr(engine, "create_runtime_config"):
            rc = engine.create_runtime_config()
            if self.shared_memory is not None:
                rc.set_execution_context_allocation_strategy(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
            if self.cuda_graph:
                rc.cuda_graph_strategy = trt.CudaGraphStrategy.WHOLE_GRAPH_CAPTURE
            if hasattr(rc, "create_runtime_cache"):  # TensorRT-RTX: JIT kernels cached per GPU, kept on disk
                self.runtime_cache = rc.create_runtime_cache()
                if self.runtime_cache_path.exists():
                    self.runtime_cache.deserialize(self.runtime_cache_path.read_bytes())  # rejected if stale
                rc.set_runtime_cache(self.runtime_cache)
            context = engine.create_execution_context(rc)
        elif self.shared_memory is not None:
            context = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        else:
            context = engine.create_execution_context()
        self.engine, self.context = engine, context
        self.active = True

    def memory_size(self) -> int:
        return int(self.engine.device_memory_size_v2) if self.engine is not None else 0

    @property
    def runtime_cache_path(self) -> Path:
        return self.engine_path.with_suffix(".runtime.cache")

    def save_runtime_cache(self) -> None:
        from ..fileio import write_bytes_atomic

        cache = getattr(self, "runtime_cache", None)
        if cache is not None:
            write_bytes_atomic(self.runtime_cache_path, bytes(cache.serialize()))

    def deactivate(self) -> None:
        self.save_runtime_cache()
        self.context = self.engine = None
        self._outputs.clear()
        self._inputs.clear()
        self.active = False

    def infer_impl(self, feeds: dict) -> dict:
        import torch

        ctx = self.context
        for name, t in self.stage_inputs(feeds, "cuda").items():
            ctx.set_input_shape(name, tuple(t.shape))
            ctx.set_tensor_address(name, t.data_ptr())
        key = tuple((n, tuple(t.shape)) for n, t in feeds.items())
        outs = self._outputs.get(key)
        if outs is None:
            outs = {}
            for o in self.entry.outputs:
                shape = tuple(ctx.get_tensor_shape(o["name"]))
                outs[o["name"]] = torch.empty(shape, dtype=torch_dtype_of_engine(o["dtype"]), device="cuda")
            self._outputs[key] = outs
        for name, t in outs.items():
            ctx.set_tensor_address(name, t.data_ptr())
        if self.shared_memory is not None:
            ctx.set_device_memory(self.shared_memory.pointer(self.memory_size()), self.memory_size())
        stream = self.stream or torch.cuda.current_stream()
        if not ctx.execute_async_v3(stream.cuda_stream):
            raise FluxtrtError(f"{self.component}: TensorRT execution failed: " + "; ".join(self.backend.logger.errors))
        return outs


    def stage_inputs(self, feeds: dict, device) -> dict:
        """The engine's input buffers: allocated once per (name, shape), filled with copy_ (casting to the
        engine's dtype) on the current stream; a tensor already of the right dtype, device and layout is
        bound as it is. The caller's dict is not modified."""
        import torch

        bound = {}
        for name, t in feeds.items():
            want = torch_dtype_of_engine(self.entry.dtype_of(name))
            if t.dtype == want and t.device.type == torch.device(device).type and t.is_contiguous():
                bound[name] = t
                continue
            key = (name, tuple(t.shape))
            buf = self._inputs.get(key)
            if buf is None:
                buf = self._inputs[key] = torch.empty(tuple(t.shape), dtype=want, device=device)
            buf.copy_(t, non_blocking=True)
            bound[name] = buf
        return bound


class SharedActivations:
    """One device buffer for all engines' activations, grown to the largest one (engines run one at a time
    on one stream, so they can share it)."""

    def __init__(self, device: str = "cuda"):
        self.buffer = None
        self.device = device

    def pointer(self, size: int) -> int:
        import torch

        if self.buffer is None or self.buffer.numel() < size:
            self.buffer = None  # free the smaller one first
            self.buffer = torch.empty(max(size, 1), dtype=torch.uint8, device=self.device)
        return self.buffer.data_ptr()


def check_gpu_for(manifest: dict, backend) -> None:
    """Refuse to run engines this GPU/driver/TensorRT cannot: no GPU, another compute capability, another
    TensorRT version."""
    from ..engine.backends import local_gpu_capabilities

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


class TorchExecutor(Executor):
    """A component's PyTorch module from the model folder on the pipeline's device (bf16 by default), the
    fallback where no engine can run (e.g. TensorRT-RTX on Hopper). Optionally torch.compile'd."""

    kind = "torch"

    def __init__(self, component: str, source, spec, device: str = "cuda", dtype: str = "bf16",
                 compile: bool = False):
        super().__init__(component, None)
        self.source, self.spec, self.compile = source, spec, compile
        self._device = device
        self.dtype_name = dtype
        self.module = None
        self._cpu_copy = None

    @property
    def device(self):
        import torch

        return torch.device(self._device)

    @property
    def dtype(self):
        return torch_dtype(self.dtype_name)

    def activate(self) -> None:
        if self._cpu_copy is not None:  # --low-vram brought it back to the CPU: move, do not reload
            self.module = self._cpu_copy.to(self.device)
            self._cpu_copy = None
        else:
            raw = self.source.load_component(self.spec.subfolder, self.dtype, self._device)
            self.module = self.spec.wrap(raw).eval()
        self._fn = self.module
        if self.compile:
            import torch

            self._fn = torch.compile(self.module, fullgraph=False, dynamic=False)
        self.active = True

    def deactivate(self) -> None:
        import torch

        if self.module is not None:
            self._cpu_copy = self.module.to("cpu")
        self.module = self._fn = None
        self.active = False
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def infer_impl(self, feeds: dict) -> dict:
        import torch

        args = []
        for t in self.spec.inputs:
            if t.name not in feeds:
                continue
            v = feeds[t.name]
            args.append(v.to(self.device, self.dtype, non_blocking=True) if v.is_floating_point()
                        else v.to(self.device, non_blocking=True))
        with torch.inference_mode():
            out = self._fn(*args)
        return {self.spec.outputs[0].name: out}
