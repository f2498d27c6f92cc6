"""Images in (multimodal/image_io.py): hostile input refused before it is decoded, odd formats
normalised to 8-bit RGB."""
from __future__ import annotations

import base64
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from vlm_utils import image, png_bytes

from asyncengine.errors import InvalidRequestError
from asyncengine.multimodal.image_io import ImageLimits, load_image

LIMITS = ImageLimits(max_images=4, max_pixels=512 * 512)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def bomb_png(w: int = 100_000, h: int = 100_000) -> bytes:
    """A few dozen bytes that declare w x h pixels (a decompression bomb's header)."""
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\x00")) + _chunk(b"IEND", b"")


def data_url(b: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(b).decode()


@pytest.mark.parametrize("bad, why", [
    (bomb_png(), "pixels"),  # refused from its header: nothing decoded
    (bomb_png(600, 600), "pixels"),  # just over this test's limit
    (png_bytes(image(0, (64, 64)))[:200], "truncated"),
    (b"GIF89a not really", "readable"),
    (b"\x00" * 100, "readable"),
])
def test_hostile_bytes_are_refused(bad, why):
    with pytest.raises(InvalidRequestError, match=why):
        load_image(bad, LIMITS)
    with pytest.raises(InvalidRequestError, match=why):
        load_image(data_url(bad), LIMITS)


def test_bad_data_urls_and_types():
    for url, why in [("data:image/png;base64,@@@", "base64"), ("data:text/plain;base64,aGk=", "not an image"),
                     ("data:image/png,raw", "data URL"), ("https://example.com/a.png", "data: URL")]:
        with pytest.raises(InvalidRequestError, match=why):
            load_image(url, LIMITS)
    with pytest.raises(InvalidRequestError, match="PIL.Image, bytes"):
        load_image(12, LIMITS)
    big = ImageLimits(max_pixels=16)
    with pytest.raises(InvalidRequestError, match="bytes"):  # the encoded size, before base64 decoding
        load_image("data:image/png;base64," + "A" * 100_000, big)


def test_odd_formats_become_rgb():
    base = image(5, (30, 20))
    for mode in ("CMYK", "P", "L", "LA", "RGBA", "1"):
        for src in (base.convert(mode), png_bytes(base.convert(mode), "TIFF" if mode == "CMYK" else "PNG")):
            out = load_image(src, LIMITS)
            assert out.mode == "RGB" and out.size == (30, 20), mode
    # 16-bit grey: scaled to 8 bits, not clipped to white
    grey16 = Image.fromarray((np.arange(600, dtype=np.uint16).reshape(20, 30) * 100))
    assert grey16.mode == "I;16"
    out = np.asarray(load_image(png_bytes(grey16), LIMITS))
    assert out.shape == (20, 30, 3) and 0 < out.mean() < 250 and out.max() > 200
    # a palette image with a transparent index
    p = base.convert("P")
    p.info["transparency"] = 0
    assert load_image(png_bytes(p), LIMITS).mode == "RGB"


def test_animation_first_frame_and_exif_rotation():
    frames = [Image.new("RGB", (10, 8), c) for c in ((255, 0, 0), (0, 255, 0))]
    gif = png_bytes(frames[0], "GIF", save_all=True, append_images=frames[1:])
    out = load_image(gif, LIMITS)
    assert out.size == (10, 8) and out.getpixel((0, 0))[0] > 200  # the first (red) frame
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    jpg = png_bytes(image(6, (40, 20)), "JPEG", exif=exif)
    assert load_image(jpg, LIMITS).size == (20, 40)
