"""llama-server's router mode: several models of a ``--models-preset`` file served by name, each
by its own ``pyllama-spec serve`` process.

``pyllama-spec serve --models-preset FILE`` without a model (no ``-m``) becomes a router, as
llama-server does (tools/server/server-models.cpp of the pin). The router loads no model itself:

- each preset section is a model, named by the section (its ``alias`` key adds other names);
  a model is loaded by starting a child ``pyllama-spec serve`` with the section's arguments on a
  free port of 127.0.0.1, when a request names it (unless ``--no-models-autoload`` or
  ``?autoload=false``), on ``POST /models/load``, or at start (``load-on-startup = true``);
- at most ``--models-max`` children run at once (4; 0: no limit): a request for one more model
  waits while the least recently used idle model is stopped (llama-server's eviction rule: a
  model answering a request, still loading, or wanted by a waiting request is never chosen);
- a request is proxied to its model's child (``model`` of the JSON body for POST, ``?model=``
  for GET), streamed answers passed on as they arrive; a client that goes away closes the
  connection to the child, which stops the generation;
- a model is stopped with SIGTERM (the child cancels its generations and exits) and killed
  after its ``stop-timeout`` (10 s); one still loading is killed at once;
- a child that crashes or fails to start leaves its model ``unloaded`` with ``failed: true``,
  its ``exit_code`` and the last lines it wrote (``reason``, this server's addition); the other
  models keep working, and the next request for it starts it again (llama-server's rule);
- the router checks the API key; each child takes a random key of its own that only the router
  knows, and listens on 127.0.0.1 only. A child whose router dies (its stdin closes) exits.

Routes: ``GET /models`` and ``/v1/models`` (every model with its status), ``POST /models/load``,
``POST /models/unload``, ``GET /models/sse`` (status events), ``/health``, ``GET /props`` (the
router's, or a model's with ``?model=``) and llama-server's model routes, proxied.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pyllama_spec import __version__
from pyllama_spec.devtools.rpc_server import free_port
from pyllama_spec.server.errors import APIError, bad_request
from pyllama_spec.server.schema import parse_json_body
from pyllama_spec.server.service import (
    ERROR_HANDLERS,
    PARSE_ON_A_THREAD_ABOVE,
    check_api_key,
    error_response,
    read_body,
)

log = logging.getLogger("pyllama_spec.server.router")

#: Set in a child's environment (llama-server's name): the child then exits when its stdin closes.
ROUTER_ENV = "LLAMA_SERVER_ROUTER_PORT"
#: Children listen here only, whatever address the router listens on.
CHILD_HOST = "127.0.0.1"
DEFAULT_STOP_TIMEOUT = 10  # seconds, llama-server's
#: What a router's child must not inherit from its environment: the router's own settings, and
#: the API key (each child gets one of its own).
_ROUTER_ONLY_ENV = ("LLAMA_API_KEY", "LLAMA_ARG_API_KEY_FILE", "LLAMA_ARG_MODELS_PRESET", "LLAMA_ARG_MODELS_MAX",
                    "LLAMA_ARG_MODELS_AUTOLOAD", "LLAMA_ARG_MODELS_DIR", "LLAMA_ARG_HOST", "LLAMA_ARG_PORT",
                    "LLAMA_ARG_ALIAS", "LLAMA_ARG_SSL_KEY_FILE", "LLAMA_ARG_SSL_CERT_FILE")
#: Headers not passed between the client and a child: hop-by-hop ones, the ones httpx or
#: uvicorn set again, the client's key (the child gets its own), compression (passed through raw).
_REQUEST_HEADERS_DROPPED = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade",
                            "te", "trailer", "proxy-authorization", "proxy-connection", "accept-encoding",
                            "authorization", "x-api-key"}
_RESPONSE_HEADERS_DROPPED = {"server", "date", "transfer-encoding", "content-length", "connection", "keep-alive"}
#: Lines of a child's output kept for the reason it failed.
TAIL_LINES = 20
_MAX_LINE = 64 * 1024  # a child's line longer than this is cut (the tail stays bounded)

# llama-server's router proxies these routes to the model a request names (server.cpp).
PROXIED_POST = ("/props", "/completion", "/completions", "/v1/completions", "/chat/completions",
                "/v1/chat/completions", "/v1/chat/completions/control", "/v1/responses", "/responses",
                "/v1/audio/transcriptions", "/audio/transcriptions", "/v1/messages", "/v1/messages/count_tokens",
                "/infill", "/embedding", "/embeddings", "/v1/embeddings", "/rerank", "/reranking", "/v1/rerank",
                "/v1/reranking", "/tokenize", "/detokenize", "/apply-template", "/chat/completions/input_tokens",
                "/v1/chat/completions/input_tokens", "/responses/input_tokens", "/v1/responses/input_tokens",
                "/lora-adapters", "/slots/{id_slot}")
PROXIED_GET = ("/metrics", "/lora-adapters", "/slots")

UNLOADED, LOADING, LOADED = "unloaded", "loading", "loaded"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model of the router: a preset section."""

    name: str
    args: tuple[str, ...]  # the child's `pyllama-spec serve` arguments, without --host/--port/--alias
    aliases: tuple[str, ...] = ()  # other names requests may use
    tags: tuple[str, ...] = ()  # informational (GET /models)
    load_on_startup: bool = False
    stop_timeout: float = DEFAULT_STOP_TIMEOUT
    preset: str = ""  # the section as INI text (GET /models' status.preset)
    input_modalities: tuple[str, ...] = ("text",)


