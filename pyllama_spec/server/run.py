"""Serving the app with uvicorn, guarded against clients that hold connections and against
shutdowns that wait for work they could cancel.

- A connection must send a whole request head within ``header_timeout`` seconds of opening
  (or of starting its next request); uvicorn itself waits forever, so a client sending its
  headers a byte a second held a connection open for as long as it liked.
- Idle keep-alive connections close after ``keep_alive`` seconds (uvicorn's own timer).
- SIGTERM / Ctrl-C cancel every generation at once (each stops within one step), so the
  in-flight requests end, the connections close and the process exits; after
  ``graceful_timeout`` seconds the remaining request tasks are cancelled.
"""

from __future__ import annotations

import dataclasses
import errno
import socket
from pathlib import Path

import h11
import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclasses.dataclass(frozen=True)
class ServeLimits:
    header_timeout: float = 10.0  # seconds for a request head to arrive
    keep_alive: float = 5.0  # seconds an idle keep-alive connection stays open
    graceful_timeout: float = 10.0  # seconds shutdown waits for requests after cancelling them
    max_connections: int = 1024  # open connections (and requests) beyond this get 503


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, with a deadline for each request head."""

    header_timeout = ServeLimits.header_timeout

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._head_deadline = None
        super().connection_made(transport)
        self._arm_head_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # still waiting for (the rest of) a request head
            self._arm_head_deadline()
        else:
            self._disarm_head_deadline()

    def connection_lost(self, exc) -> None:
        self._disarm_head_deadline()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        if self._head_deadline is None and not self.transport.is_closing():
            self._head_deadline = self.loop.call_later(self.header_timeout, self._head_too_slow)

    def _disarm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.info("closing a connection that sent no complete request head in %.0f s",
                             self.header_timeout)
            self.transport.close()


class _Server(uvicorn.Server):
    """uvicorn's server; its exit signal first cancels every generation of the app's service."""

    def handle_exit(self, sig, frame) -> None:
        service = getattr(getattr(self.config.app, "state", None), "service", None)
        if service is not None:
            service.cancel_all()
        super().handle_exit(sig, frame)


def make_server(app: Starlette, *, host: str, port: int, limits: ServeLimits = ServeLimits(),
                log_level: str = "warning") -> uvicorn.Server:
    """A uvicorn server for ``app`` with these limits (``.run()`` it, or start it on a thread)."""
    protocol = type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout": limits.header_timeout})
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                            timeout_keep_alive=limits.keep_alive,
                            timeout_graceful_shutdown=limits.graceful_timeout,
                            limit_concurrency=limits.max_connections)
    return _Server(config)


def listening_sockets(hosts: list[str], port: int) -> list[socket.socket]:
    """Bound, listening sockets for llama-server's ``--host a,b,path.sock``: each TCP address on ``port``
    (with several, ``::`` is IPv6 only, as there; two names of one address share a socket), each path
    ending in ``.sock`` a UNIX socket (a stale socket file there is replaced; one a server still
    answers on is not). OSError naming the address that cannot be listened on."""
    out: list[socket.socket] = []
    seen: set = set()
    try:
        for host in hosts:
            if host.endswith(".sock"):
                path = Path(host)
                if path.resolve() in seen:
                    continue
                seen.add(path.resolve())
                if path.is_socket():
                    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                        if probe.connect_ex(host) == 0:
                            raise OSError(errno.EADDRINUSE, f"cannot listen on {host}: a server answers there")
                    path.unlink()  # left by a server that is gone
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                out.append(sock)
                where, addr = host, host
            else:
                try:
                    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                     flags=socket.AI_PASSIVE)[0]
                except socket.gaierror as e:
                    raise OSError(errno.EADDRNOTAVAIL, f"cannot listen on {host}:{port}: {e.strerror}") from None
                if (family, addr) in seen:
                    continue  # two names of one address ("127.0.0.1,localhost"): one socket
                seen.add((family, addr))
                sock = socket.socket(family, kind, proto)
                out.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6 and len(hosts) > 1:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                where = f"{host}:{port}"
            try:
                sock.bind(addr)
                sock.listen(2048)
            except OSError as e:
                raise OSError(e.errno, f"cannot listen on {where}: {e.strerror}") from None
            sock.set_inheritable(True)
    except BaseException:
        for sock in out:
            sock.close()
        raise
    return out


def _remove_socket_files(hosts: list[str]) -> None:
    for host in hosts:
        if host.endswith(".sock") and Path(host).is_socket():
            Path(host).unlink(missing_ok=True)


def serve(app: Starlette, *, host: str | list[str], port: int, limits: ServeLimits = ServeLimits(),
          log_level: str = "warning") -> None:
    """Serve ``app`` until SIGTERM or Ctrl-C (which cancel its generations first); ``host`` may be
    several addresses (and UNIX socket paths), as llama-server's ``--host``."""
    hosts = [host] if isinstance(host, str) else list(host)
    if len(hosts) == 1 and not hosts[0].endswith(".sock"):
        make_server(app, host=hosts[0], port=port, limits=limits, log_level=log_level).run()
        return
    sockets = listening_sockets(hosts, port)
    try:
        make_server(app, host=hosts[0], port=port, limits=limits, log_level=log_level).run(sockets=sockets)
    finally:
        for sock in sockets:
            sock.close()
        _remove_socket_files(hosts)
