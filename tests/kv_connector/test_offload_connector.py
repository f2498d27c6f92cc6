"""The offload connector (kv_connector/offload/): a host-memory and disk tier under the prefix cache.

* **Token-exact**: greedy output with the host tier, the disk tier, and the disk tier of a *new*
  engine on the same directory (a restart) equals the output without a connector, while the stats
  show the tiers really served blocks (fewer prompt tokens computed).
* **Hostile disk**: truncated, bit-flipped, foreign-model and foreign-layout files are ignored
  (and deleted), an unwritable directory and a full disk degrade to reading only, the directory's
  size bound holds.
* **No leak**: after random arrivals, steps and aborts the device pool is whole, no host slot is
  pinned and no disk read is outstanding.
"""
from __future__ import annotations

import errno
import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncengine.config import EngineConfig
from asyncengine.engine_core.core import EngineCore
from asyncengine.core.request import Request
from asyncengine.errors import ConfigError
from asyncengine.kv_connector.offload.disk_store import HEADER_SIZE, DiskStore
from asyncengine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 8
VOCAB = 512


def make(tiny, **kw) -> EngineCore:
    model_dir, loaded = tiny
    kw.setdefault("num_kv_blocks", 14)
    return EngineCore(EngineConfig(model=model_dir, dtype="float32", block_size=BS, **kw), loaded)


def req(rid: str, prompt: list[int], max_tokens: int = 5) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(prompt), max_tokens=max_tokens,
                   sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens))


def run_all(core: EngineCore, reqs: list[Request], max_steps: int = 4000) -> dict[str, list[int]]:
    outs: dict[str, list[int]] = {r.request_id: [] for r in reqs if r.sampling_params.n == 1}
    for r in reqs:
        core.add_request(r)
    for _ in range(max_steps):
        if not core.has_unfinished():
            return outs
        for o in core.step():
            outs.setdefault(o.req_id, []).extend(o.new_token_ids)  # "<id>#<i>": a sample of n > 1
    raise AssertionError("engine did not finish")


def assert_whole(core: EngineCore) -> None:
    assert core.kv.num_free_blocks == core.num_blocks, "device blocks leaked"
    core.kv.pool.check_invariants()
    conn = core.scheduler.connector
    if conn is not None:
        conn.host.check_invariants()
        assert conn.host.num_pinned == 0, "host slots still pinned"
        assert not conn.has_pending_transfers()
        assert not conn._req_pins and not core.scheduler.kv_transfer.waiting_for_kv


def chat(core: EngineCore, num_convs: int = 6, turns: int = 3, seed: int = 0) -> dict[str, list[int]]:
    """Multi-turn conversations, all turns of a round at once: each prompt is the conversation so
    far (its earlier prompts and answers) plus a new user message. More conversations than the
    device cache holds, so their prefixes are evicted between rounds."""
    rng = random.Random(seed)
    hist = {c: [rng.randrange(3, VOCAB) for _ in range(21)] for c in range(num_convs)}
    outs: dict[str, list[int]] = {}
    for t in range(turns):
        reqs = [req(f"c{c}t{t}", hist[c]) for c in range(num_convs)]
        got = run_all(core, reqs)
        outs.update(got)
        for c in range(num_convs):
            hist[c] = hist[c] + got[f"c{c}t{t}"] + [rng.randrange(3, VOCAB) for _ in range(6)]
    assert_whole(core)
    return outs


def shared_prompts(seed: int = 1, n: int = 4) -> list[Request]:
    """A 40-token system prompt (5 blocks) shared by ``n`` questions."""
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB) for _ in range(40)]
    return [req(f"q{i}", system + [rng.randrange(3, VOCAB) for _ in range(3 + i)]) for i in range(n)]


def one_by_one(core: EngineCore, reqs: list[Request]) -> dict[str, list[int]]:
    outs: dict[str, list[int]] = {}
    for r in reqs:
        outs.update(run_all(core, [r]))
    return outs


@pytest.fixture(scope="module")
def baseline_chat(tiny):
    core = make(tiny)
    try:
        return chat(core), core.stats()["num_computed_prompt_tokens"]
    finally:
        core.shutdown()


