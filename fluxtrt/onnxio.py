"""Reading ONNX files whose initializers live outside them, including zero-copy exports whose external data
is a symbolic link into the user's safetensors checkpoint (see `zerocopy.py`).

onnx and ONNX Runtime refuse external data reached through a link (a guard against path tricks; onnx also
refuses hard links). TensorRT's parser follows links. Here: `load_onnx` reads such data itself (following the
links fluxtrt made, and only those inside `<stem>.weights/`), and `ort_session` hands ONNX Runtime the linked
tensors as memory-mapped arrays, so a zero-copy graph runs without copying the checkpoint anywhere."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import FluxtrtError


def external_info(t) -> dict | None:
    from onnx import TensorProto

    if t.data_location != TensorProto.EXTERNAL:
        return None
    return {e.key: e.value for e in t.external_data}


def set_external(t, location: str, offset: int, length: int) -> None:
    """Make tensor `t` external data at (location, offset, length), dropping any data it held."""
    from onnx import TensorProto

    for f in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
        t.ClearField(f)
    del t.external_data[:]
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = k, v


def linked_dir(onnx_path: Path) -> Path:
    """Where a zero-copy export keeps its links to the checkpoint's files."""
    return Path(onnx_path).with_suffix(".weights")


def has_linked_data(onnx_path: Path) -> bool:
    return linked_dir(onnx_path).is_dir()


def resolve_external(onnx_path: Path, location: str) -> Path:
    base = Path(onnx_path).parent
    path = base / location
    links = linked_dir(onnx_path)
    inside = os.path.normpath(path).startswith(os.path.normpath(links) + os.sep)
    if path.is_symlink() and not inside:
        raise FluxtrtError(f"{onnx_path}: external data '{location}' is a link outside {links.name}/; refusing it")
    if not path.exists():
        raise FluxtrtError(f"{onnx_path}: its weights file {location} is missing"
                           + (" (the checkpoint it points into was moved or deleted; export again)" if inside else ""))
    return path


def read_external(onnx_path: Path, t):
    """The raw bytes of one external tensor (memory-mapped view for linked checkpoint files)."""
    import mmap

    info = external_info(t)
    path = resolve_external(onnx_path, info["location"])
    offset, length = int(info.get("offset", 0)), info.get("length")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        length = int(length) if length is not None else size - offset
        if offset + length > size:
            raise FluxtrtError(f"{onnx_path}: tensor {t.name} points past the end of {info['location']}")
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return memoryview(m)[offset:offset + length]


def load_header(onnx_path: Path):
    """The ONNX model's proto without its external data, checked: an empty, truncated or corrupt file (or one that
    holds no graph) is one line naming it, never a protobuf traceback. The one way fluxtrt opens an ONNX file."""
    import onnx
    from google.protobuf.message import DecodeError

    path = Path(onnx_path)
    fix = "export it again (`fluxtrt export`, or `fluxtrt build` reuses nothing broken)"
    try:
        size = path.stat().st_size
        model = onnx.load(str(path), load_external_data=False) if size else None
    except OSError as e:
        raise FluxtrtError(f"cannot read {path}: {e.strerror}; {fix}") from None
    except (DecodeError, ValueError, RuntimeError) as e:
        raise FluxtrtError(f"{path} is not an ONNX model (truncated or corrupt: {type(e).__name__}); {fix}") from None
    if model is None or not model.graph.node or not model.opset_import:
        raise FluxtrtError(f"{path} is not an ONNX model ({'empty' if not size else 'no graph in it'}); {fix}")
    return model


def load_onnx(onnx_path: Path, load_data: bool = True, skip=()):
    """onnx.load that also follows fluxtrt's links into a checkpoint (data copied into the proto); tensors
    named in `skip` are left unloaded (they are filled from elsewhere)."""
    from onnx import TensorProto

    model = load_header(onnx_path)
    if not load_data:
        return model
    for t in _all_tensors(model.graph):
        if external_info(t) is not None and t.name not in skip:
            t.raw_data = bytes(read_external(onnx_path, t))
            del t.external_data[:]
            t.data_location = TensorProto.DEFAULT
    return model


