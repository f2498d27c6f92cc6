import pytest

from asyncengine import EngineConfig
from asyncengine.config.lora import check_adapter_files, parse_lora_module
from asyncengine.errors import ConfigError


@pytest.mark.parametrize("kw,match", [
    ({"max_loras": 0}, "max_loras"), ({"max_lora_rank": 0}, "max_lora_rank"),
    ({"max_lora_rank": 1024}, "max_lora_rank"), ({"max_loras": 3, "max_cpu_loras": 2}, "max_cpu_loras"),
])
def test_bad_limits_refused(kw, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(enable_lora=True, **kw)


def test_good_limits_and_module_spec():
    c = EngineConfig(enable_lora=True, max_loras=2, max_lora_rank=64, max_cpu_loras=4)
    assert (c.max_loras, c.max_lora_rank, c.max_cpu_loras) == (2, 64, 4)
    assert parse_lora_module("sql=/a/b") == ("sql", "/a/b")
    with pytest.raises(ConfigError, match="name=path"):
        parse_lora_module("sql")


def test_adapter_files_checked(tmp_path):
    with pytest.raises(ConfigError, match="no such folder"):
        check_adapter_files(str(tmp_path / "x"), 16)
    with pytest.raises(ConfigError, match="adapter_config.json"):
        check_adapter_files(str(tmp_path), 16)
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    with pytest.raises(ConfigError, match="adapter_model.safetensors"):
        check_adapter_files(str(tmp_path), 16)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    assert check_adapter_files(str(tmp_path), 16)["r"] == 8
    with pytest.raises(ConfigError, match="rank 8"):
        check_adapter_files(str(tmp_path), 4)
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        check_adapter_files(str(tmp_path), 16)
