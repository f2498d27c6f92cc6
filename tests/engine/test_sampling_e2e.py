"""Sampling and outputs, end to end through the engine (LLM and AsyncLLMEngine), on the tiny
random-weight llama of conftest.py (fp32, byte-level BPE tokenizer, EOS id 1).

Pins: logprobs / prompt logprobs equal transformers' log_softmax (also under chunked prefill and
after a preemption); seeded requests give the same tokens in any batch and order; ``n > 1``
(distinct / identical samples, seed + i, ONE prefill with the prompt blocks shared by refcount,
aggregated outputs for every output_kind, abort of the parent); stop strings, stop token ids,
min_tokens, ignore_eos, include_stop_str_in_output, skip_special_tokens; streamed text deltas;
SamplingParams validation.
"""
from __future__ import annotations

import asyncio
import random

import pytest
import torch
import transformers

from asyncengine import LLM, AsyncLLMEngine, EngineConfig, InvalidRequestError, OutputKind, SamplingParams
from asyncengine.contracts.sched_output import EngineCoreOutput
from asyncengine.engine.output_processor import OutputProcessor
from model_utils import check_entry, ref_logprobs

VOCAB = 512
EOS = 1
HANG_GUARD_S = 120.0


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir) -> str:
    return tiny_llama_dir


@pytest.fixture(scope="module")
def hf_model(model_dir):
    m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    m.eval()
    return m


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, dtype="float32", num_kv_blocks=256)


@pytest.fixture(scope="module")
def llm_chunked(model_dir) -> LLM:
    """Small step budget: prompts are prefilled in chunks of up to 7 tokens."""
    return LLM(model_dir, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=7)


def prompt_of(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def gen(llm: LLM, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


# ---------------------------------------------------------------------------- logprobs

@pytest.mark.parametrize("which", ["llm", "llm_chunked"])
def test_sample_logprobs_match_transformers(request, hf_model, which):
    llm = request.getfixturevalue(which)
    prompts = [prompt_of(1, 21), prompt_of(2, 9), prompt_of(3, 30)]
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=5, logprobs=5, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=0.0, logprobs=0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, logprobs=2, ignore_eos=True,
                             repetition_penalty=1.3)]  # raw logprobs: before temperature / penalties
    outs = gen(llm, prompts, params)
    for prompt, sp, out in zip(prompts, params, outs):
        c = out.outputs[0]
        assert len(c.logprobs) == len(c.token_ids) == sp.max_tokens
        ref = ref_logprobs(hf_model, prompt + c.token_ids)  # teacher-forced on the engine's tokens
        P = len(prompt)
        for i, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            check_entry(entry, tok, ref[P - 1 + i], sp.logprobs)
        assert abs(c.cumulative_logprob - sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs))) < 1e-4
        assert out.prompt_logprobs is None


@pytest.mark.parametrize("which", ["llm", "llm_chunked"])
def test_prompt_logprobs_match_transformers(request, hf_model, which):
    llm = request.getfixturevalue(which)
    prompts = [prompt_of(10, 37), prompt_of(11, 5), prompt_of(12, 1), prompt_of(13, 16)]
    params = [SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=3, ignore_eos=True),
              SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0, logprobs=1, ignore_eos=True),
              SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)]  # none asked
    outs = gen(llm, prompts, params)
    for prompt, sp, out in zip(prompts, params, outs):
        if sp.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        plp = out.prompt_logprobs
        assert len(plp) == len(prompt) and plp[0] is None
        ref = ref_logprobs(hf_model, prompt)
        for j in range(1, len(prompt)):
            check_entry(plp[j], prompt[j], ref[j - 1], sp.prompt_logprobs)
        if sp.logprobs is not None:  # sample logprobs of the same request still right
            full = ref_logprobs(hf_model, prompt + out.outputs[0].token_ids)
            for i, (t, e) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
                check_entry(e, t, full[len(prompt) - 1 + i], sp.logprobs)
    if which == "llm_chunked":  # the 37-token prompt really went in several chunks
        assert llm.engine.config.max_num_batched_tokens < 37


