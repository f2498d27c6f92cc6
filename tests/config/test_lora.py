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


def _weights(folder, tensors: dict, cut: int = 0) -> None:
    """A safetensors file written by hand: ``tensors`` name -> (dtype, shape, raw bytes)."""
    import json
    import struct

    header, blob = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(blob), len(blob) + len(raw)]}
        blob += raw
    h = json.dumps(header).encode()
    data = struct.pack("<Q", len(h)) + h + blob
    (folder / "adapter_model.safetensors").write_bytes(data[:len(data) - cut])


@pytest.mark.parametrize("dtype,nan", [("F32", b"\x00\x00\xc0\x7f"), ("F16", b"\x00\x7e"), ("BF16", b"\xc0\x7f"),
                                       ("F32", b"\x00\x00\x80\x7f")])  # NaNs, and +inf in F32
def test_adapter_values_read_whole_and_finite(tmp_path, dtype, nan):
    from asyncengine.config.lora import check_adapter_values

    one = {"F32": b"\x00\x00\x80\x3f", "F16": b"\x00\x3c", "BF16": b"\x80\x3f"}[dtype]
    _weights(tmp_path, {"a": (dtype, [2, 2], one * 4)})
    check_adapter_values(str(tmp_path))  # finite, whole: passes
    _weights(tmp_path, {"a": (dtype, [2, 2], one * 3 + nan)})
    with pytest.raises(ConfigError, match="NaN or infinite"):
        check_adapter_values(str(tmp_path))
    _weights(tmp_path, {"a": (dtype, [2, 2], one * 4)}, cut=1)
    with pytest.raises(ConfigError, match="cut short"):
        check_adapter_values(str(tmp_path))
    _weights(tmp_path, {"a": ("I8", [4], b"\x01" * 4)})
    with pytest.raises(ConfigError, match="not F32, F16 or BF16"):
        check_adapter_values(str(tmp_path))


@pytest.mark.parametrize("option,match", [("use_dora", "DoRA"), ("alpha_pattern", "alpha_pattern"),
                                          ("rank_pattern", "rank_pattern"), ("fan_in_fan_out", "fan_in_fan_out"),
                                          ("modules_to_save", "modules_to_save")])
def test_adapter_options_we_do_not_apply_are_refused(tmp_path, option, match):
    import json

    value = {"use_dora": True, "fan_in_fan_out": True, "modules_to_save": ["lm_head"]}.get(option, {"q_proj": 4})
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, option: value}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=match):
        check_adapter_files(str(tmp_path), 16)
