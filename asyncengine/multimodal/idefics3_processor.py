"""Idefics3 / SmolVLM prompts: each image token becomes the structured run transformers'
``Idefics3Processor`` writes, and each image tile one encoder input.

The checkpoint's image processor may split an image into rows x cols square tiles plus the whole
image scaled down (the "global" tile; an image that fits one tile, or ``do_image_splitting=False``,
gives only that one). In the prompt each tile is ``<fake_token_around_image>``, a tag
(``<row_r_col_c>`` or ``<global-img>``) and ``image_seq_len`` image tokens, rows end with a newline,
and the whole ends with ``<fake_token_around_image>``. So one image's placeholders are not one run:
the tiles are separated by text tokens. Since the tower encodes every tile on its own (no
attention across tiles), each tile is its own :class:`MultiModalInput` (its pixels, its run, its
hash): the encoder cache, chunk slicing and prefix-cache keys then work unchanged, and two images
that share a tile share its encoder output.

The expanded ids are the tokenizer's ids of that text, made once per (rows, cols): the text starts
and ends with a special token, so its tokens do not depend on the prompt around it, and the ids are
transformers' exactly."""
from __future__ import annotations

import hashlib

from asyncengine.contracts.multimodal import MultiModalInput
from asyncengine.errors import ConfigError, InvalidRequestError
from asyncengine.multimodal.processor import MultiModalProcessor, _prod

FAKE, GLOBAL, IMAGE = "<fake_token_around_image>", "<global-img>", "<image>"
MAX_TILES = 6 * 6 + 1  # the processor names tiles up to <row_6_col_6>, plus the global one


def image_text(rows: int, cols: int, tokens_per_tile: int) -> str:
    """What Idefics3Processor puts in the text for one image of rows x cols tiles (0 x 0: unsplit)."""
    run = IMAGE * tokens_per_tile
    whole = f"{FAKE}{GLOBAL}{run}{FAKE}"
    if rows == 0 and cols == 0:
        return whole
    grid = "".join("".join(f"{FAKE}<row_{r + 1}_col_{c + 1}>{run}" for c in range(cols)) + "\n" for r in range(rows))
    return grid + "\n" + whole


class Idefics3Processor(MultiModalProcessor):
    def __init__(self, model_path: str, hf_config, limits=None) -> None:
        super().__init__(model_path, hf_config, limits)
        vc = self.info["vision_config"]
        scale = int(self.info.get("scale_factor", 2))
        # rows one tile gives: its patch grid, pixel-shuffled by scale x scale (models/idefics3.py)
        self.tokens_per_image = (vc["image_size"] // vc["patch_size"]) ** 2 // (scale * scale)
        self._tokenizer = None
        self._layouts: dict[tuple[int, int], tuple[list[int], list[int]]] = {}

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer  # lazy: transformers only for a multimodal model

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        return self._tokenizer

    def layout(self, rows: int, cols: int) -> tuple[list[int], list[int]]:
        """The ids one image of rows x cols tiles becomes, and where each tile's image tokens start."""
        if (rows, cols) not in self._layouts:
            ids = self.tokenizer(image_text(rows, cols, self.tokens_per_image), add_special_tokens=False)["input_ids"]
            tok, n = self.image_token_id, self.tokens_per_image
            starts = [i for i, t in enumerate(ids) if t == tok and (i == 0 or ids[i - 1] != tok)]
            if sum(1 for t in ids if t == tok) != n * len(starts) or len(starts) != max(rows * cols + 1, 1) \
                    or any(ids[s:s + n] != [tok] * n for s in starts):
                raise ConfigError(f"{self.model_path}: the tokenizer does not keep {IMAGE} as one token "
                                  f"(id {tok}): Idefics3's image placeholders cannot be laid out")
            self._layouts[(rows, cols)] = ids, starts
        return self._layouts[(rows, cols)]

    def process(self, ids: list[int], mm_data) -> tuple[list[int], list[MultiModalInput]]:
        """The prompt's ids with each image token expanded to its image's tiles, and one input per tile."""
        images = self.placed_images(ids, mm_data)
        tok = self.image_token_id
        if not images:
            return ids, []
        import numpy as np  # lazy: with the image processor

        got = self.image_processor(images, return_tensors="np", return_row_col_info=True)
        tiles = np.asarray(got["pixel_values"][0], dtype=np.float32)  # [tiles of every image, 3, S, S]
        mask = got.get("pixel_attention_mask")
        if mask is not None and not np.asarray(mask).all():  # (all tiles are S x S: none is padded)
            raise ConfigError(f"{self.model_path}: padded image tiles are not supported")
        grids = list(zip(np.asarray(got["rows"]).reshape(-1).tolist(), np.asarray(got["cols"]).reshape(-1).tolist()))
        out: list[int] = []
        inputs: list[MultiModalInput] = []
        grid = iter(grids)  # (rows, cols) of each image, in prompt order
        for t in ids:
            if t != tok:
                out.append(t)
                continue
            rep, starts = self.layout(*next(grid))
            base = len(out)
            out.extend(rep)
            for s in starts:
                px = np.ascontiguousarray(tiles[len(inputs)])
                data = px.tobytes()
                digest = hashlib.sha256(repr(px.shape).encode() + data).hexdigest()
                inputs.append(MultiModalInput(hash=digest, offset=base + s, length=self.tokens_per_image,
                                              data=data, shape=list(px.shape)))
        if len(inputs) != len(tiles):
            raise ConfigError(f"{self.model_path}: the image processor made {len(tiles)} tiles, "
                              f"the placeholders {len(inputs)}")
        return out, inputs

    def check_prepared(self, ids: list[int], inputs) -> list[MultiModalInput]:
        """Inputs :meth:`process` made (one per tile), checked against the ids they go with."""
        inputs = list(inputs)
        if len(inputs) > self.limits.max_images * MAX_TILES:
            raise InvalidRequestError(f"{len(inputs)} image tiles in one prompt, over the limit of "
                                      f"{self.limits.max_images} images of {MAX_TILES} tiles")
        for m in inputs:
            if not isinstance(m, MultiModalInput) or m.length != self.tokens_per_image or m.offset < 0 \
                    or ids[m.offset:m.end] != [self.image_token_id] * m.length \
                    or len(m.data) != 4 * _prod(m.shape):
                raise InvalidRequestError("mm_inputs do not match this prompt (make them with prepare_images)")
        return inputs
