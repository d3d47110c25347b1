"""One thread that owns the engine, a bounded queue of jobs in front of it.

HTTP handlers run on the event loop; generation is native work that must not block it.
Each request becomes a ``Job``: queued (or refused when the queue is full), run by the
worker thread through ``Engine.stream``, its pieces handed back to the event loop as
they are accepted. A job whose client went away is cancelled: the worker stops it
between two steps (or between two prefill batches) and moves on.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any

from ..engine import Engine


class QueueFullError(Exception):
    """The server already holds as many requests as it was told to queue."""


class JobCancelled(Exception):
    """Raised inside a cancelled job's generation (from its progress callback) to stop the prefill."""


class Job:
    """One generation: its arguments, and a channel of events back to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, engine_args: dict) -> None:
        self.engine_args = engine_args
        self._loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()

    def emit(self, kind: str, value: Any = None) -> None:
        """From the worker thread: ("piece", Piece) ..., then ("done", None) or ("error", exception)."""
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()


class EngineWorker:
    def __init__(self, engine: Engine, max_queue: int, on_finished=None) -> None:
        self.engine = engine
        self._on_finished = on_finished  # called with each generation's stats, finished or cancelled
        self._jobs: queue.Queue = queue.Queue(maxsize=max_queue)
        self.busy = False
        self._thread = threading.Thread(target=self._run, name="pyllama-spec-engine", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        return self._jobs.qsize()

    def submit(self, job: Job) -> None:
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise QueueFullError from None

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the job in progress, drop the queued ones, end the thread."""
        while True:
            try:
                self._jobs.get_nowait().cancel()
            except queue.Empty:
                break
        self._jobs.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.cancelled.is_set():
                continue
            self.busy = True
            self.engine.last_stats = None
            try:
                self._generate(job)
            finally:
                self.busy = False
                if self._on_finished is not None and self.engine.last_stats is not None:
                    self._on_finished(self.engine.last_stats)

    def _generate(self, job: Job) -> None:
        def progress(stage: str, done: int, total: int) -> None:
            if job.cancelled.is_set():
                raise JobCancelled

        try:
            stream = self.engine.stream(**job.engine_args, progress=progress)
            try:
                for piece in stream:
                    job.emit("piece", piece)
                    if job.cancelled.is_set():
                        break
            finally:
                stream.close()
            job.emit("done")
        except JobCancelled:
            job.emit("done")
        except Exception as e:  # noqa: BLE001 - handed to the request that caused it
            job.emit("error", e)
