"""The ASGI application: OpenAI's chat and completion routes, llama-server's /completion,
/health, /props, /metrics, with API-key checks, body limits and OpenAI-style errors; the chat
page at / (static files in ``static/``).

The app holds an ``EngineWorker`` (one thread owning the Engine) and never touches native
objects itself. Build it with ``create_app(engine, ServerSettings(...))`` and run it with
any ASGI server (``pyllama-spec serve`` uses uvicorn).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from pyllama_spec import __version__
from pyllama_spec.errors import (
    ContextOverflowError,
    GenerationCancelledError,
    ImageError,
    NativeCallError,
    ProjectorError,
)
from pyllama_spec.server.errors import APIError, bad_request
from pyllama_spec.server.images import ImageLimits
from pyllama_spec.server.logprobs import LogprobFormatter
from pyllama_spec.server.metrics import ServerMetrics
from pyllama_spec.server.schema import (
    GenerationRequest,
    RequestLimits,
    parse_chat,
    parse_completion,
)
from pyllama_spec.server.worker import Job, QueueFullError, make_worker
from pyllama_spec.serving.engine import Engine

log = logging.getLogger("pyllama_spec.server")

#: The chat page's files (HTML, CSS, JavaScript), served at / and /static/.
STATIC_DIR = Path(__file__).parent / "static"
# The page loads nothing from anywhere but this server (pictures the user attaches are data: URIs).
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; connect-src 'self'; "
                               "style-src 'self'; script-src 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    alias: str = "pyllama-spec"  # the model id clients see
    api_key: str | None = None  # every route but /health then needs "Authorization: Bearer <key>"
    max_queue: int = 16  # requests waiting for the engine; more are answered 503
    max_body_bytes: int = 64 * 2**20
    max_tokens: int = 32768  # largest max_tokens a request may ask for
    default_max_tokens: int = 512  # when a request gives none (llama-server's -n)
    max_images: int = 8
    max_image_pixels: int = 4096 * 4096
    allowed_image_dir: Path | None = None
    body_timeout: float = 60.0  # seconds a request body may take to arrive; then 408


#: Request bodies larger than this (bytes) are checked on a thread, not on the event loop.
_PARSE_ON_A_THREAD_ABOVE = 256 * 1024

# ----------------------------------------------------------------------------- helpers


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _engine_error(e: BaseException) -> APIError:
    """An exception from a generation, as the error the client should see."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ContextOverflowError):
        return bad_request(str(e), "messages", code="context_length_exceeded")
    if isinstance(e, (ImageError, ProjectorError)):
        return bad_request(str(e), "messages", code="invalid_image")
    if isinstance(e, GenerationCancelledError):
        return APIError(503, str(e), type="server_error", code="cancelled")
    if isinstance(e, NativeCallError):
        return APIError(500, str(e), type="server_error", code="native_error")
    if isinstance(e, ValueError):
        return bad_request(str(e))
    log.exception("generation failed", exc_info=e)
    return APIError(500, f"internal error ({type(e).__name__})", type="server_error")


async def _read_json(request: Request, limit: int, timeout: float) -> tuple[Any, int]:
    """The request's JSON body and its size: at most ``limit`` bytes, all of it within ``timeout``
    seconds (a client sending its body a byte at a time holds nothing longer), parsed by
    ``parse_json_body`` (every way it can fail is a 400)."""
    from pyllama_spec.server.schema import parse_json_body

    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")

    async def body() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        raw = await asyncio.wait_for(body(), timeout)
    except ClientDisconnect:
        raise APIError(400, "the client disconnected while sending the request") from None
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s",
                       code="request_timeout", headers={"Connection": "close"}) from None
    return parse_json_body(raw), len(raw)


