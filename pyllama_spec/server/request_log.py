"""A request log, as llama-server's ``log_server_request`` writes one (its ``-v``): each finished
request's method, path, client and status, and at DEBUG its body and the response's.

On the logger ``pyllama_spec.server.requests``, at DEBUG (llama-server's trace and debug levels:
``serve -v`` or ``-lv 4`` show it; the default ``-lv 3`` does not, as llama-server, whose request
log is also off by default). As there, the routes clients poll (/health, /models, /props,
/metrics) are left out. Bodies are logged up to ``BODY_LOG_LIMIT`` characters each, and only
collected while DEBUG is on, so the default costs one level check per request.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("pyllama_spec.server.requests")

#: The routes left out, as llama-server leaves them out (polled by clients and load balancers).
QUIET_PATHS = frozenset({"/health", "/v1/health", "/models", "/v1/models", "/props", "/metrics"})
#: The most characters of a request's or response's body logged.
BODY_LOG_LIMIT = 4096


def _clipped(chunks: list[bytes], size: int) -> str:
    text = b"".join(chunks)[:BODY_LOG_LIMIT].decode("utf-8", errors="replace")
    return text + (f" ... ({size - BODY_LOG_LIMIT} more bytes)" if size > BODY_LOG_LIMIT else "")


class RequestLog:
    """ASGI middleware writing the request log (see the module)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in QUIET_PATHS or not log.isEnabledFor(logging.DEBUG):
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = [0]
        request: list[bytes] = []
        response: list[bytes] = []
        sizes = [0, 0]  # bytes seen of the request's body and of the response's

        def keep(kept: list[bytes], side: int, body: bytes) -> None:
            if sizes[side] < BODY_LOG_LIMIT:  # what is kept is what came before, up to the limit
                kept.append(body[:BODY_LOG_LIMIT - sizes[side]])
            sizes[side] += len(body)

        async def receive_logged():
            message = await receive()
            if message["type"] == "http.request":
                keep(request, 0, message.get("body", b""))
            return message

        async def send_logged(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body":
                keep(response, 1, message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive_logged, send_logged)
        finally:
            client = (scope.get("client") or ("-",))[0]
            log.debug("done request: %s %s %s %d (%.1f ms)", scope["method"], scope["path"], client, status[0],
                      (time.perf_counter() - start) * 1000)
            log.debug("request:  %s", _clipped(request, sizes[0]))
            log.debug("response: %s", _clipped(response, sizes[1]))
