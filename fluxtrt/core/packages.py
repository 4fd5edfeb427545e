"""Compiled PyTorch engines (AOTInductor `.pt2` packages) as the build and the runtime both see them: what a
package needs to run (the torch and CUDA versions and the device it was compiled for), how it is opened, and its
weights. A package holds the kernels only; its weights (the module's constants, as the build left them: an fp8
recipe's E4M3 weights in E4M3) are a safetensors file beside it, read once, straight to the device, and handed to
the package at load (AOTInductor's user-managed constants). With the weights inside, torch extracts a second copy
of them to a temporary folder on every load (docs/bench/aot_engines.json).
engine/aoti.py compiles them; runtime/executors.PackageExecutor runs them."""

from __future__ import annotations

import contextlib
from pathlib import Path

from ..errors import FluxtrtError

EXTENSION = ".pt2"
CONSTANTS = ".constants.safetensors"  # <component>.constants.safetensors beside <component>.pt2


def device_target(device) -> str:
    """What a package compiled on `device` runs on: "cpu", or the GPU's architecture ("sm90")."""
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def package_runtime(device) -> dict:
    """The runtime a package compiled here needs: torch version, CUDA version (None on a CPU), target, and the
    libstdc++ this process runs on (the build records its compiler's instead, engine/aoti.cxx_compiler)."""
    import torch

    target = device_target(device)
    return {"torch": torch.__version__, "cuda": torch.version.cuda if target != "cpu" else None, "target": target,
            "libstdc++": loaded_libstdcxx()}


def libstdcxx_version(path: str | None) -> str | None:
    """The version of a libstdc++ file, links followed ("6.0.33" for libstdc++.so.6.0.33), or None."""
    import os
    import re

    m = re.search(r"libstdc\+\+\.so\.(\d+\.\d+\.\d+)$", os.path.realpath(path)) if path else None
    return m.group(1) if m else None


