"""The router's models: which run, started, stopped and evicted as the package's doc says, each
by its own process (``child.Child``), waited for by requests, reported in status events and
GET /models entries (``Router``); and, on the child's side, ``follow_router``."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import httpx

from pyllama_spec import __version__
from pyllama_spec.server.errors import APIError, bad_request
from pyllama_spec.server.origins import OriginPolicy
from pyllama_spec.server.router.child import Child, command

log = logging.getLogger("pyllama_spec.server.router")

DEFAULT_STOP_TIMEOUT = 10  # seconds, llama-server's

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
    cors_origins: OriginPolicy = OriginPolicy()  # the web pages that may send requests (server/origins.py)
    #: How a child is started; its arguments follow.
    child_command: tuple[str, ...] = (sys.executable, "-m", "pyllama_spec.cli", "serve")
    router_port: int = 0  # told to the children (llama-server's LLAMA_SERVER_ROUTER_PORT)


@dataclasses.dataclass(eq=False)
class ModelState:
    """A model's state; changed only on the event loop."""

    spec: ModelSpec
    status: str = UNLOADED
    child: Child | None = None  # its process, while it runs (status loading or loaded)
    exit_code: int = 0
    reason: str = ""  # the child's last lines when it failed
    args: list[str] = dataclasses.field(default_factory=list)  # the command line of the last start
    last_used: float = 0.0
    requests: int = 0  # requests being proxied to it now
    info: dict = dataclasses.field(default_factory=dict)  # the child's /v1/models entry
    removed: bool = False  # gone from the preset file (a reload): requests still holding it get a 400

    @property
    def running(self) -> bool:
        return self.status in (LOADING, LOADED)

    @property
    def stopping(self) -> bool:
        """Asked to stop, not exited yet: still counts against --models-max."""
        return self.child is not None and self.child.stopping

    @property
    def failed(self) -> bool:
        return self.status == UNLOADED and self.exit_code != 0


