"""Which attention backend an engine uses: ``EngineConfig.attention_backend``, resolved against the
table in config/attention.py and against what the model needs, built with the runner's shapes."""
from __future__ import annotations

import importlib
import logging

from asyncengine.attention.backend import AttentionBackend
from asyncengine.config.attention import backend_info, resolve_backend_name
from asyncengine.errors import ConfigError

__all__ = ["get_backend", "get_model_backend", "model_backend_name", "resolve_backend_name"]
logger = logging.getLogger(__name__)


def get_backend(name: str, **kwargs) -> AttentionBackend:
    """Build the backend ``name`` (already resolved, not "auto") with the runner's shapes."""
    return backend_class(name)(**kwargs)


def backend_class(name: str) -> type[AttentionBackend]:
    module, _, cls = backend_info(name).path.partition(":")
    return getattr(importlib.import_module(module), cls)


def _missing(cls: type[AttentionBackend], args) -> list[str]:
    """What the model's attention needs that the backend lacks."""
    missing = []
    if getattr(args, "attn_softcap", None) and not cls.supports_softcap:
        missing.append(f"soft-capping (this model caps its scores at {args.attn_softcap})")
    windows = sorted({w for w in getattr(args, "layer_windows", ()) if w is not None})
    if windows and not cls.supports_sliding_window:
        missing.append(f"sliding-window attention (this model's layers use windows {windows})")
    return missing


def model_backend_name(requested: str, resolved: str, args) -> str:
    """``auto`` must run the model it was given: the device's fastest backend (``resolved``) unless
    it lacks what this model's attention needs (Gemma 2's soft-cap, sliding windows on triton), then
    torch, which has everything, with a log line saying why. A backend named by the user is kept
    (and refused with the reason by :func:`get_model_backend`)."""
    if requested != "auto" or resolved == "torch":
        return resolved
    missing = _missing(backend_class(resolved), args)
    if missing:
        logger.warning("attention_backend=auto: %s has no %s; using torch", resolved, " or ".join(missing))
        return "torch"
    return resolved


def get_model_backend(name: str, args, **kwargs) -> AttentionBackend:
    """The backend ``name`` for this model (its scale already in ``kwargs``): refused with a
    ConfigError saying why where it lacks what the model needs, before any step runs."""
    missing = _missing(backend_class(name), args)
    if missing:
        raise ConfigError(f"attention_backend={name!r} has no {' or '.join(missing)}: "
                          f"use attention_backend='torch' or 'cpu'")
    return get_backend(name, **kwargs)
