"""Hostile input, in-process: every limit of validation.py refuses its request before the work, with a
message naming the limit and its value, the same way through LLM and AsyncLLMEngine; a fault in one
request's input or output handling fails that request alone; live request ids are never confused.
(The same over HTTP: tests/integrations/test_hardening_http.py.)"""
from __future__ import annotations

import asyncio
import gc
import math
import random
import tracemalloc

import pytest
from hypothesis import given, settings, strategies as st

from asyncengine import LLM, AsyncLLMEngine, EngineConfig, InvalidRequestError, SamplingParams
from asyncengine.engine.stop_strings import StopAutomaton, StopStringMatcher
from asyncengine.engine.validation import RequestLimitError, RequestLimits, check_json_depth
from asyncengine.errors import EngineDeadError, EngineOverloaded, RequestFailedError

HANG_GUARD_S = 120.0
MAX_MODEL_LEN = 256
VOCAB = 512


def greedy(max_tokens: int = 4, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN)


def make_engine(model_dir: str, **kw) -> AsyncLLMEngine:
    kw.setdefault("num_kv_blocks", 128)
    kw.setdefault("max_model_len", MAX_MODEL_LEN)
    return AsyncLLMEngine(EngineConfig(model=model_dir, dtype="float32", **kw))


def assert_clean_llm(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.has_unfinished() and eng.kv.num_free_blocks == eng.num_blocks


async def assert_clean(eng: AsyncLLMEngine) -> None:
    for _ in range(2000):
        s = eng.stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0 and not eng._slots and not eng._busy_loop.new:
            break
        await asyncio.sleep(0.01)
    s = eng.stats()
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"], s
    assert eng._slots == {} and eng.output_processor.states == {}


# ---------------------------------------------------------------- limits, the same in LLM and AsyncLLMEngine

D = RequestLimits()
LIMIT_CASES = {
    "n": (dict(n=D.max_n + 1), "max_n=128"),
    "logprobs": (dict(logprobs=21), "max_logprobs=20"),
    "prompt_logprobs": (dict(prompt_logprobs=21), "max_prompt_logprobs=20"),
    "stop count": (dict(stop=[f"s{i}" for i in range(17)]), "max_stop_strings=16"),
    "stop length": (dict(stop=["x" * 1025]), "max_stop_string_chars=1024"),
    "stop ids": (dict(stop_token_ids=list(range(3, 3 + 257))), "max_stop_token_ids=256"),
    "stop ids, absurd duplicates": (dict(stop_token_ids=[5] * 300_000), "max_stop_token_ids=256"),
    "logit_bias entries": (dict(logit_bias={i: 1.0 for i in range(1025)}), "max_logit_bias=1024"),
    "logit_bias nan": (dict(logit_bias={5: math.nan}), "finite"),
    "logit_bias inf": (dict(logit_bias={5: math.inf}), "finite"),
    "logit_bias -inf": (dict(logit_bias={5: -math.inf}), "finite"),
    "temperature inf": (dict(temperature=math.inf), "temperature must be a finite number"),
    "allowed + min_tokens ban all": (dict(allowed_token_ids=[1], min_tokens=2), "no allowed token could be sampled"),
    "allowed + stop ids + min_tokens": (dict(allowed_token_ids=[7, 8], stop_token_ids=[7, 8], min_tokens=1),
                                        "no allowed token could be sampled"),
    "bad_words count": (dict(bad_words=[f"w{i}" for i in range(129)]), "max_bad_words=128"),
}


@pytest.mark.parametrize("name", list(LIMIT_CASES))
def test_limits_llm(llm, name):
    kw, fragment = LIMIT_CASES[name]
    params = SamplingParams(max_tokens=4, **kw)
    with pytest.raises(InvalidRequestError) as ei:
        llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert fragment in str(ei.value)
    assert_clean_llm(llm)


async def test_limits_async_engine_same_rules(tiny_llama_dir):
    eng = make_engine(tiny_llama_dir)
    async with eng:
        for name, (kw, fragment) in LIMIT_CASES.items():
            with pytest.raises(InvalidRequestError) as ei:  # at once, from generate()
                eng.generate([5, 6, 7], SamplingParams(max_tokens=4, **kw))
            assert fragment in str(ei.value), name
            if "=" in fragment:
                assert isinstance(ei.value, RequestLimitError) and ei.value.limit == fragment.split("=")[0]
        assert eng._slots == {}
        out = await asyncio.wait_for(eng.complete([5, 6, 7], greedy(3)), HANG_GUARD_S)
        assert len(out.outputs[0].token_ids) == 3
        await assert_clean(eng)


def test_duplicate_stop_ids_are_deduplicated(llm):
    (out,) = llm.generate([[5, 6, 7]], greedy(3, stop_token_ids=[9] * 1000 + [11] * 1000), use_tqdm=False)
    assert out.finished
    p = llm.processor.make_request("d", [5, 6], greedy(3, stop_token_ids=[9] * 1000 + [11]))[0].sampling_params
    assert p.stop_token_ids == [9, 11]


def test_allowed_tokens_with_min_tokens_never_leave_the_set(llm):
    """Allowed ids that min_tokens would partly ban: only the allowed, unbanned ones are emitted."""
    eos = sorted(llm.processor.eos_token_ids)
    allowed = [eos[0], 40, 41]
    for seed in range(3):
        (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, min_tokens=8, allowed_token_ids=allowed,
                                                          temperature=1.0, seed=seed), use_tqdm=False)
        ids = out.outputs[0].token_ids
        assert len(ids) == 8 and set(ids) <= {40, 41}, ids
    assert_clean_llm(llm)