def timings(stats) -> dict:
    """llama-server's ``timings`` object, plus what it lacks (acceptance by draft position)."""
    prompt_n = stats.prompt_decoded
    prompt_ms, predicted_ms = stats.prefill_seconds * 1000, stats.decode_seconds * 1000
    out = {
        "cache_n": stats.prompt_reused,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": prompt_n / stats.prefill_seconds if stats.prefill_seconds > 0 else 0.0,
        "predicted_n": stats.generated_tokens,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / stats.generated_tokens if stats.generated_tokens else 0.0,
        "predicted_per_second": stats.tokens_per_second,
        "draft_n": stats.drafted,
        "draft_n_accepted": stats.accepted,
        "acceptance_rate": stats.acceptance_rate,
        "mean_accepted_length": stats.mean_accepted_length,
        "per_position_acceptance": stats.per_position_acceptance,
        "target_steps": stats.target_steps,
    }
    return out


def speculation(piece) -> dict:
    """The ``pyllama_spec`` extension object of a streamed chunk: each token of the step with the
    text it released and whether it was an accepted draft token, the tokens the drafter proposed
    in the step, and how many of the step's tokens are accepted drafts."""
    tokens = [{"id": int(tok), "text": text, "draft": i < piece.from_draft}
              for i, (tok, text) in enumerate(zip(piece.tokens, piece.token_texts, strict=True))]
    return {"tokens": tokens, "drafted": piece.drafted, "accepted": piece.from_draft}


def usage(stats) -> dict:
    """OpenAI's usage of one generation's stats, or of a request's choices (a list): the prompt
    counted once, the completions summed."""
    every = stats if isinstance(stats, list) else [stats]
    first, completion = every[0], sum(s.generated_tokens for s in every)
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
            "total_tokens": first.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": first.prompt_reused}}


# ----------------------------------------------------------------------------- the app


class _Service:
    """What the routes share: the worker, settings, limits, counters."""

    def __init__(self, engine: Engine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = ServerMetrics()
        self.started = int(time.time())
        drafter = engine.drafter
        self.limits = RequestLimits(
            max_tokens=settings.max_tokens, default_max_tokens=settings.default_max_tokens,
            draft_max=drafter.n_max_limit if drafter else 0, draft_tree=engine.config.draft_tree,
            n_max=engine.config.n_parallel,
            images=ImageLimits(max_images=settings.max_images if engine.projector else 0,
                               max_pixels=settings.max_image_pixels, allowed_dir=settings.allowed_image_dir))
        self.worker = None  # made by start(): one slot, or the engine's slots (-np N)
        self.logprobs = LogprobFormatter(engine.model)
        # Facts the info routes answer with, read once here: the event loop never calls into
        # native code while the worker thread generates.
        from pyllama_spec.bindings.mtmd import MEDIA_MARKER

        model, proj = engine.model, engine.projector
        self.facts = dict(n_ctx=engine.ctx.n_ctx, n_vocab=model.n_vocab, n_params=model.n_params,
                          size=model.size_bytes, model_path=str(model.path), chat_template=model.chat_template or "",
                          vision=bool(proj and proj.supports_vision), audio=bool(proj and proj.supports_audio),
                          media_marker=MEDIA_MARKER)

    def start(self) -> None:
        self.worker = make_worker(self.engine, self.settings.max_queue, on_finished=self.metrics.add_generation)

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()

    def cancel_all(self) -> None:
        """Cancel every generation, running or waiting (the server is stopping: from a signal
        handler, so it only sets flags); each stops within one step."""
        if self.worker is not None:
            self.worker.cancel_all()

    def submit(self, req: GenerationRequest) -> list[Job]:
        """One job per choice. Choice i samples with the request's seed + i (the server's default
        seed when it gives none): n samples, each reproducible."""
        if req.n_images and self.engine.projector is None:
            raise bad_request("this server has no projector (--mmproj): it cannot read images", "messages",
                              code="invalid_image")
        jobs = []
        seed = req.engine_args.get("seed", self.engine.config.sampling.get("seed", 0))
        for i in range(req.n):
            args = req.engine_args if req.n == 1 else {**req.engine_args, "seed": (seed + i) & 0xFFFFFFFF}
            job = Job(asyncio.get_running_loop(), args)
            try:
                self.worker.submit(job)
            except QueueFullError:
                for j in jobs:
                    j.cancel()
                raise APIError(503, f"the server is busy ({self.settings.max_queue} requests queued); retry "
                               "shortly", type="server_error", code="queue_full", headers={"Retry-After": "1"}) from None
            jobs.append(job)
        return jobs

    def check_key(self, request: Request) -> None:
        keys = self.settings.api_key
        if keys is None or request.url.path in _OPEN_PATHS:
            return
        # Authorization: Bearer <key>, or Anthropic's X-Api-Key: <key>, as llama-server reads them
        given = request.headers.get("authorization", "")
        if given:
            token = (given[7:] if given.lower().startswith("bearer ") else "").encode()
        else:
            token = request.headers.get("x-api-key", "").encode()
        # Several keys, comma-separated (llama-server's --api-key a,b and --api-key-file): any one
        # opens. Every key is compared, so the time taken says nothing about which one was near.
        matches = [hmac.compare_digest(token, key.encode()) for key in keys.split(",") if key]
        if not any(matches):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                           type="authentication_error", code="invalid_api_key")


