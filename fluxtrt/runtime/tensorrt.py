"""The TensorRT executor: an engine (tensorrt or tensorrt_rtx) in device memory, run on the pipeline's stream.

What each call relies on (TensorRT-RTX 1.7.1 Python API, its docstrings and NvInferRuntime.h; see "Running
engines" in docs/architecture.md, and tests/fake_trt.py, the strict stand-in that enforces these contracts):
- The plan is verified (size, sha256) by streaming the file, then deserialized from an `IStreamReaderV2` that
  hands TensorRT 64 MiB at a time: never a whole copy of a 24-48 GB weight-streaming plan in host memory.
- Refit (weightless engines, `--weights`) happens before the weight-streaming budget and the context.
- The `IRuntimeConfig` is kept for the context's life (`self.runtime_config`), as NVIDIA's RTX runner does.
- Every bound address is 256-byte aligned: inputs are copied into persistent aligned buffers (also what
  TensorRT-RTX's whole-graph CUDA-graph capture needs: the same addresses every step), outputs likewise.
- `set_input_shape` and `set_tensor_address` return False on refusal and `infer_shapes()` lists tensors left
  unspecified: all three are checked before outputs are sized from `get_tensor_shape`.
- Staging copies and `execute_async_v3` run on one stream, which `infer_impl` enters itself.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from ..dtypes import torch_dtype_of_engine
from ..errors import BackendUnavailableError, FluxtrtError
from ..records import ComponentEntry, ManifestError
from .executors import Executor, ShapeError, WeightSource

ALIGNMENT = 256  # bytes: what setTensorAddress and setDeviceMemory require
READ_CHUNK = 64 << 20  # bytes handed to TensorRT per read while deserializing


def aligned_empty(shape, dtype, device):
    """An uninitialized tensor whose data pointer is a multiple of ALIGNMENT, on any device."""
    import math

    import torch

    nbytes = max(math.prod(shape), 1) * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, device=device)
    skip = (-raw.data_ptr()) % ALIGNMENT
    return raw[skip:skip + nbytes].view(dtype)[: math.prod(shape)].view(tuple(shape))


class CudaStreams:
    """Where the executor's work goes: torch CUDA streams. Tests substitute a recording stand-in."""

    device = "cuda"

    def use(self, stream):
        import torch

        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def handle(self, stream) -> int:
        import torch

        return (stream if stream is not None else torch.cuda.current_stream()).cuda_stream

    def copy(self, dst, src) -> None:
        dst.copy_(src, non_blocking=True)

    def synchronize(self, stream) -> None:
        import torch

        (stream if stream is not None else torch.cuda.current_stream()).synchronize()

    def release_cache(self) -> None:
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()


class SharedActivations:
    """One device buffer for all engines' activations, grown to the largest one (engines run one at a time
    on one stream, so they can share it); 256-byte aligned, as setDeviceMemory requires."""

    def __init__(self, device: str = "cuda"):
        self.buffer = None
        self.device = device

    def pointer(self, size: int) -> int:
        import torch

        if self.buffer is None or self.buffer.numel() < size:
            self.buffer = None  # free the smaller one first
            self.buffer = aligned_empty((max(size, 1),), torch.uint8, self.device)
        return self.buffer.data_ptr()


def plan_reader(trt, file):
    """An IStreamReaderV2 over an open plan file: READ_CHUNK bytes per read (TensorRT asks again for the rest)."""

    class PlanReader(trt.IStreamReaderV2):
        def __init__(self):
            trt.IStreamReaderV2.__init__(self)

        def read(self, num_bytes: int, stream: int) -> bytes:
            return file.read(min(num_bytes, READ_CHUNK))

        def seek(self, offset: int, where) -> bool:
            whence = {trt.SeekPosition.SET: 0, trt.SeekPosition.CUR: 1, trt.SeekPosition.END: 2}[where]
            file.seek(offset, whence)
            return True

    return PlanReader()


