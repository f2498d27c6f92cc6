"""The model runner's seam: it is built from the configuration views it reads (config/sub_configs.py:
the model, cache and scheduler views, the optional ones off), with no EngineConfig anywhere, and a
scheduler built from views drives it to the tokens the whole engine gives."""
from __future__ import annotations

from asyncengine.config.sub_configs import CacheConfig, ModelConfig, SchedulerConfig
from asyncengine.contracts.kv_cache_spec import KVCacheConfig
from asyncengine.core.kv_cache_manager import KVCacheManager
from asyncengine.core.request import Request
from asyncengine.core.scheduler import Scheduler
from asyncengine.sampling_params import SamplingParams

BLOCK_SIZE, NUM_BLOCKS = 16, 16


def _views(model_dir: str) -> tuple[ModelConfig, CacheConfig, SchedulerConfig]:
    model = ModelConfig(model=model_dir, tokenizer=None, dtype="float32", device="cpu", max_model_len=None, seed=0,
                        skip_tokenizer_init=True, attention_backend="torch", enforce_eager=False, quantization=None,
                        quantized_activations="auto", batch_invariant=False, model_impl="auto", runner="auto")
    cache = CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS, kv_cache_bytes=None,
                        kv_cache_memory_fraction=0.25, gpu_memory_utilization=0.9, enable_prefix_caching=True,
                        kv_cache_dtype="auto")
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, policy="fcfs", enable_chunked_prefill=True,
                            priority_aging_s=10.0, async_scheduling=False)
    return model, cache, sched


def test_a_runner_built_from_views_decodes_as_the_engine(tiny_llama_dir):
    from asyncengine import LLM
    from asyncengine.models.loader import load_model
    from asyncengine.worker.model_runner import ModelRunner

    model_config, cache, sched_config = _views(tiny_llama_dir)
    loaded = load_model(model_config, tokenizer=False)  # the loader reads the model's view too
    plan = KVCacheConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    runner = ModelRunner(loaded.model, plan, loaded.eos_token_ids, model_config=model_config, cache_config=cache,
                         scheduler_config=sched_config)
    assert not hasattr(runner, "config")
    assert (runner.lora, runner.kv_connector, runner.proposer, runner.encoder_cache) == (None, None, None, None)
    sched = Scheduler(KVCacheManager.from_config(plan, cache), sched_config, max_model_len=NUM_BLOCKS * BLOCK_SIZE)
    prompts = {"a": [5, 6, 7, 8, 9], "b": list(range(20, 41))}  # the second spans two blocks
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for rid, prompt in prompts.items():
        sched.add_request(Request(request_id=rid, prompt_token_ids=prompt, sampling_params=params, max_tokens=6))
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    while sched.has_unfinished():
        so = sched.schedule()
        for o in sched.update(so, runner.execute(so)):
            got[o.req_id] += o.new_token_ids
    llm = LLM(tiny_llama_dir, dtype="float32", device="cpu", attention_backend="torch", block_size=BLOCK_SIZE,
              num_kv_blocks=NUM_BLOCKS, skip_tokenizer_init=True)
    want = [o.outputs[0].token_ids for o in llm.generate(list(prompts.values()), params)]
    assert [len(t) for t in got.values()] == [6, 6]
    assert list(got.values()) == [list(t) for t in want]

