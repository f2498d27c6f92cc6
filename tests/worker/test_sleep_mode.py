"""sleep / wake_up (worker/sleep_mode.py, engine_core/sleep.py), measured in RSS, not pool counters:
level 1 on an engine with a 2 GiB KV cache gives >= 90% of it back to the OS and wake_up is
token-exact with before; level 2 gives the weights back too, and they return from the checkpoint
(token-exact again) or from a full update_weights (then equal to a fresh engine on the update)."""
from __future__ import annotations

import pytest
from safetensors.torch import load_file

from asyncengine import LLM, AsyncLLMEngine, EngineConfig, SamplingParams
from asyncengine.errors import InvalidRequestError
from asyncengine.worker.sleep_mode import rss_bytes
from model_utils import random_requests

REQUESTS = random_requests(3, 512, seed=4, plen=(3, 30), olen=(4, 8))
COMMON = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=256, num_threads=1, freeze_gc_after_load=False)


def greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in REQUESTS],
                        [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in REQUESTS],
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def held_bytes(llm: LLM) -> tuple[int, int]:
    """(KV cache bytes, weight bytes incl. packed copies) the worker holds."""
    from asyncengine.layers.linear import Linear, weight_nbytes

    w = llm.engine.executor.worker
    kv = sum(t.numel() * t.element_size() for pair in w.runner.kv_caches for t in pair)
    packed = sum(m.weight.numel() * m.weight.element_size() for m in w.model.modules()
                 if isinstance(m, Linear) and m.onednn_weight is not None)
    return kv, weight_nbytes(w.model) + packed


def test_level1_returns_the_kv_cache_to_the_os(tiny_llama_dir):
    with LLM(tiny_llama_dir, kv_cache_bytes=2 << 30, **COMMON) as llm:
        before = greedy(llm)
        kv, _ = held_bytes(llm)
        assert kv >= (2 << 30) - (64 << 20)
        for pair in llm.engine.executor.worker.runner.kv_caches:  # resident, as a cache that served
            for t in pair:                                        # many long prompts would be (its
                t.zero_()                                         # pages fault in at first write)
        del pair, t
        rss = rss_bytes()
        llm.sleep(1)
        freed = rss - rss_bytes()
        print(f"[sleep] level 1: KV {kv / 2**30:.2f} GiB, RSS down {freed / 2**30:.2f} GiB ({100 * freed / kv:.0f}%)")
        assert freed >= 0.9 * kv
        assert llm.is_sleeping
        with pytest.raises(InvalidRequestError, match="asleep"):
            greedy(llm)
        llm.wake_up()
        assert not llm.is_sleeping
        assert greedy(llm) == before


@pytest.fixture(scope="module")
def wide(tiny_model_dir):
    """Wide enough for its weights (~300 MiB) to show in RSS; A and B of one shape."""
    kw = dict(hidden_size=1024, intermediate_size=2048, vocab_size=16384, num_attention_heads=8,
              num_key_value_heads=4, tie_word_embeddings=False)
    return tiny_model_dir("llama", seed=0, **kw), tiny_model_dir("llama", seed=1, **kw)


def test_level2_returns_the_weights_and_wakes_from_the_checkpoint(wide):
    a, _ = wide
    with LLM(a, num_kv_blocks=64, **COMMON) as llm:
        before = greedy(llm)
        kv, weights = held_bytes(llm)
        rss = rss_bytes()
        llm.sleep(2)
        freed = rss - rss_bytes()
        print(f"[sleep] level 2: KV + weights {(kv + weights) / 2**20:.0f} MiB, RSS down {freed / 2**20:.0f} MiB "
              f"({100 * freed / (kv + weights):.0f}%)")
        assert freed >= 0.9 * (kv + weights)
        llm.wake_up()
        assert llm.weights_version == 1  # read again from the checkpoint
        assert greedy(llm) == before


def test_level2_weights_come_back_by_a_full_update(wide):
    a, b = wide
    with LLM(b, num_kv_blocks=64, **COMMON) as ref:
        want_b = greedy(ref)
    with LLM(a, num_kv_blocks=64, **COMMON) as llm:
        llm.sleep(2)
        with pytest.raises(Exception, match="partial"):
            llm.update_weights({"model.norm.weight": load_file(f"{b}/model.safetensors")["model.norm.weight"]},
                               partial=True)
        llm.update_weights(b)
        assert llm.engine.asleep == {"kv_cache"}
        llm.wake_up(["kv_cache"])
        assert greedy(llm) == want_b


async def test_async_sleep_holds_requests_until_wake(tiny_llama_dir):
    import asyncio

    async with AsyncLLMEngine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64, **COMMON)) as eng:
        ids, n = REQUESTS[0]
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        before = (await eng.complete({"prompt_token_ids": ids}, params)).outputs[0].token_ids
        await eng.sleep(1)
        assert eng.is_sleeping and eng.is_paused
        waiting = asyncio.create_task(eng.complete({"prompt_token_ids": ids}, params))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        await eng.wake_up()
        assert not eng.is_sleeping
        assert (await asyncio.wait_for(waiting, 120)).outputs[0].token_ids == before
