"""A strict stand-in for the TensorRT runtime API, for testing the TensorRT executor and refit without a GPU.

It enforces the documented contracts that fluxtrt relies on (TensorRT-RTX 1.7.1 docstrings, NvInferRuntime.h):
- `set_tensor_address` / `set_device_memory` refuse addresses that are not 256-byte aligned (False / error);
- `set_input_shape` returns False for a shape outside the optimization profile (and keeps the old one);
- output shapes are unresolved (-1) until `infer_shapes()` has run after the last `set_input_shape`;
- `execute_async_v3` checks every I/O address, the shapes, the device memory of a USER_MANAGED context, that the
  context's IRuntimeConfig is still alive, that a stripped engine was refitted and its weights are loaded, and
  records the stream it ran on; it "computes" each output as a byte copy of its source input (real memory);
- `Refitter` reports missing weights like the real one (unnamed ones as ''), refuses a wrong size or dtype, and
  refuses to refit an engine built with REFIT_IDENTICAL with weights other than the build's;
- `IWeightsManager` saves, unloads and restores weights in order;
- deserialization goes through an `IStreamReaderV2` read chunk by chunk.
Enums and `Weights` are the real `tensorrt_rtx` ones; every method a fake class defines exists on
the real class of the same name (tests/runtime/test_tensorrt.py checks it), so the fake cannot drift from it.
Engines are JSON "plans" written by `write_plan`."""

from __future__ import annotations

import ctypes
import json
import types
import weakref

import tensorrt_rtx as real

ALIGN = 256

# fake class -> the real class whose API it mirrors
MIRRORS = {}


def mirrors(real_cls):
    def mark(cls):
        MIRRORS[cls] = real_cls
        return cls
    return mark


def write_plan(path, inputs, outputs, profile, *, refit=None, refittable=None, build_weights=None,
               device_memory=4096, stripped=False, pad=0):
    """A fake engine file. inputs/outputs: [{"name", "dtype" (TensorRT name), "shape"}]; outputs take a "like"
    input whose shape and bytes they copy. refit: None, "identical", "refit". refittable: {name: [dtype, size]}."""
    plan = {"inputs": inputs, "outputs": outputs, "profile": profile, "refit": refit,
            "refittable": refittable or {}, "build_weights": build_weights or {}, "device_memory": device_memory,
            "stripped": stripped}
    data = json.dumps(plan).encode()
    path.write_bytes(data + b" " * pad)
    return path


@mirrors(real.IStreamReaderV2)
class IStreamReaderV2:
    """The real base class needs a CUDA driver to construct; this one has its two methods, to be overridden:
    read(num_bytes, stream) -> bytes (fewer bytes: TensorRT asks again) and seek(offset, where) -> bool."""

    def __init__(self):
        pass

    def read(self, num_bytes, stream):
        raise NotImplementedError

    def seek(self, offset, where):
        raise NotImplementedError


class Logger:
    def __init__(self):
        self.errors = []
        self.file = None

    def error(self, msg):
        self.errors.append(msg)


@mirrors(real.Runtime)
class Runtime:
    def __init__(self, logger):
        self.logger = logger
        self.engine_host_code_allowed = False
        self.reads = []  # bytes returned by each read

    def deserialize_cuda_engine(self, reader):
        assert isinstance(reader, IStreamReaderV2), "the plan is streamed, not handed over whole"
        STATS["deserialized"] += 1
        chunks = []
        while True:
            data = reader.read(1 << 40, 0)  # TensorRT asks for everything; the reader may answer in pieces
            if not data:
                break
            self.reads.append(len(data))
            chunks.append(bytes(data))
        plan = b"".join(chunks).rstrip(b" ")
        try:
            return FLAVOUR["engine"](json.loads(plan), self)
        except (json.JSONDecodeError, UnicodeDecodeError):
            self.logger.error("invalid engine plan")
            return None


STATS = {"deserialized": 0, "refits": 0}


@mirrors(real.ICudaEngine)
class ICudaEngine:
    def __init__(self, plan, runtime):
        self.plan, self.runtime = plan, runtime
        self.device_memory_size_v2 = plan["device_memory"]
        self.weight_streaming_budget_v2 = -1
        self.refittable = plan["refit"] is not None
        self.weights_loaded = True
        self.refitted = not plan["stripped"]
        self.current = {}  # refitted weights

    @property
    def num_io_tensors(self):
        return len(self.plan["inputs"]) + len(self.plan["outputs"])

    def create_runtime_config(self):
        return FLAVOUR["runtime_config"]()

    def create_execution_context(self, config=None):
        return IExecutionContext(self, config)


@mirrors(real.ICudaEngine)
class RTXCudaEngine(ICudaEngine):
    """TensorRT-RTX's engine adds the weights manager of weight-stripped engines."""

    def create_weights_manager(self):
        return IWeightsManager(self) if self.plan["stripped"] else None


