"""The TCP transport's wire (kv_connector/pd/transport.py): a prefill core's transfers served from
memory by a small server thread, and the client calls a decode core and the front end make.

One operation per connection: a length-prefixed msgpack :class:`TransferOp`, answered by a
length-prefixed :class:`TransferReply` and, for ``take``, the transfer's bytes. ``take`` hands the
transfer over (the server forgets it once sent: the decode core owns it), ``delete`` drops it (the
request left), ``count`` says how many are held (stats, tests). The reply carries the length and
CRC-32 of the bytes: a connection that ends early or bytes that do not match are refused, logged,
and the decode core computes the prompt itself. Transfers nobody took within the lease are dropped
by the server's sweep thread, whether or not the core steps. Not an authenticated channel: bind it
to the cluster's private network, as the Ray cores' own ports.
"""
from __future__ import annotations

import logging
import socket
import socketserver
import struct
import threading
import time
import zlib

import msgspec

log = logging.getLogger(__name__)
_LEN = struct.Struct(">I")
TIMEOUT_S = 30.0  # a peer that stops answering mid-transfer fails that transfer, never hangs a core
COUNT_TIMEOUT_S = 2.0  # count() serves stats (/metrics): a peer that does not answer counts 0
SWEEP_EVERY_S = 1.0


class TransferOp(msgspec.Struct, array_like=True):
    op: str  # "take" | "delete" | "count"
    key: str = ""


class TransferReply(msgspec.Struct, array_like=True):
    found: bool
    size: int = 0  # bytes that follow (take)
    crc32: int = 0
    count: int = 0


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _send_msg(sock: socket.socket, msg: msgspec.Struct) -> None:
    data = msgspec.msgpack.encode(msg)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return None
        got += k
    return bytes(buf)


def _recv_msg(sock: socket.socket, typ: type):
    head = _recv_exact(sock, _LEN.size)
    if head is None:
        return None
    body = _recv_exact(sock, _LEN.unpack(head)[0])
    return None if body is None else msgspec.msgpack.decode(body, type=typ)


class TransferServer:
    """A prefill core's transfers, served on ``address`` (``host:port``; port 0: any free one, see
    ``self.address``) until ``close()``."""

    def __init__(self, address: str, lease_s: float) -> None:
        self.lease_s = lease_s
        self._store: dict[str, tuple[bytes, int, float]] = {}  # key -> (bytes, crc32, deadline)
        self._lock = threading.Lock()
        self.num_swept = 0
        store = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.settimeout(TIMEOUT_S)
                try:
                    store._serve(self.request)
                except (OSError, msgspec.DecodeError) as e:
                    log.warning("kv transfer server: a connection failed: %s", e)

        class Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True
            daemon_threads = True

        self._server = Server(split_address(address), Handler)
        host, port = self._server.server_address[:2]
        self.address = f"{host}:{port}"
        self._stop = threading.Event()
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True,
                         name="asyncengine-kv-transfer-server").start()
        threading.Thread(target=self._sweep_loop, daemon=True, name="asyncengine-kv-transfer-sweep").start()

    def put(self, key: str, blob: bytes) -> None:
        with self._lock:
            self._store[key] = (blob, zlib.crc32(blob), time.monotonic() + self.lease_s)

    def _serve(self, sock: socket.socket) -> None:
        op = _recv_msg(sock, TransferOp)
        if op is None:
            return
        with self._lock:
            if op.op == "take":
                entry = self._store.pop(op.key, None)
            elif op.op == "delete":
                entry = self._store.pop(op.key, None)
                entry = None if entry is None else (b"", 0, 0.0)
            else:
                entry = None
            count = len(self._store)
        if op.op == "take" and entry is not None:
            blob, crc, _ = entry
            _send_msg(sock, TransferReply(found=True, size=len(blob), crc32=crc))
            sock.sendall(blob)
        else:
            _send_msg(sock, TransferReply(found=entry is not None, count=count))

    def sweep(self) -> int:
        now = time.monotonic()
        with self._lock:
            old = [k for k, (_, _, deadline) in self._store.items() if deadline <= now]
            for k in old:
                del self._store[k]
        self.num_swept += len(old)
        return len(old)

    def _sweep_loop(self) -> None:
        while not self._stop.wait(SWEEP_EVERY_S):
            self.sweep()

    def __len__(self) -> int:
        return len(self._store)

    def close(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            self._store.clear()


def _call(address: str, op: TransferOp, timeout: float = TIMEOUT_S) -> tuple[socket.socket, TransferReply] | None:
    sock = socket.create_connection(split_address(address), timeout=timeout)
    try:
        _send_msg(sock, op)
        reply = _recv_msg(sock, TransferReply)
    except BaseException:
        sock.close()
        raise
    if reply is None:
        sock.close()
        return None
    return sock, reply


class BadTransfer(Exception):
    """What arrived is not the transfer that was sent (short, or fails its CRC): never loaded."""


def take(address: str, key: str) -> bytes | None:
    """The transfer ``key`` from the server at ``address``, now this caller's; None when it has
    none or cannot be reached (logged); :class:`BadTransfer` when what arrived is short or fails
    its CRC."""
    try:
        got = _call(address, TransferOp("take", key))
        if got is None:
            return None
        sock, reply = got
        with sock:
            if not reply.found:
                return None
            blob = _recv_exact(sock, reply.size)
    except OSError as e:
        log.warning("kv transfer: pulling %s from %s failed: %s", key, address, e)
        return None
    if blob is None:
        raise BadTransfer(f"kv transfer {key} from {address} ended early (fewer than the {reply.size} bytes "
                          f"announced)")
    if zlib.crc32(blob) != reply.crc32:
        raise BadTransfer(f"kv transfer {key} from {address} fails its CRC-32")
    return blob


def delete(address: str, key: str) -> bool:
    """Drop transfer ``key`` at ``address`` (the request left); True if it was there."""
    try:
        got = _call(address, TransferOp("delete", key))
    except OSError as e:
        log.warning("kv transfer: deleting %s at %s failed: %s", key, address, e)
        return False
    if got is None:
        return False
    got[0].close()
    return got[1].found


def count(address: str) -> int:
    """How many transfers the server at ``address`` holds (0 if it does not answer)."""
    try:
        got = _call(address, TransferOp("count"), COUNT_TIMEOUT_S)
    except OSError:
        return 0
    if got is None:
        return 0
    got[0].close()
    return got[1].count