@pytest.fixture(scope="module")
def baseline_shared(tiny):
    core = make(tiny)
    try:
        return one_by_one(core, shared_prompts())
    finally:
        core.shutdown()


# ---------------------------------------------------------------------------- token-exact


def test_off_by_default(tiny):
    core = make(tiny)
    try:
        assert core.scheduler.connector is None
        assert core.executor.worker.runner.kv_connector is None
        assert not any(k.startswith("kv_offload") for k in core.stats())
    finally:
        core.shutdown()


def test_host_tier_token_exact_with_hits(tiny, baseline_chat):
    want, computed_without = baseline_chat
    core = make(tiny, kv_offload_bytes=4 << 20)
    try:
        got = chat(core)
        s = core.stats()
    finally:
        core.shutdown()
    assert got == want
    assert s["num_kv_evictions"] > 0
    assert s["kv_offload_host_saved_bytes"] > 0
    assert s["kv_offload_host_hit_tokens"] > 0 and s["kv_offload_host_hit_tokens"] % BS == 0
    # (not exactly the hits less: loaded blocks change which device blocks get evicted later)
    assert s["num_computed_prompt_tokens"] < computed_without - s["kv_offload_host_hit_tokens"] // 2


def test_tiny_host_pool_evicts_and_stays_exact(tiny, baseline_chat):
    """A host pool of 3 blocks: constant LRU eviction in the host tier too."""
    want, _ = baseline_chat
    core = make(tiny)
    block = core.scheduler.connector  # None: measure a block's bytes from the runner instead
    assert block is None
    per_block = core.executor.worker.runner.kv_caches[0][0][:, 0].numel() * 4 * 2 * len(
        core.executor.worker.runner.kv_caches)
    core.shutdown()
    core = make(tiny, kv_offload_bytes=3 * per_block)
    try:
        assert core.scheduler.connector.host.num_slots == 3
        got = chat(core)
        assert core.scheduler.connector.host.num_evictions > 0
    finally:
        core.shutdown()
    assert got == want


def test_disk_tier_survives_restart(tiny, baseline_shared, tmp_path):
    want = baseline_shared
    first = make(tiny, kv_offload_dir=str(tmp_path))
    try:
        assert one_by_one(first, shared_prompts()) == want
    finally:
        first.shutdown()  # flushes the writer
    files = [f for _, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".kv")]
    assert len(files) >= 5  # the system prompt's 5 blocks at least
    second = make(tiny, kv_offload_dir=str(tmp_path))  # a restart: an empty device cache
    try:
        got = one_by_one(second, shared_prompts())
        s = second.stats()
        assert_whole(second)
    finally:
        second.shutdown()
    assert got == want
    assert s["kv_offload_disk_hit_tokens"] >= 40
    assert s["kv_offload_disk_read_bytes"] > 0 and s["kv_offload_disk_bad_blocks"] == 0
    # the first request loaded the system prompt from disk instead of computing it
    assert s["num_computed_prompt_tokens"] < sum(r.num_prompt_tokens for r in shared_prompts()) - 40


def test_int8_kv_cache_restart_exact_and_apart_from_16_bit(tiny, tmp_path):
    """kv_cache_dtype="int8": blocks go to disk with their scales and come back exact; a 16-bit
    engine on the same directory finds none of them (the fingerprint carries the KV dtype)."""
    first = make(tiny, kv_offload_dir=str(tmp_path), kv_cache_dtype="int8")
    try:
        want = one_by_one(first, shared_prompts())
    finally:
        first.shutdown()
    second = make(tiny, kv_offload_dir=str(tmp_path), kv_cache_dtype="int8")
    try:
        got = one_by_one(second, shared_prompts())
        s = second.stats()
        assert_whole(second)
    finally:
        second.shutdown()
    assert got == want and s["kv_offload_disk_hit_tokens"] >= 40
    other = make(tiny, kv_offload_dir=str(tmp_path))
    try:
        one_by_one(other, shared_prompts())
        assert other.stats()["kv_offload_disk_hit_tokens"] == 0
    finally:
        other.shutdown()


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_other_architectures_restart_exact(tiny_model_dir, arch, tmp_path):
    from asyncengine.models.loader import load_model

    model_dir = tiny_model_dir(arch)
    tiny = (model_dir, load_model(EngineConfig(model=model_dir, dtype="float32")))
    want = one_by_one(make(tiny), shared_prompts(seed=7))
    with_disk = make(tiny, kv_offload_dir=str(tmp_path), kv_offload_bytes=1 << 20)
    assert one_by_one(with_disk, shared_prompts(seed=7)) == want
    with_disk.shutdown()
    again = make(tiny, kv_offload_dir=str(tmp_path), kv_offload_bytes=1 << 20)
    try:
        assert one_by_one(again, shared_prompts(seed=7)) == want
        assert again.stats()["kv_offload_disk_hit_tokens"] >= 40
    finally:
        again.shutdown()