def load_linked(onnx_path: Path):
    """A zero-copy graph for the graph passes: vectors (biases, norm scales: kilobytes even at full size) are
    read into the proto; matrices stay links into the checkpoint, never read (onnx-graphsurgeon keeps them as
    lazy constants and writes their references back unchanged)."""
    from onnx import TensorProto

    model = load_header(onnx_path)
    for t in model.graph.initializer:
        if external_info(t) is not None and len(t.dims) <= 1:
            t.raw_data = bytes(read_external(onnx_path, t))
            del t.external_data[:]
            t.data_location = TensorProto.DEFAULT
    return model


def copy_links(src_onnx: Path, dest_onnx: Path) -> None:
    """Give `dest_onnx` the same links into the checkpoint as `src_onnx` (its external data says where)."""
    src, dest = linked_dir(src_onnx), linked_dir(dest_onnx)
    if src.is_dir():
        dest.mkdir()
        for link in src.iterdir():
            os.symlink(os.readlink(link), dest / link.name)


def _all_tensors(graph):
    import onnx

    yield from graph.initializer
    for n in graph.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                yield a.t
            elif a.type == onnx.AttributeProto.GRAPH:
                yield from _all_tensors(a.g)


def linked_arrays(onnx_path: Path, model=None) -> dict:
    """name -> numpy array (memory-mapped, read-only) for every initializer that lives in a linked file."""
    import numpy as np
    from onnx import helper

    model = model if model is not None else load_onnx(onnx_path, load_data=False)
    out = {}
    for t in model.graph.initializer:
        info = external_info(t)
        if info is None or not (Path(onnx_path).parent / info["location"]).is_symlink():
            continue
        np_dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
        out[t.name] = np.frombuffer(read_external(onnx_path, t), dtype=np_dtype).reshape(tuple(t.dims))
    return out


def onnxruntime():
    """The onnxruntime module, or one line saying how to install it (an extra: `cpu` or `gpu`, one of the two)."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise FluxtrtError("ONNX Runtime is not installed: pip install 'fluxtrt[cpu]' (or 'fluxtrt[gpu]' for "
                           "onnxruntime-gpu; install one of the two, not both)") from None
    return ort


def ort_value(arr):
    """A host array as an OrtValue over the same memory; bf16 / fp8 (ml_dtypes, which ONNX Runtime's numpy
    bridge refuses) passed as raw bytes of their ONNX type."""
    import numpy as np

    from .dtypes import TABLE, onnx_enum

    ort = onnxruntime()
    d = next((d for d in TABLE if d.numpy == arr.dtype.name), None)
    if d is not None and d.name in ("bf16", "fp8"):
        raw = arr.view(np.uint16 if arr.dtype.itemsize == 2 else np.uint8)
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(raw, onnx_enum(d))
    return ort.OrtValue.ortvalue_from_numpy(arr)


def ort_session(onnx_path: Path, providers=("CPUExecutionProvider",), options=None, overrides=None):
    """An ONNX Runtime session; linked initializers are passed in memory-mapped (ORT refuses the links), and
    `overrides` (name -> array) replace initializers (a weight-free ONNX filled from a checkpoint)."""
    import numpy as np

    ort = onnxruntime()
    options = options or ort.SessionOptions()
    arrays = linked_arrays(onnx_path) if has_linked_data(onnx_path) else {}
    arrays.update({k: np.ascontiguousarray(v) for k, v in (overrides or {}).items()})
    if arrays:
        values = [ort_value(a) for a in arrays.values()]
        options.add_external_initializers(list(arrays), values)
    session = ort.InferenceSession(str(onnx_path), options, providers=list(providers))
    session._fluxtrt_keepalive = arrays  # the session reads these buffers for its whole life
    return session