@dataclasses.dataclass(frozen=True)
class RouterSettings:
    models_max: int = 4  # children at once; 0: no limit
    autoload: bool = True  # load a model a request names (a request's ?autoload= overrides)
    api_key: str | None = None  # comma-separated keys; None: open
    max_body_bytes: int = 64 * 2**20
    body_timeout: float = 60.0
    #: How a child is started; its arguments follow.
    child_command: tuple[str, ...] = (sys.executable, "-m", "pyllama_spec.cli", "serve")
    router_port: int = 0  # told to the children (llama-server's LLAMA_SERVER_ROUTER_PORT)


@dataclasses.dataclass(eq=False)
class _Model:
    """A model's state; changed only on the event loop."""

    spec: ModelSpec
    status: str = UNLOADED
    stopping: bool = False  # asked to stop, not exited yet: still counts against --models-max
    exit_code: int = 0
    tail: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    reason: str = ""  # the tail when it failed
    proc: asyncio.subprocess.Process | None = None
    port: int = 0
    key: str = ""  # the child's own API key
    args: list[str] = dataclasses.field(default_factory=list)  # the command line of the last start
    last_used: float = 0.0
    requests: int = 0  # requests being proxied to it now
    info: dict = dataclasses.field(default_factory=dict)  # the child's /v1/models entry
    kill_timer: asyncio.TimerHandle | None = None
    watcher: asyncio.Task | None = None

    @property
    def running(self) -> bool:
        return self.status in (LOADING, LOADED)

    @property
    def failed(self) -> bool:
        return self.status == UNLOADED and self.exit_code != 0


