"""Which grammar engine: xgrammar vs llguidance on the default model's tokenizer (SmolLM2, 49k
tokens), CPU. Per engine: tokenizer set-up, compiling a JSON schema (cold), and the per-token cost
of filling the next-token bitmask + advancing, along a valid output.

    python benchmarks/grammar_engines.py
"""
from __future__ import annotations

import json
import time

from asyncengine.config import EngineConfig
from asyncengine.models.model_info import load_model_info

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "maxLength": 60}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                            "maxItems": 8},
    "address": {"type": "object", "properties": {"street": {"type": "string", "maxLength": 60},
                                                 "city": {"type": "string", "maxLength": 30},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "city", "zip"], "additionalProperties": False},
    "status": {"enum": ["active", "inactive", "banned"]}},
    "required": ["name", "age", "email", "tags", "address", "status"], "additionalProperties": False}
OUTPUT = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["math", "poetry", "engines"],
                     "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"},
                     "status": "active"})  # the compact form both engines produce: ", " and ": "


def bench_xgrammar(tok, vocab, eos):
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=eos)
    comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t1 = time.perf_counter()
    g = comp.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    t2 = time.perf_counter()
    ids = tok.encode(OUTPUT, add_special_tokens=False)
    mask = xgr.allocate_token_bitmask(1, vocab)
    best = float("inf")
    for _ in range(5):
        m = xgr.GrammarMatcher(g)
        t = time.perf_counter()
        for i in ids:
            m.fill_next_token_bitmask(mask, 0)
            assert m.accept_token(i), tok.decode(ids[:ids.index(i) + 1])
        best = min(best, (time.perf_counter() - t) / len(ids))
    return t1 - t0, t2 - t1, best, len(ids)


def bench_llguidance(tok, vocab, eos):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t0 = time.perf_counter()
    lt = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    m = llguidance.LLMatcher(lt, grammar)
    assert not m.is_error(), m.get_error()
    t2 = time.perf_counter()
    ids = tok.encode(OUTPUT, add_special_tokens=False)
    mask = llguidance.torch.allocate_token_bitmask(1, vocab)
    best = float("inf")
    for _ in range(5):
        m = llguidance.LLMatcher(lt, grammar)
        t = time.perf_counter()
        for i in ids:
            llguidance.torch.fill_next_token_bitmask(m, mask, 0)
            assert m.consume_token(i), (i, m.get_error())
        best = min(best, (time.perf_counter() - t) / len(ids))
    return t1 - t0, t2 - t1, best, len(ids)


def main() -> None:
    info = load_model_info(EngineConfig(model=None))
    tok, vocab, eos = info.tokenizer, info.vocab_size, list(info.eos_token_ids)
    for name, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        try:
            setup, compile_s, per_tok, n = fn(tok, vocab, eos)
            print(f"{name:10s}: tokenizer set-up {setup * 1e3:7.1f} ms, schema compile {compile_s * 1e3:7.1f} ms, "
                  f"mask+advance {per_tok * 1e6:6.1f} us/token (over {n} tokens)")
        except Exception as e:  # noqa: BLE001
            print(f"{name:10s}: failed: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
