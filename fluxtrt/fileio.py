"""Atomic file writing and hashing: every artifact is written to a temp name and renamed into place,
so an interrupted run never leaves a file that a later run would trust."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path


def _umask_mode() -> int:
    """The mode a plain open() would give a new file (mkstemp makes 0600 files)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


TREE_CHUNK = 64 << 20  # tree_sha256's piece size (its record's name would change with it)


def tree_sha256(path: Path, workers: int | None = None) -> str:
    """sha256 of the concatenated sha256 digests of the file's consecutive 64 MiB pieces, the pieces hashed on
    `workers` threads at once (hashlib releases the GIL): a large file's check at several cores' rate, where one
    sha256 stream is one core's (about 0.5-1.5 GB/s). Not what `sha256sum` prints: records name it tree_sha256."""
    import os
    import threading
    from concurrent.futures import ThreadPoolExecutor

    fd = os.open(path, os.O_RDONLY)
    local = threading.local()  # one reused buffer per thread: a fresh 64 MiB object per piece costs as much as the hash
    try:
        pieces = max(1, -(-os.fstat(fd).st_size // TREE_CHUNK))

        def piece(i):
            if not hasattr(local, "buf"):
                local.buf = bytearray(TREE_CHUNK)
            n = os.preadv(fd, [local.buf], i * TREE_CHUNK)
            return hashlib.sha256(memoryview(local.buf)[:n]).digest()

        with ThreadPoolExecutor(workers or min(8, os.cpu_count() or 1)) as pool:
            digests = list(pool.map(piece, range(pieces)))
    finally:
        os.close(fd)
    return hashlib.sha256(b"".join(digests)).hexdigest()


def sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


@contextlib.contextmanager
def staging_dir(final_dir: Path, tag: str):
    """A temp folder inside `final_dir` (same filesystem, so renames are atomic); removed on exit."""
    final_dir = Path(final_dir)
    final_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{tag}-", dir=final_dir))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def publish(files: list[Path], final_dir: Path) -> list[Path]:
    """Rename staged files into `final_dir`, the last one last (the file readers look for first)."""
    out = []
    for f in files:
        dest = Path(final_dir) / f.name
        if f.is_dir() and dest.is_dir() and not dest.is_symlink():
            # a folder (of links) cannot be renamed over a non-empty one: move the old one aside first
            old = Path(tempfile.mkdtemp(prefix=f".tmp-old-{f.name}-", dir=final_dir))
            os.replace(dest, old / f.name)
            os.replace(f, dest)
            shutil.rmtree(old, ignore_errors=True)  # never follows the links inside
        else:
            os.replace(f, dest)
        out.append(dest)
    return out


def write_json_atomic(path: Path, obj) -> None:
    text = json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n"
    write_bytes_atomic(path, text.encode(), check_free=False)


@contextlib.contextmanager
def atomic_path(path: Path):
    """A temp name beside `path` (its suffix kept) for a writer that takes a path; on a clean exit it is renamed to
    `path` (readers see the old file or the new one), on an error removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", suffix=path.suffix, dir=path.parent)  # remove_stale_staging's prefix
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, _umask_mode())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_file(path: Path):
    """A binary file open on a temp name beside `path` (atomic_path); on a clean exit it is fsynced and renamed."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def write_bytes_atomic(path: Path, data: bytes, check_free: bool = True) -> None:
    """Write to a temp name beside `path`, fsync, then rename: readers see the old file or the new one."""
    if check_free:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        check_space(path, len(data))
    with atomic_file(path) as f:
        f.write(data)


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MB (Linux reports KB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def check_space(path: Path, needed: int) -> None:
    """Refuse before writing `needed` bytes where the disk has less free."""
    from .errors import FluxtrtError

    free = shutil.disk_usage(Path(path).parent).free
    if needed > free:
        raise FluxtrtError(f"not enough disk space for {path}: {needed / 1e6:.1f} MB needed, {free / 1e6:.1f} MB free; "
                           "free some space or write elsewhere with --out")


@contextlib.contextmanager
def exclusive_lock(folder: Path, what: str = "fluxtrt build"):
    """One writer per output folder: a second build into it fails at once with a clear message (the kernel
    releases the lock if the holder dies, so a killed build never blocks the next one)."""
    import fcntl

    from .errors import FluxtrtError

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lock_path = folder / ".fluxtrt.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            raise FluxtrtError(f"another {what} (pid {holder}) is writing to {folder}; wait for it to finish "
                               "or use another --out") from None
        try:  # the file may have been removed by the holder we waited on: then this lock guards nothing
            same = os.fstat(fd).st_ino == os.stat(lock_path).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            raise FluxtrtError(f"another {what} was finishing in {folder}; run again")
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock_path)  # leave no lock file behind (still held: nobody else can take it meanwhile)
    finally:
        os.close(fd)


def remove_stale_staging(folder: Path) -> int:
    """Staging folders and temp files (`.tmp-*`) left by a killed run (only call while holding the folder's lock)."""
    n = 0
    for tmp in sorted(Path(folder).rglob(".tmp-*"), key=lambda p: len(p.parts)):
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
            n += 1
        elif tmp.is_file() or tmp.is_symlink():
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            n += 1
    return n


def inside(folder: Path, rel, what: str) -> Path:
    """`folder / rel` for a path read from a file we did not just write (a manifest, a weight map, an archive):
    it must be a relative string that stays inside `folder` once links are followed; else one line naming it."""
    from .errors import FluxtrtError

    if not isinstance(rel, str) or not rel or "\x00" in rel or os.path.isabs(rel) or rel.startswith("\\"):
        raise FluxtrtError(f"{what} {rel!r} is not a relative path inside {folder}; the file was edited or "
                           "tampered with: rebuild or unpack the engines again")
    base = Path(folder).resolve()
    path = Path(folder) / rel
    resolved = path.resolve()
    if ".." in Path(rel).parts or not resolved.is_relative_to(base):
        raise FluxtrtError(f"{what} {rel!r} leads outside {folder} (to {resolved}); refusing to read it: rebuild or "
                           "unpack the engines again")
    return path


def check_out_folder(folder: Path, flag: str = "--out") -> None:
    """An output folder is a folder (or does not exist yet): never a file that writing would replace."""
    from .errors import FluxtrtError

    folder = Path(folder)
    for p in (folder, *folder.parents):
        if p.exists() or p.is_symlink():
            if not p.is_dir():
                raise FluxtrtError(f"cannot write {flag} {folder}: {p} is a file, not a folder; pass a folder")
            return


def read_json(path: Path, what: str, fix: str, error=None):
    """A JSON file we did not write: its value, or one line (`error`, a FluxtrtError class) naming `what` it should
    be and the `fix`. A file of more than 256 MB, unreadable bytes or nesting past the parser's limit are refused
    the same way."""
    from .errors import FluxtrtError

    error = error or FluxtrtError
    try:
        if Path(path).stat().st_size > 256 << 20:
            raise error(f"{path} is too large for {what}; {fix}")
        return json.loads(Path(path).read_bytes())
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror}; {fix}") from None
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise error(f"{path} is unreadable: not {what} (JSON); {fix}") from None