class Router:
    """The models and their states: which run, within ``models_max``, and who waits for one (see
    the package's doc); each running model's process is a ``Child``. Use it on one event loop:
    ``await start()``, the routes, ``await close()``."""

    def __init__(self, specs: list[ModelSpec], settings: RouterSettings) -> None:
        self.settings = settings
        self.models: dict[str, ModelState] = {s.name: ModelState(s) for s in sorted(specs, key=lambda s: s.name)}
        self.names: dict[str, ModelState] = {n: self.models[to] for n, to in _names(specs).items()}
        startup = [m for m in self.models.values() if m.spec.load_on_startup]
        if settings.models_max > 0 and len(startup) > settings.models_max:
            raise ValueError(f"number of models to load on startup ({len(startup)}) exceeds models_max "
                             f"({settings.models_max})")
        for m in self.models.values():
            m.args = command(settings.child_command, m.spec.args, m.spec.name, 0)
        self.closing = False
        self.client: httpx.AsyncClient | None = None
        # waiting requests by model (the state, not its name: a reload may replace a name's model)
        self._wanted: collections.OrderedDict[ModelState, int] = collections.OrderedDict()
        self.reloading = False  # a reload is stopping models: no model is started meanwhile
        self._reload_lock = asyncio.Lock()  # one reload at a time
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
        watchers = [m.child.watcher for m in self.models.values() if m.child is not None]
        if watchers:
            limit = max(m.spec.stop_timeout for m in self.models.values()) + 5
            _, pending = await asyncio.wait(watchers, timeout=limit)
            for m in self.models.values():  # a child that outlived even that: killed, then reaped
                if m.child is not None:
                    m.child.kill()
            if pending:
                await asyncio.wait(pending, timeout=5)
        if self.client is not None:
            await self.client.aclose()

    # ------------------------------------------------------------------ children

    def _spawn(self, m: ModelState) -> None:
        """Start ``m``'s child (its status becomes loading; ``_loaded`` and ``_exited`` follow)."""
        m.child = Child(m.spec.name, self.settings.child_command, m.spec.args, stop_timeout=m.spec.stop_timeout,
                        router_port=self.settings.router_port, client=self.client,
                        on_ready=functools.partial(self._loaded, m), on_exit=functools.partial(self._exited, m))
        m.args = m.child.args
        m.status, m.exit_code, m.reason, m.info = LOADING, 0, "", {}
        m.last_used = time.monotonic()
        m.child.start()
        self._event(m, "model_status", {"status": LOADING})
        self._notify()

    def _loaded(self, m: ModelState, child: Child, info: dict) -> None:
        """``m``'s child answers: it is loaded (unless it was asked to stop meanwhile)."""
        if m.child is child and m.status == LOADING and not m.stopping:
            m.status, m.info = LOADED, info
            m.last_used = time.monotonic()
            self._event(m, "status_change", {"status": LOADED, "info": m.info})
            self._notify()

    def _exited(self, m: ModelState, child: Child, rc: int) -> None:
        if m.child is not child:
            return
        # A child that stopped as asked exits 0 or by the SIGTERM it was sent (uvicorn re-raises
        # it): that is a clean unload. Killed after its stop-timeout, or ended by itself with an
        # error, it failed (as in llama-server, where a force-killed child shows failed too).
        clean = rc == 0 or (child.stopping and rc == -signal.SIGTERM)
        m.exit_code = 0 if clean else rc
        m.reason = "" if clean else "\n".join(child.tail)
        m.status, m.child, m.info = UNLOADED, None, {}
        if not clean:
            log.warning("model %s exited with status %s", m.spec.name, rc)
        self._event(m, "status_change", {"status": UNLOADED, "exit_code": m.exit_code})
        self._notify()

    def _request_stop(self, m: ModelState) -> None:
        """Ask ``m``'s child to stop (SIGTERM; killed after stop-timeout); one still loading is
        killed at once, as llama-server does."""
        if not m.running or m.stopping:
            return
        m.child.stop(at_once=m.status == LOADING)
        self._notify()

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

    def _victim(self) -> ModelState | None:
        """The least recently used model that is loaded, idle, not stopping and not wanted."""
        idle = [m for m in self.models.values()
                if m.status == LOADED and not m.requests and not m.stopping and m not in self._wanted]
        return min(idle, key=lambda m: m.last_used, default=None)

    def _make_room(self) -> None:
        """Stop idle models while the waiting requests need more slots than are free or freeing
        (llama-server's server_lru_sched::tick)."""
        if self.settings.models_max <= 0:
            return
        needed = sum(1 for w in self._wanted if not w.removed and (not w.running or w.stopping))
        stopping = sum(m.running and m.stopping for m in self.models.values())
        free = self.settings.models_max - self._n_running() + stopping
        while free < needed:
            victim = self._victim()
            if victim is None:
                return  # every model is busy: wait for a request to end
            log.info("evicting idle model %s for a waiting request", victim.spec.name)
            self._request_stop(victim)
            free += 1

    def _first_waiting(self) -> ModelState | None:
        """The model whose turn it is to start: the first wanted one that is not running."""
        return next((w for w in self._wanted if not w.running and not w.removed), None)

    async def ensure_ready(self, m: ModelState) -> None:
        """Return once ``m`` is loaded, starting it (and making room) if needed; raises the
        error its request gets when it cannot be loaded."""
        if m.status == LOADED and not m.stopping:
            return
        self._wanted[m] = self._wanted.get(m, 0) + 1
        started = seen_loading = False
        spec = m.spec  # the arguments it is started with; a reload may change them
        try:
            while True:
                if self.closing:
                    raise APIError(503, "the server is stopping", type="unavailable_error", code="stopping")
                if m.removed:
                    raise not_found(m)
                # during a reload nothing is judged or started: the preset is about to change
                if not m.stopping and not self.reloading:
                    if m.status == LOADED:
                        return
                    if m.status == LOADING:
                        seen_loading = True
                    elif (started or seen_loading) and m.spec is not spec:
                        # a reload stopped it to change its arguments: start it again with the new ones
                        started = seen_loading = False
                        spec = m.spec
                        continue
                    elif started or seen_loading:  # it was started and came back down
                        if m.failed:
                            raise load_failed(m)
                        raise not_running(m)
                    elif self._first_waiting() is m and self._has_capacity():
                        self._spawn(m)
                        started = True
                        continue
                self._make_room()
                await self._wait_change()
        finally:
            self._wanted[m] -= 1
            if not self._wanted[m]:
                del self._wanted[m]
            self._notify()  # a slot made for this request goes to the next one

    async def load(self, m: ModelState) -> None:
        """POST /models/load: start ``m`` (without waiting for it), first stopping the least
        recently used idle model if the limit is reached; 500 when every model is busy."""
        await self._reload_done()
        if not self._has_capacity():
            victim = self._victim()
            if victim is not None:
                self._request_stop(victim)
                while victim.running and not self.closing:
                    await self._wait_change()
            await self._reload_done()
        if self.closing:
            raise APIError(503, "the server is stopping", type="unavailable_error", code="stopping")
        if m.removed:
            raise APIError(404, "model is not found", type="not_found_error", code="model_not_found")
        if m.running:
            return  # started by a request meanwhile
        if not self._has_capacity():
            raise APIError(500, "model limit reached, try again later", type="server_error", code="models_max")
        self._spawn(m)

    def unload(self, m: ModelState) -> None:
        """POST /models/unload: stop ``m``'s child."""
        self._request_stop(m)

    @contextlib.contextmanager
    def using(self, m: ModelState, touch: bool):
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

    # ------------------------------------------------------------------ reload (GET /models?reload=1)

    async def reload(self, specs: list[ModelSpec]) -> None:
        """Serve ``specs`` (the preset file read again) as llama-server's load_models does on a
        reload: a running model that is gone or whose arguments changed is stopped (and waited
        for), a gone one disappears, a running unchanged one keeps running, a new one is added
        unloaded (load-on-startup is not honoured, as there). Raises ValueError for names that
        clash, before anything changes."""
        new = {s.name: s for s in specs}
        names = _names(specs)
        async with self._reload_lock:
            self.reloading = True
            try:
                outdated = [m for m in self.models.values()
                            if m.running and not _same_process(m.spec, new.get(m.spec.name))]
                for m in outdated:
                    log.info("reload: stopping model %s (%s)", m.spec.name,
                             "changed" if m.spec.name in new else "no longer in the preset")
                    self._request_stop(m)
                while any(m.running for m in outdated) and not self.closing:
                    await self._wait_change()
                if self.closing:
                    raise APIError(503, "the server is stopping", type="unavailable_error", code="stopping")
                self._replace_models(new, names)
            finally:
                self.reloading = False
                self._notify()  # waiting requests go on with the new list
        self._broadcast({"model": "*", "event": "models_reload"})

    def _replace_models(self, new: dict[str, ModelSpec], names: dict[str, str]) -> None:
        """The models become ``new``'s, keeping the state of each name still there. No await in
        here: a request sees the old list or the new one, never a mix."""
        models = {}
        for name, spec in sorted(new.items()):
            m = self.models.get(name) or ModelState(spec, args=command(self.settings.child_command, spec.args, name, 0))
            if m.spec != spec:  # replaced only when changed: ensure_ready tells a change by identity
                m.spec = spec
                if not m.running:
                    m.args = command(self.settings.child_command, spec.args, name, 0)
            if not m.running:
                m.exit_code, m.reason = 0, ""  # a model that failed may be loaded again (as in llama-server)
            models[name] = m
        for name, m in self.models.items():
            m.removed = name not in models
        log.info("reload: models %s", ", ".join(models) or "(none)")
        self.models = models
        self.names = {n: models[to] for n, to in names.items()}

    async def _reload_done(self) -> None:
        """Wait while a reload runs (llama-server's load() waits too): a model is started with
        the arguments the preset file gives now."""
        while self.reloading and not self.closing:
            await self._wait_change()

    # ------------------------------------------------------------------ what routes show

    def entry(self, m: ModelState, now: int) -> dict:
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

    def _event(self, m: ModelState, event: str, data: dict) -> None:
        self._broadcast({"model": m.spec.name, "event": event, "data": data})

    def _broadcast(self, payload: dict) -> None:
        for s in list(self._subscribers):
            s.put(payload)

    def subscribe(self) -> _Subscriber:
        s = _Subscriber(self._subscribers)
        if self.closing:
            s.close()
        return s