def test_prompt_chars_checked_before_tokenizing(llm, monkeypatch):
    cap = 32 * MAX_MODEL_LEN
    calls = []
    real = llm.tokenizer.encode
    monkeypatch.setattr(llm.tokenizer, "encode", lambda *a, **k: calls.append(1) or real(*a, **k))
    with pytest.raises(RequestLimitError, match=f"max_prompt_chars={cap}"):
        llm.generate("a" * (cap + 1), greedy(), use_tqdm=False)
    assert calls == []  # refused before the tokenizer saw it


def test_tokenizer_error_is_invalid_request(llm, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("tokenizer exploded")

    monkeypatch.setattr(llm.tokenizer, "encode", broken)
    with pytest.raises(InvalidRequestError, match="the tokenizer cannot encode this prompt: RuntimeError"):
        llm.generate("hello", greedy(), use_tqdm=False)
    monkeypatch.undo()
    assert llm.generate("hello", greedy(2), use_tqdm=False)[0].finished


@pytest.mark.parametrize("messages, fragment", [
    ([{"content": "hi"}], "messages[0].role must be one of"),
    ([{"role": "user"}], "messages[0] has no 'content'"),
    ([{"role": "wizard", "content": "hi"}], "role must be one of"),
    ([{"role": "user", "content": 5}], "content must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "only text content parts"),
    ([{"role": "user", "content": "hi"}, "not a message"], "messages[1] must be an object"),
    ([{"role": "user", "content": "x" * (32 * MAX_MODEL_LEN + 1)}], "max_prompt_chars="),
])
async def test_bad_chat_messages(llm, tiny_llama_dir, messages, fragment):
    with pytest.raises(InvalidRequestError) as ei:
        llm.chat(messages, greedy(), use_tqdm=False)
    assert fragment in str(ei.value)
    eng = make_engine(tiny_llama_dir, num_kv_blocks=16)
    async with eng:
        with pytest.raises(InvalidRequestError) as ei:
            eng.generate(messages, greedy())
        assert fragment in str(ei.value)


async def test_chat_template_error_is_invalid_request(tiny_llama_dir, monkeypatch):
    eng = make_engine(tiny_llama_dir, num_kv_blocks=16)
    monkeypatch.setattr(eng.tokenizer, "chat_template", "{{ raise_exception('no system messages') }}")
    async with eng:
        with pytest.raises(InvalidRequestError, match="chat template cannot render"):
            eng.generate([{"role": "system", "content": "x"}], greedy())


# ---------------------------------------------------------------- admission: never-admissible is 400, not 429


async def test_never_admissible_is_invalid_not_overloaded(tiny_llama_dir):
    eng = make_engine(tiny_llama_dir, max_queued_requests=2, max_queued_tokens=20)
    async with eng:
        with pytest.raises(RequestLimitError, match="max_queued_requests=2"):
            eng.generate([5, 6, 7], greedy(n=3))
        with pytest.raises(RequestLimitError, match="max_queued_tokens=20"):
            eng.generate(list(range(3, 30)), greedy())
        a = eng.generate([5, 6, 7], greedy(2, n=2))  # fits, and fills the queue
        with pytest.raises(EngineOverloaded):  # a full queue: retry later
            eng.generate([5, 6, 7], greedy())
        async for _ in a:
            pass
        await assert_clean(eng)


# ---------------------------------------------------------------- request ids


async def test_live_request_id_cannot_be_reused(tiny_llama_dir):
    eng = make_engine(tiny_llama_dir)
    async with eng:
        a = eng.generate([5, 6, 7], greedy(50), request_id="x")
        with pytest.raises(InvalidRequestError, match="'x' is already in use"):
            eng.generate([8, 9], greedy(), request_id="x")
        b = eng.generate([5, 6, 7], greedy(50, n=2), request_id="y")
        # a core id of one of y's samples is taken too (it would mix their outputs)
        with pytest.raises(InvalidRequestError, match="already in use"):
            eng.generate([8, 9], greedy(), request_id="y#1")
        with pytest.raises(InvalidRequestError, match="max_request_id_chars=256"):
            eng.generate([8, 9], greedy(), request_id="z" * 257)
        await a.aclose()
        await b.aclose()
        await assert_clean(eng)


async def test_dropped_old_stream_never_aborts_a_new_request_with_its_id(tiny_llama_dir):
    eng = make_engine(tiny_llama_dir)
    async with eng:
        old = eng.generate([5, 6, 7], greedy(2), request_id="same")
        for _ in range(2000):  # finished, but its last output never consumed: the stream is not done
            if "same" not in eng._slots:
                break
            await asyncio.sleep(0.005)
        assert "same" not in eng._slots
        new = eng.generate([5, 6, 7], greedy(30), request_id="same")
        del old
        gc.collect()  # the old stream's __del__ "abandons" it
        outs = [o async for o in new]
        assert outs[-1].finish_reason == "length" and len(outs[-1].outputs[0].token_ids) == 30
        await assert_clean(eng)


# ---------------------------------------------------------------- faults stay with their request


async def test_output_fault_fails_only_its_request(tiny_llama_dir, monkeypatch):
    eng = make_engine(tiny_llama_dir)
    real = eng.output_processor._process_one

    def poisoned(st, s, co, now, to_abort):
        if st.request_id == "poison" and len(s.token_ids) >= 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "simulated detokenizer fault")
        return real(st, s, co, now, to_abort)

    monkeypatch.setattr(eng.output_processor, "_process_one", poisoned)
    async with eng:
        good = [eng.generate([5 + i, 6, 7], greedy(20), request_id=f"good-{i}") for i in range(3)]
        bad = eng.generate([9, 9, 9], greedy(20, n=2), request_id="poison")
        with pytest.raises(RequestFailedError, match="'poison' failed while its output was processed: "
                                                     "UnicodeDecodeError"):
            async for _ in bad:
                pass
        for g in good:
            outs = [o async for o in g]
            assert outs[-1].finish_reason == "length" and len(outs[-1].outputs[0].token_ids) == 20
        assert not eng.errored
        out = await asyncio.wait_for(eng.complete([5, 6], greedy(3)), HANG_GUARD_S)
        assert len(out.outputs[0].token_ids) == 3
        await assert_clean(eng)


async def test_tokenizer_fault_async_long_and_short(tiny_llama_dir, monkeypatch):
    eng = make_engine(tiny_llama_dir, limits=RequestLimits(off_loop_chars=64))
    real = eng.tokenizer.encode

    def flaky(text, *a, **k):
        if "BOOM" in text:
            raise RuntimeError("cannot encode")
        return real(text, *a, **k)

    monkeypatch.setattr(eng.tokenizer, "encode", flaky)
    async with eng:
        with pytest.raises(InvalidRequestError, match="tokenizer cannot encode"):
            eng.generate("BOOM", greedy())
        with pytest.raises(InvalidRequestError, match="tokenizer cannot encode"):  # long: off the loop
            async for _ in eng.generate("BOOM " * 40, greedy()):
                pass
        assert not eng.errored
        out = await asyncio.wait_for(eng.complete("fine " * 40, greedy(2)), HANG_GUARD_S)
        assert out.finished
        await assert_clean(eng)


async def test_long_tokenizations_are_bounded(tiny_llama_dir, monkeypatch):
    eng = make_engine(tiny_llama_dir, limits=RequestLimits(off_loop_chars=16, max_concurrent_tokenizations=2))
    busy, peak = [0], [0]
    real = eng.processor.tokenize

    def counting(prompt):
        busy[0] += 1
        peak[0] = max(peak[0], busy[0])
        try:
            import time

            time.sleep(0.01)  # long enough for others to pile up (not asserted on)
            return real(prompt)
        finally:
            busy[0] -= 1

    monkeypatch.setattr(eng.processor, "tokenize", counting)
    async with eng:
        streams = [eng.generate(f"a long enough prompt number {i}", greedy(2)) for i in range(8)]
        for s in streams:
            async for _ in s:
                pass
        assert 1 <= peak[0] <= 2
        await assert_clean(eng)


# ---------------------------------------------------------------- the stop matcher is linear


def test_stop_automaton_memory_is_linear():
    """One 20,000-character stop string: the old prefix set held ~200 M characters; the automaton
    holds one edge per character."""
    tracemalloc.start()
    try:
        a = StopAutomaton(["ab" * 10_000])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(a.depth) == 20_001
    assert peak < 16 * 2**20, peak
    m = StopStringMatcher(a)
    text, matched = "", None
    for _ in range(10_001):
        piece, matched = m.feed("ab")
        text += piece
        if matched:
            break
    assert matched == "ab" * 10_000 and text == ""


def _reference(text: str, stops: list[str]):
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < (best[0] + len(best[1]), best[0])):
            best = (i, s)
    return best