# Routes that need no API key: the health check, and the page (it holds no data; it asks for the
# key and sends it with each request).
_OPEN_PATHS = ("/health", "/v1/health", "/")


def create_app(engine: Engine, settings: ServerSettings | None = None) -> Starlette:
    """The ASGI app serving ``engine``. Its lifespan starts and stops the engine's worker thread."""
    service = _Service(engine, settings or ServerSettings())

    def route(path: str, methods: list[str]):
        def wrap(handler):
            async def endpoint(request: Request) -> Response:
                try:
                    service.check_key(request)
                    response = await handler(request)
                except APIError as e:
                    response = _error_response(e)
                except Exception as e:  # noqa: BLE001 - never a traceback to the client
                    response = _error_response(_engine_error(e))
                service.metrics.count_request(path, response.status_code)
                return response

            return Route(path, endpoint, methods=methods)

        return wrap

    async def generation(request: Request, parse) -> Response:
        body, size = await _read_json(request, service.settings.max_body_bytes, service.settings.body_timeout)
        if size > _PARSE_ON_A_THREAD_ABOVE:
            # images are decoded (and checked) while parsing: off the event loop, which other
            # requests' streams share (Pillow releases the GIL while it decodes)
            req = await asyncio.get_running_loop().run_in_executor(None, parse, body, service.limits)
        else:
            req = parse(body, service.limits)
        jobs = service.submit(req)
        if req.stream:
            return EventSourceResponse(_stream_events(service, req, jobs), ping=15)
        return await _complete(service, req, jobs, request)

    def llama_completion(body, limits):
        return parse_completion(body, limits, llama_style=True)

    # llama-server's paths: each route under its un-prefixed and /v1/ names, and /completion(s)
    # in llama-server's own shape
    routes = [
        *(route(p, ["POST"])(lambda r: generation(r, parse_chat)) for p in ("/v1/chat/completions",
                                                                            "/chat/completions")),
        route("/v1/completions", ["POST"])(lambda r: generation(r, parse_completion)),
        *(route(p, ["POST"])(lambda r: generation(r, llama_completion)) for p in ("/completion", "/completions")),
        route("/v1/models", ["GET"])(lambda r: _models(service)),
        route("/models", ["GET"])(lambda r: _models(service)),
        *(route(p, ["GET"])(lambda r: _health(service)) for p in ("/health", "/v1/health")),
        route("/props", ["GET"])(lambda r: _props(service)),
        route("/metrics", ["GET"])(lambda r: _metrics(service)),
        route("/", ["GET"])(lambda r: _page()),
        Mount("/static", app=_StaticFiles(directory=STATIC_DIR), name="static"),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, service.stop)

    async def not_found(request: Request, exc) -> Response:
        return _error_response(APIError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    async def bad_method(request: Request, exc) -> Response:
        return _error_response(APIError(405, f"{request.method} is not allowed on {request.url.path}",
                                        code="method_not_allowed"))

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: bad_method})
    app.state.service = service
    return app