def count_prefill_chunks(core: EngineCore) -> dict[str, int]:
    """Records, per request, the steps that schedule it more than one token (its prefill chunks,
    and a recompute's after a preemption): wraps the core's scheduler."""
    chunks: dict[str, int] = {}
    schedule = core.scheduler.schedule

    def counting(*a, **kw):
        out = schedule(*a, **kw)
        for rid, n in out.num_scheduled_tokens.items():
            if n > 1:
                chunks[rid] = chunks.get(rid, 0) + 1
        return out

    core.scheduler.schedule = counting
    return chunks


def test_chunked_prefill_and_preemption_exact(tiny, tmp_path):
    """A small step budget (prompts of 21-32 tokens in chunks of 16) and a device cache of 9
    blocks, which 4 growing conversations outgrow: preemption in all three engines, chunks in the
    two that compute their prompts (the restart loads them from disk). With 9 blocks the host tier
    evicts a block inside a prefix whose later blocks it keeps: staging from disk stops there."""
    opts = dict(num_kv_blocks=9, max_num_batched_tokens=16)
    want = None
    for name in ("baseline", "first", "restart"):
        core = make(tiny, **opts) if name == "baseline" else make(
            tiny, kv_offload_dir=str(tmp_path), kv_offload_bytes=1 << 20, **opts)
        chunks = count_prefill_chunks(core)
        try:
            got = chat(core, num_convs=4, turns=2, seed=3)
            s = core.stats()
        finally:
            core.shutdown()
        want = got if want is None else want
        assert got == want, name
        assert s["num_preemptions"] > 0, f"{name}: nothing was preempted"
        if name == "restart":
            assert s["kv_offload_disk_hit_tokens"] > 0
        else:
            assert max(chunks.values()) > 1, f"{name}: no prompt was prefilled in chunks"


