"""Response header names sent as llama-server sends them: ``Content-Type``, ``Access-Control-Allow-Origin``.

HTTP header names are case-insensitive, and Starlette writes them in lower case. Clients that read
headers into a plain dict look for llama-server's spelling (llama.cpp's own server tests do:
``res.headers["Access-Control-Allow-Origin"]``), so this ASGI middleware, outermost, writes each
name with every dash-separated word capitalised. uvicorn keeps the case it is given.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=256)
def canonical(name: bytes) -> bytes:
    return b"-".join(word[:1].upper() + word[1:] for word in name.split(b"-"))


class CanonicalHeaderNames:
    """ASGI middleware: response header names as llama-server spells them (see the module)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_canonical(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [(canonical(k.encode("latin-1") if isinstance(k, str) else bytes(k)), v)
                                                   for k, v in message.get("headers", ())]}
            await send(message)

        await self.app(scope, receive, send_canonical)
