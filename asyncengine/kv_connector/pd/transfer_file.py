"""Transfer files: one request's prompt KV on its way from a prefill core to a decode core.

``<dir>/<key>.kv`` where ``key`` is a digest of the request id (ids are the user's: never a path).
A file is a header (magic, version, the KV fingerprint, a digest of the prompt's token ids, the
number of tokens, blocks and bytes per block) and the blocks in the host pool's slot layout. The
writer renames a private temporary file into place, so a reader sees a whole file or none. A decode
core *claims* a file by renaming it to ``<key>.<pid>.claimed`` before it commits to loading it, so
that nobody else (another decode core, the front end cleaning up an aborted request, the sweep)
can take it away meanwhile. The sweep deletes unclaimed files older than the lease and claimed files
whose claiming process is gone: nothing outlives a lease or a core.
"""
from __future__ import annotations

import hashlib
import os
import struct
import time
from array import array

MAGIC = b"AEPD"
VERSION = 1
_HEADER = struct.Struct("<4sHH32s32sIIQ")  # magic, version, reserved, fingerprint, prompt digest, tokens, blocks, bytes
HEADER_SIZE = _HEADER.size


def default_dir() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    import tempfile

    return os.path.join(base or tempfile.gettempdir(), "asyncengine-pd")


def request_key(request_id: str) -> str:
    return hashlib.sha256(request_id.encode()).hexdigest()[:32]


def file_path(directory: str, request_id: str) -> str:
    return os.path.join(directory, request_key(request_id) + ".kv")


def claimed_path(directory: str, request_id: str) -> str:
    return os.path.join(directory, f"{request_key(request_id)}.{os.getpid()}.claimed")


def prompt_digest(token_ids, extra: str | None = None) -> bytes:
    """What a transfer file's prompt is: its token ids and what the prefix cache keys beside them
    (``Request.block_extra`` over the whole prompt: the images' hashes, the cache salt / LoRA), so
    that the same tokens with another image never load this KV."""
    h = hashlib.sha256(array("q", token_ids).tobytes())
    if extra:
        h.update(extra.encode())
    return h.digest()


class Header:
    __slots__ = ("fingerprint", "digest", "num_tokens", "num_blocks", "block_nbytes")

    def __init__(self, fingerprint: bytes, digest: bytes, num_tokens: int, num_blocks: int, block_nbytes: int):
        self.fingerprint, self.digest = fingerprint, digest
        self.num_tokens, self.num_blocks, self.block_nbytes = num_tokens, num_blocks, block_nbytes

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, VERSION, 0, self.fingerprint, self.digest, self.num_tokens, self.num_blocks,
                            self.block_nbytes)


def read_header(path: str) -> Header | None:
    """The file's header if it is a whole transfer file of this format, else None."""
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_SIZE)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return None
    if len(raw) != HEADER_SIZE:
        return None
    magic, version, _, fp, digest, ntok, nblk, nbytes = _HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION or size != HEADER_SIZE + nblk * nbytes:
        return None
    return Header(fp, digest, ntok, nblk, nbytes)


def parse_header(blob: bytes) -> Header | None:
    """The header of a whole transfer held in memory (the TCP transport), else None."""
    if len(blob) < HEADER_SIZE:
        return None
    magic, version, _, fp, digest, ntok, nblk, nbytes = _HEADER.unpack_from(blob)
    if magic != MAGIC or version != VERSION or len(blob) != HEADER_SIZE + nblk * nbytes:
        return None
    return Header(fp, digest, ntok, nblk, nbytes)


def write(path: str, header: Header, payload) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(header.pack())
            f.write(memoryview(payload).cast("B"))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def sweep(directory: str, lease_s: float) -> int:
    """Delete unclaimed (and temporary) files older than ``lease_s`` and files claimed by a process
    that no longer exists. Returns how many."""
    now = time.time()
    n = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        full = os.path.join(directory, name)
        if name.endswith(".claimed"):
            try:
                pid = int(name.split(".")[1])
                os.kill(pid, 0)
                continue  # its owner is alive: it will load or delete it
            except ProcessLookupError:
                pass
            except (ValueError, IndexError, PermissionError):
                continue
        else:
            try:
                if now - os.stat(full).st_mtime <= lease_s:
                    continue
            except OSError:
                continue
        try:
            os.unlink(full)
            n += 1
        except OSError:
            pass
    return n
