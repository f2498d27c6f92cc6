"""The disk tier's files: one file per KV block, safe to share between processes.

Layout: ``<dir>/<fingerprint[:16] hex>/<hash[:1] hex>/<block hash hex>.kv``. A file is a fixed
header (magic, format version, the full fingerprint, the block hash, payload length, CRC-32 of the
payload) and the block's bytes. A reader accepts a file only if all of them match what it expects:
a file of another model or layout, a truncated one (crash mid-write, full disk) or one with flipped
bits is ignored and deleted. Writers write a private temporary file and ``os.replace`` it into
place, so readers in other processes see a whole file or none. CRC-32 catches accidents, not an
adversary: whoever can write the directory can already change what the engine computes.

The directory's size is bounded: when a writer takes it past ``max_bytes`` it rescans the directory
(every fingerprint, every process's files) and deletes the least recently used files (a hit
refreshes a file's mtime) down to 90% of the bound.
"""
from __future__ import annotations

import errno
import logging
import os
import struct
import time
import zlib

log = logging.getLogger(__name__)

MAGIC = b"AEKV"
VERSION = 1
_HEADER = struct.Struct("<4sHH32s32sQI")  # magic, version, reserved, fingerprint, hash, length, crc32
HEADER_SIZE = _HEADER.size
_STALE_TMP_S = 600.0


class BadBlockFile(Exception):
    """A block file that must not be loaded (missing, foreign, truncated or corrupt)."""


class DiskStore:
    def __init__(self, root: str, fingerprint: bytes, payload_bytes: int, max_bytes: int) -> None:
        self.root = root
        self.fingerprint = fingerprint
        self.dir = os.path.join(root, fingerprint[:8].hex())
        self.payload_bytes = payload_bytes
        self.max_bytes = max_bytes
        self._approx_bytes: int | None = None  # the directory's size as of the last scan + our writes

    def path(self, block_hash: bytes) -> str:
        h = block_hash.hex()
        return os.path.join(self.dir, h[:2], h + ".kv")

    # ------------------------------------------------------------------ what is there

    def list_hashes(self) -> set[bytes]:
        """The block hashes with a file in our fingerprint's folder (not verified)."""
        out: set[bytes] = set()
        try:
            subs = os.listdir(self.dir)
        except OSError:
            return out
        for sub in subs:
            try:
                names = os.listdir(os.path.join(self.dir, sub))
            except OSError:
                continue
            for name in names:
                if name.endswith(".kv") and len(name) == 67:
                    try:
                        out.add(bytes.fromhex(name[:64]))
                    except ValueError:
                        pass
        return out

    def exists(self, block_hash: bytes) -> bool:
        return os.path.exists(self.path(block_hash))

    # ------------------------------------------------------------------ read

    def read_into(self, block_hash: bytes, buf) -> None:
        """Fill ``buf`` (a writable buffer of ``payload_bytes``) with the block, or raise BadBlockFile
        (and delete the file when it is bad rather than missing)."""
        p = self.path(block_hash)
        try:
            with open(p, "rb") as f:
                head = f.read(HEADER_SIZE)
                if len(head) != HEADER_SIZE:
                    raise self._bad(p, "truncated header")
                magic, version, _, fp, h, length, crc = _HEADER.unpack(head)
                if magic != MAGIC or version != VERSION:
                    raise self._bad(p, "not a block file of this version")
                if fp != self.fingerprint:
                    raise self._bad(p, "another model or layout")
                if h != block_hash or length != self.payload_bytes:
                    raise self._bad(p, "another block")
                view = memoryview(buf).cast("B")
                if f.readinto(view) != length or f.read(1):
                    raise self._bad(p, "wrong length")
                if zlib.crc32(view) != crc:
                    raise self._bad(p, "checksum mismatch")
        except FileNotFoundError:
            raise BadBlockFile(f"{p}: gone") from None
        except OSError as e:
            raise BadBlockFile(f"{p}: {e}") from None
        try:
            os.utime(p)  # LRU: a hit is a use
        except OSError:
            pass

    def _bad(self, p: str, why: str) -> BadBlockFile:
        log.warning("kv offload: ignoring %s (%s)", p, why)
        try:
            os.unlink(p)
        except OSError:
            pass
        return BadBlockFile(f"{p}: {why}")

    # ------------------------------------------------------------------ write

    def write(self, block_hash: bytes, payload) -> bool:
        """Write one block atomically; False if it was already there. OSError propagates (the
        caller decides what a full or read-only disk means)."""
        p = self.path(block_hash)
        if os.path.exists(p):
            return False
        view = memoryview(payload).cast("B")
        assert len(view) == self.payload_bytes
        head = _HEADER.pack(MAGIC, VERSION, 0, self.fingerprint, block_hash, len(view), zlib.crc32(view))
        os.makedirs(os.path.dirname(p), exist_ok=True)
        tmp = f"{p}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(view)
            os.replace(tmp, p)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        if self._approx_bytes is not None:
            self._approx_bytes += HEADER_SIZE + len(view)
        if self._approx_bytes is None or self._approx_bytes > self.max_bytes:
            self.enforce_bound()
        return True

    def probe_writable(self) -> OSError | None:
        """None if we can create files here, else why not."""
        try:
            os.makedirs(self.dir, exist_ok=True)
            tmp = os.path.join(self.dir, f".probe.{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                f.write(b"x")
            os.unlink(tmp)
            return None
        except OSError as e:
            return e

    # ------------------------------------------------------------------ the bound

    def enforce_bound(self) -> int:
        """Rescan the whole directory; delete stale temporary files and the least recently used
        block files until it is under 90% of ``max_bytes``. Returns the number of files deleted."""
        files: list[tuple[float, int, str]] = []
        total = 0
        now = time.time()
        deleted = 0
        for dirpath, _, names in os.walk(self.root):
            for name in names:
                full = os.path.join(dirpath, name)
                try:
                    st = os.stat(full)
                except OSError:
                    continue
                if name.endswith(".tmp"):
                    if now - st.st_mtime > _STALE_TMP_S:  # a writer died mid-file
                        deleted += _unlink(full)
                    continue
                if name.endswith(".kv"):
                    files.append((st.st_mtime, st.st_size, full))
                    total += st.st_size
        if total > self.max_bytes:
            files.sort()
            target = int(self.max_bytes * 0.9)
            for _, size, full in files:
                if total <= target:
                    break
                if _unlink(full):
                    deleted += 1
                total -= size
        self._approx_bytes = total
        return deleted


def _unlink(p: str) -> int:
    try:
        os.unlink(p)
        return 1
    except OSError:
        return 0


def is_out_of_space(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, errno.EDQUOT)
