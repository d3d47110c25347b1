"""The thread that runs generations for the server, a bounded queue of jobs in front of it.

HTTP handlers run on the event loop; generation is native work that must not block it.
Each request becomes a ``Job``: queued (or refused when the queue is full), run on a
worker thread, its pieces handed back to the event loop as they are accepted. A job
whose client went away is cancelled: it stops between two steps (or between two
prefill batches).

Two workers, one interface (``submit``, ``stop``, ``queue_depth``, ``running``):

- ``EngineWorker`` (one slot): its own thread runs the jobs one at a time through
  ``Engine.stream``;
- ``SlotWorker`` (``-np N``): the engine's scheduler runs up to N jobs at once, every
  slot's draft verified in one target batch (``Engine.submit``).

Both also run work on one slot's sequence (``on_slot``: a slot's save, restore or erase) once
that slot is idle, and say what each slot runs or ran last (``slot_jobs``, for /slots).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any

from pyllama_spec.errors import EngineBusyError, GenerationCancelledError
from pyllama_spec.serving.engine import Engine


class QueueFullError(Exception):
    """The server already holds as many requests as it was told to queue."""


class JobCancelled(Exception):
    """Raised inside a cancelled job's generation (from its progress callback) to stop the prefill."""


class Job:
    """One generation: its arguments, and a channel of events back to the event loop."""

    #: Send ("progress", (stage, rows done, rows in all, perf_counter())) events while the prompt is
    #: decoded (llama-server's return_progress); the engine's progress stages (spec/generation.py).
    report_progress = False

    def progress(self, stage: str, done: int, total: int) -> None:
        """The engine's progress callback (on the worker thread)."""
        if self.report_progress and stage in ("cache", "prefill"):
            self.emit("progress", (stage, done, total, time.perf_counter()))

    def __init__(self, loop: asyncio.AbstractEventLoop, engine_args: dict, *, id_task: int = 0,
                 id_slot: int = -1, stream: bool = False) -> None:
        self.engine_args = engine_args
        self.id_task = id_task  # llama-server's task id, shown by /slots
        self.id_slot = id_slot  # the slot it asked for (-1: any)
        self.stream = stream  # its answer is streamed (shown by /slots)
        self._loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.submission = None  # its scheduler handle, under a SlotWorker
        self._slot: int | None = None  # where an EngineWorker runs it
        # What /slots reports of it, kept by the worker thread as its pieces go out:
        self.n_decoded = 0  # tokens generated
        self.has_new_line = False  # its text holds a newline
        self.stats = None  # its GenerationStats, once its last piece came
        self.ending = None  # how it ended (its last piece's Ending: the stop string, ...), once that came
        self.done = False  # its last event went out

    @property
    def slot(self) -> int | None:
        """The slot it runs (or ran) in; None before it has one."""
        if self._slot is None and self.submission is not None:
            return self.submission.slot
        return self._slot

    def emit(self, kind: str, value: Any = None) -> None:
        """From the worker thread: ("progress", ...) while the prompt is decoded when asked, ("piece",
        Piece) ..., then ("done", None) or ("error", exception)."""
        if kind == "piece":
            self.n_decoded += len(value.tokens)
            self.has_new_line = self.has_new_line or "\n" in value.text
            if value.stats is not None:
                self.stats, self.ending = value.stats, value.ending
        elif kind != "progress":  # ("progress", ...) events come before the pieces
            self.done = True
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()
        if self.submission is not None:
            self.submission.cancel()


