"""A grammar-compile worker process: ``python -m asyncengine.structured.compile_worker``.

Why a process: xgrammar's compile is C++ that holds the GIL's attention for seconds on a hostile
schema and cannot be interrupted; in a thread it runs to the end after its client has gone, and
six of them once filled the default thread pool (issue 27). A process is killed at the budget or
when its request is abandoned, and its memory goes with it. It runs at a lower CPU priority
(nice 10) so that the engine's steps win the cores while a compile runs.

Protocol on stdin/stdout: length-prefixed msgpack frames. The parent sends :class:`Hello` (the
tokenizer, as xgrammar's serialized ``TokenizerInfo``), the worker answers :class:`Ready`; then
each :class:`Job` gets one :class:`Result` (the grammar serialized, or the compiler's message).
Imports xgrammar's compiler only (:func:`import_compiler`: no torch, no transformers, no
asyncengine engine code), so a worker starts in a fraction of a second and ~55 MB instead of ~3 s
and ~270 MB: the tokenizer arrives as plain data (xgrammar's serialized ``TokenizerInfo``: vocab,
vocab type, stop ids). The compile logic shared with the in-process fallback is :func:`compile_kind`.
"""
from __future__ import annotations

import importlib.util
import json
import os
import struct
import sys
import time
import types
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


def import_compiler():
    """xgrammar's ``GrammarCompiler`` and ``TokenizerInfo`` without the package's ``__init__``,
    which imports torch (matcher, kernels) and transformers (``TokenizerInfo.from_huggingface``),
    none of which a compile needs. torch is marked absent (tvm_ffi imports it only if it can);
    transformers is replaced by a module with the two classes tokenizer_info.py names in its
    signatures. Only for a worker process: it leaves ``sys.modules`` unfit for anything else."""
    sys.modules.setdefault("torch", None)  # None in sys.modules: "import torch" raises ImportError
    if "transformers" not in sys.modules:
        stand_in = types.ModuleType("transformers")
        stand_in.PreTrainedTokenizerBase = type("PreTrainedTokenizerBase", (), {})
        stand_in.PreTrainedTokenizerFast = type("PreTrainedTokenizerFast", (stand_in.PreTrainedTokenizerBase,), {})
        sys.modules["transformers"] = stand_in
    if "xgrammar" not in sys.modules:
        spec = importlib.util.find_spec("xgrammar")
        package = types.ModuleType("xgrammar")
        package.__path__ = list(spec.submodule_search_locations)
        package.__package__ = "xgrammar"
        sys.modules["xgrammar"] = package
    import xgrammar.load_binding  # noqa: F401  (the native library, before the modules that bind it)
    from xgrammar.compiler import GrammarCompiler
    from xgrammar.tokenizer_info import TokenizerInfo
    return GrammarCompiler, TokenizerInfo


def rss_bytes(pid: int | str = "self") -> int | None:
    """Resident memory of a process (Linux /proc; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return None


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

    GrammarCompiler, TokenizerInfo = import_compiler()

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
            info = TokenizerInfo.deserialize_json(msg.tokenizer_info)
            compiler = GrammarCompiler(info, max_threads=1, cache_enabled=False)
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
