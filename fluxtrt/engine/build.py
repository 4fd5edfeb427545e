"""Build one serialized engine from one ONNX file: parse (strongly typed), one optimization profile from
the component spec, backend target settings, then stream the plan to disk (a full-size plan is as large as the
weights; it is never held whole in memory)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..components import ComponentSpec, Geometry, ShapeRange
from ..core.backends import Backend
from ..errors import (
    BuildError,  # noqa: F401 - defined in errors.py, raised here
)


@dataclass
class BuiltEngine:
    bytes: int  # of the plan streamed to `engine_path` as TensorRT wrote it (never whole in memory)
    sha256: str
    layers: int
    inputs: list[dict]
    outputs: list[dict]
    profile: dict  # input name -> {"min": [...], "opt": [...], "max": [...]} as read back from TensorRT
    memory: dict | None = None  # the builder's report: activations (profile max), weights, persistent; bytes
    computed_layers: int | None = None  # layers that read an input (the rest TensorRT evaluates once, at build)


def computed_layers(network) -> int:
    """Layers of a parsed network that depend on a network input. The others read only constants (weights,
    a linked weight's Transpose or Concat, shape arithmetic on constants): TensorRT evaluates them at build
    time, so they are not work done per inference."""
    constant, count = set(), 0
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        ins = [layer.get_input(j) for j in range(layer.num_inputs)]
        if all(t is None or t.name in constant for t in ins):
            constant.update(layer.get_output(j).name for j in range(layer.num_outputs))
        else:
            count += 1
    return count


def _dims(shape) -> list[int]:
    return [int(d) for d in shape]


def apply_profile(network, profile, shapes: dict, component: str) -> None:
    """Set min/opt/max per input; names are checked against the network, listing the ones it has."""
    net_inputs = {network.get_input(i).name: network.get_input(i) for i in range(network.num_inputs)}
    unknown = sorted(set(shapes) - set(net_inputs))
    missing = sorted(set(net_inputs) - set(shapes))
    if unknown or missing:
        raise BuildError(f"{component}: profile inputs {unknown or ''} not in the network, network inputs "
                         f"{missing or ''} without a profile; the network has {', '.join(net_inputs)}")
    for name, (lo, opt, hi) in shapes.items():
        dims = _dims(net_inputs[name].shape)
        for axis, d in enumerate(dims):
            if d != -1 and not lo[axis] == opt[axis] == hi[axis] == d:
                raise BuildError(f"{component}: input {name} has static size {d} on axis {axis} but the profile "
                                 f"asks {lo[axis]}..{hi[axis]}")
        profile.set_shape(name, lo, opt, hi)


def builder_flags(trt, weight_streaming: bool, weightless: bool) -> list:
    """Builder flags beyond the defaults. Weightless engines are stripped and refitted at load with the user's
    weights, which differ from the build's: REFIT, not REFIT_IDENTICAL ("Different weights during refits yield
    unpredictable behavior", BuilderFlag docstring of TensorRT-RTX 1.7; NVIDIA's sample pairs STRIP_PLAN with
    REFIT)."""
    flags = [trt.BuilderFlag.WEIGHT_STREAMING] if weight_streaming else []
    if weightless:
        flags += [trt.BuilderFlag.STRIP_PLAN, trt.BuilderFlag.REFIT]
    return flags


def _plan_writer(trt, f):
    """A TensorRT stream writer that appends each chunk of the plan to `f` and hashes it on the way."""
    import hashlib

    class PlanWriter(trt.IStreamWriter):
        def __init__(self):
            trt.IStreamWriter.__init__(self)
            self.bytes, self.sha, self.error = 0, hashlib.sha256(), None

        def write(self, data) -> int:
            try:
                f.write(data)
            except OSError as e:  # e.g. disk full: TensorRT sees a short write and fails the build
                self.error = e
                return 0
            self.sha.update(data)
            self.bytes += len(data)
            return len(data)

    return PlanWriter()


class MappedWeights:
    """Read-only memory maps of an ONNX file's external data, handed to TensorRT's parser as pointers
    (`load_initializer`: the parser keeps no copy). While TensorRT's builder runs, a thread drops the maps'
    resident pages every `interval` seconds (MADV_DONTNEED on a read-only file map: a later read faults the page
    back in from the page cache, unchanged), so the weights TensorRT has already copied are not held a second
    time by this process; the kernel may reclaim them like any cached file."""

    interval = 0.5  # seconds between page drops

    def __init__(self):
        self.maps: dict = {}
        self._stop = None

    def pointer(self, path: Path, offset: int, length: int) -> int:
        import mmap

        import numpy as np

        if path not in self.maps:
            with open(path, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self.maps[path] = (m, np.frombuffer(m, dtype=np.uint8))
        m, view = self.maps[path]
        if offset + length > len(m):
            raise BuildError(f"{path.name}: a tensor points past the end of the file")
        return view.ctypes.data + offset

    def drop_pages(self) -> None:
        import mmap

        for m, _ in self.maps.values():
            m.madvise(mmap.MADV_DONTNEED)

    def __enter__(self):
        import mmap
        import threading

        if self.maps and hasattr(mmap, "MADV_DONTNEED"):
            self._stop = threading.Event()

            def loop():
                while not self._stop.wait(self.interval):
                    self.drop_pages()

            self._thread = threading.Thread(target=loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._stop is not None:
            self._stop.set()
            self._thread.join()


def _parse(parser, onnx_path: Path) -> MappedWeights | None:
    """Parse an ONNX file, its external weights handed over as pointers into memory maps (see MappedWeights);
    None when parsing failed. The maps must outlive the parser and the build."""
    from ..onnxio import external_info, load_header, resolve_external

    model = load_header(onnx_path)
    external = [t for t in model.graph.initializer if external_info(t) is not None]
    weights = MappedWeights()
    if not external or not hasattr(parser, "load_initializer"):
        return weights if parser.parse_from_file(str(onnx_path)) else None
    if not parser.load_model_proto(onnx_path.read_bytes(), str(onnx_path)):
        return None
    for t in external:
        info = external_info(t)
        path = resolve_external(onnx_path, info["location"])
        offset = int(info.get("offset", 0))
        length = int(info["length"]) if "length" in info else path.stat().st_size - offset
        if not parser.load_initializer(t.name, weights.pointer(path, offset, length), length):
            return None
    return weights if parser.parse_model_proto() else None


def build_engine(backend: Backend, onnx_path: Path, spec: ComponentSpec, geo: Geometry, shape_range: ShapeRange,
                 *, compute_capability: str, engine_path: Path, weight_streaming: bool = False,
                 optimization_level: int = 3, timing_cache: Path | None = None, log_file=None,
                 weightless: bool = False) -> BuiltEngine:
    """Parse `onnx_path`, build, and stream the plan to a temp name renamed to `engine_path` on success."""
    from ..fileio import atomic_file

    trt = backend.trt
    logger = backend.logger
    logger.file, logger.errors, logger.memory, logger.cpu_note = log_file, [], {}, False
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    weights = _parse(parser, Path(onnx_path))  # memory maps the parser reads from: alive until the build ends
    if weights is None:
        errs = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BuildError(f"{backend.name} could not parse {onnx_path.name}: {errs}")
    config = builder.create_builder_config()
    backend.configure(config, compute_capability)
    config.builder_optimization_level = optimization_level
    for flag in builder_flags(trt, weight_streaming, weightless):
        config.set_flag(flag)
    cache = None
    if timing_cache is not None and backend.uses_timing_cache and hasattr(config, "create_timing_cache"):
        blob = timing_cache.read_bytes() if timing_cache.exists() else b""
        cache = config.create_timing_cache(blob)
        config.set_timing_cache(cache, ignore_mismatch=True)
    profile = builder.create_optimization_profile()
    apply_profile(network, profile, spec.profile(shape_range, geo), spec.name)
    config.add_optimization_profile(profile)
    with atomic_file(engine_path) as f:  # any error below removes the temp file; the old engine stays
        writer = _plan_writer(trt, f)
        with weights:
            ok = builder.build_serialized_network_to_stream(network, config, writer)
        if writer.error is not None:  # the CLI says "no space left ... while writing <engine>" for ENOSPC
            raise OSError(writer.error.errno, writer.error.strerror, str(engine_path)) from writer.error
        if not ok or writer.bytes == 0:
            detail = "; ".join(logger.errors) or "no detail"
            if weightless:
                raise BuildError(f"{backend.name} could not build {spec.name} as a weightless (refittable) engine: "
                                 f"{detail[:300]}. {backend.name} {backend.version} builds weightless engines only "
                                 "where the build machine has a supported GPU; build there, or drop --weightless")
            raise BuildError(f"{backend.name} failed to build {spec.name}: {detail}")
    if cache is not None:
        from ..fileio import write_bytes_atomic

        write_bytes_atomic(timing_cache, bytes(cache.serialize()))

    def io(t):
        return {"name": t.name, "dtype": str(t.dtype).split(".")[-1].lower(), "shape": _dims(t.shape)}

    inputs = [io(network.get_input(i)) for i in range(network.num_inputs)]
    outputs = [io(network.get_output(i)) for i in range(network.num_outputs)]
    read_back = {
        i["name"]: dict(zip(("min", "opt", "max"), (_dims(s) for s in profile.get_shape(i["name"]))))
        for i in inputs
    }
    logger.file = None
    built = BuiltEngine(bytes=writer.bytes, sha256=writer.sha.hexdigest(), layers=network.num_layers, inputs=inputs,
                        outputs=outputs, profile=read_back,
                        memory=dict(logger.memory) or None, computed_layers=computed_layers(network))
    del parser, network  # before the memory maps their weights point into
    del weights
    return built
