"""The GGUF file itself: its metadata and tensor table, parsed with ``struct`` over a memory map.

No ``gguf`` package here (see types.py): ``gguf.GGUFReader`` builds a numpy view per metadata
element, which takes seconds on a 50k-150k token vocabulary, and importing it costs 0.12 s.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
import warnings
from typing import Any

import numpy as np

from asyncengine.errors import ModelLoadError
from asyncengine.models.gguf.types import BLOCK_SIZES, SUPPORTED_TENSOR_TYPES, GGMLType, type_name

__all__ = ["GGUFFile", "TensorInfo", "check_tensor_types", "resolve_file"]


def resolve_file(path: str | os.PathLike) -> str:
    path = os.path.expanduser(os.fspath(path))
    if os.path.isdir(path):
        found = sorted(f for f in os.listdir(path) if f.lower().endswith(".gguf"))
        if len(found) != 1:
            what = "no .gguf file" if not found else f"{len(found)} .gguf files ({', '.join(found)})"
            raise ModelLoadError(f"{path}: is a folder with {what}; pass the path of one .gguf file.")
        path = os.path.join(path, found[0])
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such GGUF file.")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: not a regular file.")
    return path


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    type_id: int  # a types.GGMLType value (kept as int: the file may hold an unknown one)
    dims: tuple[int, ...]  # GGUF order: innermost (contiguous) dimension first
    offset: int  # absolute, in bytes from the start of the file

    @property
    def shape(self) -> tuple[int, ...]:
        """The torch/numpy shape (outermost first), e.g. (out_features, in_features)."""
        return tuple(reversed(self.dims))

    @property
    def type_name(self) -> str:
        return type_name(self.type_id)


# GGUF metadata value types -> struct format (fixed-size ones); 8 is a string, 9 an array.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
# Metadata arrays we only count: the vocabulary (transformers' tokenizer code reads those itself).
_COUNTED_ARRAYS = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                   "tokenizer.ggml.token_type", "tokenizer.ggml.precompiled_charsmap"}


class _Truncated(Exception):
    pass


_last_opened: tuple = (None, None)  # ((path, size, mtime_ns), GGUFFile)


def open_file(path: str) -> "GGUFFile":
    """``GGUFFile(path)``, parsed once per process while the file is unchanged (same size and
    mtime): an in-process engine opens its GGUF twice as it starts, for the model info and then for
    the weights, and a parse of a 49k-token vocabulary's header is 20-40 ms."""
    global _last_opened
    try:
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    except OSError:
        return GGUFFile(path)  # its own error message
    cached_key, cached = _last_opened
    if cached_key == key:
        return cached
    f = GGUFFile(path)
    _last_opened = (key, f)
    return f