# ----------------------------------------------------------------------------- generation routes


def _ids(req: GenerationRequest) -> tuple[str, str]:
    prefix = {"chat": "chatcmpl", "completion": "cmpl", "llama": "cmpl"}[req.kind]
    return f"{prefix}-{uuid.uuid4().hex[:24]}", {"chat": "chat.completion", "completion": "text_completion",
                                                 "llama": "completion"}[req.kind]


async def _until_disconnected(request: Request) -> None:
    """Returns when the client has gone (ASGI's http.disconnect; the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclasses.dataclass
class _Choice:
    """One choice's generation, gathered: its text, tokens, logprobs and last piece."""

    text: list = dataclasses.field(default_factory=list)
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    last: Any = None


async def _gather(job: Job) -> _Choice:
    out = _Choice()
    while True:
        kind, value = await job.events.get()
        if kind == "piece":
            out.text.append(value.text)
            out.tokens.extend(value.tokens)
            out.logprobs.extend(value.logprobs)
            out.last = value
        elif kind == "error":
            raise _engine_error(value)
        else:
            break
    if out.last is None or out.last.stats is None:  # ended without its last piece: stopped under it
        raise APIError(503, "the generation was stopped before it finished (the server is stopping)",
                       type="server_error", code="cancelled")
    return out


def _stop_type(finish_reason: str | None) -> str:
    return "limit" if finish_reason == "length" else "eos"


async def _complete(service: _Service, req: GenerationRequest, jobs: list[Job], request: Request) -> Response:
    gone = asyncio.ensure_future(_until_disconnected(request))
    work = asyncio.ensure_future(asyncio.gather(*(_gather(job) for job in jobs)))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            raise APIError(499, "the client disconnected")
        choices = work.result()  # the first error, if one failed
    finally:
        gone.cancel()
        for job in jobs:
            job.cancel()  # no-op once finished; stops the others when one failed or the client left
    rid, obj = _ids(req)
    model = service.settings.alias
    asked = req.engine_args.get("logprobs") is not None
    if req.kind == "llama":
        bodies = []
        for i, c in enumerate(choices):
            stats = c.last.stats
            body = {"index": i, "content": "".join(c.text), "tokens": c.tokens, "model": model,
                    "stop": True, "stop_type": _stop_type(c.last.finish_reason),
                    "tokens_predicted": stats.generated_tokens, "tokens_evaluated": stats.prompt_tokens,
                    "tokens_cached": stats.prompt_reused, "timings": timings(stats)}
            if asked:
                body["completion_probabilities"] = service.logprobs.entries(c.logprobs)
            bodies.append(body)
        return JSONResponse(bodies[0] if len(bodies) == 1 else bodies)  # llama-server: a list for n_cmpl > 1
    out = []
    for i, c in enumerate(choices):
        # llama-server answers OpenAI's chat shape {"content": [...]} on both routes
        choice: dict = {"index": i, "finish_reason": c.last.finish_reason,
                        "logprobs": {"content": service.logprobs.entries(c.logprobs)} if asked else None}
        if req.kind == "chat":
            choice["message"] = {"role": "assistant", "content": "".join(c.text)}
        else:
            choice["text"] = "".join(c.text)
        out.append(choice)
    stats = [c.last.stats for c in choices]
    return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": out,
                         "usage": usage(stats), "timings": timings(stats[0])})


async def _merged(jobs: list[Job]) -> AsyncIterator[tuple[int, str, Any]]:
    """Every job's events as (choice index, kind, value), in the order they arrive."""
    waiting = {asyncio.ensure_future(job.events.get()): i for i, job in enumerate(jobs)}
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=waiting.get):
                i = waiting.pop(future)
                kind, value = future.result()
                yield i, kind, value
                if kind == "piece":
                    waiting[asyncio.ensure_future(jobs[i].events.get())] = i
    finally:
        for future in waiting:
            future.cancel()


