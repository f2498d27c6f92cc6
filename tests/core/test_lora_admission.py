from asyncengine import LoRARequest, SamplingParams
from asyncengine.core.lora_admission import too_many_loras
from asyncengine.core.request import Request


def _req(i: int, lora: int | None) -> Request:
    lr = None if lora is None else LoRARequest(f"a{lora}", lora, f"/adapters/{lora}")
    return Request(request_id=f"r{i}", prompt_token_ids=[1, 2], sampling_params=SamplingParams(), lora_request=lr)


def test_a_third_adapter_waits_while_two_run():
    running = [_req(0, 1), _req(1, 2), _req(2, None)]
    assert too_many_loras(_req(3, 3), running, max_loras=2)
    assert not too_many_loras(_req(4, 1), running, max_loras=2)  # an adapter already running
    assert not too_many_loras(_req(5, None), running, max_loras=2)  # the base model never waits
    assert not too_many_loras(_req(6, 3), running, max_loras=3)
    assert not too_many_loras(_req(7, 3), running, max_loras=None)  # LoRA off: no limit


def test_requests_behind_a_waiting_adapter_are_admitted_past_it():
    """Two adapters run with max_loras=2: a third adapter's request waits (no slot, no block), the
    base-model and running-adapter requests behind it start now, and it keeps its place at the front."""
    from asyncengine.config import EngineConfig
    from asyncengine.core.kv_cache_manager import KVCacheManager
    from asyncengine.core.scheduler import Scheduler

    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, enable_lora=True, max_loras=2)
    s = Scheduler(KVCacheManager(64, 4, True), config.scheduler_config, max_model_len=256, lora=config.lora_config)
    for r in (_req(0, 1), _req(1, 2)):
        s.add_request(r)
    s.schedule()
    third, base, again = _req(2, 3), _req(3, None), _req(4, 1)
    for r in (third, base, again):
        s.add_request(r)
    out = s.schedule()
    started = {d.req_id for d in out.new_requests}
    assert started == {"r3", "r4"}  # past r2, whose adapter would be a third
    assert s.waiting.peek() is third and len(s.waiting) == 1
    assert third.request_id not in s.kv.req_to_blocks
