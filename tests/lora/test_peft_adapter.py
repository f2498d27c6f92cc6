import json

import pytest
import torch

from asyncengine.errors import ConfigError
from asyncengine.lora.peft_adapter import load_peft_adapter
from lora_utils import make_adapter

# the tiny Llama's (in, out) per module: hidden 64, 4 heads / 2 KV heads of 16, MLP 128
SHAPES = {(i, m): s for i in range(2) for m, s in {
    "q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
    "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}.items()}


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    return make_adapter(tiny_model_dir("llama"), str(tmp_path_factory.mktemp("a8")), "a8")


def test_loads_with_scale_folded(adapter_dir):
    ad = load_peft_adapter("a8", 1, adapter_dir, SHAPES, max_rank=16)
    assert ad.rank == 8 and set(m for _, m in ad.weights) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    from safetensors.torch import load_file

    raw = load_file(adapter_dir + "/adapter_model.safetensors")
    b = next(v for k, v in raw.items() if "layers.0.self_attn.q_proj.lora_B" in k)
    torch.testing.assert_close(ad.weights[(0, "q_proj")][1], b * (16 / 8))


def test_rank_above_max_refused(adapter_dir):
    with pytest.raises(ConfigError, match="rank 8"):
        load_peft_adapter("a8", 1, adapter_dir, SHAPES, max_rank=4)


def test_missing_folder_and_files_refused(tmp_path, adapter_dir):
    with pytest.raises(ConfigError, match="no such folder"):
        load_peft_adapter("x", 1, str(tmp_path / "nope"), SHAPES, 16)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "adapter_config.json").write_text(open(adapter_dir + "/adapter_config.json").read())
    with pytest.raises(ConfigError, match="adapter_model.safetensors"):
        load_peft_adapter("x", 1, str(tmp_path / "cfg"), SHAPES, 16)
    with pytest.raises(ConfigError, match="adapter_config.json"):
        load_peft_adapter("x", 1, str(tmp_path), SHAPES, 16)


def test_base_model_mismatch_refused(adapter_dir):
    other = {k: (fin * 2, fout) for k, (fin, fout) in SHAPES.items()}
    with pytest.raises(ConfigError, match="another base model"):
        load_peft_adapter("a8", 1, adapter_dir, other, 16)
    one_layer = {k: v for k, v in SHAPES.items() if k[0] == 0}
    with pytest.raises(ConfigError, match="no layer 1"):
        load_peft_adapter("a8", 1, adapter_dir, one_layer, 16)


def test_wrong_shapes_and_dora_refused(tmp_path, adapter_dir):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(adapter_dir, bad)
    raw = load_file(str(bad / "adapter_model.safetensors"))
    key = next(k for k in raw if "lora_A" in k)
    raw[key] = raw[key][:, :10].contiguous()
    save_file(raw, str(bad / "adapter_model.safetensors"))
    with pytest.raises(ConfigError, match="needs A"):
        load_peft_adapter("bad", 1, str(bad), SHAPES, 16)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="DoRA"):
        load_peft_adapter("bad", 1, str(bad), SHAPES, 16)
