"""Qwen2-VL (``Qwen2VLForConditionalGeneration``): a dynamic-resolution ViT and our Qwen2 as the
language model, with M-RoPE.

The vision tower is transformers' own module built from the checkpoint's vision config: it runs
once per image (worker/encoder_cache.py), fed the image processor's flattened patches and each
image's patch grid, so its output is the reference's exactly; its patch merger makes one row per
``merge x merge`` patches, one per placeholder token (multimodal/grid_images.py).

The LM is :class:`Qwen2ForCausalLM` with one change, the rotary lookup: each token has three
positions (temporal, height, width; worker/mrope_positions.py builds them per step), and the
sections ``mrope_section`` of a head's rotary half-dims take their angles from one of the three
each. A step with no image request passes plain positions (all three equal: plain RoPE), and a
decode token's three are equal too (``position + delta``), so the cos/sin rows the layers (and the
native decode step, models/llama_native.py) receive are right either way."""
from __future__ import annotations

import torch

from asyncengine.errors import ConfigError
from asyncengine.layers.parallel import FULL, SINGLE, PPGroup, TPGroup
from asyncengine.layers.rotary import RotaryEmbedding
from asyncengine.models.llama import Qwen2ForCausalLM
from asyncengine.models.vision_language import VisionLanguageModel


class MRotaryEmbedding(RotaryEmbedding):
    """Rotary tables looked up with [3, T] positions: half-dim ``j`` rotates by the position of
    stream ``section[j]`` (sections cycle temporal, height, width, as transformers recomposes them)."""

    def build(self, device: torch.device | None = None) -> None:
        super().build(device)
        sections = [int(s) for s in self.params["mrope_section"]]
        if sum(sections) != self.rotary_dim // 2:
            raise ConfigError(f"mrope_section {sections} does not sum to half the rotary dim ({self.rotary_dim // 2})")
        with torch.device("cpu"):
            half = torch.repeat_interleave(torch.arange(len(sections)) % 3, torch.tensor(sections))
            self.section = torch.cat([half, half]).to(device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().lookup(positions, dtype)
        cos_t, sin_t = self.tables(dtype)
        pick = self.section.to(positions.device).view(1, 1, -1).expand(1, positions.shape[1], -1)
        return (cos_t[positions].gather(0, pick)[0].unsqueeze(1),
                sin_t[positions].gather(0, pick)[0].unsqueeze(1))


def vision_tower(vc: dict):
    """transformers' Qwen2-VL / Qwen2.5-VL vision transformer for this vision config."""
    kind = vc.get("model_type", "qwen2_vl_vision")
    args = {k: v for k, v in vc.items() if k not in ("model_type", "transformers_version")}
    if kind == "qwen2_vl_vision":
        from transformers.models.qwen2_vl import modeling_qwen2_vl as m  # lazy: the tower is transformers'

        return m.Qwen2VisionTransformerPretrainedModel._from_config(m.Qwen2VLVisionConfig(**args))
    if kind in ("qwen2_5_vl_vision", "qwen2_5_vl"):
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m  # lazy: the tower is transformers'

        return m.Qwen2_5_VisionTransformerPretrainedModel._from_config(m.Qwen2_5_VLVisionConfig(**args))
    raise ConfigError(f"a Qwen2-VL vision tower of type {kind!r} is not supported")


class Qwen2VLForConditionalGeneration(VisionLanguageModel, Qwen2ForCausalLM):
    is_multimodal = True
    uses_mrope = True  # the runner passes [3, T] positions for steps with images

    def __init__(self, hf_config, max_positions: int, tp: TPGroup = SINGLE, pp: PPGroup = FULL) -> None:
        if tp.size > 1 or pp.size > 1:
            raise ConfigError("Qwen2-VL runs on one rank for now (no tensor or pipeline parallelism)")
        super().__init__(hf_config, max_positions, tp, pp)
        a = self.args
        if "mrope_section" not in a.rope:
            raise ConfigError("Qwen2-VL: the text config's rope parameters name no mrope_section")
        self.rotary = MRotaryEmbedding(a.head_dim, max_positions, a.rope)
        for layer in self.layers:
            layer.self_attn.rotary = self.rotary
        self.visual = vision_tower(dict(hf_config.llava["vision_config"]))

    @classmethod
    def check_tensor_parallel(cls, hf_config, size: int) -> None:
        if size > 1:
            raise ConfigError("Qwen2-VL runs on one rank for now (no tensor parallelism)")

    def encode_images(self, patches: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Flattened patches of one or more images [sum t*h*w, C*tp*p*p] and their grids [n, 3] ->
        the images' placeholder rows, concatenated [sum t*h*w / merge**2, LM hidden]."""
        return self.visual(patches, grid_thw=grid_thw).pooler_output

    def forward(self, input_ids, positions, kv_caches, meta, intermediate=None, mm_embeds=None,
                mrope_positions=None):
        """``mrope_positions``: [3, T] for a step with images (else ``positions`` serve all three);
        ``mm_embeds``: (flat rows, image rows) this step's placeholder rows take."""
        x = None
        if mm_embeds is not None:
            rows, feats = mm_embeds
            x = self.embed(input_ids)
            x[rows] = feats.to(x.dtype)
        # the text model's forward itself (the mixin's reads no M-RoPE positions)
        return Qwen2ForCausalLM.forward(self, input_ids, positions if mrope_positions is None else mrope_positions,
                                        kv_caches, meta, intermediate, inputs_embeds=x)

    # ------------------------------------------------------------------ weights

    def _split(self, weights):
        """LM tensors renamed for the Qwen2 loader (both layouts: transformers 5's
        ``model.language_model.`` and the Hub's ``model.``); vision ones (``visual.``) apart."""
        vision = []

        def text():
            for name, tensor in weights:
                for old, new in (("model.language_model.", "model."), ("model.visual.", "visual.")):
                    if name.startswith(old):
                        name = new + name[len(old):]
                        break
                if name.startswith("visual."):
                    vision.append((name, tensor))
                else:
                    yield name, tensor
        return text(), vision

    def after_load(self) -> None:
        rot = self.visual.rotary_pos_emb  # its non-persistent buffers: not in the checkpoint
        dev = self.rotary.cos.device
        with torch.device("cpu"):
            inv = rot.compute_axial_rope_parameters(rot.config)[0]
        rot.inv_freq, rot.original_inv_freq = inv.to(dev), inv.clone().to(dev)
