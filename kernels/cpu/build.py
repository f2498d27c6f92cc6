"""Build the C kernels of this folder into one shared library, once per (sources, compiler, CPU).

The cache key hashes the sources, the compiler's version and the flags, and the CPU's SIMD flags,
so a machine of another kind, or an edited source, gets its own build. The library lives in
``$ASYNCENGINE_CACHE/kernels`` (default ``~/.cache/asyncengine/kernels``), written atomically under
a file lock, so concurrent first uses (worker processes, test runs) build it once.

``ASYNCENGINE_CPU_KERNELS=0`` turns the kernels off (the torch fallbacks then run): tests use it to
cover the fallback, and a user can use it to rule the kernels out. ``ASYNCENGINE_CPU_ISA`` (set as
the library loads, below; ``isa.py`` is the API) forces the dense kernels' instruction set.
"""
from __future__ import annotations

import ctypes
import fcntl
import glob
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_error: str | None = None


def _sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.c"))


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _flags() -> list[str]:
    """-march=native where the compiler takes it (the kernels pick their SIMD path from the macros
    it defines); plain -O3 otherwise. OpenMP always: the kernels split their rows over threads."""
    return ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11", "-ffp-contract=fast"]


def _cache_root() -> Path:
    if explicit := os.environ.get("ASYNCENGINE_CACHE"):
        return Path(explicit).expanduser() / "kernels"
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "asyncengine" / "kernels"
    return Path.home() / ".cache" / "asyncengine" / "kernels"


def _key(cc: str) -> str:
    h = hashlib.sha256()
    for src in _sources() + sorted(SOURCE_DIR.glob("*.h")):  # headers too: an edited one must rebuild
        h.update(src.name.encode())
        h.update(src.read_bytes())
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = cc
    h.update(version.encode())
    h.update(" ".join(_flags()).encode())
    h.update(" ".join(sorted(f for f in _cpu_flags() if f.startswith(("avx", "fma", "f16c", "amx", "sse")))).encode())
    return h.hexdigest()[:16]


def _torch_gomp() -> list[str]:
    """Link torch's own libgomp when it ships one, so one OpenMP runtime serves both."""
    try:
        import torch

        found = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*"))
    except Exception:
        found = []
    if not found:
        return []
    lib = found[0]
    return [f"-L{os.path.dirname(lib)}", f"-Wl,-rpath,{os.path.dirname(lib)}"]


def _build(cc: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(str(target) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return
        t0 = time.perf_counter()
        print(f"asyncengine: compiling the CPU kernels for this machine (once; cached in {target.parent})",
              file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            cmd = [cc, *_flags(), *map(str, _sources()), "-o", str(out), *_torch_gomp(), "-lm"]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if res.returncode != 0 and "-march=native" in cmd:  # a compiler without it
                cmd.remove("-march=native")
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if res.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
            os.replace(out, target)
        log.info("CPU kernels built in %.1f s: %s", time.perf_counter() - t0, target)


def load() -> ctypes.CDLL | None:
    """The kernels' library, built on first use; None when disabled or unbuildable (the reason:
    :func:`build_error`)."""
    global _lib, _tried, _error
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            if os.environ.get("ASYNCENGINE_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
                raise RuntimeError("turned off by ASYNCENGINE_CPU_KERNELS=0")
            cc = _compiler()
            if cc is None:
                raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
            import torch  # noqa: F401  (loads torch's libgomp first, so ours resolves to it)

            target = _cache_root() / f"asyncengine_cpu_{_key(cc)}.so"
            if not target.exists():
                _build(cc, target)
            _lib = ctypes.CDLL(str(target))
            _apply_isa_env(_lib)
        except Exception as exc:
            if isinstance(exc, IsaError):  # a misspelt or impossible ASYNCENGINE_CPU_ISA is an error
                _lib = None
                raise  # no compiler, a failed build: the torch paths run instead
            _error = str(exc)
            _lib = None
            log.warning("CPU kernels unavailable, using the torch fallbacks: %s", exc)
        _tried = True
        return _lib


def available() -> bool:
    return load() is not None


# The dense kernels' instruction-set levels (isa.c), in order: each runs every path below it.
# kernels/cpu/isa.py is the API; the level named by ASYNCENGINE_CPU_ISA is set here, as the library
# loads, before any kernel runs.
ISAS = ("scalar", "avx2", "avx512_vnni", "avx512_bf16", "amx_bf16")


class IsaError(ValueError):
    """An ISA this CPU cannot execute, or an unknown name."""


def bind_isa(lib) -> None:
    if not hasattr(lib, "_ae_isa_ready"):
        for name, args in (("ae_isa_cpu", []), ("ae_isa_get", []), ("ae_isa_set", [ctypes.c_int])):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        lib._ae_isa_ready = True


def set_isa_level(lib, name: str, what: str) -> str:
    """Use level ``name`` (or ``"auto"``); returns the level now in use; IsaError where it cannot."""
    bind_isa(lib)
    if name != "auto" and name not in ISAS:
        raise IsaError(f"{what}={name!r}: expected auto or one of {', '.join(ISAS)}")
    if lib.ae_isa_set(-1 if name == "auto" else ISAS.index(name)) < 0:
        raise IsaError(f"{what}={name}: this CPU (or its OS) cannot execute it; the best it can is "
                       f"{ISAS[lib.ae_isa_cpu()]}")
    return ISAS[lib.ae_isa_get()]


def _apply_isa_env(lib) -> None:
    want = os.environ.get("ASYNCENGINE_CPU_ISA", "auto").strip().lower() or "auto"
    if want != "auto":
        set_isa_level(lib, want, "ASYNCENGINE_CPU_ISA")


def bind(signatures: dict[str, list], lib: ctypes.CDLL | None = None) -> dict | bool:
    """The library's functions named in ``signatures`` (name -> ctypes argtypes; they return
    nothing), or False where the library is not built: what each kernel module caches. ``lib``:
    another build of it instead (benchmarks/kernel_builds_ab.py compares two)."""
    lib = lib if lib is not None else load()
    if lib is None:
        return False
    fns = {}
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
        fns[name] = fn
    return fns


class LazyBinding:
    """A kernel module's functions, bound on first use (:func:`bind`) and cached: the dict of them,
    or False where the library is not built. ``lib()`` returns that; ``reset()`` forgets it (tests
    that switch the kernels off and on)."""

    def __init__(self, signatures: dict[str, list]) -> None:
        self.signatures = signatures
        self._fns: dict | bool | None = None

    def __call__(self) -> dict | bool:
        if self._fns is None:
            self._fns = bind(self.signatures)
        return self._fns

    def available(self) -> bool:
        return bool(self())

    def reset(self) -> None:
        self._fns = None


def build_error() -> str | None:
    return _error


def _reset_for_tests() -> None:
    global _lib, _tried, _error
    with _lock:
        _lib, _tried, _error = None, False, None
