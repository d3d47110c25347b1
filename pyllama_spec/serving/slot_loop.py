"""Several generations at once: one slot (sequence) each, every slot's draft verified in one batch.

An engine loaded with ``n_parallel=N`` has N sequences in its target context (and in its
drafter). A scheduler thread owns them. Each turn of its loop:

1. admits waiting requests into free slots (the free slot whose cache shares the longest
   prefix with the prompt, so a conversation's next turn lands where its last one is);
2. advances the prefilling slots one slice each in turn (text: up to n_batch rows; an image:
   one slice of its rows once encoded) until n_batch prompt rows were decoded this turn, so
   requests that arrive together start together, and a long prefill does not stall the others.
   An image's encode runs on the encoder thread meanwhile: its slot waits, the others decode;
3. runs one ``speculative_step`` over every decoding slot: one draft call, one target
   decode holding every slot's ``[id_last, d1..dk]`` at its own positions, each slot's
   own verification and commit;
4. hands each request its piece, and frees the slots of finished or cancelled requests.

Requests are ``Submission`` handles: iterate them for pieces (from any thread), take
``result()``, or ``cancel()``. A cancelled request stops between two steps (or two prefill
slices), leaving its slot's cache consistent for the next prompt.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterator

from pyllama_spec.errors import GenerationCancelledError
from pyllama_spec.spec.generation import Generation, Piece, Result, speculative_step
from pyllama_spec.spec.media import encode_media

if TYPE_CHECKING:
    from pyllama_spec.serving.request import Request


class Submission:
    """One request in a scheduler: queued, running in a slot, or finished.

    Iterate it for its pieces (the last carries ``finish_reason`` and ``stats``); the
    iteration raises what the generation raised, and ``GenerationCancelledError`` when it
    was cancelled. Leaving the iteration early cancels it. With ``on_event`` given (a server
    pushing into its event loop), events go there instead: ``("piece", Piece)`` ...,
    then ``("done", None)``, ``("error", exception)`` or ``("cancelled", stats)`` (the
    GenerationStats of the part it ran, or None when it never reached a slot).
    """

    def __init__(self, request: "Request", on_event: Callable[[str, Any], None] | None = None,
                 id_slot: int = -1) -> None:
        self.request = request
        self.id_slot = id_slot  # the slot it must run in (llama-server's id_slot); -1: any
        self._on_event = on_event
        self._events: queue.Queue = queue.Queue()
        self._cancel = threading.Event()
        self.finished = threading.Event()  # set once its last event was sent
        self.slot: int | None = None  # the slot it ran in
        self._seen: list[Piece] = []  # the pieces read so far, for result() and a second iteration
        self._ended = False  # its last event was read
        self._outcome: BaseException | None = None  # what it raised, if it did

    # --- the consumer's side
    def cancel(self) -> None:
        """Stop at the next step boundary (or drop it from the queue); safe from any thread."""
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
                kind, value = self._events.get()
                if kind == "piece":
                    self._seen.append(value)
                    yield value
                    continue
                done = self._ended = True
                if kind == "done":
                    return
                if kind == "cancelled":
                    value = GenerationCancelledError("the generation was cancelled (Submission.cancel or "
                                                     "the engine closed) before it finished")
                self._outcome = value
                raise value
        finally:
            if not done:
                self.cancel()  # the consumer stopped listening: free the slot

    def result(self):
        """Wait for the whole generation and return it as a Result (again on a later call; pieces
        already read from the submission are part of it)."""
        if not self._ended:
            for _ in self._pieces():
                pass
        if self._outcome is not None:
            raise self._outcome
        return Result.from_pieces(self._seen)

    # --- the scheduler's side
    def _emit(self, kind: str, value: Any = None) -> None:
        if self._on_event is not None:
            self._on_event(kind, value)
        else:
            self._events.put((kind, value))
        if kind != "piece":
            self.finished.set()


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


class Scheduler:
    """The thread that runs an engine's slots (see the module docstring).

    It is given what it runs on: the slots' sequences, the target context, the drafter, the
    projector, the engine's step cost, ``prepare(request)``, which makes a request's
    generation as a context manager (tokenized, with its sampler; freed at its end), and the
    engine's LoRA adapters (serving/lora.py).
    """

    def __init__(self, *, sequences, ctx, drafter, projector, step_cost, prepare, lora) -> None:
        self._sequences, self._ctx, self._drafter, self._projector = sequences, ctx, drafter, projector
        self._step_cost, self._prepare, self._lora = step_cost, prepare, lora
        self._cond = threading.Condition()
        self._pending: collections.deque[Submission] = collections.deque()
        self._slots: list[_Running | None] = [None] * len(sequences)
        self._stopping = False
        self._reset_requested: threading.Event | None = None
        # Work on one slot's sequence (save, restore, erase), run when that slot is free:
        # (slot, fn, Future), in the order asked.
        self._slot_ops: list[tuple[int, Callable, Future]] = []
        self._turn = 0  # round robin over prefilling slots
        self.steps = 0  # speculative steps run (each over every decoding slot)
        self.slots_per_step: collections.Counter = collections.Counter()  # how many slots shared a step
        # Media encodes run on their own thread (one at a time: one projector), so the other slots
        # keep decoding while an image is encoded.
        self._encoder = (ThreadPoolExecutor(1, thread_name_prefix="pyllama-spec-encode")
                         if projector is not None else None)
        self._thread = threading.Thread(target=self._loop, name="pyllama-spec-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ from any thread
    def submit(self, request: "Request", on_event: Callable[[str, Any], None] | None = None,
               max_waiting: int | None = None, id_slot: int = -1) -> Submission:
        """Queue a request for a slot (``id_slot``: that slot only, waiting while it is busy; -1:
        any). With ``max_waiting``, refuse it (EngineBusyError) when that many requests already
        wait for a slot (a server's bounded queue)."""
        if not -1 <= id_slot < len(self._slots):
            raise ValueError(f"id_slot must be -1 (any) or a slot from 0 to {len(self._slots) - 1}, got {id_slot}")
        sub = Submission(request, on_event, id_slot)
        with self._cond:
            if self._stopping:
                from pyllama_spec.errors import ClosedError

                raise ClosedError("the engine is closed")
            if max_waiting is not None and len(self._pending) >= max_waiting:
                from pyllama_spec.errors import EngineBusyError

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
        """Run ``fn(sequence)`` on the scheduler thread once ``slot`` is free (before any request
        waiting for a slot takes it), and return the Future of its result. While the slot runs a
        generation the call waits, as llama-server defers a slot action on a busy slot."""
        if not 0 <= slot < len(self._slots):
            raise ValueError(f"slot must be from 0 to {len(self._slots) - 1}, got {slot}")
        future: Future = Future()
        with self._cond:
            if self._stopping:
                from pyllama_spec.errors import ClosedError

                raise ClosedError("the engine is closed")
            self._slot_ops.append((slot, fn, future))
            self._cond.notify_all()
        return future

    def reset_all(self) -> None:
        """Forget the cached prompts of the idle slots (runs on the scheduler thread; waits for it)."""
        done = threading.Event()
        with self._cond:
            self._reset_requested = done
            self._cond.notify_all()
        done.wait()

    def stop(self, timeout: float = 60.0) -> None:
        """Cancel everything, waiting and running, and end the thread (after its current step)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the scheduler thread
    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._stopping or self._pending or self.n_active or self._reset_requested
                               or self._slot_ops):
                        self._cond.wait()
                    if self._stopping:
                        return
                    reset, self._reset_requested = self._reset_requested, None
                if reset is not None:
                    for seq, running in zip(self._sequences, self._slots):
                        if running is None:
                            seq.reset()
                    reset.set()
                self._drop_cancelled()
                self._run_slot_ops()
                self._admit()
                self._prefill_slices()
                self._step()
                self._wait_while_only_encodes_run()
        finally:
            self._cancel_everything()
            if self._encoder is not None:
                self._encoder.shutdown(wait=True)

    def _run_slot_ops(self) -> None:
        """Run the slot operations whose slot is free; the others wait for theirs."""
        with self._cond:
            ready = [op for op in self._slot_ops if self._slots[op[0]] is None]
            self._slot_ops = [op for op in self._slot_ops if self._slots[op[0]] is not None]
        for slot, fn, future in ready:
            if not future.set_running_or_notify_cancel():
                continue  # its caller gave up waiting
            try:
                future.set_result(fn(self._sequences[slot]))
            except BaseException as e:  # noqa: BLE001 - handed to whoever asked
                future.set_exception(e)

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
        while True:
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
            except BaseException as e:  # noqa: BLE001 - a bad request fails alone
                sub._emit("error", e)
                continue
            seqs = self._sequences
            if sub.id_slot >= 0:
                best = sub.id_slot
            else:
                best = max(free, key=lambda i: (seqs[i].prefix_length(gen.parts), -i)) if gen.cache_prompt else free[0]
            gen.seq = seqs[best]
            sub.slot = best
            scales = self._lora.scales_for(sub.request.lora)
            self._lora.use(gen.seq, scales)  # a prompt cached under other adapters is not reused
            self._slots[best] = _Running(sub, prepared, gen, scales)

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
            if not waiting:
                return
            i = waiting[self._turn % len(waiting)]
            self._turn += 1
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
        except BaseException as e:  # noqa: BLE001 - a failed prefill fails its request alone
            running.gen.seq.reset()
            self._finish(i, "error", e)
            return 1

    def _encode_async(self, chunk) -> Future:
        def encode():  # the target's encode, and a vision draft model's of the same item (spec/media.py)
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
        except BaseException as e:  # noqa: BLE001 - a shared step failed: every slot in it fails
            for i, r in active:
                r.gen.seq.reset()
                self._finish(i, "error", e)
            return
        self.steps += 1
        self.slots_per_step[len(active)] += 1
        for (i, _), piece in zip(active, pieces):
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
        if running.encoding is not None:
            try:  # its chunk must outlive the encode that reads it
                running.encoding.result()
            except BaseException:  # noqa: BLE001 - the request ends anyway
                pass
        running.prepared.__exit__(None, None, None)
        running.submission._emit(kind, value)

    def _cancel_everything(self) -> None:
        for i, running in enumerate(self._slots):
            if running is not None:
                if running.prefill is not None and not running.decoding:
                    self._close_prefill(i, running)
                self._finish(i, "cancelled", running.gen.stats)
        with self._cond:
            pending, self._pending = list(self._pending), collections.deque()
        for sub in pending:
            sub._emit("cancelled")
        with self._cond:
            ops, self._slot_ops = self._slot_ops, []
        for _, _, future in ops:
            if future.set_running_or_notify_cancel():
                from pyllama_spec.errors import ClosedError

                future.set_exception(ClosedError("the engine closed before the slot was free"))
        if self._reset_requested is not None:
            self._reset_requested.set()
