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
from asyncengine.layers.attention import AttentionMetadata, PrefillChunk
from asyncengine.models.loader import LoadedModel
from asyncengine.sampling_params import SamplingParams


@dataclass
class RunnerRequestState:
    req_id: str
    token_ids: list[int]  # prompt + outputs, including the runner's own latest samples
    num_prompt_tokens: int
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
        shape = (num_blocks, self.block_size, a.num_kv_heads, a.head_dim)
        # zeroed, not empty: masked-out slots are multiplied by 0 probabilities, and 0 * NaN = NaN
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(a.num_layers)]
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
                num_prompt_tokens=len(nr.prompt_token_ids), block_ids=list(nr.block_ids),
                num_computed_tokens=nr.num_computed_tokens, sampling_params=nr.sampling_params,
                bad_words_token_ids=nr.bad_words_token_ids)
        for cr in so.cached_requests:
            st = self.requests[cr.req_id]
            st.block_ids.extend(cr.new_block_ids)
            assert st.num_computed_tokens == cr.num_computed_tokens, \
                f"{cr.req_id}: runner at {st.num_computed_tokens}, scheduler at {cr.num_computed_tokens}"

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

        # decodes: one token each, batched attention over padded block tables
        nd = len(decodes)
        max_blocks = 0
        for st in decodes:
            pos = st.num_computed_tokens
            input_ids.append(st.token_ids[pos])
            positions.append(pos)
            slots.append(st.block_ids[pos // bs] * bs + pos % bs)
            max_blocks = max(max_blocks, pos // bs + 1)
        meta = AttentionMetadata(slot_mapping=None, num_decodes=nd)
        if nd:
            table = torch.tensor([st.block_ids[:max_blocks] + [0] * (max_blocks - len(st.block_ids[:max_blocks]))
                                  for st in decodes], dtype=torch.long, device=self.device)
            seq_lens = torch.tensor([p + 1 for p in positions], dtype=torch.long, device=self.device)
            key_pos = torch.arange(max_blocks * bs, device=self.device)
            meta.decode_block_table = table
            meta.decode_key_mask = (key_pos[None, :] < seq_lens[:, None]).view(nd, 1, 1, -1)
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
                prompt_token_ids=[st.token_ids[:st.num_prompt_tokens] for st in sample_states],
                output_token_ids=[st.token_ids[st.num_prompt_tokens:] for st in sample_states],
                eos_token_ids=self.eos_token_ids,
                bad_words_token_ids=[st.bad_words_token_ids for st in sample_states],
                vocab_size=self.vocab_size, device=dev, generator=self.generator)
            out = self.sampler(logits, smeta)
            sampled = out.sampled_token_ids
            for st, tok in zip(sample_states, sampled):
                st.token_ids.append(tok)
                req_ids.append(st.req_id)
            if out.logprobs is not None:
                lp = out.logprobs
                logprobs = [None if ids is None else (ids, vals, rank)
                            for ids, vals, rank in zip(lp.logprob_token_ids, lp.logprobs, lp.sampled_token_ranks)]
        dt = time.perf_counter() - t0
        self.execute_time_s += dt
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=logprobs,
                                 execute_time_s=dt)
