"""Phi-3 / Phi-4-mini against transformers: greedy, fp32, token-exact (near-tie rule).

The tiny checkpoint (model_utils.ARCHS["phi3"]) has the fused ``qkv_proj`` / ``gate_up_proj``
tensors, Phi-4-mini's partial rotary (3/4 of each head) and LongRoPE factors. The parity regimes
stay below the original length (short factors). Past it, the engine rotates each position with the
factors of its side of the original length (long from there on; vLLM's choice too), which is what
transformers computes step by step with its cache; its ``generate`` instead recomputes the whole
sequence with the long factors once it crosses (Phi3ForCausalLM.prepare_inputs_for_generation), so
the reference there is a plain cached greedy loop with prompts below the original length.
"""
from __future__ import annotations

import random

import pytest
import torch
import transformers

from asyncengine import LLM
from asyncengine.errors import ConfigError
from asyncengine.models.phi3 import Phi3ForCausalLM
from model_utils import Reference, compare
from test_parity import REGIMES, record, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("backend,regime", [("cpu", r) for r in REGIMES] + [("torch", "chunked")])
def test_parity(backend, regime, tiny_model_dir, tiny_reference):
    requests, refs = tiny_reference("phi3")
    llm = LLM(tiny_model_dir("phi3"), dtype="float32", attention_backend=backend, **REGIMES[regime])
    counts = record(f"phi3/{backend}/{regime}", compare(run(llm, requests), refs))
    assert counts["exact"] + counts["near_tie"] == len(requests)


def stepwise_greedy(model_dir: str, requests) -> list[Reference]:
    """Greedy with transformers' cache, one token per forward (no recompute at the crossing)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    refs = []
    with torch.inference_mode():
        for ids, n in requests:
            out = model(torch.tensor([ids]), use_cache=True)
            toks, margins = [], []
            for i in range(n):
                logits = out.logits[0, -1]
                top2 = torch.topk(logits, 2).values
                toks.append(int(logits.argmax()))
                margins.append(float(top2[0] - top2[1]))
                if i + 1 < n:
                    pos = torch.tensor([[len(ids) + i]])
                    out = model(torch.tensor([[toks[-1]]]), past_key_values=out.past_key_values,
                                position_ids=pos, use_cache=True)
            refs.append(Reference(toks, margins))
    return refs


def test_longrope_past_the_original_length(tiny_model_dir):
    """Original length 32: prompts of 10-30 tokens decode to 40-60 positions, through the switch."""
    d = tiny_model_dir("phi3", original_max_position_embeddings=32)
    rng = random.Random(3)
    requests = [([rng.randrange(3, 512) for _ in range(rng.randint(10, 30))], rng.randint(25, 30)) for _ in range(6)]
    refs = stepwise_greedy(d, requests)
    assert all(len(p) < 32 <= len(p) + m for p, m in requests)
    llm = LLM(d, dtype="float32", num_kv_blocks=128, block_size=8, max_num_batched_tokens=16)
    counts = record("phi3/longrope", compare(run(llm, requests), refs))
    assert counts["exact"] + counts["near_tie"] == len(requests)
    # the long factors matter: short factors throughout give other tokens
    short = hf_same_factors(tiny_model_dir, requests)
    assert sum(a.tokens != b.tokens for a, b in zip(refs, short)) >= 2


def hf_same_factors(tiny_model_dir, requests) -> list[Reference]:
    factors = [1.0 + 0.1 * i for i in range(6)]
    d = tiny_model_dir("phi3", original_max_position_embeddings=32, rope_scaling={
        "type": "longrope", "short_factor": factors, "long_factor": factors})
    return stepwise_greedy(d, requests)


def test_tensor_parallel_is_refused(tiny_model_dir):
    cfg = transformers.AutoConfig.from_pretrained(tiny_model_dir("phi3"))
    with pytest.raises(ConfigError, match="tensor parallel"):
        Phi3ForCausalLM.check_tensor_parallel(cfg, 2)
