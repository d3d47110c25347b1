"""One model's process in the router (``Child``): a ``pyllama-spec serve`` started on a free port
of 127.0.0.1 with an API key of its own, its output followed, its readiness noticed, asked to
stop, killed. What the model's state becomes meanwhile is the pool's (``pool.Router``): a child
only tells it when it answers and when it has ended."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import secrets
import signal
import sys
from collections.abc import Callable, Sequence

import httpx

from pyllama_spec.ports import free_port

log = logging.getLogger("pyllama_spec.server.router")

#: Set in a child's environment (llama-server's name): the child then exits when its stdin closes.
ROUTER_ENV = "LLAMA_SERVER_ROUTER_PORT"
#: Children listen here only, whatever address the router listens on.
CHILD_HOST = "127.0.0.1"
#: What a router's child must not inherit from its environment: the router's own settings, the
#: API key (each child gets one of its own), and Vertex AI's (AIP_HTTP_PORT would move the child
#: onto the router's port; the router is what Vertex AI talks to).
_ROUTER_ONLY_ENV = ("LLAMA_API_KEY", "LLAMA_ARG_API_KEY_FILE", "LLAMA_ARG_MODELS_PRESET", "LLAMA_ARG_MODELS_MAX",
                    "LLAMA_ARG_MODELS_AUTOLOAD", "LLAMA_ARG_MODELS_DIR", "LLAMA_ARG_HOST", "LLAMA_ARG_PORT",
                    "LLAMA_ARG_ALIAS", "LLAMA_ARG_SSL_KEY_FILE", "LLAMA_ARG_SSL_CERT_FILE", "AIP_MODE", "AIP_HTTP_PORT",
                    "AIP_HEALTH_ROUTE", "AIP_PREDICT_ROUTE")
#: Lines of a child's output kept for the reason it failed.
TAIL_LINES = 20
_MAX_LINE = 64 * 1024  # a child's line longer than this is cut (the tail stays bounded)


def command(program: Sequence[str], args: Sequence[str], name: str, port: int) -> list[str]:
    """A model's command line: how a child is started, the model's ``serve`` arguments, then
    where it listens and the name it answers to."""
    return [*program, *args, "--host", CHILD_HOST, "--port", str(port), "--alias", name]


def child_env(key: str, router_port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _ROUTER_ONLY_ENV}
    env[ROUTER_ENV] = str(router_port)
    env["LLAMA_API_KEY"] = key
    env["PYTHONUNBUFFERED"] = "1"  # its lines reach the router as they are written
    return env


class Child:
    """One start of a model's process, from spawn to exit (a model started again gets a new one).

    ``start()`` spawns it and follows it (``watcher``); it calls ``on_ready(child, info)`` once
    the process answers /health (``info``: its /v1/models entry, ``{}`` if unreadable) and
    ``on_exit(child, returncode)`` when it has ended (127: it could not be started), its last
    lines then in ``tail``. Use it on the event loop."""

    def __init__(self, name: str, program: Sequence[str], args: Sequence[str], *, stop_timeout: float,
                 router_port: int, client: httpx.AsyncClient,
                 on_ready: Callable[[Child, dict], None], on_exit: Callable[[Child, int], None]) -> None:
        self.name, self.stop_timeout, self.router_port, self.client = name, stop_timeout, router_port, client
        self.on_ready, self.on_exit = on_ready, on_exit
        self.port, self.key = free_port(CHILD_HOST), secrets.token_urlsafe(24)
        self.args = command(program, args, name, self.port)
        self.url = f"http://{CHILD_HOST}:{self.port}"
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.proc: asyncio.subprocess.Process | None = None
        self.stopping = False  # asked to stop (stop()), not exited yet
        self.kill_timer: asyncio.TimerHandle | None = None
        self.watcher: asyncio.Task | None = None

    def start(self) -> None:
        """Spawn the process (in a task, ``watcher``, that follows it until it ends)."""
        self.watcher = asyncio.ensure_future(self._run())

    def stop(self, at_once: bool = False) -> None:
        """Ask it to stop: SIGTERM, SIGKILL ``at_once``; killed after its stop-timeout."""
        self.stopping = True
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGKILL if at_once else signal.SIGTERM)
        self.kill_timer = asyncio.get_running_loop().call_later(self.stop_timeout, self._stop_timed_out)

    def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    def _stop_timed_out(self) -> None:
        self.kill_timer = None
        if self.stopping and self.proc is not None and self.proc.returncode is None:
            log.warning("killing model %s: it did not stop within %g s", self.name, self.stop_timeout)
            self.kill()

    async def _run(self) -> None:
        """Start the process, follow its output, tell when it answers, and how it ended."""
        try:
            # its own session: a Ctrl-C in the router's terminal reaches the router only, which
            # then stops the children in order; stdin stays open (a pipe) until the router ends
            proc = await asyncio.create_subprocess_exec(
                *self.args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=child_env(self.key, self.router_port), start_new_session=True)
        except OSError as e:
            self.tail.append(f"cannot start {self.args[0]}: {e}")
            self._ended(127)
            return
        self.proc = proc
        if self.stopping:  # unloaded (or the router stopping) while it was being started
            self.kill()
        ready = asyncio.ensure_future(self._until_ready(proc))
        await asyncio.gather(self._pump(proc.stdout), self._pump(proc.stderr))
        rc = await proc.wait()
        ready.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await ready
        self._ended(rc)

    def _ended(self, rc: int) -> None:
        if self.kill_timer is not None:
            self.kill_timer.cancel()
            self.kill_timer = None
        self.on_exit(self, rc)

    async def _pump(self, stream: asyncio.StreamReader) -> None:
        """The process's lines, passed on to the router's stderr (prefixed with the model's name)
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
                    self.tail.append(line)
                    with contextlib.suppress(OSError, ValueError):  # the router's own stderr gone: go on
                        sys.stderr.write(f"[{self.name}] {line}\n")
            if not chunk:
                with contextlib.suppress(OSError, ValueError):
                    sys.stderr.flush()
                return

    async def _until_ready(self, proc: asyncio.subprocess.Process) -> None:
        """Poll the process's /health until it answers; then read its /v1/models entry and tell."""
        delay = 0.05
        while proc.returncode is None:
            try:
                r = await self.client.get(self.url + "/health", timeout=2.0)
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
            r = await self.client.get(self.url + "/v1/models", headers={"Authorization": f"Bearer {self.key}"},
                                      timeout=10.0)
            info = r.json()["data"][0]
        self.on_ready(self, info if isinstance(info, dict) else {})
