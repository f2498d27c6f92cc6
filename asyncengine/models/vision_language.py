"""What the vision-language models here share, mixed in before their text model's class:

- the forward: a step's placeholder rows take their image features (``mm_embeds``) in place of the
  token embeddings, then the text model runs as ever (paged KV, chunked prefill);
- the checkpoint: the language model's tensors renamed for the text model's own loader (fused
  projections, shards), the vision tower's and the projector's by name, then whatever the
  checkpoint cannot hold (a tower's non-persistent buffers: ``after_load``).

A model defines ``_split(weights)`` -> (the LM's (name, tensor) pairs under the text model's names,
a list of the vision (name, tensor) pairs), ``encode_images`` and, if it needs one, ``after_load``."""
from __future__ import annotations


class VisionLanguageModel:
    def forward(self, input_ids, positions, kv_caches, meta, intermediate=None, mm_embeds=None):
        """``mm_embeds``: (flat rows, their image feature rows) this step's placeholder rows take."""
        if mm_embeds is None:
            return super().forward(input_ids, positions, kv_caches, meta, intermediate)
        rows, feats = mm_embeds
        x = self.embed(input_ids)
        x[rows] = feats.to(x.dtype)
        return super().forward(input_ids, positions, kv_caches, meta, inputs_embeds=x)

    def _split(self, weights):
        raise NotImplementedError

    def after_load(self) -> None:
        """Buffers no checkpoint holds, rebuilt once the weights are in (default: none)."""

    def weight_targets(self, weights):
        text, vision = self._split(weights)
        yield from super().weight_targets(text)
        for name, tensor in vision:
            yield name, name, None, tensor

    def load_weights(self, weights) -> None:
        super().load_weights(weights)  # the text model's loader, through weight_targets above
        self.after_load()
