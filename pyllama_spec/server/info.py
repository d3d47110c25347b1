"""The routes that describe the server: /v1/models, /health, /props (and POST /props),
/metrics, and the chat page at / with its files under /static/."""

from __future__ import annotations

from pathlib import Path

from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.staticfiles import StaticFiles

from pyllama_spec import __version__
from pyllama_spec.server.errors import APIError, bad_request
from pyllama_spec.server.json_body import parse_json_body
from pyllama_spec.server.service import RouteSpec, Service, read_body
from pyllama_spec.server.llama_fields import generation_params

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
    asleep = {}  # /props's body as the model was unloaded (--sleep-idle-seconds), answered until it wakes
    service.before_sleep.append(lambda: asleep.update(props=_props_body(service, is_sleeping=True)))
    return [
        *((p, ["GET"], lambda r: _models(service)) for p in ("/v1/models", "/models")),
        *((p, ["GET"], lambda r: _health(service)) for p in ("/health", "/v1/health")),
        ("/props", ["GET"], lambda r: _props(service, asleep)),
        ("/props", ["POST"], lambda r: _set_props(service, r)),
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
    """llama-server's answer: OpenAI's ``data`` and, beside it, the ``models`` list (Ollama's
    shape) that llama-server also gives. ``meta.n_ctx`` is a slot's context, as there; ``meta``
    lacks llama-server's ``vocab_type`` and ``ftype`` (not read here), and ``data`` entries also
    carry ``capabilities`` and ``meta.speculative`` (extensions)."""
    f, alias = service.facts, service.settings.alias
    caps = ["completion"] + (["multimodal"] if f["vision"] or f["audio"] else [])
    names = list(service.settings.aliases) or [alias]
    entry = {"id": alias, "aliases": names, "tags": list(service.settings.tags), "object": "model",
             "created": service.started,
             "owned_by": "pyllama-spec", "capabilities": caps,
             "meta": {"n_vocab": f["n_vocab"], "n_ctx": f["n_ctx_slot"], "n_ctx_train": f["n_ctx_train"],
                      "n_embd": f["n_embd"], "n_params": f["n_params"], "size": f["size"],
                      "speculative": service.engine.config.spec_type}}
    model = {"name": alias, "model": alias, "modified_at": "", "size": "", "digest": "", "type": "model",
             "description": "", "tags": [""], "capabilities": caps, "parameters": "",
             "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                         "parameter_size": "", "quantization_level": ""}}
    return JSONResponse({"models": [model], "object": "list", "data": [entry]})


async def _health(service: Service) -> Response:
    return JSONResponse({"status": "ok"})


async def _props(service: Service, asleep: dict) -> Response:
    """llama-server's fields that apply (it also gives model_ftype and ui_settings: not read
    here), and this project's: ``default_generation_settings`` also holds ``max_tokens`` and the
    ``speculative`` settings (the chat page reads them). While the model sleeps, the body it had
    when it was unloaded, with ``is_sleeping``: the engine is closed."""
    if service.sleep.asleep:
        return JSONResponse(asleep["props"])
    return JSONResponse(_props_body(service, is_sleeping=False))


def _props_body(service: Service, *, is_sleeping: bool) -> dict:
    f, d, settings = service.facts, service.engine.drafter, service.settings
    chat = service.engine.chat
    tool_use = {"chat_template_tool_use": chat.tool_use_source} if chat.use_jinja and chat.tool_use_source else {}
    return {
        **tool_use,
        "chat_template_caps": chat.caps,
        # this project's: how tools reach the model ("generic": the template cannot render them, so
        # they are described in the system message and the answer is JSON: serving/generic_tools.py)
        "tool_call_format": chat.tool_format,
        "model_alias": settings.alias,
        "model_path": f["model_path"],
        "build_info": f"pyllama-spec {__version__}",
        "total_slots": service.engine.config.n_parallel,
        "chat_template": f["chat_template"],
        "bos_token": f["bos_token"],
        "eos_token": f["eos_token"],
        "media_marker": f["media_marker"],
        "modalities": {"vision": f["vision"], "video": False, "audio": f["audio"]},
        "endpoint_slots": settings.endpoint_slots,
        "endpoint_props": settings.endpoint_props,
        "endpoint_metrics": True,  # always served here
        "ui": True,  # the chat page at /
        "is_sleeping": is_sleeping,
        "cors_proxy_enabled": False,
        "default_generation_settings": {
            "params": generation_params(service, service.default_request, False),
            "n_ctx": f["n_ctx_slot"], "max_tokens": settings.default_max_tokens,
            "speculative": {"type": service.engine.config.spec_type, "n_max": service.engine.draft_max,
                            "n_min": d.n_min if d else 0, "n_max_limit": d.n_max_limit if d else 0,
                            "draft_positions": service.engine.positions.draft_positions,
                            "tree": service.engine.config.draft_tree},
        },
    }


async def _set_props(service: Service, request) -> Response:
    """llama-server's POST /props: only with --props, and it changes nothing (its pin has no
    property to change). An empty body or {} is answered as there; a property named is refused
    here (a 400 saying nothing can change), where llama-server says success and ignores it."""
    if not service.settings.endpoint_props:
        raise APIError(501, "This server does not support changing global properties. Start it with `--props`",
                       type="not_supported_error", code="not_supported")
    raw = await read_body(request, 64 * 1024, service.settings.body_timeout)  # no property needs more
    body = parse_json_body(raw) if raw.strip() else {}
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if body:
        raise bad_request(f"no server property can be changed here (llama-server's POST /props changes none "
                          f"either); got {', '.join(sorted(body))[:200]}", next(iter(body)))
    return JSONResponse({"success": True})


async def _metrics(service: Service) -> Response:
    """Also while the model sleeps (no worker then, and the counts as they were when it was unloaded);
    it does not wake it."""
    w = service.worker
    steps, busy = service.decode_counts()
    return PlainTextResponse(service.metrics.prometheus(queue_depth=w.queue_depth if w else 0,
                                                        running=w.running if w else 0,
                                                        slots=service.engine.config.n_parallel,
                                                        busy_per_decode=busy / steps if steps else 0.0),
                             media_type="text/plain; version=0.0.4",
                             headers={"Process-Start-Time-Unix": str(service.started)})  # llama-server's
