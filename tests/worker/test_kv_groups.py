"""Models mixing full and sliding-window layers run with one block table per KV-cache group
(core/grouped_kv_cache_manager.py, worker/kv_groups.py): greedy fp32 against transformers with
prompts several windows long, in a batch under chunked prefill with preemption and prefix hits, and
the pool's own count showing the sliding groups' blocks freed.

Tiny checkpoints, window 16, block size 4: a Gemma 3 shape (5 local layers : 1 global), Gemma 2
(alternating) and Qwen2 with ``max_window_layers`` (its first 2 of 4 layers full).
(tests/models/test_gemma.py runs the 2-layer Gemmas through the standard parity regimes too.)
"""
from __future__ import annotations

import random

import pytest

from asyncengine import LLM, SamplingParams
from asyncengine.core.grouped_kv_cache_manager import GroupedKVCacheManager
from asyncengine.contracts.kv_cache_spec import block_table_groups
from asyncengine.core.kv_cache_manager import KVCacheManager
from asyncengine.worker.kv_groups import GroupKV, allocate_kv_caches
from model_utils import compare, model_hook

WINDOW, BS = 16, 4
SHAPES = {
    "gemma3": ("gemma3", dict(num_hidden_layers=6, max_position_embeddings=1024,
                              layer_types=["sliding_attention"] * 5 + ["full_attention"])),
    "gemma2": ("gemma2", dict(num_hidden_layers=2)),
    "qwen2": ("qwen2", dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=WINDOW,
                            max_window_layers=2)),
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(n)]


def test_layers_of_each_group_share_tensors():
    class Backend:
        def allocate_kv_caches(self, n, alloc):
            return [(f"k{i}", f"v{i}") for i in range(n)]

    caches = allocate_kv_caches(Backend(), block_table_groups([8, 8, 8, 8, 8, None]), 6, None)
    assert all(isinstance(c, GroupKV) for c in caches)
    assert [c.group for c in caches] == [1, 2, 3, 4, 5, 0] and {tuple(c) for c in caches} == {("k0", "v0")}
    k, v = caches[0]  # still a (k, v) pair to the backends
    assert (k, v) == ("k0", "v0")
    assert allocate_kv_caches(Backend(), block_table_groups([None, None]), 2, None) == [("k0", "v0"), ("k1", "v1")]


@pytest.mark.parametrize("shape,backend", [(s, "cpu") for s in SHAPES] + [("gemma3", "torch")])
def test_batch_chunks_preemption_and_hits_match_transformers(shape, backend, tiny_model_dir, hf_reference):
    arch, overrides = SHAPES[shape]
    d = tiny_model_dir(arch, **overrides)
    rng = random.Random(7)
    shared = tokens(rng, 40)  # 2.5 windows, cached by the first round
    requests = [(shared + tokens(rng, rng.randint(20, 80)), rng.randint(6, 14)) for _ in range(4)]
    refs = hf_reference(d, requests)
    llm = LLM(d, dtype="float32", block_size=BS, num_kv_blocks=24, max_num_batched_tokens=32,
              enable_prefix_caching=True, attention_backend=backend)
    kv = llm.engine.kv
    assert isinstance(kv, GroupedKVCacheManager) and None in kv.windows and WINDOW in kv.windows
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in requests]
    first = llm.generate([p for p, _ in requests], params, use_tqdm=False)
    second = llm.generate([p for p, _ in requests], params, use_tqdm=False)
    for outs in (first, second):
        counts = compare([o.outputs[0].token_ids for o in outs], refs)  # raises at a real mismatch
        assert counts["exact"] + counts["near_tie"] == len(requests)
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] >= 4 * 32
    assert kv.num_free_blocks == llm.engine.num_blocks and not kv.req_to_blocks
    kv.pool.check_invariants()


def test_sliding_groups_hold_their_window_only(tiny_model_dir, hf_reference):
    """A 400-token request on the Gemma 3 shape: at its last step the full group holds a block per
    4 positions, each sliding group at most window / block + 2 (the pool's own count)."""
    d = tiny_model_dir(*SHAPES["gemma3"][:1], **SHAPES["gemma3"][1])
    request = (tokens(random.Random(3), 400), 6)
    llm = LLM(d, dtype="float32", block_size=BS, num_kv_blocks=40, max_num_batched_tokens=32)
    kv = llm.engine.kv
    held: list[tuple[int, list[int]]] = []

    def hook(_):
        rid = next(iter(kv.req_to_blocks), None)
        if rid is not None:
            held.append((kv.pool.num_blocks - kv.num_free_blocks,
                         [kv.held_blocks(rid, g) for g in range(len(kv.groups))]))

    with model_hook(llm, hook):
        out = llm.generate([request[0]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)
    total, per_group = held[-1]
    assert kv.windows == [None] + [WINDOW] * 5 and llm.engine.num_blocks == 40 * 6
    assert per_group[0] == -(-405 // BS)  # the full group: every block of the 405 positions so far
    assert all(n <= WINDOW // BS + 2 for n in per_group[1:])
    assert total == sum(per_group) < 6 * -(-405 // BS)  # one table: every group's every block
    counts = compare([out[0].outputs[0].token_ids], hf_reference(d, [request]))
    assert counts["exact"] + counts["near_tie"] == 1
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_speculative_decoding_keeps_one_table(tiny_model_dir):
    """A draft model reads the target's table: with one configured, a mixed model keeps one
    (tests/models/test_gemma.py runs Gemma 2 as its own draft)."""
    llm = LLM(tiny_model_dir("gemma3"), dtype="float32", block_size=BS, num_kv_blocks=24,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert type(llm.engine.kv) is KVCacheManager and llm.engine.num_blocks == 24


def test_sleep_and_wake_rebuild_the_grouped_cache(tiny_model_dir):
    """Level 1 drops the cache; waking rebuilds it with the layers of each group sharing tensors."""
    llm = LLM(tiny_model_dir(*SHAPES["gemma3"][:1], **SHAPES["gemma3"][1]), dtype="float32", block_size=BS,
              num_kv_blocks=24, max_num_batched_tokens=32)
    prompt, params = tokens(random.Random(4), 70), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    before = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    llm.sleep(1)
    llm.wake_up()
    caches = llm.engine.executor.worker.runner.kv_caches
    assert [c.group for c in caches] == [1, 2, 3, 4, 5, 0] and len({id(c[0]) for c in caches}) == 1
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == before