@settings(max_examples=300, deadline=None, derandomize=True)
@given(text=st.text("abc", max_size=60), stops=st.lists(st.text("abc", min_size=1, max_size=12), min_size=1,
                                                        max_size=16), seed=st.integers(0, 100))
def test_stop_automaton_matches_reference_many_stops(text, stops, seed):
    rng = random.Random(seed)
    m = StopStringMatcher(stops)
    out, matched, i = "", None, 0
    while i < len(text):
        j = min(len(text), i + rng.randint(1, 5))
        piece, matched = m.feed(text[i:j])
        out += piece
        i = j
        if matched:
            break
    hit = _reference(text, stops)
    if hit is None:
        assert matched is None and out + m.flush() == text
    else:
        assert matched == hit[1] and out == text[:hit[0]]


# ---------------------------------------------------------------- JSON depth


def test_json_depth_check():
    limits = RequestLimits(max_json_depth=8)
    check_json_depth(b'{"a": [[[1]]], "s": "[[[[[[[[[[[[[[[[[[[[[[[["}', limits)  # brackets in strings do not count
    check_json_depth(b'{"s": "\\"[[[[[[[[[[[[[[[[[[["}', limits)  # nor after an escaped quote
    with pytest.raises(RequestLimitError, match="max_json_depth=8"):
        check_json_depth(b"[" * 9 + b"]" * 9, limits)
    with pytest.raises(RequestLimitError, match="nesting depth is 1001"):
        check_json_depth(b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", RequestLimits())


def test_limits_must_be_positive():
    from asyncengine import ConfigError

    with pytest.raises(ConfigError, match="RequestLimits.max_n must be a positive integer"):
        RequestLimits(max_n=0)


async def test_input_fault_in_the_core_fails_only_its_request(tiny_llama_dir, monkeypatch):
    eng = make_engine(tiny_llama_dir)
    real = eng.core.add_request

    def picky(req):
        if req.request_id == "bad-input":
            raise ValueError("simulated admission fault")
        return real(req)

    monkeypatch.setattr(eng.core, "add_request", picky)
    async with eng:
        good = eng.generate([5, 6, 7], greedy(10), request_id="good")
        bad = eng.generate([8, 9], greedy(10), request_id="bad-input")
        with pytest.raises(RequestFailedError, match="'bad-input' failed while it was admitted: ValueError"):
            async for _ in bad:
                pass
        outs = [o async for o in good]
        assert outs[-1].finish_reason == "length" and not eng.errored
        await assert_clean(eng)


async def test_no_core_left_at_admission_kills_the_engine_not_the_request(tiny_llama_dir, monkeypatch):
    """The last data-parallel core died between a request's submission and its hand-over: the
    engine is dead (every stream raises EngineDeadError, the server answers 503), never one request's
    fault (RequestFailedError, a 500)."""
    eng = make_engine(tiny_llama_dir)

    def gone(req):
        raise EngineDeadError("every engine core is dead")

    monkeypatch.setattr(eng.client, "add_request", gone)
    async with eng:
        with pytest.raises(EngineDeadError, match="every engine core is dead") as info:
            async for _ in eng.generate([8, 9], greedy(10)):
                pass
        assert not isinstance(info.value, RequestFailedError) and eng.errored


async def test_absurd_n_is_refused_at_once(tiny_llama_dir):
    eng = make_engine(tiny_llama_dir, num_kv_blocks=16)
    async with eng:
        with pytest.raises(RequestLimitError, match="max_n=128"):  # no per-sample work before the check
            eng.generate([5, 6], SamplingParams(n=10**12), request_id="huge")


async def test_long_stop_strings_are_built_off_the_loop_and_still_match(tiny_llama_dir, monkeypatch):
    """Stop strings over 1,024 characters in all: the automaton is built on a worker thread; the
    request behaves the same (here: a stop that is the greedy text itself ends it)."""
    import threading

    import asyncengine.engine.prompt_intake as ae  # where prompts are prepared

    eng = make_engine(tiny_llama_dir)
    built_on = []
    real = ae.StopAutomaton

    def spy(stops):
        built_on.append(threading.current_thread() is threading.main_thread())
        return real(stops)

    monkeypatch.setattr(ae, "StopAutomaton", spy)
    async with eng:
        free = await asyncio.wait_for(eng.complete([5, 6, 7], greedy(12)), HANG_GUARD_S)
        text = free.outputs[0].text
        assert len(text) >= 4
        stops = [text[2:4]] + ["\x00" + "z" * 1000, "\x01" + "q" * 1000]
        out = await asyncio.wait_for(eng.complete([5, 6, 7], greedy(12, stop=stops)), HANG_GUARD_S)
        assert out.outputs[0].stop_reason == text[2:4] and out.outputs[0].text == text[:text.find(text[2:4])]
        assert built_on == [False]
        await assert_clean(eng)
