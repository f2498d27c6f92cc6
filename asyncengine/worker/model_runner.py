"""ModelRunner: turns a SchedulerOutput into one flat, unpadded token batch, runs the model and the
sampler, and returns the sampled ids. It owns every tensor: the weights and the KV cache.

It keeps a small state per request (its token ids as far as the runner knows them, its block
table), so the scheduler sends only what changed. The runner appends each token it samples to that
state, which is what lets the scheduler plan step N+1 before step N's tokens reach it: the input
of a decode is always the runner's own last sample.

Under tensor parallelism every rank runs this same code on the same SchedulerOutput (so every
rank builds the same batch and calls the same collectives); rank 0 alone samples, and broadcasts
the sampled ids so that every rank's request state advances alike. Only rank 0 returns an output.
"""
from __future__ import annotations

import ctypes
import math
import mmap
import sys
import time
from dataclasses import dataclass

import torch

from asyncengine.config import EngineConfig
from asyncengine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from asyncengine.layers.parallel import SINGLE, TPGroup
from asyncengine.worker.sampler import Sampler, SamplingMetadata, gather_logprobs
from asyncengine.layers.attention import (AttentionMetadata, PrefillChunk, TorchPagedAttention,
                                          build_decode_groups)
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


def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes on this rank (its share of the KV heads; core/kv_sizing.py)."""
    from asyncengine.core.kv_sizing import KVModelShape, bytes_per_block

    a = model.args
    shape = KVModelShape(a.num_layers, model.num_kv_heads, a.head_dim, max_model_len=0)
    return bytes_per_block(shape, block_size, dtype.itemsize)


def kv_cache_zeros(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV-cache tensor whose memory is not touched until used.

    Zeroed, not empty: masked-out slots are multiplied by 0 probabilities, and 0 * NaN = NaN. On CPU
    the zeros come from the kernel: fresh anonymous memory reads as zero and each page becomes
    resident only when first written, so a cache sized for many long sequences costs a one-line
    chat only the pages its few blocks use (zeroing 2 GiB up front took 6.7 s and 2 GiB of RSS).
    No huge-page advice (it made decode gathers ~15% faster): the head-major layout spreads a block
    over every head's region, and each first write would fault in 2 MiB where it needs 4 KiB."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # the tensor keeps the mapping alive


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt() parameters


def keep_freed_memory() -> bool:
    """Ask glibc malloc to keep freed memory for reuse instead of giving it back to the OS.

    torch's CPU allocator has no cache of its own: every step allocates its activations afresh
    (several MiB each at 2048 tokens) and frees them. By default glibc serves blocks that large
    with fresh mmap()s, or trims the heap as they are freed, so every step pays page faults on
    every large tensor; prefill attention ran at half speed for it (docs/benchmarks.md). With
    these settings the process keeps its peak heap instead (its RSS does not shrink after a burst).
    Process-wide and idempotent; a no-op (False) off glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)  # glibc's maximum: larger blocks still mmap
        return bool(ok and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):
        return False


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, num_blocks: int,
                 eos_token_ids: list[int], tp: TPGroup = SINGLE) -> None:
        self.config = config
        if config.torch_device.type == "cpu":
            keep_freed_memory()
        self.model = model
        self.tp = tp
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        self.vocab_size = self.model.args.vocab_size
        self.eos_token_ids = list(eos_token_ids)
        a = self.model.args
        # this rank's heads: the KV cache holds only its KV heads
        self.num_heads, self.num_kv_heads = model.num_heads, model.num_kv_heads
        self.num_blocks = num_blocks
        # this rank's KV heads only; lazily zero-filled (kv_cache_zeros)
        shape = TorchPagedAttention.kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, a.head_dim)
        self.kv_caches = [(kv_cache_zeros(shape, self.dtype, self.device),
                           kv_cache_zeros(shape, self.dtype, self.device))
                          for _ in range(a.num_layers)]
        # scratch for the decode attention's gathered keys, reused by every layer and step
        self.attn_workspace = torch.empty(0, dtype=self.dtype, device=self.device)
        self.requests: dict[str, RunnerRequestState] = {}
        # requests that asked for prompt logprobs (only a gate: empty = skip that work entirely)
        self._prompt_logprob_ids: set[str] = set()
        self.sampler = Sampler()
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.execute_time_s = 0.0  # total time inside execute(), for the busy-fraction metric

    # ------------------------------------------------------------------ state

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self._prompt_logprob_ids.discard(rid)
        for nr in so.new_requests:
            self.requests[nr.req_id] = RunnerRequestState(
                req_id=nr.req_id, num_prompt_tokens=len(nr.prompt_token_ids), prompt_ids=nr.prompt_token_ids,
                output_ids=list(nr.output_token_ids), block_ids=list(nr.block_ids),
                num_computed_tokens=nr.num_computed_tokens, sampling_params=nr.sampling_params,
                bad_words_token_ids=nr.bad_words_token_ids)
            if nr.sampling_params.prompt_logprobs is not None:
                self._prompt_logprob_ids.add(nr.req_id)
            else:
                self._prompt_logprob_ids.discard(nr.req_id)
        for cr in so.cached_requests:
            st = self.requests[cr.req_id]
            st.block_ids.extend(cr.new_block_ids)
            assert st.num_computed_tokens == cr.num_computed_tokens, \
                f"{cr.req_id}: runner at {st.num_computed_tokens}, scheduler at {cr.num_computed_tokens}"

    def _workspace(self, groups) -> torch.Tensor:
        """The decode scratch, grown (never shrunk) to hold the largest group's gathered keys."""
        a = self.model.args
        need = max(self.num_kv_heads * (g.end - g.start) * g.num_blocks * self.block_size * a.head_dim
                   for g in groups)
        if self.attn_workspace.numel() < need:
            self.attn_workspace = torch.empty(need, dtype=self.dtype, device=self.device)
        return self.attn_workspace

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """This step's output on rank 0; None on the other ranks."""
        t0 = time.perf_counter()
        self._update_states(so)
        if so.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[]) if self.tp.rank == 0 else None
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
            n_prompt = st.num_prompt_tokens
            input_ids.append(st.prompt_ids[pos] if pos < n_prompt else st.output_ids[pos - n_prompt])
            positions.append(pos)
            slots.append(st.block_ids[pos // bs] * bs + pos % bs)
        meta = AttentionMetadata(slot_mapping=None, num_decodes=nd)
        if nd:
            meta.decode_groups = build_decode_groups(
                [st.block_ids for st in decodes], [p + 1 for p in positions], bs, self.num_kv_heads,
                self.num_heads // self.num_kv_heads, self.num_blocks, self.device)
            meta.workspace = self._workspace(meta.decode_groups)
            for i, st in enumerate(decodes):
                if st.num_computed_tokens + 1 == st.num_tokens:
                    sample_rows.append(i)
                    sample_states.append(st)

        # prefill chunks
        row = nd
        for st, n in prefills:
            start = st.num_computed_tokens
            end = start + n
            input_ids.extend(st.tokens(start, end))
            positions.extend(range(start, end))
            blocks = st.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            nb = -(-end // bs)
            meta.prefills.append(PrefillChunk(
                q_start=row, q_end=row + n, context_len=start,
                block_ids=torch.tensor(blocks[:nb], dtype=torch.long, device=self.device)))
            row += n
            if end == st.num_tokens:
                sample_rows.append(row - 1)
                sample_states.append(st)

        plp_spans = self._prompt_logprob_spans(decodes, prefills, positions) if self._prompt_logprob_ids else None

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
        if sample_rows and self.tp.rank > 0:  # take part in the head's gather, then learn the ids
            idx = torch.tensor(sample_rows, dtype=torch.long, device=dev)
            self.model.compute_logits(hidden[idx])
            ids = self.tp.broadcast_from_first(torch.empty(len(sample_rows), dtype=torch.long, device=dev))
            for st, tok in zip(sample_states, ids.tolist()):
                st.output_ids.append(tok)
            if plp_spans:
                self._prompt_logprobs(hidden, plp_spans)
            self.execute_time_s += time.perf_counter() - t0
            return None
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
            if self.tp.size > 1:
                self.tp.broadcast_from_first(torch.tensor(sampled, dtype=torch.long, device=dev))
            for st, tok in zip(sample_states, sampled):
                st.output_ids.append(tok)
                req_ids.append(st.req_id)
            if out.logprobs is not None:
                lp = out.logprobs
                logprobs = [None if ids is None else (ids, vals, rank)
                            for ids, vals, rank in zip(lp.logprob_token_ids, lp.logprobs, lp.sampled_token_ranks)]
        prompt_logprobs = self._prompt_logprobs(hidden, plp_spans) if plp_spans else None
        if self.tp.rank > 0:  # no row sampled this step (every chunk was mid-prompt)
            self.execute_time_s += time.perf_counter() - t0
            return None
        dt = time.perf_counter() - t0
        self.execute_time_s += dt
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[t] for t in sampled], logprobs=logprobs,
                                 prompt_logprobs=prompt_logprobs, execute_time_s=dt)

    # ------------------------------------------------------------------ prompt logprobs

    def _prompt_logprob_spans(self, decodes, prefills, positions: list[int]
                              ) -> list[tuple[RunnerRequestState, int, int, int]]:
        """(state, first flat row, first position, count) of the prompt positions this step computes
        for requests with prompt_logprobs: every position but the prompt's last (whose logits are
        the first sample's). Call before the computed counts advance; rows as execute() lays them
        out (decodes first, then the prefill chunks in order)."""
        spans = []
        for i, st in enumerate(decodes):
            if st.sampling_params.prompt_logprobs is not None and st.num_computed_tokens < st.num_prompt_tokens - 1:
                spans.append((st, i, st.num_computed_tokens, 1))
        row = len(decodes)
        for st, n in prefills:
            if st.sampling_params.prompt_logprobs is not None:
                start = st.num_computed_tokens
                m = min(start + n, st.num_prompt_tokens - 1) - start
                if m > 0:
                    spans.append((st, row, start, m))
            row += n
        for st, row, start, m in spans:  # the batch layout is as assumed above
            assert positions[row] == start and positions[row + m - 1] == start + m - 1, "batch layout changed"
        return spans

    def _prompt_logprobs(self, hidden: torch.Tensor, spans, rows_per_pass: int = 512) -> dict:
        """Raw log_softmax logprobs of each next prompt token (and the top k), computed in slices of
        rows so that a long chunk never materializes [chunk, vocab] logits at once."""
        out = {}
        V = self.vocab_size
        for st, row, start, m in spans:
            k = min(st.sampling_params.prompt_logprobs, V)
            targets = torch.tensor(st.prompt_ids[start + 1:start + m + 1], dtype=torch.long, device=self.device)
            entries: list = []
            for c in range(0, m, rows_per_pass):
                e = min(m, c + rows_per_pass)
                logits = self.model.compute_logits(hidden[row + c:row + e])
                if logits is None:  # a tensor-parallel rank other than 0: it only took part
                    continue
                lp = logits.float()[:, :V].log_softmax(dim=-1)
                ids_t, lps_t, ranks_t = gather_logprobs(lp, targets[c:e], k)
                entries.extend(zip(ids_t.tolist(), lps_t.tolist(), ranks_t.tolist()))
            if self.tp.rank == 0:
                out[st.req_id] = (start, entries)
        return out
