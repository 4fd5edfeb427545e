"""Images a request brings (untrusted files): read with a pixel limit from the header before decoding, at
least 16 px a side, 16-bit and float images scaled to 8 bits, and diffusers' image processor as the Flux
pipelines build theirs. One line naming the flag for anything unreadable."""

from __future__ import annotations

import logging
from pathlib import Path

from ..components import Geometry
from ..errors import WorkflowError


def image_processor(geo: Geometry, mask: bool = False, latent_channels: bool = True):
    """diffusers' VaeImageProcessor as the Flux pipelines build theirs (resizing, normalising, binarising)."""
    from diffusers.image_processor import VaeImageProcessor

    kwargs = {"vae_latent_channels": geo.latent_channels} if latent_channels else {}
    if mask:
        kwargs.update(do_normalize=False, do_binarize=True, do_convert_grayscale=True)
    return VaeImageProcessor(vae_scale_factor=geo.vae_scale_factor * 2, **kwargs)


MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # 64 MP: far over what FLUX takes (about 4 MP), far under a decompression bomb
MIN_IMAGE_SIDE = 16  # the pixel multiple: a smaller image holds no latent pixel


def load_image(value, flag: str):
    """An RGB PIL image from a path or the bytes of an uploaded file (or a PIL image as is), checked as untrusted
    input: a pixel limit read from the header before decoding, at least 16 px a side, 16-bit and float images scaled
    to 8 bits (not clipped), alpha dropped and the EXIF orientation applied as diffusers' load_image does. One line
    naming the flag otherwise."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value
    return _to_rgb(_open(value, flag))


def load_upload_mask(data: bytes, flag: str = "mask"):
    """An uploaded mask (OpenAI's images.edit) as `run --mask` takes it (white = repaint): one with an alpha channel
    follows OpenAI (fully transparent = edit), one without is taken as is (white = edit)."""
    import numpy as np
    from PIL import Image

    img = _open(data, flag)
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        alpha = np.asarray(img.convert("RGBA"))[..., 3]
        return Image.fromarray(np.where(alpha == 0, 255, 0).astype(np.uint8), "L").convert("RGB")
    return _to_rgb(img)


def _open(value, flag: str):
    """The decoded PIL image (its own mode, EXIF orientation applied) of a path or uploaded bytes, within the
    limits; one line naming the flag otherwise."""
    import io

    from PIL import Image, ImageOps, UnidentifiedImageError

    upload = isinstance(value, (bytes, bytearray))
    what = f"{flag} ({len(value)} bytes uploaded)" if upload else f"{flag} {Path(value)}"
    if not upload and not Path(value).is_file():
        raise WorkflowError(f"{flag} {Path(value)}: no such file; pass a PNG or JPEG image")
    try:
        with Image.open(io.BytesIO(value) if upload else Path(value)) as img:
            w, h = img.size
            if w * h > MAX_IMAGE_PIXELS:
                raise WorkflowError(f"{what} is {w}x{h} px, over the {MAX_IMAGE_PIXELS >> 20} MP limit; "
                                    "pass an image of at most a few megapixels")
            if min(w, h) < MIN_IMAGE_SIDE:
                raise WorkflowError(f"{what} is {w}x{h} px; pass an image at least {MIN_IMAGE_SIDE} px a side")
            img.load()
            return ImageOps.exif_transpose(img)  # a camera's orientation tag applied, as diffusers does
    except WorkflowError:
        raise
    except Image.DecompressionBombError:  # Pillow refuses before reading the size out: the same limit, said so
        raise WorkflowError(f"{what} is over the {MAX_IMAGE_PIXELS >> 20} MP limit; pass an image of at most "
                            "a few megapixels") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError) as e:
        raise WorkflowError(f"{what} is not a readable image ({type(e).__name__}); pass a PNG or JPEG") from None


def _to_rgb(img):
    """8-bit RGB: 16-bit integer images scaled by 255/65535, float images by 255 (clipped to 0..1)."""
    import numpy as np
    from PIL import Image

    if img.mode.startswith("I;16") or img.mode == "I":
        arr = np.asarray(img, dtype=np.float64)
        top = 65535.0 if img.mode.startswith("I;16") or arr.max(initial=0) > 255 else 255.0
        return Image.fromarray(np.clip(np.rint(arr * 255.0 / top), 0, 255).astype(np.uint8), "L").convert("RGB")
    if img.mode == "F":
        arr = np.nan_to_num(np.asarray(img, dtype=np.float64), nan=0.0)
        return Image.fromarray(np.rint(np.clip(arr, 0.0, 1.0) * 255.0).astype(np.uint8), "L").convert("RGB")
    return img.convert("RGB")


def load_resized(value, flag: str, height: int, width: int):
    """load_image, saying (one warning line) when the image is resized to the output size, as diffusers does."""
    img = load_image(value, flag)
    if img.size != (width, height):
        logging.getLogger("fluxtrt").warning("%s is %dx%d: resized to %dx%d (as diffusers does)", flag, *img.size,
                                             width, height)
    return img
