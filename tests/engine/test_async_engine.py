"""AsyncLLMEngine acceptance: streams, parity with the offline LLM, cancellation, admission control,
faults, per-request errors and lifecycle (loops, shutdown, output kinds).

Every scenario is a plain coroutine ``scenario_*(model_dir, ...)`` so the same code also runs on
uvloop and under anyio (tests/engine/test_async_uvloop.py). fp32, greedy, EOS ignored, tiny random model.
No test asserts on wall-clock time: waits are bounded loops of short sleeps, and
``asyncio.wait_for`` appears only as a hang guard with a generous limit.
"""
from __future__ import annotations

import asyncio
import gc
import random
import threading

import pytest

from asyncengine import (AsyncLLMEngine, EngineConfig, EngineDeadError, EngineOverloaded, InvalidRequestError,
                         OutputKind, SamplingParams)
from asyncengine.engine.llm import render_chat
from asyncengine.engine.output_processor import IncrementalDetokenizer
from model_utils import compare, model_hook, random_requests

VOCAB = 512  # the tiny checkpoints of conftest.py
HANG_GUARD_S = 120.0  # only ever a guard against a hang, never the thing a test checks
NUM_BLOCKS = 512


def make_engine(model_dir: str, **kw) -> AsyncLLMEngine:
    kw.setdefault("num_kv_blocks", NUM_BLOCKS)
    return AsyncLLMEngine(EngineConfig(model=model_dir, dtype="float32", **kw))


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


async def guard(aw, timeout: float = HANG_GUARD_S):
    return await asyncio.wait_for(aw, timeout)


async def settle(eng: AsyncLLMEngine, iterations: int = 2000) -> None:
    """Wait (a bounded number of short sleeps) until nothing is running, waiting or pending."""
    for _ in range(iterations):
        s = eng.stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0 and not eng._busy_loop.new and not eng._busy_loop.aborts \
                and not eng._slots:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the engine never went idle: {eng.stats()}, slots {list(eng._slots)}")


async def assert_clean(eng: AsyncLLMEngine) -> None:
    """No blocks held and no per-request state left anywhere, once the runner has seen one more step."""
    await settle(eng)
    assert eng.core.kv.num_free_blocks == eng.core.num_blocks
    assert eng._slots == {}
    assert eng.output_processor.states == {}
    assert eng.core.scheduler.requests == {}
    # the runner forgets finished requests when the next step tells it: run one
    probe = await guard(eng.complete([5, 6, 7], greedy(1), request_id="probe-after-settle"))
    assert probe.finished
    await settle(eng)
    held = eng.core.collective_rpc("runner_stats")[0]["request_ids"]
    assert set(held) <= {"probe-after-settle"}, held[:10]
    assert eng.core.kv.num_free_blocks == eng.core.num_blocks
    assert eng.output_processor.states == {} and eng._slots == {}


async def collect(stream) -> tuple[list[int], str, object]:
    """Consume a stream; returns (concatenated token deltas, concatenated text deltas, last output)."""
    toks: list[int] = []
    text = ""
    last = None
    async for out in stream:
        toks += out.token_ids_delta
        text += out.text_delta
        last = out
    return toks, text, last


# ---------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir) -> str:
    return tiny_llama_dir


PARITY_REQS = random_requests(64, VOCAB, seed=11, plen=(3, 60), olen=(1, 24))


_OFFLINE: dict[str, list[list[int]]] = {}  # shared with test_async_uvloop.py


@pytest.fixture(scope="module")
def offline(model_dir) -> list[list[int]]:
    """What the offline LLM.generate produces for PARITY_REQS."""
    if model_dir not in _OFFLINE:
        from asyncengine import LLM
        llm = LLM(model_dir, dtype="float32", num_kv_blocks=NUM_BLOCKS)
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in PARITY_REQS],
                            [greedy(m) for _, m in PARITY_REQS], use_tqdm=False)
        _OFFLINE[model_dir] = [list(o.outputs[0].token_ids) for o in outs]
    return _OFFLINE[model_dir]


# ---------------------------------------------------------------------------------------- scenarios

