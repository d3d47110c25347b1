"""llama-server's ``--sleep-idle-seconds N``: the model is unloaded once no request has used it for N
seconds, and loaded again by the next request that needs it.

``IdleSleep`` keeps the state (awake or asleep), the idle clock and the two changes between them; the
``Service`` says what unloading and loading are (closing its Engine, making one of the same
configuration). Every route but ``ANSWERED_ASLEEP`` holds the model (``hold()``) from the moment its
API key is checked until its response is sent: that loads it first when asleep, and the model is never
unloaded while a request holds it or a generation runs or waits. Requests arriving while it loads wait
for that one load. Everything here runs on the event loop; the unload and the load themselves run on
a thread (the Service's callbacks).

As in llama-server, N is at least 1, or -1 (the default): never.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

log = logging.getLogger("pyllama_spec.server")

#: The routes (path, method) answered while asleep without loading the model: what llama-server serves
#: with bypass_sleep (/health, /props, /models, /metrics), and the chat page. They read nothing native:
#: /props answers as it did when the model was unloaded, /metrics the counts, which cannot change meanwhile.
ANSWERED_ASLEEP = frozenset({("/health", "GET"), ("/v1/health", "GET"), ("/props", "GET"), ("/models", "GET"),
                             ("/v1/models", "GET"), ("/metrics", "GET"), ("/", "GET")})


def check_seconds(seconds: int) -> int:
    """llama-server's rule (common/arg.cpp): -1 (never) or at least 1 second."""
    if seconds == 0 or seconds < -1:
        raise ValueError(f"{seconds} is not allowed: give at least 1 (seconds), or -1 never to sleep")
    return seconds


class IdleSleep:
    """The model's sleep: unloaded after ``seconds`` without use, loaded again on demand.

    ``idle()`` says whether no generation runs or waits (the worker's queue); ``unload()`` and
    ``load()`` change the model (coroutines that run the native work on a thread). ``unload()``
    raises only before it has changed anything (the model stays loaded); a failed ``load()`` raises
    to every request that waited for it, and the next request tries again.
    """

    def __init__(self, seconds: int, *, idle: Callable[[], bool], unload: Callable[[], Awaitable[None]],
                 load: Callable[[], Awaitable[None]]) -> None:
        self.seconds = check_seconds(seconds)
        self.asleep = False  # from the start of the unload to the end of the next load
        self._idle, self._unload, self._load = idle, unload, load
        self._holders = 0  # requests using the model now
        self._last_use = time.monotonic()
        self._change = asyncio.Lock()  # one unload or load at a time: a load waits for an unload running
        self._waking: asyncio.Task | None = None  # the load every request arriving meanwhile waits for
        self._watch: asyncio.Task | None = None

    @property
    def enabled(self) -> bool:
        return self.seconds > 0

    @property
    def holders(self) -> int:
        """Requests holding the model now (those waiting for it to load included)."""
        return self._holders

    def start(self) -> None:
        """Start the idle clock (on the event loop that serves the app)."""
        if self.enabled and self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self._watch_idle())

    async def stop(self) -> None:
        """Stop the clock, after an unload or load running now has ended (the caller closes the engine
        next: never beside a thread still closing or loading it)."""
        if self._watch is None:
            return
        async with self._change:
            self._watch.cancel()
        try:
            await self._watch
        except asyncio.CancelledError:
            pass
        self._watch = None

    async def hold(self) -> Callable[[], None] | None:
        """Keep the model loaded until the returned ``release()`` is called, loading it first when it
        sleeps (None when sleeping is off: nothing to release)."""
        if not self.enabled:
            return None
        self._holders += 1  # before any await: the clock sees this request from now on
        try:
            while self.asleep:
                if self._waking is None:
                    self._waking = asyncio.get_running_loop().create_task(self._wake())
                    self._waking.add_done_callback(_seen)
                # shielded: a client that leaves does not abandon a load half done
                await asyncio.shield(self._waking)
        except BaseException:
            self._release()
            raise
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._release()

        return release

    def _release(self) -> None:
        self._holders -= 1
        self._last_use = time.monotonic()

    async def _wake(self) -> None:
        try:
            async with self._change:
                if self.asleep:
                    t0 = time.monotonic()
                    await self._load()
                    self.asleep = False
                    self._last_use = time.monotonic()
                    log.info("awake: the model was loaded again in %.1f s", time.monotonic() - t0)
        finally:
            self._waking = None

    async def _watch_idle(self) -> None:
        poll = min(1.0, self.seconds / 4)
        while True:
            await asyncio.sleep(poll)
            if self.asleep:
                continue
            if self._holders or not self._idle():
                self._last_use = time.monotonic()  # a generation outlives its request only until it stops
            elif time.monotonic() - self._last_use >= self.seconds:
                try:
                    await self._sleep()
                except Exception:  # noqa: BLE001 - the clock goes on; the next request loads the model
                    log.exception("unloading the model failed")

    async def _sleep(self) -> None:
        async with self._change:
            if self.asleep or self._holders or not self._idle():
                return
            self.asleep = True  # before the first await: a request arriving now waits for a load
            log.info("sleeping: no request for %d s, the model is unloaded (--sleep-idle-seconds)", self.seconds)
            try:
                await self._unload()
            except BaseException:
                self.asleep = False  # unload() raises only before it changed anything
                raise


def _seen(task: asyncio.Task) -> None:
    """A failed load whose waiters all went away is not reported as never retrieved."""
    if not task.cancelled():
        task.exception()
