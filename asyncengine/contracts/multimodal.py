"""What crosses the engine-core boundary for an image: the encoder's input as bytes, where its
placeholder run sits in the prompt, and the image's content hash.

The hash keys three things: the worker's encoder cache (the same image is encoded once while any
request needs it), the prefix cache (a block's hash includes the hashes of the images it covers, so
the same text with another image shares no block), and equality of two requests' images."""
from __future__ import annotations

import msgspec


class MultiModalInput(msgspec.Struct, frozen=True, kw_only=True):
    """One image of a prompt, ready for the vision encoder (float32 pixel values, C-order); for
    Idefics3 one tile of an image (its tiles' runs are apart in the prompt: each its own input)."""

    hash: str  # sha256 hex of the processed pixel values and their shape
    offset: int  # the first prompt position of its placeholder run
    length: int  # placeholder tokens: the encoder output's rows, one per position
    data: bytes  # the image processor's float32 pixel values
    shape: list[int]  # their shape, e.g. [3, 336, 336]
    # dynamic resolution (Qwen2-VL): the image's patch grid (t, h, w) before the spatial merge; the
    # data are then its flattened patches, [t*h*w, C*tp*p*p]. Empty for fixed-size towers (LLaVA)
    grid_thw: list[int] = []

    @property
    def end(self) -> int:
        return self.offset + self.length


def block_extra(inputs: list[MultiModalInput] | None, start: int, stop: int) -> str:
    """The images a block of prompt positions [start, stop) overlaps, as a string for its hash
    (each image's hash and where the block cuts it): '' when it overlaps none."""
    if not inputs:
        return ""
    return "".join(f"\x00mm:{m.hash}:{max(start, m.offset) - m.offset}" for m in inputs
                   if m.offset < stop and start < m.end)
