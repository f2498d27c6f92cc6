"""How one request's prompt KV (a transfer: a transfer file's bytes, kv_connector/pd/transfer_file.py)
gets from the prefill core that computed it to the decode core that loads it.

Three operations, by request id: the prefill core's worker ``put``s a transfer; a decode core
``claim``s it (it becomes a local file the decode worker loads, then deletes); the front end
``delete``s it when the request leaves before a decode core claimed it. Two transports:

* :class:`ShmTransport` (``kv_transfer_transport="shm"``): files in a directory every core of the
  host sees (tmpfs); a claim is a rename. One host only.
* :class:`TcpTransport` (``"tcp"``): the prefill worker keeps its transfers in memory and serves
  them from a small server thread on its node's address (kv_connector/pd/tcp_server.py); a decode
  core pulls one by request id from the address the front end passed along with the request
  (SGLang's pull), checks its length and CRC-32, and stages it as a local file. Any host.

Both keep the same guarantees: unclaimed transfers are deleted after the lease (shm: the prefill
cores' sweep; tcp: the server's own), a transfer that is short, corrupt or of another model, layout
or prompt is never loaded (the decode core computes that prompt itself, counted as rejected).
"""
from __future__ import annotations

import logging
import os
from typing import Callable

from asyncengine.kv_connector.pd import transfer_file as tf

log = logging.getLogger(__name__)

Accept = Callable[[tf.Header], bool]  # the decode side's check of a transfer's header


class ShmTransport:
    claims_over_network = False  # a claim is a rename: the scheduler makes it inline

    def __init__(self, directory: str) -> None:
        self.dir = directory

    def put(self, key: str, header: tf.Header, payload) -> None:
        tf.write(tf.file_path(self.dir, key), header, payload)

    def claim(self, key: str, source: str | None, accept: Accept) -> tuple[str, tf.Header] | None:
        """(the local file the worker loads, its header), or None: no transfer, or refused."""
        src = tf.file_path(self.dir, key)
        h = tf.read_header(src)
        if h is None or not accept(h):
            return None
        dst = tf.claimed_path(self.dir, key)
        try:
            os.rename(src, dst)
        except OSError:  # taken away meanwhile (aborted, swept)
            return None
        return dst, h

    def delete(self, key: str, source: str | None) -> None:
        try:
            os.unlink(tf.file_path(self.dir, key))
        except OSError:
            pass

    def num_held(self, sources=()) -> int:
        try:
            return len(os.listdir(self.dir))
        except OSError:
            return 0


class TcpTransport:
    """``directory``: where a decode core stages what it pulled (local tmpfs); ``serve_on``: a
    prefill core's ``host:port`` (its worker starts the server)."""

    claims_over_network = True  # a claim is a pull: the decode scheduler makes it on a thread

    def __init__(self, directory: str, serve_on: str | None = None, lease_s: float = 30.0) -> None:
        self.dir = directory
        self.server = None
        if serve_on is not None:
            from asyncengine.kv_connector.pd.tcp_server import TransferServer  # lazy: the TCP transport only when kv_transfer_transport='tcp'

            self.server = TransferServer(serve_on, lease_s)

    def put(self, key: str, header: tf.Header, payload) -> None:
        self.server.put(tf.request_key(key), b"".join((header.pack(), memoryview(payload).cast("B"))))

    def claim(self, key: str, source: str | None, accept: Accept) -> tuple[str, tf.Header] | None:
        from asyncengine.kv_connector.pd import tcp_server  # lazy: the TCP transport only when kv_transfer_transport='tcp'

        if source is None:
            return None
        # None: nothing there; short or corrupt: BadTransfer, for the caller to count
        blob = tcp_server.take(source, tf.request_key(key))
        if blob is None:
            return None
        h = tf.parse_header(blob)
        if h is None or not accept(h):
            return None
        dst = tf.claimed_path(self.dir, key)
        os.makedirs(self.dir, exist_ok=True)
        with open(dst, "wb") as f:
            f.write(blob)
        return dst, h

    def delete(self, key: str, source: str | None) -> None:
        from asyncengine.kv_connector.pd import tcp_server  # lazy: the TCP transport only when kv_transfer_transport='tcp'

        if source is not None:
            tcp_server.delete(source, tf.request_key(key))

    def num_held(self, sources=()) -> int:
        from asyncengine.kv_connector.pd import tcp_server  # lazy: the TCP transport only when kv_transfer_transport='tcp'

        return sum(tcp_server.count(s) for s in sources)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def make_transport(kind: str, directory: str, serve_on: str | None = None, lease_s: float = 30.0):
    if kind == "tcp":
        return TcpTransport(directory, serve_on, lease_s)
    if kind == "shm":
        return ShmTransport(directory)
    raise ValueError(f"unknown kv transfer transport {kind!r}")
