"""The scheduler's encoder budget (core/encoder_budget.py): a step reaches at most
``max_num_encoder_input_tokens`` placeholder rows of images not encoded yet; a chunk stops before the
image that does not fit; an image larger than the budget goes alone; nothing deadlocks.

Unit cases on ``EncoderBudget.fit``, then a property over random prompts with images driven through
a real Scheduler + KVCacheManager (tests/sched_oracle.py's KV oracle) *and* the worker's real
EncoderCache with a fake tower whose output row i of image k is ``1000 k + i``: every step's
actual encoder work stays within the budget (or is one image alone), every placeholder position gets
exactly its own image's row, and every request finishes with its exact greedy output."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncengine.config import EngineConfig
from asyncengine.contracts.multimodal import MultiModalInput
from asyncengine.core.encoder_budget import EncoderBudget
from asyncengine.core.kv_cache_manager import KVCacheManager
from asyncengine.core.request import Request
from asyncengine.core.scheduler import Scheduler
from asyncengine.errors import ConfigError
from asyncengine.sampling_params import SamplingParams
from sched_oracle import Driver

IMAGE_TOKEN0 = 200  # image k's placeholder rows carry token 200 + k (the KV oracle then tells images apart)


def img(k: int, offset: int, length: int) -> MultiModalInput:
    data = (np.arange(length, dtype=np.float32) + 1000 * k).tobytes()
    return MultiModalInput(hash=f"img{k}-{length}", offset=offset, length=length, data=data, shape=[length])


def make_req(rid: str, parts, max_tokens: int = 3) -> Request:
    """``parts``: text lengths (int) and images ``(k, length)``, in prompt order."""
    toks, mm = [1], []
    for p in parts:
        if isinstance(p, int):
            toks += [3 + (len(toks) + i) % 50 for i in range(p)]
        else:
            k, n = p
            mm.append(img(k, len(toks), n))
            toks += [IMAGE_TOKEN0 + k] * n
    return Request(request_id=rid, prompt_token_ids=toks, max_tokens=max_tokens, mm_inputs=mm or None,
                   sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens))


# ------------------------------------------------------------------ fit(), case by case

def test_chunk_stops_before_the_image_that_does_not_fit():
    b = EncoderBudget(10, [])
    r = make_req("a", [2, (1, 6), 3, (2, 6), 4])  # images at 3..9 and 12..18
    assert b.fit(r, 0, 20) == 12 and b.used == 6 and r.request_id in b.deferred
    b.begin_step()
    assert b.fit(r, 12, 8) == 8 and b.used == 6 and not b.deferred  # the next step takes the second


def test_an_image_larger_than_the_budget_goes_alone():
    b = EncoderBudget(4, [])
    r = make_req("a", [1, (1, 9), (2, 3)])  # 9 rows > 4: alone
    assert b.fit(r, 0, 20) == 11 and b.used == 9  # stops before image 2 (at 11)
    other = make_req("b", [(3, 2)])
    assert b.fit(other, 0, 3) == 1  # budget spent: b's image waits, its first token goes
    b.begin_step()
    assert b.fit(other, 1, 2) == 2 and b.used == 2


def test_a_chunk_starting_inside_an_image_that_does_not_fit_waits():
    b = EncoderBudget(8, [])
    assert b.fit(make_req("a", [(1, 6)]), 0, 7) == 7
    late = make_req("b", [(2, 6)])
    assert b.fit(late, 4, 3) == 0 and "b" in b.deferred  # (a prefix hit ended inside its run)


def test_images_held_by_a_running_request_or_taken_this_step_cost_nothing():
    running = [make_req("a", [2, (1, 8), 4])]
    running[0].num_computed_tokens = 5  # inside image 1's run (3..11): the worker holds its output
    b = EncoderBudget(4, running)
    assert b.fit(make_req("b", [1, (1, 8)]), 0, 10) == 10 and b.used == 0
    running[0].num_computed_tokens = 11  # past it: the output may be gone, encoding counts again
    assert b.fit(make_req("c", [1, (1, 8)]), 0, 10) == 10 and b.used == 8
    assert b.fit(make_req("d", [(1, 8)]), 0, 9) == 9 and b.used == 8  # taken this step already
    twice = make_req("e", [(5, 3), 1, (5, 3)])  # the same image twice in one prompt: encoded once
    b.begin_step()
    assert b.fit(twice, 0, 8) == 8 and b.used == 3


def test_without_chunked_prefill_a_prompt_goes_whole_or_waits():
    b = EncoderBudget(10, [], chunked=False)
    assert b.fit(make_req("a", [(1, 6), (2, 6)]), 0, 13) == 13 and b.used == 12  # nothing before: alone
    assert b.fit(make_req("b", [(3, 1)]), 0, 2) == 0
    assert b.fit(make_req("c", [5]), 0, 6) == 6  # text only: never held back


def test_config_field_and_default():
    assert EngineConfig().scheduler_config.max_num_encoder_input_tokens is None
    kv = KVCacheManager(8, 4)
    s = Scheduler(kv, EngineConfig(max_num_batched_tokens=32).scheduler_config, max_model_len=32)
    assert s.encoder.max_tokens == 32  # None = the step's token budget
    s = Scheduler(kv, EngineConfig(max_num_encoder_input_tokens=5).scheduler_config, max_model_len=32)
    assert s.encoder.max_tokens == 5
    with pytest.raises(ConfigError, match="max_num_encoder_input_tokens"):
        EngineConfig(max_num_encoder_input_tokens=0)


# ------------------------------------------------------------------ scheduler + worker cache, randomly

class FakeTower(torch.nn.Module):
    """The "vision tower": image k's pixel values are 1000 k + row, returned as its rows."""

    def encode_images(self, px: torch.Tensor) -> torch.Tensor:
        return px.unsqueeze(-1)


