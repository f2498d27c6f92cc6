"""What the runner knows of one running request: its token ids as far as the runner has them (its
own latest samples included), its block table and its true position. The scheduler sends only what
changed; the runner's helpers (grammar, speculation, prompt logprobs) read and advance this."""
from __future__ import annotations

from dataclasses import dataclass, field

from asyncengine.sampling_params import SamplingParams


@dataclass
class RunnerRequestState:
    req_id: str
    num_prompt_tokens: int
    prompt_ids: list[int]  # shared (not copied) with the sampler each step
    output_ids: list[int]  # outputs, including the runner's own latest samples
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    bad_words_token_ids: list[list[int]] | None
    matcher: object | None = None  # structured outputs: the grammar state after output_ids
    state_slot: int = -1  # hybrid models: the request's Mamba state slot (worker/state_cache.py)
    lora_id: int = 0  # its LoRA adapter (0: the base model)
    pool_state: object | None = None  # a pooling request's partial embedding (worker/pooling.py)
    # models mixing full and sliding layers: the tables of KV-cache groups 1.. (worker/kv_groups.py)
    group_block_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids of positions [start, end) across the prompt and the outputs."""
        p = self.num_prompt_tokens
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p:end - p]
        return self.prompt_ids[start:] + self.output_ids[:end - p]
