"""The P/D connector's TCP transport (kv_connector/pd/transport.py, tcp_server.py): the server
hands a transfer over once, deletes and sweeps it; a short or corrupt transfer is refused (never
loaded: the decode core computes the prompt itself, token-exact); two engine cores in this process
and a PDEngine with its cores in processes, over TCP, give the tokens of one colocated core, and
aborts leave both pools whole and nothing held by the prefill core's server."""
from __future__ import annotations

import asyncio
import socket
import threading
import zlib

import msgspec
import pytest
from test_pd_connector import colocated, drain, make, prompts
from test_pd_connector import req as pd_req
from test_pd_engine import idle

from asyncengine import AsyncLLMEngine, EngineConfig, SamplingParams
from asyncengine.kv_connector.pd import tcp_server
from asyncengine.kv_connector.pd import transfer_file as tf
from asyncengine.kv_connector.pd.transport import TcpTransport

pytestmark = pytest.mark.usefixtures("one_torch_thread")
HANG_GUARD_S = 180.0  # only a guard against a hang


def blob(nblocks: int = 2, nbytes: int = 64, tokens: int = 12) -> bytes:
    h = tf.Header(b"f" * 32, tf.prompt_digest(list(range(tokens))), tokens, nblocks, nbytes)
    return h.pack() + bytes(range(256)) * (nblocks * nbytes // 256) + bytes(nblocks * nbytes % 256)


@pytest.fixture
def server():
    s = tcp_server.TransferServer("127.0.0.1:0", lease_s=30.0)
    yield s
    s.close()


def test_a_transfer_is_taken_once_deleted_and_swept(server):
    data = blob()
    server.put("a", data)
    server.put("b", data)
    server.put("c", data)
    assert tcp_server.count(server.address) == 3
    assert tcp_server.take(server.address, "a") == data
    assert tcp_server.take(server.address, "a") is None  # handed over: the decode core owns it now
    assert tcp_server.delete(server.address, "b") and not tcp_server.delete(server.address, "b")
    server.lease_s = 0.0
    server.put("d", data)
    assert server.sweep() == 1 and tcp_server.count(server.address) == 1  # d: past its lease; c: within


def test_a_corrupt_transfer_is_refused(server):
    data = blob()
    server.put("a", data)
    stored, crc, deadline = server._store["a"]
    flipped = bytearray(stored)
    flipped[-1] ^= 0x40  # a bit flipped on the way
    server._store["a"] = (bytes(flipped), crc, deadline)
    with pytest.raises(tcp_server.BadTransfer, match="CRC"):
        tcp_server.take(server.address, "a")


def short_server(data: bytes) -> tuple[str, threading.Thread]:
    """A peer that announces ``data`` whole and sends half of it, then hangs up."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def run():
        conn, _ = lsock.accept()
        with conn:
            tcp_server._recv_msg(conn, tcp_server.TransferOp)
            tcp_server._send_msg(conn, tcp_server.TransferReply(found=True, size=len(data), crc32=zlib.crc32(data)))
            conn.sendall(data[:len(data) // 2])
        lsock.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return f"127.0.0.1:{lsock.getsockname()[1]}", t


def test_a_short_transfer_is_refused():
    address, t = short_server(blob())
    with pytest.raises(tcp_server.BadTransfer, match="ended early"):
        tcp_server.take(address, "a")
    t.join(HANG_GUARD_S)


def test_claim_stages_a_local_file_and_checks_the_header(server, tmp_path):
    data = blob()
    server.put(tf.request_key("r1"), data)
    server.put(tf.request_key("r2"), data)
    t = TcpTransport(str(tmp_path))
    assert t.claim("r1", server.address, accept=lambda h: False) is None  # refused: not loaded
    path, h = t.claim("r2", server.address, accept=lambda h: True)
    assert h.num_tokens == 12 and open(path, "rb").read() == data
    assert t.claim("r2", server.address, accept=lambda h: True) is None
    assert t.claim("r3", None, accept=lambda h: True) is None  # no source: nothing to pull


# ---------------------------------------------------------------- two engine cores in this process


def req(rid, prompt, max_tokens, n=1, source=None):
    """test_pd_connector's request, naming the prefill core it pulls its KV from."""
    r = pd_req(rid, prompt, max_tokens, n=n)
    r.kv_transfer_params = {"source": source} if source else None
    return r


@pytest.mark.parametrize("regime", ["plain", "chunked", "n2"])
def test_token_exact_over_tcp(tiny, tmp_path, regime):
    opts = {"chunked": dict(max_num_batched_tokens=16)}.get(regime, {})
    n = 2 if regime == "n2" else 1
    ps = prompts(seed=len(regime), k=4)
    want = colocated(tiny, ps, n=n, **opts)
    tcp = dict(kv_transfer_transport="tcp", kv_transfer_dir=str(tmp_path), **opts)
    p_core = make(tiny, kv_role="prefill", kv_transfer_address="127.0.0.1:0", **tcp)
    d_core = make(tiny, kv_role="decode", **tcp)
    try:
        server = p_core.executor.worker.runner.kv_connector.transport.server
        assert p_core.kv_transfer_address == server.address != "127.0.0.1:0"  # as bound: what front ends are told
        got = {}
        for i, p in enumerate(ps):
            p_core.add_request(req(f"r{i}", p, 1))
            drain(p_core)
            assert len(server) == 1  # held in the prefill core's memory until pulled
            d_core.add_request(req(f"r{i}", p, 6, n=n, source=p_core.kv_transfer_address))
            drain(d_core, got)
            assert len(server) == 0
        assert got == want
        s = d_core.stats()
        assert s["kv_transfer_imported_requests"] == len(ps) and s["kv_transfer_rejected_files"] == 0
        assert s["kv_transfer_imported_tokens"] == sum(len(p) - 1 for p in ps)
        for core in (p_core, d_core):
            assert core.kv.num_free_blocks == core.num_blocks
    finally:
        p_core.shutdown()
        d_core.shutdown()


@pytest.mark.parametrize("fault", ["corrupt", "short"])
def test_a_bad_transfer_is_computed_instead(tiny, tmp_path, fault):
    """What arrives short or fails its CRC is never loaded: the decode core computes the prompt
    itself (the same tokens) and counts the transfer as rejected."""
    ps = prompts(seed=3, k=1)
    want = colocated(tiny, ps)
    tcp = dict(kv_transfer_transport="tcp", kv_transfer_dir=str(tmp_path))
    p_core = make(tiny, kv_role="prefill", kv_transfer_address="127.0.0.1:0", **tcp)
    d_core = make(tiny, kv_role="decode", **tcp)
    try:
        server = p_core.executor.worker.runner.kv_connector.transport.server
        p_core.add_request(req("r0", ps[0], 1))
        drain(p_core)
        key = tf.request_key("r0")
        data, crc, deadline = server._store[key]
        t = None
        if fault == "corrupt":
            server._store[key] = (data[:-1] + bytes([data[-1] ^ 1]), crc, deadline)
            source = server.address
        else:
            source, t = short_server(data)
        d_core.add_request(req("r0", ps[0], 6, source=source))
        assert drain(d_core) == want
        s = d_core.stats()
        assert s["kv_transfer_rejected_files"] == 1 and s.get("kv_transfer_imported_requests", 0) == 0
        assert d_core.kv.num_free_blocks == d_core.num_blocks
        if t is not None:
            t.join(HANG_GUARD_S)
    finally:
        p_core.shutdown()
        d_core.shutdown()


def held_server(data: bytes) -> tuple[str, threading.Event, threading.Thread]:
    """A peer that answers a pull of ``data`` only once ``release`` is set (a slow link)."""
    lsock = socket.create_server(("127.0.0.1", 0))
    release = threading.Event()

    def run():
        conn, _ = lsock.accept()
        with conn:
            tcp_server._recv_msg(conn, tcp_server.TransferOp)
            release.wait(HANG_GUARD_S)
            tcp_server._send_msg(conn, tcp_server.TransferReply(found=True, size=len(data), crc32=zlib.crc32(data)))
            conn.sendall(data)
        lsock.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return f"127.0.0.1:{lsock.getsockname()[1]}", release, t


@pytest.fixture
def tcp_cores(tiny, tmp_path):
    """A prefill core serving its transfers over TCP and a decode core, both in this process."""
    tcp = dict(kv_transfer_transport="tcp", kv_transfer_dir=str(tmp_path))
    p_core = make(tiny, kv_role="prefill", kv_transfer_address="127.0.0.1:0", **tcp)
    d_core = make(tiny, kv_role="decode", **tcp)
    yield p_core, d_core
    p_core.shutdown()
    d_core.shutdown()


def held_back(p_core, rid: str, prompt) -> tuple[str, threading.Event, threading.Thread]:
    """``prompt`` prefilled on ``p_core``, its transfer taken and served by a peer that holds it back."""
    p_core.add_request(req(rid, prompt, 1))
    drain(p_core)
    return held_server(tcp_server.take(p_core.kv_transfer_address, tf.request_key(rid)))


def test_a_pull_in_flight_never_stalls_the_running_requests(tiny, tcp_cores):
    """The decode core pulls a request's KV on a thread while that request waits: another request
    runs to its end meanwhile (a pull in the scheduler would stop every step until the bytes came);
    then the pulled one is loaded, token-exact, and both pools are whole."""
    ps = prompts(seed=5, k=2)
    want = colocated(tiny, ps)
    p_core, d_core = tcp_cores
    address, release, t = held_back(p_core, "r1", ps[1])
    d_core.add_request(req("r1", ps[1], 6, source=address))  # its bytes are held back
    d_core.add_request(req("r0", ps[0], 6))  # no transfer: computed here
    got: dict = {}
    for _ in range(200):
        if len(got.get("r0", [])) == 6:
            break
        for o in d_core.step():
            got.setdefault(o.req_id, []).extend(o.new_token_ids)
    assert len(got.get("r0", [])) == 6 and "r1" not in got, got
    assert d_core.stats()["kv_transfer_pulls"] == 1
    release.set()
    drain(d_core, got)
    t.join(HANG_GUARD_S)
    assert got == want
    s = d_core.stats()
    assert s["kv_transfer_imported_requests"] == 1 and s["kv_transfer_pulls"] == 0
    assert s["kv_transfer_imported_tokens"] == len(ps[1]) - 1
    assert d_core.kv.num_free_blocks == d_core.num_blocks and not d_core.scheduler.requests


def test_a_request_aborted_during_its_pull_leaves_nothing(tcp_cores, tmp_path):
    """Aborted while its bytes are on the way: the pull's file is deleted when it lands, the core
    stops stepping for it, nothing is imported and the pool is whole."""
    [prompt] = prompts(seed=6, k=1)
    p_core, d_core = tcp_cores
    address, release, t = held_back(p_core, "r0", prompt)
    d_core.add_request(req("r0", prompt, 6, source=address))
    assert d_core.step() == [] and d_core.stats()["kv_transfer_pulls"] == 1
    d_core.abort_requests(["r0"])
    release.set()
    assert drain(d_core) == {}
    t.join(HANG_GUARD_S)
    s = d_core.stats()
    assert s["kv_transfer_pulls"] == 0 and s["kv_transfer_claimed_files"] == 0
    assert s["kv_transfer_imported_requests"] == 0
    assert [f for f in tmp_path.rglob("*") if f.is_file()] == []  # the pulled file is gone
    assert d_core.kv.num_free_blocks == d_core.num_blocks and not d_core.scheduler.requests


# ---------------------------------------------------------------- PDEngine, cores in processes


def test_pd_engine_over_tcp(tiny_llama_dir, tmp_path):
    def cfg(**kw):
        return EngineConfig(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=8,
                            kv_transfer_dir=str(tmp_path), **kw)

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def collect(eng, p, rid):
        return [t async for o in eng.generate({"prompt_token_ids": p}, params, request_id=rid)
                for t in o.token_ids_delta]

    async def main():
        ps = prompts(seed=9, k=4)
        async with AsyncLLMEngine(cfg()) as colo:
            want = [await collect(colo, p, f"r{i}") for i, p in enumerate(ps)]
        async with AsyncLLMEngine.from_config(cfg(prefill_cores=1, decode_cores=1, kv_transfer_transport="tcp")) as pd:
            got = await asyncio.wait_for(asyncio.gather(*(collect(pd, p, f"r{i}") for i, p in enumerate(ps))),
                                         HANG_GUARD_S)
            assert got == want
            # aborted during the prefill and during the decode
            stream = pd.generate({"prompt_token_ids": ps[0]}, msgspec.structs.replace(params, max_tokens=300),
                                 request_id="x")
            await pd.abort("x")
            assert [o async for o in stream][-1].outputs[0].finish_reason == "abort"
            stream = pd.generate({"prompt_token_ids": ps[1]}, msgspec.structs.replace(params, max_tokens=300),
                                 request_id="y")
            await asyncio.wait_for(stream.__anext__(), HANG_GUARD_S)
            await stream.aclose()
            s = await idle(pd)
            assert s["transfer_files"] == 0 and s["num_streams"] == 0
            assert all(c["num_free_kv_blocks"] == c["num_kv_blocks"] for c in s["cores"]), s["cores"]
            [d] = s["decode"]
            assert d["kv_transfer_imported_requests"] >= len(ps) and d["kv_transfer_rejected_files"] == 0

    asyncio.run(main())
