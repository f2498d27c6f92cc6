"""Gemma 3 (text) and Gemma 2 against transformers: greedy, fp32, token-exact (near-tie rule).

Tiny random checkpoints (model_utils.ARCHS): a sliding layer (window 16, shorter than most of the
3-60-token prompts plus outputs) then a global one, each with its own rope base; a score scale
from ``query_pre_attn_scalar`` that is not ``head_dim ** -0.5``; Gemma 3's q/k norms; Gemma 2's
attention and final-logit soft-caps (small enough to change tokens). The regimes of test_parity.py
(a batch, chunked prefill, preemption) on the cpu backend (its C kernel soft-caps Gemma 2's scores:
no fallback to the torch path) and the torch backend; prefix-cache hits and n > 1.
"""
from __future__ import annotations

import random

import pytest
import torch
import transformers

from asyncengine import LLM, SamplingParams
from model_utils import ARCHS, compare, scale_weights
from test_parity import REGIMES, check_no_leak, record, run

GEMMAS = ("gemma3", "gemma2")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("backend,regime", [("cpu", r) for r in REGIMES] + [("torch", "chunked")])
@pytest.mark.parametrize("arch", GEMMAS)
def test_parity(arch, backend, regime, tiny_model_dir, tiny_reference):
    requests, refs = tiny_reference(arch)
    llm = LLM(tiny_model_dir(arch), dtype="float32", attention_backend=backend, **REGIMES[regime])
    from worker_hooks import attention_kernels, attention_windows

    assert llm.engine.collective_rpc(attention_windows)[0] == [16, None]
    if backend == "cpu":  # the C kernels attend (Gemma 2 soft-caps there), no torch fallback
        assert llm.engine.collective_rpc(attention_kernels)[0] is True
    counts = record(f"{arch}/{backend}/{regime}", compare(run(llm, requests), refs))
    assert counts["exact"] + counts["near_tie"] == len(requests)
    if regime == "preempt":
        assert llm.engine.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("arch", GEMMAS)
def test_the_window_and_the_caps_matter(arch, tiny_model_dir, tiny_reference, hf_reference):
    """The same weights without the window (and, for Gemma 2, without the caps) give other tokens:
    the parity above would catch an engine that ignored them."""
    requests, refs = tiny_reference(arch)
    plain = dict(layer_types=["full_attention", "full_attention"])
    if arch == "gemma2":
        plain.update(attn_logit_softcapping=None, final_logit_softcapping=None)
    other = hf_reference(tiny_model_dir(arch, **plain), requests)
    assert sum(a.tokens != b.tokens for a, b in zip(refs, other)) >= len(requests) // 3


@pytest.mark.parametrize("arch", GEMMAS)
def test_prefix_hits_and_n(arch, tiny_model_dir, hf_reference):
    """Prompts sharing a 37-token prefix (past the window) hit the cache the second time round and
    still match the reference; n = 3 greedy samples are each the reference."""
    d = tiny_model_dir(arch)
    rng = random.Random(5)
    prefix = [rng.randrange(3, 512) for _ in range(37)]
    requests = [(prefix + [rng.randrange(3, 512) for _ in range(rng.randint(1, 12))], rng.randint(2, 10))
                for _ in range(5)]
    refs = hf_reference(d, requests)
    llm = LLM(d, dtype="float32", num_kv_blocks=128, block_size=8, max_num_batched_tokens=32,
              enable_prefix_caching=True)
    first = run(llm, requests)
    second = run(llm, requests[::-1])[::-1]
    assert first == second
    assert llm.engine.stats()["prefix_cache_hits"] >= 5 * 32
    counts = compare(first, refs)
    assert counts["exact"] + counts["near_tie"] == len(requests)
    prompts = [list(p) for p, _ in requests[:2]]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, n=3) for _, m in requests[:2]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, ref in zip(outs, refs[:2]):
        assert len(out.outputs) == 3
        for c in out.outputs:
            assert compare([list(c.token_ids)], [ref])["total"] == 1
    check_no_leak(llm)


def tiny_gemma3_vision_checkpoint(out_dir) -> str:
    """A Gemma3ForConditionalGeneration (a one-layer vision tower beside the tiny text model)."""
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, rms_norm_eps=1e-6,
                bos_token_id=0, eos_token_id=1, pad_token_id=2, **ARCHS["gemma3"][1])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=500, boi_token_index=498, eoi_token_index=499)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).to(torch.float32)
    scale_weights(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    return str(out_dir)


def test_gemma3_vision_checkpoint_serves_its_text_model(tmp_path, hf_reference):
    d = tiny_gemma3_vision_checkpoint(tmp_path)
    rng = random.Random(11)
    requests = [([rng.randrange(3, 498) for _ in range(rng.randint(5, 50))], rng.randint(4, 16)) for _ in range(6)]
    refs = hf_reference(d, requests)
    llm = LLM(d, dtype="float32", num_kv_blocks=128, block_size=8, max_num_batched_tokens=16)
    counts = record("gemma3-vision/text", compare(run(llm, requests), refs))
    assert counts["exact"] + counts["near_tie"] == len(requests)


def test_gemma2_as_its_own_draft(tiny_model_dir, tiny_reference):
    """A Gemma 2 draft model gets the target's attention scale and soft-capping too: drafting with
    the target's own weights, every draft is accepted and the tokens are the reference's."""
    d = tiny_model_dir("gemma2")
    requests, refs = tiny_reference("gemma2")
    requests, refs = requests[:6], refs[:6]
    llm = LLM(d, dtype="float32", num_kv_blocks=256, block_size=8,
              speculative_config={"method": "draft_model", "model": d, "num_speculative_tokens": 3})
    counts = compare(run(llm, requests), refs)
    assert counts["exact"] + counts["near_tie"] == len(requests)
    s = llm.engine.stats()
    assert s["spec_num_draft_tokens"] > 0 and s["spec_num_accepted_tokens"] >= 0.9 * s["spec_num_draft_tokens"], s
