"""The server's generations: each request's jobs handed to the engine's slot loop, a bounded
queue of them waiting for a slot, and their pieces handed back to the event loop.

HTTP handlers run on the event loop; generation is native work that must not block it. Each
choice of a request becomes a ``Job`` carrying its resolved ``Request``: queued in the engine's
slot loop (serving/slot_loop.py, on its own thread; with ``-np N`` up to N run at once, every
slot's draft verified in one target batch), or refused when the queue is full; its pieces come
back to the event loop as they are accepted. A job whose client went away is cancelled: it
stops between two steps (or between two prefill slices).

The worker also runs work on one slot's sequence (``on_slot``: a slot's save, restore or erase)
once that slot is idle, and says what each slot runs or ran last (``slot_jobs``, for /slots).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from pyllama_spec.errors import EngineBusyError, GenerationCancelledError
from pyllama_spec.serving.engine import Engine
from pyllama_spec.serving.request import Request


class QueueFullError(Exception):
    """The server already holds as many requests as it was told to queue."""


class Job:
    """One generation: its Request, and a channel of events back to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, request: Request, *, id_task: int = 0,
                 id_slot: int = -1, stream: bool = False, report_progress: bool = False) -> None:
        self.request = request
        self.id_task = id_task  # llama-server's task id, shown by /slots
        self.id_slot = id_slot  # the slot it asked for (-1: any)
        self.stream = stream  # its answer is streamed (shown by /slots)
        #: Send ("progress", (stage, rows done, rows in all, perf_counter())) events while the prompt is
        #: decoded (llama-server's return_progress); the engine's progress stages (speculative/generation.py).
        self.report_progress = report_progress
        self._event_loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.submission = None  # its handle in the slot loop, once submitted
        # What /slots reports of it, kept by the loop's thread as its pieces go out:
        self.n_decoded = 0  # tokens generated
        self.has_new_line = False  # its text holds a newline
        self.stats = None  # its GenerationStats, once its last piece came
        self.ending = None  # how it ended (its last piece's Ending: the stop string, ...), once that came
        self.done = False  # its last event went out

    @property
    def slot(self) -> int | None:
        """The slot it runs (or ran) in; None before it has one."""
        return self.submission.slot if self.submission is not None else None

    def progress(self, stage: str, done: int, total: int) -> None:
        """The engine's progress callback (on the loop's thread)."""
        if stage in ("cache", "prefill"):
            self.emit("progress", (stage, done, total, time.perf_counter()))

    def emit(self, kind: str, value: Any = None) -> None:
        """From the loop's thread: ("progress", ...) while the prompt is decoded when asked, ("piece",
        Piece) ..., then ("done", None) or ("error", exception)."""
        if kind == "piece":
            self.n_decoded += len(value.tokens)
            self.has_new_line = self.has_new_line or "\n" in value.text
            if value.stats is not None:
                self.stats, self.ending = value.stats, value.ending
        elif kind != "progress":  # ("progress", ...) events come before the pieces
            self.done = True
        try:
            self._event_loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancelled.set()

    def cancel(self) -> None:
        """Stop it (flags only: a signal handler may call it)."""
        self.cancelled.set()
        if self.submission is not None:
            self.submission.cancel()


class Worker:
    """Jobs run by the engine's slot loop, up to ``n_parallel`` at once (see the module).

    ``max_queue`` bounds the jobs waiting for a free slot, as llama-server's queue of
    deferred tasks does; the running ones are not counted. ``on_finished(stats)`` is called with
    each generation's stats, finished or cancelled with the part it ran.
    """

    def __init__(self, engine: Engine, max_queue: int, on_finished=None) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self._on_finished = on_finished
        self._slots = engine.slot_loop
        # the event loop waits for pieces: the slot loop turns on its own thread (a one-slot engine's,
        # started here, ends with the server)
        self._started_thread = not self._slots.threaded
        self._slots.start_thread()
        self._live: set[Job] = set()  # submitted, not finished: stop() cancels them
        self._last: dict[int, Job] = {}  # the latest job that ran in each slot (for /slots)
        self._lock = threading.Lock()
        self._stopping = False

    @property
    def queue_depth(self) -> int:
        return self._slots.n_pending

    @property
    def running(self) -> int:
        return self._slots.n_active

    def submit(self, job: Job) -> None:
        def on_event(kind: str, value: Any) -> None:  # on the loop's thread
            stats = value.stats if kind == "piece" else value if kind in ("cancelled", "closed") else None
            if stats is not None and self._on_finished is not None:
                self._on_finished(stats)  # finished, or cancelled with the part it ran
            if kind in ("cancelled", "closed"):
                if job.cancelled.is_set() and not self._stopping:
                    kind = "done"  # the client went away: nobody reads the rest
                else:  # the server (or the engine) is stopping
                    kind, value = "error", GenerationCancelledError("the server is stopping")
            if kind != "piece":
                with self._lock:
                    self._live.discard(job)
                    if job.slot is not None:
                        self._last[job.slot] = job
            job.emit(kind, value)

        request = job.request.with_progress(job.progress) if job.report_progress else job.request
        with self._lock:
            self._live.add(job)
        try:
            job.submission = self._slots.submit(request, on_event, max_waiting=self.max_queue, id_slot=job.id_slot)
        except BaseException as e:
            with self._lock:
                self._live.discard(job)
            if isinstance(e, EngineBusyError):
                raise QueueFullError from None
            raise
        if job.cancelled.is_set():  # cancelled before its handle existed
            job.submission.cancel()

    def on_slot(self, slot: int, fn) -> asyncio.Future:
        """Run ``fn(sequence)`` in the slot loop once ``slot`` is free; its Future."""
        return asyncio.wrap_future(self.engine.run_on_slot(slot, fn))

    def slot_jobs(self) -> list[tuple[bool, Job | None, Any]]:
        """For each slot: (whether it is generating, the job running in it or the latest that ran,
        that job's stats so far)."""
        with self._lock:
            live, last = list(self._live), dict(self._last)
        out = []
        for i in range(self.engine.config.n_parallel):
            running = self._slots.running(i)
            if running is not None:
                sub, stats = running
                job = next((j for j in live if j.submission is sub), None)
                out.append((job is None or not job.done, job, stats))
            else:
                done = last.get(i)
                out.append((False, done, done.stats if done is not None else None))
        return out

    def cancel_all(self) -> None:
        """Cancel this server's generations, running and waiting, without waiting for them
        (safe from a signal handler: flags only)."""
        self._stopping = True  # their requests get "the server is stopping"
        for job in list(self._live):  # a copy without the lock: a signal handler must not block
            job.cancel()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel this server's generations, running and waiting, and wait for their slots to free
        (the slot loop belongs to the engine, which outlives the server)."""
        with self._lock:
            self._stopping = True
            live = list(self._live)
        for job in live:
            job.cancel()
        for job in live:
            if job.submission is not None:
                job.submission.finished.wait(timeout)
        if self._started_thread:  # the engine outlives the server: its readers turn the loop again
            self._slots.stop_thread(timeout)
