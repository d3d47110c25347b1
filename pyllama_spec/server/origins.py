"""Which web pages may talk to the server: requests sent by a browser from another site are refused.

A browser sends a "simple" cross-site request (a POST with ``Content-Type: text/plain``, a form, an
``<img>``'s GET) without asking the server first. Without an API key any page the user opens could then
set LoRA scales, erase slots, fill the queue or make a router load models on a server on localhost. So,
on every route but the health check:

* a request whose ``Origin`` is neither the server's own (its chat page) nor allowed by ``--cors-origins``
  is answered 403;
* a request without an ``Origin`` that the browser marks ``Sec-Fetch-Site: cross-site`` (or
  ``same-site`` where pages on this machine are not allowed) is answered 403;
* on a server listening on a loopback address (the default), a request whose ``Host`` is not a
  loopback address or ``localhost`` is answered 403: a page whose name an attacker re-pointed at
  127.0.0.1 (DNS rebinding) would otherwise be "the server's own" origin.

Requests without these headers (curl, the SDKs, scripts) are served as before.

``--cors-origins`` is llama-server's flag, with its values: a comma-separated list of origins,
``localhost`` (pages served from this machine: ``http://localhost:3000``, ``http://127.0.0.1:5173``, ...;
the default here, as in Ollama), or ``*`` (any page: llama-server's default, which it warns about
without an API key). An allowed origin gets llama-server's CORS headers, so that a page there can also
send JSON and an ``Authorization`` header (the preflight ``OPTIONS`` is answered, 200 as llama-server
answers it, with no CORS headers for an origin that is not allowed).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
from typing import Sequence
from urllib.parse import urlsplit

#: Paths served whatever the origin: the health check holds nothing and changes nothing.
OPEN_PATHS = frozenset({"/health", "/v1/health"})
#: What a preflight allows (llama-server's --cors-methods and --cors-headers defaults).
ALLOW_METHODS = b"GET, POST, DELETE, OPTIONS"


@dataclasses.dataclass(frozen=True)
class OriginPolicy:
    """What ``--cors-origins`` allows besides the server's own origin."""

    any_origin: bool = False
    local_origins: bool = True
    origins: frozenset[str] = frozenset()
    # the server listens on a loopback address: only requests naming a loopback Host are served
    loopback_host: bool = False

    @classmethod
    def parse(cls, value: str | None, *, listen_host: str | Sequence[str] | None = None) -> "OriginPolicy":
        """From --cors-origins: "*", "localhost", or origins separated by commas (None: "localhost"),
        for a server listening on ``listen_host`` (--host: one address, or several). The Host check
        holds when every TCP address is a loopback one (a UNIX socket path, ``*.sock``, is local)."""
        hosts = [listen_host] if isinstance(listen_host, str) else list(listen_host or ())
        tcp = [h for h in hosts if not h.endswith(".sock")]
        loopback = bool(tcp) and all(_is_loopback(h) for h in tcp)
        if value is None:
            return cls(loopback_host=loopback)
        items = [_normal(v.strip()) for v in value.split(",") if v.strip()]
        bad = [v for v in items if v not in ("*", "localhost") and not _is_origin(v)]
        if bad:
            raise ValueError(f"--cors-origins takes '*', 'localhost' or origins like http://example.com:3000, "
                             f"separated by commas; got {bad[0]!r}")
        return cls(any_origin="*" in items, local_origins="localhost" in items,
                   origins=frozenset(v for v in items if v not in ("*", "localhost")), loopback_host=loopback)

    def allows_host(self, host: str) -> bool:
        """A request for ``host`` (a Host header's name) is served: any on a server that does not listen on
        loopback; there, a loopback name or address, or a name an allowed origin has (a reverse proxy that
        keeps the Host it was asked for)."""
        if not self.loopback_host or self.any_origin or _is_loopback(host):
            return True
        return any(urlsplit(o).hostname == host.rstrip(".").lower() for o in self.origins)

    def allows(self, origin: str) -> bool:
        origin = _normal(origin)
        if self.any_origin or origin in self.origins:
            return True
        return self.local_origins and _is_local(origin)


def _normal(origin: str) -> str:
    """An origin as compared: lower case, no trailing slash, no default port (a browser sends none)."""
    origin = origin.rstrip("/").lower()
    for scheme, port in (("http://", ":80"), ("https://", ":443")):
        if origin.startswith(scheme) and origin.endswith(port) and "/" not in origin[len(scheme):]:
            return origin[: -len(port)]
    return origin


def _is_loopback(host: str) -> bool:
    """``host`` (a name or an address, without a port) is this machine's loopback."""
    host = host.strip("[]").rstrip(".").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def _host_name(host: str) -> str:
    """The name in a Host header, without its port."""
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_origin(value: str) -> bool:
    parts = urlsplit(value)
    return parts.scheme in ("http", "https") and bool(parts.hostname) and not parts.path and not parts.query


def _is_local(origin: str) -> bool:
    try:
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and parts.hostname is not None and _is_loopback(parts.hostname)
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
        host = headers.get(b"host", b"").decode("latin-1")
        path = scope["path"]
        open_path = path in OPEN_PATHS
        if host and not open_path and not self.policy.allows_host(_host_name(host)):
            return await _refuse(send, "host_not_allowed", f"a request for the host {_shown(host)} was refused: this "
                                 "server listens on a loopback address and answers requests for localhost or "
                                 "127.0.0.1 (another name pointed at this machine is how a web page gets in); "
                                 "behind a reverse proxy that keeps the name, allow it with --cors-origins "
                                 "http://NAME")
        if raw is None:
            site = headers.get(b"sec-fetch-site", b"").decode("latin-1").lower()
            # following a link to the chat page from another site is a top-level navigation: it is served
            page = scope["method"] in ("GET", "HEAD") and (path == "/" or path.startswith("/static/")) \
                and headers.get(b"sec-fetch-mode", b"").decode("latin-1").lower() == "navigate"
            if not open_path and not page and (site == "cross-site" and not self.policy.any_origin or
                                               site == "same-site" and not (self.policy.any_origin
                                                                            or self.policy.local_origins)):
                return await _refuse(send, "origin_not_allowed", f"a {site} request from a web page was refused: "
                                     "this server answers pages from its own address and from localhost; start it "
                                     "with --cors-origins '*' to allow any site")
            return await self.app(scope, receive, send)
        origin = raw.decode("latin-1")
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
            if open_path:
                return await self.app(scope, receive, send)
            return await _refuse(send, "origin_not_allowed", f"a request from the web page at {_shown(origin)} was "
                                 "refused: this server answers pages from its own address and from localhost; start "
                                 "it with --cors-origins ORIGIN (or '*') to allow that site")
        cors = [(b"access-control-allow-origin", raw), (b"vary", b"Origin"), (b"access-control-allow-credentials", b"true")]

        async def send_with_cors(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *cors]}
            await send(message)

        return await self.app(scope, receive, send_with_cors)


def _shown(text: str) -> str:
    return text if len(text) <= 200 else text[:200] + "..."


async def _refuse(send, code: str, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": code,
                                 "param": None}}).encode()
    await send({"type": "http.response.start", "status": 403, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
