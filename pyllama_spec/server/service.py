"""What every route shares: the settings, the engine's worker, the request limits, the facts
the info routes answer with, the model's sleep (``--sleep-idle-seconds``: server/sleep.py); the
API-key check, reading a JSON body within its limits, and turning a generation's exception into the
error its client sees.

Routes live in their own modules (``chat_completions``, ``completions``, ``info``, ...), each
with a ``routes(service)`` that ``app.create_app`` mounts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import itertools
import logging
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from pyllama_spec.errors import (
    ContextFullError,
    ContextOverflowError,
    GenerationCancelledError,
    ImageError,
    NativeCallError,
    ProjectorError,
)
from pyllama_spec.server.errors import APIError, bad_request, context_overflow
from pyllama_spec.server.images import ImageLimits
from pyllama_spec.server.logprobs import LogprobFormatter
from pyllama_spec.server.metrics import ServerMetrics
from pyllama_spec.server.schema import GenerationRequest, RequestLimits, has_text_bias, text_bias
from pyllama_spec.server.chat import render_chat
from pyllama_spec.server import large_bodies
from pyllama_spec.server.json_body import parse_json_body, takes_steps
from pyllama_spec.server.offload import PARSE_ON_A_THREAD_ABOVE, off_loop
from pyllama_spec.server.origins import OriginPolicy
from pyllama_spec.server.sleep import IdleSleep
from pyllama_spec.server.vertex import INSTANCE_BODY, VertexSettings
from pyllama_spec.server.worker import Job, QueueFullError, Worker
from pyllama_spec.serving.engine import Engine
from pyllama_spec.serving.request import RequestOptions

log = logging.getLogger("pyllama_spec.server")

#: What a route module hands the app: (path, methods, handler of one request).
RouteSpec = tuple[str, list[str], Callable[[Request], Awaitable[Response]]]


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    alias: str = "pyllama-spec"  # the model id clients see
    aliases: tuple[str, ...] = ()  # every name of the model (-a a,b: /v1/models lists them); () : (alias,)
    tags: tuple[str, ...] = ()  # --tags: informational, listed by /v1/models
    api_key: str | None = None  # every route but /health then needs "Authorization: Bearer <key>"
    max_queue: int = 16  # requests waiting for the engine; more are answered 503
    max_body_bytes: int = 64 * 2**20
    max_tokens: int = 32768  # largest max_tokens a request may ask for
    default_max_tokens: int = 512  # when a request gives none (llama-server's -n)
    max_images: int = 64  # an agent's conversation holds every screenshot so far
    max_image_pixels: int = 4096 * 4096
    max_request_pixels: int | None = None  # of all a request's images; None: 8 x max_image_pixels
    allowed_image_dir: Path | None = None
    body_timeout: float = 60.0  # seconds a request body may take to arrive; then 408
    endpoint_slots: bool = True  # GET /slots (llama-server's --slots / --no-slots)
    endpoint_props: bool = False  # POST /props (llama-server's --props)
    slot_save_path: Path | None = None  # POST /slots/{id}?action=save|restore|erase (--slot-save-path)
    # /v1/responses kept for previous_response_id (server/responses/store.py): at most this many,
    # holding at most this many bytes of conversation; the least recently used go first
    responses_stored: int = 1024
    responses_stored_bytes: int = 256 * 2**20
    # the web pages that may send requests (--cors-origins; server/origins.py): by default this server's
    # own page and pages served from localhost
    cors_origins: OriginPolicy = OriginPolicy()
    # --sleep-idle-seconds: unload the model after this many seconds without a request, load it again
    # on the next one (server/sleep.py); -1: never
    sleep_idle_seconds: int = -1
    # Vertex AI's prediction protocol (server/vertex.py; the CLI reads it from AIP_MODE and AIP_*): None off
    vertex: VertexSettings | None = None


# Routes that need no API key: the health check, and the page (it holds no data; it asks for the
# key and sends it with each request).
OPEN_PATHS = ("/health", "/v1/health", "/")


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _not_found(request: Request, exc) -> Response:
    return error_response(APIError(404, f"no route {request.method} {request.url.path}", code="not_found"))


async def _bad_method(request: Request, exc) -> Response:
    return error_response(APIError(405, f"{request.method} is not allowed on {request.url.path}",
                                   code="method_not_allowed"))


#: Starlette's exception handlers for a path no route serves and a method a route does not take.
ERROR_HANDLERS = {404: _not_found, 405: _bad_method}


def engine_error(e: BaseException) -> APIError:
    """An exception from a generation, as the error the client should see."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ContextOverflowError):
        return context_overflow(e, "messages")
    if isinstance(e, (ImageError, ProjectorError)):
        return bad_request(str(e), "messages", code="invalid_image")
    if isinstance(e, GenerationCancelledError):
        return APIError(503, str(e), type="server_error", code="cancelled")
    if isinstance(e, ContextFullError):  # as llama-server: a 500 saying "Context size has been exceeded"
        return APIError(500, str(e), type="server_error", code="context_full")
    if isinstance(e, NativeCallError):
        return APIError(500, str(e), type="server_error", code="native_error")
    if isinstance(e, ValueError):
        return bad_request(str(e))
    log.exception("generation failed", exc_info=e)
    return APIError(500, f"internal error ({type(e).__name__})", type="server_error")