class SlotJob:
    """Work on the one slot's sequence (a save, restore or erase), queued behind the generations
    of an ``EngineWorker``; ``future`` (on the event loop) gets its result."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fn) -> None:
        self.fn = fn
        self.future: asyncio.Future = loop.create_future()
        self.cancelled = threading.Event()
        self._loop = loop

    def cancel(self) -> None:
        self.cancelled.set()  # flags only (a signal handler may call it); the worker answers

    def run(self, engine: Engine) -> None:
        """On the worker thread: run it (or refuse it, cancelled) and hand the outcome back."""
        try:
            if self.cancelled.is_set():
                raise GenerationCancelledError("the server is stopping")
            outcome, error = engine.run_on_slot(0, self.fn).result(), None
        except Exception as e:  # noqa: BLE001 - handed to the request that asked
            outcome, error = None, e

        def settle() -> None:
            if not self.future.done():
                if error is None:
                    self.future.set_result(outcome)
                else:
                    self.future.set_exception(error)

        try:
            self._loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass


def make_worker(engine: Engine, max_queue: int, on_finished=None):
    """The worker for this engine: slots when it was loaded with n_parallel > 1."""
    if engine.config.n_parallel > 1:
        return SlotWorker(engine, max_queue, on_finished)
    return EngineWorker(engine, max_queue, on_finished)


class EngineWorker:
    def __init__(self, engine: Engine, max_queue: int, on_finished=None) -> None:
        self.engine = engine
        self._on_finished = on_finished  # called with each generation's stats, finished or cancelled
        self._jobs: queue.Queue = queue.Queue(maxsize=max_queue)
        self.running = 0  # generations in progress (0 or 1)
        self._current: Job | None = None  # the job in progress
        self._last: Job | None = None  # the latest job that ran (for /slots)
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

    def on_slot(self, slot: int, fn) -> asyncio.Future:
        """Run ``fn(sequence)`` on the worker thread after the jobs queued before it; its Future.
        QueueFullError when the queue is full."""
        job = SlotJob(asyncio.get_running_loop(), fn)
        self.submit(job)
        return job.future

    def slot_jobs(self) -> list[tuple[bool, Job | None, Any]]:
        """For the one slot: (whether it is generating, the job running in it or the latest that
        ran, that job's stats so far)."""
        current = self._current
        if current is not None:  # (done: its answer went out, the thread is still tidying up)
            return [(not current.done, current, self.engine.last_stats)]
        last = self._last
        return [(False, last, last.stats if last is not None else None)]

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the job in progress, drop the queued ones, end the thread."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if isinstance(job, SlotJob):
                job.cancel()
                job.run(self.engine)  # cancelled: it answers without running
            elif job is not None:
                job.cancel()
                job.emit("done")
        self._jobs.put(None)
        self._thread.join(timeout)

    def cancel_all(self) -> None:
        """Cancel the job in progress and the queued ones (safe from a signal handler: flags only)."""
        current = self._current
        if current is not None:
            current.cancel()
        # a copy of the deque (atomic under the GIL), not the queue's lock: a signal handler may
        # have interrupted this very thread inside put_nowait()
        for job in list(self._jobs.queue):
            if job is not None:
                job.cancel()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if isinstance(job, SlotJob):
                job.run(self.engine)
                continue
            if job.cancelled.is_set():
                job.emit("done")  # its handler may still wait (the server is stopping): it ends now
                continue
            self.running = 1
            job._slot = 0
            self._current = self._last = job
            self.engine.last_stats = None
            try:
                self._generate(job)
            finally:
                self.running = 0
                self._current = None
                if self._on_finished is not None and self.engine.last_stats is not None:
                    self._on_finished(self.engine.last_stats)

    def _generate(self, job: Job) -> None:
        def progress(stage: str, done: int, total: int) -> None:
            if job.cancelled.is_set():
                raise JobCancelled
            job.progress(stage, done, total)

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


class SlotWorker:
    """Jobs run by the engine's scheduler, up to ``n_parallel`` at once (see scheduler.py).

    ``max_queue`` bounds the jobs waiting for a free slot, as llama-server's queue of
    deferred tasks does; the running ones are not counted.
    """

    def __init__(self, engine: Engine, max_queue: int, on_finished=None) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self._on_finished = on_finished
        self._scheduler = engine.scheduler
        self._live: set[Job] = set()  # submitted, not finished: stop() cancels them
        self._last: dict[int, Job] = {}  # the latest job that ran in each slot (for /slots)
        self._lock = threading.Lock()
        self._stopping = False

    @property
    def queue_depth(self) -> int:
        return self._scheduler.n_pending

    @property
    def running(self) -> int:
        return self._scheduler.n_active

    def submit(self, job: Job) -> None:
        def on_event(kind: str, value: Any) -> None:  # on the scheduler's thread
            stats = value.stats if kind == "piece" else value if kind == "cancelled" else None
            if stats is not None and self._on_finished is not None:
                self._on_finished(stats)  # finished, or cancelled with the part it ran
            if kind == "cancelled":
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

        with self._lock:
            self._live.add(job)
        try:
            job.submission = self.engine.submit(**job.engine_args, on_event=on_event, max_waiting=self.max_queue,
                                                id_slot=job.id_slot,
                                                **({"progress": job.progress} if job.report_progress else {}))
        except BaseException as e:
            with self._lock:
                self._live.discard(job)
            if isinstance(e, EngineBusyError):
                raise QueueFullError from None
            raise
        if job.cancelled.is_set():  # cancelled before its handle existed
            job.submission.cancel()

    def on_slot(self, slot: int, fn) -> asyncio.Future:
        """Run ``fn(sequence)`` on the scheduler thread once ``slot`` is free; its Future."""
        return asyncio.wrap_future(self.engine.run_on_slot(slot, fn))

    def slot_jobs(self) -> list[tuple[bool, Job | None, Any]]:
        """For each slot: (whether it is generating, the job running in it or the latest that ran,
        that job's stats so far)."""
        with self._lock:
            live, last = list(self._live), dict(self._last)
        out = []
        for i in range(self.engine.config.n_parallel):
            running = self._scheduler.running(i)
            if running is not None:
                sub, stats = running
                job = next((j for j in live if j.submission is sub), None)
                out.append((job is None or not job.done, job, stats))
            else:
                done = last.get(i)
                out.append((False, done, done.stats if done is not None else None))
        return out

    def cancel_all(self) -> None:
        """Cancel this server's generations, running and waiting, without waiting for them."""
        self._stopping = True  # their requests get "the server is stopping"
        for job in list(self._live):  # a copy without the lock: a signal handler must not block
            job.cancel()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel this server's generations, running and waiting, and wait for their slots to free
        (the scheduler belongs to the engine, which outlives the server)."""
        with self._lock:
            self._stopping = True
            live = list(self._live)
        for job in live:
            job.cancel()
        for job in live:
            if job.submission is not None:
                job.submission.finished.wait(timeout)
