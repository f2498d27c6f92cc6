"""Images in, RGB images out, refusing hostile input before it costs memory.

An image arrives as a ``PIL.Image``, raw bytes, or a URL (``data:``, ``file:`` under an allowed
folder, ``http(s):`` on an allowed host: the server decides, media.py). Its declared size is read
from the header and checked against ``max_pixels`` *before* any pixel is decoded (a 1x1-byte PNG
that declares 100,000 x 100,000 is refused in microseconds); a truncated or malformed file is a
clear error. What decodes is normalised: the first frame of an animation, EXIF orientation applied,
CMYK / palette / grey / 16-bit / alpha all to 8-bit RGB."""
from __future__ import annotations

import base64
import binascii
import io

import msgspec

from asyncengine.errors import InvalidRequestError


class ImageLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What one prompt's images may cost (EngineConfig: limit_mm_per_prompt, mm_max_pixels)."""

    max_images: int = 8
    max_pixels: int = 4096 * 4096

    @property
    def max_bytes(self) -> int:
        """An encoded image larger than its raw RGBA pixels is not an image worth decoding."""
        return 4 * self.max_pixels + (1 << 16)


def decode_data_url(url: str, limits: ImageLimits) -> bytes:
    """The bytes of a ``data:image/...;base64,`` URL (size checked before base64 decoding)."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise InvalidRequestError("an image data URL must look like data:image/<type>;base64,<data>")
    if not head[5:].startswith("image/"):
        raise InvalidRequestError(f"a data URL of type {head[5:-7]!r:.40} is not an image")
    if len(payload) * 3 // 4 > limits.max_bytes:
        raise InvalidRequestError(f"the image is over {limits.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("the image data URL is not valid base64") from None


def open_image(data: bytes, limits: ImageLimits):
    """Bytes to a decoded 8-bit RGB ``PIL.Image`` (its declared size checked first)."""
    from PIL import Image  # lazy: Pillow only where images are served

    if len(data) > limits.max_bytes:
        raise InvalidRequestError(f"the image is over {limits.max_bytes} bytes")
    try:
        img = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError:
        raise InvalidRequestError("the image declares more pixels than Pillow will decode (a decompression "
                                  "bomb)") from None
    except Exception as e:  # UnidentifiedImageError, a bomb warning, a broken header
        raise InvalidRequestError(f"not a readable image ({type(e).__name__})") from None
    return normalize(img, limits)


def check_size(img, limits: ImageLimits) -> None:
    w, h = img.size
    if w < 1 or h < 1:
        raise InvalidRequestError(f"the image is {w}x{h} pixels")
    if w * h > limits.max_pixels:
        raise InvalidRequestError(f"the image is {w}x{h} = {w * h} pixels, over the limit of "
                                  f"{limits.max_pixels} (mm_max_pixels)")


def normalize(img, limits: ImageLimits):
    """An opened (maybe not yet decoded) image to 8-bit RGB, after checking its size."""
    from PIL import Image, ImageOps  # lazy: Pillow only where images are served

    check_size(img, limits)
    try:
        if getattr(img, "is_animated", False):
            img.seek(0)  # the first frame (vLLM and transformers take the first as well)
        img.load()
        img = ImageOps.exif_transpose(img)  # a copy when the EXIF says to rotate; else the image
        check_size(img, limits)
        if img.mode in ("I;16", "I;16B", "I;16L", "I"):  # 16/32-bit grey: scale, do not clip
            import numpy as np  # lazy: with Pillow

            arr = np.asarray(img, dtype=np.float64)
            top = 65535.0 if img.mode.startswith("I;16") or arr.max() > 255 else 255.0
            img = Image.fromarray((arr * (255.0 / top)).round().astype(np.uint8), mode="L")
        if img.mode == "P" and "transparency" in img.info:
            img = img.convert("RGBA")
        return img if img.mode == "RGB" else img.convert("RGB")
    except InvalidRequestError:
        raise
    except Exception as e:  # truncated data (OSError), a decoder's error, a bomb
        raise InvalidRequestError(f"the image cannot be decoded: malformed or truncated "
                                  f"({type(e).__name__})") from None


def load_image(item, limits: ImageLimits):
    """One ``multi_modal_data`` image (a PIL image, bytes or a data URL) as 8-bit RGB."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        return open_image(bytes(item), limits)
    if isinstance(item, str):
        if item.startswith("data:"):
            return open_image(decode_data_url(item, limits), limits)
        raise InvalidRequestError("an image given as a string must be a data: URL (the server fetches "
                                  "files and remote URLs only where its flags allow them)")
    if type(item).__module__.startswith("PIL.") and hasattr(item, "size") and hasattr(item, "mode"):
        return normalize(item, limits)
    raise InvalidRequestError(f"an image must be a PIL.Image, bytes or a data: URL, not {type(item).__name__}")
