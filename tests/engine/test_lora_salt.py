"""engine/processor.py's cache salt for adapters: the same id naming other weights (a restart that
numbers adapters afresh, an adapter retrained in place) gets another salt, so no KV block, in the
cache or on the disk tier, is read under the wrong adapter."""
import os

from asyncengine.engine.processor import lora_salt
from asyncengine.lora_request import LoRARequest


def _adapter(folder, payload: bytes) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "adapter_model.safetensors"), "wb") as f:
        f.write(payload)
    return str(folder)


def test_the_salt_names_the_adapters_weights(tmp_path):
    a = _adapter(tmp_path / "a", b"x" * 10)
    b = _adapter(tmp_path / "b", b"x" * 10)
    assert lora_salt(None, None) is None and lora_salt("s", None) == "s"  # the base model: unchanged
    one = lora_salt(None, LoRARequest("a", 1, a))
    assert one == lora_salt(None, LoRARequest("a", 1, a))  # stable: prefix hits still happen
    assert one != lora_salt(None, LoRARequest("b", 1, b))  # another adapter under the same id
    assert one != lora_salt(None, LoRARequest("a", 2, a))
    assert lora_salt("user", LoRARequest("a", 1, a)).startswith("user")
    _adapter(tmp_path / "a", b"y" * 11)  # retrained in place
    assert lora_salt(None, LoRARequest("a", 1, a)) != one
