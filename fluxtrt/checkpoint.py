"""Safetensors checkpoints without loading them: headers, the shard index of a component folder, reading one
stored tensor, and links that let an ONNX file's external data point straight at a shard.

Used by export (zero-copy links, filling a copying export), the weight map (weights from a user's checkpoint),
refit and LoRA. ONNX external data = file, offset, length; safetensors stores each tensor raw at a known offset,
so the two meet without a copy."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from .dtypes import BY_SAFETENSORS, LINKABLE, np_dtype
from .errors import FluxtrtError


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file: where its bytes are."""

    file: Path
    offset: int  # absolute, from the start of the file
    length: int
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple


def read_header(path: Path) -> dict[str, StoredTensor]:
    """Every tensor of one safetensors file, the header checked as untrusted input: JSON object of entries with a
    known dtype, a shape of non-negative integers, offsets inside the data and of the shape's byte length, and no
    two tensors sharing bytes. One line naming the file and the tensor otherwise."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise FluxtrtError(f"{path} is not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100_000_000:
                raise FluxtrtError(f"{path} is not a safetensors file (header of {n} bytes)")
            header = json.loads(f.read(n))
            size = os.fstat(f.fileno()).st_size
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise FluxtrtError(f"{path} is not a safetensors file (unreadable header)") from None
    except OSError as e:
        raise FluxtrtError(f"cannot read {path}: {e.strerror}") from None
    if not isinstance(header, dict):
        raise FluxtrtError(f"{path} is not a safetensors file (its header is not a JSON object)")
    start = 8 + n
    out = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        t = _stored(path, key, meta, start, size)
        out[key] = t
    spans = sorted((t.offset, t.offset + t.length, k) for k, t in out.items() if t.length)
    for (_, a1, ka), (b0, _, kb) in zip(spans, spans[1:]):
        if b0 < a1:
            raise FluxtrtError(f"{path}: tensors {ka!r} and {kb!r} share bytes (the header is damaged or hostile); "
                               "download or convert the checkpoint again")
    return out


def _stored(path: Path, key: str, meta, start: int, size: int) -> StoredTensor:
    def bad(why: str) -> FluxtrtError:
        return FluxtrtError(f"{path}: tensor {key!r} {why}; the file is damaged or not a safetensors checkpoint")

    if not isinstance(meta, dict):
        raise bad("has no entry object")
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if dtype not in BY_SAFETENSORS:
        raise bad(f"has dtype {dtype!r}, which fluxtrt does not read ({', '.join(BY_SAFETENSORS)})")
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0  # noqa: E731
    if not isinstance(shape, list) or len(shape) > 8 or not all(is_int(v) for v in shape):
        raise bad(f"has shape {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_int(v) for v in offsets) or offsets[0] > offsets[1]:
        raise bad(f"has data_offsets {offsets!r}")
    a, b = offsets
    if start + b > size:
        raise FluxtrtError(f"{path} is truncated ({size} bytes, tensor {key!r} ends at {start + b}); "
                           "download or copy it again")
    numel = 1
    for v in shape:
        numel *= v
    itemsize = np_dtype(BY_SAFETENSORS[dtype].numpy).itemsize
    if numel * itemsize != b - a:
        raise bad(f"{dtype}{shape} needs {numel * itemsize} bytes, its offsets give {b - a}")
    return StoredTensor(Path(path), start + a, b - a, dtype, tuple(shape))


def checkpoint_index(folder: Path) -> dict[str, StoredTensor]:
    """Every tensor of every `*.safetensors` shard in a component folder, by name."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FluxtrtError(f"{folder} holds no .safetensors files; zero-copy export needs safetensors weights "
                           "(convert the checkpoint, or export without --zero-copy)")
    index: dict[str, StoredTensor] = {}
    for f in files:
        for key, t in read_header(f).items():
            if key in index:
                raise FluxtrtError(f"tensor {key} is stored twice ({index[key].file.name}, {f.name})")
            index[key] = t
    return index


def has_safetensors(folder: Path) -> bool:
    return any(Path(folder).glob("*.safetensors"))


def checkpoint_dtype(index: dict[str, StoredTensor], folder: Path) -> str:
    """The one float dtype the component is stored in (zero-copy keeps it; mixed checkpoints are refused)."""
    floats = {t.dtype for t in index.values() if t.dtype in ("F32", "F16", "BF16")}
    unknown = {t.dtype for t in index.values()} - set(LINKABLE)
    if unknown:
        raise FluxtrtError(f"{folder} stores dtypes {sorted(unknown)} that zero-copy export does not map to ONNX; "
                           "export without --zero-copy")
    if len(floats) != 1:
        raise FluxtrtError(f"{folder} mixes float dtypes {sorted(floats)}; zero-copy export keeps the stored dtype "
                           "and needs one; export without --zero-copy")
    return BY_SAFETENSORS[floats.pop()].name


def numpy_name(t: StoredTensor) -> str:
    return BY_SAFETENSORS[t.dtype].numpy


def read_stored(t: StoredTensor):
    """One safetensors tensor as a numpy array."""
    import numpy as np

    with open(t.file, "rb") as f:
        f.seek(t.offset)
        raw = f.read(t.length)
    if len(raw) != t.length:
        raise FluxtrtError(f"{t.file} is truncated; download or copy it again")
    return np.frombuffer(raw, dtype=np_dtype(numpy_name(t))).reshape(t.shape)


def check_finite(arr, file, key: str):
    """`arr` as is, or one line naming the file and tensor when a float tensor holds NaN or Inf (a broken download or
    fine-tune): said when the weights load, not blamed on the engine's precision after a run."""
    import numpy as np

    if arr.dtype.kind in "iub":
        return arr
    try:
        finite = bool(np.isfinite(arr).all())
    except TypeError:  # a float type numpy's ufunc lacks: compare in fp32
        finite = bool(np.isfinite(arr.astype(np.float32)).all())
    if not finite:
        raise FluxtrtError(f"{file}: tensor {key} holds NaN or Inf; this checkpoint is broken (download or export it "
                           "again)")
    return arr


class CheckpointReader:
    """Tensors of one component folder's safetensors shards, read by key."""

    def __init__(self, folder):
        self.folder = folder
        self.index = checkpoint_index(folder)

    def __call__(self, key: str):
        t = self.index.get(key)
        if t is None:
            raise FluxtrtError(f"your checkpoint {self.folder} has no tensor '{key}', which the engine needs; "
                               "is it the same model (dev/schnell, same architecture) the engines were built for?")
        return check_finite(read_stored(t), t.file, key)


def link(links: Path, stored: StoredTensor) -> str:
    """The external-data location of `stored` as seen from the ONNX file: a link in `links` to its shard."""
    target = links / stored.file.name
    if not target.is_symlink():
        os.symlink(os.path.realpath(stored.file), target)
    return f"{links.name}/{stored.file.name}"


def check_stored(key: str, stored: StoredTensor, shape: tuple, onnx_type_name: str) -> None:
    if tuple(stored.shape) != tuple(shape) or BY_SAFETENSORS[stored.dtype].onnx != onnx_type_name:
        raise FluxtrtError(f"{key}: checkpoint has {stored.dtype}{list(stored.shape)}, the graph wants "
                           f"{onnx_type_name}{list(shape)}; the model's config does not match its weights")


def missing_tensor(index: dict[str, StoredTensor], name: str) -> FluxtrtError:
    """The error for a graph weight that the checkpoint does not hold."""
    return FluxtrtError(f"the checkpoint in {next(iter(index.values())).file.parent} has no tensor '{name}'; "
                        "it does not match the model's config")
