"""Idefics3 / SmolVLM (``Idefics3ForConditionalGeneration``): a SigLIP-shaped vision tower, a
pixel-shuffle connector, and our Llama as the language model.

The tower is transformers' own ``Idefics3VisionTransformer`` (built with ``from_config`` from the
checkpoint's vision config): it runs once per image tile, not per token, so its output is then the
reference's exactly. The connector (pixel shuffle by ``scale_factor``, then one linear map) and the
LM are ours; the LM is :class:`LlamaForCausalLM` unchanged.

An image reaches the model as tiles (up to rows x cols crops plus the whole image scaled down, see
multimodal/idefics3_processor.py), each with its own placeholder run in the prompt and its own
encoder input: tiles never attend to each other in the tower, so each is encoded (and cached by
hash) on its own, and :meth:`encode_images` sees a batch of tiles. Tensor and pipeline parallelism
are refused for now."""
from __future__ import annotations

import torch
from torch import nn

from asyncengine.errors import ConfigError
from asyncengine.layers.parallel import FULL, SINGLE, PPGroup, TPGroup
from asyncengine.models.llama import LlamaForCausalLM
from asyncengine.models.vision_language import VisionLanguageModel


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[tiles, side*side, d] -> [tiles, (side/scale)^2, d*scale^2]: each scale x scale block of
    patches becomes one row (its patches' features side by side, row-major within the block)."""
    n, seq, d = x.shape
    side = int(round(seq ** 0.5))
    if side * side != seq or side % scale:
        raise ValueError(f"pixel shuffle needs a square patch grid divisible by {scale}, got {seq} patches")
    g = side // scale
    return x.view(n, g, scale, g, scale, d).permute(0, 1, 3, 2, 4, 5).reshape(n, g * g, scale * scale * d)


class _Projection(nn.Module):
    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width_in, width_out, bias=False)


class Connector(nn.Module):
    """Tower features to LM rows: pixel shuffle, then a linear map (Idefics3Connector)."""

    def __init__(self, vision_width: int, text_width: int, scale: int) -> None:
        super().__init__()
        self.scale = scale
        self.modality_projection = _Projection(vision_width * scale * scale, text_width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(pixel_shuffle(x, self.scale))


class Idefics3ForConditionalGeneration(VisionLanguageModel, LlamaForCausalLM):
    is_multimodal = True

    def __init__(self, hf_config, max_positions: int, tp: TPGroup = SINGLE, pp: PPGroup = FULL) -> None:
        if tp.size > 1 or pp.size > 1:
            raise ConfigError("Idefics3 runs on one rank for now (no tensor or pipeline parallelism)")
        super().__init__(hf_config, max_positions, tp, pp)
        from transformers import AutoModel  # lazy: the vision tower is transformers' Idefics3 tower
        from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig  # lazy: same

        info = dict(hf_config.llava)
        vc = {k: v for k, v in dict(info["vision_config"]).items() if k not in ("model_type", "transformers_version")}
        vision_config = Idefics3VisionConfig(**vc)
        self.vision_model = AutoModel.from_config(vision_config)
        self.connector = Connector(vision_config.hidden_size, self.args.hidden_size, int(info.get("scale_factor", 2)))

    @classmethod
    def check_tensor_parallel(cls, hf_config, size: int) -> None:
        if size > 1:
            raise ConfigError("Idefics3 runs on one rank for now (no tensor parallelism)")

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[tiles, 3, S, S] -> [tiles, rows per tile, LM hidden]: the rows of their placeholder runs.
        Every tile is whole (the processor pads none), so every patch is attended to."""
        out = self.vision_model(pixel_values=pixel_values, return_dict=True)
        return self.connector(out.last_hidden_state)

    # ------------------------------------------------------------------ weights

    def _split(self, weights):
        """LM tensors renamed for the Llama loader (model.text_model.X -> model.X); the tower's and
        the connector's apart (vision_model.X, connector.X)."""
        vision = []

        def text():
            for name, tensor in weights:
                if name.startswith("model.text_model."):
                    yield "model." + name[len("model.text_model."):], tensor
                elif name.startswith(("model.vision_model.", "model.connector.")):
                    vision.append((name[len("model."):], tensor))
                else:
                    yield name, tensor
        return text(), vision