def test_prompt_logprobs_survive_preemption(model_dir, hf_model):
    """A request with prompt logprobs that is preempted and recomputed delivers each position once."""
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=8, block_size=16)
    prompts = [prompt_of(20, 40), prompt_of(21, 40)]
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, prompt_logprobs=2)]
    victims = []
    preempt = llm.engine.scheduler._preempt

    def spy(req):
        victims.append(req.sampling_params.prompt_logprobs)
        preempt(req)

    llm.engine.scheduler._preempt = spy
    outs = gen(llm, prompts, params)
    assert 2 in victims  # the prompt-logprobs request itself was preempted and recomputed
    plp = outs[1].prompt_logprobs
    assert len(plp) == 40 and plp[0] is None
    ref = ref_logprobs(hf_model, prompts[1])
    for j in range(1, 40):
        check_entry(plp[j], prompts[1][j], ref[j - 1], 2)


# ---------------------------------------------------------------------------- seeds

def test_seeded_request_same_in_any_batch(llm, llm_chunked):
    target = prompt_of(30, 19)
    sp = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = gen(llm, [target], [sp])[0].outputs[0].token_ids
    others = [prompt_of(31 + i, 5 + 7 * i) for i in range(5)]
    other_params = [SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True),  # unseeded
                    SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                    SamplingParams(max_tokens=20, temperature=0.7, top_k=20, seed=9, ignore_eos=True),
                    SamplingParams(max_tokens=9, temperature=1.3, min_p=0.05, ignore_eos=True),
                    SamplingParams(max_tokens=14, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)]
    for eng, order in ((llm, [0, 1, 2, 3, 4]), (llm, [4, 2, 0]), (llm_chunked, [3, 1, 4, 0, 2])):
        ps = [others[i] for i in order]
        qs = [other_params[i] for i in order]
        mid = len(ps) // 2
        outs = gen(eng, ps[:mid] + [target] + ps[mid:], qs[:mid] + [sp] + qs[mid:])
        assert outs[mid].outputs[0].token_ids == alone
    again = gen(llm, [target], [sp])[0].outputs[0].token_ids
    assert again == alone
    other_seed = gen(llm, [target], [SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1235,
                                                    ignore_eos=True)])[0].outputs[0].token_ids
    assert other_seed != alone


# ---------------------------------------------------------------------------- n > 1

def test_n_distinct_with_temperature_identical_greedy(llm):
    prompt = prompt_of(40, 12)
    out = gen(llm, [prompt], [SamplingParams(n=4, max_tokens=10, temperature=1.0, ignore_eos=True)])[0]
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2, 3]
    seqs = [tuple(c.token_ids) for c in out.outputs]
    assert all(len(s) == 10 for s in seqs) and len(set(seqs)) == 4
    assert all(c.finish_reason == "length" for c in out.outputs)
    g = gen(llm, [prompt], [SamplingParams(n=3, max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)])[0]
    one = gen(llm, [prompt], [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)])[0]
    assert [c.token_ids for c in g.outputs] == [one.outputs[0].token_ids] * 3
    assert len({round(c.cumulative_logprob, 4) for c in g.outputs}) == 1
    assert all(c.text == one.outputs[0].text for c in g.outputs)
    assert llm.engine.scheduler.samples.parents == {} and llm.engine.kv.num_free_blocks == llm.engine.num_blocks


