"""Where a route's work runs, and noticing that its client went away: the server's one
off-loop policy.

The event loop serves every client at once (each stream's next piece, each new request), so work
that grows with what a client sent must not hold it; but a hop to a thread costs more than small
work itself. So the size of the input decides:

- ``off_loop(big, fn, ...)``: work linear in a request (reading its JSON, decoding its images,
  a prompt's text, tokenizing a stop string) runs here, on the event loop, while the input is
  under a budget (``PARSE_ON_A_THREAD_ABOVE`` bytes of body, or the caller's own for a string);
  above it, on a thread of the loop's default executor, where the loop goes on meanwhile (Pillow
  releases the GIL while it decodes). Work that has no small case (a JSON schema's grammar, a
  template rendered with tools, a slot file, stopping the engine) passes ``big=True``.
- ``ThreadRunner``: a route's tokenizer and template work always runs on a thread, and inputs
  over the budget take turns, one at a time per route, because llama.cpp's tokenizer holds some
  30 to 60 bytes of memory per byte of text while it runs (the memory of one huge tokenization
  at a time, however many clients send one at once).

``until_disconnected`` returns when a client has gone, so that a route waiting on a generation
can stop it.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any, Callable

from starlette.requests import Request

#: Request bodies larger than this (bytes) are worked on on a thread, not on the event loop; a
#: ThreadRunner runs larger ones one at a time.
PARSE_ON_A_THREAD_ABOVE = 256 * 1024


async def off_loop(big: bool, fn: Callable, *args: Any) -> Any:
    """``fn(*args)``: on a thread when ``big`` (work linear in a long input), else here."""
    if big:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
    return fn(*args)


class ThreadRunner:
    """Runs a request's tokenizer or template work on a thread: at once when the request is
    small, one at a time with the other large ones when it is large (the memory of one huge
    tokenization at a time). One per route module."""

    def __init__(self) -> None:
        self._large: asyncio.Semaphore | None = None

    async def __call__(self, size: int, fn: Callable, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        work = functools.partial(fn, *args)
        if size <= PARSE_ON_A_THREAD_ABOVE:
            return await loop.run_in_executor(None, work)
        if self._large is None:  # made here, on the event loop that serves the app
            self._large = asyncio.Semaphore(1)
        large = self._large
        await large.acquire()

        def done(f: asyncio.Future) -> None:
            large.release()
            if not f.cancelled():
                f.exception()  # seen, also when the client went away before it came

        try:
            future = loop.run_in_executor(None, work)
        except BaseException:
            large.release()
            raise
        # the turn ends when the thread is done, not when the client goes away (a native call
        # cannot be stopped): shielded, the client leaving does not cancel it
        future.add_done_callback(done)
        return await asyncio.shield(future)


async def until_disconnected(request: Request) -> None:
    """Returns when the client has gone (ASGI's http.disconnect; the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
