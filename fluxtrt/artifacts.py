"""Engine artifacts: one archive per GPU target (engines + manifest + tokenizers/configs, no ONNX) with a
sha256 file, and safe unpacking of archives fetched from elsewhere (untrusted input).

Unpacking refuses, before writing anything: a checksum mismatch, absolute paths, `..` components, links,
devices and other special members, and archives whose members add up to more than the size limit. After
extraction every engine is checked against the manifest's sha256; on any failure the destination is left
as it was (extraction goes to a staging folder that is renamed only at the end)."""

from __future__ import annotations

import gzip
import os
import shutil
import tarfile
import zlib
from pathlib import Path, PurePosixPath

from .errors import (
    ArtifactError,  # noqa: F401 - defined in errors.py, raised here
    )
from .fileio import sha256_file, staging_dir
from .records import read_manifest

MAX_UNPACKED_BYTES = 64 << 30  # a full-size FLUX.1-dev set of engines is well under this
SKIP = {".fluxtrt.lock", "build.log"}


def archive_name(manifest) -> str:
    model = manifest.model.id.replace("/", "_").replace(":", "-").strip("._") or "model"
    return f"fluxtrt-{model}-{manifest.gpu}-{manifest.sm}.tar.gz"


def pack(gpu_dir: Path, out_dir: Path) -> tuple[Path, Path]:
    """gpu_dir (OUT/<gpu>) -> out_dir/<name>.tar.gz and <name>.tar.gz.sha256 (sha256sum format)."""
    gpu_dir, out_dir = Path(gpu_dir), Path(out_dir)
    manifest = read_manifest(gpu_dir)
    for e in manifest.components.values():
        if sha256_file(gpu_dir / e.engine) != e.sha256:
            raise ArtifactError(f"{gpu_dir / e.engine} does not match its manifest; rebuild before packing")
    name = archive_name(manifest)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = sorted(p for p in gpu_dir.rglob("*") if p.is_file() and p.name not in SKIP
                   and not any(part.startswith(".tmp-") for part in p.relative_to(gpu_dir).parts))
    with staging_dir(out_dir, "pack") as tmp:
        archive = tmp / name
        # gzip header without a timestamp or file name: the same inputs give the same bytes
        with open(archive, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz, \
                tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for f in files:
                info = tar.gettarinfo(str(f), arcname=f"{manifest.gpu}/{f.relative_to(gpu_dir).as_posix()}")
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.mtime = 0
                info.mode = 0o644
                with open(f, "rb") as fh:
                    tar.addfile(info, fh)
        digest = sha256_file(archive)
        (tmp / f"{name}.sha256").write_text(f"{digest}  {name}\n")
        os.replace(archive, out_dir / name)
        os.replace(tmp / f"{name}.sha256", out_dir / f"{name}.sha256")
    return out_dir / name, out_dir / f"{name}.sha256"


def verify_checksum(archive: Path, sha_file: Path | None = None) -> str:
    archive = Path(archive)
    sha_file = Path(sha_file) if sha_file else Path(f"{archive}.sha256")
    if not archive.is_file():
        raise ArtifactError(f"{archive} is not a file; pass an archive made by `fluxtrt artifacts`")
    if not sha_file.is_file():
        raise ArtifactError(f"no checksum file {sha_file.name} beside {archive.name}; download it too "
                            "(or pass --sha256 FILE)")
    try:
        words = sha_file.read_bytes()[:4096].decode("ascii").split()
    except (OSError, UnicodeDecodeError):
        words = []
    want = words[0].lower() if words else ""
    if len(want) != 64:
        raise ArtifactError(f"{sha_file.name} holds no sha256 (64 hex digits, as `sha256sum` writes); download it again")
    got = sha256_file(archive)
    if got != want:
        raise ArtifactError(f"{archive.name} does not match its checksum (sha256 {got[:16]}..., expected "
                            f"{want[:16]}...): the download is corrupt or was tampered with; fetch it again")
    return got


def _check_member(m: tarfile.TarInfo) -> PurePosixPath:
    p = PurePosixPath(m.name)
    if p.is_absolute() or m.name.startswith(("/", "\\")) or ".." in p.parts or not p.parts or ":" in p.parts[0] \
            or "\x00" in m.name or "\\" in m.name:
        raise ArtifactError(f"unsafe path in archive: {m.name!r} (absolute, empty, '.' or with '..'); refusing to extract")
    if m.issym() or m.islnk():
        raise ArtifactError(f"archive member {m.name!r} is a link; fluxtrt archives hold plain files only")
    if not (m.isfile() or m.isdir()):
        raise ArtifactError(f"archive member {m.name!r} is not a plain file or folder; refusing to extract")
    return p


def previous_name(final: Path) -> Path:
    """A free name beside `final` for the folder an unpack replaces: `<gpu>.previous`, `<gpu>.previous-2`, ..."""
    n, cand = 1, final.with_name(f"{final.name}.previous")
    while cand.exists() or cand.is_symlink():
        n += 1
        cand = final.with_name(f"{final.name}.previous-{n}")
    return cand


def unpack(archive: Path, dest: Path, sha_file: Path | None = None, max_bytes: int = MAX_UNPACKED_BYTES,
           on_moved=lambda old, new: None) -> Path:
    """Verify and safely extract one artifact archive into dest/<gpu>/; returns that folder. An existing
    dest/<gpu>/ is never deleted (it may hold the user's own files): it is moved aside to `<gpu>.previous`
    (`on_moved(old, new)` is told) and the new folder takes its place."""
    archive, dest = Path(archive), Path(dest)
    if dest.exists() and not dest.is_dir():
        raise ArtifactError(f"--out {dest} is a file; pass a folder (the GPU folder is placed inside it)")
    verify_checksum(archive, sha_file)
    try:
        with tarfile.open(archive, "r:gz") as tar:
            return _extract(tar, archive, dest, max_bytes, on_moved)
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise ArtifactError(f"{archive.name} is not a readable .tar.gz ({type(e).__name__}: "
                            f"{str(e).splitlines()[0][:80] if str(e) else 'truncated'}); fetch it again") from None


def _extract(tar, archive: Path, dest: Path, max_bytes: int, on_moved) -> Path:
    members = tar.getmembers()
    paths = [_check_member(m) for m in members]
    tops = {p.parts[0] for p in paths}
    if len(tops) != 1:
        raise ArtifactError(f"{archive.name} must hold one folder (the GPU's); it holds {sorted(tops)[:5]}")
    if len({str(p) for p in paths}) != len(paths):
        raise ArtifactError(f"{archive.name} holds a member twice; fluxtrt archives do not: fetch it again")
    total = sum(m.size for m in members)
    if total > max_bytes:
        raise ArtifactError(f"{archive.name} unpacks to {total / 1e9:.1f} GB, over the {max_bytes / 1e9:.1f} GB limit")
    dest.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dest).free
    if total > free:
        raise ArtifactError(f"{archive.name} unpacks to {total / 1e9:.2f} GB and {dest} has {free / 1e9:.2f} GB free; "
                            "free some space or pass --out on another disk")
    top = tops.pop()
    final = dest / top
    with staging_dir(dest, "unpack") as tmp:
        for m, p in zip(members, paths):
            target = tmp.joinpath(*p.parts)
            if m.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            if target.is_dir() or (target.parent.exists() and not target.parent.is_dir()):
                raise ArtifactError(f"{archive.name}: member {m.name!r} is both a file and a folder; fetch it again")
            target.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(m)
            with open(target, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 22)
            if target.stat().st_size != m.size:
                raise ArtifactError(f"{archive.name}: member {m.name!r} is truncated; fetch it again")
        folder = tmp / top
        manifest = read_manifest(folder)
        for e in manifest.components.values():
            f = folder / e.engine
            if not f.is_file() or sha256_file(f) != e.sha256:
                raise ArtifactError(f"{archive.name}: {e.engine} does not match the manifest's sha256; "
                                    "refusing the archive")
        if final.exists() or final.is_symlink():
            aside = previous_name(final)
            os.replace(final, aside)
            on_moved(final, aside)
        os.replace(folder, final)
    return final
