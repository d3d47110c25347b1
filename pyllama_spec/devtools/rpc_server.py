"""A ggml-rpc-server of this build on the loopback interface, for tests, benchmarks and trials.

>>> from pyllama_spec.devtools.rpc_server import LocalRPCServer                # doctest: +SKIP
>>> with LocalRPCServer() as server:
...     engine = ps.load("t.gguf", rpc_servers=[server.endpoint], n_gpu_layers=99)

The server is bound to 127.0.0.1 (an address in 127.0.0.0/8 only: ggml-rpc-server has no
authentication), on a free port, in its own process group, with a bounded lifetime (``timeout``
kills it after ``lifetime`` seconds even when the owner dies without cleaning up); ``close()``
ends it, ``kill()`` ends it as a crash would (SIGKILL). On another machine run
``pyllama-spec rpc-server -H ADDRESS -p PORT`` instead.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from pyllama_spec.ports import free_port


def server_binary() -> Path | None:
    """This build's ggml-rpc-server, or None when it was built without RPC."""
    from pyllama_spec.bindings.native_info import RPC_SERVER_PATH

    return RPC_SERVER_PATH if RPC_SERVER_PATH.is_file() else None


class LocalRPCServer:
    """One ggml-rpc-server process on loopback (see the module)."""

    def __init__(self, *, port: int | None = None, host: str = "127.0.0.1", threads: int = 1,
                 lifetime: float = 900, ready_timeout: float = 20, log: str | os.PathLike | None = None) -> None:
        if ipaddress.ip_address(host) not in ipaddress.ip_network("127.0.0.0/8"):
            raise ValueError(f"LocalRPCServer binds to loopback only (127.0.0.0/8), not {host}")
        binary = server_binary()
        if binary is None:
            raise FileNotFoundError("this build has no ggml-rpc-server: rebuild with `python build.py --rpc`")
        self.host, self.port = host, port or free_port(host)
        self.endpoint = f"{host}:{self.port}"
        cmd = [str(binary), "-H", host, "-p", str(self.port), "-t", str(threads)]
        if shutil.which("timeout"):
            cmd = ["timeout", "-s", "KILL", str(int(lifetime)), *cmd]
        self._log = open(log, "ab") if log else subprocess.DEVNULL
        self.process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log,
                                        start_new_session=True)
        try:
            self._wait_ready(ready_timeout)
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ggml-rpc-server on {self.endpoint} exited at start (rc {self.process.returncode})")
            try:
                # a connection that closes at once: the server serves it (nothing) and accepts the next
                with socket.create_connection((self.host, self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"ggml-rpc-server on {self.endpoint} did not listen within {timeout:g} s")

    def _signal(self, sig: int) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, sig)  # the server and the `timeout` around it
            except ProcessLookupError:
                pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        if self._log is not subprocess.DEVNULL:
            self._log.close()
            self._log = subprocess.DEVNULL

    def kill(self) -> None:
        """End the server as a crash would (SIGKILL): its clients see the connection drop."""
        self._signal(signal.SIGKILL)

    def close(self) -> None:
        self._signal(signal.SIGTERM)

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def __enter__(self) -> "LocalRPCServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.kill()
        except Exception:  # noqa: BLE001 - a finalizer must never raise
            pass
