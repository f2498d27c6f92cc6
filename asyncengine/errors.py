"""The exceptions users catch. Each names the problem in words a user can act on."""


class AsyncEngineError(Exception):
    """Base class of every error this package raises on purpose."""


class InvalidRequestError(AsyncEngineError, ValueError):
    """A request (prompt or sampling parameters) that can never be served; fails only that request."""


class ConfigError(AsyncEngineError, ValueError):
    """An EngineConfig that cannot work (bad sizes, unknown dtype, unsupported model...)."""


class WeightUpdateError(AsyncEngineError, ValueError):
    """An ``update_weights`` that cannot apply (a wrong name, shape or dtype, a missing tensor, an
    unreadable path): nothing changed, the old weights go on serving."""


class ModelLoadError(AsyncEngineError):
    """A checkpoint that is missing, corrupt, or of an architecture we do not implement."""


class EngineOverloaded(AsyncEngineError):
    """The waiting queue is full: retry later (HTTP 429/503). Raised immediately, never after a wait."""


class EngineDeadError(AsyncEngineError):
    """The engine's loop died; every pending and future request fails with this. `__cause__` holds why."""


class RequestFailedError(AsyncEngineError):
    """One request failed inside the engine (e.g. its output could not be detokenized); only that
    request ends with it, the engine and every other request go on. `__cause__` holds why."""


class EngineCoreDied(RequestFailedError):
    """The data-parallel engine core running this request died; the engine goes on with its other
    cores, so a retry is served (HTTP 503)."""
