"""The P/D connector between two engine cores in one process (the front end's routing done by
hand): a prefill core writes the prompt's KV to a transfer file, a decode core loads it and
computes only the last prompt token. Token-exact against one colocated core, in plain, chunked-
prefill, preemption and n > 1 regimes; an abort at every phase leaves both pools whole and no file
behind; a file for another prompt or model is not loaded."""
from __future__ import annotations

import os
import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncengine.config import EngineConfig
from asyncengine.engine_core.core import EngineCore
from asyncengine.core.request import Request
from asyncengine.errors import ConfigError
from asyncengine.kv_connector.pd import transfer_file as tf
from asyncengine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BS = 8
VOCAB = 512


def make(tiny, **kw) -> EngineCore:
    model_dir, loaded = tiny
    kw.setdefault("num_kv_blocks", 32)
    return EngineCore(EngineConfig(model=model_dir, dtype="float32", block_size=BS, **kw), loaded)


def req(rid, prompt, max_tokens, n=1):
    return Request(request_id=rid, prompt_token_ids=list(prompt), max_tokens=max_tokens,
                   sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n))


def drain(core, outs=None, max_steps=3000):
    outs = {} if outs is None else outs
    for _ in range(max_steps):
        if not core.has_unfinished():
            return outs
        for o in core.step():
            outs.setdefault(o.req_id, []).extend(o.new_token_ids)
    raise AssertionError("not finished")


def whole(core):
    assert core.kv.num_free_blocks == core.num_blocks, "blocks leaked"
    core.kv.pool.check_invariants()
    assert not core.scheduler.requests


def files(d) -> list[str]:
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def prompts(seed=0, k=5):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(9, 60))] for _ in range(k)]


def colocated(tiny, ps, n=1, **opts) -> dict:
    """The outputs of prompts ``ps`` on one ordinary core (what P/D must reproduce token for token)."""
    colo = make(tiny, **opts)
    want = {}
    for i, p in enumerate(ps):
        colo.add_request(req(f"r{i}", p, 6, n=n))
    drain(colo, want)
    colo.shutdown()
    return want


def pd_run(p_core, d_core, ps, max_tokens=6, n=1):
    """Each request: one token on the prefill core, then the whole request on the decode core."""
    out = {}
    for i, p in enumerate(ps):
        rid = f"r{i}"
        p_core.add_request(req(rid, p, 1))
        drain(p_core)
        d_core.add_request(req(rid, p, max_tokens, n=n))
        drain(d_core, out)
    return out


@pytest.fixture
def pd(tiny, tmp_path):
    made = []

    def get(p_opts=None, d_opts=None):
        d = str(tmp_path / "xfer")
        p_core = make(tiny, kv_role="prefill", kv_transfer_dir=d, **(p_opts or {}))
        d_core = make(tiny, kv_role="decode", kv_transfer_dir=d, **(d_opts or {}))
        made.extend([p_core, d_core])
        return p_core, d_core, d

    yield get
    for c in made:
        c.shutdown()


@pytest.mark.parametrize("regime", ["plain", "chunked", "preempt", "n2"])
def test_token_exact_against_colocated(tiny, pd, regime):
    opts = {"chunked": dict(max_num_batched_tokens=16), "preempt": dict(num_kv_blocks=10)}.get(regime, {})
    n = 2 if regime == "n2" else 1
    ps = prompts(seed=len(regime))
    want = colocated(tiny, ps, n=n, **opts)
    p_core, d_core, d = pd(opts, opts)
    if regime == "preempt":  # all at once on the decode core: its small cache preempts
        for i, p in enumerate(ps):
            p_core.add_request(req(f"r{i}", p, 1))
        drain(p_core)
        for i, p in enumerate(ps):
            d_core.add_request(req(f"r{i}", p, 6))
        got = drain(d_core)
        assert d_core.stats()["num_preemptions"] > 0
    else:
        got = pd_run(p_core, d_core, ps, n=n)
    assert got == want
    s = d_core.stats()
    assert s["kv_transfer_imported_requests"] == len(ps)
    assert s["kv_transfer_imported_tokens"] == sum(len(p) - 1 for p in ps)
    assert p_core.stats()["kv_transfer_exported_requests"] == len(ps)
    whole(p_core)
    whole(d_core)
    assert files(d) == []  # every transfer file consumed


def test_int8_kv_cache_transfers_and_a_16_bit_consumer_refuses(tiny, pd):
    """int8 on both sides: the blocks travel with their scales, token-exact against a colocated int8
    core. An int8 producer and a 16-bit consumer: the file is refused (its fingerprint names the
    KV dtype) and the consumer computes the prompt itself."""
    ps = prompts(seed=3, k=3)
    want = colocated(tiny, ps, kv_cache_dtype="int8")
    p_core, d_core, d = pd(dict(kv_cache_dtype="int8"), dict(kv_cache_dtype="int8"))
    assert pd_run(p_core, d_core, ps) == want
    assert d_core.stats()["kv_transfer_imported_requests"] == len(ps)
    whole(d_core)
    p8, d16, _ = pd(dict(kv_cache_dtype="int8"), {})
    want16 = colocated(tiny, ps[:1])
    assert pd_run(p8, d16, ps[:1]) == want16
    s = d16.stats()
    assert s["kv_transfer_rejected_files"] >= 1 and s["kv_transfer_imported_requests"] == 0


