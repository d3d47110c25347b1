"""What one sequence (one slot) holds, and the only code that changes it.

A sequence lives in three places that must agree: the target's memory (its ``seq_id``),
the drafter's state for that ``seq_id``, and its ``SequencePositions``. It also remembers
what its cache holds (text tokens and media items, in order) so that a later prompt can
reuse the longest common prefix.

Every change to where the sequence ends goes through one method here, which updates all
three in the one safe order: decide the new end (positions), then cut the target's memory
and tell the drafter where the sequence now ends (``forget``). Rows decoded elsewhere (a
verify step in generation.py) are kept or cut by ``commit``.

The drafter may lag behind the target by the rows of steps that drafted nothing
(``hold_for_drafter``): they are shown to it in batches before it is next used for this
sequence (``show_drafter``: before a draft, a prompt's rows, a cut, which keeps only those
before it), or dropped by a reset.

Two other places remove rows, never this sequence's own: a drafter drops the rows of its
draft blocks from its own draft context once it has read them; and a tree step
(``generation._tree_step``) shares this sequence's cells into temporary leaf sequences
(the seq ids after this one), copies the accepted path's cells back into this sequence,
then removes the leaf sequences whole (also when its decode failed), and calls ``commit``
for the path, so the positions and the drafter still move here.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

from pyllama_spec.bindings.context import Context
from pyllama_spec.drafters import DraftMedia, Drafter, HeldRows, TargetDecode, TargetRows
from pyllama_spec.errors import KVMemoryError
from pyllama_spec.speculative.media import EncodedMedia, encode_media
from pyllama_spec.speculative.positions import SequencePositions, is_pinned
from pyllama_spec.speculative.stats import GenerationStats, Stopwatch


@dataclasses.dataclass(frozen=True)
class CachedMedia:
    """A media item in the cache: its content id, rows and positions (``draft_n_pos``: the
    positions it spans in the draft, where a vision draft model decoded it through its own projector)."""

    id: str | None
    n_tokens: int
    n_pos: int
    draft_n_pos: int | None = None


@dataclasses.dataclass(frozen=True)
class SavedSequence:
    """A sequence's cache taken out of its context (``Sequence.save_state``), to be put back later
    into a sequence of a context of the same model and cache layout (``Sequence.restore_state``).

    ``parts``: what the cache holds, in order (int32 token arrays for text, ``CachedMedia`` for
    media items); ``draft_positions``: the position mode it was laid out by; ``memory``: the
    target's memory of the sequence (its KV cells with their positions, or its recurrent
    state), as llama.cpp serializes it. Its positions follow from the parts (``positions``).
    """

    parts: tuple
    draft_positions: str
    memory: bytes

    def positions(self) -> SequencePositions:
        """Where a sequence holding these parts stands."""
        p = SequencePositions(self.draft_positions)
        _advance_over(p, self.parts)
        return p


def _advance_over(positions: SequencePositions, parts) -> None:
    """Move ``positions`` over cached parts: a text token one row and one position, a media item
    its rows and its positions."""
    for part in parts:
        if isinstance(part, CachedMedia):
            positions.advance_media(part.n_tokens, part.n_pos, part.draft_n_pos)
        else:
            positions.advance_text(len(part))


class Sequence:
    """One slot's sequence: ``seq_id`` in the target context (and the drafter), its positions and cache."""

    def __init__(self, ctx: Context, drafter: Drafter | None, seq_id: int = 0, *,
                 draft_positions: str = "target", n_seq: int = 1) -> None:
        self.ctx = ctx
        self.drafter = drafter
        self.seq_id = seq_id
        self.positions = SequencePositions(draft_positions)
        self.cached: list = []  # int32 token arrays (text) and CachedMedia, in cache order
        #: Rows of a media item being decoded, in the cache already (its positions move at its end)
        self.media_rows_in = 0
        self._alone = n_seq == 1  # the only sequence of its context: a reset may clear everything
        self._batch = None  # for media slices, made at the first image
        #: The cache rows this sequence may use: its share of the context (n_ctx / n_seq).
        self.n_ctx = ctx.n_ctx_seq
        self._held: list[HeldRows] = []  # rows in the target's cache the drafter has not been shown yet

    @property
    def n_cached_rows(self) -> int:
        """The cache rows of what the sequence holds (a snapshot: safe to read from another thread)."""
        return rows_of(list(self.cached))

    # ------------------------------------------------------------------ rows
    def text_rows(self, tokens: np.ndarray, row_offset: int = 0) -> TargetRows:
        """The TargetRows of text rows decoded at pos_next.. (the first at ``row_offset`` in the decode)."""
        p = self.positions
        pos = np.arange(p.pos_next, p.pos_next + len(tokens), dtype=np.int32)
        return TargetRows(pos[None, :], False, p.draft_pos_next, tokens=np.asarray(tokens, dtype=np.int32),
                          seq_id=self.seq_id, row_offset=row_offset, draft_positions=p.draft_positions)

    # ------------------------------------------------------------------ the drafter's view
    def hold_for_drafter(self, decode: TargetDecode, rows: TargetRows) -> None:
        """Keep text ``rows`` of the target's last decode (about to be committed whole) for the drafter,
        instead of showing them now. A step that drafted nothing need not pay a drafter decode for
        its one row (on a CPU that costs more than the target's step): the rows are shown in
        batches before the drafter next works for this sequence (``show_drafter``), so a run of
        such steps costs a drafter decode per batch, and the drafter then holds what it would
        have held had each been shown at once."""
        self._held.append(decode.hold(rows))

    @property
    def held_rows(self) -> int:
        """Rows waiting to be shown to the drafter (``hold_for_drafter``)."""
        return sum(h.rows.n_rows for h in self._held)

    @property
    def holds_rows(self) -> bool:
        return bool(self._held)

    def show_drafter(self, stats: GenerationStats | None = None) -> int:
        """Show the drafter the rows held for it, in order, in batches of the target's n_batch (timed
        into ``stats.draft_seconds`` when given); the rows shown. A drafter that fails here leaves
        its state for this sequence unknown: the sequence is reset, then the error raised."""
        if not self._held:
            return 0
        held, self._held = self._held, []
        try:
            with Stopwatch(stats, "draft_seconds"):
                for decode in TargetDecode.joined(held, self.ctx.n_batch):
                    self.drafter.process(decode)
        except BaseException:
            self.reset()
            raise
        return sum(h.rows.n_rows for h in held)

    # ------------------------------------------------------------------ changing it
    def decode_text(self, tokens: np.ndarray, outputs, stats: GenerationStats) -> None:
        """Decode prompt text at pos_next.. into the target, show it to the drafter, and keep it."""
        rows = self.text_rows(tokens)
        self.show_drafter(stats)
        with Stopwatch(stats, "target_seconds"):
            self.ctx.decode_tokens(tokens, rows.section0, outputs=outputs, seq_id=self.seq_id)
        if self.drafter is not None:
            with Stopwatch(stats, "draft_seconds"):
                self.drafter.process(TargetDecode([rows], self.ctx))
        self.commit(tokens, len(tokens))

    def commit(self, tokens: np.ndarray, n_kept: int) -> None:
        """``tokens`` were just decoded at pos_next.. (and shown to the drafter); keep the first n_kept.

        The one order that is always right: the positions move to the new end first, then
        the target's memory and the drafter forget everything after it.
        """
        p = self.positions
        p.advance_text(n_kept)
        if n_kept < len(tokens):
            self.ctx.memory.remove(self.seq_id, p.pos_next, -1)
            if self.drafter is not None:
                self.drafter.forget(self.seq_id, p.pos_next, p.draft_pos_next)
        if n_kept:
            self._remember_text(np.asarray(tokens[:n_kept], dtype=np.int32))

    def decode_media(self, projector, chunk, stats: GenerationStats, *, n_batch: int,
                     embd: EncodedMedia | None = None, outputs: bool = False) -> Iterator[int]:
        """Encode a media chunk (unless its embeddings ``embd`` are given: encoded elsewhere), then
        decode its rows in slices of n_batch, yielding after each slice (the rows of the chunk
        decoded so far), so that a scheduler can run other sequences' steps in between.
        Positions advance when the last slice is in. ``outputs``: every row is an output (an
        embedding's rows; a generation reads none of a picture's).

        A vision draft model's twin of the chunk (``chunk.draft``: the same item through the
        draft's projector) is encoded with it (speculative/media.py) and handed to the drafter with the
        first slice; the draft's positions then move by the twin's n_pos, not the target's."""
        p = self.positions
        self.show_drafter(stats)
        if embd is None:
            with Stopwatch(stats, "target_seconds"):
                embd = encode_media(projector, chunk)
        twin = chunk.draft if self.drafter is not None and embd.draft is not None else None
        draft_media = None if twin is None else DraftMedia(twin, embd.draft, chunk.n_tokens)
        embd = embd.target
        positions = projector.media_positions(chunk, p.pos_next)  # [n_tokens, n_pos]
        pinned = is_pinned(chunk.n_tokens, chunk.n_pos)  # for the whole chunk, whatever its slices
        non_causal = projector.uses_non_causal(chunk)
        batch = self._media_batch()
        try:
            for s in range(0, chunk.n_tokens, n_batch):
                e = min(s + n_batch, chunk.n_tokens)
                batch.clear()
                batch.add_embeddings(embd[s:e], positions[s:e], seq_id=self.seq_id, outputs=outputs)
                with Stopwatch(stats, "target_seconds"):
                    if non_causal:
                        self.ctx.set_causal_attn(False)
                    try:
                        self.ctx.decode(batch)
                    finally:
                        if non_causal:
                            self.ctx.set_causal_attn(True)
                if self.drafter is not None:
                    # (first_draft_pos matters in "sequential" mode, where every row takes a draft position,
                    # and on the first slice for a vision draft model: where its own rows of the item start)
                    rows = TargetRows(np.ascontiguousarray(positions[s:e].T), True, p.draft_pos_next + s,
                                      pinned=pinned, seq_id=self.seq_id, draft_positions=p.draft_positions,
                                      draft_media=draft_media if s == 0 else None,
                                      embeddings=embd[s:e])  # a view: free for drafters that do not read it
                    with Stopwatch(stats, "draft_seconds"):
                        self.drafter.process(TargetDecode([rows], self.ctx))
                self.media_rows_in = e
                yield e
        except BaseException:
            # Stopped inside the chunk (cancelled between slices, or a slice failed): the positions
            # never moved, so cut both caches back to where the chunk started.
            self.media_rows_in = 0
            self.ctx.memory.remove(self.seq_id, p.pos_next, -1)
            if self.drafter is not None:
                self.drafter.forget(self.seq_id, p.pos_next, p.draft_pos_next)
            raise
        draft_n_pos = None if twin is None else twin.n_pos
        self.media_rows_in = 0
        p.advance_media(chunk.n_tokens, chunk.n_pos, draft_n_pos)
        self.cached.append(CachedMedia(chunk.id, chunk.n_tokens, chunk.n_pos, draft_n_pos))

    def _media_batch(self):
        if self._batch is None:
            from pyllama_spec.bindings.batch import Batch

            self._batch = Batch(self.ctx)
        return self._batch

    def reset(self) -> None:
        """Forget everything: the next prompt is decoded from position 0."""
        self.cached = []
        self.media_rows_in = 0
        if self._alone:
            self.ctx.memory.clear()
        else:
            self.ctx.memory.remove(self.seq_id, -1, -1)
        self.positions.reset()
        self._held = []
        if self.drafter is not None:
            self.drafter.forget(self.seq_id, 0, 0)

    def set_draft_positions(self, mode: str) -> None:
        """Change the position mode; the draft's cache is laid out by it, so this starts over."""
        if mode != self.positions.draft_positions:
            self.reset()
            self.positions.draft_positions = mode

    def close(self) -> None:
        if self._batch is not None:
            self._batch.close()
            self._batch = None

    # ------------------------------------------------------------------ saving and restoring
    def save_state(self) -> SavedSequence:
        """What this sequence holds, to put back later with ``restore_state``. The drafter's state
        is not part of it (see ``restore_state``)."""
        return SavedSequence(tuple(self.cached), self.positions.draft_positions,
                             self.ctx.memory.save_seq(self.seq_id))

    def restore_state(self, saved: SavedSequence) -> None:
        """Make this sequence hold what ``saved`` holds: the target's memory, the cached parts (so
        that a later prompt reuses them) and the positions they take.

        The drafter starts this sequence afresh: it sees the rows decoded from here on, not the
        restored ones (its drafts have less context, so fewer may be accepted; the output, which
        the target verifies, is the same). When the target refuses the memory (KVMemoryError),
        or it does not end where the parts say, the sequence is left empty."""
        self.reset()
        positions = saved.positions()
        try:
            self.ctx.memory.load_seq(self.seq_id, saved.memory)
            last = self.ctx.memory.pos_max(self.seq_id)
            ends_in_text = bool(saved.parts) and not isinstance(saved.parts[-1], CachedMedia)
            # text ends at its last position; a media item's rows may all sit on its first one
            lowest = positions.pos_next - 1 if ends_in_text or not saved.parts else \
                positions.pos_next - saved.parts[-1].n_pos
            if not lowest <= last <= positions.pos_next - 1:
                raise KVMemoryError("Sequence.restore_state", None,
                                    f"the restored memory of sequence {self.seq_id} ends at position {last}, "
                                    f"but its {positions.n_rows} cached rows end at {positions.pos_next - 1}")
        except BaseException:
            self.reset()
            raise
        self.positions.reset()
        self.positions.draft_positions = saved.draft_positions
        _advance_over(self.positions, saved.parts)
        self.cached = [p.copy() if isinstance(p, np.ndarray) else p for p in saved.parts]

    # ------------------------------------------------------------------ the prompt cache
    def keep_prefix(self, parts: list) -> list:
        """Keep the longest prefix of ``parts`` already in the caches; return what is left to decode."""
        i, j = common_prefix(self.cached, parts)
        if i == len(parts) or (i == len(parts) - 1 and j == len(parts[-1])):
            # All of it is cached: decode the last token again for fresh logits.
            i, j = len(parts) - 1, len(parts[-1]) - 1
        if i == 0 and j == 0:
            self.reset()
            return list(parts)
        keep = self.cached[:i] + ([self.cached[i][:j]] if j else [])
        pos = sum(len(c) if isinstance(c, np.ndarray) else c.n_pos for c in keep)
        if self._held:  # those before the cut, before anything is cut (a failure here resets the sequence)
            self._held = [h.head(pos) for h in self._held if h.rows.section0[0] < pos]
            self.show_drafter()
        try:
            self.ctx.memory.remove(self.seq_id, pos, -1)
        except KVMemoryError:
            self.reset()  # e.g. a recurrent target cannot roll back that far
            return list(parts)
        self.positions.truncate(pos)
        if self.drafter is not None:
            self.drafter.forget(self.seq_id, pos, self.positions.draft_pos_next)
        self.cached = keep
        rest = list(parts[i:])
        if j:
            rest[0] = rest[0][j:]
        return rest

    def prefix_length(self, parts: list) -> int:
        """Rows of ``parts`` this sequence's cache already holds (to pick the best slot for a prompt)."""
        return shared_rows(self.cached, parts)

    def _remember_text(self, tokens: np.ndarray) -> None:
        if self.cached and isinstance(self.cached[-1], np.ndarray):
            self.cached[-1] = np.concatenate([self.cached[-1], tokens])
        else:
            self.cached.append(tokens.copy())


def rows_of(parts) -> int:
    """Cache rows ``parts`` take: a text token one, a media item its rows (``n_tokens``)."""
    return sum(len(p) if isinstance(p, np.ndarray) else p.n_tokens for p in parts)


def shared_rows(cached, parts) -> int:
    """Cache rows of the longest prefix ``cached`` and ``parts`` share (whole media items count
    their rows; a media item shared in part is not shared)."""
    i, j = common_prefix(cached, parts)
    return rows_of(cached[:i]) + j


def common_prefix(cached, parts) -> tuple[int, int]:
    """(i, j): the first i parts match whole, and the first j tokens of part i (text) too."""
    for i, (c, p) in enumerate(zip(cached, parts)):
        if isinstance(c, np.ndarray) and isinstance(p, np.ndarray):
            m = min(len(c), len(p))
            same = c[:m] == p[:m]
            j = m if same.all() else int(np.argmin(same))
            if j == len(c) == len(p):
                continue
            return i, j
        if isinstance(c, CachedMedia) and not isinstance(p, np.ndarray) and c.id and c.id == p.id \
                and (c.n_tokens, c.n_pos) == (p.n_tokens, p.n_pos):
            continue
        return i, 0
    return min(len(cached), len(parts)), 0
