"""Who may touch an engine's native state: one generation at a time.

An engine holds one sequence in native caches that are not thread-safe. A generation
(a ``stream`` from its first step to its end) owns the engine for its whole life,
because its cache and positions must not change between two of its steps.

* A generation started while another one owns the engine from **another thread**
  waits for it to finish (calls from a web server's worker threads are serialized).
* A generation started on the thread that last ran the owner, while the owner is
  suspended between two steps (two interleaved ``stream()`` generators, or
  ``generate()`` inside a ``for piece in stream()`` loop), **supersedes** it: waiting
  would deadlock. The superseded stream raises ``GenerationCancelledError`` if it is
  resumed, instead of going on over a cache that changed under it.
* Starting a generation from inside a running step of the same thread (a progress
  callback calling ``generate``) raises ``EngineBusyError``.

Pure Python: nothing native here.
"""

from __future__ import annotations

import threading

from pyllama_spec.errors import ClosedError, EngineBusyError, GenerationCancelledError


class Ticket:
    """One generation's claim on the gate."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()  # the thread that last ran a step of it
        self.running = True  # inside a step (not suspended at a yield)
        self.cancelled_by: str | None = None


class EngineGate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._owner: Ticket | None = None
        self.closed = False
        # Set while a step is in progress and cleared at each yield: a step cut short
        # (an exception, Ctrl-C) leaves native state half-updated, and the next owner
        # must start from a clean cache even if the cleanup itself was interrupted.
        self.dirty = False

    def enter(self) -> Ticket:
        """Claim the engine for a new generation (waits for other threads; see the module)."""
        me = threading.get_ident()
        with self._cond:
            while True:
                if self.closed:
                    raise ClosedError("the engine is closed")
                owner = self._owner
                if owner is None:
                    break
                if owner.thread == me:
                    if owner.running:
                        raise EngineBusyError("the engine is already running a generation on this thread "
                                              "(called from inside a step, e.g. a progress callback)")
                    owner.cancelled_by = "a newer generation on the same engine"
                    self._owner = None
                    break
                self._cond.wait()
            ticket = Ticket()
            self._owner = ticket
            return ticket

    def resume(self, ticket: Ticket) -> None:
        """A suspended generation is about to run its next step."""
        with self._cond:
            if self.closed:
                raise ClosedError("the engine was closed while this stream was suspended")
            if ticket.cancelled_by is not None:
                raise GenerationCancelledError(
                    f"this stream was superseded by {ticket.cancelled_by}: its cache changed under it, so it "
                    "cannot go on (finish or close a stream before starting another on the same engine)")
            ticket.thread = threading.get_ident()
            ticket.running = True
            self.dirty = True

    def pause(self, ticket: Ticket, consistent: bool) -> None:
        """The generation stopped running: at a yield (``consistent``) or because a step failed."""
        with self._cond:
            ticket.running = False
            if consistent:
                self.dirty = False

    def leave(self, ticket: Ticket) -> None:
        """The generation ended (finished, closed or failed)."""
        with self._cond:
            ticket.running = False
            if self._owner is ticket:
                self._owner = None
                self._cond.notify_all()

    def close(self) -> None:
        """Refuse new generations; wait for a step running on another thread, cancel a suspended owner."""
        me = threading.get_ident()
        with self._cond:
            while self._owner is not None and self._owner.running and self._owner.thread != me:
                self._cond.wait()
            self.closed = True
            self._owner = None
            self._cond.notify_all()

    def run_step(self, ticket: Ticket):
        """Context for one step of a generation: resume on entry, pause on exit."""
        return _Step(self, ticket)


class _Step:
    def __init__(self, gate: EngineGate, ticket: Ticket) -> None:
        self.gate, self.ticket = gate, ticket

    def __enter__(self) -> None:
        self.gate.resume(self.ticket)

    def __exit__(self, exc_type, exc, tb) -> None:
        self.gate.pause(self.ticket, consistent=exc_type is None)
