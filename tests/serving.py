"""Servers for tests: the app served on 127.0.0.1 and a free port the way `pyllama-spec serve`
serves it (server/run.py's make_server), on a thread, stopped by ``stop()``; and the command
itself in a process of its own (``cli_server``), as a user starts it."""

from __future__ import annotations

import base64
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from pyllama_spec.devtools.rpc_server import free_port  # noqa: F401 - the tests' free port too
from pyllama_spec.devtools.servers import running_server
from pyllama_spec.server import ServerSettings, create_app
from pyllama_spec.server.run import ServeLimits, make_server


class LocalServer:
    def __init__(self, engine, settings: ServerSettings, limits: ServeLimits = ServeLimits()) -> None:
        self.engine, self.port = engine, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(engine, settings)
        self._server = make_server(self.app, host="127.0.0.1", port=self.port, limits=limits, log_level="error")
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    @property
    def busy(self) -> int:
        """Generations running now (none while the server sleeps: it has no worker then)."""
        worker = self.app.state.service.worker
        return worker.running if worker is not None else 0

    def wait_idle(self, within: float) -> float:
        """Seconds until no generation runs; fails after ``within``."""
        start = time.monotonic()
        while self.busy:
            if time.monotonic() - start > within:
                raise AssertionError(f"still generating {within} s later")
            time.sleep(0.01)
        return time.monotonic() - start

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        assert not self._thread.is_alive()

    def __enter__(self) -> "LocalServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def http(base: str, path: str, body=None, raw: bytes | None = None) -> tuple[int, object]:
    """``base + path`` with urllib: a POST of ``body`` as JSON (or of ``raw`` bytes), a GET when
    there is neither; (status, the JSON answer, or its text when it is not JSON), error statuses
    included."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        text = e.read()
        try:
            return e.code, json.loads(text)
        except ValueError:
            return e.code, text.decode(errors="replace")


def image_chat(png: bytes, text: str, max_tokens: int) -> dict:
    """A greedy /v1/chat/completions body: one user turn, the picture (a data: URI) then ``text``."""
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                                      {"type": "text", "text": text}]}],
            "max_tokens": max_tokens, "temperature": 0}


def cli_server(*args: str, within: float = 120):
    """``python -m pyllama_spec serve ARGS --port P`` (what ``pyllama-spec serve`` runs) from this
    checkout, until it answers /health: a context yielding its base URL, which stops it (SIGTERM) on
    the way out. Fails with the server's stderr if it exits first (devtools/servers.py)."""
    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])))
    return running_server([sys.executable, "-m", "pyllama_spec", "serve", *args], within=within, host=None,
                          env=env, cwd=repo)
