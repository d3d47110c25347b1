"""The routes that describe the server: /v1/models, /health, /props, /metrics, and the chat
page at / with its files under /static/."""

from __future__ import annotations

from pathlib import Path

from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.staticfiles import StaticFiles

from pyllama_spec import __version__
from pyllama_spec.server.service import RouteSpec, Service

#: The chat page's files (HTML, CSS, JavaScript), served at / and /static/.
STATIC_DIR = Path(__file__).parent / "static"
# The page loads nothing from anywhere but this server (pictures the user attaches are data: URIs).
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; connect-src 'self'; "
                               "style-src 'self'; script-src 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def routes(service: Service) -> list[RouteSpec]:
    return [
        *((p, ["GET"], lambda r: _models(service)) for p in ("/v1/models", "/models")),
        *((p, ["GET"], lambda r: _health(service)) for p in ("/health", "/v1/health")),
        ("/props", ["GET"], lambda r: _props(service)),
        ("/metrics", ["GET"], lambda r: _metrics(service)),
        ("/", ["GET"], lambda r: _page()),
    ]


def static_files() -> StaticFiles:
    """The page's files, mounted at /static."""
    return _StaticFiles(directory=STATIC_DIR)


class _StaticFiles(StaticFiles):
    """The page's files, with the page's headers (its content security policy among them)."""

    def file_response(self, *args, **kwargs) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers.update(PAGE_HEADERS)
        return response


async def _page() -> Response:
    return FileResponse(STATIC_DIR / "index.html", headers=PAGE_HEADERS)


async def _models(service: Service) -> Response:
    f = service.facts
    caps = ["completion"] + (["multimodal"] if f["vision"] or f["audio"] else [])
    entry = {"id": service.settings.alias, "object": "model", "created": service.started, "owned_by": "pyllama-spec",
             "capabilities": caps,
             "meta": {"n_ctx": f["n_ctx"], "n_vocab": f["n_vocab"], "n_params": f["n_params"], "size": f["size"],
                      "speculative": service.engine.config.spec_type}}
    return JSONResponse({"object": "list", "data": [entry]})


async def _health(service: Service) -> Response:
    return JSONResponse({"status": "ok"})


async def _props(service: Service) -> Response:
    f, d = service.facts, service.engine.drafter
    return JSONResponse({
        "model_alias": service.settings.alias,
        "model_path": f["model_path"],
        "build_info": f"pyllama-spec {__version__}",
        "total_slots": service.engine.config.n_parallel,
        "chat_template": f["chat_template"],
        "media_marker": f["media_marker"],
        "modalities": {"vision": f["vision"], "audio": f["audio"]},
        "default_generation_settings": {
            "n_ctx": f["n_ctx"], "max_tokens": service.settings.default_max_tokens,
            "speculative": {"type": service.engine.config.spec_type, "n_max": service.engine.draft_max,
                            "n_min": d.n_min if d else 0, "n_max_limit": d.n_max_limit if d else 0,
                            "draft_positions": service.engine.positions.draft_positions,
                            "tree": service.engine.config.draft_tree},
        },
    })


async def _metrics(service: Service) -> Response:
    w = service.worker
    return PlainTextResponse(service.metrics.prometheus(queue_depth=w.queue_depth if w else 0,
                                                        running=w.running if w else 0,
                                                        slots=service.engine.config.n_parallel),
                             media_type="text/plain; version=0.0.4")