@mirrors(real.IRuntimeCache)
class IRuntimeCache:
    def __init__(self):
        self.blob = b"kernels"

    def serialize(self):
        return self.blob

    def deserialize(self, blob):
        self.blob = bytes(blob)
        return True


@mirrors(real.IRuntimeConfig)
class IRuntimeConfig:
    """Full TensorRT's runtime config: no CUDA-graph strategy, no runtime cache."""

    def __init__(self):
        self.strategy = real.ExecutionContextAllocationStrategy.STATIC

    def set_execution_context_allocation_strategy(self, strategy):
        self.strategy = strategy

    def get_execution_context_allocation_strategy(self):
        return self.strategy


@mirrors(real.IRuntimeConfig)
class RTXRuntimeConfig(IRuntimeConfig):
    """TensorRT-RTX's: whole-graph capture, kernel specialization, runtime cache."""

    def __init__(self):
        super().__init__()
        self.cuda_graph_strategy = real.CudaGraphStrategy.DISABLED
        self.dynamic_shapes_kernel_specialization_strategy = real.DynamicShapesKernelSpecializationStrategy.LAZY
        self.cache = None

    def create_runtime_cache(self):
        return IRuntimeCache()

    def set_runtime_cache(self, cache):
        self.cache = cache
        return True

    def get_runtime_cache(self):
        return self.cache


def _bytes_of(dtype: str) -> int:
    return {"float": 4, "half": 2, "bf16": 2, "int64": 8, "int32": 4, "int8": 1, "uint8": 1, "bool": 1, "fp8": 1}[dtype]


@mirrors(real.IExecutionContext)
class IExecutionContext:
    def __init__(self, engine, config):
        self.engine = engine
        self._config = weakref.ref(config) if config is not None else None
        user = (config.get_execution_context_allocation_strategy() if config is not None else None)
        if isinstance(config, real.ExecutionContextAllocationStrategy):
            user, self._config = config, None
        self.user_managed = user == real.ExecutionContextAllocationStrategy.USER_MANAGED
        self.shapes, self.addresses, self.inferred = {}, {}, False
        self.memory = None
        self.calls = []  # (method, name) in order
        self.executions = []  # {"stream", "addresses"} per execute_async_v3
        io = engine.plan["inputs"] + engine.plan["outputs"]
        self.tensors = {t["name"]: t for t in io}

    def set_input_shape(self, name, shape):
        self.calls.append(("set_input_shape", name))
        lo, _, hi = self.engine.plan["profile"][name]
        shape = list(shape)
        if len(shape) != len(lo) or any(not a <= s <= b for a, s, b in zip(lo, shape, hi)):
            self.engine.runtime.logger.error(f"{name}: shape {shape} outside the profile {lo}..{hi}")
            return False
        self.shapes[name] = shape
        self.inferred = False
        return True

    def set_tensor_address(self, name, memory):
        self.calls.append(("set_tensor_address", name))
        if name not in self.tensors or memory % ALIGN:
            self.engine.runtime.logger.error(f"{name}: address {memory:#x} is not {ALIGN}-byte aligned")
            return False
        self.addresses[name] = memory
        return True

    def infer_shapes(self):
        self.calls.append(("infer_shapes", None))
        missing = [t["name"] for t in self.engine.plan["inputs"] if t["name"] not in self.shapes]
        self.inferred = not missing
        return missing

    def get_tensor_shape(self, name):
        self.calls.append(("get_tensor_shape", name))
        t = self.tensors[name]
        if "like" not in t:
            return tuple(self.shapes.get(name, t["shape"]))
        if not self.inferred:
            return tuple(-1 for _ in t["shape"])
        return tuple(self.shapes[t["like"]])

    def set_device_memory(self, memory, size):
        if memory % ALIGN or size < self.engine.device_memory_size_v2:
            raise RuntimeError(f"device memory {memory:#x} ({size} bytes) is unaligned or too small")
        self.memory = memory

    def execute_async_v3(self, stream_handle):
        e = self.engine
        problems = []
        if self._config is not None and self._config() is None:
            problems.append("the IRuntimeConfig of this context was destroyed")
        if not e.refitted:
            problems.append("a stripped engine was not refitted")
        if not e.weights_loaded:
            problems.append("weights are unloaded")
        if self.user_managed and self.memory is None:
            problems.append("no device memory set")
        if not self.inferred:
            problems.append("shapes not inferred")
        problems += [f"no address for {n}" for n in self.tensors if n not in self.addresses]
        if problems:
            e.runtime.logger.error("; ".join(problems))
            return False
        for out in e.plan["outputs"]:  # output = its source input's bytes
            src = self.tensors[out["like"]]
            n = _numel(self.shapes[out["like"]]) * _bytes_of(src["dtype"])
            ctypes.memmove(self.addresses[out["name"]], self.addresses[out["like"]], n)
        self.executions.append({"stream": stream_handle, "addresses": dict(self.addresses)})
        return True


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


class _Prototype:
    """What get_weights_prototype returns: a real trt.Weights carries `dtype` and `size` (checked in tests)."""

    def __init__(self, dtype, size):
        self.dtype, self.size = dtype, size


