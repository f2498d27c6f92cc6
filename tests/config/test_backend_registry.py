"""The attention backends are listed once (attention/registry.py): the config's type and check,
the CLI's choices and the selector all read that table, and the CUDA-graph gate reads a capability
flag, not a backend's name."""
from __future__ import annotations

import typing

import pytest

from asyncengine.attention.backend import AttentionBackend
from asyncengine.config.attention import (BACKEND_CHOICES, BACKENDS, AttentionBackendName, backend_info,
                                            check_backend_name)
from asyncengine.attention.selector import get_backend
from asyncengine.cli.args import build_parser
from asyncengine.config import EngineConfig
from asyncengine.errors import ConfigError


def test_config_cli_and_type_read_the_table():
    assert BACKEND_CHOICES == ("auto", *BACKENDS)
    assert typing.get_args(AttentionBackendName) == BACKEND_CHOICES
    for name in BACKEND_CHOICES:  # the CLI offers exactly the table's names
        assert build_parser().parse_args(["chat", "--attention-backend", name]).attention_backend == name
    with pytest.raises(SystemExit):
        build_parser().parse_args(["chat", "--attention-backend", "flash"])
    for name in BACKEND_CHOICES:
        assert EngineConfig(device="cpu", attention_backend=name).attention_backend == name
    with pytest.raises(ConfigError, match="attention_backend must be one of auto, torch, cpu, triton"):
        EngineConfig(attention_backend="flash")
    with pytest.raises(ConfigError):
        check_backend_name("TORCH")


def test_every_row_names_its_class():
    for name, info in BACKENDS.items():
        module, _, cls = info.path.partition(":")
        backend_cls = getattr(__import__(module, fromlist=[cls]), cls)
        assert issubclass(backend_cls, AttentionBackend) and backend_cls.name == name
        assert set(info.devices) <= {"cpu", "cuda"}
    with pytest.raises(ConfigError, match="unknown attention backend"):
        backend_info("auto")  # resolve it first


def test_selector_builds_from_the_table():
    import torch

    b = get_backend("torch", num_heads=4, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=8,
                    dtype=torch.float32, device=torch.device("cpu"))
    assert type(b).__name__ == "TorchBackend" and b.name == "torch"


def test_cuda_graphs_is_a_capability():
    assert [n for n, info in BACKENDS.items() if info.cuda_graphs] == ["triton"]
    import inspect

    from asyncengine.worker import cuda_graphs

    src = inspect.getsource(cuda_graphs)  # the runner's gate for its decode graphs
    assert "backend_info(runner.attn_backend.name).cuda_graphs" in src and '.name == "triton"' not in src
