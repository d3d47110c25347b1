"""The slot loop: every generation of an engine, one slot (sequence) each, every slot's draft
verified in one target batch — for one slot or many, as llama-server's ``update_slots()``.

An engine loaded with ``n_parallel=N`` has N sequences in its target context (and in its
drafter). Each turn of the loop:

1. runs slot operations (save, restore, erase) whose slot is free, and admits waiting requests
   into free slots (the free slot whose cache shares the longest prefix with the prompt, if more
   than a tenth of it, so a conversation's next turn lands where its last one is; else the least
   recently used). With a prompt cache (``--cache-ram``, prompt_cache.py), a slot about to lose
   most of its cache copies it there first, and takes back the saved prompt nearest the new one.
   Where the slots share one pool of n_ctx cells (``kv_unified``, llama-server's --kv-unified)
   instead of n_ctx / N each, the pool is shared out before every decode: idle slots give their
   cells up first (least recently used first); a prompt waits until all of it has cells while other
   slots decode, and when none decodes a slot holding part of its prompt gives it back to read
   it again later; when the decoding slots cannot each have a cell for their next token, the
   prompts being read give theirs back, then the answer holding the most fails (ContextFullError);
2. advances the prefilling slots one slice each in turn (text: up to n_batch rows; an image:
   one slice of its rows once encoded) until n_batch prompt rows were decoded this turn, so
   requests that arrive together start together, and a long prefill does not stall the others;
3. runs one ``speculative_step`` over every decoding slot: one draft call, one target
   decode holding every slot's ``[id_last, d1..dk]`` at its own positions, each slot's
   own verification and commit;
4. hands each request its piece, and frees the slots of finished or cancelled requests.

Who turns the loop: its own thread once anything is submitted to run in the background (with
``n_parallel > 1`` from the start, as a server needs); until then, the thread that waits for a
piece runs the turn itself. So a one-slot engine used from Python runs every native call on the
caller's thread, where Ctrl-C stops a long decode or encode between graph nodes, and a
generation advances only as its stream is read. Rules of that caller-driven mode (the loop's
thread, once started, needs none of them):

* a thread that starts a generation (or a slot operation) while one of its own streams is
  suspended in the slot it needs **supersedes** that stream: resuming it raises
  ``GenerationCancelledError`` instead of going on over a cache that changed under it (waiting
  would deadlock);
* a thread whose generation needs a slot another thread's stream holds runs that stream to its
  end (its pieces wait for their reader), then its own;
* starting a generation from inside a turn (a progress callback) raises ``EngineBusyError``.

Requests are ``Submission`` handles: iterate them for pieces (from any thread), take
``result()``, or ``cancel()``. A cancelled request stops between two steps (or two prefill
slices), leaving its slot's cache consistent for the next prompt.
"""

from __future__ import annotations

import collections
import logging
import queue
from concurrent import futures
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterator

from pyllama_spec.errors import ClosedError, ContextFullError, EngineBusyError, GenerationCancelledError
from pyllama_spec.serving.prompt_cache import SLOT_PROMPT_SIMILARITY, Entry, PromptCache, takes_cache_update
from pyllama_spec.speculative.generation import Generation, Piece, Result, speculative_step
from pyllama_spec.speculative.media import encode_media
from pyllama_spec.speculative.sequence import Sequence, rows_of

if TYPE_CHECKING:
    from pyllama_spec.serving.request import Request

log = logging.getLogger("pyllama_spec.prompt_cache")

#: Why a submission was cancelled, when not by its own ``cancel()``.
_SUPERSEDED = ("this stream was superseded by a newer generation on the same engine: its cache changed under "
               "it, so it cannot go on (finish or close a stream before starting another on the same engine)")


