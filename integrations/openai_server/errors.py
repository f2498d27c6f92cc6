"""OpenAI's error JSON, {"error": {"message", "type", "param", "code"}}, and how engine exceptions
map onto HTTP statuses."""
from __future__ import annotations

import msgspec

from asyncengine.errors import EngineCoreDied, EngineDeadError, EngineOverloaded, InvalidRequestError, RequestFailedError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          415: "invalid_request_error",
          429: "rate_limit_error", 500: "internal_server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error the API reports to its client with ``status`` and OpenAI's error body."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "api_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def encode(self) -> bytes:
        return msgspec.json.encode(self.body())


def from_engine(exc: BaseException, engine) -> APIError:
    """The API error for an exception out of ``engine.generate`` (or its stream)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):  # RequestLimitError names the field and the limit
        limit = getattr(exc, "limit", None)
        return APIError(400, str(exc), param=getattr(exc, "param", None),
                        code="limit_exceeded" if limit else None)
    if isinstance(exc, EngineCoreDied):  # its data-parallel core died; the others serve a retry
        return APIError(503, str(exc), code="engine_core_dead", headers={"retry-after": "1"})
    if isinstance(exc, RequestFailedError):  # this request alone failed inside the engine
        return APIError(500, str(exc), code="request_failed")
    if isinstance(exc, EngineOverloaded):
        return APIError(429, str(exc), code="engine_overloaded", headers={"retry-after": "1"})
    if isinstance(exc, EngineDeadError):
        if getattr(engine, "errored", False):
            # 503, not 500: the server cannot serve, a supervisor restarts it (cli/serve.py exits
            # non-zero). The first line only: a core's traceback goes to the log, never to clients.
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else "the engine died"
            return APIError(503, first, code="engine_dead")
        # shut down or shutting down: not a fault, the server is going away
        return APIError(503, str(exc), code="shutting_down")
    return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    415: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error"}
ANTHROPIC_PATHS = ("/v1/messages",)


def anthropic_body(e: APIError) -> dict:
    """``e`` in the shape of Anthropic's API: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(e.status, "api_error"), "message": e.message}}


def error_response(e: APIError, path: str = ""):
    """``e`` as a starlette Response: the error body of the API that ``path`` belongs to (OpenAI's,
    or Anthropic's under /v1/messages), the error's status and headers. Here, not in app.py, so
    the security middleware (which app.py installs) can answer with it."""
    from starlette.responses import Response

    body = msgspec.json.encode(anthropic_body(e)) if path.startswith(ANTHROPIC_PATHS) else e.encode()
    return Response(body, status_code=e.status, headers=e.headers, media_type="application/json")
