"""A request passed to its model's process and the answer passed back as it arrives
(``ProxyResponse``), and GET /models/sse's status events (``EventsResponse``); either ends when
its client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import httpx
from starlette.requests import Request
from starlette.responses import Response

from pyllama_spec.server.errors import APIError
from pyllama_spec.server.offload import until_disconnected
from pyllama_spec.server.router.child import Child
from pyllama_spec.server.router.pool import LOADED, LOADING, ModelState, Router, not_running

log = logging.getLogger("pyllama_spec.server.router")

#: Headers not passed between the client and a child: hop-by-hop ones, the ones httpx or
#: uvicorn set again, the client's key (the child gets its own), compression (passed through raw).
_REQUEST_HEADERS_DROPPED = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade",
                            "te", "trailer", "proxy-authorization", "proxy-connection", "accept-encoding",
                            "authorization", "x-api-key",
                            # checked by the router (server/origins.py): the child would judge them against
                            # its own address
                            "origin", "sec-fetch-site", "sec-fetch-mode", "sec-fetch-dest", "sec-fetch-user"}
_RESPONSE_HEADERS_DROPPED = {"server", "date", "transfer-encoding", "content-length", "connection", "keep-alive"}


async def _race_disconnect(work, scope, receive) -> None:
    """Run ``work`` until it ends or the client goes away (then it is cancelled)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(until_disconnected(Request(scope, receive)))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, gone):
            t.cancel()
        results = await asyncio.gather(task, gone, return_exceptions=True)
    if isinstance(results[0], Exception) and not isinstance(results[0], OSError):
        log.error("proxying failed", exc_info=results[0])


async def _send_error(send, e: APIError) -> None:
    body = json.dumps(e.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in e.headers.items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class ProxyResponse(Response):
    """The answer of ``model``'s child to this request, loading the model first when
    ``autoload``; passed on as it arrives, and abandoned (the connection to the child closed)
    when the client goes away."""

    def __init__(self, router: Router, m: ModelState, request: Request, body: bytes, autoload: bool) -> None:
        self.router, self.m, self.request, self.body_bytes, self.autoload = router, m, request, body, autoload
        self.status_code = 200  # set from the child's answer (for logs; the ASGI messages carry it)

    async def __call__(self, scope, receive, send) -> None:
        await _race_disconnect(self._answer(scope, send), scope, receive)

    async def _answer(self, scope, send) -> None:
        router, m, started = self.router, self.m, False
        try:
            if self.autoload:
                await router.ensure_ready(m)
            elif m.status == LOADING and not m.stopping:
                # llama-server's child answers this while it loads
                raise APIError(503, "Loading model", type="unavailable_error", code="loading")
            if m.status != LOADED or m.stopping:
                raise not_running(m)
            with router.using(m, touch=scope["method"] == "POST"):
                child = m.child
                target = scope.get("raw_path") or scope["path"].encode()  # path and query as the client wrote them
                if scope.get("query_string"):
                    target += b"?" + scope["query_string"]
                url = httpx.URL(child.url).copy_with(raw_path=target)
                headers = [(k, v) for k, v in self.request.headers.raw
                           if k.decode("latin-1").lower() not in _REQUEST_HEADERS_DROPPED]
                headers.append((b"authorization", f"Bearer {child.key}".encode()))
                upstream_request = router.client.build_request(scope["method"], url, headers=headers,
                                                               content=self.body_bytes)
                try:
                    upstream = await router.client.send(upstream_request, stream=True)
                except httpx.HTTPError as e:
                    raise await _child_gone(m, child, e) from None
                try:
                    self.status_code = upstream.status_code
                    out = [(k, v) for k, v in upstream.headers.raw
                           if k.decode("latin-1").lower() not in _RESPONSE_HEADERS_DROPPED]
                    await send({"type": "http.response.start", "status": upstream.status_code, "headers": out})
                    started = True
                    try:
                        async for chunk in upstream.aiter_raw():
                            await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    except httpx.HTTPError as e:  # the child went away mid-answer: the answer ends there
                        log.warning("model %s stopped answering: %s", m.spec.name, e)
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                finally:
                    await upstream.aclose()  # on a client that left, this closes the child's connection
        except Exception as e:
            if not isinstance(e, APIError):
                log.error("proxying to model %s failed", m.spec.name, exc_info=e)
                e = APIError(500, f"internal error ({type(e).__name__})", type="server_error")
            if not started:
                self.status_code = e.status
                await _send_error(send, e)


async def _child_gone(m: ModelState, child: Child, e: Exception) -> APIError:
    """The error for a request whose child could not be reached (it crashed or is stopping)."""
    proc = child.proc
    if proc is not None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proc.wait(), 2.0)  # let its exit (and its last lines) be recorded
    reason = "\n".join(child.tail) if proc is not None and proc.returncode not in (None, 0) else ""
    what = f"exited with status {proc.returncode}" if proc is not None and proc.returncode is not None \
        else f"cannot be reached ({type(e).__name__})"
    return APIError(500, f"model name={m.spec.name} {what}" + (f": {reason}" if reason else ""),
                    type="server_error", code="model_failed")


class EventsResponse(Response):
    """GET /models/sse: ``data: {...}`` per status change, until the client or the router goes."""

    media_type = "text/event-stream"

    def __init__(self, router: Router) -> None:
        self.router, self.status_code = router, 200

    async def __call__(self, scope, receive, send) -> None:
        sub = self.router.subscribe()

        async def stream() -> None:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
            while True:
                while sub.events:
                    data = json.dumps(sub.events.popleft(), separators=(",", ":"))
                    await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(),
                                "more_body": True})
                if sub.closed:
                    break
                sub.ready.clear()
                await sub.ready.wait()
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await _race_disconnect(stream(), scope, receive)
        finally:
            sub.close()
