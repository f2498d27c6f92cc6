"""Every EngineConfig field has exactly one home, and the views say what the flat config says."""
import dataclasses

import msgspec
import pytest

from asyncengine.config import EngineConfig
from asyncengine.config.sub_configs import (ENGINE_ONLY, OTHER_HOMES, VIEWS, CacheConfig, KVTransferConfig,
                                            SchedulerConfig, home_of)

HOW_TO_ADD = (
    "Give it one home in asyncengine/config/sub_configs.py: add `{name}: <type>` to the view of the part "
    "that reads it (ModelConfig: loading/model runner; CacheConfig: KV-cache size/prefix caching; "
    "SchedulerConfig: batching/order; ParallelConfig: ranks/executors/cores; KVTransferConfig: offload "
    "and P/D), with the EngineConfig field's own name; or one line in OTHER_HOMES if it is parsed into a "
    "config object of its own (as speculative_config); or, if only the front end / engine process reads "
    "it, one line in ENGINE_ONLY saying why."
)


def test_every_field_has_exactly_one_home():
    problems = []
    for field in dataclasses.fields(EngineConfig):
        homes = home_of(field.name)
        if len(homes) != 1:
            where = f"has {len(homes)} homes ({'; '.join(homes)})" if homes else "has no home"
            problems.append(f"EngineConfig.{field.name} {where}. " + HOW_TO_ADD.format(name=field.name))
    assert not problems, "\n".join(problems)


def test_every_home_names_a_real_field():
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    homed = set(ENGINE_ONLY) | set(OTHER_HOMES)
    for view in VIEWS.values():
        homed |= set(view.__struct_fields__)
    assert homed <= names, f"not EngineConfig fields (renamed or removed?): {sorted(homed - names)}"


def test_views_copy_the_flat_fields_once():
    config = EngineConfig(block_size=32, max_num_seqs=3, policy="priority", kv_offload_bytes=2**20,
                          enable_prefix_caching=True)
    assert config.cache_config == CacheConfig(
        block_size=32, num_kv_blocks=None, kv_cache_bytes=None, kv_cache_memory_fraction=0.25,
        gpu_memory_utilization=0.9, enable_prefix_caching=True, kv_cache_dtype="auto")
    assert config.scheduler_config.max_num_seqs == 3 and config.scheduler_config.policy == "priority"
    assert config.parallel_config.distributed_executor_backend == "uni"  # resolved, not None
    assert config.parallel_config.world_size == 1
    assert config.kv_transfer_config.offload_enabled and config.kv_transfer_config.host_offload_bytes == 2**20
    assert config.model_config is config.model_config  # built once
    replaced = dataclasses.replace(config, block_size=64)
    assert replaced.cache_config.block_size == 64 and config.cache_config.block_size == 32


def test_views_are_read_only():
    view = EngineConfig().scheduler_config
    assert isinstance(view, SchedulerConfig)
    with pytest.raises(AttributeError):
        view.max_num_seqs = 1


def test_host_pool_default_when_only_a_directory(tmp_path):
    view = EngineConfig(kv_offload_dir=str(tmp_path)).kv_transfer_config
    assert isinstance(view, KVTransferConfig) and view.host_offload_bytes == 512 * 2**20


def test_the_model_view_resolves_the_machine_once_and_keeps_it_when_pickled():
    """The loader and the runner read the device, dtype and backend from the model's view alone;
    EngineConfig's own properties are that view's, and a pickled view (another process) keeps them."""
    import pickle

    import torch

    config = EngineConfig(model="/models/hf-folder", dtype="float32", device="cpu", attention_backend="torch")
    view = config.model_config
    assert (view.torch_device, view.torch_dtype) == (torch.device("cpu"), torch.float32)
    assert view.dtype_reason == "asked for" and view.attention_backend_name == "torch"
    assert (config.torch_device, config.torch_dtype, config.attention_backend_name) == \
        (view.torch_device, view.torch_dtype, view.attention_backend_name)
    copy = pickle.loads(pickle.dumps(config)).model_config
    assert copy == view and copy.__dict__ == view.__dict__
    assert not msgspec.structs.replace(view, model="/models/other").__dict__  # a changed view resolves afresh