class Router:
    """The children and their states (see the module's doc). Use it on one event loop:
    ``await start()``, the routes, ``await close()``."""

    def __init__(self, specs: list[ModelSpec], settings: RouterSettings) -> None:
        self.settings = settings
        self.models: dict[str, _Model] = {s.name: _Model(s) for s in sorted(specs, key=lambda s: s.name)}
        self.names: dict[str, _Model] = dict(self.models)
        for m in self.models.values():
            for alias in m.spec.aliases:
                if self.names.get(alias, m) is not m:
                    raise ValueError(f"alias '{alias}' of model '{m.spec.name}' is already the name of a model")
                self.names[alias] = m
        startup = [m for m in self.models.values() if m.spec.load_on_startup]
        if settings.models_max > 0 and len(startup) > settings.models_max:
            raise ValueError(f"number of models to load on startup ({len(startup)}) exceeds models_max "
                             f"({settings.models_max})")
        for m in self.models.values():
            m.args = self._command(m, 0)
        self.closing = False
        self.client: httpx.AsyncClient | None = None
        self._wanted: collections.OrderedDict[str, int] = collections.OrderedDict()  # waiting requests by model
        self._changed: asyncio.Event | None = None  # made on the loop, by start()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._subscribers: set[_Subscriber] = set()

    # ------------------------------------------------------------------ life

    async def start(self) -> None:
        """Start the models marked load-on-startup (without waiting for them)."""
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        # trust_env=False: an HTTP(S)_PROXY of the environment must not carry loopback traffic
        self.client = httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(None, connect=10.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=32))
        for m in self.models.values():
            if m.spec.load_on_startup:
                self._spawn(m)

    def cancel_all(self) -> None:
        """The router is stopping (run.py's signal handler calls this, so it only schedules): every
        child is asked to stop, which ends its generations, and no model is started again."""
        self.closing = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop_all_soon)

    def _stop_all_soon(self) -> None:
        for m in self.models.values():
            self._request_stop(m)
        for s in list(self._subscribers):
            s.close()
        self._notify()

    async def close(self) -> None:
        """Stop every child (each within its stop-timeout, then killed) and wait for them."""
        self.closing = True
        self._stop_all_soon()
        watchers = [m.watcher for m in self.models.values() if m.watcher is not None]
        if watchers:
            limit = max(m.spec.stop_timeout for m in self.models.values()) + 5
            _, pending = await asyncio.wait(watchers, timeout=limit)
            for m in self.models.values():  # a child that outlived even that: killed, then reaped
                if m.proc is not None and m.proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        m.proc.kill()
            if pending:
                await asyncio.wait(pending, timeout=5)
        if self.client is not None:
            await self.client.aclose()

    # ------------------------------------------------------------------ children

    def _command(self, m: _Model, port: int) -> list[str]:
        return [*self.settings.child_command, *m.spec.args, "--host", CHILD_HOST, "--port", str(port),
                "--alias", m.spec.name]

    def _spawn(self, m: _Model) -> None:
        """Start ``m``'s child (its status becomes loading; a watcher follows it)."""
        m.port, m.key = free_port(CHILD_HOST), secrets.token_urlsafe(24)
        m.args = self._command(m, m.port)
        m.status, m.stopping, m.exit_code, m.reason, m.info = LOADING, False, 0, "", {}
        m.last_used = time.monotonic()
        m.tail.clear()
        m.proc = None
        m.watcher = asyncio.ensure_future(self._run_child(m))
        self._event(m, "model_status", {"status": LOADING})
        self._notify()

    def _child_env(self, m: _Model) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _ROUTER_ONLY_ENV}
        env[ROUTER_ENV] = str(self.settings.router_port)
        env["LLAMA_API_KEY"] = m.key
        env["PYTHONUNBUFFERED"] = "1"  # its lines reach the router as they are written
        return env

    async def _run_child(self, m: _Model) -> None:
        """Start the child, follow its output, mark it loaded when it answers, and record how it ended."""
        try:
            # its own session: a Ctrl-C in the router's terminal reaches the router only, which
            # then stops the children in order; stdin stays open (a pipe) until the router ends
            proc = await asyncio.create_subprocess_exec(
                *m.args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=self._child_env(m), start_new_session=True)
        except OSError as e:
            m.tail.append(f"cannot start {m.args[0]}: {e}")
            self._exited(m, None, 127)
            return
        m.proc = proc
        if m.stopping:  # unloaded (or the router stopping) while it was being started
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        ready = asyncio.ensure_future(self._until_ready(m, proc))
        await asyncio.gather(self._pump(m, proc.stdout), self._pump(m, proc.stderr))
        rc = await proc.wait()
        ready.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await ready
        self._exited(m, proc, rc)

    async def _pump(self, m: _Model, stream: asyncio.StreamReader) -> None:
        """The child's lines, passed on to the router's stderr (prefixed with the model's name)
        and kept in its tail."""
        buf = b""
        while True:
            chunk = await stream.read(65536)
            if chunk:
                buf += chunk
                *lines, buf = buf.split(b"\n")
                if len(buf) > _MAX_LINE:  # a child that never writes a newline: cut, stay bounded
                    lines, buf = [*lines, buf[:_MAX_LINE]], b""
            else:
                lines, buf = ([buf] if buf else []), b""
            for raw in lines:
                line = raw.decode("utf-8", "replace").rstrip("\r")
                if line.strip():
                    m.tail.append(line)
                    with contextlib.suppress(OSError, ValueError):  # the router's own stderr gone: go on
                        sys.stderr.write(f"[{m.spec.name}] {line}\n")
            if not chunk:
                with contextlib.suppress(OSError, ValueError):
                    sys.stderr.flush()
                return

    async def _until_ready(self, m: _Model, proc) -> None:
        """Poll the child's /health until it answers; then read its /v1/models entry and mark it loaded."""
        base = f"http://{CHILD_HOST}:{m.port}"
        delay = 0.05
        while proc.returncode is None:
            try:
                r = await self.client.get(base + "/health", timeout=2.0)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.5)
        else:
            return
        info = {}
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            r = await self.client.get(base + "/v1/models", headers={"Authorization": f"Bearer {m.key}"}, timeout=10.0)
            info = r.json()["data"][0]
        if m.proc is proc and m.status == LOADING and not m.stopping:
            m.status, m.info = LOADED, info if isinstance(info, dict) else {}
            m.last_used = time.monotonic()
            self._event(m, "status_change", {"status": LOADED, "info": m.info})
            self._notify()

    def _exited(self, m: _Model, proc, rc: int) -> None:
        if m.kill_timer is not None:
            m.kill_timer.cancel()
            m.kill_timer = None
        if m.proc is not proc:
            return
        # A child that stopped as asked exits 0 or by the SIGTERM it was sent (uvicorn re-raises
        # it): that is a clean unload. Killed after its stop-timeout, or ended by itself with an
        # error, it failed (as in llama-server, where a force-killed child shows failed too).
        clean = rc == 0 or (m.stopping and rc == -signal.SIGTERM)
        m.exit_code = 0 if clean else rc
        m.reason = "" if clean else "\n".join(m.tail)
        m.status, m.stopping, m.proc, m.port, m.info = UNLOADED, False, None, 0, {}
        if not clean:
            log.warning("model %s exited with status %s", m.spec.name, rc)
        self._event(m, "status_change", {"status": UNLOADED, "exit_code": m.exit_code})
        self._notify()

    def _request_stop(self, m: _Model) -> None:
        """Ask ``m``'s child to stop (SIGTERM; killed after stop-timeout); one still loading is
        killed at once, as llama-server does."""
        if not m.running or m.stopping:
            return
        m.stopping = True
        if m.proc is not None and m.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                m.proc.send_signal(signal.SIGKILL if m.status == LOADING else signal.SIGTERM)
        loop = asyncio.get_running_loop()
        m.kill_timer = loop.call_later(m.spec.stop_timeout, self._kill, m)
        self._notify()

    def _kill(self, m: _Model) -> None:
        m.kill_timer = None
        if m.stopping and m.proc is not None and m.proc.returncode is None:
            log.warning("killing model %s: it did not stop within %g s", m.spec.name, m.spec.stop_timeout)
            with contextlib.suppress(ProcessLookupError):
                m.proc.kill()

    # ------------------------------------------------------------------ scheduling

    def _notify(self) -> None:
        """Wake every request waiting for a state change."""
        if self._changed is not None:
            self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self, timeout: float = 0.5) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    def _n_running(self) -> int:
        return sum(m.running for m in self.models.values())

    def _has_capacity(self) -> bool:
        return self.settings.models_max <= 0 or self._n_running() < self.settings.models_max

    def _victim(self) -> _Model | None:
        """The least recently used model that is loaded, idle, not stopping and not wanted."""
        idle = [m for m in self.models.values()
                if m.status == LOADED and not m.requests and not m.stopping and m.spec.name not in self._wanted]
        return min(idle, key=lambda m: m.last_used, default=None)

    def _make_room(self) -> None:
        """Stop idle models while the waiting requests need more slots than are free or freeing
        (llama-server's server_lru_sched::tick)."""
        if self.settings.models_max <= 0:
            return
        needed = sum(1 for n in self._wanted if not self.models[n].running or self.models[n].stopping)
        stopping = sum(m.running and m.stopping for m in self.models.values())
        free = self.settings.models_max - self._n_running() + stopping
        while free < needed:
            victim = self._victim()
            if victim is None:
                return  # every model is busy: wait for a request to end
            log.info("evicting idle model %s for a waiting request", victim.spec.name)
            self._request_stop(victim)
            free += 1

    def _first_waiting(self) -> str | None:
        """The model whose turn it is to start: the first wanted one that is not running."""
        return next((n for n in self._wanted if not self.models[n].running), None)

    async def ensure_ready(self, m: _Model) -> None:
        """Return once ``m`` is loaded, starting it (and making room) if needed; raises the
        error its request gets when it cannot be loaded."""
        if m.status == LOADED and not m.stopping:
            return
        name = m.spec.name
        self._wanted[name] = self._wanted.get(name, 0) + 1
        started = seen_loading = False
        try:
            while True:
                if self.closing:
                    raise APIError(503, "the server is stopping", type="unavailable_error", code="stopping")
                if not m.stopping:
                    if m.status == LOADED:
                        return
                    if m.status == LOADING:
                        seen_loading = True
                    elif started or seen_loading:  # it was started and came back down
                        if m.failed:
                            raise load_failed(m)
                        raise not_running(m)
                    elif self._first_waiting() == name and self._has_capacity():
                        self._spawn(m)
                        started = True
                        continue
                self._make_room()
                await self._wait_change()
        finally:
            self._wanted[name] -= 1
            if not self._wanted[name]:
                del self._wanted[name]
            self._notify()  # a slot made for this request goes to the next one

    async def load(self, m: _Model) -> None:
        """POST /models/load: start ``m`` (without waiting for it), first stopping the least
        recently used idle model if the limit is reached; 500 when every model is busy."""
        if not self._has_capacity():
            victim = self._victim()
            if victim is not None:
                self._request_stop(victim)
                while victim.running and not self.closing:
                    await self._wait_change()
        if self.closing:
            raise APIError(503, "the server is stopping", type="unavailable_error", code="stopping")
        if m.running:
            return  # started by a request meanwhile
        if not self._has_capacity():
            raise APIError(500, "model limit reached, try again later", type="server_error", code="models_max")
        self._spawn(m)

    def unload(self, m: _Model) -> None:
        """POST /models/unload: stop ``m``'s child."""
        self._request_stop(m)

    @contextlib.contextmanager
    def using(self, m: _Model, touch: bool):
        """While a request is proxied to ``m``: it is busy (never evicted); ``touch``: it counts
        as used now (POST requests, as in llama-server)."""
        m.requests += 1
        if touch:
            m.last_used = time.monotonic()
        try:
            yield
        finally:
            m.requests -= 1
            self._notify()

    # ------------------------------------------------------------------ what routes show

    def entry(self, m: _Model, now: int) -> dict:
        """``m`` as GET /models lists it (llama-server's fields)."""
        status: dict[str, Any] = {"value": m.status, "args": m.args}
        if m.spec.preset:
            status["preset"] = m.spec.preset
        if m.failed:
            status.update(exit_code=m.exit_code, failed=True, reason=m.reason)
        out = {"id": m.spec.name, "aliases": list(m.spec.aliases), "tags": list(m.spec.tags), "object": "model",
               "owned_by": "pyllama-spec", "created": now, "status": status,
               "architecture": {"input_modalities": list(m.spec.input_modalities), "output_modalities": ["text"]},
               "source": "preset", "can_remove": False}
        if m.running:
            for k, v in m.info.items():  # the child's own entry fills in what it knows (meta, capabilities)
                out.setdefault(k, v)
        return out

    def props(self) -> dict:
        """GET /props of the router itself (llama-server's fields; the model ones are placeholders there too)."""
        return {"role": "router", "max_instances": self.settings.models_max,
                "models_autoload": self.settings.autoload, "model_alias": "llama-server", "model_path": "none",
                "default_generation_settings": {"params": None, "n_ctx": 0}, "ui_settings": {},
                "build_info": f"pyllama-spec {__version__}", "cors_proxy_enabled": False}

    # ------------------------------------------------------------------ events (GET /models/sse)

    def _event(self, m: _Model, event: str, data: dict) -> None:
        payload = {"model": m.spec.name, "event": event, "data": data}
        for s in list(self._subscribers):
            s.put(payload)

    def subscribe(self) -> _Subscriber:
        s = _Subscriber(self._subscribers)
        if self.closing:
            s.close()
        return s