async def read_json(request: Request, limit: int, timeout: float) -> tuple[Any, int]:
    """The request's JSON body and its size: at most ``limit`` bytes, all of it within ``timeout``
    seconds (a client sending its body a byte at a time holds nothing longer), parsed by
    ``parse_json_body`` (every way it can fail is a 400): a large body on a thread, where it takes
    turns with the event loop, out of the collector's way and freed in pieces (``large_bodies``). A
    request made by Vertex AI's prediction route carries its body parsed already (vertex.py)."""
    given = request.scope.get(INSTANCE_BODY)
    if given is not None:
        return given
    raw = await read_body(request, limit, timeout)
    if len(raw) > PARSE_ON_A_THREAD_ABOVE:
        return await large_bodies.parse(request, raw), len(raw)
    return await off_loop(takes_steps(raw), parse_json_body, raw), len(raw)


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The request's body as bytes, within the limits ``read_json`` describes (413, 408, 400)."""
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
        # joining 60 MB takes some 35 ms (its pages are new): on a thread, where bytes.join lets the GIL go
        return await off_loop(size > PARSE_ON_A_THREAD_ABOVE, b"".join, chunks)

    try:
        raw = await asyncio.wait_for(body(), timeout)
    except ClientDisconnect:
        raise APIError(400, "the client disconnected while sending the request") from None
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s",
                       code="request_timeout", headers={"Connection": "close"}) from None
    return raw


