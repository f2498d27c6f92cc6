"""KV-cache sizing goes one way (core/kv_cache_spec.py): each worker reports a KVCacheSpec (its block
size and what a block costs), the core plans, every worker builds the KVCacheConfig it is handed and
never re-reads the block size from the engine config."""
from __future__ import annotations

import pytest

from asyncengine.config import EngineConfig
from asyncengine.contracts.kv_cache_spec import KVCacheConfig, KVCacheSpec
from asyncengine.executor.abstract import Executor


def test_the_runner_builds_the_planned_cache_not_the_configs(tiny_llama_dir):
    from asyncengine.models.loader import load_model
    from asyncengine.worker.model_runner import ModelRunner

    cfg = EngineConfig(model=tiny_llama_dir, dtype="float32", device="cpu", block_size=16, attention_backend="torch")
    model = load_model(cfg.model_config, tokenizer=False).model
    runner = ModelRunner(model, KVCacheConfig(num_blocks=6, block_size=32), eos_token_ids=[],
                         model_config=cfg.model_config, cache_config=cfg.cache_config,
                         scheduler_config=cfg.scheduler_config)
    assert (runner.block_size, runner.num_blocks) == (32, 6)
    assert runner.attn_backend.block_size == 32
    from asyncengine.layers.attention import TorchPagedAttention

    k, _ = runner.kv_caches[0]
    assert tuple(k.shape) == TorchPagedAttention.kv_cache_shape(6, 32, model.num_kv_heads, model.args.head_dim)


def test_an_engine_reports_and_builds_its_block_size(tiny_llama_dir):
    from worker_hooks import runner_of

    from asyncengine import LLM, SamplingParams

    llm = LLM(tiny_llama_dir, dtype="float32", block_size=8, num_kv_blocks=40)
    spec = llm.engine.executor.determine_kv_cache_spec()
    assert spec.block_size == 8 and spec.bytes_per_block > 0
    [runner] = llm.engine.collective_rpc(runner_of)
    assert (runner.block_size, runner.num_blocks) == (8, 40)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


class _Ranks(Executor):
    """The executor's merge of its ranks' reports, without workers."""

    def __init__(self, specs):
        self.specs = specs

    def collective_rpc(self, method, args=(), kwargs=None, timeout=None, non_block=False):
        assert method == "determine_kv_cache_spec"
        return self.specs

    execute_model = check_health = shutdown = None


def test_ranks_merge_to_the_most_constrained_and_must_agree_on_block_size():
    a = KVCacheSpec(block_size=16, bytes_per_block=100, available_bytes=5000, kv_budget_bytes=None)
    b = KVCacheSpec(block_size=16, bytes_per_block=120, available_bytes=4000, kv_budget_bytes=900)
    merged = _Ranks([a, b]).determine_kv_cache_spec()
    assert (merged.block_size, merged.bytes_per_block, merged.available_bytes, merged.kv_budget_bytes) == \
        (16, 120, 4000, 900)
    with pytest.raises(RuntimeError, match="disagree on the KV block size"):
        _Ranks([a, KVCacheSpec(block_size=32, bytes_per_block=100, available_bytes=None)]).determine_kv_cache_spec()