def input_modalities(mmproj: str | os.PathLike | None) -> tuple[str, ...]:
    """What a model with this projector file reads (GET /models' architecture.input_modalities),
    from the file's header, as llama-server does; a file that cannot be read: text only (the
    model's load then says why)."""
    from pyllama_spec.gguf.reader import read_gguf

    if not mmproj:
        return ("text",)
    try:
        meta = read_gguf(mmproj, "projector").metadata
    except (OSError, ValueError) as e:
        log.warning("cannot read the projector %s: %s", mmproj, e)
        return ("text",)
    return ("text", *(["image"] if meta.get("clip.has_vision_encoder") else []),
            *(["audio"] if meta.get("clip.has_audio_encoder") else []))


class _Subscriber:
    """One GET /models/sse client: its events, at most ``LIMIT`` behind (then it is dropped)."""

    LIMIT = 1024

    def __init__(self, owner: set) -> None:
        self.owner, self.events, self.closed, self.ready = owner, collections.deque(), False, asyncio.Event()
        owner.add(self)

    def put(self, payload: dict) -> None:
        if len(self.events) >= self.LIMIT:
            self.close()  # a client that does not read: dropped, the router's memory stays bounded
            return
        self.events.append(payload)
        self.ready.set()

    def close(self) -> None:
        self.closed = True
        self.owner.discard(self)
        self.ready.set()


