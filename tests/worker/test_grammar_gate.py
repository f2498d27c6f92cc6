"""A grammar after a reasoning span: free tokens until the output writes the end marker, then the
grammar; a reasoning budget forces the marker; speculative rollbacks cross the gate both ways."""
from __future__ import annotations

import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.errors import InvalidRequestError
from asyncengine.structured import StructuredOutputsParams
from asyncengine.worker.grammar_gate import GatedMatcher

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 64


class Recorder:
    """A stand-in grammar: allows only token 7; records what it accepted."""

    def __init__(self) -> None:
        self.accepted: list[int] = []
        self.terminated = False

    def fill(self, bitmask, row):
        bitmask[row] = 0
        bitmask[row, 0] = 1 << 7

    def accept(self, t):
        self.accepted.append(t)
        return True

    def rollback(self, n):
        del self.accepted[len(self.accepted) - n:]


def _allowed(m) -> list[int]:
    mask = torch.zeros(1, VOCAB // 32, dtype=torch.int32)
    m.fill(mask, 0)
    return [t for t in range(VOCAB) if (int(mask[0, t // 32]) >> (t % 32)) & 1]


def test_free_until_the_marker_then_the_grammar():
    inner = Recorder()
    m = GatedMatcher(inner, [40, 41])
    for t in (5, 40, 9, 40):  # a lone first marker token does not open it
        assert _allowed(m) == list(range(VOCAB))
        m.accept(t)
    m.accept(41)
    assert m.opened and _allowed(m) == [7] and inner.accepted == []
    m.accept(7)
    assert inner.accepted == [7]
    m.rollback(2)  # back across the gate: free again, the grammar rolled back too
    assert not m.opened and inner.accepted == [] and _allowed(m) == list(range(VOCAB))


@pytest.mark.parametrize("budget", [0, 3])
def test_the_budget_forces_the_marker(budget):
    m = GatedMatcher(Recorder(), [40, 63], budget)
    for t in range(budget):
        assert _allowed(m) == list(range(VOCAB))
        m.accept(t + 1)
    assert _allowed(m) == [40]
    m.accept(40)
    assert _allowed(m) == [63]  # the high bit of its int32 word
    m.accept(63)
    assert m.opened and _allowed(m) == [7]


def test_a_budget_alone_leaves_the_answer_free():
    m = GatedMatcher(None, [40], 1)
    m.accept(3)
    assert _allowed(m) == [40]
    m.accept(40)
    assert _allowed(m) == list(range(VOCAB)) and not m.terminated


def test_params_are_checked():
    with pytest.raises(InvalidRequestError):
        StructuredOutputsParams(regex="a", after=[])
    with pytest.raises(InvalidRequestError):
        StructuredOutputsParams(regex="a", reasoning_budget=3)
    with pytest.raises(InvalidRequestError):
        StructuredOutputsParams()
    assert not StructuredOutputsParams(after=[1], reasoning_budget=2).has_grammar


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    eng = LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=512)
    yield eng
    eng.shutdown()


def test_engine_reasons_then_follows_the_grammar(llm):
    tok = llm.get_tokenizer()
    end = tok.encode("</think>", add_special_tokens=False)
    assert len(end) > 1  # the tiny tokenizer spells it in pieces: the marker spans tokens
    so = StructuredOutputsParams(regex="(yes|no)!", after=end, reasoning_budget=5)
    out = llm.generate(["Is it?"], SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so),
                       use_tqdm=False)[0].outputs[0]
    ids = list(out.token_ids)
    assert ids[5:5 + len(end)] == end and end not in [ids[i:i + len(end)] for i in range(5)]
    assert tok.decode(ids[5 + len(end):], skip_special_tokens=True) in ("yes!", "no!")
    assert out.finish_reason == "stop"
    budget_only = StructuredOutputsParams(after=end, reasoning_budget=3)
    free = llm.generate(["Is it?"], SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=budget_only),
                        use_tqdm=False)[0].outputs[0]
    assert list(free.token_ids)[3:3 + len(end)] == end and len(free.token_ids) == 12


def test_speculation_is_exact_across_the_gate(llm, tiny_llama_dir):
    """Drafts accepted and rolled back across the end marker give the tokens plain decoding gives."""
    spec = LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=512,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 3})
    try:
        end = llm.get_tokenizer().encode("</think>", add_special_tokens=False)
        prompts = ["yes! no! </think> yes! no! </think>" * 3, "Is it? Is it? Is it?"]
        params = [SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=StructuredOutputsParams(
            regex="(yes|no)! (yes|no)!", after=end, reasoning_budget=b)) for b in (2, 6)]
        for p in params:
            a = [o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
            b = [o.outputs[0].token_ids for o in spec.generate(prompts, p, use_tqdm=False)]
            assert a == b
    finally:
        spec.shutdown()
