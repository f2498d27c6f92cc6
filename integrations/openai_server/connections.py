"""A cap on open API connections: websockets and in-flight ``/v1/`` HTTP requests (streaming or
not) together, ``max_connections`` (``serve --max-connections``). Past it, an HTTP request gets a
503 with ``retry-after`` and a websocket handshake is refused (close code 1013, "try again
later"): each open one holds a task, buffers and possibly a generation, and before this a client
could hold any number of idle websockets for ever (issue 27: 300 sockets). /health, /metrics and
the web page are never counted or refused. The websocket idle timeout is in websocket.py.
"""
from __future__ import annotations

from .errors import APIError


class ConnectionCap:
    """ASGI middleware; ``open`` is the number counted now (read by /metrics and the tests)."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.open = 0
        self.refused = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or not scope.get("path", "").startswith("/v1/"):
            return await self.app(scope, receive, send)
        if self.open >= self.limit:
            self.refused += 1
            if scope["type"] == "websocket":
                await receive()  # websocket.connect
                await send({"type": "websocket.close", "code": 1013, "reason": "too many connections"})
                return
            from .errors import error_response  # lazy: route modules load when the app is built (start-up time)

            err = APIError(503, f"the server has {self.open} connections open, its limit max_connections="
                                f"{self.limit}: retry later", code="too_many_connections",
                           headers={"retry-after": "1"})
            return await error_response(err, scope.get("path", ""))(scope, receive, send)
        self.open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.open -= 1