def load_failed(m: _Model) -> APIError:
    return APIError(500, f"model name={m.spec.name} failed to load (exit code {m.exit_code})"
                    + (f": {m.reason}" if m.reason else ""), type="server_error", code="model_load_failed")


def not_running(m: _Model) -> APIError:
    return bad_request(f"model name={m.spec.name} is not running", "model", code="model_not_running")


# ---------------------------------------------------------------------------- responses


async def _until_disconnected(receive) -> None:
    """Returns when the client has gone (the body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _race_disconnect(work, receive) -> None:
    """Run ``work`` until it ends or the client goes away (then it is cancelled)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_until_disconnected(receive))
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

    def __init__(self, router: Router, m: _Model, request: Request, body: bytes, autoload: bool) -> None:
        self.router, self.m, self.request, self.body_bytes, self.autoload = router, m, request, body, autoload
        self.status_code = 200  # set from the child's answer (for logs; the ASGI messages carry it)

    async def __call__(self, scope, receive, send) -> None:
        await _race_disconnect(self._answer(scope, send), receive)

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
                proc, port = m.proc, m.port
                target = scope.get("raw_path") or scope["path"].encode()  # path and query as the client wrote them
                if scope.get("query_string"):
                    target += b"?" + scope["query_string"]
                url = httpx.URL(f"http://{CHILD_HOST}:{port}").copy_with(raw_path=target)
                headers = [(k, v) for k, v in self.request.headers.raw
                           if k.decode("latin-1").lower() not in _REQUEST_HEADERS_DROPPED]
                headers.append((b"authorization", f"Bearer {m.key}".encode()))
                upstream_request = router.client.build_request(scope["method"], url, headers=headers,
                                                               content=self.body_bytes)
                try:
                    upstream = await router.client.send(upstream_request, stream=True)
                except httpx.HTTPError as e:
                    raise await _child_gone(m, proc, e) from None
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


