"""The ASGI application: the routes of ``chat_completions`` (OpenAI's chat completions),
``completions`` (OpenAI's /v1/completions, llama-server's /completion), ``info`` (/v1/models,
/health, /props, /metrics, the chat page), ``tokens`` (llama-server's /tokenize, /detokenize,
/apply-template, chat input_tokens), ``slots`` (llama-server's /slots and slot
save/restore/erase), ``infill`` (/infill), ``anthropic/`` (Anthropic's /v1/messages and its
count_tokens), ``responses/`` (OpenAI's /v1/responses and its input_tokens) and ``embeddings``
(/embedding, /embeddings, /v1/embeddings with --embeddings, /rerank and its aliases with
--reranking; llama-server's 501 without them), each behind the API-key check, with OpenAI-style errors for everything that goes wrong
(Anthropic-style on Anthropic's routes). A request a browser sends from a site that
``--cors-origins`` does not allow is refused before any route sees it (``origins``).

The app holds a ``Service`` (its ``Worker`` hands each generation to the engine's slot loop,
which runs on a thread of its own) and never touches native objects itself. With
``--sleep-idle-seconds`` every route but a few (``sleep.ANSWERED_ASLEEP``) loads the model first
when it sleeps, and keeps it loaded until its response is sent (``sleep.py``). Build it with
``create_app(engine, ServerSettings(...))`` and run it with any ASGI server (``pyllama-spec
serve`` uses uvicorn).
"""

from __future__ import annotations

import contextlib

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route

from pyllama_spec.server import (chat_completions, completions, embeddings, infill, info, large_bodies, lora, slots,
                                 tokens, vertex)
from pyllama_spec.server.anthropic import routes as anthropic
from pyllama_spec.server.errors import APIError
from pyllama_spec.server.offload import off_loop
from pyllama_spec.server.header_names import CanonicalHeaderNames
from pyllama_spec.server.origins import CrossSiteGuard
from pyllama_spec.server.request_log import RequestLog
from pyllama_spec.server.responses import routes as responses
from pyllama_spec.server.sleep import ANSWERED_ASLEEP
from pyllama_spec.server.service import (
    ERROR_HANDLERS,
    ServerSettings,
    Service,
    engine_error,
    error_response,
    read_json,
)
from pyllama_spec.serving.engine import Engine

__all__ = ["ServerSettings", "create_app"]

#: The modules whose ``routes(service)`` the app serves.
_ROUTE_MODULES = (chat_completions, completions, info, tokens, slots, lora, infill, anthropic, responses,
                  embeddings)


def create_app(engine: Engine, settings: ServerSettings | None = None) -> Starlette:
    """The ASGI app serving ``engine``. Its lifespan starts the Worker (the engine's slot loop on its
    own thread) and stops it."""
    service = Service(engine, settings or ServerSettings())

    def route(path: str, methods: list[str], handler) -> Route:
        vertex_health = service.settings.vertex.health_route if service.settings.vertex else None
        answered_asleep = all((path, m) in ANSWERED_ASLEEP or (path, m) == (vertex_health, "GET") for m in methods)

        async def endpoint(request: Request) -> Response:
            release = None
            try:
                try:
                    service.check_key(request)
                    if not answered_asleep:
                        release = await service.sleep.hold()  # loads the model if it sleeps
                    response = await handler(request)
                except APIError as e:
                    response = error_response(e)
                except Exception as e:  # noqa: BLE001 - never a traceback to the client
                    response = error_response(engine_error(e))
                # With --sleep-idle-seconds the routes answered asleep are not counted: while asleep
                # /metrics shows what it showed when the model was unloaded (as llama-server's), and
                # they go on being polled.
                if not (answered_asleep and service.sleep.enabled):
                    service.metrics.count_request(path, response.status_code)
                if release is not None:  # a stream still reads the model after this returns
                    response, release = _Held(response, release), None
                return response
            finally:
                if release is not None:
                    release()
                large_bodies.free(request)  # the handler's frame is gone: a large body's last holder is the request

        return Route(path, endpoint, methods=methods)

    specs = [spec for module in _ROUTE_MODULES for spec in module.routes(service)]
    if service.settings.vertex is not None:  # Vertex AI's prediction route, over the others (vertex.py)
        async def read_body(request: Request):
            return await read_json(request, service.settings.max_body_bytes, service.settings.body_timeout)

        specs += vertex.routes(service.settings.vertex, specs, read_body, engine_error)
    routes = [route(*spec) for spec in specs]
    routes.append(Mount("/static", app=info.static_files(), name="static"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.start()
        try:
            yield
        finally:
            await service.sleep.stop()
            await off_loop(True, service.stop)  # it waits for the generations to end

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=ERROR_HANDLERS,
                    middleware=[Middleware(CanonicalHeaderNames), Middleware(RequestLog),
                                Middleware(CrossSiteGuard, policy=service.settings.cors_origins)])
    app.state.service = service
    return app


class _Held:
    """A response that keeps the model loaded (``IdleSleep.hold``) until it has been sent: a stream
    formats its pieces with the model, and a client may read slowly."""

    def __init__(self, response: Response, release) -> None:
        self.response, self.release = response, release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.release()
