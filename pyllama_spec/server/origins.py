"""Which web pages may talk to the server: requests sent by a browser from another site are refused.

A browser sends a "simple" cross-site request (a POST with ``Content-Type: text/plain``, a form) without
asking the server first, and it carries an ``Origin`` header naming the page's site. Without an API key
any page the user opens could then load LoRA scales, erase slots or fill the queue of a server on
localhost. So a request whose ``Origin`` is neither the server's own (its chat page) nor allowed by
``--cors-origins`` is answered 403, on every route but the health check; requests without an ``Origin``
(curl, the SDKs, scripts) are served as before.

``--cors-origins`` is llama-server's flag, with its values: a comma-separated list of origins,
``localhost`` (pages served from this machine: ``http://localhost:3000``, ``http://127.0.0.1:5173``, ...;
the default here, as in Ollama), or ``*`` (any page: llama-server's default, which it warns about
without an API key). An allowed origin gets llama-server's CORS headers, so that a page there can also
send JSON and an ``Authorization`` header (the preflight ``OPTIONS`` is answered, 200 as llama-server
answers it, with no CORS headers for an origin that is not allowed).
"""

from __future__ import annotations

import dataclasses
import json
from urllib.parse import urlsplit

#: Paths served whatever the origin: the health check holds nothing and changes nothing.
OPEN_PATHS = frozenset({"/health", "/v1/health"})
#: What a preflight allows (llama-server's --cors-methods and --cors-headers defaults).
ALLOW_METHODS = b"GET, POST, DELETE, OPTIONS"
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


@dataclasses.dataclass(frozen=True)
class OriginPolicy:
    """What ``--cors-origins`` allows besides the server's own origin."""

    any_origin: bool = False
    local_origins: bool = True
    origins: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, value: str | None) -> "OriginPolicy":
        """From --cors-origins: "*", "localhost", or origins separated by commas (None: "localhost")."""
        if value is None:
            return cls()
        items = [v.strip().rstrip("/").lower() for v in value.split(",") if v.strip()]
        bad = [v for v in items if v not in ("*", "localhost") and not _is_origin(v)]
        if bad:
            raise ValueError(f"--cors-origins takes '*', 'localhost' or origins like http://example.com:3000, "
                             f"separated by commas; got {bad[0]!r}")
        return cls(any_origin="*" in items, local_origins="localhost" in items,
                   origins=frozenset(v for v in items if v not in ("*", "localhost")))

    def allows(self, origin: str) -> bool:
        origin = origin.rstrip("/").lower()
        if self.any_origin or origin in self.origins:
            return True
        return self.local_origins and _is_local(origin)


def _is_origin(value: str) -> bool:
    parts = urlsplit(value)
    return parts.scheme in ("http", "https") and bool(parts.hostname) and not parts.path and not parts.query


def _is_local(origin: str) -> bool:
    try:
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and parts.hostname in LOCAL_HOSTS
    except ValueError:  # a port that is not a number
        return False


def _same_origin(origin: str, host: str | None) -> bool:
    """The page was served by this server: its origin names the host the request was sent to."""
    if not host:
        return False
    try:
        return urlsplit(origin).netloc.lower() == host.lower()
    except ValueError:
        return False


class CrossSiteGuard:
    """ASGI middleware: refuse requests from origins the policy does not allow (see the module)."""

    def __init__(self, app, policy: OriginPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope.get("headers", ())}
        raw = headers.get(b"origin")
        if raw is None:
            return await self.app(scope, receive, send)
        origin = raw.decode("latin-1")
        host = headers.get(b"host", b"").decode("latin-1")
        if _same_origin(origin, host):
            return await self.app(scope, receive, send)
        allowed = self.policy.allows(origin)
        if scope["method"] == "OPTIONS":  # a preflight: what the page may send next
            # As llama-server answers one: 200, and the CORS headers only for an allowed origin (the
            # browser then sends nothing more). The headers asked for are echoed: a "*" would not
            # cover Authorization.
            cors = [(b"access-control-allow-origin", raw), (b"vary", b"Origin"),
                    (b"access-control-allow-credentials", b"true"),
                    (b"access-control-allow-methods", ALLOW_METHODS),
                    (b"access-control-allow-headers", headers.get(b"access-control-request-headers", b"*")),
                    (b"access-control-max-age", b"600")] if allowed else []
            await send({"type": "http.response.start", "status": 200,
                        "headers": [*cors, (b"content-length", b"0")]})
            return await send({"type": "http.response.body", "body": b""})
        if not allowed:
            if scope["path"] in OPEN_PATHS:
                return await self.app(scope, receive, send)
            return await _refuse(send, origin)
        cors = [(b"access-control-allow-origin", raw), (b"vary", b"Origin"), (b"access-control-allow-credentials", b"true")]

        async def send_with_cors(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *cors]}
            await send(message)

        return await self.app(scope, receive, send_with_cors)


async def _refuse(send, origin: str) -> None:
    shown = origin if len(origin) <= 200 else origin[:200] + "..."
    body = json.dumps({"error": {
        "message": f"a request from the web page at {shown} was refused: this server answers pages from its own "
                   "address and from localhost; start it with --cors-origins ORIGIN (or '*') to allow that site",
        "type": "invalid_request_error", "code": "origin_not_allowed", "param": None}}).encode()
    await send({"type": "http.response.start", "status": 403, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