async def scenario_parity(model_dir: str, offline: list[list[int]], hf_reference, async_scheduling: bool = True
                          ) -> dict:
    """64 concurrent streams == offline LLM.generate, token-exact up to reference near-ties."""
    eng = make_engine(model_dir, async_scheduling=async_scheduling)
    async with eng:
        streams = [eng.generate({"prompt_token_ids": p}, greedy(m), request_id=f"p{i}")
                   for i, (p, m) in enumerate(PARITY_REQS)]
        results = await guard(asyncio.gather(*(collect(s) for s in streams)))
        got = [toks for toks, _, _ in results]
        for (toks, _, last), (_, m) in zip(results, PARITY_REQS):
            assert last.finished and last.finish_reason == "length" and len(toks) == m
            assert list(last.outputs[0].token_ids) == toks  # CUMULATIVE: the last output has it all
        await assert_clean(eng)
    differ = [i for i in range(len(got)) if got[i] != offline[i]]
    report = {"total": len(got), "differ_from_offline": len(differ), "near_tie": 0}
    if differ:
        refs = hf_reference(model_dir, [PARITY_REQS[i] for i in differ])
        c_async = compare([got[i] for i in differ], refs)  # raises on a real mismatch
        c_off = compare([offline[i] for i in differ], refs)
        report["near_tie"] = c_async["near_tie"] + c_off["near_tie"]
    return report


async def scenario_interleave(model_dir: str) -> None:
    """Tokens of different requests arrive before any request finishes."""
    eng = make_engine(model_dir)
    events: list[tuple[int, int, bool]] = []  # (request, tokens in this output, finished)
    async with eng:
        streams = [eng.generate(list(range(10 + i, 20 + i)), greedy(12)) for i in range(8)]

        async def consume(i, s):
            async for out in s:
                events.append((i, len(out.token_ids_delta), out.finished))

        await guard(asyncio.gather(*(consume(i, s) for i, s in enumerate(streams))))
        await assert_clean(eng)
    first_finish = next(k for k, (_, _, fin) in enumerate(events) if fin)
    before = {i for i, n, _ in events[:first_finish] if n > 0}
    assert before == set(range(8)), f"only requests {sorted(before)} streamed before the first finished"
    # and each request streamed more than once: tokens really came one step at a time
    assert all(sum(1 for i, _, _ in events if i == r) > 1 for r in range(8))


async def scenario_cancellations(model_dir: str, seed: int = 0, n: int = 48) -> dict:
    """Many concurrent early exits of every kind leave no blocks and no per-request state."""
    rng = random.Random(seed)
    methods = ["break", "aclose", "abort", "task_cancel", "cancel_in_body", "drop", "never_iterated", "complete"]
    plan = [methods[i % len(methods)] for i in range(n)]
    rng.shuffle(plan)
    max_tokens = 40
    eng = make_engine(model_dir)
    async with eng:
        ready = [asyncio.Event() for _ in range(n)]
        finals: dict[int, object] = {}

        async def run(i: int, how: str):
            prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 40))]
            k = rng.randint(1, 4)  # outputs to read before leaving
            if how == "never_iterated":
                eng.generate(prompt, greedy(max_tokens))  # the stream is dropped at once
                ready[i].set()
                return
            stream = eng.generate(prompt, greedy(max_tokens))
            if how == "drop":
                for _ in range(k):
                    await stream.__anext__()
                del stream  # the last reference: __del__ aborts
                ready[i].set()
                return
            seen = 0
            async for out in stream:
                seen += 1
                if how == "complete":
                    finals[i] = out
                    continue
                if seen < k:
                    continue
                if how == "break":
                    break
                if how == "aclose":
                    await stream.aclose()
                    rest = [o async for o in stream]
                    assert rest == []
                    break
                if how == "abort":
                    await eng.abort(stream.request_id)
                    last = out
                    async for last in stream:  # whatever was pending, then the abort
                        pass
                    assert last.finished
                    # the abort may race a natural finish of a short request
                    assert last.finish_reason in ("abort", "length")
                    finals[i] = last
                    break
                if how == "task_cancel":
                    ready[i].set()
                    continue  # keep reading until cancelled (inside __anext__ most of the time)
                if how == "cancel_in_body":
                    ready[i].set()
                    await asyncio.Event().wait()  # cancelled here, outside the stream
            ready[i].set()

        tasks = [asyncio.create_task(run(i, how)) for i, how in enumerate(plan)]
        to_cancel = [i for i, how in enumerate(plan) if how in ("task_cancel", "cancel_in_body")]
        await guard(asyncio.gather(*(ready[i].wait() for i in to_cancel)))
        for i in to_cancel:
            tasks[i].cancel()
        results = await guard(asyncio.gather(*tasks, return_exceptions=True))
        for i, (how, r) in enumerate(zip(plan, results)):
            if i in to_cancel:
                assert isinstance(r, asyncio.CancelledError), (how, r)
            elif isinstance(r, BaseException):
                raise r
        del results, tasks  # a cancelled task's traceback holds its frame (and the stream in it)
        gc.collect()
        for i, how in enumerate(plan):
            if how == "complete":
                assert finals[i].finish_reason == "length" and len(finals[i].outputs[0].token_ids) == max_tokens
        await assert_clean(eng)
        return {"requests": n, "by_method": {m: plan.count(m) for m in methods}}


