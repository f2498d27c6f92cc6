"""The runtime-format weight cache: a model's loaded state, written once, memory-mapped after.

Decoding a quantized GGUF into the engine's tensors costs seconds on a small CPU (SmolLM2-135M:
~3 s of dequantizing and copying on 2 busy cores), every start; even kept in its blocks, gathering
the file's tensors into the engine's fused, unpermuted layout took 0.13 s of a one-line chat. After
the first load of a GGUF the engine writes its state (parameters and block buffers, exactly as the
model holds them: fused, in the engine's dtype or blocks), into one flat file in the cache folder;
later starts map that file copy-on-write (pre-faulted where the OS can) and hand the model views
of it: no decoding, no copy.

The key covers what the content depends on: the GGUF's real path, size and modification time, the
dtype, the model class, the storage chosen per layer (``variant``) and this module's format
version. A stale or corrupt entry is ignored (and replaced), never trusted: the index must list
exactly the model's state tensors with their shapes and dtypes. Entries no key can reach again
(their GGUF changed or is gone, or an older format wrote them) are deleted whenever a new entry is
written: at ~4x the GGUF's size for an fp32 entry, they added up to gigabytes.
Only files of at least :data:`MIN_FILE_BYTES` are cached (tiny files decode in milliseconds).
``ASYNCENGINE_WEIGHT_CACHE=0`` turns the cache off.
"""
from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import tempfile
import time
import warnings
from pathlib import Path

import torch

from asyncengine.platforms.paths import cache_dir

log = logging.getLogger(__name__)

FORMAT_VERSION = 3  # 3: a Q5_0 tensor is cached as the Q8_0 blocks it converts to exactly (was re-quantized)
MIN_FILE_BYTES = 16 << 20
_ALIGN = 64


def enabled_for(path: str) -> bool:
    if os.environ.get("ASYNCENGINE_WEIGHT_CACHE", "1").lower() in ("0", "false", "no", "off"):
        return False
    try:
        return os.path.getsize(path) >= MIN_FILE_BYTES
    except OSError:
        return False


def cache_file(path: str, dtype: torch.dtype, model_cls: type, variant: str = "") -> Path:
    """``variant``: anything else the content depends on (which layers keep which block format)."""

    st = os.stat(path)
    key = json.dumps([os.path.realpath(path), st.st_size, st.st_mtime_ns, str(dtype), model_cls.__name__,
                      variant, FORMAT_VERSION])
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return cache_dir() / "weights" / f"{Path(path).stem}-{digest}.bin"


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the cache holds: parameters and persistent buffers (the state_dict's tensors)."""
    return dict(model.state_dict(keep_vars=True))


def _map_private(fd: int) -> mmap.mmap:
    """A copy-on-write map of the whole file, its pages faulted in at once where Linux allows
    (one call instead of a fault per 4 KiB page during the first forward pass)."""
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if populate:
        try:
            return mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE | populate, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            pass
    return mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)


def load(model: torch.nn.Module, file: Path) -> bool:
    """Point ``model``'s state tensors at the cached file (copy-on-write map). False if there is no
    usable entry; the model is then untouched."""
    index_file = file.with_suffix(".json")
    try:
        index = json.loads(index_file.read_text())
        params = _state(model)
        if set(index["tensors"]) != set(params):
            return False
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != index["nbytes"]:
                return False
            buf = _map_private(f.fileno())
    except (OSError, ValueError, KeyError, TypeError):
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buf, dtype=torch.uint8)  # keeps the map alive
    views = {}
    for name, (dtype, shape, offset) in index["tensors"].items():
        p = params[name]
        dt = getattr(torch, dtype)
        if list(p.shape) != shape or dt != p.dtype:
            return False
        n = p.numel() * dt.itemsize
        views[name] = flat[offset:offset + n].view(dt).view(shape)
    model.load_state_dict(views, strict=True, assign=True)  # works on a meta-device model too
    return True


def _source(path: str) -> list:
    st = os.stat(path)
    return [os.path.realpath(path), st.st_size, st.st_mtime_ns]


def _unreachable(index: dict) -> bool:
    """Whether no key can lead to this entry again: another format, or a source file changed or gone."""
    if index.get("format") != FORMAT_VERSION:
        return True
    try:
        return _source(index["source"][0]) != index["source"]
    except (OSError, KeyError, IndexError, TypeError):
        return True


def prune(folder: Path, keep: Path | None = None) -> list[Path]:
    """Delete the entries in ``folder`` that no key reaches any more (and data files a crashed
    write left without an index); returns what was deleted."""
    gone = []
    for index_file in folder.glob("*.json"):
        entry = index_file.with_suffix(".bin")
        if entry == keep:
            continue
        try:
            stale = _unreachable(json.loads(index_file.read_text()))
        except (OSError, ValueError):
            stale = True
        if stale:
            for f in (entry, index_file):
                try:
                    f.unlink()
                    gone.append(f)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    log.warning("could not delete the stale weight-cache file %s: %s", f, e)
    for orphan in folder.glob("*.bin"):  # an entry whose index never got written (a crash between
        try:                             # the two renames; not one being written now: 10 min old)
            if orphan != keep and not orphan.with_suffix(".json").exists() \
                    and time.time() - orphan.stat().st_mtime > 600:
                orphan.unlink()
                gone.append(orphan)
        except OSError:
            pass
    if gone:
        log.info("weight cache: deleted %d stale file(s)", len(gone))
    return gone


def save(model: torch.nn.Module, file: Path, source: str) -> None:
    """Write ``model``'s state tensors (flat, aligned) and their index; atomic, best effort. Then
    delete the entries no key reaches any more. ``source``: the GGUF the entry was made from."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tensors, offset = {}, 0
        fd, tmp = tempfile.mkstemp(prefix=f".{file.name}.", dir=file.parent)
        with os.fdopen(fd, "wb") as out:
            for name, p in _state(model).items():
                pad = -offset % _ALIGN
                out.write(b"\0" * pad)
                offset += pad
                data = p.detach().contiguous().view(-1).view(torch.uint8).numpy().data
                out.write(data)
                tensors[name] = (str(p.dtype).removeprefix("torch."), list(p.shape), offset)
                offset += data.nbytes
        os.replace(tmp, file)
        index = file.with_suffix(".json")
        tmp_index = index.with_name(f".{index.name}.tmp{os.getpid()}")
        tmp_index.write_text(json.dumps({"nbytes": offset, "tensors": tensors, "format": FORMAT_VERSION,
                                         "source": _source(source)}))
        os.replace(tmp_index, index)
        prune(file.parent, keep=file)
    except OSError as e:
        log.warning("could not write the weight cache %s: %s", file, e)
        try:
            os.unlink(tmp)
        except (OSError, UnboundLocalError):
            pass