class Submission:
    """One request in the slot loop: queued, running in a slot, or finished.

    Iterate it for its pieces (the last carries ``finish_reason`` and ``stats``); the
    iteration raises what the generation raised, ``GenerationCancelledError`` when it
    was cancelled and ``ClosedError`` when the engine closed first. Leaving the iteration early
    cancels it. With ``on_event`` given (a server pushing into its event loop), events go there
    instead: ``("piece", Piece)`` ..., then ``("done", None)``, ``("error", exception)``,
    ``("cancelled", stats)`` or ``("closed", stats)`` (the GenerationStats of the part it ran,
    or None when it never reached a slot).
    """

    def __init__(self, request: "Request", loop: "SlotLoop", on_event: Callable[[str, Any], None] | None = None,
                 id_slot: int = -1) -> None:
        self.request = request
        self.id_slot = id_slot  # the slot it must run in (llama-server's id_slot); -1: any
        self._loop = loop
        self._on_event = on_event
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._cancel = threading.Event()
        self._cancel_reason: str | None = None  # set when the loop cancelled it (superseded)
        self.owner = threading.get_ident()  # the thread reading it (it runs the turns while the loop has no thread)
        self.finished = threading.Event()  # set once its last event was sent
        self.slot: int | None = None  # the slot it ran in
        self._seen: list[Piece] = []  # the pieces read so far, for result() and a second iteration
        self._ended = False  # its last event was read
        self._outcome: BaseException | None = None  # what it raised, if it did

    # --- the consumer's side
    def cancel(self) -> None:
        """Stop at the next step boundary (or drop it from the queue); safe from any thread (flags only)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def __iter__(self) -> Iterator[Piece]:
        if self._on_event is not None:
            raise TypeError("this submission sends its events to on_event; it cannot also be iterated")
        return self._pieces()

    def _pieces(self) -> Iterator[Piece]:
        if self._ended:  # iterated (or waited for) already: the same pieces and outcome again
            yield from list(self._seen)
            if self._outcome is not None:
                raise self._outcome
            return
        done = False
        try:
            while True:
                kind, value = self._next_event()
                if kind == "piece":
                    self._seen.append(value)
                    yield value
                    continue
                done = self._ended = True
                if kind == "done":
                    return
                if kind == "cancelled":
                    value = GenerationCancelledError(self._cancel_reason or (
                        "the generation was cancelled (Submission.cancel) before it finished"))
                elif kind == "closed":
                    value = ClosedError("the engine was closed before this generation finished")
                self._outcome = value
                raise value
        finally:
            if not done:
                self.cancel()  # the consumer stopped listening: free the slot
                self._loop.tidy()

    def _next_event(self) -> tuple[str, Any]:
        self.owner = threading.get_ident()
        while True:
            if not self._events.empty():
                return self._events.get_nowait()
            if self.finished.is_set():  # (set after its last event was put: that event is here, or taken)
                if not self._events.empty():
                    return self._events.get_nowait()
                return "cancelled", None  # taken, and lost (a Ctrl-C while it was read)
            if self._loop.threaded:  # (its thread may stop once idle: then this thread turns the loop)
                try:
                    return self._events.get(timeout=0.1)
                except queue.Empty:
                    continue
            self._loop.turn_for(self)

    def result(self):
        """Wait for the whole generation and return it as a Result (again on a later call; pieces
        already read from the submission are part of it)."""
        if not self._ended:
            for _ in self._pieces():
                pass
        if self._outcome is not None:
            raise self._outcome
        return Result.from_pieces(self._seen)

    # --- the loop's side
    def _emit(self, kind: str, value: Any = None) -> None:
        if self._on_event is not None:
            self._on_event(kind, value)
        else:
            self._events.put((kind, value))
        if kind != "piece":
            self.finished.set()

    def _has_event(self) -> bool:
        return not self._events.empty()


class _Running:
    """A submission in a slot: its prepared generation and where it is."""

    def __init__(self, submission: Submission, prepared, gen: Generation, lora: tuple[float, ...] = ()) -> None:
        self.submission = submission
        self.lora = lora  # its LoRA scales: every target decode of this slot runs under them
        self.prepared = prepared  # frees the request's bitmaps and sampler at the end
        self.gen = gen
        self.prefill: Iterator[Future | None] | None = None  # set when its prefill starts
        self.encoding: Future | None = None  # its media encode, while it runs on the encoder thread
        self.decoding = False

    @property
    def waits_for_encode(self) -> bool:
        return self.encoding is not None and not self.encoding.done()


class _SlotOp:
    """Work on one slot's sequence (a save, restore or erase), run when that slot is free."""

    def __init__(self, slot: int, fn: Callable, future: Future) -> None:
        self.slot, self.fn, self.future = slot, fn, future
        self.owner = threading.get_ident()


