"""Images out of the runtime: PNGs written atomically (temp name, then rename), with the generation's settings
in PNG text chunks (as other generators do: prompt, seed, steps, guidance, size, model, engine hashes)."""

from __future__ import annotations

from pathlib import Path

from ..errors import FluxtrtError


def check_output_path(dest: Path, inputs: dict | None = None, folders: dict | None = None) -> None:
    """Before any work: the PNG can be written where asked (suffix, folder writable), and it replaces none of
    the request's input files (`inputs`: flag -> path) and lies in none of its input folders (`folders`)."""
    if Path(dest).suffix.lower() != ".png":
        raise FluxtrtError(f"--out must end in .png, got {dest}")
    check_writable(Path(dest), inputs, folders)


def check_writable(dest: Path, inputs: dict | None = None, folders: dict | None = None, flag: str = "--out") -> None:
    """A file can be created at `dest` (its folder made if needed), it is not a folder, it is none of `inputs`
    (flag -> path: an output never replaces an input) and lies inside none of `folders` (flag -> folder, e.g. the
    engines); else one line naming the fix."""
    import os
    import tempfile

    dest = Path(dest)
    if dest.is_dir():
        raise FluxtrtError(f"{flag} {dest} is a folder; pass a file name inside it")
    real = dest.resolve()
    for what, path in (inputs or {}).items():
        if path is not None and Path(path).exists() and real == Path(path).resolve():
            raise FluxtrtError(f"{flag} {dest} is the {what} file: writing it would destroy an input; pass another "
                               f"{flag}")
    for what, folder_in in (folders or {}).items():
        if folder_in is not None and real.is_relative_to(Path(folder_in).resolve()):
            raise FluxtrtError(f"{flag} {dest} lies inside the {what} folder {folder_in}; write outputs elsewhere")
    folder = dest.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".probe", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise FluxtrtError(f"cannot write {dest}: {e.strerror} ({folder}); pass --out in a writable folder") from None


def save_png(image, dest: Path, metadata: dict | None = None) -> None:
    """uint8 [H, W, 3] -> PNG at `dest`, never half-written; `metadata` goes into tEXt chunks."""
    import io

    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    from ..fileio import atomic_file

    info = PngInfo()
    for key, value in (metadata or {}).items():
        info.add_text(key, str(value))
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG", pnginfo=info)
    with atomic_file(Path(dest)) as f:
        f.write(buf.getvalue())
