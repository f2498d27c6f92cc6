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