class GGUFFile:
    """A GGUF v2/v3 file: its metadata and tensor table, parsed with ``struct`` over a memory map.

    ``gguf.GGUFReader`` builds a numpy view per metadata element, which takes seconds on a 50k-150k
    token vocabulary (about 2 s for SmolLM2, several for Qwen/Llama 3); this parser skips the
    vocabulary arrays and takes milliseconds (they are read on demand: :meth:`read_array`). Tensor
    bytes are numpy or torch views of the map; the tests cross-check this parser against ``GGUFReader``.
    """

    def __init__(self, path: str):
        import mmap

        self.path = path
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(8)
                if len(head) < 8:
                    raise ModelLoadError(f"{path}: file is too short ({len(head)} bytes) to be a GGUF file.")
                if head[:4] != b"GGUF":
                    raise ModelLoadError(
                        f"{path}: not a GGUF file (it starts with {head[:4]!r}, a GGUF file starts with b'GGUF')."
                    )
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise ModelLoadError(f"{path}: cannot read the file: {exc.strerror or exc}.") from None
        self.size = size
        try:
            self._parse()
        except (_Truncated, struct.error):
            raise ModelLoadError(
                f"{path}: the GGUF header is cut short ({size} bytes in all): the file is truncated or corrupt."
            ) from None
        except UnicodeDecodeError as exc:
            raise ModelLoadError(f"{path}: corrupt GGUF header (a string is not UTF-8: {exc}).") from None

    # -- parsing
    def _take(self, fmt: str):
        value = struct.unpack_from(fmt, self._map, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._take("<Q")
        end = self._pos + n
        if end > self.size:
            raise _Truncated
        text = self._map[self._pos:end].decode("utf-8")
        self._pos = end
        return text

    def _value(self, type_id: int, key: str):
        if type_id in _SCALAR_FORMATS:
            return self._take(_SCALAR_FORMATS[type_id])
        if type_id == 8:
            return self._string()
        if type_id == 9:
            item_type, count = self._take("<I"), self._take("<Q")
            if key in _COUNTED_ARRAYS:
                start = self._pos
                self._skip_array(item_type, count)
                self.arrays[key] = (item_type, count, start, self._pos)
                return _ArrayCount(count)  # a plain int once stored
            return [self._value(item_type, key) for _ in range(count)]
        raise ModelLoadError(f"{self.path}: corrupt GGUF metadata (key {key!r} has unknown value type {type_id}).")

    def _skip_array(self, item_type: int, count: int) -> None:
        if item_type in _SCALAR_FORMATS:
            self._pos += struct.calcsize(_SCALAR_FORMATS[item_type]) * count
        elif item_type == 8:
            unpack, buf, pos = struct.Struct("<Q").unpack_from, self._map, self._pos
            for _ in range(count):
                pos += 8 + unpack(buf, pos)[0]
            self._pos = pos
        else:
            for _ in range(count):
                self._value(item_type, "")
        if self._pos > self.size:
            raise _Truncated

    def read_array(self, key: str) -> list | None:
        """A vocabulary array the header parse skipped (tokens, merges, token types), or None."""
        if key not in self.arrays:
            return None
        item_type, count, pos, end = self.arrays[key]
        if item_type == 8:
            try:
                strings = _short_strings(self._map, pos, end, count)
                if strings is not None:
                    return strings
                out, unpack, buf = [], struct.Struct("<Q").unpack_from, self._map
                for _ in range(count):
                    n = unpack(buf, pos)[0]
                    out.append(buf[pos + 8:pos + 8 + n].decode("utf-8"))
                    pos += 8 + n
                return out
            except UnicodeDecodeError as exc:
                raise ModelLoadError(f"{self.path}: corrupt GGUF metadata ({key!r} holds a string that is not "
                                     f"UTF-8: {exc}).") from None
        if item_type in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[item_type]
            return list(np.frombuffer(self._map, dtype=np.dtype(fmt), count=count, offset=pos).tolist())
        return None

    def _parse(self) -> None:
        self.arrays: dict[str, tuple[int, int, int, int]] = {}  # key -> (item type, count, start, end)
        self._pos = 4
        version = self._take("<I")
        if version not in (2, 3):
            hint = " (a big-endian file?)" if version > 0xFFFF else ""
            raise ModelLoadError(f"{self.path}: GGUF version {version} is not supported (2 and 3 are){hint}.")
        n_tensors, n_kv = self._take("<Q"), self._take("<Q")
        if n_tensors > self.size or n_kv > self.size:
            raise _Truncated
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            metadata[key] = self._value(self._take("<I"), key)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._take("<I")
            if n_dims > 8:
                raise ModelLoadError(f"{self.path}: corrupt tensor table ({name!r} has {n_dims} dimensions).")
            dims = tuple(self._take("<Q") for _ in range(n_dims))
            type_id, offset = self._take("<I"), self._take("<Q")
            infos.append((name, type_id, dims, offset))
        alignment = int(metadata.get("general.alignment", 32))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ModelLoadError(f"{self.path}: invalid general.alignment {alignment}.")
        data_start = (self._pos + alignment - 1) // alignment * alignment
        # A skipped vocabulary array `k` appears as `k.count`.
        self.metadata = {(k + ".count" if isinstance(v, _ArrayCount) else k): v for k, v in metadata.items()}
        self.tensors = [TensorInfo(n, t, d, data_start + o) for n, t, d, o in infos]
        self.tensor_names = {t.name for t in self.tensors}

    # -- tensor data
    def nbytes(self, t: TensorInfo) -> int:
        sizes = BLOCK_SIZES.get(t.type_id)
        if sizes is None:
            raise ModelLoadError(f"{self.path}: tensor {t.name!r} has type {t.type_name}: the file is corrupt "
                                 f"or newer than this reader.")
        block, type_size = sizes
        n_elements = math.prod(t.dims)
        if n_elements % block or (t.dims and t.dims[0] % block):
            raise ModelLoadError(
                f"{self.path}: tensor {t.name!r} has shape {list(t.shape)}, whose rows do not divide into "
                f"{t.type_name} blocks of {block}: the file is corrupt."
            )
        return n_elements // block * type_size

    def release(self, t: TensorInfo) -> None:
        """Drop this process's mapping of a tensor's pages (they stay in the page cache; a later
        read faults them back in), so a load's peak RSS does not count the file on top of the
        weights copied out of it."""
        import mmap

        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = t.offset - t.offset % mmap.PAGESIZE
        try:
            self._map.madvise(mmap.MADV_DONTNEED, start, t.offset + self.nbytes(t) - start)
        except (OSError, ValueError):
            pass

    def torch_bytes(self, t: TensorInfo):
        """The tensor's bytes as a flat torch uint8 view of the map (read-only: callers copy out of it)."""
        import torch

        with warnings.catch_warnings():  # torch warns that the buffer is not writable
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(self._map, dtype=torch.uint8, count=self.nbytes(t), offset=t.offset)

    def floats(self, t: TensorInfo) -> np.ndarray:
        """An F32/F16/BF16 tensor as a fresh float32 array (numpy only: small tensors such as
        ``rope_freqs`` read where torch is not imported)."""
        kind = {GGMLType.F32: np.float32, GGMLType.F16: np.float16, GGMLType.BF16: np.uint16}.get(t.type_id)
        if kind is None:
            raise ModelLoadError(f"{self.path}: tensor {t.name!r} is {t.type_name}, not a float type")
        data = np.frombuffer(self._map, dtype=kind, count=self.nbytes(t) // np.dtype(kind).itemsize,
                             offset=t.offset)
        if kind is np.uint16:  # bfloat16: the high half of a float32
            data = (data.astype(np.uint32) << 16).view(np.float32)
        return data.astype(np.float32).reshape(t.shape)

    def raw(self, t: TensorInfo) -> np.ndarray:
        """The tensor's bytes as uint8 with shape (*outer dims, bytes per row): what gguf.quants expects."""
        nbytes = self.nbytes(t)
        data = np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=t.offset)
        return data.reshape(*t.shape[:-1], nbytes // max(1, math.prod(t.shape[:-1])))


def _short_strings(buf, start: int, end: int, count: int) -> list[str] | None:
    """The ``count`` length-prefixed strings in ``buf[start:end]``, decoded in a few whole-array
    steps (~7 ms for SmolLM2's 49k tokens, against ~20 ms one by one), provided each is 1-255 bytes
    of UTF-8 without NUL, as vocabulary strings are; None otherwise (the caller goes one by one).

    Each string's 8-byte little-endian length is then ``[n, 0, 0, 0, 0, 0, 0, 0]`` with ``n > 0``: the
    runs of that shape are candidates, and following the chain of lengths from the first byte
    proves they are the length fields. Each field then becomes one NUL, so that one decode and one
    split make the strings.
    """
    region = np.frombuffer(buf, dtype=np.uint8, count=end - start, offset=start)
    n = len(region)
    if count == 0 or n < 9:
        return None
    zero = region == 0
    if np.count_nonzero(zero) != 7 * count:  # a longer or empty string, or one holding a NUL
        return None
    field = ~zero[:n - 7]
    for k in range(1, 8):
        field &= zero[k:n - 7 + k]
    starts = np.flatnonzero(field)
    if len(starts) != count or starts[0] != 0:
        return None
    ends = starts + 8 + region[starts]
    if ends[-1] != n or not np.array_equal(ends[:-1], starts[1:]):
        return None
    text = region.copy()
    text[starts] = 0  # a field's first byte becomes the separator; its 7 zero bytes go
    try:
        return text[~zero].tobytes().decode("utf-8").split("\0")[1:]
    except UnicodeDecodeError:  # the one-by-one path raises it for the string at fault
        return None


class _ArrayCount(int):
    """Stands for a metadata array that was skipped: the number of its elements."""


def check_tensor_types(f: GGUFFile, path: str) -> None:
    """Refuse a file with a tensor type we cannot read, or whose tensors run past its end."""
    supported_ids = {int(q) for q in SUPPORTED_TENSOR_TYPES}
    unsupported: dict[str, list[str]] = {}
    for t in f.tensors:
        if t.type_id not in supported_ids:
            unsupported.setdefault(t.type_name, []).append(t.name)
    if unsupported:
        listed = "; ".join(f"{k} ({len(v)} tensors, e.g. {v[0]!r})" for k, v in sorted(unsupported.items()))
        raise ModelLoadError(
            f"{path}: unsupported tensor type(s): {listed}. Supported: "
            f"{', '.join(sorted(q.name for q in SUPPORTED_TENSOR_TYPES))}. Re-quantize the model "
            f"(e.g. llama-quantize to Q4_K_M or Q8_0) or use an F16/F32 file."
        )
    for t in f.tensors:
        end = t.offset + f.nbytes(t)
        if end > f.size:
            raise ModelLoadError(
                f"{path}: tensor {t.name!r} ends at byte {end} but the file has only {f.size} bytes: "
                f"the file is truncated."
            )
