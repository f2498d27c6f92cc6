"""ModelRunner: turns a SchedulerOutput into one flat, unpadded token batch, runs the model and the
sampler, and returns the sampled ids. It owns every tensor: the weights and the KV cache.

It keeps a small state per request (its token ids as far as the runner knows them, its block
table), so the scheduler sends only what changed. The runner appends each token it samples to that
state, which is what lets the scheduler plan step N+1 before step N's tokens reach it: the input
of a decode is always the runner's own last sample.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from asyncengine.config import EngineConfig
from asyncengine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from asyncengine.executor.sampler import Sampler, SamplingMetadata
from asyncengine.layers.attention import (AttentionMetadata, PrefillChunk, TorchPagedAttention,
                                          build_decode_groups)
from asyncengine.models.loader import LoadedModel
from asyncengine.sampling_params import SamplingParams


@dataclass
class RunnerRequestState:
    req_id: str
    token_ids: list[int]  # prompt + outputs, including the runner's own latest samples
    num_prompt_tokens: int
    prompt_ids: list[int]  # the two parts again, shared (not copied) with the sampler each step
    output_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    bad_words_token_ids: list[list[int]] | None


def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
    a = model.args
    return 2 * a.num_layers * block_size * a.num_kv_heads * a.head_dim * torch.finfo(dtype).bits // 8


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, num_blocks: int) -> None:
        self.config = config
        self.model = loaded.model
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        self.vocab_size = self.model.args.vocab_size
        self.eos_token_ids = list(loaded.eos_token_ids)
        a = self.model.args
        shape = TorchPagedAttention.kv_cache_shape(num_blocks, self.block_size, a.num_kv_heads, a.head_dim)
        # zeroed, not empty: masked-out slots are multiplied by 0 probabilities, and 0 * NaN = NaN
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(a.num_layers)]
        # scratch for the decode attention's gathered keys/values, reused by every layer and step
        self.attn_workspace = torch.empty(0, dtype=self.dtype, device=self.device)
        self.requests: dict[str, RunnerRequestState] = {}
        self.sampler = Sampler()
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.execute_time_s = 0.0  # total time inside execute(), for the busy-fraction metric

    # ------------------------------------------------------------------ state

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for nr in so.new_requests:
            self.requests[nr.req_id] = RunnerRequestState(
                req_id=nr.req_id, token_ids=list(nr.prompt_token_ids) + list(nr.output_token_ids),
                num_prompt_tokens=len(nr.prompt_token_ids), prompt_ids=nr.prompt_token_ids,
                output_ids=list(nr.output_token_ids), block_ids=list(nr.block_ids),
                num_computed_tokens=nr.num_computed_tokens, sampling_params=nr.sampling_params,
                bad_words_token_ids=nr.bad_words_token_ids)
        for cr in so.cached_requests:
            st = self.requests[cr.req_id]
            st.block_ids.extend(cr.new_block_ids)
            assert st.num_computed_tokens == cr.num_computed_tokens, \
                f"{cr.req_id}: runner at {st.num_computed_tokens}, scheduler at {cr.num_computed_tokens}"

    def _workspace(self, groups) -> torch.Tensor:
        """The decode scratch, grown (never shrunk) to hold the largest group's keys and values."""
        a = self.model.args
        need = max(2 * a.num_kv_heads * (g.end - g.start) * g.num_blocks * self.block_size * a.head_dim
                   for g in groups)
        if self.attn_workspace.numel() < need:
            self.attn_workspace = torch.empty(need, dtype=self.dtype, device=self.device)
        return self.attn_workspace

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        self._update_states(so)
        if so.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        bs = self.block_size
        decodes: list[RunnerRequestState] = []
        prefills: list[tuple[RunnerRequestState, int]] = []
        for rid, n in so.num_scheduled_tokens.items():
            st = self.requests[rid]
            if n == 1 and st.num_computed_tokens > 0:
                decodes.append(st)
            else:
                prefills.append((st, n))

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []  # flat row of the last token of each request that samples
        sample_states: list[RunnerRequestState] = []

        # decodes: one token each, longest context first, attended in groups of similar length
        decodes.sort(key=lambda st: st.num_computed_tokens, reverse=True)
        nd = len(decodes)
        for st in decodes:
            pos = st.num_computed_tokens
            input_ids.append(st.token_ids[pos])
            positions.append(pos)
            slots.append(st.block_ids[pos // bs] * bs + pos % bs)
        meta = AttentionMetadata(slot_mapping=None, num_decodes=nd)
        if nd:
            meta.decode_groups = build_decode_groups([st.block_ids for st in decodes],
                                                     [p + 1 for p in positions], bs, self.device)
            meta.workspace = self._workspace(meta.decode_groups)
            for i, st in enumerate(decodes):
                if st.num_computed_tokens + 1 == len(st.token_ids):
                    sample_rows.append(i)
                    sample_states.append(st)

        # prefill chunks
        row = nd
        for st, n in prefills:
            start = st.num_computed_tokens
            end = start + n
            input_ids.extend(st.token_ids[start:end])
            positions.extend(range(start, end))
            blocks = st.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            nb = -(-end // bs)
            meta.prefills.append(PrefillChunk(
                q_start=row, q_end=row + n, context_len=start,
                block_ids=torch.tensor(blocks[:nb], dtype=torch.long, device=self.device)))
            row += n
            if end == len(st.token_ids):
                sample_rows.append(row - 1)
                sample_states.append(st)

        for st in decodes:
            st.num_computed_tokens += 1
        for st, n in prefills:
            st.num_computed_tokens += n

        dev = self.device
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        meta.slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)
        hidden = self.model(ids_t, pos_t, self.kv_caches, meta)

        req_ids: list[str] = []
        sampled: list[int] = []
        logprobs = None
        if sample_rows:
            idx = torch.tensor(sample_rows, dtype=torch.long, device=dev)
            logits = self.model.compute_logits(hidden[idx]).float()
            smeta = SamplingMetadata.build(
                params=[st.sampling_params for st in sample_states],
                prompt_token_ids=[st.prompt_ids for st in sample_states],
                output_token_ids=[st.output_ids for st in sample_states],
                eos_token_ids=self.eos_token_ids,
                bad_words_token_ids=[st.bad_words_token_ids for st in sample_states],
                vocab_size=self.vocab_size, device=dev, generator=self.generator)
            out = self.sampler(logits, smeta)
            sampled = out.sampled_token_ids
            for st, tok in zip(sample_states, sampled):
                st.token_ids.append(tok)
                st.output_ids.append(tok)
                req_ids.append(st.req_id)
            if out.logprobs is not None:
                lp = out.logprobs
                logprobs = [None if ids is None else (ids, vals, rank)
                            for ids, vals, rank in zip(lp.logprob_token_ids, lp.logprobs, lp.sampled_token_ranks)]
        dt = time.perf_counter() - t0
        self.execute_time_s += dt
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=logprobs,
                                 execute_time_s=dt)