def test_n_with_seed_is_seed_plus_i(llm):
    prompt = prompt_of(41, 20)
    sp = SamplingParams(n=3, max_tokens=12, temperature=1.0, top_p=0.9, seed=77, ignore_eos=True)
    out = gen(llm, [prompt], [sp])[0]
    singles = gen(llm, [prompt] * 3, [SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=77 + i,
                                                     ignore_eos=True) for i in range(3)])
    assert [c.token_ids for c in out.outputs] == [s.outputs[0].token_ids for s in singles]
    assert [c.text for c in out.outputs] == [s.outputs[0].text for s in singles]
    assert gen(llm, [prompt], [sp])[0].outputs[0].token_ids == out.outputs[0].token_ids  # reproducible


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["shared", "no-prefix-cache"])
def test_n_shares_prompt_blocks(model_dir, prefix_caching):
    bs, n, P, max_tokens = 16, 4, 4 * 16 + 6, 8  # 4 full prompt blocks + 6 tokens
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=64, block_size=bs, enable_prefix_caching=prefix_caching)
    eng = llm.engine
    prompt = prompt_of(42, P)
    sp = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
    req, _ = llm.processor.make_request("par", {"prompt_token_ids": prompt}, sp)
    llm.output_processor.add_request("par", None, prompt, sp)
    eng.add_request(req)
    snapshot, peak, outs = None, 0, []
    while eng.has_unfinished():
        outs += llm.output_processor.process(eng.step()).outputs
        peak = max(peak, eng.num_blocks - eng.kv.num_free_blocks)
        blocks = eng.kv.req_to_blocks
        if snapshot is None and len(blocks) == n:
            snapshot = {rid: list(bl) for rid, bl in blocks.items()}
            refs = {rid: [b.ref_cnt for b in bl] for rid, bl in blocks.items()}
    assert sorted(snapshot) == [f"par#{i}" for i in range(n)]
    sched = eng.stats()["num_scheduled_tokens"]
    decode_tokens = n * (max_tokens - 1)
    if prefix_caching:
        first = snapshot["par#0"][:4]
        for rid, bl in snapshot.items():
            assert bl[:4] == first  # the very same block objects
            assert len(bl) == 5 and bl[4] not in first
        assert all(r == [n] * 4 + [1] for r in refs.values())
        assert len({id(b) for bl in snapshot.values() for b in bl}) == 4 + n
        assert peak == 4 + n  # vs n * 5 = 20 for separate prefills
        # one prefill, plus each other sample's partial last block
        assert sched == P + (n - 1) * (P % bs) + decode_tokens
    else:
        assert all(r == [1] * 5 for r in refs.values())
        assert peak == n * 5
        assert sched == n * P + decode_tokens  # documented: n prefills without prefix caching
    final = outs[-1]
    assert final.finished and len(final.outputs) == n and sum(o.finished for o in outs) == 1
    assert len({tuple(c.token_ids) for c in final.outputs}) == n
    assert eng.kv.num_free_blocks == eng.num_blocks and eng.scheduler.samples.parents == {}


def test_n_held_samples_abort_and_release(model_dir):
    """Samples 1..n-1 wait (held) while sample 0's prompt is prefilled in chunks; aborting the
    parent takes them all; if sample 0 goes away first, the others are released and run."""
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=64, block_size=16, max_num_batched_tokens=16)
    eng, sched = llm.engine, llm.engine.scheduler
    prompt = prompt_of(43, 50)
    sp = SamplingParams(n=3, max_tokens=4, temperature=1.0, ignore_eos=True)
    for abort_id in ("p", "p#0"):
        req, _ = llm.processor.make_request("p", {"prompt_token_ids": prompt}, sp)
        llm.output_processor.add_request("p", None, prompt, sp)
        eng.add_request(req)
        llm.output_processor.process(eng.step())  # sample 0's first 16-token chunk
        assert [c.request_id for c in sched.samples.held] == ["p#1", "p#2"] and sched.num_waiting == 2
        assert list(eng.kv.req_to_blocks) == ["p#0"]
        eng.abort_requests([abort_id])
        if abort_id == "p":
            llm.output_processor.abort("p")
            assert sched.requests == {} and sched.samples.parents == {} and sched.samples.held == []
            eng.step()
            assert eng.kv.num_free_blocks == eng.num_blocks
            continue
        # sample 0 aborted alone (as a stop string would): the others are released and finish
        assert sched.samples.parents == {"p": {"p#1", "p#2"}}
        llm.output_processor.process([EngineCoreOutput(req_id="p#0", new_token_ids=[], finish_reason="abort")])
        outs = []
        while eng.has_unfinished():
            outs += llm.output_processor.process(eng.step()).outputs
        final = outs[-1]
        assert final.finished and [c.finish_reason for c in final.outputs] == ["abort", "length", "length"]
        assert [len(c.token_ids) for c in final.outputs] == [0, 4, 4]
        assert sched.samples.parents == {} and eng.kv.num_free_blocks == eng.num_blocks


