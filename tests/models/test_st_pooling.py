"""modules.json / 1_Pooling/config.json read as sentence-transformers means them; what we do not
run is refused by name."""
from __future__ import annotations

import json

import pytest

from asyncengine.errors import ModelLoadError
from asyncengine.layers.pooler import PoolingSpec
from asyncengine.models.st_pooling import read_st_pooling

T, P, N = ("sentence_transformers.models." + k for k in ("Transformer", "Pooling", "Normalize"))


def _write(root, modules, pooling_cfg=None, pool_dir="1_Pooling"):
    (root / "modules.json").write_text(json.dumps(modules))
    if pooling_cfg is not None:
        (root / pool_dir).mkdir()
        (root / pool_dir / "config.json").write_text(json.dumps(pooling_cfg))


def test_no_modules_json_means_no_opinion(tmp_path):
    assert read_st_pooling(tmp_path) is None


@pytest.mark.parametrize("flag,pooling", [("pooling_mode_cls_token", "cls"), ("pooling_mode_mean_tokens", "mean"),
                                          ("pooling_mode_lasttoken", "last")])
def test_pooling_mode_and_normalize(tmp_path, flag, pooling):
    _write(tmp_path, [{"idx": 0, "path": "", "type": T}, {"idx": 1, "path": "pool", "type": P},
                      {"idx": 2, "path": "2_Normalize", "type": N}],
           {flag: True, "pooling_mode_max_tokens": False}, pool_dir="pool")
    assert read_st_pooling(tmp_path) == PoolingSpec(pooling, normalize=True)


def test_without_normalize_the_embedding_is_raw(tmp_path):
    _write(tmp_path, [{"idx": 0, "path": "", "type": T}, {"idx": 1, "path": "1_Pooling", "type": P}],
           {"pooling_mode_mean_tokens": True})
    assert read_st_pooling(tmp_path) == PoolingSpec("mean", normalize=False)


@pytest.mark.parametrize("modules,cfg,msg", [
    ([{"idx": 1, "path": "1_Pooling", "type": P}], {"pooling_mode_max_tokens": True}, "not supported"),
    ([{"idx": 1, "path": "1_Pooling", "type": P}], {"pooling_mode_cls_token": True,
                                                    "pooling_mode_mean_tokens": True}, "exactly one"),
    ([{"idx": 1, "path": "1_Pooling", "type": P}, {"idx": 2, "path": "2_Dense",
                                                   "type": "sentence_transformers.models.Dense"}],
     {"pooling_mode_cls_token": True}, "Dense"),
    ([{"idx": 0, "path": "", "type": T}], None, "has no"),
    ([{"idx": 1, "path": "1_Pooling", "type": P}], None, "is missing"),
])
def test_what_we_do_not_run_is_refused(tmp_path, modules, cfg, msg):
    _write(tmp_path, modules, cfg)
    with pytest.raises(ModelLoadError, match=msg):
        read_st_pooling(tmp_path)
