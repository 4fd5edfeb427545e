"""Images out of the runtime: PNGs written atomically (temp name, then rename), with the generation's settings
in PNG text chunks (as other generators do: prompt, seed, steps, guidance, size, model, engine hashes)."""

from __future__ import annotations

from pathlib import Path

from ..errors import FluxtrtError


def check_output_path(dest: Path) -> None:
    """Before any work: the PNG can be written where asked (suffix, folder writable)."""
    if Path(dest).suffix.lower() != ".png":
        raise FluxtrtError(f"--out must end in .png, got {dest}")
    check_writable(Path(dest))


def check_writable(dest: Path) -> None:
    """A file can be created beside `dest` (its folder made if needed); else one line naming the folder."""
    import os
    import tempfile

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