def test_parallel_samples_and_ngram_speculation_exact(tiny, tmp_path):
    """n > 1 (samples share the prompt's blocks) and n-gram drafts, over disk and host hits."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}

    pattern = random.Random(3).sample(range(3, VOCAB), 8)

    def reqs():  # a repetitive 40-token system prompt: the n-gram proposer finds its suffixes
        return [Request(request_id=f"q{i}", prompt_token_ids=pattern * 5 + pattern[:3 + i], max_tokens=6,
                        sampling_params=SamplingParams(temperature=0.0, max_tokens=6, n=2)) for i in range(4)]

    def run(core):
        got = one_by_one(core, reqs())
        assert_whole(core)
        return got, core.stats()

    want, _ = run(make(tiny, speculative_config=spec))
    assert set(want) == {f"q{i}#{j}" for i in range(4) for j in range(2)}
    first = make(tiny, speculative_config=spec, kv_offload_dir=str(tmp_path), kv_offload_bytes=1 << 20)
    assert run(first)[0] == want
    first.shutdown()
    again = make(tiny, speculative_config=spec, kv_offload_dir=str(tmp_path), kv_offload_bytes=1 << 20)
    try:
        got, s = run(again)
    finally:
        again.shutdown()
    assert got == want
    assert s["kv_offload_disk_hit_tokens"] >= 40 and s["spec_num_drafts"] > 0


# ---------------------------------------------------------------------------- hostile disk


def _block_files(root) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".kv"))


def test_hostile_files_are_ignored(tiny, baseline_shared, tmp_path):
    first = make(tiny, kv_offload_dir=str(tmp_path))
    one_by_one(first, shared_prompts())
    first.shutdown()
    files = _block_files(tmp_path)
    assert len(files) >= 5
    # damage the first 4 files of the cache, four ways
    with open(files[0], "r+b") as f:  # truncated (a crash mid-write)
        f.truncate(HEADER_SIZE + 100)
    with open(files[1], "r+b") as f:  # one flipped bit in the payload
        f.seek(HEADER_SIZE + 1000)
        b = f.read(1)
        f.seek(HEADER_SIZE + 1000)
        f.write(bytes([b[0] ^ 0x10]))
    with open(files[2], "r+b") as f:  # another model's block under our name
        f.seek(8)
        f.write(b"\xff" * 32)
    data = open(files[3], "rb").read()  # another layout: the payload is 2x as long
    store_fp = data[8:40]
    h = bytes.fromhex(os.path.basename(files[3])[:64])
    payload = data[HEADER_SIZE:] * 2
    foreign = DiskStore(str(tmp_path / "scratch"), store_fp, len(payload), 1 << 30)
    foreign.write(h, bytearray(payload))
    os.replace(foreign.path(h), files[3])

    second = make(tiny, kv_offload_dir=str(tmp_path))
    try:
        got = one_by_one(second, shared_prompts())
        s = second.stats()
        assert_whole(second)
    finally:
        second.shutdown()
    assert got == baseline_shared
    assert s["kv_offload_disk_bad_blocks"] >= 1 and s["kv_offload_disk_bad_files"] >= 1
    for p in files[:4]:  # a bad file is deleted once found (or rewritten whole by the recompute)
        if os.path.exists(p):
            DiskStore(str(tmp_path), store_fp, len(data) - HEADER_SIZE, 1 << 30).read_into(
                bytes.fromhex(os.path.basename(p)[:64]), bytearray(len(data) - HEADER_SIZE))


def test_one_flipped_bit_alone_is_caught_end_to_end(tiny, baseline_shared, tmp_path):
    """The CRC by itself: one bit flipped in each block file's payload (header, length and
    fingerprint intact) is found by a restarted engine, which recomputes and stays exact."""
    first = make(tiny, kv_offload_dir=str(tmp_path))
    one_by_one(first, shared_prompts())
    first.shutdown()
    files = _block_files(tmp_path)
    for path in files:  # every file: whichever the restart reads first is damaged
        with open(path, "r+b") as f:
            f.seek(HEADER_SIZE + 7)
            b = f.read(1)
            f.seek(HEADER_SIZE + 7)
            f.write(bytes([b[0] ^ 0x04]))
    second = make(tiny, kv_offload_dir=str(tmp_path))
    try:
        got = one_by_one(second, shared_prompts())
        s = second.stats()
        assert_whole(second)
    finally:
        second.shutdown()
    assert s["kv_offload_disk_bad_blocks"] >= 1
    assert got == baseline_shared


def test_every_damaged_file_is_rejected_by_the_store(tmp_path):
    """The store alone: each kind of damage raises BadBlockFile and deletes the file."""
    from asyncengine.kv_connector.offload.disk_store import BadBlockFile

    fp, n = b"f" * 32, 4096
    store = DiskStore(str(tmp_path), fp, n, 1 << 30)
    rng = random.Random(0)
    payload = bytearray(rng.randbytes(n))
    damages = {
        "truncated": lambda d: d[:HEADER_SIZE + 10],
        "empty": lambda d: b"",
        "bit flip": lambda d: d[:HEADER_SIZE + 5] + bytes([d[HEADER_SIZE + 5] ^ 1]) + d[HEADER_SIZE + 6:],
        "foreign model": lambda d: d[:8] + b"g" * 32 + d[40:],
        "trailing bytes": lambda d: d + b"x",
        "bad magic": lambda d: b"NOPE" + d[4:],
    }
    for i, (name, damage) in enumerate(damages.items()):
        h = bytes([i]) * 32
        assert store.write(h, payload)
        out = bytearray(n)
        store.read_into(h, out)
        assert out == payload
        p = store.path(h)
        good = open(p, "rb").read()
        open(p, "wb").write(damage(good))
        with pytest.raises(BadBlockFile):
            store.read_into(h, bytearray(n))
        assert not os.path.exists(p), name
    with pytest.raises(BadBlockFile):
        store.read_into(b"\x99" * 32, bytearray(n))  # missing


def test_size_bound_evicts_least_recently_used(tmp_path):
    n = 1000
    store = DiskStore(str(tmp_path), b"f" * 32, n, max_bytes=10 * (n + HEADER_SIZE))
    hashes = [bytes([i]) * 32 for i in range(30)]
    for i, h in enumerate(hashes):
        store.write(h, bytearray(n))
        os.utime(store.path(h), (1000 + i, 1000 + i))  # a distinct age per file
        if i == 5:
            os.utime(store.path(hashes[0]), (5000, 5000))  # block 0 was just used
    total = sum(os.path.getsize(p) for p in _block_files(tmp_path))
    assert total <= 10 * (n + HEADER_SIZE)
    assert store.exists(hashes[-1])
    assert not store.exists(hashes[1])  # old and unused: gone first
    assert store.exists(hashes[0])  # old but used since: kept
    # a temporary file a dead writer left: deleted once old, kept while it may still be written
    old, fresh = os.path.join(store.dir, "dead.1.tmp"), os.path.join(store.dir, "live.2.tmp")
    for p in (old, fresh):
        open(p, "wb").write(b"partial")
    os.utime(old, (1000, 1000))
    store.enforce_bound()
    assert not os.path.exists(old) and os.path.exists(fresh)


def test_unwritable_dir_only_reads(tiny, baseline_shared, tmp_path, caplog):
    """A directory the engine cannot write (here: its folder is a file; as root, permissions would
    not stop us): a warning, no writes, output unchanged, and blocks already there still serve."""
    first = make(tiny, kv_offload_dir=str(tmp_path / "ok"))
    one_by_one(first, shared_prompts())
    first.shutdown()
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    fpdir = first.scheduler.connector.disk.store.dir.replace(str(tmp_path / "ok"), str(blocked))
    open(fpdir, "w").close()
    with caplog.at_level("WARNING"):
        core = make(tiny, kv_offload_dir=str(blocked))
    try:
        assert "not writable" in caplog.text
        assert one_by_one(core, shared_prompts()) == baseline_shared
        assert core.stats().get("kv_offload_disk_written_bytes", 0) == 0
    finally:
        core.shutdown()


def test_full_disk_stops_writing(tiny, baseline_shared, tmp_path, caplog, monkeypatch):
    def full(self, h, payload):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskStore, "write", full)
    core = make(tiny, kv_offload_dir=str(tmp_path))
    try:
        with caplog.at_level("WARNING"):
            assert one_by_one(core, shared_prompts()) == baseline_shared
            core.shutdown()
        s = core.stats()
        assert s["kv_offload_disk_write_errors"] == 1  # one failure, then the tier stops writing
        assert "disk is full" in caplog.text
        assert not core.executor.worker.runner.kv_connector.writable
    finally:
        core.shutdown()


def test_shared_directory_between_engines(tiny, baseline_shared, tmp_path):
    """Two engines on one directory at once: what one writes, the other reads."""
    a = make(tiny, kv_offload_dir=str(tmp_path))
    b = make(tiny, kv_offload_dir=str(tmp_path))
    try:
        assert one_by_one(a, shared_prompts()[:1]) == {"q0": baseline_shared["q0"]}
        a.executor.worker.runner.kv_connector._writes.join()  # a's writes are on disk
        got = one_by_one(b, shared_prompts()[1:])
        assert got == {k: v for k, v in baseline_shared.items() if k != "q0"}
        assert b.stats()["kv_offload_disk_hit_tokens"] >= 40
    finally:
        a.shutdown()
        b.shutdown()


def test_config_refuses_what_it_cannot_do(tiny_llama_dir):
    with pytest.raises(ConfigError, match="prefix"):
        EngineConfig(model=tiny_llama_dir, kv_offload_bytes=1 << 20, enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="kv_offload_bytes"):
        EngineConfig(model=tiny_llama_dir, kv_offload_bytes=0)
    with pytest.raises(ConfigError, match="tensor_parallel"):
        EngineConfig(model=tiny_llama_dir, kv_offload_bytes=1 << 20, tensor_parallel_size=2)


# ---------------------------------------------------------------------------- no leak


def test_abort_while_waiting_for_disk_read(tiny, tmp_path):
    first = make(tiny, kv_offload_dir=str(tmp_path))
    one_by_one(first, shared_prompts()[:1])
    first.shutdown()
    core = make(tiny, kv_offload_dir=str(tmp_path))
    try:
        core.add_request(shared_prompts()[1])
        so = core.schedule()  # the lookup finds the system prompt on disk: a read starts, the request waits
        assert list(core.scheduler.kv_transfer.waiting_for_kv) == ["q1"] and core.scheduler.connector.has_pending_transfers()
        assert so.kv_connector_metadata.stage_from_disk and not so.num_scheduled_tokens
        assert core.kv.num_free_blocks == core.num_blocks  # waiting for a read holds no device block
        core.abort_requests(["q1"])
        assert not core.scheduler.kv_transfer.waiting_for_kv
        core.update(so, core.execute(so))
        for _ in range(1000):
            if not core.has_unfinished():
                break
            core.step()
        assert_whole(core)
        assert len(core.scheduler.connector.host) == 5  # the read landed: the host tier has the 5 blocks
    finally:
        core.shutdown()



@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "step", "step", "abort"]), st.integers(0, 7)),
                    min_size=5, max_size=40))
def test_random_aborts_leave_everything_whole(tiny, tmp_path_factory, ops):
    """Random arrivals (prompts sharing prefixes), steps and aborts, with both tiers on, starting
    from a directory a previous engine filled (so disk reads are in flight when aborts land)."""
    d = str(tmp_path_factory.mktemp("abort"))
    seed_core = make(tiny, kv_offload_dir=d, kv_offload_bytes=1 << 20, num_kv_blocks=10)
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(24)] for _ in range(3)]
    run_all(seed_core, [req(f"s{i}", p + [5, 6]) for i, p in enumerate(prefixes)])
    seed_core.shutdown()
    core = make(tiny, kv_offload_dir=d, kv_offload_bytes=1 << 20, num_kv_blocks=10)
    try:
        live: list[str] = []
        for i, (op, x) in enumerate(ops):
            if op == "add":
                rid = f"r{i}"
                core.add_request(req(rid, prefixes[x % 3] + [7 + x] * (x + 1), max_tokens=1 + x))
                live.append(rid)
            elif op == "step":
                core.step()
            elif live:
                core.abort_requests([live.pop(x % len(live))])
        core.abort_requests(live)
        for _ in range(2000):
            if not core.has_unfinished():
                break
            core.step()
        assert_whole(core)
    finally:
        core.shutdown()


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_host_pool_copies_both_layouts(backend):
    """Device -> slot -> device and device -> file payload, for the head-major (cpu, torch) and the
    block-major (triton) cache layouts, on CPU tensors."""
    import torch

    from asyncengine.kv_connector.offload.host_pool import HostPool, block_dim

    g = torch.Generator().manual_seed(0)
    nb, heads, bs, hd, layers = 6, 2, 4, 3, 2
    shape = (nb, bs, heads, hd) if backend == "triton" else (heads, nb, bs, hd)
    caches = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(layers)]
    before = [(k.clone(), v.clone()) for k, v in caches]
    d = block_dim(backend)
    pool = HostPool(caches, d, num_slots=4)
    assert pool.block_nbytes == 2 * layers * heads * bs * hd * 4
    pool.save([(1, 0), (4, 3)])
    payload = pool.blocks_bytes([4])[0]
    assert torch.equal(payload, pool.slots[3].view(torch.uint8).reshape(-1))
    pool.load([(3, 0), (0, 5)])  # block 4's content into block 0, block 1's into block 5
    for (k, v), (k0, v0) in zip(caches, before):
        for t, t0 in ((k, k0), (v, v0)):
            assert torch.equal(t.select(d, 0), t0.select(d, 4))
            assert torch.equal(t.select(d, 5), t0.select(d, 1))
            assert torch.equal(t.select(d, 2), t0.select(d, 2))  # untouched
