"""What keeps other web pages, other hosts' names and keyless clients out (ASGI middleware), and
keys out of the logs.

Checked in this order, before any handler runs:

1. **Host allow-list** (DNS rebinding: a page on ``evil.example`` whose name is made to resolve to
   127.0.0.1 would otherwise be "same origin" with this server). Default: the loopback names when
   bound to a loopback address; the bound address itself otherwise (any IP literal and this
   machine's name when bound to every interface); ``allowed_hosts`` adds names, ``"*"`` allows all.
2. **Origin** on websockets and on state-changing requests (anything but GET/HEAD/OPTIONS): a
   browser always sends it; it must be this server's own origin or one of ``allowed_origins``.
   Clients that are not browsers send none and are not affected.
3. **Content-Type: application/json** on POST (a cross-site ``text/plain`` form post needs no CORS
   preflight; a JSON one does, and CORS is off unless ``allowed_origins`` is set).
4. **API key** (when set) on everything but ``/health`` and the static chat page (``/metrics``
   too, unless ``metrics_public``): ``Authorization: Bearer <key>``, or for websockets (browsers
   cannot set headers on them) the subprotocol ``asyncengine.key.<base64url(key)>`` next to
   ``asyncengine.v1``; ``x-api-key: <key>`` as Anthropic's clients send it. Never a query
   parameter: URLs end up in logs. Compared in constant time.
"""
from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import logging
import re
import socket
from urllib.parse import urlsplit

from .errors import APIError, error_response

WS_PROTOCOL = "asyncengine.v1"
WS_KEY_PREFIX = "asyncengine.key."
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "localhost.localdomain")
PUBLIC_PATHS = frozenset({"/health", "/", "/chat", "/chat.js"})  # no data: the page asks for the key
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def default_allowed_hosts(bind_host: str) -> frozenset[str]:
    """The Host names a server bound to ``bind_host`` answers to by default."""
    h = bind_host.strip("[]").lower()
    if h in ("localhost", "") or (_is_ip(h) and ipaddress.ip_address(h).is_loopback):
        return frozenset(LOOPBACK_HOSTS)
    if h in ("0.0.0.0", "::"):
        names = set(LOOPBACK_HOSTS) | {"<ip>"}
        for n in (socket.gethostname(), socket.getfqdn()):
            if n:
                names.add(n.lower())
        return frozenset(names)
    return frozenset({h})


