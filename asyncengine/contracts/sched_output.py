"""Typed messages between the scheduler and the model runner (the core's one-way data flow)."""
from __future__ import annotations

import msgspec

from asyncengine.contracts.connector_messages import KVConnectorMetadata, KVConnectorOutput
from asyncengine.contracts.multimodal import MultiModalInput
from asyncengine.lora_request import LoRARequest
from asyncengine.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, kw_only=True):
    """A request the runner has not seen yet (or is seeing again after a preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resuming after preemption
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # first position this step computes (prefix-cache hits skip ahead)
    # of num_computed_tokens, those a KV connector loaded (the target's KV only: a draft model
    # computes them itself)
    num_external_tokens: int = 0
    eos_token_ids: list[int] = []
    bad_words_token_ids: list[list[int]] | None = None
    state_slot: int = -1  # hybrid models: the request's Mamba state slot (-1: the model has none)
    lora_request: LoRARequest | None = None  # its LoRA adapter (None: the base model)
    # models mixing full and sliding layers: block tables of KV-cache groups 1.. (block_ids is
    # group 0's; core/grouped_kv_cache_manager.py); empty: one group
    group_block_ids: list[list[int]] = []
    mm_inputs: list[MultiModalInput] | None = None  # its images' encoder inputs (multimodal models)


class CachedRequestData(msgspec.Struct, kw_only=True):
    """A request the runner already holds: only what changed."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # pipeline parallel: the tokens sampled since the request's last step (the stages that do not
    # sample learn them here); empty otherwise
    new_token_ids: list[int] = []
    # models mixing full and sliding layers: new ids of KV-cache groups 1.. (empty: one group)
    new_group_block_ids: list[list[int]] = []


class SchedulerOutput(msgspec.Struct, kw_only=True):
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # in batch order
    total_num_scheduled_tokens: int
    # requests the runner must forget before this step: finished, aborted or preempted
    finished_req_ids: list[str]
    num_preempted: int = 0
    # speculative decoding: req_id -> k, the last k of that request's scheduled tokens are slots
    # (budget and KV) for draft tokens the runner proposes and verifies in this same step
    num_spec_tokens: dict[str, int] = {}
    # the KV connector's transfers for this step (None: no connector, or nothing to move)
    kv_connector_metadata: KVConnectorMetadata | None = None
    # hybrid models, n > 1: (source slot, destination slot) state copies the runner makes at the
    # start of this step, before the forward (core/hybrid_kv_cache_manager.py: fork)
    state_copies: list[tuple[int, int]] = []

    @property
    def is_empty(self) -> bool:
        """Nothing for the workers to do: no token to compute and no KV to move."""
        return self.total_num_scheduled_tokens == 0 and self.kv_connector_metadata is None


class ModelRunnerOutput(msgspec.Struct, kw_only=True):
    """Only rows that sampled appear. ``sampled_token_ids[i]`` is the list of tokens request
    ``req_ids[i]`` accepted this step (one today; several once speculative decoding accepts drafts).
    ``logprobs[i]`` is one (token ids, logprobs, rank of the sampled token) per accepted token for
    rows whose request asked for logprobs, else None. ``num_draft_tokens[i]``: drafts the row
    verified (speculative decoding; None when no row speculated)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[tuple[list[int], list[float], int]] | None] | None = None
    num_draft_tokens: list[int] | None = None
    # req_id -> (first position p, entries) for requests with prompt_logprobs whose chunk this step
    # covers prompt positions p, p+1, ...: entry i is (ids, logprobs, rank) for prompt token
    # p + i + 1 (the sampler's logprobs format), computed from the logits at position p + i
    prompt_logprobs: dict[str, tuple[int, list[tuple[list[int], list[float], int]]]] | None = None
    # req_id -> embedding, for pooling requests whose prompt's last chunk ran this step
    pooled: dict[str, list[float]] | None = None
    execute_time_s: float = 0.0
    kv_connector_output: KVConnectorOutput | None = None  # transfers that ended, counters
    # mixture-of-experts models: tokens routed to each expert this step, summed over the layers
    expert_tokens: list[int] | None = None


class EngineCoreOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a step gave one request: new tokens and, once, why it finished. (Fields left at
    their defaults are not encoded: most of them, for most tokens, over a core process's pipe.)"""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[tuple[list[int], list[float], int]] | None = None
    new_prompt_logprobs: list[tuple[list[int], list[float], int]] | None = None
    num_cached_tokens: int = 0
    pooled: list[float] | None = None  # a pooling request's embedding (with its one token)
    num_preemptions: int = 0  # times this request was preempted (its KV freed, recomputed) so far

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, tag="outputs", kw_only=True):
    """One finished batch of the engine core's step pipeline, as every front end receives it
    (in-process, or over a core process's pipe): the requests' outputs, the core's load after it,
    and the requests scheduled for the first time since the last batch (they no longer queue)."""

    outputs: list[EngineCoreOutput]
    num_running: int
    num_waiting: int
    # the requests scheduled for the first time since the last batch: {core request id: when
    # (time.monotonic(), one clock for every process on the machine)}
    started: dict[str, float] = {}
    stats: dict | None = None  # the core's full stats, when its driver attaches them
    # data parallel: requests a dead engine core held (they fail; the other cores go on), and why
    lost_req_ids: list[str] = []
    lost_reason: str = ""
    # the weights the batch ran on: 0 as loaded, +1 per update_weights (engine_core/weight_sync.py)
    weights_version: int = 0
