"""A grammar-compile worker process: ``python -m asyncengine.structured.compile_worker``.

Why a process: xgrammar's compile is C++ that holds the GIL's attention for seconds on a hostile
schema and cannot be interrupted; in a thread it runs to the end after its client has gone, and
six of them once filled the default thread pool (issue 27). A process is killed at the budget or
when its request is abandoned, and its memory goes with it. It runs at a lower CPU priority
(nice 10) so that the engine's steps win the cores while a compile runs.

Protocol on stdin/stdout: length-prefixed msgpack frames. The parent sends :class:`Hello` (the
tokenizer, as xgrammar's serialized ``TokenizerInfo``), the worker answers :class:`Ready`; then
each :class:`Job` gets one :class:`Result` (the grammar serialized, or the compiler's message).
Imports xgrammar only (no torch, no asyncengine engine code): the compile logic shared with the
in-process fallback is :func:`compile_kind`.
"""
from __future__ import annotations

import json
import os
import struct
import sys
import time
import zlib

import msgspec


class Hello(msgspec.Struct, tag="hello"):
    tokenizer_info: str


class Ready(msgspec.Struct, tag="ready"):
    pid: int


class Job(msgspec.Struct, tag="job"):
    kind: str
    text: str


class Result(msgspec.Struct, tag="result"):
    ok: bool
    compiled: bytes = b""  # xgrammar's serialized JSON, zlib-compressed (pack / unpack)
    error: str = ""
    seconds: float = 0.0


ToWorker = Hello | Job
FromWorker = Ready | Result
_HEADER = struct.Struct("<I")


def ebnf_string(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)  # xgrammar's EBNF string literals use JSON escapes


def compile_kind(compiler, kind: str, text: str):
    """Compile a StructuredOutputsParams key (kind, text) with an ``xgrammar.GrammarCompiler``.
    JSON is compact (no free whitespace) unless the kind ends with ``_ws``."""
    if kind.startswith("json_object"):
        return (compiler.compile_builtin_json_grammar() if kind.endswith("_ws") else
                compiler.compile_json_schema('{"type": "object"}', any_whitespace=False))
    if kind.startswith("json"):
        return compiler.compile_json_schema(text, any_whitespace=kind.endswith("_ws"))
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "choice":
        return compiler.compile_grammar("root ::= " + " | ".join(ebnf_string(s) for s in json.loads(text)))
    return compiler.compile_grammar(text)


def pack(serialized: str) -> bytes:
    """xgrammar's serialized grammar is JSON of bitsets: zlib shrinks it ~60x (4.8 MB -> 81 KB for
    a 15 KB schema on a 32k vocabulary, 47 ms; unpacking 14 ms), for the pipe, the cache and every
    request message to a core in another process."""
    return zlib.compress(serialized.encode("utf-8"), 6)


def unpack(packed: bytes) -> str:
    return zlib.decompress(packed).decode("utf-8")


def _read(f, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def main() -> None:
    out = os.fdopen(os.dup(1), "wb")  # frames only: anything printed (xgrammar's C++ log) goes to stderr
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    try:
        os.nice(10)
    except OSError:
        pass
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ToWorker)

    def send(msg) -> None:
        body = enc.encode(msg)
        out.write(_HEADER.pack(len(body)) + body)
        out.flush()

    import xgrammar as xgr

    compiler = None
    while True:
        head = _read(inp, _HEADER.size)
        if head is None:
            return  # the parent closed our stdin: it is done with us
        body = _read(inp, _HEADER.unpack(head)[0])
        if body is None:
            return
        msg = dec.decode(body)
        if isinstance(msg, Hello):
            info = xgr.TokenizerInfo.deserialize_json(msg.tokenizer_info)
            compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            send(Ready(os.getpid()))
            continue
        t0 = time.perf_counter()
        try:
            g = compile_kind(compiler, msg.kind, msg.text)
            send(Result(True, compiled=pack(g.serialize_json()), seconds=time.perf_counter() - t0))
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with its message
            send(Result(False, error=str(e), seconds=time.perf_counter() - t0))


if __name__ == "__main__":
    main()