async def _stream_events(service: _Service, req: GenerationRequest, jobs: list[Job]) -> AsyncIterator[dict]:
    """Server-sent events: OpenAI chunks ending with [DONE] (llama-server's chunks for /completion),
    each naming its choice by ``index``."""
    rid, _ = _ids(req)
    created, model = int(time.time()), service.settings.alias
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    asked = req.engine_args.get("logprobs") is not None

    def chunk(i: int, delta_text: str | None, finish: str | None, role: bool = False, piece=None) -> dict:
        lp = {"content": service.logprobs.entries(piece.logprobs)} if asked and piece is not None else None
        if req.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({} if delta_text is None else
                                                                      {"content": delta_text})
            c = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            c = {"index": i, "text": delta_text or "", "logprobs": lp, "finish_reason": finish}
        out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [c]}
        if piece is not None:
            out["pyllama_spec"] = speculation(piece)  # an extension: clients ignore unknown fields
        return out

    def data(obj_: dict) -> dict:
        return {"data": json.dumps(obj_, ensure_ascii=False)}

    final_stats = {}
    try:
        if req.kind == "chat":
            for i in range(len(jobs)):
                yield data(chunk(i, None, None, role=True))
        async with contextlib.aclosing(_merged(jobs)) as events:  # the client going away cancels this
            async for i, kind, piece in events:
                if kind == "error":
                    yield data(_engine_error(piece).body())
                    return
                if kind == "done":
                    continue
                if req.kind == "llama":
                    event = {"index": i, "content": piece.text, "tokens": list(piece.tokens),
                             "stop": piece.stats is not None, "pyllama_spec": speculation(piece)}
                    if asked:
                        event["completion_probabilities"] = service.logprobs.entries(piece.logprobs)
                    if piece.stats is not None:
                        event.update(model=model, stop_type=_stop_type(piece.finish_reason),
                                     tokens_predicted=piece.stats.generated_tokens,
                                     tokens_evaluated=piece.stats.prompt_tokens, timings=timings(piece.stats))
                    yield data(event)
                    continue
                # A step whose text is held back (a partial character, a possible stop string) still
                # gets its chunk, with empty content, so that every token's origin is reported.
                if piece.text or piece.tokens:
                    yield data(chunk(i, piece.text, None, piece=piece))
                if piece.stats is not None:
                    final_stats[i] = piece.stats
                    final = chunk(i, None, piece.finish_reason)
                    final["timings"] = timings(piece.stats)
                    yield data(final)
        if req.kind != "llama":
            if req.include_usage and len(final_stats) == len(jobs):
                yield data({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                            "usage": usage([final_stats[i] for i in sorted(final_stats)])})
            yield {"data": "[DONE]"}
    finally:
        for job in jobs:
            job.cancel()  # the client went away (or the stream ended): stop generating within one step


# ----------------------------------------------------------------------------- other routes


class _StaticFiles(StaticFiles):
    """The page's files, with the page's headers (its content security policy among them)."""

    def file_response(self, *args, **kwargs) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers.update(PAGE_HEADERS)
        return response


async def _page() -> Response:
    return FileResponse(STATIC_DIR / "index.html", headers=PAGE_HEADERS)



async def _models(service: _Service) -> Response:
    f = service.facts
    caps = ["completion"] + (["multimodal"] if f["vision"] or f["audio"] else [])
    entry = {"id": service.settings.alias, "object": "model", "created": service.started, "owned_by": "pyllama-spec",
             "capabilities": caps,
             "meta": {"n_ctx": f["n_ctx"], "n_vocab": f["n_vocab"], "n_params": f["n_params"], "size": f["size"],
                      "speculative": service.engine.config.spec_type}}
    return JSONResponse({"object": "list", "data": [entry]})


async def _health(service: _Service) -> Response:
    return JSONResponse({"status": "ok"})


async def _props(service: _Service) -> Response:
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


async def _metrics(service: _Service) -> Response:
    w = service.worker
    return PlainTextResponse(service.metrics.prometheus(queue_depth=w.queue_depth if w else 0,
                                                        running=w.running if w else 0,
                                                        slots=service.engine.config.n_parallel),
                             media_type="text/plain; version=0.0.4")