class Service:
    """What the routes share: the worker, settings, limits, counters."""

    def __init__(self, engine: Engine, settings: ServerSettings) -> None:
        self.settings = settings
        self.metrics = ServerMetrics()
        self.started = int(time.time())
        self.worker: Worker | None = None  # made by start(): runs the jobs in the engine's slots
        self.task_ids = itertools.count()  # llama-server's id_task of each generation (/slots)
        #: The model's sleep (--sleep-idle-seconds). While asleep ``engine`` is closed and ``worker``
        #: None; only the routes of sleep.ANSWERED_ASLEEP run, and read no native object.
        self.sleep = IdleSleep(settings.sleep_idle_seconds, idle=self._idle, unload=self._unload, load=self._reload)
        #: Called on the event loop as the model is unloaded, while it is still loaded: the routes
        #: answered asleep keep what they need from it (info.py: /props's body).
        self.before_sleep: list[Callable[[], None]] = []
        self._decodes_before = (0, 0)  # decode steps and busy slots of the engines closed by a sleep
        self._loaded: Engine | None = None  # the engine a wake loaded: this service closes it
        #: The paths that need no API key: OPEN_PATHS, and Vertex AI's health route (its checks carry no key,
        #: where llama-server asks one of them; only GET is served there: vertex.py refuses a served path).
        v = settings.vertex
        self.open_paths = OPEN_PATHS + ((v.health_route,) if v is not None and v.health_route else ())
        self._bind(engine)

    def _bind(self, engine: Engine) -> None:
        """Serve ``engine``: what the routes read from it, read once (also on a new engine after a
        sleep). The event loop never calls into native code while the slot loop generates."""
        from pyllama_spec.serving.chat_template import MEDIA_MARKER

        settings = self.settings
        self.engine = engine
        drafter = engine.drafter
        self.limits = RequestLimits(
            max_tokens=settings.max_tokens, default_max_tokens=settings.default_max_tokens,
            draft_max=drafter.n_max_limit if drafter else 0, draft_tree=engine.config.draft_tree,
            n_max=engine.config.n_parallel, n_lora=len(engine.lora), n_vocab=engine.model.n_vocab,
            max_prompts=settings.max_queue,
            images=ImageLimits(max_images=settings.max_images if engine.projector else 0,
                               max_pixels=settings.max_image_pixels,
                               max_total_pixels=settings.max_request_pixels or 8 * settings.max_image_pixels,
                               allowed_dir=settings.allowed_image_dir))
        #: A request that gives nothing: the server's defaults, as /props shows them.
        self.default_request = engine.resolve(RequestOptions(prompt="", max_tokens=settings.default_max_tokens))
        self.logprobs = LogprobFormatter(engine.model)
        # Facts the info routes answer with
        model, proj = engine.model, engine.projector
        self.facts = dict(n_ctx=engine.ctx.n_ctx, n_vocab=model.n_vocab, n_params=model.n_params,
                          size=model.size_bytes, model_path=str(model.path), chat_template=engine.chat.source,
                          vision=bool(proj and proj.supports_vision), audio=bool(proj and proj.supports_audio),
                          media_marker=MEDIA_MARKER, n_ctx_slot=engine.ctx.n_ctx_seq, n_ctx_train=model.n_ctx_train,
                          n_embd=model.n_embd_inp, bos_token=_token_text(model, model.bos),
                          eos_token=_token_text(model, model.eos))

    def start(self) -> None:
        """Start serving (on the event loop): the worker, and the idle clock when sleeping is on."""
        self.worker = Worker(self.engine, self.settings.max_queue, on_finished=self.metrics.add_generation)
        self.sleep.start()

    def stop(self) -> None:
        """Stop the worker (it waits for the generations to end) and close the engine a wake loaded
        (the one given to the service belongs to its caller). After ``sleep.stop()``."""
        if self.worker is not None:
            self.worker.stop()
        if self._loaded is not None:
            self._loaded.close()

    def decode_counts(self) -> tuple[int, int]:
        """Target decode steps so far and the busy slots they served, over every engine this service
        ran (a sleep closes one and a wake makes another)."""
        steps, busy = self._decodes_before
        if not self.sleep.asleep:
            steps, busy = _add(steps, busy, self.engine)
        return steps, busy

    # ------------------------------------------------------------------ sleep (server/sleep.py)
    def _idle(self) -> bool:
        """No generation runs or waits."""
        w = self.worker
        return w is None or (w.queue_depth == 0 and w.running == 0)

    async def _unload(self) -> None:
        """Close the engine and stop its worker; raises only before anything is closed."""
        for keep in self.before_sleep:
            keep()
        self._decodes_before = _add(*self._decodes_before, self.engine)
        worker, engine, self.worker = self.worker, self.engine, None
        await off_loop(True, _close, worker, engine)  # freeing the model's memory takes a while

    async def _reload(self) -> None:
        """The same engine again (its configuration as planned at the first load: the same context
        size), with the LoRA scales POST /lora-adapters set (llama-server keeps them too)."""
        old = self.engine
        try:
            engine = await off_loop(True, Engine, old.config)
        except Exception as e:  # noqa: BLE001 - a file removed or changed, memory taken meanwhile
            log.error("loading the model again after sleeping failed: %s", e)
            raise APIError(500, f"the model could not be loaded again after sleeping (--sleep-idle-seconds): "
                           f"{type(e).__name__}: {e}", type="server_error", code="model_reload_failed") from None
        try:
            if len(engine.lora) == len(old.lora):
                engine.lora.scales = old.lora.scales
            self._bind(engine)
            self.worker = Worker(engine, self.settings.max_queue, on_finished=self.metrics.add_generation)
        except BaseException:  # still asleep: the next request tries again
            await off_loop(True, engine.close)
            raise
        self._loaded = engine

    def cancel_all(self) -> None:
        """Cancel every generation, running or waiting (the server is stopping: from a signal
        handler, so it only sets flags); each stops within one step."""
        if self.worker is not None:
            self.worker.cancel_all()

    async def prepare(self, req: GenerationRequest) -> None:
        """Make a parsed request ready to queue: render its chat (server/chat.py) and resolve each
        of its jobs into the engine's ``Request`` (the engine's defaults applied, every value
        checked, a json_schema turned into its grammar: a 400 for what it refuses). On a thread
        when that can take long (a chat template with tools, a schema, a grammar's cost check, a long
        prompt of ids)."""
        p = req.params
        big = (req.kind == "chat" and req.chat is None and p.messages is not None) or any(
            o.sampling.get("json_schema") is not None or o.sampling.get("grammar")
            or _prompt_size(o.prompt) > PARSE_ON_A_THREAD_ABOVE or has_text_bias(o) for o in (req.prompts or [p]))
        await off_loop(big, self._prepare, req)

    def _prepare(self, req: GenerationRequest) -> None:
        render_chat(self.engine, req)
        if req.n_images and self.engine.projector is None:
            raise bad_request("this server has no projector (--mmproj): it cannot read images", "messages",
                              code="invalid_image")
        try:
            @functools.lru_cache(maxsize=None)  # each text once per request, whatever its jobs
            def tokenize(text: str) -> tuple[int, ...]:
                return tuple(self.engine.model.tokenize(text, add_special=False, parse_special=False))

            req.requests = [self.engine.resolve(text_bias(o, tokenize))
                            for o in req.job_options(self.engine.config.sampling.get("seed", 0))]
        except (ValueError, TypeError) as e:
            raise engine_error(e) if isinstance(e, ValueError) else bad_request(str(e)) from None

    def submit(self, req: GenerationRequest) -> list[Job]:
        """Queue one job per choice of each prompt, prompt by prompt (``GenerationRequest.job_options``),
        each its Request resolved by ``prepare``; a 503 when the queue is full."""
        if req.requests is None:
            raise RuntimeError("Service.submit needs a request made ready by Service.prepare")
        jobs = []
        for k, request in enumerate(req.requests):
            # id_slot places the first choice (llama-server: the others take any free slot)
            job = Job(asyncio.get_running_loop(), request, id_task=next(self.task_ids),
                      id_slot=req.id_slot if k % req.n == 0 else -1, stream=req.stream,
                      report_progress=req.stream and req.options.return_progress)
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
        check_api_key(request, self.settings.api_key, self.open_paths)