# ---------------------------------------------------------------------------- stops

def _text_ids(model_dir) -> list[int]:
    """Tokens of the tiny tokenizer (352 of the model's 512 ids) that decode to whole characters:
    any sequence of them is clean text, so the reference texts below are exact."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    return [t for t in range(3, len(tok)) if "\ufffd" not in tok.decode([t]) and tok.decode([t])]


TEXT_IDS: list[int] = []


@pytest.fixture(scope="module", autouse=True)
def _fill_text_ids(model_dir):
    TEXT_IDS[:] = _text_ids(model_dir)


def text_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice(TEXT_IDS) for _ in range(length)]


def greedy_ref(llm, prompt, max_tokens=24):
    return gen(llm, [prompt], [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                              allowed_token_ids=TEXT_IDS)])[0].outputs[0]


def stop_across_boundary(tok, ids: list[int]) -> tuple[str, int, int]:
    """A stop string whose first occurrence in decode(ids) straddles a token boundary: returns
    (stop, its offset in the text, number of tokens needed to complete it)."""
    text = tok.decode(ids)
    for k in range(2, len(ids) - 1):
        head = tok.decode(ids[:k])
        b = len(head)
        if not text.startswith(head) or b < 2 or len(text) < b + 2:
            continue
        stop = text[b - 2:b + 2]
        if "\ufffd" in stop or text.find(stop) != b - 2 or stop.strip() != stop:
            continue
        need = next(j for j in range(k + 1, len(ids) + 1) if stop in tok.decode(ids[:j]))
        return stop, b - 2, need
    raise AssertionError("no usable token boundary in the reference text")


def test_stop_string_across_tokens_llm(llm):
    tok = llm.get_tokenizer()
    prompt = text_prompt(50, 8)
    ref = greedy_ref(llm, prompt)
    stop, at, need = stop_across_boundary(tok, ref.token_ids)
    for include in (False, True):
        sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop, "\x00never"],
                            include_stop_str_in_output=include, allowed_token_ids=TEXT_IDS)
        c = gen(llm, [prompt], [sp])[0].outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop
        assert c.text == ref.text[:at + (len(stop) if include else 0)]
        assert c.token_ids == ref.token_ids[:need]
    # a stop string never met: the request runs to the end untouched
    c = gen(llm, [prompt], [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop="\x00",
                                           allowed_token_ids=TEXT_IDS)])[0].outputs[0]
    assert c.text == ref.text and c.finish_reason == "length" and c.stop_reason is None


async def test_stop_string_never_streamed_async(model_dir):
    eng = AsyncLLMEngine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=256))
    async with eng:
        prompt = text_prompt(51, 8)
        ref = (await eng.complete(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                         allowed_token_ids=TEXT_IDS))).outputs[0]
        stop, at, need = stop_across_boundary(eng.tokenizer, ref.token_ids)
        for kind in (OutputKind.DELTA, OutputKind.CUMULATIVE):
            sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=stop, output_kind=kind,
                                allowed_token_ids=TEXT_IDS)
            deltas, last = [], None
            async for out in eng.generate(prompt, sp):
                deltas.append(out.text_delta)
                assert stop not in "".join(deltas)
                assert ref.text[:at].startswith("".join(deltas))  # nothing past the cut, ever
                last = out
            assert "".join(deltas) == ref.text[:at]
            c = last.outputs[0]
            assert last.finished and c.finish_reason == "stop" and c.stop_reason == stop
            if kind == OutputKind.CUMULATIVE:
                assert c.text == ref.text[:at] and c.token_ids == ref.token_ids[:need]
        assert eng.core.scheduler.requests == {}


def test_stop_token_ids_min_tokens_ignore_eos(llm):
    tok = llm.get_tokenizer()
    prompt = text_prompt(60, 10)
    ref = greedy_ref(llm, prompt, 16)
    t = ref.token_ids[3]
    first = ref.token_ids.index(t)
    base = dict(max_tokens=16, temperature=0.0, ignore_eos=True, allowed_token_ids=TEXT_IDS)
    c = gen(llm, [prompt], [SamplingParams(stop_token_ids=[t], **base)])[0].outputs[0]
    assert c.token_ids == ref.token_ids[:first + 1]  # the stop token is in the ids...
    assert c.finish_reason == "stop" and c.stop_reason == t
    assert c.text == tok.decode(ref.token_ids[:first])  # ...but not in the text
    c = gen(llm, [prompt], [SamplingParams(stop_token_ids=[t], include_stop_str_in_output=True,
                                           **base)])[0].outputs[0]
    assert c.text == tok.decode(ref.token_ids[:first + 1])
    # min_tokens: the stop token is banned until min_tokens tokens exist
    c = gen(llm, [prompt], [SamplingParams(stop_token_ids=[t], min_tokens=first + 3, **base)])[0].outputs[0]
    assert len(c.token_ids) >= first + 3 and t not in c.token_ids[:first + 3]
    assert (c.finish_reason, c.stop_reason) in (("length", None), ("stop", t))
    # EOS made certain by a logit bias: stops at once, unless ignore_eos; min_tokens delays it
    eos_bias = {EOS: 100.0}
    c = gen(llm, [prompt], [SamplingParams(max_tokens=8, temperature=0.0, logit_bias=eos_bias)])[0].outputs[0]
    assert c.token_ids == [EOS] and c.finish_reason == "stop" and c.stop_reason is None and c.text == ""
    c = gen(llm, [prompt], [SamplingParams(max_tokens=8, temperature=0.0, logit_bias=eos_bias,
                                           min_tokens=3)])[0].outputs[0]
    assert len(c.token_ids) == 4 and EOS not in c.token_ids[:3] and c.token_ids[3] == EOS
    assert c.finish_reason == "stop"
    for skip in (True, False):
        c = gen(llm, [prompt], [SamplingParams(max_tokens=5, temperature=0.0, logit_bias=eos_bias, ignore_eos=True,
                                               skip_special_tokens=skip)])[0].outputs[0]
        assert c.token_ids == [EOS] * 5 and c.finish_reason == "length"
        assert c.text == tok.decode([EOS] * 5, skip_special_tokens=skip)
        assert c.text == ("" if skip else tok.decode([EOS]) * 5) and (skip or c.text)


# ---------------------------------------------------------------------------- streams and kinds

async def _collect(stream):
    outs = []
    async for o in stream:
        outs.append(o)
    return outs


async def test_streamed_deltas_concatenate_to_decode(model_dir):
    eng = AsyncLLMEngine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=256))
    async with eng:
        tok = eng.tokenizer
        texts = ["The quick brown fox", "def f(x):", "Paris is the capital of", "Café, naïve"]
        # clean text (whole characters) -> exactly decode(output ids); any ids -> still consistent
        streams = [eng.generate(texts[i % 4], SamplingParams(
                       max_tokens=30, temperature=1.2, seed=i, ignore_eos=True, output_kind=OutputKind.DELTA,
                       allowed_token_ids=TEXT_IDS if i < 4 else None)) for i in range(6)]
        results = await asyncio.wait_for(asyncio.gather(*(_collect(s) for s in streams)), HANG_GUARD_S)
        for i, outs in enumerate(results):
            ids = sum((o.token_ids_delta for o in outs), [])
            text = "".join(o.text_delta for o in outs)
            assert ids == sum((list(o.outputs[0].token_ids) for o in outs), [])
            assert text == "".join(o.outputs[0].text for o in outs)
            assert len(ids) == 30 and outs[-1].finished
            if i < 4:
                assert text == tok.decode(ids, skip_special_tokens=True)
                assert tok.decode(tok.encode(texts[i]) + ids) == texts[i] + text  # appends to the prompt


async def test_output_kinds_n1_and_n3(model_dir):
    eng = AsyncLLMEngine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=256))
    prompt = prompt_of(80, 20)
    async with eng:
        for n in (1, 3):
            def sp(kind):
                return SamplingParams(n=n, max_tokens=10, temperature=1.0, seed=3, ignore_eos=True, logprobs=1,
                                      output_kind=kind)
            final = await asyncio.wait_for(_collect(eng.generate(prompt, sp(OutputKind.FINAL_ONLY))), HANG_GUARD_S)
            assert len(final) == 1 and final[0].finished and len(final[0].outputs) == n
            want = {c.index: c for c in final[0].outputs}
            assert sorted(want) == list(range(n))

            outs = await asyncio.wait_for(_collect(eng.generate(prompt, sp(OutputKind.DELTA))), HANG_GUARD_S)
            assert len(outs) > 1 and outs[-1].finished and not any(o.finished for o in outs[:-1])
            got = {i: ([], "", []) for i in range(n)}
            for o in outs:
                assert len({c.index for c in o.outputs}) == len(o.outputs)
                for c in o.outputs:
                    ids, text, lps = got[c.index]
                    got[c.index] = (ids + list(c.token_ids), text + c.text, lps + list(c.logprobs))
            for i in range(n):
                assert got[i][0] == want[i].token_ids and got[i][1] == want[i].text
                assert [set(e) for e in got[i][2]] == [set(e) for e in want[i].logprobs]
            assert sum((o.token_ids_delta for o in outs), []) == want[0].token_ids  # sample 0's news

            outs = await asyncio.wait_for(_collect(eng.generate(prompt, sp(OutputKind.CUMULATIVE))), HANG_GUARD_S)
            assert len(outs) > 1 and outs[-1].finished
            for a, b in zip(outs, outs[1:]):
                assert [c.index for c in b.outputs] == list(range(n))
                for ca, cb in zip(a.outputs, b.outputs):
                    assert cb.token_ids[:len(ca.token_ids)] == ca.token_ids
            assert [c.token_ids for c in outs[-1].outputs] == [want[i].token_ids for i in range(n)]
            assert [c.finish_reason for c in outs[-1].outputs] == ["length"] * n

            for kind in (OutputKind.DELTA, OutputKind.CUMULATIVE):  # a slow consumer: merged outputs
                stream = eng.generate(prompt, sp(kind))
                first = await asyncio.wait_for(stream.__anext__(), HANG_GUARD_S)
                for _ in range(2000):
                    if stream.request_id not in eng._slots:
                        break
                    await asyncio.sleep(0.005)
                rest = await asyncio.wait_for(_collect(stream), HANG_GUARD_S)
                assert len(rest) == 1 and rest[0].finished
                if kind == OutputKind.CUMULATIVE:
                    merged = {c.index: list(c.token_ids) for c in rest[0].outputs}
                else:
                    merged = {i: [] for i in range(n)}
                    for o in (first, rest[0]):
                        for c in o.outputs:
                            merged[c.index] += list(c.token_ids)
                assert merged == {i: want[i].token_ids for i in range(n)}
                assert first.token_ids_delta + rest[0].token_ids_delta == want[0].token_ids
        assert eng.core.scheduler.requests == {} and eng.output_processor.states == {}


async def test_abort_parent_aborts_every_sample(model_dir):
    eng = AsyncLLMEngine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=256))
    async with eng:
        stream = eng.generate(prompt_of(90, 40), SamplingParams(n=3, max_tokens=200, temperature=1.0, ignore_eos=True,
                                                                output_kind=OutputKind.DELTA),
                              request_id="par")
        seen = set()
        async for out in stream:
            seen |= {c.index for c in out.outputs}
            if len(seen) == 3:
                break  # leaving the stream aborts the request
        for _ in range(2000):
            if not eng.core.scheduler.requests and not eng._slots:
                break
            await asyncio.sleep(0.01)
        assert eng.core.scheduler.requests == {} and eng.core.scheduler.samples.parents == {}
        assert eng.output_processor.states == {} and eng.core.kv.num_free_blocks == eng.core.num_blocks
        # an explicit abort of a request that is still held / queued also takes all samples
        stream = eng.generate(prompt_of(91, 40), SamplingParams(n=4, max_tokens=200, temperature=1.0, ignore_eos=True),
                              request_id="par2")
        await eng.abort("par2")
        outs = await asyncio.wait_for(_collect(stream), HANG_GUARD_S)
        assert outs[-1].finished and {c.finish_reason for c in outs[-1].outputs} == {"abort"}
        assert eng.core.scheduler.requests == {} and eng.core.scheduler.samples.parents == {}


async def test_prompt_logprobs_streamed_once(model_dir, hf_model):
    eng = AsyncLLMEngine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=8))
    prompt = prompt_of(95, 30)
    async with eng:
        outs = await asyncio.wait_for(_collect(eng.generate(prompt, SamplingParams(
            n=2, max_tokens=5, temperature=1.0, ignore_eos=True, prompt_logprobs=1,
            output_kind=OutputKind.DELTA))), HANG_GUARD_S)
    with_plp = [o for o in outs if o.prompt_logprobs is not None]
    assert len(with_plp) == 1
    plp = with_plp[0].prompt_logprobs
    ref = ref_logprobs(hf_model, prompt)
    assert len(plp) == 30 and plp[0] is None
    for j in range(1, 30):
        check_entry(plp[j], prompt[j], ref[j - 1], 1)


# ---------------------------------------------------------------------------- text conventions

def test_text_keeps_leading_space_of_sentencepiece_tokenizers():
    """vLLM's convention: the text is what the output adds after the prompt (" jumps over"), not
    decode(output_ids) alone ("jumps over")."""
    from test_detokenizer import metaspace_bpe

    tok = metaspace_bpe()
    prompt = tok.encode("The quick brown fox").ids
    out = tok.encode("The quick brown fox jumps over").ids[len(prompt):]
    op = OutputProcessor(tok)
    op.add_request("r", None, prompt, SamplingParams(max_tokens=len(out)))
    texts = []
    for i, t in enumerate(out):
        fin = "length" if i == len(out) - 1 else None
        for o in op.process([EngineCoreOutput(req_id="r", new_token_ids=[t], finish_reason=fin)]).outputs:
            texts.append(o.text_delta)
            last = o
    assert "".join(texts) == last.outputs[0].text == " jumps over"


# ---------------------------------------------------------------------------- validation

@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("max_tokens", 0), ("min_tokens", -1), ("logprobs", -1), ("prompt_logprobs", -2), ("seed", -1),
    ("stop", [""]), ("allowed_token_ids", []),
])
def test_sampling_params_validation(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


@pytest.mark.parametrize("field,value", [("logit_bias", {VOCAB: 1.0}), ("stop_token_ids", [VOCAB + 3]),
                                         ("allowed_token_ids", [-1])])
def test_token_ids_outside_vocab_are_refused(llm, field, value):
    with pytest.raises(InvalidRequestError, match=field):
        gen(llm, [[5, 6, 7]], [SamplingParams(**{field: value})])
    assert llm.engine.scheduler.requests == {}