class TensorRTExecutor(Executor):
    """Deserializes an engine into device memory and runs it with persistent, aligned torch buffers on the
    pipeline's one stream (execute_async_v3: no host synchronisation)."""

    kind = "tensorrt"

    def __init__(self, component: str, entry: ComponentEntry, engine_path: Path, backend, stream=None,
                 *, shared_memory=None, weight_streaming_budget: int | None = None, cuda_graph: bool = False,
                 allow_host_code: bool = False, weights: WeightSource | None = None,
                 kernel_specialization: str = "eager", streams=None, low_vram: bool = False):
        super().__init__(component, entry)
        self.allow_host_code = allow_host_code
        self.weights = weights
        self.engine_path = Path(engine_path)
        self.backend = backend
        self.stream = stream
        self.streams = streams or CudaStreams()
        self.shared_memory = shared_memory  # a SharedActivations, or None for per-context memory
        self.weight_streaming_budget = weight_streaming_budget
        self.cuda_graph = cuda_graph
        # EAGER for one-shot runs: shape-specialized kernels before the first step (every step uses them, and the
        # runtime cache saved at the end holds them); LAZY for servers (no stall on a new shape).
        self.kernel_specialization = kernel_specialization
        self.low_vram = low_vram
        self.runtime = self.engine = self.context = self.runtime_config = self.runtime_cache = None
        self.native_cuda_graph = False  # TensorRT-RTX captures the graph itself; else the pipeline does
        self._outputs: dict[tuple, dict] = {}  # output buffers per input-shape signature
        self._inputs: dict[tuple, object] = {}  # persistent input buffers per (name, shape)
        self._arrays = None  # the checkpoint's weights, kept where a reload would need them again
        self._parked = None  # (weights manager, host copy) while --low-vram has the weights off the GPU
        self._manager = None  # the engine's IWeightsManager (TensorRT-RTX, stripped engines)

    @property
    def device(self):
        import torch

        return torch.device(self.streams.device)

    # -- loading ------------------------------------------------------------------------------------------
    def _verify_plan(self) -> None:
        from ..fileio import sha256_file

        size = self.engine_path.stat().st_size if self.engine_path.exists() else None
        if size != self.entry.bytes or sha256_file(self.engine_path) != self.entry.sha256:
            raise ManifestError(f"{self.engine_path} does not match the manifest's size and sha256 (corrupt or "
                                "replaced); rebuild with `fluxtrt build --force`, or unpack the archive again")

    def activate(self) -> None:
        if self._parked is not None:
            self._restore_weights()
            return
        trt = self.backend.trt
        self._verify_plan()  # before TensorRT reads a byte of it (streamed: no copy held in memory)
        validity = self.backend.runtime_validity(self.engine_path)
        if validity is not None and validity.startswith("INVALID"):
            raise BackendUnavailableError(f"{self.backend.name} says {self.engine_path.name} cannot run on this "
                                          f"machine ({validity}); build for this GPU with `fluxtrt build`")
        self.runtime = trt.Runtime(self.backend.logger)  # kept: the engine must not outlive its runtime
        if hasattr(self.runtime, "engine_host_code_allowed"):  # engines with embedded host code only if asked
            self.runtime.engine_host_code_allowed = self.allow_host_code
        self.backend.logger.errors = []
        with open(self.engine_path, "rb") as f:
            engine = self.runtime.deserialize_cuda_engine(plan_reader(trt, f))
        if engine is None:
            detail = "; ".join(self.backend.logger.errors) or "no detail"
            hint = ("" if self.allow_host_code or "host code" not in detail.lower()
                    else "; it embeds host code: pass --allow-host-code only if you trust where it came from")
            raise FluxtrtError(f"{self.backend.name} could not load {self.engine_path.name}: {detail}{hint}")
        if self.weights is not None:  # weightless engine (or new weights): refit from the user's checkpoint
            from ..core.refit import refit_engine

            arrays = self._arrays if self._arrays is not None else self.weights.arrays()
            refit_engine(engine, trt, self.backend.logger, arrays, self.weights.graph_constants)
            # kept only where reloading would refit again (--low-vram without a weights manager)
            self._arrays = arrays if self.low_vram and not hasattr(engine, "create_weights_manager") else None
        if self.weight_streaming_budget is not None and self.entry.weight_streaming:
            engine.weight_streaming_budget_v2 = int(self.weight_streaming_budget)
        self.engine = engine
        self.context = self._create_context(trt, engine)
        self.active = True

    def _create_context(self, trt, engine):
        if hasattr(engine, "create_runtime_config"):
            rc = engine.create_runtime_config()
            if self.shared_memory is not None:
                rc.set_execution_context_allocation_strategy(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
            # TensorRT-RTX captures whole-graph CUDA graphs itself; full TensorRT's IRuntimeConfig has no such
            # attribute: there the pipeline captures the step (CudaGraphStep) after a warm-up.
            self.native_cuda_graph = (self.cuda_graph and hasattr(rc, "cuda_graph_strategy")
                                      and hasattr(trt, "CudaGraphStrategy"))
            if self.native_cuda_graph:
                rc.cuda_graph_strategy = trt.CudaGraphStrategy.WHOLE_GRAPH_CAPTURE
            strategy = getattr(trt, "DynamicShapesKernelSpecializationStrategy", None)
            if strategy is not None and hasattr(rc, "dynamic_shapes_kernel_specialization_strategy"):
                rc.dynamic_shapes_kernel_specialization_strategy = getattr(strategy, self.kernel_specialization.upper())
            if hasattr(rc, "create_runtime_cache"):  # TensorRT-RTX: JIT kernels cached per GPU, kept on disk
                self.runtime_cache = rc.create_runtime_cache()
                if self.runtime_cache_path.exists():
                    self.runtime_cache.deserialize(self.runtime_cache_path.read_bytes())  # rejected if stale
                rc.set_runtime_cache(self.runtime_cache)
            self.runtime_config = rc  # the context may hold a pointer to it: kept for the context's life
            context = engine.create_execution_context(rc)
        elif self.shared_memory is not None:
            context = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        else:
            context = engine.create_execution_context()
        if context is None:
            raise FluxtrtError(f"{self.component}: TensorRT could not create an execution context: "
                               + ("; ".join(self.backend.logger.errors) or "no detail"))
        return context

    def memory_size(self) -> int:
        return int(self.engine.device_memory_size_v2) if self.engine is not None else 0

    @property
    def runtime_cache_path(self) -> Path:
        return self.engine_path.with_suffix(".runtime.cache")

    def save_runtime_cache(self) -> str | None:
        """Keep TensorRT-RTX's JIT kernels for the next run; a folder that cannot be written costs only that
        (the caller's images are never lost to it): returns the reason it was not saved, or None."""
        from ..fileio import write_bytes_atomic

        if self.runtime_cache is None:
            return None
        try:
            write_bytes_atomic(self.runtime_cache_path, bytes(self.runtime_cache.serialize()), check_free=False)
        except OSError as e:
            return f"could not save {self.runtime_cache_path.name} ({e.strerror}); the next run compiles its kernels again"
        return None

    # -- low VRAM: weights off the GPU between uses, without deserializing and refitting again ----------------
    def _park_weights(self) -> bool:
        """Refitted engine, --low-vram: save its weights to host memory and unload them from the GPU through
        TensorRT-RTX's weights manager (the engine and context stay). False where there is no manager."""
        import torch

        trt = self.backend.trt
        if self._manager is None:  # one per engine, kept with it
            maker = getattr(self.engine, "create_weights_manager", None)
            self._manager = maker() if maker is not None else None
        manager = self._manager
        if manager is None:
            return False
        size = int(manager.get_size())
        host = aligned_empty((size,), torch.uint8, "cpu")
        handle = self.streams.handle(self.stream)
        if not manager.save_to_buffer(host.data_ptr(), size, trt.TensorLocation.HOST, handle):
            return False
        self.streams.synchronize(self.stream)  # the copy is done before the memory goes
        if not manager.unload(handle):
            return False
        self._parked = (manager, host)
        return True

    def _restore_weights(self) -> None:
        trt = self.backend.trt
        manager, host = self._parked
        if not manager.restore_from_buffer(host.data_ptr(), host.numel(), trt.TensorLocation.HOST,
                                           self.streams.handle(self.stream)):
            raise FluxtrtError(f"{self.component}: TensorRT could not restore the engine's weights: "
                               + ("; ".join(self.backend.logger.errors) or "no detail"))
        self._parked = None  # the host copy is freed once the restore, ordered on our stream, has been issued
        self.streams.synchronize(self.stream)
        self.active = True

    def deactivate(self) -> str | None:
        """Free the GPU memory of this engine; returns a note when the runtime cache could not be saved."""
        note = self.save_runtime_cache()
        self._outputs.clear()
        self._inputs.clear()
        self.active = False
        if self.low_vram and self.weights is not None and self.engine is not None and self._park_weights():
            return note
        self.context = self.runtime_config = self.runtime_cache = self._manager = self.engine = self.runtime = None
        if self.low_vram:  # the next engine allocates outside torch: give torch's cached blocks back first
            self.streams.release_cache()
        return note

    # -- running --------------------------------------------------------------------------------------------
    def stage_inputs(self, feeds: dict) -> dict:
        """The engine's input buffers: persistent per (name, shape), 256-byte aligned, filled by a copy on the
        executor's stream (casting to the engine's dtype). The caller's tensors are never bound directly: their
        addresses change every step and may be misaligned (a stride-0 view into a timestep table)."""
        bound = {}
        for name, t in feeds.items():
            key = (name, tuple(t.shape))
            buf = self._inputs.get(key)
            if buf is None:
                dtype = torch_dtype_of_engine(self.entry.dtype_of(name))
                buf = self._inputs[key] = aligned_empty(tuple(t.shape), dtype, self.device)
            self.streams.copy(buf, t)
            bound[name] = buf
        return bound

    def _engine_error(self, what: str) -> str:
        return f"{self.component}: {what}" + (f" ({'; '.join(self.backend.logger.errors)})"
                                              if self.backend.logger.errors else "")

    def _bind(self, name: str, t) -> None:
        if not self.context.set_tensor_address(name, t.data_ptr()):
            raise FluxtrtError(self._engine_error(f"TensorRT refused the address of {name}"))

    def _output_buffers(self, key) -> dict:
        outs = self._outputs.get(key)
        if outs is None:
            outs = {}
            for o in self.entry.outputs:
                shape = tuple(self.context.get_tensor_shape(o["name"]))
                if any(d < 0 for d in shape):
                    raise FluxtrtError(self._engine_error(f"output {o['name']} has unresolved shape {list(shape)}"))
                outs[o["name"]] = aligned_empty(shape, torch_dtype_of_engine(o["dtype"]), self.device)
            self._outputs[key] = outs
        return outs

    def infer_impl(self, feeds: dict) -> dict:
        ctx = self.context
        self.backend.logger.errors = []
        with self.streams.use(self.stream):  # the copies below and the execution: one stream
            bound = self.stage_inputs(feeds)
            for name, t in bound.items():
                if not ctx.set_input_shape(name, tuple(t.shape)):
                    raise ShapeError(self._engine_error(f"TensorRT refused shape {list(t.shape)} for input {name}; "
                                                        "it is outside the engine's profile"))
                self._bind(name, t)
            unresolved = ctx.infer_shapes()
            if unresolved:
                raise FluxtrtError(self._engine_error(f"inputs not fully specified: {', '.join(unresolved)}"))
            outs = self._output_buffers(tuple((n, tuple(t.shape)) for n, t in bound.items()))
            for name, t in outs.items():
                self._bind(name, t)
            if self.shared_memory is not None:
                size = self.memory_size()
                ctx.set_device_memory(self.shared_memory.pointer(size), size)
            if not ctx.execute_async_v3(self.streams.handle(self.stream)):
                raise FluxtrtError(self._engine_error("TensorRT execution failed"))
        return outs
