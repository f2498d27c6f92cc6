"""LLaVA (``LlavaForConditionalGeneration``): a CLIP vision tower, a two-layer projector, and our
Llama as the language model.

The vision tower is transformers' own CLIP module (``AutoModel.from_config`` of the checkpoint's
vision config): it runs once per image, not per token, so our fused kernels would buy little there
and its output is then exactly the reference's. The projector and the language model are ours; the
LM is :class:`LlamaForCausalLM` unchanged (paged KV, chunked prefill, native decode step), started
from embedding rows in which each image's placeholder run holds the projected image features.

Encoding is the worker's (worker/encoder_cache.py): at a request's prefill it calls
:meth:`encode_images` once per image hash and slices the rows each chunk covers into
``mm_embeds``. Tensor and pipeline parallelism are refused for now."""
from __future__ import annotations

import torch
from torch import nn

from asyncengine.errors import ConfigError
from asyncengine.layers.parallel import FULL, SINGLE, PPGroup, TPGroup
from asyncengine.models.llama import LlamaForCausalLM
from asyncengine.models.vision_language import VisionLanguageModel

_ACTS = {"gelu": nn.GELU, "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"), "silu": nn.SiLU,
         "quick_gelu": None}


class Projector(nn.Module):
    """Vision features to the LM's width: linear, activation, linear (LlavaMultiModalProjector)."""

    def __init__(self, vision_width: int, text_width: int, act: str, bias: bool) -> None:
        super().__init__()
        if _ACTS.get(act) is None:
            raise ConfigError(f"LLaVA projector activation {act!r} is not supported (gelu, gelu_pytorch_tanh, silu)")
        self.linear_1 = nn.Linear(vision_width, text_width, bias=bias)
        self.act = _ACTS[act]()
        self.linear_2 = nn.Linear(text_width, text_width, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(VisionLanguageModel, LlamaForCausalLM):
    is_multimodal = True

    def __init__(self, hf_config, max_positions: int, tp: TPGroup = SINGLE, pp: PPGroup = FULL) -> None:
        if tp.size > 1 or pp.size > 1:
            raise ConfigError("LLaVA runs on one rank for now (no tensor or pipeline parallelism)")
        super().__init__(hf_config, max_positions, tp, pp)
        from transformers import AutoModel, CLIPVisionConfig  # lazy: the vision tower is transformers' CLIP

        info = dict(hf_config.llava)
        vc = dict(info["vision_config"])
        if vc.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise ConfigError(f"LLaVA with a {vc.get('model_type')!r} vision tower is not supported (CLIP only)")
        self.feature_layer = info.get("vision_feature_layer", -2)
        self.select_strategy = info.get("vision_feature_select_strategy", "default")
        vision_config = CLIPVisionConfig(**{k: v for k, v in vc.items() if k not in ("model_type", "transformers_version")})
        self.vision_tower = AutoModel.from_config(vision_config)
        layers = 1 if isinstance(self.feature_layer, int) else len(self.feature_layer)
        self.multi_modal_projector = Projector(vision_config.hidden_size * layers, self.args.hidden_size,
                                               info.get("projector_hidden_act", "gelu"),
                                               bool(info.get("multimodal_projector_bias", True)))

    @classmethod
    def check_tensor_parallel(cls, hf_config, size: int) -> None:
        if size > 1:
            raise ConfigError("LLaVA runs on one rank for now (no tensor parallelism)")

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, 3, H, W] -> [images, tokens per image, LM hidden]: the rows of their placeholders."""
        out = self.vision_tower(pixel_values, output_hidden_states=True, return_dict=True)
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else self.feature_layer
        feats = [out.hidden_states[i] for i in layers]
        if self.select_strategy == "default":  # CLIP's class token dropped
            feats = [f[:, 1:] for f in feats]
        return self.multi_modal_projector(feats[0] if len(feats) == 1 else torch.cat(feats, dim=-1))

    # ------------------------------------------------------------------ weights

    def _split(self, weights):
        """LM tensors renamed for the Llama loader; vision ones (vision_tower.X, projector) apart."""
        vision = []

        def text():
            for name, tensor in weights:
                for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                                 ("language_model.lm_head.", "lm_head."), ("model.vision_tower.", "vision_tower."),
                                 ("model.multi_modal_projector.", "multi_modal_projector.")):
                    if name.startswith(old):
                        name = new + name[len(old):]
                        break
                if name.startswith(("vision_tower.", "multi_modal_projector.")):
                    vision.append((name.replace("vision_tower.vision_model.", "vision_tower."), tensor))
                else:
                    yield name, tensor
        return text(), vision

    def after_load(self) -> None:
        emb = self.vision_tower.embeddings  # its non-persistent buffer: not in the checkpoint
        emb.position_ids = torch.arange(emb.num_positions, device=emb.position_ids.device).unsqueeze(0)
