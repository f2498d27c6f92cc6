"""P/D and KV offload on the same cores (kv_connector/multi.py): token-exact against one colocated
core, the decode core's prompts reaching its host/disk tier, and a soak of random aborts at every
phase after which both pools are whole, no lease or host pin is held, no transfer file is left and
each offload directory is within its bound."""
from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import pytest

from test_pd_connector import drain, drive_with_random_aborts, files, make, pd_run, prompts, req, whole

pytestmark = pytest.mark.usefixtures("one_torch_thread")
DIR_BOUND = 64 << 10


def offload(path, host_bytes=64 << 10):
    return dict(kv_offload_bytes=host_bytes, kv_offload_dir=str(path), kv_offload_dir_bytes=DIR_BOUND)


def dir_bytes(d) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)


def settled(core):
    s = core.stats()
    assert s["kv_leases_held"] == 0 and s["kv_blocks_held_for_transfer"] == 0, s
    assert s["kv_offload_pinned_slots"] == 0 and s["kv_offload_pending_stages"] == 0, s


def test_token_exact_and_offloaded(tiny, tmp_path):
    ps = prompts(seed=21)
    colo = make(tiny)
    want = {}
    for i, p in enumerate(ps):
        colo.add_request(req(f"r{i}", p, 6))
    drain(colo, want)
    colo.shutdown()
    x = str(tmp_path / "xfer")
    p_core = make(tiny, kv_role="prefill", kv_transfer_dir=x, **offload(tmp_path / "p_off"))
    d_core = make(tiny, kv_role="decode", kv_transfer_dir=x, num_kv_blocks=12, **offload(tmp_path / "d_off"))
    try:
        assert pd_run(p_core, d_core, ps) == want
        s = d_core.stats()
        assert s["kv_transfer_imported_requests"] == len(ps)
        # each side's worker counters reach its own scheduler side only
        assert s["kv_transfer_read_bytes"] > 0, s
        assert not [k for k in s if k.startswith(("kv_offload_transfer", "kv_disk", "kv_host"))], s
        # the same prompts again, straight to the decode core (its small cache evicted the first ones)
        again = {}
        for i, p in enumerate(ps):
            d_core.add_request(req(f"r{i}", p, 6))
            drain(d_core, again)
        assert again == want
        assert d_core.stats()["kv_offload_host_hit_tokens"] > 0  # evicted by later prompts, back from host
        settled(p_core)
        settled(d_core)
        whole(p_core)
        whole(d_core)
        assert files(x) == []
    finally:
        p_core.shutdown()
        d_core.shutdown()
    assert 0 < dir_bytes(tmp_path / "d_off") <= DIR_BOUND  # the decode core's imported prompts persisted


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["new", "p_step", "d_step", "abort"]), st.integers(0, 9)),
                    min_size=5, max_size=40))
def test_random_aborts_with_offload_leave_everything_whole(tiny, tmp_path_factory, ops):
    """As test_pd_connector's soak, with a small host tier and a bounded disk tier on both cores
    (evictions, host hits and disk writes happen along the way)."""
    root = tmp_path_factory.mktemp("pdoff")
    x = str(root / "xfer")
    p_core = make(tiny, kv_role="prefill", kv_transfer_dir=x, num_kv_blocks=12, max_num_batched_tokens=24,
                  **offload(root / "p_off", 16 << 10))
    d_core = make(tiny, kv_role="decode", kv_transfer_dir=x, num_kv_blocks=6, **offload(root / "d_off", 16 << 10))
    try:
        drive_with_random_aborts(p_core, d_core, x, ops)
        for core in (p_core, d_core):
            whole(core)
            settled(core)
        assert files(x) == []
    finally:
        p_core.shutdown()
        d_core.shutdown()
    for d in ("p_off", "d_off"):  # pending writes flushed by the shutdown
        assert dir_bytes(root / d) <= DIR_BOUND