def _add(steps: int, busy: int, engine: Engine) -> tuple[int, int]:
    """``steps`` and ``busy`` plus the engine's slot loop's decode steps and the busy slots they served."""
    loop = engine.slot_loop  # (counters the loop's thread adds to: a snapshot is enough)
    return steps + loop.steps, busy + sum(k * n for k, n in list(loop.slots_per_step.items()))


def _close(worker: Worker | None, engine: Engine) -> None:
    """Free a sleeping server's engine (on a thread). A failure is logged: the next request loads a new one."""
    try:
        if worker is not None:
            worker.stop()
    except Exception:  # noqa: BLE001
        log.exception("stopping the worker to sleep failed")
    try:
        engine.close(give_back_memory=True)
    except Exception:  # noqa: BLE001
        log.exception("closing the engine to sleep failed")


def _token_text(model, token: int) -> str:
    """A special token's text as llama-server's /props shows it ("" when the model has none)."""
    return model.token_to_bytes(token, special=True).decode("utf-8", errors="replace") if token >= 0 else ""


def check_api_key(request: Request, keys: str | None, open_paths: tuple[str, ...] = OPEN_PATHS) -> None:
    """A 401 unless the request carries one of ``keys`` (comma-separated; None: no key needed)
    or asks for an open path (/health)."""
    if keys is None or request.url.path in open_paths:
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



def _prompt_size(prompt) -> int:
    """About how much work resolving a prompt is: its characters, or its token ids and strings."""
    if prompt is None or isinstance(prompt, str):
        return len(prompt or "")
    return sum(len(x) if hasattr(x, "__len__") else 1 for x in prompt)
