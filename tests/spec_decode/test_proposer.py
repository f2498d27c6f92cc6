"""One proposer interface (spec_decode/proposer.py): the runner drafts through it whatever the
method; the n-gram lookup behind it gives what its own lookup gives, and is stateless."""
from __future__ import annotations

from types import SimpleNamespace

from asyncengine.spec_decode.draft import DraftModelProposer
from asyncengine.spec_decode.ngram import NgramProposer
from asyncengine.spec_decode.proposer import Proposer


def test_both_methods_are_proposers():
    assert issubclass(NgramProposer, Proposer) and issubclass(DraftModelProposer, Proposer)
    assert DraftModelProposer.runs_every_step and not NgramProposer.runs_every_step


def test_ngram_behind_the_interface():
    p = NgramProposer(1, 3, 3)
    a = SimpleNamespace(req_id="a", prompt_ids=[1, 2, 3, 4], output_ids=[1, 2])
    b = SimpleNamespace(req_id="b", prompt_ids=[7, 8], output_ids=[9])
    decode = SimpleNamespace(req_id="c", prompt_ids=[5], output_ids=[5])
    assert p.propose_step([decode], [], [(a, 2), (b, 3)]) == [[3, 4], []]
    assert p.propose_step([], [], [(a, 1)]) == [p.propose([1, 2, 3, 4, 1, 2], 1)] == [[3]]
    p.add("a", 0), p.accepted("a", 5, 2, 2), p.forget("a"), p.reset()  # stateless: no-ops
    assert p.propose_step([], [], [(a, 2)]) == [[3, 4]]