class SlotLoop:
    """The slots of one engine and the loop that runs them (see the module docstring).

    It is given what it runs on: the slots' sequences, the target context, the drafter, the
    projector, the engine's step cost, ``prepare(request)``, which makes a request's
    generation as a context manager (tokenized, with its sampler; freed at its end), and the
    engine's LoRA adapters (serving/lora.py). ``threaded``: start the loop's own thread now.
    """

    def __init__(self, *, sequences, ctx, drafter, projector, step_cost, prepare, lora, threaded: bool,
                 prompt_cache: PromptCache | None = None, cache_idle_slots: bool = False) -> None:
        self._sequences, self._ctx, self._drafter, self._projector = sequences, ctx, drafter, projector
        self._step_cost, self._prepare, self._lora = step_cost, prepare, lora
        self._prompt_cache = prompt_cache  # slots' caches kept in host memory (prompt_cache.py)
        # --kv-unified: the slots share one pool of n_ctx cells, shared out before every decode (a
        # recurrent target's state is no pool of cells: each sequence has its own)
        model = ctx.model
        self._shared_cells = ctx.kv_unified and len(sequences) > 1 and (model.is_hybrid or not model.is_recurrent)
        self._cache_idle_slots = cache_idle_slots and prompt_cache is not None
        if prompt_cache is not None:
            limit = f"{prompt_cache.limit_bytes >> 20} MiB" if prompt_cache.limit_bytes else "no size limit"
            log.debug("prompt cache: on, %s", limit)
        if self._cache_idle_slots:
            # llama-server's tag for this, which its tests read in its debug log
            log.debug("idle slots will be saved to the prompt cache upon starting a new task "
                      "(__TEST_TAG_CACHE_IDLE_SLOTS_ENABLED__)")
        self._cond = threading.Condition()
        self._pending: collections.deque[Submission] = collections.deque()
        self._slots: list[_Running | None] = [None] * len(sequences)
        self._admissions = 0  # admissions and releases so far: the clock of _last_used
        self._last_used = [0] * len(sequences)  # per slot: when it was last released
        self._stopping = False
        self._closed = False
        self._reset_requested: threading.Event | None = None
        self._slot_ops: list[_SlotOp] = []  # in the order asked
        self._driver: int | None = None  # the thread running a turn now
        self._turn_index = 0  # round robin over prefilling slots
        self.steps = 0  # speculative steps run (each over every decoding slot)
        self.slots_per_step: collections.Counter = collections.Counter()  # how many slots shared a step
        self._thread: threading.Thread | None = None
        self._leave_when_idle = False  # stop_thread() asked the thread to end once idle
        # Media encodes run on their own thread once the loop has one (one at a time: one projector),
        # so the other slots keep decoding while an image is encoded.
        self._encoder: ThreadPoolExecutor | None = None
        if threaded:
            self.start_thread()

    # ------------------------------------------------------------------ from any thread
    @property
    def threaded(self) -> bool:
        """Whether the loop runs on its own thread (else its readers run its turns)."""
        return self._thread is not None

    def start_thread(self) -> None:
        """Run the loop on its own thread from now on (a server's, or ``submit()``'s background work)."""
        with self._cond:
            if self._thread is not None:
                return
            if self._stopping:
                raise ClosedError("the engine is closed")
            self._leave_when_idle = False
            if self._projector is not None:
                self._encoder = ThreadPoolExecutor(1, thread_name_prefix="pyllama-spec-encode")
            self._thread = threading.Thread(target=self._run_forever, name="pyllama-spec-slots", daemon=True)
            self._thread.start()

    def submit(self, request: "Request", on_event: Callable[[str, Any], None] | None = None,
               max_waiting: int | None = None, id_slot: int = -1) -> Submission:
        """Queue a request for a slot (``id_slot``: that slot only, waiting while it is busy; -1:
        any). With ``max_waiting``, refuse it (EngineBusyError) when that many requests already
        wait for a slot (a server's bounded queue). ``on_event`` needs the loop's own thread,
        which it starts."""
        if not -1 <= id_slot < len(self._slots):
            raise ValueError(f"id_slot must be -1 (any) or a slot from 0 to {len(self._slots) - 1}, got {id_slot}")
        self._refuse_from_inside_a_turn()
        if on_event is not None:
            self.start_thread()
        sub = Submission(request, self, on_event, id_slot)
        with self._cond:
            if self._stopping:
                raise ClosedError("the engine is closed")
            if max_waiting is not None and len(self._pending) >= max_waiting:
                raise EngineBusyError(f"{len(self._pending)} requests are already waiting for a slot")
            self._pending.append(sub)
            self._cond.notify_all()
        return sub

    @property
    def n_active(self) -> int:
        return sum(r is not None for r in self._slots)

    @property
    def n_pending(self) -> int:
        return len(self._pending)

    def running(self, slot: int):
        """(Submission, GenerationStats) of the generation in ``slot`` now, or None when it is free
        (for reports such as a server's /slots; read from any thread)."""
        r = self._slots[slot]
        return None if r is None else (r.submission, r.gen.stats)

    def run_on_slot(self, slot: int, fn: Callable[[Any], Any]) -> Future:
        """Run ``fn(sequence)`` in the loop once ``slot`` is free (before any request waiting for a
        slot takes it), and return the Future of its result. While the slot runs a generation the
        action waits, as llama-server defers a slot action on a busy slot. With the loop's own thread
        the Future is returned at once (a server calls this on its event loop); without it the call
        runs the loop on this thread, and the Future is done on return."""
        if not 0 <= slot < len(self._slots):
            raise ValueError(f"slot must be from 0 to {len(self._slots) - 1}, got {slot}")
        self._refuse_from_inside_a_turn()
        op = _SlotOp(slot, fn, Future())
        with self._cond:
            if self._stopping:
                raise ClosedError("the engine is closed")
            self._slot_ops.append(op)
            self._cond.notify_all()
        if not self.threaded:
            self._turn_until(op.future.done)
            futures.wait([op.future])  # (the loop's thread may have started meanwhile)
        return op.future

    def reset_all(self) -> None:
        """Forget the cached prompts of the idle slots (in the loop; waits for it)."""
        self._refuse_from_inside_a_turn()
        with self._cond:
            if self._stopping:
                raise ClosedError("the engine is closed")
            # one reset serves every thread that asks before it runs
            done = self._reset_requested = self._reset_requested or threading.Event()
            self._cond.notify_all()
        if not self.threaded:
            self._turn_until(done.is_set)
        done.wait()  # (the loop's thread may have started meanwhile)

    def stop(self) -> None:
        """Close: end everything, waiting and running (a turn running on another thread first ends),
        and the loop's thread. Their readers get ``ClosedError``. Refused from inside a turn (a
        progress or event callback): the turn would go on over freed native objects."""
        self._refuse_from_inside_a_turn("close the engine")
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()  # its last turn ends, then it closes everything (_run_forever)
        me = threading.get_ident()
        try:
            with self._cond:
                while self._driver is not None:
                    self._cond.wait()
                if self._closed:
                    return
                self._driver = me
            self._close_everything()
        finally:
            self._release(me)

    def tidy(self) -> None:
        """Free the slots of cancelled requests now, when no turn runs and the loop has no thread
        (a stream closed early frees its bitmaps and sampler at once)."""
        if self.threaded:
            with self._cond:
                self._cond.notify_all()
            return
        me = threading.get_ident()
        try:
            with self._cond:
                if self._driver is not None or self._closed:
                    return
                self._driver = me
            self._drop_cancelled()
        finally:
            self._release(me)

    # ------------------------------------------------------------------ turning the loop on the caller's thread
    def turn_for(self, sub: Submission) -> None:
        """Run one turn on this thread for ``sub``'s sake, or wait for the turn another thread runs
        (returns once ``sub`` may have an event)."""
        self._turn_until(sub._has_event, driving=sub)

    def _turn_until(self, done: Callable[[], bool], driving: Submission | None = None) -> None:
        me = threading.get_ident()
        while not done():
            self._refuse_from_inside_a_turn()
            try:
                with self._cond:
                    # (while the engine closes, its closing turn comes first)
                    while (self._driver is not None or (self._stopping and not self._closed)) and not done():
                        self._cond.wait()
                    if done() or self._thread is not None:
                        return
                    if self._closed:
                        raise ClosedError("the engine is closed")
                    self._driver = me
                self._supersede_for(me, driving)
                self._turn(driving)
            except BaseException as e:
                if self._driver == me:
                    self._recover(e, me)  # a turn cut short (Ctrl-C): no slot goes on, the caller gets it
                raise
            finally:
                self._release(me)

    def _release(self, me: int) -> None:
        """End this thread's turn, if it holds one (set and cleared under the lock, so that a Ctrl-C
        anywhere between them cannot leave the loop held)."""
        with self._cond:
            if self._driver == me:
                self._driver = None
                self._cond.notify_all()

    def _refuse_from_inside_a_turn(self, what: str = "start a generation") -> None:
        if self._driver == threading.get_ident():
            raise EngineBusyError(f"cannot {what} from inside a step of this engine's own (a progress or "
                                  "event callback): it would run over the step in progress")

    def _supersede_for(self, me: int, driving: Submission | None) -> None:
        """This thread waits for a slot that one of its own suspended streams holds: cancel that
        stream (see the module), rather than wait for it forever."""
        if not (self._slot_ops or self._pending or self._reset_requested):
            return  # (each step of a stream: nothing waits for a slot)
        with self._cond:  # (other threads queue work meanwhile)
            ops, pending = list(self._slot_ops), list(self._pending)
        wanted: set[int] = {op.slot for op in ops if op.owner == me}
        if self._reset_requested is not None:
            wanted.update(range(len(self._slots)))
        free = [i for i, r in enumerate(self._slots) if r is None]
        for sub in pending:
            if sub.owner == me and not sub.cancelled:
                if sub.id_slot >= 0:
                    wanted.add(sub.id_slot)
                elif not free:
                    wanted.update(range(len(self._slots)))
        for i in sorted(wanted):
            r = self._slots[i]
            if r is not None and r.submission.owner == me and r.submission is not driving:
                r.submission._cancel_reason = _SUPERSEDED
                r.submission.cancel()

    def _recover(self, e: BaseException, me: int | None = None) -> None:
        """After a turn that raised (a Ctrl-C, or a fault in the loop itself): every running slot
        ends from an empty cache. The requests of the thread ``me`` that ran the turn get ``e``
        (its reader raises it anyway); another thread's get ``GenerationCancelledError``."""
        for i, running in enumerate(self._slots):
            if running is not None:
                try:
                    if running.prefill is not None and not running.decoding:
                        self._close_prefill(i, running)  # its cleanup runs now, not later over another prompt
                    running.gen.seq.reset()
                finally:
                    mine = me is None or running.submission.owner == me
                    self._finish(i, "error", e if mine else GenerationCancelledError(
                        f"the step this generation shared was interrupted ({type(e).__name__} on the thread "
                        "that ran it); its cache was forgotten"))

    # ------------------------------------------------------------------ the loop's own thread
    def _run_forever(self) -> None:
        me = threading.get_ident()
        closing, encoder = True, None
        try:
            while True:
                with self._cond:
                    while not (self._stopping or self._has_work() or self._leave_when_idle) \
                            or self._driver is not None:
                        self._cond.wait()
                    if self._stopping:
                        break
                    if self._leave_when_idle and not self._has_work():
                        # (decided under the lock: whatever comes next finds no thread, and turns it; the
                        # encoder is this thread's, taken here before a new thread can make its own)
                        self._thread, self._leave_when_idle, closing = None, False, False
                        encoder, self._encoder = self._encoder, None
                        break
                    self._driver = me
                try:
                    self._turn()
                    self._wait_while_only_encodes_run()
                except Exception as e:  # noqa: BLE001 - a fault of the loop's own: its requests fail, it goes on
                    self._recover(e)
                finally:
                    self._release(me)
        finally:
            if closing:  # (this thread is still the loop's: start_thread makes no other, nor an encoder)
                encoder, self._encoder = self._encoder, None
                try:
                    with self._cond:
                        self._stopping = True  # (also when it ended on a fault: nothing is queued to no one)
                        while self._driver is not None:
                            self._cond.wait()
                        self._driver = me
                    self._close_everything()
                finally:
                    self._release(me)
            if encoder is not None:
                encoder.shutdown(wait=True)

    def _has_work(self) -> bool:
        return bool(self._pending or self.n_active or self._reset_requested or self._slot_ops)

    def stop_thread(self, timeout: float | None = None) -> None:
        """Let the loop's own thread end once nothing runs or waits (a server stopped: the engine
        goes on, its readers turning the loop again, lazily, with Ctrl-C reaching native calls).
        Waits for it at most ``timeout`` seconds (None: until it ends); one still busy then (work of
        the engine's other users) ends by itself once idle."""
        with self._cond:
            thread = self._thread
            if thread is None:
                return
            self._leave_when_idle = True
            self._cond.notify_all()
        if thread is not threading.current_thread():
            thread.join(timeout)

    # ------------------------------------------------------------------ one turn
    def _turn(self, driving: Submission | None = None) -> None:
        """One turn (see the module). Run for ``driving``'s reader, it stops once that request has
        a piece: a stream advances only as it is read."""
        self._drop_cancelled()
        with self._cond:  # (taken after: were dropping to fail, the reset would wait for the next turn)
            reset, self._reset_requested = self._reset_requested, None
        if reset is not None:
            for seq, running in zip(self._sequences, self._slots):
                if running is None:
                    seq.reset()
            if self._prompt_cache is not None:
                self._prompt_cache.clear()  # nothing decoded before comes back
            reset.set()
        self._run_slot_ops()
        self._admit()
        self._prefill_slices()
        if driving is None or not driving._has_event():
            self._step()

    def _run_slot_ops(self) -> None:
        """Run the slot operations whose slot is free; the others wait for theirs."""
        if not self._slot_ops:
            return
        with self._cond:
            ready = [op for op in self._slot_ops if self._slots[op.slot] is None]
            self._slot_ops = [op for op in self._slot_ops if self._slots[op.slot] is not None]
        for op in ready:
            if not op.future.set_running_or_notify_cancel():
                continue  # its caller gave up waiting
            try:
                op.future.set_result(op.fn(self._sequences[op.slot]))
            except BaseException as e:  # noqa: BLE001 - handed to whoever asked
                op.future.set_exception(e)

    def _next_admissible(self, free: list[int]) -> Submission | None:
        """The first waiting request that may take one of the ``free`` slots (a request for a
        busy slot waits for it; those behind it go first). Called holding the lock."""
        for k, sub in enumerate(self._pending):
            if sub.id_slot < 0 or sub.id_slot in free or sub.cancelled:
                del self._pending[k]
                return sub
        return None

    def _admit(self) -> None:
        """Give waiting requests the free slots (the one asked for, else the one whose cache shares
        most with the prompt)."""
        while self._pending:
            free = [i for i, r in enumerate(self._slots) if r is None]
            with self._cond:
                if not free or not self._pending:
                    return
                sub = self._next_admissible(free)
                if sub is None:
                    return
            if sub.cancelled:
                sub._emit("cancelled")
                continue
            prepared = self._prepare(sub.request)
            try:
                gen = prepared.__enter__()
                seqs = self._sequences
                best = sub.id_slot if sub.id_slot >= 0 else self._pick_slot(free, gen)
                gen.seq = seqs[best]
                scales = self._lora.scales_for(sub.request.lora)
                taken = None
                if self._prompt_cache is not None:
                    taken = self._swap_through_cache(gen, scales, named_slot=sub.id_slot >= 0)
                if self._cache_idle_slots:
                    self._save_idle_slots(keep=best)
                if taken is not None:
                    # (after the idle slots gave their cells up: in one pool its rows then go low, not above
                    # theirs, where every decode of the answer would read the span: 1.5x the target's step)
                    self._load_from_cache(gen.seq, taken, scales)
                self._lora.use(gen.seq, scales)  # a prompt cached under other adapters is not reused
                if self._shared_cells:  # what the prompt does not keep frees its cells now, not at its first slice
                    if gen.cache_prompt:
                        gen.seq.keep_prefix(gen.parts)
                    else:
                        gen.seq.reset()
            except BaseException as e:
                prepared.__exit__(None, None, None)
                sub._emit("error", e)  # a bad request fails alone
                if not isinstance(e, Exception):
                    raise  # (a Ctrl-C: the turn ends, see _turn_until)
                continue
            sub.slot = best
            self._slots[best] = _Running(sub, prepared, gen, scales)

    def _pick_slot(self, free: list[int], gen: Generation) -> int:
        """llama-server's choice of a free slot: the one whose cache holds most of the prompt, if
        that is more than a tenth of it; else the least recently used (so a new conversation does
        not take the slot of one that was just served)."""
        if gen.cache_prompt:
            seqs = self._sequences
            shared, best = max(((seqs[i].prefix_length(gen.parts), i) for i in free), key=lambda t: (t[0], -t[1]))
            if shared / max(rows_of(gen.parts), 1) > SLOT_PROMPT_SIMILARITY:
                return best
        return min(free, key=lambda i: (self._last_used[i], i))

    def _swap_through_cache(self, gen: Generation, scales: tuple[float, ...], named_slot: bool) -> Entry | None:
        """When the slot ``gen`` takes would lose most of its cache to the prompt: copy the cache
        into the prompt cache, and take out the saved prompt that shares most with this one (not
        for a request that reuses no cache: it decodes its prompt whole anyway), to load into the
        slot (``_load_from_cache``). The cache never fails the request: on any error the slot starts
        empty."""
        seq, cache = gen.seq, self._prompt_cache
        try:
            if not takes_cache_update(seq, gen.parts, named_slot):
                return None
            log.debug("updating prompt cache: slot %d holds %d rows", seq.seq_id, seq.positions.n_rows)
            cache.save(seq, self._lora.cached_scales(seq.seq_id))
            best = cache.best_for(seq, gen.parts, scales, gen.draft_positions) if gen.cache_prompt else None
            if best is not None:
                cache.take(best)
            if best is not None and self._shared_cells:
                # the entry needs its cells (the slot's own go when it is replaced), and the decoding slots one each
                need = best.rows - seq.positions.n_rows + self._n_decoding()
                if self._free_cells(need, keep=seq.seq_id) < need:
                    log.debug("prompt cache: no room in the shared cache to restore %d rows into slot %d",
                              best.rows, seq.seq_id)
                    cache.put_back(best)
                    best = None
            cache.trim()
            return best
        except Exception:  # noqa: BLE001 - a cache fault costs this request its reuse, nothing more
            log.exception("prompt cache: failed on slot %d; the slot starts empty", seq.seq_id)
            seq.reset()
            return None

    def _load_from_cache(self, seq: Sequence, entry: Entry, scales: tuple[float, ...]) -> None:
        try:
            if self._prompt_cache.load(seq, entry):
                self._lora.mark_cached(seq.seq_id, scales)
        except Exception:  # noqa: BLE001 - as above
            log.exception("prompt cache: failed on slot %d; the slot starts empty", seq.seq_id)
            seq.reset()

    def _save_idle_slots(self, keep: int) -> None:
        """Copy every idle slot's cache but ``keep``'s (the one a request is taking) into the prompt
        cache (llama-server's --cache-idle-slots), so that a conversation whose slot another one
        takes later comes back from there; where the slots share one pool of cells (--kv-unified),
        empty them, their cells going to the busy slots, as llama-server does."""
        for i, running in enumerate(self._slots):
            if running is not None or i == keep:
                continue
            saved = self._copy_to_cache(i)
            if saved:  # llama-server's tag for this, which its tests read in its debug log
                log.debug("slot %d: saved idle slot to the prompt cache (__TEST_TAG_CACHE_IDLE_SLOT__)", i)
            if saved is not None and self._shared_cells:
                self._sequences[i].reset()  # as llama-server with --kv-unified: its cells go to the busy slots

    def _copy_to_cache(self, i: int) -> bool | None:
        """Copy idle slot i's cache into the prompt cache: True when copied (the cache then trimmed),
        False when there was nothing new to copy, None when the copy failed (logged: the slot keeps
        its cache, only the copy is missing)."""
        seq = self._sequences[i]
        try:
            saved = self._prompt_cache.save(seq, self._lora.cached_scales(seq.seq_id))
            if saved:
                self._prompt_cache.trim()
            return saved
        except Exception:  # noqa: BLE001
            log.exception("prompt cache: could not save idle slot %d", i)
            return None

    # ------------------------------------------------------------------ one pool of cells (--kv-unified)
    def _cells_free(self) -> int:
        return self._ctx.n_ctx - sum(seq.positions.n_rows + seq.media_rows_in for seq in self._sequences)

    def _n_decoding(self) -> int:
        return sum(1 for r in self._slots if r is not None and r.decoding)

    def _free_cells(self, needed: int, keep: int = -1) -> int:
        """Empty idle slots but ``keep``, least recently used first, until ``needed`` cells of the
        shared pool are free (each copied into the prompt cache first, when there is one), unless
        all of them together would not free enough; the cells free."""
        free = self._cells_free()
        if free >= needed:
            return free
        idle = sorted((i for i, r in enumerate(self._slots)
                       if r is None and i != keep and self._sequences[i].positions.n_rows),
                      key=lambda i: self._last_used[i])
        if free + sum(self._sequences[i].positions.n_rows for i in idle) < needed:
            return free  # emptying them would not do: keep their caches
        for i in idle:
            if free >= needed:
                break
            seq = self._sequences[i]
            if self._prompt_cache is not None:
                self._copy_to_cache(i)  # (a failed copy loses only the copy: the cells are needed)
            free += seq.positions.n_rows
            log.debug("slot %d: idle, its %d cells given to the busy slots", i, seq.positions.n_rows)
            seq.reset()
        return free

    def _restart_prefill(self, i: int) -> None:
        """Slot i gives back the cells of the part of its prompt read so far, to read it all again later."""
        running = self._slots[i]
        log.debug("slot %d: its %d rows read so far give way; it reads its prompt again later", i,
                  running.gen.seq.positions.n_rows + running.gen.seq.media_rows_in)
        if running.prefill is not None:
            self._close_prefill(i, running)  # (a media item cut short removes its rows)
            running.prefill = None
        running.gen.seq.reset()

    def _fits_prefill(self, i: int) -> bool:
        """Whether slot i's prompt may go on being read: while other slots decode, only if the whole
        rest of it has cells (with one for each decoding slot's next token), so that a prompt
        never holds cells an answer needs; when none decodes, its next slice. Idle slots are
        emptied for it if need be. When no slot decodes and the prompts being read hold the pool
        between them, a slot holding part of its prompt gives it back to read again later, so
        that another gets in whole (one always does: every prompt fits n_ctx alone)."""
        running = self._slots[i]
        seq = running.gen.seq
        rows_left = max(1, rows_of(running.gen.parts) - seq.prefix_length(running.gen.parts))
        decoding = self._n_decoding()
        need = rows_left + decoding if decoding else min(self._ctx.n_batch, rows_left)
        if self._free_cells(need) >= need:
            return True
        if not decoding and seq.positions.n_rows + seq.media_rows_in:
            self._restart_prefill(i)
        return False

    def _share_cells(self, active: list) -> list:
        """Share the pool's free cells among the decoding slots for one step: each its next token's,
        the rest evenly for drafts. Where the pool cannot give each slot one cell, the prompts being
        read give theirs back first; then the slot holding the most fails (ContextFullError,
        llama-server's "Context size has been exceeded", which fails every slot there)."""
        n_draft = getattr(self._drafter, "n_max", 0) if self._drafter is not None else 0
        free = self._free_cells(len(active) * (1 + n_draft))
        if free < len(active):
            for j, r in enumerate(self._slots):
                if r is not None and not r.decoding and r.gen.seq.positions.n_rows + r.gen.seq.media_rows_in:
                    self._restart_prefill(j)
            free = self._free_cells(len(active))
        while active and free < len(active):
            i, r = max(active, key=lambda t: t[1].gen.seq.positions.n_rows)
            active.remove((i, r))
            rows = r.gen.seq.positions.n_rows
            r.gen.seq.reset()
            self._finish(i, "error", ContextFullError(
                f"Context size has been exceeded: the {self._ctx.n_ctx} cache cells the {len(self._sequences)} slots "
                f"share (--kv-unified) are full; this answer held {rows} of them"))
            free = self._free_cells(len(active))
        for _, r in active:
            r.gen.cells_for_step = 1 + (free - len(active)) // len(active)
        return active

    def _drop_cancelled(self) -> None:
        for i, running in enumerate(self._slots):
            if running is not None and running.submission.cancelled:
                if running.prefill is not None and not running.decoding:
                    self._close_prefill(i, running)  # cut back to a consistent cache
                self._finish(i, "cancelled", running.gen.stats)

    def _prefill_slices(self) -> None:
        """Advance the prefilling slots, one slice each in turn, until this turn decoded n_batch
        prompt rows (llama-server's batch budget): requests that arrive together start decoding
        together, while a long prompt or a big image still yields to the decoding slots after
        n_batch rows."""
        budget = self._ctx.n_batch
        while budget > 0:
            waiting = [i for i, r in enumerate(self._slots)  # cancelled ones are dropped next turn
                       if r is not None and not r.decoding and not r.submission.cancelled and not r.waits_for_encode]
            if self._shared_cells:
                waiting = [i for i in waiting if self._fits_prefill(i)]
            if not waiting:
                return
            i = waiting[self._turn_index % len(waiting)]
            self._turn_index += 1
            budget -= self._prefill_slice(i, self._slots[i])

    def _prefill_slice(self, i: int, running: _Running) -> int:
        """One slice of slot i's prefill; the prompt rows it decoded (at least 1, so turns end)."""
        try:
            if running.prefill is None:
                running.prefill = running.gen.prefill(self._ctx.n_batch, self._projector,
                                                      self._encode_async if self._encoder else None)
            before = running.gen.seq.positions.n_rows
            self._lora.apply(self._ctx, running.lora)
            out = next(running.prefill, None)
            running.encoding = out if isinstance(out, Future) else None
            if running.encoding is not None:
                return 0  # its image is being encoded: the others go on
            if running.gen.prefilled:  # the prompt is in: its first token, before any other decode
                running.decoding = True
                self._deliver(i, running.gen.start())
            return max(1, running.gen.seq.positions.n_rows - before)
        except Exception as e:  # noqa: BLE001 - a failed prefill fails its request alone
            if running.prefill is not None:
                self._close_prefill(i, running)
            running.gen.seq.reset()
            self._finish(i, "error", e)
            return 1

    def _encode_async(self, chunk) -> Future:
        def encode():  # the target's encode, and a vision draft model's of the same item (speculative/media.py)
            t = time.perf_counter()
            return encode_media(self._projector, chunk), time.perf_counter() - t

        future = self._encoder.submit(encode)
        future.add_done_callback(lambda _: self._wake())
        return future

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _wait_while_only_encodes_run(self) -> None:
        """Nothing to decode but encodes running: sleep until one ends or a request comes."""
        active = [r for r in self._slots if r is not None]
        if active and all(r.waits_for_encode for r in active):
            with self._cond:
                if not (self._pending or self._stopping or self._reset_requested or self._slot_ops):
                    self._cond.wait(0.1)

    def _step(self) -> None:
        active = [(i, r) for i, r in enumerate(self._slots) if r is not None and r.decoding and not r.gen.finished]
        if self._shared_cells and active:
            active = self._share_cells(active)
        # One target decode runs under one set of LoRA scales: as llama-server batches only slots
        # whose adapters are equal, the slots of each set step together, one set after another.
        by_lora: dict[tuple[float, ...], list] = {}
        for i, r in active:
            by_lora.setdefault(r.lora, []).append((i, r))
        for scales, group in by_lora.items():
            self._lora.apply(self._ctx, scales)
            self._step_slots(group)

    def _step_slots(self, active: list) -> None:
        """One speculative step over these decoding slots: one draft call, one target decode."""
        try:
            pieces = speculative_step(self._ctx, self._drafter, [r.gen for _, r in active], self._step_cost)
        except Exception as e:  # noqa: BLE001 - a shared step failed: every slot in it fails
            for i, r in active:
                r.gen.seq.reset()
                self._finish(i, "error", e)
            return
        self.steps += 1
        self.slots_per_step[len(active)] += 1
        for (i, r), piece in zip(active, pieces):
            if isinstance(piece, Exception):  # its own sampler failed (its grammar): it alone ends
                r.gen.seq.reset()
                self._finish(i, "error", piece)
            else:
                self._deliver(i, piece)

    def _deliver(self, i: int, piece: Piece | None) -> None:
        running = self._slots[i]
        if piece is not None:
            running.submission._emit("piece", piece)
        if running.gen.finished:
            self._finish(i, "done")

    def _close_prefill(self, i: int, running: _Running) -> None:
        try:
            running.prefill.close()  # a media chunk cut short removes its rows (sequence.py)
        except BaseException:  # noqa: BLE001
            running.gen.seq.reset()

    def _finish(self, i: int, kind: str, value: Any = None) -> None:
        running = self._slots[i]
        self._slots[i] = None
        self._admissions += 1  # least recently used counts from the release, as llama-server's t_last_used
        self._last_used[i] = self._admissions
        try:
            if running.encoding is not None:
                try:  # its chunk must outlive the encode that reads it
                    running.encoding.result()
                except Exception:  # noqa: BLE001 - the request ends anyway
                    pass
            running.prepared.__exit__(None, None, None)
        finally:
            running.submission._emit(kind, value)

    def _close_everything(self) -> None:
        """The engine closes: every request, running or waiting, and every slot operation ends."""
        for i, running in enumerate(self._slots):
            if running is not None:
                if running.prefill is not None and not running.decoding:
                    self._close_prefill(i, running)
                self._finish(i, "closed", running.gen.stats)
        with self._cond:
            self._closed = True
            pending, self._pending = list(self._pending), collections.deque()
            ops, self._slot_ops = self._slot_ops, []
        for sub in pending:
            sub._emit("closed")
        for op in ops:
            if op.future.set_running_or_notify_cancel():
                op.future.set_exception(ClosedError("the engine closed before the slot was free"))
        if self._prompt_cache is not None:
            self._prompt_cache.clear()  # its memory goes with the engine (a server asleep gives it back)
        if self._reset_requested is not None:
            self._reset_requested.set()