async def _child_gone(m: _Model, proc, e: Exception) -> APIError:
    """The error for a request whose child could not be reached (it crashed or is stopping)."""
    if proc is not None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proc.wait(), 2.0)  # let its exit (and its last lines) be recorded
    reason = "\n".join(m.tail) if proc is not None and proc.returncode not in (None, 0) else ""
    what = f"exited with status {proc.returncode}" if proc is not None and proc.returncode is not None \
        else f"cannot be reached ({type(e).__name__})"
    return APIError(500, f"model name={m.spec.name} {what}" + (f": {reason}" if reason else ""),
                    type="server_error", code="model_failed")


class _EventsResponse(Response):
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
            await _race_disconnect(stream(), receive)
        finally:
            sub.close()


# ---------------------------------------------------------------------------- the app


def create_router_app(specs: list[ModelSpec], settings: RouterSettings) -> Starlette:
    """The router's ASGI app; its lifespan starts the load-on-startup models and stops every
    child on shutdown. Raises ValueError for a preset it cannot serve (alias clashes, more
    load-on-startup models than --models-max)."""
    router = Router(specs, settings)

    def route(path: str, methods: list[str], handler) -> Route:
        async def endpoint(request: Request) -> Response:
            try:
                check_api_key(request, settings.api_key)
                return await handler(request)
            except APIError as e:
                return error_response(e)

        return Route(path, endpoint, methods=methods)

    def find(name: str) -> _Model:
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
        if len(raw) > PARSE_ON_A_THREAD_ABOVE:  # a large body is parsed off the event loop
            return raw, await asyncio.get_running_loop().run_in_executor(None, parse_json_body, raw)
        return raw, parse_json_body(raw)

    def model_of(body: Any) -> str:
        name = body.get("model") if isinstance(body, dict) else None
        return name if isinstance(name, str) else ""

    def proxied(request: Request, m: _Model, raw: bytes) -> Response:
        load = autoload(request)
        if not load and not m.running:
            raise bad_request("model is not loaded", "model", code="model_not_loaded")
        return ProxyResponse(router, m, request, raw, load)

    async def proxy_post(request: Request) -> Response:
        raw, body = await body_of(request)
        return proxied(request, find(model_of(body)), raw)

    async def proxy_get(request: Request) -> Response:
        return proxied(request, find(request.query_params.get("model", "")), b"")

    async def models(request: Request) -> Response:
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
        return _EventsResponse(router)

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

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=ERROR_HANDLERS)
    app.state.router = router
    app.state.service = router  # run.py's server calls its cancel_all() on SIGTERM / Ctrl-C
    return app


def follow_router(grace: float = 15.0) -> None:
    """In a child a router started: when the router goes (this process's stdin, a pipe from the
    router, closes), stop as on SIGTERM, and exit for good ``grace`` seconds later. So a router
    killed without cleaning up (SIGKILL) leaves no child behind (llama-server's children do the same)."""

    def watch() -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)
        os._exit(1)

    threading.Thread(target=watch, name="router-watch", daemon=True).start()