def _names(specs: list[ModelSpec]) -> dict[str, str]:
    """Every name a request may use (a model's own, its aliases) -> the model's name; ValueError
    when an alias is another model's name or alias."""
    names = {s.name: s.name for s in specs}
    for s in specs:
        for alias in s.aliases:
            if names.get(alias, s.name) != s.name:
                raise ValueError(f"alias '{alias}' of model '{s.name}' is already the name of a model")
            names[alias] = s.name
    return names


def _same_process(old: ModelSpec, new: ModelSpec | None) -> bool:
    """Whether a running model of spec ``old`` may keep running under ``new``: the same section
    but for its names and tags, which only the router reads (llama-server compares the options
    less the alias)."""
    return new is not None and (dataclasses.replace(old, aliases=(), tags=())
                                == dataclasses.replace(new, aliases=(), tags=()))


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


def load_failed(m: ModelState) -> APIError:
    return APIError(500, f"model name={m.spec.name} failed to load (exit code {m.exit_code})"
                    + (f": {m.reason}" if m.reason else ""), type="server_error", code="model_load_failed")


def not_found(m: ModelState) -> APIError:
    """A model removed by a reload while a request waited for it: as if it had never been there."""
    return bad_request(f"model '{m.spec.name}' not found", "model", code="model_not_found")


def not_running(m: ModelState) -> APIError:
    return bad_request(f"model name={m.spec.name} is not running", "model", code="model_not_running")


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
