"""A free TCP port, for a process this package starts: the router's model processes
(``server/router/``), and the RPC servers and llama-servers of tests and benchmarks (``devtools``).

It lives at the root, importing nothing of the package, so that ``devtools`` reaches it without
the server's extra and the server without ``devtools``.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at ``host`` now (the OS picks it; it may be taken again later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
