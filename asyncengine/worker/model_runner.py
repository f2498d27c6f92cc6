"""ModelRunner: turns a SchedulerOutput into one flat, unpadded token batch, runs the model and the
sampler, and returns the sampled ids. It owns every tensor: the weights and the KV cache.

It keeps a small state per request (its token ids as far as the runner knows them, its block
table: worker/request_state.py), so the scheduler sends only what changed. The runner appends each
token it samples to that state, which is what lets the scheduler plan step N+1 before step N's
tokens reach it: the input of a decode is always the runner's own last sample.

Around the step, each idea has its module: the KV tensors (attention/kv_cache.py), structured-output
masks (worker/grammar.py), speculative drafts and their verification (worker/speculation.py: a
request with drafts is laid out like a prefill chunk of its last token and the drafts, every row
sampled), prompt logprobs (worker/prompt_logprobs.py).

Under tensor parallelism every rank runs this same code on the same SchedulerOutput (so every
rank builds the same batch and calls the same collectives); rank 0 alone samples, and broadcasts
the sampled ids so that every rank's request state advances alike. Only rank 0 returns an output.

Under pipeline parallelism every stage builds the same batch too; a stage other than the first
receives the previous stage's hidden states instead of embedding ids, one other than the last
sends its own on (worker/pipeline.py) and samples nothing. Only the last stage samples, so the
scheduler sends the other stages the tokens sampled since a request's last step
(``CachedRequestData.new_token_ids``; in-flight batches are disjoint, so it knows them all).
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence

import torch

from asyncengine.attention.backend import StepBatch
from asyncengine.attention.buffers import PersistentBuffers
from asyncengine.attention.kv_cache import kv_cache_zeros
from asyncengine.attention.selector import get_model_backend, model_backend_name
from asyncengine.config.grammar_limits import GrammarLimits
from asyncengine.config.speculative import SpeculativeConfig
from asyncengine.config.sub_configs import (CacheConfig, KVTransferConfig, LoRAConfig, ModelConfig,
                                            MultiModalConfig, SchedulerConfig)
from asyncengine.contracts.kv_cache_spec import KVCacheConfig, KVCacheGroup
from asyncengine.contracts.sched_output import ModelRunnerOutput, SchedulerOutput
from asyncengine.kv_connector.factory import make_worker_connector
from asyncengine.kv_connector.offload.fingerprint import kv_fingerprint
from asyncengine.layers import batch_invariant
from asyncengine.layers.moe import SparseMoE, take_expert_load
from asyncengine.layers.parallel import FULL, SINGLE, PPGroup, TPGroup
from asyncengine.worker.cpu_malloc import keep_freed_memory
from asyncengine.worker.encoder_cache import EncoderCache
from asyncengine.worker.grammar import Grammar
from asyncengine.worker.pooling import pool_spans, pooling_spans, token_types
from asyncengine.worker.prompt_logprobs import compute_prompt_logprobs, prompt_logprob_spans
from asyncengine.worker.request_state import RunnerRequestState
from asyncengine.worker.sampler import Sampler, SamplerOutput
from asyncengine.worker.sampling_batch import SamplingBatch
from asyncengine.worker.sampling_metadata import SamplingMetadata
from asyncengine.worker.speculation import accept_drafts, draft_outputs, make_proposer, propose_drafts
from asyncengine.worker.state_cache import StateCache
from asyncengine.worker.kv_groups import allocate_kv_caches, grouped_metadata
from asyncengine.worker.step_layout import StepLayout, classify, lay_out, row_lora_ids

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVCacheConfig, eos_token_ids: list[int], *,
                 model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                 kv_groups: Sequence[KVCacheGroup] = (), kv_transfer_config: KVTransferConfig | None = None,
                 lora_config: LoRAConfig | None = None, multimodal_config: MultiModalConfig | None = None,
                 speculative: SpeculativeConfig | None = None, grammar_limits: GrammarLimits | None = None,
                 tp: TPGroup = SINGLE, draft_model: torch.nn.Module | None = None, pp: PPGroup = FULL) -> None:
        """Each part of the engine's configuration as its view (config/sub_configs.py); an optional
        one left None is its feature off. ``kv``: the core's block plan (never re-read from
        ``cache_config``); ``kv_groups``: the block tables the engine keeps (worker/kv_groups.py)."""
        self.model_config, self.scheduler_config = model_config, scheduler_config
        self.device, self.dtype = model_config.torch_device, model_config.torch_dtype
        if self.device.type == "cpu":
            keep_freed_memory()
        self.model, self.tp, self.pp = model, tp, pp
        # the one rank that returns each step's output: tensor rank 0 of the last stage
        self.is_output_rank = tp.rank == 0 and pp.is_last
        self.block_size = kv.block_size  # the core's plan (core/kv_cache_spec.py), not re-read from config
        self.vocab_size = self.model.args.vocab_size
        self.eos_token_ids = list(eos_token_ids)
        a = self.model.args
        # this rank's heads: the KV cache holds only its KV heads
        self.num_heads, self.num_kv_heads = model.num_heads, model.num_kv_heads
        self.num_blocks = num_blocks = kv.num_blocks
        # the attention backend owns the cache layout and builds each step's attention metadata
        self.attn_backend = self._attention_backend(model_config, scheduler_config, cache_config.kv_cache_dtype, a)
        self.kv_groups = list(kv_groups)
        self._init_kv_cache(a.num_layers if pp.size == 1 else len(model.layers), kv_transfer_config,
                            functools.partial(kv_fingerprint, model_config, cache_config, tp.size))
        self.link = None  # pipeline parallel: the stage's link to its neighbours
        if pp.size > 1:
            from asyncengine.worker.pipeline import StageLink  # lazy: CUDA graphs / pipeline parallel only when configured
            self.link = StageLink(pp, a.hidden_size, self.dtype, self.device)
        self.recv_wait_s = 0.0  # time spent waiting for the previous stage (the pipeline's bubble)
        # the step's token ids and positions: filled in place every step (pinned + async copy on CUDA)
        cap = max(scheduler_config.max_num_batched_tokens, scheduler_config.max_num_seqs)
        self.inputs = PersistentBuffers({"input_ids": ((cap,), torch.int64), "positions": ((cap,), torch.int64)},
                                        self.device)
        # hybrid models: the Mamba layers' state slots, one per sequence the scheduler may run
        self.state_cache = StateCache.for_model(model, scheduler_config.max_num_seqs, self.dtype, self.device)
        self.graphs = None  # DecodeGraphs on CUDA with a graph-capturable backend, unless enforce_eager
        if self.device.type == "cuda":
            from asyncengine.worker.cuda_graphs import decode_graphs_for  # lazy: CUDA graphs / pipeline parallel only when configured
            self.graphs = decode_graphs_for(self, model_config, scheduler_config)
        self.requests: dict[str, RunnerRequestState] = {}
        # vision-language models: the image encoder's outputs by image hash (worker/encoder_cache.py)
        self.encoder_cache = EncoderCache.for_model(model, self.device, self.dtype, *(
            (multimodal_config.mm_encoder_cache_tokens,) if multimodal_config is not None else ()))
        self.lora = None  # multi-LoRA: the adapters' slots and hooks on the model (lora/hooks.py)
        if lora_config is not None and lora_config.enable_lora:
            from asyncengine.lora.hooks import LoRAModel  # lazy: only LoRA serving needs it
            self.lora = LoRAModel(model, lora_config.max_loras, lora_config.max_lora_rank, lora_config.max_cpu_loras,
                                  self.dtype)
        # requests that asked for prompt logprobs (only a gate: empty = skip that work entirely)
        self._prompt_logprob_ids: set[str] = set()
        self._pooling_ids: set[str] = set()  # pooling (embedding) requests, the same kind of gate
        self.sampler = Sampler()
        self.generator = torch.Generator(device=self.device).manual_seed(model_config.seed)
        # the sampler's per-row tables and penalty token ids, kept across steps
        self.sampling = SamplingBatch(self.vocab_size, self.eos_token_ids, self.device, self.generator)
        self.execute_time_s = 0.0  # total time inside execute(), for the busy-fraction metric
        # mixture-of-experts layers count the tokens routed to each expert (stats' load balance)
        self.moe_layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
        for m in self.moe_layers:
            m.record_load = True
        self.spec = speculative
        # structured outputs: matchers and each step's masks (the compiler is made on first use)
        self.grammar = Grammar(model_config, grammar_limits, self.vocab_size, self.eos_token_ids)
        self.proposer = None  # spec_decode/proposer.py: n-gram lookup or a draft model
        if speculative is not None:
            self.proposer = make_proposer(speculative, draft_model, num_blocks, self.block_size, self.device,
                                          self.dtype, self.attn_backend.name)

    def _init_kv_cache(self, num_layers: int, kv_transfer: KVTransferConfig | None, fingerprint) -> None:
        """This stage's attention layers' caches (a.num_layers is the whole model's: pipeline parallel
        holds a slice; hybrids count their attention layers there), zeroed: masked-out slots are
        multiplied by 0 probabilities, and 0 * NaN = NaN. Mixed full/sliding models: a table per group."""
        self.kv_caches = allocate_kv_caches(self.attn_backend, self.kv_groups, num_layers, kv_cache_zeros)
        if len(self.kv_groups) > 1:
            log.info("KV cache: %d block tables, one per group; the native decode step and CUDA graphs take one "
                     "table, so they stay off for this model", len(self.kv_groups))
        # moves KV between the cache and elsewhere around each step (kv_connector/; None: off)
        self.kv_connector = None if kv_transfer is None else make_worker_connector(
            kv_transfer, self.attn_backend.name, self.kv_caches, fingerprint)

    def _attention_backend(self, model_config: ModelConfig, sched: SchedulerConfig, kv_cache_dtype: str, a):
        """The backend for this model's attention: its scale, soft-cap and windows checked at start."""
        name = model_backend_name(model_config.attention_backend, model_config.attention_backend_name, a)
        backend = get_model_backend(
            name, a, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=a.head_dim, block_size=self.block_size, num_blocks=self.num_blocks, dtype=self.dtype,
            device=self.device, max_num_tokens=sched.max_num_batched_tokens, max_num_seqs=sched.max_num_seqs,
            max_blocks_per_seq=min(self.num_blocks, -(-a.max_positions // self.block_size)),
            scale=getattr(a, "attn_scale", None),  # Gemma: query_pre_attn_scalar ** -0.5
            kv_cache_dtype=kv_cache_dtype)
        if model_config.batch_invariant:
            batch_invariant.check_backend(backend)
            backend.batch_invariant = True
        return backend

    @property
    def grammar_time_s(self) -> float:
        """Time spent on masks and matchers (the structured-output overhead)."""
        return self.grammar.time_s

    # ------------------------------------------------------------------ state

    def reset_requests(self) -> None:
        """Forget every request (the core abandoned them all): their states, prompt-logprob marks
        and the draft model's computed positions."""
        self.requests.clear()
        if self.encoder_cache is not None:
            self.encoder_cache.reset()
        self._prompt_logprob_ids.clear()
        self._pooling_ids.clear()
        self.sampling.clear()
        if self.proposer is not None:
            self.proposer.reset()

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self._prompt_logprob_ids.discard(rid)
            self._pooling_ids.discard(rid)
            self.sampling.forget(rid)
            if self.proposer is not None:
                self.proposer.forget(rid)
            if self.encoder_cache is not None:
                self.encoder_cache.forget(rid)
        for nr in so.new_requests:
            if self.encoder_cache is not None:
                self.encoder_cache.add(nr.req_id, nr.mm_inputs, nr.num_computed_tokens)
            self.sampling.forget(nr.req_id)  # a re-sent request starts afresh
            self.requests[nr.req_id] = RunnerRequestState(
                req_id=nr.req_id, num_prompt_tokens=len(nr.prompt_token_ids), prompt_ids=nr.prompt_token_ids,
                output_ids=list(nr.output_token_ids), block_ids=list(nr.block_ids),
                num_computed_tokens=nr.num_computed_tokens, sampling_params=nr.sampling_params,
                bad_words_token_ids=nr.bad_words_token_ids, state_slot=nr.state_slot,
                lora_id=self.lora.ensure(nr.lora_request) if self.lora is not None else 0,
                group_block_ids=[list(t) for t in nr.group_block_ids])
            if self.proposer is not None:
                self.proposer.add(nr.req_id, nr.num_computed_tokens - nr.num_external_tokens)
            if nr.sampling_params.structured_outputs is not None:
                self.grammar.start(self.requests[nr.req_id])
            if nr.sampling_params.pooling is not None:
                self._pooling_ids.add(nr.req_id)
            if nr.sampling_params.prompt_logprobs is not None:
                self._prompt_logprob_ids.add(nr.req_id)
            else:
                self._prompt_logprob_ids.discard(nr.req_id)
        feed = not self.pp.is_last  # only the last stage samples: the others learn the tokens here
        for cr in so.cached_requests:
            st = self.requests[cr.req_id]
            st.block_ids.extend(cr.new_block_ids)
            for table, new in zip(st.group_block_ids, cr.new_group_block_ids):
                table.extend(new)
            if feed and cr.new_token_ids:
                st.output_ids.extend(cr.new_token_ids)
            # with speculation the scheduler counts in-flight drafts as accepted (>=): the runner
            # knows the true position
            assert st.num_computed_tokens == cr.num_computed_tokens or (
                self.spec is not None and st.num_computed_tokens < cr.num_computed_tokens), \
                f"{cr.req_id}: runner at {st.num_computed_tokens}, scheduler at {cr.num_computed_tokens}"

    def _stage(self, name: str, values: list[int]) -> torch.Tensor:
        if len(values) <= self.inputs.capacity(name):
            return self.inputs.stage(name, values)
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _rows(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """The hidden states of the sampled rows. Rows come in increasing order, so as many rows as the
        batch has are all of them: then no index tensor, no gather (each step of a pure decode batch)."""
        if len(rows) == hidden.shape[0]:
            return hidden
        return hidden[torch.tensor(rows, dtype=torch.long, device=self.device)]

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """This step's output on rank 0; None on the other ranks."""
        conn = self.kv_connector
        if conn is None:
            return self._execute(so)
        conn.before_forward(so.kv_connector_metadata)
        out = self._execute(so)
        conn.after_forward(so.kv_connector_metadata)
        if out is not None:
            out.kv_connector_output = conn.take_output()
        return out

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """One step as named sub-steps: update the request states, lay out the flat batch, run the
        model (a captured graph, or this pipeline stage's part), then sample and accept."""
        t0 = time.perf_counter()
        self._update_states(so)
        if so.state_copies:  # hybrid n > 1 forks: before this step's forward moves the sources on
            self.state_cache.copy_slots(so.state_copies)
        if not so.total_num_scheduled_tokens:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[]) if self.is_output_rank else None
        decodes, prefills, specs = classify(so, self.requests)
        # a draft model runs on every position the target computes, drafts or not
        if self.proposer is not None and (specs or self.proposer.runs_every_step):
            specs = propose_drafts(self.proposer, decodes, prefills, specs)
        lay = lay_out(decodes, prefills, specs, self.block_size)
        plp_spans = prompt_logprob_spans(decodes, prefills, lay.positions) if self._prompt_logprob_ids else None
        pool_sp = pooling_spans(decodes, prefills) if self._pooling_ids else None
        for st in decodes:
            st.num_computed_tokens += 1
        for st, n in prefills:
            st.num_computed_tokens += n
        extra = {}
        if pool_sp and getattr(self.model, "uses_token_types", False):  # an encoder's (query, document) pairs
            extra["token_type_ids"] = token_types(pool_sp, len(lay.input_ids), self.device)
        hidden = self._forward(lay, decodes, prefills, specs, extra)
        if hidden is None:  # a pipeline stage before the last: sent on, nothing to sample
            self.execute_time_s += time.perf_counter() - t0
            return None
        if lay.sample_rows and self.tp.rank > 0:
            self._follow_the_head(hidden, lay, plp_spans)
            self.execute_time_s += time.perf_counter() - t0
            return None
        req_ids, sampled_ids, logprobs, num_drafts = self._sample_and_accept(hidden, lay, specs)
        prompt_logprobs = self._prompt_logprobs(hidden, plp_spans) if plp_spans else None
        pooled = pool_spans(hidden, pool_sp, getattr(self.model, "classify_pooled", None)) if pool_sp else None
        if self.tp.rank > 0:  # no row sampled this step (every chunk was mid-prompt)
            self.execute_time_s += time.perf_counter() - t0
            return None
        dt = time.perf_counter() - t0
        self.execute_time_s += dt
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled_ids, logprobs=logprobs,
                                 num_draft_tokens=num_drafts, prompt_logprobs=prompt_logprobs, pooled=pooled,
                                 execute_time_s=dt,
                                 expert_tokens=take_expert_load(self.moe_layers) if self.moe_layers else None)

    def _forward(self, lay: StepLayout, decodes: list[RunnerRequestState], prefills=(),
                 specs=(), extra=None) -> torch.Tensor | None:
        """The model over the flat batch: the hidden states, or None on a pipeline stage that sent
        its own on to the next. ``extra``: more model inputs (an encoder's token types)."""
        nd = lay.num_decodes
        if self.lora is not None:
            self.lora.set_rows(row_lora_ids(lay, decodes, prefills, specs))
        req_ids = [st.req_id for st in (*decodes, *(st for st, _ in prefills), *(st for st, _ in specs))]
        mm = None if self.encoder_cache is None else self.encoder_cache.step_embeds(req_ids, lay.seqs)
        graph_size = self.graphs.size_for(nd) if self.graphs is not None and nd == len(lay.seqs) \
            and not getattr(self.model, "lora_active", False) and mm is None else None
        if graph_size is not None:  # a pure decode step: replay the captured graph of its padded size
            return self.graphs.run(graph_size, lay.input_ids, lay.positions, lay.seqs, lay.slots)
        if len(self.kv_groups) > 1:  # a metadata per group (worker/kv_groups.py): the native step declines it
            meta = grouped_metadata(self.attn_backend, lay, [*decodes, *(st for st, _ in prefills),
                                                             *(st for st, _ in specs)], self.block_size)
        else:
            meta = self.attn_backend.build_metadata(StepBatch(seqs=lay.seqs, slot_mapping=lay.slots, num_decodes=nd))
        stage = dict(extra or {}) if self.state_cache is None else {
            "ssm": self.state_cache.step_meta([st.state_slot for st in decodes], lay.ssm_chunks)}
        if mm is not None:
            stage["mm_embeds"] = mm
        if getattr(self.model, "uses_mrope", False):  # Qwen2-VL: (t, h, w) per token (worker/mrope_positions.py)
            stage["mrope_positions"] = self.encoder_cache.positions(req_ids, lay.seqs)
        if self.link is not None and not self.pp.is_first:  # the previous stage's stream
            t_wait = time.perf_counter()
            stage["intermediate"] = self.link.recv(lay.num_rows)
            self.recv_wait_s += time.perf_counter() - t_wait
        hidden = self.model(self._stage("input_ids", lay.input_ids), self._stage("positions", lay.positions),
                            self.kv_caches, meta, **stage)
        if self.link is not None and not self.pp.is_last:  # on to the next stage; nothing to sample
            from asyncengine.worker.pipeline import IntermediateTensors  # lazy: only pipeline stages need it

            self.link.send(IntermediateTensors(*hidden))
            return None
        return hidden

    def _follow_the_head(self, hidden: torch.Tensor, lay: StepLayout, plp_spans) -> None:
        """A tensor-parallel rank other than 0: take part in the head's gather, then learn the ids."""
        self.model.compute_logits(self._rows(hidden, lay.sample_rows))
        ids = self.tp.broadcast_from_first(torch.empty(len(lay.sample_rows), dtype=torch.long, device=self.device))
        for st, tok in zip(lay.sample_states, ids.tolist()):
            st.output_ids.append(tok)
        if plp_spans:
            self._prompt_logprobs(hidden, plp_spans)

    def _sample_and_accept(self, hidden: torch.Tensor, lay: StepLayout, specs):
        """Sample the step's rows and append what each request accepts (drafts verified, grammar
        advanced): (request ids, accepted ids per request, logprobs, drafts per request)."""
        req_ids: list[str] = []
        sampled_ids: list[list[int]] = []  # the tokens each row accepted (one without speculation)
        logprobs = num_drafts = None
        sample_rows, sample_states, spec_rows = lay.sample_rows, lay.sample_states, lay.spec_rows
        if sample_rows and specs:
            out = self._sample(hidden, sample_rows, sample_states, draft_outputs(sample_states, specs, spec_rows),
                               {first: d for (_, d), (first, _) in zip(specs, spec_rows)})
            req_ids, sampled_ids, logprobs, num_drafts = accept_drafts(
                out.sampled_token_ids, out.logprobs, sample_states, specs, spec_rows, self.proposer)
        elif sample_rows:
            out = self._sample(hidden, sample_rows, sample_states)
            sampled = out.sampled_token_ids
            if self.tp.size > 1:
                self.tp.broadcast_from_first(torch.tensor(sampled, dtype=torch.long, device=self.device))
            for st, tok in zip(sample_states, sampled):
                st.output_ids.append(tok)
                req_ids.append(st.req_id)
                if st.matcher is not None:
                    self.grammar.accept(st.matcher, tok)
            if out.logprobs is not None:
                lp = out.logprobs
                logprobs = [None if ids is None else [(ids, vals, rank)]
                            for ids, vals, rank in zip(lp.logprob_token_ids, lp.logprobs, lp.sampled_token_ranks)]
            sampled_ids = [[t] for t in sampled]
        return req_ids, sampled_ids, logprobs, num_drafts

    def _sample(self, hidden: torch.Tensor, sample_rows: list[int], sample_states: list[RunnerRequestState],
                output_ids: list[list[int]] | None = None, spec_drafts: dict[int, list[int]] | None = None
                ) -> SamplerOutput:
        """Sample the rows (one per entry of ``sample_states``), each after its ``output_ids``
        (penalties, seeded draw position; None: each state's own), within what its grammar allows."""
        logits = self.model.compute_logits(self._rows(hidden, sample_rows))
        if output_ids is None:  # one row per request: the persistent batch
            smeta = self.sampling.metadata(sample_states)
        else:  # draft rows: each after its own drafts, built from the lists
            smeta = SamplingMetadata.build(
                params=[st.sampling_params for st in sample_states],
                prompt_token_ids=[st.prompt_ids for st in sample_states],
                output_token_ids=output_ids, eos_token_ids=self.eos_token_ids,
                bad_words_token_ids=[st.bad_words_token_ids for st in sample_states],
                vocab_size=self.vocab_size, device=self.device, generator=self.generator)
        if not smeta.fast_greedy or self.grammar.active:  # a plain greedy batch: argmax of the model's dtype
            logits = logits.float()
        self.grammar.apply(logits, sample_states, spec_drafts)
        # the logits are this step's own: the sampler may process them in place
        return self.sampler(logits, smeta, owned=True)

    def _prompt_logprobs(self, hidden: torch.Tensor, spans) -> dict:
        """Every rank runs the LM head over the spans (a collective under tensor parallelism);
        rank 0 keeps the entries."""
        return compute_prompt_logprobs(self.model.compute_logits, hidden, spans, self.vocab_size, self.device,
                               keep=self.tp.rank == 0)
