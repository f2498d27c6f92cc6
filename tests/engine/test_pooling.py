"""LLM.embed / AsyncLLMEngine.embed (engine/pooling.py, worker/pooling.py): decoder embeddings run
through the scheduler with generation. Each embedding equals the pool of transformers' final
hidden states (fp32, cosine > 0.99999) for last / mean / cls pooling, through chunked prefill (a
16-token budget) and with last-token prefix-cache hits; embedding requests mixed into a generating
batch leave the generated tokens token-exact; no KV block leaks."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch
import torch.nn.functional as F
import transformers

from asyncengine import LLM, AsyncLLMEngine, EngineConfig, SamplingParams
from asyncengine.errors import InvalidRequestError
from asyncengine.pooling_params import PoolingSpec

COMMON = dict(dtype="float32", skip_tokenizer_init=True, num_kv_blocks=256, max_model_len=256, num_threads=1,
              freeze_gc_after_load=False, max_num_batched_tokens=16, seed=0)


def prompts(n: int = 6, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 512) for _ in range(20)]  # shared: last pooling may hit the prefix cache
    return [prefix[:rng.randrange(0, 21)] + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 30))]
            for _ in range(n)]


def hf_embeddings(model_dir: str, ps: list[list[int]], pooling: str, dimensions=None) -> list[torch.Tensor]:
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in ps:
            h = model(torch.tensor([p])).last_hidden_state[0]
            v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling]
            out.append(F.normalize(v[:dimensions] if dimensions else v, dim=-1))
    return out


def assert_close(got: list[list[float]], refs: list[torch.Tensor]) -> None:
    assert len(got) == len(refs)
    for g, r in zip(got, refs):
        g = torch.tensor(g)
        assert g.shape == r.shape
        assert F.cosine_similarity(g, r, dim=0).item() > 0.99999
        assert abs(g.norm().item() - 1.0) < 1e-5


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_embed_equals_pooled_transformers_hidden_states(tiny_model_dir, arch):
    d = tiny_model_dir(arch)
    ps = prompts()
    with LLM(d, enable_prefix_caching=True, **COMMON) as llm:
        first = llm.embed(ps)
        again = llm.embed(ps)  # last pooling: the second run hits the prefix cache
        means = llm.embed(ps, pooling="mean")
        cls = llm.embed(ps, pooling="cls", dimensions=16)
        assert llm.engine.kv.prefix_hits > 0
        assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks, "KV blocks leaked"
        assert not llm.engine.kv.req_to_blocks
    assert_close(first, hf_embeddings(d, ps, "last"))
    assert_close(again, hf_embeddings(d, ps, "last"))
    assert_close(means, hf_embeddings(d, ps, "mean"))
    assert_close(cls, hf_embeddings(d, ps, "cls", 16))


@pytest.mark.usefixtures("one_torch_thread")
def test_embeddings_mixed_into_generation_leave_tokens_exact(tiny_llama_dir):
    gen = prompts(5, seed=9)
    emb = prompts(6, seed=11)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

    async def run(mixed: bool):
        engine = AsyncLLMEngine.from_config(EngineConfig(model=tiny_llama_dir, **COMMON))
        try:
            gens = [engine.complete({"prompt_token_ids": p}, params) for p in gen]
            tasks = gens + ([engine.embed(emb, pooling="mean"), engine.embed(emb[:2])] if mixed else [])
            outs = await asyncio.gather(*tasks)
            return [o.outputs[0].token_ids for o in outs[:len(gen)]], outs[len(gen):]
        finally:
            await engine.shutdown()

    alone, _ = asyncio.run(run(False))
    mixed, embs = asyncio.run(run(True))
    assert mixed == alone
    assert_close(embs[0], hf_embeddings(tiny_llama_dir, emb, "mean"))
    assert_close(embs[1], hf_embeddings(tiny_llama_dir, emb[:2], "last"))


def test_embed_inputs_and_bad_requests(tiny_llama_dir):
    with LLM(tiny_llama_dir, **COMMON) as llm:
        one = llm.embed([5, 6, 7])  # a list of ints is one input
        assert len(one) == 1 and len(one[0]) == 64
        raw = llm.embed([[5, 6, 7]], normalize=False)
        assert abs(torch.tensor(raw[0]).norm().item() - 1.0) > 1e-3
        for bad in (dict(pooling="max"), dict(dimensions=0)):
            with pytest.raises(InvalidRequestError):
                llm.embed([[5, 6]], **bad)
        with pytest.raises(InvalidRequestError):
            llm.embed([])
        with pytest.raises(InvalidRequestError, match="tokenizer"):
            llm.embed("text without a tokenizer")
        with pytest.raises(InvalidRequestError, match="exceeds"):
            llm.embed([[5, 6]], dimensions=65)
    with pytest.raises(InvalidRequestError, match="pooling"):  # a spec given to generate directly
        SamplingParams(max_tokens=1, pooling=PoolingSpec("max"))


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("front", ["core_process", "data_parallel", "prefill_decode"])
def test_embed_through_every_front_end(tiny_llama_dir, tmp_path, front):
    """The EngineClient protocol's embed on the other front ends: the embedding crosses a core
    process's pipe (msgspec), the DP router, the P/D engine (no KV hop: the decode core pools)."""
    extra = {"core_process": dict(engine_core_process=True), "data_parallel": dict(data_parallel_size=2),
             "prefill_decode": dict(kv_transfer_dir=str(tmp_path), prefill_cores=1, decode_cores=1)}[front]
    ps = prompts(4, seed=13)

    async def run():
        async with AsyncLLMEngine.from_config(EngineConfig(model=tiny_llama_dir, **COMMON, **extra)) as eng:
            return await asyncio.wait_for(eng.embed(ps, pooling="mean"), 180)

    assert_close(asyncio.run(run()), hf_embeddings(tiny_llama_dir, ps, "mean"))


@pytest.mark.usefixtures("one_torch_thread")
def test_embeddings_under_preemption(tiny_llama_dir):
    """Pooling requests preempted (their KV freed) come back as new runner states and recompute
    from position 0: the embeddings still equal the reference, the pool is whole after."""
    from asyncengine.engine.pooling import embed_requests

    gen = prompts(4, seed=21)
    emb = [list(range(3 + i, 3 + i + 44)) for i in range(4)]
    cfg = dict(COMMON, num_kv_blocks=24, block_size=4)

    async def run():
        async with AsyncLLMEngine.from_config(EngineConfig(model=tiny_llama_dir, **cfg)) as eng:
            gens = [eng.complete({"prompt_token_ids": p}, SamplingParams(max_tokens=30, temperature=0.0,
                                                                         ignore_eos=True)) for p in gen]
            embs = [eng.complete(p, params) for p, params in embed_requests(None, emb, pooling="mean")]
            outs = await asyncio.wait_for(asyncio.gather(*gens, *embs), 180)
            stats = eng.stats()
        return outs[len(gen):], stats

    outs, stats = asyncio.run(run())
    assert sum(o.metrics.num_preemptions for o in outs) > 0, stats
    assert_close([o.embedding for o in outs], hf_embeddings(tiny_llama_dir, emb, "mean"))
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
