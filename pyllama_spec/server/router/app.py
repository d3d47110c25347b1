"""The router's ASGI app: its own routes (the models, loading and unloading them, their status
events, /health, /props) and llama-server's model routes, proxied to the model a request names."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pyllama_spec.server.errors import APIError, bad_request
from pyllama_spec.server.header_names import CanonicalHeaderNames
from pyllama_spec.server.offload import PARSE_ON_A_THREAD_ABOVE, off_loop
from pyllama_spec.server.origins import CrossSiteGuard
from pyllama_spec.server.router.pool import ModelSpec, ModelState, Router, RouterSettings
from pyllama_spec.server.router.proxy import EventsResponse, ProxyResponse
from pyllama_spec.server.json_body import parse_json_body, takes_steps
from pyllama_spec.server.service import (
    ERROR_HANDLERS,
    check_api_key,
    error_response,
    read_body,
)

# llama-server's router proxies these routes to the model a request names (server.cpp).
PROXIED_POST = ("/props", "/completion", "/completions", "/v1/completions", "/chat/completions",
                "/v1/chat/completions", "/v1/chat/completions/control", "/v1/responses", "/responses",
                "/v1/audio/transcriptions", "/audio/transcriptions", "/v1/messages", "/v1/messages/count_tokens",
                "/infill", "/embedding", "/embeddings", "/v1/embeddings", "/rerank", "/reranking", "/v1/rerank",
                "/v1/reranking", "/tokenize", "/detokenize", "/apply-template", "/chat/completions/input_tokens",
                "/v1/chat/completions/input_tokens", "/responses/input_tokens", "/v1/responses/input_tokens",
                "/lora-adapters", "/slots/{id_slot}")
PROXIED_GET = ("/metrics", "/lora-adapters", "/slots")


def create_router_app(specs: list[ModelSpec], settings: RouterSettings,
                      read_again: Callable[[], list[ModelSpec]] | None = None) -> Starlette:
    """The router's ASGI app; its lifespan starts the load-on-startup models and stops every
    child on shutdown. Raises ValueError for a preset it cannot serve (alias clashes, more
    load-on-startup models than --models-max). ``read_again``: the models as the preset file
    says now, for GET /models?reload=1 (a ValueError for a file that cannot be served); None:
    the models never change."""
    router = Router(specs, settings)

    def route(path: str, methods: list[str], handler) -> Route:
        async def endpoint(request: Request) -> Response:
            try:
                check_api_key(request, settings.api_key)
                return await handler(request)
            except APIError as e:
                return error_response(e)

        return Route(path, endpoint, methods=methods)

    def find(name: str) -> ModelState:
        """The model a request names (llama-server's router_validate_model)."""
        if not name:
            raise bad_request("model name is missing from the request", "model", code="model_missing")
        m = router.names.get(name)
        if m is None:
            raise bad_request(f"model '{name}' not found", "model", code="model_not_found")
        return m

    def autoload(request: Request) -> bool:
        given = request.query_params.get("autoload", "")
        return settings.autoload if not given else given in ("true", "1")

    async def body_of(request: Request) -> tuple[bytes, Any]:
        raw = await read_body(request, settings.max_body_bytes, settings.body_timeout)
        # a large body is parsed off the event loop
        return raw, await off_loop(len(raw) > PARSE_ON_A_THREAD_ABOVE or takes_steps(raw), parse_json_body, raw)

    def model_of(body: Any) -> str:
        name = body.get("model") if isinstance(body, dict) else None
        return name if isinstance(name, str) else ""

    def proxied(request: Request, m: ModelState, raw: bytes) -> Response:
        load = autoload(request)
        if not load and not m.running:
            raise bad_request("model is not loaded", "model", code="model_not_loaded")
        return ProxyResponse(router, m, request, raw, load)

    async def proxy_post(request: Request) -> Response:
        raw, body = await body_of(request)
        return proxied(request, find(model_of(body)), raw)

    async def proxy_get(request: Request) -> Response:
        return proxied(request, find(request.query_params.get("model", "")), b"")

    async def reload() -> None:
        """Read the preset file again and serve what it says now (llama-server's GET
        /models?reload=1). A file that cannot be read or served is a 500 with llama-server's
        error type, and the models stay as they were."""
        if read_again is None:
            return
        try:
            specs = await asyncio.to_thread(read_again)  # file reads (GGUF headers too): off the event loop
            await router.reload(specs)
        except ValueError as e:  # a PresetError, or names that clash
            raise APIError(500, str(e), type="server_error", code="preset_invalid") from None

    async def models(request: Request) -> Response:
        if request.query_params.get("reload", ""):  # any value, as in llama-server
            await reload()
        now = int(time.time())
        return JSONResponse({"data": [router.entry(m, now) for m in router.models.values()], "object": "list"})

    async def load(request: Request) -> Response:
        _, body = await body_of(request)
        m = router.names.get(model_of(body))
        if m is None:
            raise APIError(404, "model is not found", type="not_found_error", code="model_not_found")
        if m.running and not m.stopping:
            raise bad_request("model is already running", "model", code="model_running")
        await router.load(m)
        return JSONResponse({"success": True})

    async def unload(request: Request) -> Response:
        _, body = await body_of(request)
        m = router.names.get(model_of(body))
        if m is None:
            raise bad_request("model is not found", "model", code="model_not_found")
        if not m.running:
            raise bad_request("model is not running", "model", code="model_not_running")
        router.unload(m)
        return JSONResponse({"success": True})

    async def props(request: Request) -> Response:
        if request.query_params.get("model", ""):
            return await proxy_get(request)
        return JSONResponse(router.props())

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def events(request: Request) -> Response:
        return EventsResponse(router)

    async def download(request: Request) -> Response:
        # llama-server downloads a Hugging Face model here; this server reads local files only
        raise APIError(501, "models are not downloaded here: add a section for the file to the --models-preset file",
                       type="not_supported_error", code="not_supported")

    async def remove(request: Request) -> Response:
        name = request.query_params.get("model", "")
        if not name:
            raise bad_request("model must be a non-empty string", "model")
        if name not in router.names:
            raise APIError(500, f"model name={name} is not found", type="server_error", code="model_not_found")
        raise APIError(500, f"model name={name} is not removable (not from cache)", type="server_error",
                       code="not_removable")

    routes = [
        *(route(p, ["GET"], health) for p in ("/health", "/v1/health")),
        *(route(p, ["GET"], models) for p in ("/models", "/v1/models")),
        route("/models", ["POST"], download),
        route("/models", ["DELETE"], remove),
        route("/models/load", ["POST"], load),
        route("/models/unload", ["POST"], unload),
        route("/models/sse", ["GET"], events),
        route("/props", ["GET"], props),
        *(route(p, ["POST"], proxy_post) for p in PROXIED_POST),
        *(route(p, ["GET"], proxy_get) for p in PROXIED_GET),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await router.start()
        try:
            yield
        finally:
            await router.close()

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=ERROR_HANDLERS,
                    middleware=[Middleware(CanonicalHeaderNames),
                                Middleware(CrossSiteGuard, policy=settings.cors_origins)])
    app.state.router = router
    app.state.service = router  # run.py's server calls its cancel_all() on SIGTERM / Ctrl-C
    return app
