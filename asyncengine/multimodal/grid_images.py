"""Dynamic-resolution images (Qwen2-VL): each image keeps (about) its own size, so it gives its own
number of placeholder rows.

The model's image processor resizes an image to multiples of ``patch * merge`` within
``min_pixels``/``max_pixels`` (its saved ``size``), cuts it into flattened patches
``[t*h*w, C*tp*p*p]`` and reports each image's patch grid ``(t, h, w)``; the encoder merges each
``merge x merge`` block of patches into one row, so the image's run is ``t*h*w / merge**2``
placeholders (transformers' Qwen2VLProcessor expands ``<|image_pad|>`` to as many)."""
from __future__ import annotations

import hashlib

from asyncengine.contracts.multimodal import MultiModalInput


def grid_rows(grid_thw, merge: int) -> int:
    """Placeholder rows (encoder output rows) of an image with this patch grid."""
    t, h, w = (int(x) for x in grid_thw)
    return t * h * w // (merge * merge)


def expand_grid_images(ids: list[int], image_token: int, processed, merge: int
                       ) -> tuple[list[int], list[MultiModalInput]]:
    """``ids`` with the n-th image token expanded to the n-th image's run, and each image's input
    (its own rows of the processor's ``pixel_values``, its grid, a hash of both)."""
    import numpy as np  # lazy: with the image processor

    pixels = np.asarray(processed["pixel_values"], dtype=np.float32)
    grids = np.asarray(processed["image_grid_thw"], dtype=np.int64).reshape(-1, 3)
    out: list[int] = []
    inputs: list[MultiModalInput] = []
    first = 0
    for t in ids:
        if t != image_token:
            out.append(t)
            continue
        grid = [int(x) for x in grids[len(inputs)]]
        patches = grid[0] * grid[1] * grid[2]
        px = np.ascontiguousarray(pixels[first:first + patches])
        first += patches
        data = px.tobytes()
        digest = hashlib.sha256(repr((px.shape, grid)).encode() + data).hexdigest()
        n = grid_rows(grid, merge)
        inputs.append(MultiModalInput(hash=digest, offset=len(out), length=n, data=data, shape=list(px.shape),
                                      grid_thw=grid))
        out.extend([image_token] * n)
    return out, inputs


def grid_input_ok(m: MultiModalInput, merge: int) -> bool:
    """A hand-passed input's grid agrees with its rows and its placeholder run."""
    if len(m.grid_thw) != 3 or min(m.grid_thw) <= 0 or len(m.shape) != 2:
        return False
    t, h, w = m.grid_thw
    return h % merge == 0 and w % merge == 0 and m.shape[0] == t * h * w and m.length == grid_rows(m.grid_thw, merge)