def test_no_file_means_the_decode_core_computes(tiny, pd):
    p_core, d_core, d = pd()
    ps = prompts(seed=9, k=2)
    colo = make(tiny)
    for i, p in enumerate(ps):
        colo.add_request(req(f"r{i}", p, 5))
    want = drain(colo)
    colo.shutdown()
    for i, p in enumerate(ps):  # straight to the decode core (a short prompt skipping the hop)
        d_core.add_request(req(f"r{i}", p, 5))
    assert drain(d_core) == want
    assert d_core.stats()["kv_transfer_misses"] == 2


def test_a_file_for_another_prompt_is_not_loaded(tiny, pd):
    p_core, d_core, d = pd()
    a, b = prompts(seed=4, k=2)
    p_core.add_request(req("x", a, 1))
    drain(p_core)
    colo = make(tiny)
    colo.add_request(req("x", b, 5))
    want = drain(colo)
    colo.shutdown()
    d_core.add_request(req("x", b, 5))  # same id, another prompt
    assert drain(d_core) == want
    s = d_core.stats()
    assert s["kv_transfer_rejected_files"] >= 1 and s["kv_transfer_imported_requests"] == 0


def test_aborts_at_every_phase_leave_nothing(tiny, pd):
    p_core, d_core, d = pd(dict(max_num_batched_tokens=16), {})
    p = prompts(seed=2, k=1)[0] + prompts(seed=3, k=1)[0]  # > 16 tokens: prefilled in chunks
    # 1. queued on the prefill core
    p_core.add_request(req("a", p, 1))
    p_core.abort_requests(["a"])
    drain(p_core)
    # 2. prefilling: a first chunk done, aborted before the last one
    p_core.add_request(req("b", p, 1))
    p_core.step()
    p_core.abort_requests(["b"])
    drain(p_core)
    assert files(d) == []  # nothing exported before the prompt's last chunk
    whole(p_core)
    # 3. transferring: exported, the decode core claims it and is aborted in the step that loads it
    p_core.add_request(req("c", p, 1))
    drain(p_core)
    assert len(files(d)) == 1
    d_core.add_request(req("c", p, 6))
    so = d_core.schedule()
    assert so.kv_connector_metadata.import_kv and files(d)[0].endswith(".claimed")
    d_core.abort_requests(["c"])
    d_core.update(so, d_core.execute(so))
    drain(d_core)
    assert files(d) == []
    # 3b. exported, the front end aborts before the decode core saw it: it deletes the file
    p_core.add_request(req("e", p, 1))
    drain(p_core)
    os.unlink(tf.file_path(d, "e"))
    # 4. decoding
    p_core.add_request(req("f", p, 1))
    drain(p_core)
    d_core.add_request(req("f", p, 50))
    for _ in range(3):
        d_core.step()
    d_core.abort_requests(["f"])
    drain(d_core)
    whole(p_core)
    whole(d_core)
    assert files(d) == []


def test_an_unclaimed_file_outlives_no_lease(tiny, pd, tmp_path):
    p_core, d_core, d = pd()
    p = prompts(seed=5, k=1)[0]
    p_core.add_request(req("g", p, 1))
    drain(p_core)  # exported, and the decode side never comes
    path = tf.file_path(d, "g")
    assert os.path.exists(path)
    os.utime(path, (time.time() - 100, time.time() - 100))  # older than the 30 s lease
    assert tf.sweep(d, 30.0) == 1 and files(d) == []
    # a claim whose process is gone is swept at once; one whose process lives is kept
    open(os.path.join(d, "k.999999999.claimed"), "w").close()
    open(os.path.join(d, f"l.{os.getpid()}.claimed"), "w").close()
    assert tf.sweep(d, 30.0) == 1
    assert files(d) == [f"l.{os.getpid()}.claimed"]


def test_config(tiny_llama_dir):
    EngineConfig(model=tiny_llama_dir, kv_role="prefill", kv_offload_bytes=1 << 20)  # both: kv_connector/multi.py
    with pytest.raises(ConfigError, match="kv_role"):
        EngineConfig(model=tiny_llama_dir, kv_role="both")