async def scenario_overload(model_dir: str) -> None:
    """Beyond max_queued_requests / max_queued_tokens, generate() raises EngineOverloaded at once."""
    eng = make_engine(model_dir, max_queued_requests=4)
    async with eng:
        streams = [eng.generate([5 + i, 6, 7], greedy(4)) for i in range(4)]
        with pytest.raises(EngineOverloaded, match="max_queued_requests"):
            eng.generate([9, 9, 9], greedy(4))
        assert len(eng._slots) == 4  # the refused request left nothing behind
        outs = await guard(asyncio.gather(*(collect(s) for s in streams)))
        assert all(last.finish_reason == "length" for _, _, last in outs)
        await settle(eng)
        # room again once the queue drained
        await guard(collect(eng.generate([9, 9, 9], greedy(2))))
        await assert_clean(eng)

    eng = make_engine(model_dir, max_queued_tokens=100)
    async with eng:
        a = eng.generate(list(range(3, 43)), greedy(3))  # 40
        b = eng.generate(list(range(50, 90)), greedy(3))  # 80
        with pytest.raises(EngineOverloaded, match="max_queued_tokens"):
            eng.generate(list(range(100, 140)), greedy(3))  # 120 > 100
        c = eng.generate(list(range(100, 120)), greedy(3))  # exactly 100
        with pytest.raises(EngineOverloaded):
            eng.generate([7], greedy(3))
        await guard(asyncio.gather(*(collect(s) for s in (a, b, c))))
        await assert_clean(eng)

    # tokens of requests already handed to the scheduler but still waiting there count too
    eng = make_engine(model_dir, max_queued_tokens=100, max_num_seqs=1)
    async with eng:
        first = eng.generate(list(range(3, 13)), greedy(200))
        await guard(first.__anext__())  # running: its prompt no longer counts as queued
        waiting = []
        for j in range(2):
            waiting.append(eng.generate(list(range(20 + 40 * j, 60 + 40 * j)), greedy(2)))
            for _ in range(2000):  # let the busy loop hand it to the scheduler
                if not eng._busy_loop.new:
                    break
                await asyncio.sleep(0.005)
        assert eng.core.scheduler.num_waiting >= 1
        with pytest.raises(EngineOverloaded, match="max_queued_tokens"):
            eng.generate(list(range(200, 240)), greedy(2))  # 80 waiting + 40 > 100
        await first.aclose()
        await guard(asyncio.gather(*(collect(s) for s in waiting)))
        await assert_clean(eng)


async def scenario_model_fault(model_dir: str, fail_after: int = 3) -> None:
    """The model raising mid-run: every pending stream gets EngineDeadError carrying the cause,
    later calls fail at once, nobody hangs."""
    eng = make_engine(model_dir)

    def faulty(k):
        if k >= fail_after:
            raise RuntimeError("simulated kernel fault")

    with model_hook(eng, faulty):
        await _model_fault_streams(eng)


async def _model_fault_streams(eng: AsyncLLMEngine) -> None:
    async with eng:
        streams = [eng.generate([3 + i, 4, 5, 6], greedy(50)) for i in range(12)]

        async def consume(s):
            n = 0
            with pytest.raises(EngineDeadError) as ei:
                async for _ in s:
                    n += 1
            return ei.value, n

        got = await guard(asyncio.gather(*(consume(s) for s in streams)))
        for err, _ in got:
            assert isinstance(err.__cause__, RuntimeError) and "simulated kernel fault" in str(err.__cause__)
            assert "simulated kernel fault" in str(err)
        assert any(n > 0 for _, n in got)  # it really died mid-stream
        assert eng.errored and not eng.is_running
        with pytest.raises(EngineDeadError) as ei:
            eng.generate([3, 4], greedy(2))
        assert isinstance(ei.value.__cause__, RuntimeError)
        with pytest.raises(EngineDeadError):
            await guard(eng.complete([3, 4], greedy(2)))
        assert eng._slots == {}
    # __aexit__ (shutdown) on a dead engine returns quietly