class EncoderWorker:
    """The worker's real EncoderCache fed each SchedulerOutput before the KV oracle runs it; checks
    each step's encoder work and that every placeholder position gets its own image's row."""

    def __init__(self, driver: Driver, budget: int, lru_rows: int, chunked: bool) -> None:
        from asyncengine.worker.encoder_cache import EncoderCache  # lazy: only this harness needs the worker's class

        self.cache = EncoderCache(FakeTower(), torch.device("cpu"), torch.float32, budget_tokens=lru_rows)
        self.budget, self.chunked, self.max_rows, self.mm = budget, chunked, 0, {}
        self.encoded: set[str] = set()  # the hashes the step being run encodes
        encode = self.cache._encode

        def recording(todo):
            self.encoded |= {m.hash for m in todo}
            return encode(todo)
        self.cache._encode = recording
        inner = driver.runner.execute

        def execute(so):
            self.step(so)
            return inner(so)
        driver.runner.execute = execute

    def step(self, so) -> None:
        c = self.cache
        for rid in so.finished_req_ids:
            c.forget(rid)
        ctx = {cr.req_id: cr.num_computed_tokens for cr in so.cached_requests}
        for nr in so.new_requests:
            c.add(nr.req_id, nr.mm_inputs, nr.num_computed_tokens)
            ctx[nr.req_id], self.mm[nr.req_id] = nr.num_computed_tokens, nr.mm_inputs or []
        ids, seqs, want, q = [], [], {}, 0
        reached: dict[str, set[str]] = {}  # request -> the images its chunk reaches
        for rid, n in so.num_scheduled_tokens.items():
            ids.append(rid)
            seqs.append(SimpleNamespace(query_start=q, query_len=n, context_len=ctx[rid]))
            for m in self.mm[rid]:
                for p in range(max(ctx[rid], m.offset), min(ctx[rid] + n, m.end)):
                    want[q + p - ctx[rid]] = 1000 * int(m.hash[3:].split("-")[0]) + p - m.offset
                    reached.setdefault(rid, set()).add(m.hash)
            q += n
        rows0, self.encoded = c.num_encoded_rows, set()
        out = c.step_embeds(ids, seqs)
        rows, encoded = c.num_encoded_rows - rows0, self.encoded
        # over the budget only alone: one image, or (without chunked prefill) one prompt's images
        assert rows <= self.budget or len(encoded) == 1 or not self.chunked and any(
            encoded <= hs for hs in reached.values()), f"{sorted(encoded)}: {rows} encoder rows > {self.budget}"
        self.max_rows = max(self.max_rows, rows)
        got = {} if out is None else dict(zip(out[0].tolist(), out[1][:, 0].tolist()))
        assert got == want, "a placeholder position got another image's or another row's output"


parts_st = st.lists(st.one_of(st.integers(1, 6), st.tuples(st.integers(0, 4), st.integers(1, 12))),
                    min_size=1, max_size=5)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=st.lists(parts_st, min_size=1, max_size=5), enc_budget=st.integers(1, 16),
       token_budget=st.integers(4, 24), num_blocks=st.integers(14, 40), chunked=st.booleans(),
       overlap=st.booleans(), lru_rows=st.sampled_from([0, 64]))
def test_random_prompts_stay_within_the_encoder_budget(prompts, enc_budget, token_budget, num_blocks, chunked,
                                                       overlap, lru_rows):
    reqs = [make_req(f"r{i}", parts) for i, parts in enumerate(prompts)]
    longest = max(r.num_prompt_tokens + r.max_tokens for r in reqs)
    if not chunked:
        token_budget = max(token_budget, longest)
    kv = KVCacheManager(max(num_blocks, -(-longest // 4) + 1), 4, enable_caching=True)
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=token_budget, enable_chunked_prefill=chunked,
                          max_num_encoder_input_tokens=enc_budget).scheduler_config
    sched = Scheduler(kv, config, max_model_len=kv.pool.num_blocks * 4)
    d = Driver(sched, overlap=overlap)
    worker = EncoderWorker(d, enc_budget, lru_rows, chunked)
    for r in reqs:
        d.add(r)
    d.run(max_steps=2000)
    d.check_done(reqs)
    assert sched.encoder.num_tokens >= worker.cache.num_encoded_rows  # the scheduler's count bounds the work