def loaded_libstdcxx() -> str | None:
    """The version of the libstdc++ this process runs on (from its memory map; None where there is none)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "libstdc++.so" in line:
                    return libstdcxx_version(line.split()[-1])
    except OSError:
        pass
    return None


def _version(v: str) -> tuple:
    return tuple(int(x) for x in v.split("."))


def run_device(recorded: dict | None) -> str:
    """The torch device a package of this recorded runtime runs on: "cpu" or "cuda"."""
    return "cpu" if (recorded or {}).get("target") == "cpu" else "cuda"


def runtime_problem(recorded: dict, device) -> str | None:
    """Why a package built for `recorded` (package_runtime's dict) cannot load on `device` here, or None."""
    here = package_runtime(device)
    for key, what in (("target", "device"), ("torch", "torch"), ("cuda", "CUDA")):
        if recorded.get(key) != here.get(key):
            return f"it was compiled for {what} {recorded.get(key)}, this machine has {what} {here.get(key)}"
    built, have = recorded.get("libstdc++"), here.get("libstdc++")
    if built and have and _version(built) > _version(have):  # newer headers than the runtime: crashes on load
        return f"it was compiled against libstdc++ {built}, this machine's torch runs on the older libstdc++ {have}"
    return None


def load_package(path: Path, component: str, device):
    """The compiled module of a package (already checked against the manifest's sha256 and runtime); a package
    torch cannot open is one line."""
    try:
        return _open(str(path), _index(device))
    except Exception as e:
        raise _not_loadable(component, path, f"{type(e).__name__}: "
                            f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}") from None


def _open(path: str, device_index: int):
    """torch's loader for a package's default model, without aoti_load_package's device-information check: that
    check only warns, and to name this CPU's vector ISA it compiles and runs a test program per ISA with g++, which
    took 53 s of a fresh process's first package load on the H100's machine (scripts/aot_engines.py kernels,
    docs/bench/aot_engines.json). The manifest's runtime (target, torch, CUDA) is checked before this instead.
    Nor through torch.export.pt2_archive, whose import (torch._export's serializer, torch._dynamo) costs seconds
    of a fresh process: `Compiled` calls the loader as its AOTICompiledModel does.
    Single-threaded: the default container waits on CUDA events for a free model instance, which a CUDA graph
    capture refuses ("operation not permitted when stream is capturing", the H100's `run --cuda-graph`); a
    pipeline calls its executors from one thread at a time."""
    import torch

    # the custom ops that packages built on a GPU call: fp8-attn's FlashInfer attention and its single-stream norm +
    # RoPE + quantize (Hopper), fp8's GELU + quantize
    from ..kernels import flashinfer_fp8_attention, gelu_quantize, norm_rope_quantize  # noqa: F401

    return Compiled(torch._C._aoti.AOTIModelPackageLoader(path, "model", True, 1, device_index))


class Compiled:
    """A loaded package's model called with tensors (positional, as the spec orders its inputs), as torch's
    AOTICompiledModel calls it: the flat tensors in, the outputs rebuilt by the package's output spec."""

    def __init__(self, loader):
        from torch.utils import _pytree as pytree

        self.loader = loader
        self._out_spec = pytree.treespec_loads(loader.get_call_spec()[1])

    def __call__(self, *args):
        from torch.utils import _pytree as pytree

        return pytree.tree_unflatten(self.loader.boxed_run(list(args)), self._out_spec)

    def get_constant_fqns(self) -> list[str]:
        return self.loader.get_constant_fqns()

    def load_constants(self, constants: dict, *, check_full_update: bool, user_managed: bool = False) -> None:
        self.loader.load_constants(constants, False, check_full_update, user_managed)  # torch 2.11 has 4 parameters


def needed_libraries(elf: bytes) -> list[str] | None:
    """The shared libraries an ELF64 (little-endian) shared object names as DT_NEEDED, or None where `elf` is not
    one this can read."""
    import struct

    try:
        if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
            return None
        shoff, = struct.unpack_from("<Q", elf, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
        # (name, type, flags, addr, offset, size, link, info, addralign, entsize) of each section
        sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
        out = []
        for sec in sections:
            if sec[1] != 6:  # SHT_DYNAMIC; its link is the string table of the names
                continue
            strtab = sections[sec[6]][4]
            for at in range(sec[4], sec[4] + sec[5], 16):
                tag, value = struct.unpack_from("<qQ", elf, at)
                if tag == 0:
                    break
                if tag == 1:  # DT_NEEDED
                    out.append(elf[strtab + value:elf.index(b"\0", strtab + value)].decode())
        return out
    except (struct.error, IndexError, ValueError, UnicodeDecodeError):
        return None


def links_shared_libstdcxx(path: Path) -> bool:
    """Whether every compiled library inside the package names the shared libstdc++ (as packages fluxtrt builds
    do, engine/aoti.cxx_compiler): a wrapper with libstdc++ linked statically crashed on load in std::regex on the
    H200 (docs/bench/aot_engines.json). False for anything unreadable."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            libs = [i for i in z.infolist() if i.filename.endswith(".so")]
            if not libs:
                return False
            for info in libs:
                needed = needed_libraries(z.read(info))
                if needed is None or not any(n.startswith("libstdc++.so") for n in needed):
                    return False
        return True
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


# what the child process of probe_load runs: each package's kernels loaded in turn by _open (a CUDA package needs
# no weights for that), its index printed first, so that a crash names the package it died in
_PROBE = """import sys
from fluxtrt.core.packages import _open
for i, path in enumerate(sys.argv[2:]):
    print(i, flush=True)
    _open(path, int(sys.argv[1]))
"""


def probe_load(paths: dict, device) -> None:
    """Load the packages' kernels ({component: path}) once in one child process: a package that crashes the
    process on load (every one whose wrapper linked libstdc++ statically SIGSEGVed in aoti_load_package on the H200,
    docs/bench/aot_engines.json; the build now avoids such compilers, engine/aoti.cxx_compiler) is one line here,
    not a dead `fluxtrt run` or server replica. The caller remembers packages that loaded."""
    import os
    import signal
    import subprocess
    import sys

    import torch

    names = list(paths)
    here = str(Path(__file__).resolve().parents[2])  # where this fluxtrt is imported from: the child imports it too
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (here, os.environ.get("PYTHONPATH")))))
    try:
        p = subprocess.run([sys.executable, "-c", _PROBE, str(_index(device)), *map(str, paths.values())],
                           capture_output=True, text=True, timeout=900, env=env)
    except subprocess.TimeoutExpired:
        raise FluxtrtError(f"{', '.join(names)}: loading their packages did not finish in 15 minutes; check the GPU "
                           "with nvidia-smi") from None
    done = p.stdout.split()
    component = names[int(done[-1])] if done and done[-1].isdigit() and int(done[-1]) < len(names) else names[0]
    path = Path(paths[component])
    if p.returncode < 0:
        sig = signal.Signals(-p.returncode).name
        raise FluxtrtError(f"{component}: this torch {torch.__version__} crashes loading {path.name} ({sig} inside "
                           "torch's package loader, as packages whose C++ compiler linked libstdc++ "
                           "statically do); rebuild it here with `fluxtrt build --backend torch`, or run the JIT "
                           "path instead (`fluxtrt run --backend torch --model MODEL --compile`)")
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1][:200]
        raise _not_loadable(component, path, last)


def _not_loadable(component: str, path: Path, why: str) -> FluxtrtError:
    """The one line for a package this torch refuses (in this process or the probe's)."""
    return FluxtrtError(f"{component}: {path} is not a package this torch can load ({why}); rebuild it with "
                        "`fluxtrt build --backend torch`")


def _index(device) -> int:
    import torch

    device = torch.device(device)
    return -1 if device.type == "cpu" else (device.index if device.index is not None else torch.cuda.current_device())


def save_constants(tensors: dict, path: Path) -> dict:
    """The package's constants {name: tensor} as one safetensors file (temp name, renamed): {"file",
    "tree_sha256", "bytes"} for the manifest (fileio.tree_sha256: checked at load on several cores)."""
    import torch
    from safetensors.torch import save_file

    from ..fileio import atomic_path, tree_sha256

    path = Path(path)
    host = {k: (v.detach().cpu() if v.device.type != "cpu" else v.detach().clone()).contiguous()
            for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    with atomic_path(path) as tmp:
        save_file(host, str(tmp))
    return {"file": path.name, "tree_sha256": tree_sha256(path), "bytes": path.stat().st_size}


def read_constants(path: Path, recorded: dict, device, component: str) -> dict:
    """The constants file read once, straight into tensors allocated on `device`, checked as it is read: the file's
    64 MiB pieces (fileio.tree_sha256's) go to up to 8 threads, each reading its piece into a reused buffer (pinned
    on a GPU: the copy is DMA on the thread's own stream), hashing it and copying its bytes to the tensors they
    belong to. The size and tree_sha256 must be the manifest's (a truncated or changed file is one line, nothing
    kept). The reader before (one read stream, a second read for the hash, pageable copies) ran at 1.2-1.3 GB/s on
    the H100's machine (docs/bench/aot_engines.json)."""
    import hashlib
    import os
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from .. import fileio
    from ..checkpoint import read_header
    from ..dtypes import BY_SAFETENSORS

    path = Path(path)
    fix = "build the packages again with `fluxtrt build --backend torch`, or unpack the archive again"
    if not path.is_file() or path.stat().st_size != recorded.get("bytes"):
        raise FluxtrtError(f"{component}: {path} is missing or not the size the manifest records; {fix}")
    device = torch.device(device)
    cuda = device.type == "cuda"
    out, spans = {}, []
    for key, t in read_header(path).items():
        out[key] = torch.empty(t.shape, dtype=getattr(torch, BY_SAFETENSORS[t.dtype].numpy), device=device)
        if t.length:
            spans.append((t.offset, t.offset + t.length, out[key].reshape(-1).view(torch.uint8)))
    spans.sort(key=lambda s: s[0])
    chunk, size = fileio.TREE_CHUNK, recorded["bytes"]
    local = threading.local()

    def piece(i):
        if not hasattr(local, "buf"):
            local.buf = torch.empty(chunk, dtype=torch.uint8, pin_memory=cuda)
            local.stream = torch.cuda.Stream(device) if cuda else None
        lo = i * chunk
        want = min(chunk, size - lo)
        n = os.preadv(fd, [local.buf.numpy()[:want]], lo)
        if n != want:
            raise FluxtrtError(f"{component}: {path} is truncated; {fix}")
        digest = hashlib.sha256(local.buf.numpy()[:n]).digest()
        with torch.cuda.stream(local.stream) if cuda else contextlib.nullcontext():
            for start, end, dst in spans:  # the tensors' bytes inside [lo, lo + n)
                a, b = max(start, lo), min(end, lo + n)
                if a < b:
                    dst[a - start:b - start].copy_(local.buf[a - lo:b - lo], non_blocking=cuda)
        if cuda:
            local.stream.synchronize()  # the buffer is refilled next
        return digest

    fd = os.open(path, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
            digests = list(pool.map(piece, range(max(1, -(-size // chunk)))))
    finally:
        os.close(fd)
    if hashlib.sha256(b"".join(digests)).hexdigest() != recorded.get("tree_sha256"):
        raise FluxtrtError(f"{component}: {path} is not the file the manifest records (tree_sha256 differs: "
                           f"corrupted or replaced); {fix}")
    return out


def open_package(path: Path, constants: Path, recorded: dict, device, component: str, *, before_load=None,
                 adjust=None, read: dict | None = None):
    """A package ready to run: its kernels loaded and its weights file (`recorded`: the manifest's {"file",
    "tree_sha256", "bytes"}) read to `device` and handed over as user-managed constants; `adjust(weights)` changes
    them in place first (LoRAs merged); `before_load()` (the folder's probe, running beside) is awaited after the
    read, before the kernels load here. Returns (compiled module, weights): the module reads the weights in place,
    so the caller keeps both alive together. `read`: the weights file as read_constants read it already (a
    prefetch)."""
    weights = read if read is not None else read_constants(constants, recorded, device, component)
    if adjust is not None:
        adjust(weights)
    if before_load is not None:
        before_load()
    fn = load_package(path, component, device)
    wanted = fn.get_constant_fqns()
    missing = sorted(set(wanted) - set(weights))
    if missing:
        raise FluxtrtError(f"{component}: its weights file lacks {len(missing)} of the package's constants "
                           f"({', '.join(missing[:3])}): build it again with `fluxtrt build --backend torch`")
    fn.load_constants({k: weights[k] for k in wanted}, check_full_update=True, user_managed=True)
    return fn, weights