async def scenario_bad_requests(model_dir: str) -> None:
    """A bad request fails alone with InvalidRequestError; concurrent good ones complete."""
    eng = make_engine(model_dir, max_model_len=256)
    async with eng:
        good = [eng.generate([10 + i, 11, 12, 13], greedy(16)) for i in range(4)]
        tasks = [asyncio.create_task(collect(s)) for s in good]
        await asyncio.sleep(0)
        bad_prompts = [
            [3, 4, VOCAB + 5],  # token id outside the vocabulary
            [-1, 4],
            [],  # empty token list
            "",  # empty text
            {"nothing": 1},
            list(range(3, 300)),  # longer than max_model_len
            [3, "x"],
        ]
        for p in bad_prompts:
            with pytest.raises(InvalidRequestError):
                eng.generate(p, greedy(4))
        with pytest.raises(InvalidRequestError):
            eng.generate([3, 4], greedy(4, stop_token_ids=[VOCAB + 1]))
        with pytest.raises(InvalidRequestError):
            eng.generate([3, 4], {"max_tokens": 4})  # not SamplingParams
        # a request id that is in use is refused, the running one is untouched
        with pytest.raises(InvalidRequestError, match="in use"):
            eng.generate([3, 4], greedy(4), request_id=good[0].request_id)
        # a very long text prompt is tokenized off the loop: its error surfaces at iteration
        long_stream = eng.generate("The quick brown fox jumps over the lazy dog. " * 120, greedy(4))
        with pytest.raises(InvalidRequestError, match="max_model_len"):
            await guard(collect(long_stream))
        outs = await guard(asyncio.gather(*tasks))
        for toks, _, last in outs:
            assert last.finish_reason == "length" and len(toks) == 16
        assert not eng.errored
        await assert_clean(eng)


async def scenario_shutdown(model_dir: str, drain: bool) -> None:
    eng = make_engine(model_dir, max_num_seqs=4)
    streams = [eng.generate([3 + i, 4, 5], greedy(30)) for i in range(10)]  # some wait in the queue
    tasks = [asyncio.create_task(collect(s)) for s in streams]
    await asyncio.sleep(0)
    # wait (bounded) until something is running, so shutdown hits a busy engine
    for _ in range(1000):
        if eng.stats()["num_running"]:
            break
        await asyncio.sleep(0.005)
    await guard(eng.shutdown(drain=drain))
    outs = await guard(asyncio.gather(*tasks))
    reasons = {last.finish_reason for _, _, last in outs}
    if drain:
        assert reasons == {"length"} and all(len(t) == 30 for t, _, _ in outs)
    else:
        assert "abort" in reasons and reasons <= {"abort", "length"}
    assert not eng.is_running
    with pytest.raises(EngineDeadError):
        eng.generate([3, 4], greedy(2))
    assert eng._slots == {} and eng.output_processor.states == {}
    assert eng.core.kv.num_free_blocks == eng.core.num_blocks


async def scenario_output_kinds(model_dir: str) -> None:
    eng = make_engine(model_dir)
    prompt, n = [20, 21, 22, 23, 24], 12
    async with eng:
        ref = await guard(eng.complete(prompt, greedy(n)))  # FINAL_ONLY by construction
        full = list(ref.outputs[0].token_ids)
        assert ref.finished and len(full) == n and ref.finish_reason == "length"

        outs = [o async for o in eng.generate(prompt, greedy(n, output_kind=OutputKind.DELTA))]
        assert len(outs) > 1 and outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert sum((list(o.outputs[0].token_ids) for o in outs), []) == full
        assert all(list(o.outputs[0].token_ids) == o.token_ids_delta for o in outs)
        assert "".join(o.outputs[0].text for o in outs) == ref.outputs[0].text

        outs = [o async for o in eng.generate(prompt, greedy(n, output_kind=OutputKind.CUMULATIVE))]
        assert len(outs) > 1
        for a, b in zip(outs, outs[1:]):  # each output extends the previous one
            assert b.outputs[0].token_ids[:len(a.outputs[0].token_ids)] == a.outputs[0].token_ids
        assert list(outs[-1].outputs[0].token_ids) == full and outs[-1].outputs[0].text == ref.outputs[0].text

        outs = [o async for o in eng.generate(prompt, greedy(n, output_kind=OutputKind.FINAL_ONLY))]
        assert len(outs) == 1 and outs[0].finished and list(outs[0].outputs[0].token_ids) == full
        await assert_clean(eng)