def drive_with_random_aborts(p_core, d_core, transfer_dir: str, ops) -> None:
    """Requests walk prefill -> transfer -> decode as the front end drives them (a request that
    finished its one prefill token is sent to the decode core before the next operation), with
    aborts landing at random phases (the front end's part of an abort: abort where the request is,
    delete its unclaimed file); at the end the front end goes away and both cores drain."""
    rng = random.Random(0)
    base = [rng.randrange(3, VOCAB) for _ in range(30)]
    prompt_of: dict[str, list[int]] = {}
    phase: dict[str, str] = {}  # id -> "prefill" | "decode"

    def abort(rid: str) -> None:
        (p_core if phase[rid] == "prefill" else d_core).abort_requests([rid])
        if os.path.exists(tf.file_path(transfer_dir, rid)):
            os.unlink(tf.file_path(transfer_dir, rid))

    for i, (op, x) in enumerate(ops):
        for rid in [r for r, ph in phase.items() if ph == "prefill" and r not in p_core.scheduler.requests]:
            d_core.add_request(req(rid, prompt_of[rid], 1 + x))  # exported: on to the decode core
            phase[rid] = "decode"
        for rid in [r for r, ph in phase.items() if ph == "decode" and r not in d_core.scheduler.requests]:
            del phase[rid]  # finished on the decode core
        if op == "new":
            rid = f"r{i}"
            prompt_of[rid] = base[:5 + x] + [7 + x] * (x + 3)
            p_core.add_request(req(rid, prompt_of[rid], 1))
            phase[rid] = "prefill"
        elif op == "p_step":
            p_core.step()
        elif op == "d_step":
            d_core.step()
        elif phase:
            rid = sorted(phase)[x % len(phase)]
            abort(rid)
            del phase[rid]
    for rid in phase:  # the front end goes away: everything left is aborted
        abort(rid)
    drain(p_core)
    drain(d_core)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["new", "p_step", "d_step", "abort"]), st.integers(0, 9)),
                    min_size=5, max_size=40))
def test_random_aborts_at_every_phase_leave_both_sides_whole(tiny, tmp_path_factory, ops):
    """Random aborts at every phase (:func:`drive_with_random_aborts`): afterwards both pools are
    whole and no transfer file is left."""
    d = str(tmp_path_factory.mktemp("pdsoak"))
    p_core = make(tiny, kv_role="prefill", kv_transfer_dir=d, num_kv_blocks=12, max_num_batched_tokens=24)
    d_core = make(tiny, kv_role="decode", kv_transfer_dir=d, num_kv_blocks=6)  # claims that wait for blocks
    try:
        drive_with_random_aborts(p_core, d_core, d, ops)
        whole(p_core)
        whole(d_core)
        assert files(d) == []
    finally:
        p_core.shutdown()
        d_core.shutdown()


def test_abort_while_a_claimed_request_waits_for_blocks(tiny, tmp_path):
    """The decode core claimed the file but has no blocks for the request yet; aborted then, the
    claim is deleted with it."""
    d = str(tmp_path / "xfer")
    p_core = make(tiny, kv_role="prefill", kv_transfer_dir=d)
    d_core = make(tiny, kv_role="decode", kv_transfer_dir=d, num_kv_blocks=6)
    try:
        a, b = prompts(seed=8, k=2)
        d_core.add_request(req("busy", [5] * 40, 6))  # 40 + 6 tokens: every block of 6 x 8
        d_core.step()
        p_core.add_request(req("w", b[:20], 1))
        drain(p_core)
        d_core.add_request(req("w", b[:20], 4))
        d_core.step()  # looked at: claimed, but no block is free
        assert "w" in d_core.scheduler.requests and d_core.scheduler.connector._claims
        assert files(d)[0].endswith(".claimed")
        d_core.abort_requests(["w"])
        assert files(d) == []
        drain(d_core)
        whole(d_core)
        whole(p_core)
    finally:
        p_core.shutdown()
        d_core.shutdown()


def spec_prompts(seed=0, k=5):
    """Prompts that repeat a segment (n-gram drafts get accepted) and plain random ones."""
    rng = random.Random(seed)
    out = []
    for i in range(k):
        seg = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 8))]
        out.append(seg * rng.randrange(3, 7) if i % 2 == 0 else
                   [rng.randrange(3, VOCAB) for _ in range(rng.randrange(9, 40))])
    return out


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_token_exact_with_speculation_on_the_decode_core(tiny, tiny_llama_dir, pd, method):
    """The decode core drafts (n-gram lookup over the imported prompt, or a draft model): greedy
    tokens equal a colocated core's with and without speculation. The draft model here is the target
    itself, so its drafts are all accepted only if its own KV covers the imported prompt too (the
    transfer carries only the target's KV: the draft recomputes the prompt)."""
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
            if method == "ngram" else
            {"method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": 3})
    ps = spec_prompts(seed=11)
    want = {}
    for opts in ({}, dict(speculative_config=spec)):
        colo = make(tiny, **opts)
        for i, p in enumerate(ps):
            colo.add_request(req(f"r{i}", p, 12))
        got_colo = drain(colo)
        colo.shutdown()
        assert not want or got_colo == want
        want = got_colo
    p_core, d_core, d = pd({}, dict(speculative_config=spec))
    got = pd_run(p_core, d_core, ps, max_tokens=12)
    assert got == want
    s = d_core.stats()
    assert s["kv_transfer_imported_requests"] == len(ps), sorted((k, v) for k, v in s.items() if "kv_" in k)
    assert s["spec_num_accepted_tokens"] > 0
    if method == "draft_model":
        assert s["spec_acceptance_rate"] == 1.0, s
    whole(p_core)
    whole(d_core)
    assert files(d) == []