def split_host(value: str) -> str:
    """``host[:port]`` / ``[v6]:port`` -> host, lowercased."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        return value.split(":", 1)[0]
    return value


class SecurityPolicy:
    def __init__(self, api_key: str | None, *, allowed_hosts=None, allowed_origins=(), bind_host: str = "127.0.0.1",
                 metrics_public: bool = False) -> None:
        self.api_key = api_key.encode("utf-8") if api_key else None
        hosts = set(default_allowed_hosts(bind_host)) | {h.strip().strip("[]").lower() for h in allowed_hosts or ()}
        self.any_host = "*" in hosts
        self.any_ip = "<ip>" in hosts
        self.allowed_hosts = frozenset(hosts - {"*", "<ip>"})
        origins = {o.rstrip("/").lower() for o in allowed_origins}
        self.any_origin = "*" in origins
        self.allowed_origins = frozenset(origins - {"*"})
        self.metrics_public = metrics_public

    # ---- the checks (None = fine, else the APIError to answer)

    def check_host(self, headers: dict[bytes, bytes]) -> APIError | None:
        if self.any_host:
            return None
        raw = headers.get(b"host")
        host = split_host(raw.decode("latin-1")) if raw else ""
        if host in self.allowed_hosts or (self.any_ip and _is_ip(host)):
            return None
        return APIError(403, f"Host {host[:100]!r} is not allowed (DNS rebinding protection); start the server "
                             f"with --allowed-hosts to add it", code="host_not_allowed")

    def check_origin(self, headers: dict[bytes, bytes]) -> APIError | None:
        raw = headers.get(b"origin")
        if raw is None:
            return None  # not a browser
        origin = raw.decode("latin-1").strip().rstrip("/").lower()
        if self.any_origin or origin in self.allowed_origins:
            return None
        host = (headers.get(b"host") or b"").decode("latin-1").strip().lower()
        parts = urlsplit(origin)
        if parts.scheme in ("http", "https") and host and parts.netloc == host:
            return None  # same origin: the page this server served
        return APIError(403, f"Origin {origin[:100]!r} is not allowed; start the server with --allowed-origins "
                             f"to allow it", code="origin_not_allowed")

    def needs_key(self, path: str) -> bool:
        if self.api_key is None or path in PUBLIC_PATHS:
            return False
        return not (self.metrics_public and path == "/metrics")

    def authorized(self, scope, headers: dict[bytes, bytes]) -> bool:
        given = b""
        auth = headers.get(b"authorization")
        if auth is not None:
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() == b"bearer":
                given = token.strip()
        if not given:
            given = headers.get(b"x-api-key", b"").strip()  # Anthropic's clients
        if not given and scope["type"] == "websocket":
            given = ws_key(headers) or b""
        return hmac.compare_digest(given, self.api_key)


def ws_protocols(headers: dict[bytes, bytes]) -> list[str]:
    raw = headers.get(b"sec-websocket-protocol", b"").decode("latin-1")
    return [p.strip() for p in raw.split(",") if p.strip()]


def ws_key(headers: dict[bytes, bytes]) -> bytes | None:
    for p in ws_protocols(headers):
        if p.startswith(WS_KEY_PREFIX):
            b64 = p[len(WS_KEY_PREFIX):]
            try:
                return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4))
            except (binascii.Error, ValueError):
                return None
    return None


def _headers(scope) -> dict[bytes, bytes]:
    out: dict[bytes, bytes] = {}
    for k, v in scope.get("headers", ()):
        if k in out:  # repeated: joined, as HTTP does (a second Host would be a smuggling attempt)
            out[k] = out[k] + b"," + v if k != b"host" else b"\0invalid"
        else:
            out[k] = v
    return out


def _json_type(value: bytes | None) -> bool:
    if not value:
        return False
    media = value.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


class SecurityMiddleware:
    def __init__(self, app, policy: SecurityPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        p = self.policy
        headers = _headers(scope)
        is_ws = scope["type"] == "websocket"
        method = scope.get("method", "GET")
        err = p.check_host(headers)
        if err is None and (is_ws or method not in _SAFE_METHODS):
            err = p.check_origin(headers)
        if err is None and method == "POST" and not _json_type(headers.get(b"content-type")):
            err = APIError(415, "Content-Type must be application/json", code="unsupported_media_type")
        if err is None and p.needs_key(scope.get("path", "")) and not p.authorized(scope, headers):
            err = APIError(401, "Incorrect API key provided: send it as 'Authorization: Bearer <key>' or "
                                "'x-api-key: <key>' (websockets: the subprotocol "
                                f"'{WS_KEY_PREFIX}<base64url key>').", code="invalid_api_key")
        if err is None:
            return await self.app(scope, receive, send)
        if is_ws:  # refuse the handshake (an HTTP 403 to the client)
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008, "reason": err.code or "forbidden"})
            return
        await error_response(err, scope.get("path", ""))(scope, receive, send)


# ---------------------------------------------------------------- logs

_SECRET_QUERY = re.compile(r"(?i)([?&](?:api[_-]?key|key|token|access[_-]?token|secret|password|auth)=)[^&#\s]*")


def redact(text: str) -> str:
    """A URL (or a log line) with the values of secret-looking query parameters replaced."""
    return _SECRET_QUERY.sub(r"\1[REDACTED]", text)


class RedactQuerySecrets(logging.Filter):
    """On uvicorn's access log: ``?api_key=...`` (and the like) never reach a log file."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.msg, str):
            record.msg = redact(record.msg)
        return True


def install_log_redaction() -> None:
    """On uvicorn's access log and its error log (where a refused websocket handshake is logged
    with its URL, ``?api_key=`` included) and on ours."""
    for name in ("uvicorn.access", "uvicorn.error", "asyncengine.integrations.openai_server"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactQuerySecrets) for f in logger.filters):
            logger.addFilter(RedactQuerySecrets())
