"""Every configuration type, one module each: the engine's (``engine.py``, ``EngineConfig``), the
attention backends' names (``attention.py``), speculative decoding (``speculative.py``), grammar and
request limits (``grammar_limits.py``, ``request_limits.py``). ``asyncengine.config.EngineConfig``
is the public path."""
from asyncengine.config.engine import EngineConfig, resolve_device, resolve_dtype

__all__ = ["EngineConfig", "resolve_device", "resolve_dtype"]