@mirrors(real.Refitter)
class Refitter:
    def __init__(self, engine, logger):
        if not engine.refittable:
            raise RuntimeError("engine is not refittable")
        self.engine, self.logger, self.given = engine, logger, {}

    def get_all_weights(self):
        return list(self.engine.plan["refittable"])

    def get_weights_prototype(self, name):
        dtype, size = self.engine.plan["refittable"].get(name, ["FLOAT", -1])
        return _Prototype(getattr(real.DataType, dtype), size)

    def set_named_weights(self, name, weights):
        proto = self.get_weights_prototype(name)
        if proto.size < 0 or weights.dtype != proto.dtype or weights.size != proto.size:
            self.logger.error(f"{name}: weights of {weights.dtype} x {weights.size}, expected {proto.dtype} x {proto.size}")
            return False
        values = weights.numpy() if weights.dtype == real.DataType.FLOAT else None
        self.given[name] = None if values is None else [float(v) for v in values.reshape(-1)]
        return True

    def get_missing_weights(self):
        return [n for n in self.engine.plan["refittable"] if n not in self.given]

    def refit_cuda_engine(self):
        if self.get_missing_weights():
            self.logger.error("missing weights: " + ", ".join(self.get_missing_weights()))
            return False
        if self.engine.plan["refit"] == "identical":
            build = self.engine.plan["build_weights"]
            changed = [n for n, v in self.given.items() if v is not None and n in build and v != build[n]]
            if changed:
                self.logger.error(f"REFIT_IDENTICAL engine refitted with other weights: {', '.join(changed)}")
                return False
        self.engine.current = dict(self.given)
        self.engine.refitted = True
        STATS["refits"] += 1
        return True


@mirrors(real.IWeightsManager)
class IWeightsManager:
    def __init__(self, engine):
        self.engine = engine
        self.log = []  # (operation, stream)

    def get_size(self):
        return 512

    def save_to_buffer(self, destination, size, location, stream_handle):
        if size != self.get_size() or location != real.TensorLocation.HOST or not self.engine.weights_loaded:
            return False
        ctypes.memset(destination, 7, size)
        self.log.append(("save", stream_handle))
        return True

    def unload(self, stream_handle):
        if not self.engine.weights_loaded:
            return False
        self.engine.weights_loaded = False
        self.log.append(("unload", stream_handle))
        return True

    def restore_from_buffer(self, source, size, location, stream_handle):
        if self.engine.weights_loaded or size != self.get_size() or ctypes.string_at(source, 1) != b"\x07":
            return False
        self.engine.weights_loaded = True
        self.log.append(("restore", stream_handle))
        return True


def module(flavour: str = "rtx"):
    """A stand-in `tensorrt_rtx` ("rtx") or full `tensorrt` ("trt": no CUDA-graph strategy, no runtime cache,
    no weights manager, no kernel specialization)."""
    rtx = flavour == "rtx"
    FLAVOUR["runtime_config"] = RTXRuntimeConfig if rtx else IRuntimeConfig
    FLAVOUR["engine"] = RTXCudaEngine if rtx else ICudaEngine
    m = types.SimpleNamespace(
        __version__=real.__version__, Runtime=Runtime, Refitter=Refitter, Weights=real.Weights,
        IStreamReaderV2=IStreamReaderV2, SeekPosition=real.SeekPosition, TensorLocation=real.TensorLocation,
        DataType=real.DataType, ExecutionContextAllocationStrategy=real.ExecutionContextAllocationStrategy,
        BuilderFlag=real.BuilderFlag)
    if rtx:
        m.CudaGraphStrategy = real.CudaGraphStrategy
        m.DynamicShapesKernelSpecializationStrategy = real.DynamicShapesKernelSpecializationStrategy
    return m


FLAVOUR = {"runtime_config": RTXRuntimeConfig, "engine": None}


class Backend:
    """What the executor uses of engine.backends.Backend, over the stand-in module."""

    name = "tensorrt-rtx"

    def __init__(self, flavour: str = "rtx"):
        self.trt = module(flavour)
        self.logger = Logger()
        self.version = real.__version__
        self.flavour = flavour

    def runtime_validity(self, path):
        return None


class Streams:
    """Records which stream each copy ran on (runtime.tensorrt.CudaStreams' interface, on the CPU)."""

    device = "cpu"

    def __init__(self):
        self.current = "default"
        self.copies = []  # (stream, shape) per copy
        self.released = 0
        self.synchronized = []

    def use(self, stream):
        import contextlib

        @contextlib.contextmanager
        def scope():
            old, self.current = self.current, (stream if stream is not None else self.current)
            try:
                yield
            finally:
                self.current = old

        return scope()

    def handle(self, stream):
        return stream if stream is not None else self.current

    def copy(self, dst, src):
        self.copies.append((self.current, tuple(src.shape)))
        dst.copy_(src)

    def synchronize(self, stream):
        self.synchronized.append(stream)

    def release_cache(self):
        self.released += 1
