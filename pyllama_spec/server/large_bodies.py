"""Large request bodies: parsed off the event loop, kept out of the cyclic collector's way while they
live, and freed on a thread a piece at a time.

Each of these held the GIL, and so every other request and ``/health``, for as long as a body is large
(3.9 million floats in 99,000 lists, 30 MB):

- a collection while the body lives walks every reference in it (80-140 ms), whichever thread's
  allocation sets it off, and parsing the body sets them off (its containers are young). A parsed JSON
  body is a tree, never a cycle, so it need not be walked: the automatic collector is off while large
  bodies are parsed, and once one is parsed, what exists is frozen (``gc.freeze``: collections skip it)
  until the last large body is freed;
- dropping it is one C call that frees it all (60-106 ms): once the route is done with it, it is freed on
  a thread by ``json_body.free_in_pieces``, ``FREE_PIECE`` values at a time.

Freezing keeps garbage cycles that exist at that moment until the unfreeze; where large bodies overlap
for longer than ``MAX_FROZEN_SECONDS`` (seen when the next large body is parsed), all is unfrozen and a
full collection runs, on a thread but holding the GIL as any collection does (the one stall this allows,
at most once a minute under overlapping large bodies).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from typing import Any

from starlette.requests import Request

from pyllama_spec.server.json_body import free_in_pieces, parse_json_body
from pyllama_spec.server.offload import off_loop

log = logging.getLogger(__name__)

#: Where a request keeps its large bodies until ``free`` (the ASGI scope lives as long as the request).
SCOPE_KEY = "pyllama_spec.large_bodies"


class _CollectorPause:
    """The collector off while large bodies are parsed, and what exists frozen while they live (see the
    module). Called from the event loop and from the freeing threads."""

    MAX_FROZEN_SECONDS = 60.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parsing = self._alive = 0
        self._was_enabled = True
        self._frozen_since: float | None = None

    def parsing_begins(self) -> None:
        with self._lock:
            if self._parsing == 0:
                self._was_enabled = gc.isenabled()
            self._parsing += 1
            gc.disable()

    def parsing_ends(self, parsed: bool) -> bool:
        """A large parse is over; ``parsed``: its body lives (``freed`` follows). True when the bodies
        have been frozen too long: the caller runs a collection (off the event loop)."""
        collect = False
        with self._lock:
            self._parsing -= 1
            if parsed:
                self._alive += 1
                now = time.monotonic()
                if self._frozen_since is None:
                    self._frozen_since = now
                if now - self._frozen_since <= self.MAX_FROZEN_SECONDS:
                    gc.freeze()
                else:  # overlapping large bodies for a minute: let the collector see everything once
                    gc.unfreeze()
                    self._frozen_since, collect = None, True
            if self._parsing == 0 and self._was_enabled:
                gc.enable()
        return collect

    def freed(self) -> None:
        with self._lock:
            self._alive -= 1
            if self._alive == 0:
                gc.unfreeze()
                self._frozen_since = None


_PAUSE = _CollectorPause()


async def parse(request: Request, raw: bytes) -> Any:
    """``raw`` parsed on a thread, the collector out of its way; kept on ``request`` for ``free``."""
    _PAUSE.parsing_begins()
    parsed = False
    try:
        body = await off_loop(True, parse_json_body, raw)
        parsed = True
    finally:
        collect = _PAUSE.parsing_ends(parsed)
    if collect:
        _on_a_thread(gc.collect)
    request.scope.setdefault(SCOPE_KEY, []).append(body)
    return body


def free(request: Request) -> None:
    """Once a route is done with ``request`` (its handler's frame gone): the large bodies ``parse`` kept
    for it are freed on a thread, a piece at a time."""
    bodies = request.scope.pop(SCOPE_KEY, None)
    if bodies:
        _on_a_thread(_free, bodies)


def _free(bodies: list) -> None:
    n = len(bodies)
    try:
        free_in_pieces(bodies)
    finally:
        for _ in range(n):
            _PAUSE.freed()


def _on_a_thread(fn, *args: Any) -> None:
    """``fn(*args)`` on the loop's executor, its failure logged; here, where the executor is shut down."""
    try:
        future = asyncio.get_running_loop().run_in_executor(None, fn, *args)
    except RuntimeError:  # the server is stopping: no executor any more
        fn(*args)
        return
    future.add_done_callback(lambda f: f.cancelled() or f.exception() is None or
                             log.error("freeing a large body failed", exc_info=f.exception()))
