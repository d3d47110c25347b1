"""An HTTP server started as its user starts it, for the tests and benchmarks that talk to it: a command
that takes ``--host`` and ``--port`` (`pyllama-spec serve`, llama-server), on a free port, until it
answers /health.

    with running_server([llama_server, "-m", "t.gguf"]) as url:
        ...  # requests to url; on the way out the server gets SIGTERM (SIGKILL if it does not stop)

Its standard error goes to a file (a pipe nobody reads would fill and stall it); a server that exits
or does not come up fails with the file's last lines.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator, Sequence

from pyllama_spec.ports import free_port


def wait_healthy(url: str, proc: subprocess.Popen, log: str | os.PathLike, within: float = 120.0,
                 poll: float = 0.2) -> None:
    """Until ``url``/health answers 200: RuntimeError with the log's tail if ``proc`` exits first or
    ``within`` seconds pass. ``poll``: seconds between tries (a start-up benchmark wants it short)."""
    deadline = time.monotonic() + within
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}: {Path(log).read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proc.args[0]} did not answer /health in {within:.0f} s: "
                               f"{Path(log).read_text()[-3000:]}")
        time.sleep(poll)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, and SIGKILL if it has not ended 30 s later."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def running_server(command: Sequence[str], *, within: float = 120.0, log: str | os.PathLike | None = None,
                   host: str | None = "127.0.0.1", env: dict | None = None,
                   cwd: str | os.PathLike | None = None) -> Iterator[str]:
    """``command --host HOST --port PORT`` (``host`` None: the command gives its own ``--host``) until
    it answers /health; yields its base URL (on 127.0.0.1) and stops it on the way out. Its standard
    error goes to ``log`` (a temporary file when None)."""
    port = free_port()
    log = log or tempfile.NamedTemporaryFile(prefix="server-", suffix=".log", delete=False).name
    args = [*map(str, command), *(["--host", host] if host else []), "--port", str(port)]
    with open(log, "w") as err:
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=cwd)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log, within)
        yield url
    finally:
        stop(proc)