async def scenario_slow_consumer(model_dir: str) -> None:
    """A consumer that falls behind gets merged deltas whose concatenation is the full output."""
    eng = make_engine(model_dir)
    prompt, n = [30, 31, 32, 33], 20
    async with eng:
        ref = await guard(eng.complete(prompt, greedy(n)))
        for kind in (OutputKind.DELTA, OutputKind.CUMULATIVE):
            stream = eng.generate(prompt, greedy(n, output_kind=kind))
            first = await guard(stream.__anext__())
            # fall behind: wait (bounded) until the engine has routed the whole request
            for _ in range(2000):
                if stream.request_id not in eng._slots:
                    break
                await asyncio.sleep(0.005)
            rest = [o async for o in stream]
            assert len(rest) == 1, "everything produced while we slept comes merged in one output"
            toks = first.token_ids_delta + rest[0].token_ids_delta
            assert toks == list(ref.outputs[0].token_ids)
            assert first.text_delta + rest[0].text_delta == ref.outputs[0].text
            assert rest[0].finished and rest[0].finish_reason == "length"
            if kind == OutputKind.DELTA:
                assert list(first.outputs[0].token_ids) + list(rest[0].outputs[0].token_ids) == toks
            else:
                assert list(rest[0].outputs[0].token_ids) == toks

        # many slow consumers at once: sleeping between reads never loses or duplicates a token
        refs = [await eng.complete([40 + i, 41, 42], greedy(n)) for i in range(6)]

        async def sleepy(i):
            toks, text = [], ""
            async for out in eng.generate([40 + i, 41, 42], greedy(n, output_kind=OutputKind.DELTA)):
                toks += out.token_ids_delta
                text += out.text_delta
                await asyncio.sleep(0.003 * (i + 1))
            return toks, text

        got = await guard(asyncio.gather(*(sleepy(i) for i in range(6))))
        for (toks, text), r in zip(got, refs):
            assert toks == list(r.outputs[0].token_ids) and text == r.outputs[0].text
        await assert_clean(eng)


