"""Structured outputs on a random-weight tiny model (real BPE tokenizer): 200 varied JSON schemas in
one engine run all give output that parses and validates within max_tokens; regex and choice always
match; grammars that cannot compile are clear errors; speculation on changes nothing (greedy)."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from asyncengine import LLM, SamplingParams
from asyncengine.errors import InvalidRequestError
from asyncengine.structured import StructuredOutputsParams as SO

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
WORDS = ["red", "green", "blue", "alpha", "beta", "x", "yes", "no"]


def random_schema(rng: random.Random, depth: int = 0, bounded: bool = True) -> dict:
    """A random schema over what a grammar can bound: strings with maxLength (unless not
    ``bounded``), integers and numbers with ranges, enums, booleans, arrays with maxItems, nested
    objects with required fields."""
    kinds = ["string", "integer", "number", "enum", "boolean", "array"] + (["object"] * 2 if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        s = {"type": "string"}
        if bounded:
            s["maxLength"] = rng.randint(1, 12)
            if rng.random() < 0.3:
                s["minLength"] = rng.randint(0, s["maxLength"])
        return s
    if kind == "integer":
        lo = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 5000)}
    if kind == "number":
        lo = rng.randint(-100, 100)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 500)}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1, bounded), "maxItems": rng.randint(1, 4)}
    props = {f"f{i}_{rng.choice(WORDS)}": random_schema(rng, depth + 1, bounded) for i in range(rng.randint(1, 4))}
    names = list(props)
    return {"type": "object", "properties": props, "required": rng.sample(names, rng.randint(1, len(names))),
            "additionalProperties": False}


def object_schema(rng, bounded=True) -> dict:
    s = random_schema(rng, 1, bounded)
    return {"type": "object", "properties": {"value": s, "note": {"enum": WORDS[:3]}}, "required": ["value"],
            "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    eng = LLM(tiny_llama_dir, dtype="float32", max_num_seqs=256, num_kv_blocks=4096)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def llm_spec(tiny_llama_dir):
    eng = LLM(tiny_llama_dir, dtype="float32", max_num_seqs=256, num_kv_blocks=4096, speculative_config=NGRAM)
    yield eng
    eng.shutdown()


def workload(n: int = 200, seed: int = 0):
    rng = random.Random(seed)
    schemas, params = [], []
    for i in range(n):
        bounded = i % 10 != 9  # every 10th: unbounded strings (only "stop" outputs must validate)
        schema = object_schema(rng, bounded) if i % 3 else random_schema(rng, 0, bounded) | {}
        if schema.get("type") != "object" and i % 3 == 0:
            schema = {"type": "object", "properties": {"v": schema}, "required": ["v"], "additionalProperties": False}
        schemas.append((schema, bounded))
        t = [0.0, 0.7, 1.0][i % 3]
        params.append(SamplingParams(temperature=t, seed=i, max_tokens=400,
                                     structured_outputs=SO(json=schema)))
    prompts = [f"Give me JSON number {i}:" for i in range(n)]
    return prompts, schemas, params


def check_json(outs, schemas):
    bad = []
    for o, (schema, bounded) in zip(outs, schemas):
        c = o.outputs[0]
        if c.finish_reason != "stop":
            if bounded:
                bad.append((schema, c.text, c.finish_reason))
            continue
        try:
            jsonschema.validate(json.loads(c.text), schema)
        except Exception as e:  # noqa: BLE001
            bad.append((schema, c.text, str(e)[:200]))
    assert not bad, bad[:3]


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "ngram"])
def test_200_json_schemas_validate(llm, llm_spec, spec):
    prompts, schemas, params = workload()
    eng = llm_spec if spec else llm
    outs = eng.generate(prompts, params, use_tqdm=False)
    check_json(outs, schemas)
    finished_stop = sum(o.outputs[0].finish_reason == "stop" for o in outs)
    assert finished_stop >= 0.9 * len(outs)


def test_speculation_is_exact_under_a_grammar(llm, llm_spec):
    prompts, schemas, params = workload(40, seed=1)
    params = [SamplingParams(temperature=0.0, max_tokens=300, structured_outputs=p.structured_outputs) for p in params]
    a = llm.generate(prompts, params, use_tqdm=False)
    b = llm_spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert llm_spec.engine.stats()["spec_num_accepted_tokens"] > 0


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "ngram"])
def test_regex_choice_json_object_grammar(llm, llm_spec, spec):
    eng = llm_spec if spec else llm
    regexes = [r"[a-c]{3}-\d{2}", r"(cat|dog)s? [0-9]{1,3}", r"[A-Z][a-z]{0,6}\.", r"\d{4}-\d{2}-\d{2}"]
    choices = [["yes", "no"], ["red", "green", "blue"], ["a long answer", "short"]]
    grammar = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
    ps, kinds = [], []
    for i in range(60):
        t = [0.0, 1.0][i % 2]
        kind = i % 4
        if kind == 0:
            so = SO(regex=regexes[i % len(regexes)])
        elif kind == 1:
            so = SO(choice=choices[i % len(choices)])
        elif kind == 2:
            so = SO(json_object=True)
        else:
            so = SO(grammar=grammar)
        ps.append(SamplingParams(temperature=t, seed=i, max_tokens=120, structured_outputs=so))
        kinds.append(so)
    outs = eng.generate([f"q{i}" for i in range(len(ps))], ps, use_tqdm=False)
    for o, so in zip(outs, kinds):
        text, reason = o.outputs[0].text, o.outputs[0].finish_reason
        if so.regex:
            assert reason == "stop" and re.fullmatch(so.regex, text), (so.regex, text)
        elif so.choice:
            assert reason == "stop" and text in so.choice, text
        elif so.json_object:
            if reason == "stop":  # any JSON object: free strings may run long on a random model
                assert isinstance(json.loads(text), dict), text
        else:
            assert reason == "stop" and re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", text), text


def test_bad_grammars_are_clear_errors_and_the_engine_lives(llm):
    for so, msg in [(SO(json='{"type": "object", "properties": 5}'), "properties"),
                    (SO(json="{not json"), "json"),
                    (SO(regex="(unclosed"), "regex"),
                    (SO(grammar="root ::= missing_rule"), "grammar")]:
        with pytest.raises(InvalidRequestError, match="does not compile"):
            llm.generate("x", SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="exactly one"):
        SO(regex="a", choice=["b"])
    out = llm.generate("x", SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=SO(choice=["ok"])),
                       use_tqdm=False)
    assert out[0].outputs[0].text == "ok"


def test_async_engine_overlap_speculation_and_grammar(tiny_llama_dir):
    """Two steps in flight + n-gram drafts + grammars: a step scheduled before its request's grammar
    ended must not break anything; outputs validate and equal the offline greedy ones."""
    import asyncio

    from asyncengine import AsyncLLMEngine, EngineConfig

    prompts, schemas, params = workload(30, seed=2)
    params = [SamplingParams(temperature=0.0, max_tokens=300, structured_outputs=p.structured_outputs) for p in params]

    async def go():
        eng = AsyncLLMEngine(EngineConfig(model=tiny_llama_dir, dtype="float32", num_kv_blocks=2048,
                                          speculative_config=NGRAM))
        try:
            return await asyncio.wait_for(asyncio.gather(
                *[eng.complete(p, sp, request_id=f"r{i}") for i, (p, sp) in enumerate(zip(prompts, params))]), 300)
        finally:
            await eng.shutdown()

    outs = asyncio.run(go())
    check_json(outs, schemas)
    offline = LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=2048)
    try:
        ref = offline.generate(prompts, params, use_tqdm=False)
    finally:
        offline.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
