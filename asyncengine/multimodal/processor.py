"""A prompt's images to encoder inputs, and its image tokens to placeholder runs.

The model's own (Hugging Face) image processor makes the pixel values, exactly as transformers'
processor would; each image token in the prompt's ids becomes ``num_image_tokens`` copies of it
(LLaVA's processor does the same to the text), one per row the encoder + projector will produce.
Each image's hash is sha256 of its pixel values and shape: what the worker's encoder cache and the
prefix cache key it by (contracts/multimodal.py)."""
from __future__ import annotations

import hashlib
import importlib
from collections.abc import Mapping, Sequence

from asyncengine.config.sub_configs import MultiModalConfig
from asyncengine.contracts.multimodal import MultiModalInput
from asyncengine.errors import InvalidRequestError
from asyncengine.multimodal.grid_images import expand_grid_images, grid_input_ok
from asyncengine.multimodal.image_io import ImageLimits, load_image


def vision_info(hf_config) -> dict | None:
    """The model's image facts (models/model_info.py puts them on a LLaVA config as ``llava``):
    None for a text-only model."""
    info = hf_config.get("llava") if isinstance(hf_config, dict) else getattr(hf_config, "llava", None)
    return dict(info) if info else None


def num_image_tokens(info: dict) -> int:
    """Rows one image gives: a patch grid (CLIP's class token dropped under the default strategy)."""
    vc = info["vision_config"]
    n = (vc["image_size"] // vc["patch_size"]) ** 2
    return n + (1 if info.get("vision_feature_select_strategy", "default") == "full" else 0)


# model_type -> "module:class" of its processor where it is not this module's (LLaVA's one run per
# image); by name, as the model registry does, since each subclasses MultiModalProcessor
PROCESSORS: dict[str, str] = {
    "idefics3": "asyncengine.multimodal.idefics3_processor:Idefics3Processor",  # tiles (Idefics3 / SmolVLM)
}


def processor_class(info: dict) -> type:
    """The processor class of a model's image facts (:func:`vision_info`)."""
    path = PROCESSORS.get(info.get("model_type", ""))
    if path is None:
        return MultiModalProcessor
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class MultiModalProcessor:
    def __init__(self, model_path: str, hf_config, limits: ImageLimits | None = None) -> None:
        self.info = vision_info(hf_config)
        self.limits = limits or ImageLimits()
        self.model_path = model_path
        self._image_processor = None
        if self.info is not None:
            self.image_token_id = int(self.info.get("image_token_index", self.info.get("image_token_id")))
            # dynamic resolution (Qwen2-VL): rows per image from its grid (multimodal/grid_images.py)
            self.merge = self.info["vision_config"].get("spatial_merge_size")
            self.tokens_per_image = None if self.merge else num_image_tokens(self.info)

    @classmethod
    def of(cls, mm: MultiModalConfig, model_info, model_impl: str = "auto") -> "MultiModalProcessor | None":
        """The processor of an engine's model (the image limits of its multimodal view), or None: no
        images. ``model_impl``: the model view's (the Transformers backend takes no images)."""
        if vision_info(model_info.hf_config) is None or model_impl == "transformers":
            return None  # (the Transformers backend runs the text model alone: it takes no images)
        limits = ImageLimits(max_images=mm.limit_mm_per_prompt, max_pixels=mm.mm_max_pixels)
        return processor_class(vision_info(model_info.hf_config))(model_info.path, model_info.hf_config, limits)

    def image_part_text(self, tokenizer) -> str:
        """What a chat message's image part becomes in its text: the image token, between the
        vision start/end tokens where the model has them (Qwen2-VL, as its chat template writes it)."""
        ids = [self.info.get("vision_start_token_id"), self.image_token_id, self.info.get("vision_end_token_id")]
        return "".join(tokenizer.convert_ids_to_tokens([i for i in ids if i is not None]))

    @property
    def enabled(self) -> bool:
        return self.info is not None

    @property
    def image_processor(self):
        if self._image_processor is None:
            from transformers import AutoImageProcessor  # lazy: transformers only for a multimodal model

            self._image_processor = AutoImageProcessor.from_pretrained(self.model_path, local_files_only=True)
        return self._image_processor

    def images_of(self, mm_data) -> list:
        """``{"image": one or a list}`` checked and loaded (count, size, format) into RGB images."""
        if not isinstance(mm_data, Mapping):
            raise InvalidRequestError("multi_modal_data must be a dict like {'image': [images]}")
        unknown = set(mm_data) - {"image"}
        if unknown:
            raise InvalidRequestError(f"multi_modal_data: only 'image' is supported, not {sorted(unknown)!r:.80}")
        if not self.enabled:
            raise InvalidRequestError("this model takes no images (it is not a vision-language model we serve)")
        items = mm_data.get("image")
        items = list(items) if isinstance(items, Sequence) and not isinstance(items, (str, bytes)) else [items]
        if len(items) > self.limits.max_images:
            raise InvalidRequestError(f"{len(items)} images in one prompt, over the limit of "
                                      f"{self.limits.max_images} (limit_mm_per_prompt)")
        return [load_image(x, self.limits) for x in items]

    def placed_images(self, ids: list[int], mm_data) -> list:
        """The request's images, one per image token in ``ids`` (else an InvalidRequestError)."""
        images = self.images_of(mm_data)
        tok = self.image_token_id
        found = sum(1 for t in ids if t == tok)
        if found != len(images):
            raise InvalidRequestError(f"the prompt has {found} image placeholders (token {tok}) for "
                                      f"{len(images)} images: put one <image> where each image goes")
        return images

    def process(self, ids: list[int], mm_data) -> tuple[list[int], list[MultiModalInput]]:
        """The prompt's ids with each image token expanded to its run, and the images' inputs."""
        images = self.placed_images(ids, mm_data)
        tok, n = self.image_token_id, self.tokens_per_image
        if not images:
            return ids, []
        if self.merge:
            return expand_grid_images(ids, tok, self.image_processor(images, return_tensors="np"), self.merge)
        import numpy as np  # lazy: with the image processor

        pixels = np.asarray(self.image_processor(images, return_tensors="np")["pixel_values"], dtype=np.float32)
        out: list[int] = []
        inputs: list[MultiModalInput] = []
        for t in ids:
            if t != tok:
                out.append(t)
                continue
            px = np.ascontiguousarray(pixels[len(inputs)])
            data = px.tobytes()
            digest = hashlib.sha256(repr(px.shape).encode() + data).hexdigest()
            inputs.append(MultiModalInput(hash=digest, offset=len(out), length=n, data=data, shape=list(px.shape)))
            out.extend([tok] * n)
        return out, inputs

    def check_prepared(self, ids: list[int], inputs) -> list[MultiModalInput]:
        """Inputs :meth:`process` made (passed back as a prompt's ``mm_inputs``), checked against
        the ids they go with, so that no hand-made one reaches the encoder malformed."""
        inputs = list(inputs)
        if len(inputs) > self.limits.max_images:
            raise InvalidRequestError(f"{len(inputs)} images in one prompt, over the limit of {self.limits.max_images}")
        for m in inputs:
            if not isinstance(m, MultiModalInput) or m.offset < 0 or not (
                    grid_input_ok(m, self.merge) if self.merge else m.length == self.tokens_per_image) \
                    or ids[m.offset:m.end] != [self.image_token_id] * m.length \
                    or len(m.data) != 4 * _prod(m.shape):
                raise InvalidRequestError("mm_inputs do not match this prompt (make them with prepare_images)")
        return inputs


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