async def scenario_chat(model_dir: str) -> None:
    eng = make_engine(model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Paris?"}]
    async with eng:
        ids = render_chat(eng.tokenizer, messages)
        out = await guard(eng.complete(messages, greedy(10)))
        assert list(out.prompt_token_ids) == ids
        same = await guard(eng.complete({"prompt_token_ids": ids}, greedy(10)))
        assert list(out.outputs[0].token_ids) == list(same.outputs[0].token_ids)
        assert len(out.outputs[0].token_ids) == 10
        if IncrementalDetokenizer is not None:
            assert out.outputs[0].text == eng.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
        # streamed chat, text prompts too
        toks, text, last = await guard(collect(eng.generate(messages, greedy(10))))
        assert toks == list(out.outputs[0].token_ids) and text == last.outputs[0].text
        toks, _, last = await guard(collect(eng.generate("Paris is the capital of", greedy(5))))
        assert len(toks) == 5 and last.prompt == "Paris is the capital of"
        await assert_clean(eng)


# ---------------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlap", "no-overlap"])
async def test_64_streams_match_offline(model_dir, offline, hf_reference, async_scheduling, record_property):
    report = await scenario_parity(model_dir, offline, hf_reference, async_scheduling)
    record_property("parity", report)
    print(f"\nparity ({'overlap' if async_scheduling else 'no overlap'}): {report}")


async def test_streams_interleave(model_dir):
    await scenario_interleave(model_dir)


@pytest.mark.parametrize("seed", [0, 1])
async def test_cancellations_leave_nothing_behind(model_dir, seed):
    await scenario_cancellations(model_dir, seed)


async def test_overload_is_refused_immediately(model_dir):
    await scenario_overload(model_dir)


async def test_model_fault_kills_every_stream(model_dir):
    await scenario_model_fault(model_dir)


async def test_model_fault_in_forward_on_first_step(model_dir):
    """A fault in the model's forward itself, on the very first step."""
    eng = make_engine(model_dir)

    def boom(k):
        raise ValueError("forward exploded")

    with model_hook(eng, boom):
        await _first_step_fault(eng)


async def _first_step_fault(eng: AsyncLLMEngine) -> None:
    async with eng:
        with pytest.raises(EngineDeadError) as ei:
            await guard(eng.complete([3, 4, 5], greedy(4)))
        assert isinstance(ei.value.__cause__, ValueError)
        with pytest.raises(EngineDeadError):
            await eng.start()


async def test_bad_request_fails_alone(model_dir):
    await scenario_bad_requests(model_dir)


@pytest.mark.parametrize("drain", [True, False], ids=["drain", "abort"])
async def test_shutdown(model_dir, drain):
    await scenario_shutdown(model_dir, drain)


async def test_output_kinds(model_dir):
    await scenario_output_kinds(model_dir)


async def test_slow_consumer_gets_merged_deltas(model_dir):
    await scenario_slow_consumer(model_dir)


async def test_chat_messages(model_dir):
    await scenario_chat(model_dir)


async def test_complete_matches_offline(model_dir, offline):
    eng = make_engine(model_dir)
    async with eng:
        for i in (0, 7, 21):
            p, m = PARITY_REQS[i]
            out = await guard(eng.complete({"prompt_token_ids": p}, greedy(m)))
            assert out.finished and list(out.outputs[0].token_ids) == offline[i]
        await assert_clean(eng)


# ----------------------------------------------------------------- lifecycle across loops (sync tests)

async def _one_request(eng: AsyncLLMEngine, prompt=(3, 4, 5), n: int = 6) -> list[int]:
    toks, _, last = await guard(collect(eng.generate(list(prompt), greedy(n))))
    assert last.finish_reason == "length"
    return toks


def test_created_outside_loop_then_asyncio_run(model_dir):
    eng = make_engine(model_dir)  # no loop running here
    assert not eng.is_running
    toks = asyncio.run(_one_request(eng))
    assert len(toks) == 6


def test_two_successive_asyncio_runs(model_dir):
    """asyncio.run cancels every task it leaves behind, the busy loop included: the engine rebinds
    to the next loop instead of dying."""
    eng = make_engine(model_dir)
    first = asyncio.run(_one_request(eng))
    second = asyncio.run(_one_request(eng))
    assert first == second
    assert not eng.errored

    async def both():
        r = await _one_request(eng)
        await assert_clean(eng)
        await eng.shutdown()
        return r

    assert asyncio.run(both()) == first


def test_second_asyncio_run_after_requests_left_running(model_dir):
    """The first loop ends with streams still open: they are abandoned, the core is cleaned up, and
    the next loop gets a working engine."""
    eng = make_engine(model_dir)

    async def leave_running():
        streams = [eng.generate([3 + i, 4, 5], greedy(200)) for i in range(4)]
        for s in streams:
            await guard(s.__anext__())
        return streams  # still open when asyncio.run cancels the busy loop

    kept = asyncio.run(leave_running())

    async def again():
        r = await _one_request(eng)
        await assert_clean(eng)
        return r

    assert len(asyncio.run(again())) == 6
    del kept


def test_use_from_second_loop_is_refused(model_dir):
    eng = make_engine(model_dir)
    started = threading.Event()
    stop: dict = {}

    def other_thread():
        async def main():
            stop["loop"] = asyncio.get_running_loop()
            stop["event"] = asyncio.Event()
            await eng.start()
            await _one_request(eng)
            started.set()
            await stop["event"].wait()
            await _one_request(eng)  # still fine on its own loop
            await eng.shutdown()

        asyncio.run(main())

    th = threading.Thread(target=other_thread)
    th.start()
    try:
        assert started.wait(HANG_GUARD_S)

        async def intruder():
            with pytest.raises(RuntimeError, match="another event loop"):
                eng.generate([3, 4], greedy(2))
            with pytest.raises(RuntimeError, match="another event loop"):
                await eng.start()

        asyncio.run(intruder())
    finally:
        stop["loop"].call_soon_threadsafe(stop["event"].set)
        th.join(HANG_GUARD_S)
    assert not th.is_alive()
    assert not eng.errored


def test_loop_closed_without_cancelling_then_reused(model_dir):
    """A loop closed with the busy loop still pending (run_until_complete + close, no asyncio.run):
    the next loop abandons that loop's requests and gets a clean engine."""
    eng = make_engine(model_dir)
    loop = asyncio.new_event_loop()

    async def leave_running():
        s = eng.generate([3, 4, 5], greedy(200))
        await guard(s.__anext__())
        return s

    kept = loop.run_until_complete(leave_running())
    loop.close()  # the busy loop task is never cancelled

    async def again():
        r = await _one_request(eng)
        del loop_ref[:]
        gc.collect()  # the old loop's busy-loop coroutine is destroyed now, mid-use of the new one
        assert not eng.errored and eng.is_running
        assert await _one_request(eng) == r
        await assert_clean(eng)
        await eng.shutdown()
        return r

    loop_ref = [loop]
    del loop
    assert len(asyncio.run(again())) == 6
    del kept
