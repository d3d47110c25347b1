"""Speculative drafters behind one protocol; one module per method.

The engine is typed against ``Drafter`` and talks to every method through these calls.
A drafter serves ``n_seq`` sequences (one per slot; see sequence.py), named by ``seq_id``:

* ``process(decode)``: the target just decoded a batch; ``decode`` (a ``TargetDecode``)
  gives its rows, one ``TargetRows`` per sequence in it (prompt text, media slices, the
  verify rows of every slot), and what the target computed for them (``features``).
  DFlash injects the target's features here, MTP writes each token (and each media row, by its
  ``embeddings``) with the target's hidden state of the row before it (``hidden``), n-gram
  records tokens. The rows of steps that drafted nothing may reach ``process`` later, several
  steps' rows in one call (``Sequence.hold_for_drafter``), before the drafter drafts for that
  sequence or is shown its next rows; a ``forget`` may come while rows are held (they are
  dropped with it);
* ``draft(requests)``: one ``Proposal`` per ``DraftRequest``, made together (one draft
  decode for all slots where the method allows): up to n_max tokens following
  ``id_last``, which sits at the request's position (none when fewer than n_min are
  found), with the draft's logits when the method has a distribution (rejection
  sampling verifies against it);
* ``begin(seq_id)`` (optional): the sequence's prompt is decoded and its generation starts
  (llama.cpp's ``begin``: the n-gram maps index the prompt here);
* ``accept(seq_id, n_accepted)`` (optional): the target kept ``n_accepted`` tokens of the
  sequence's last non-empty draft (llama.cpp's ``accept``: ngram-map-k remembers it per key,
  ngram-mod resets after a run of poor drafts); the model drafters have nothing to do here. A
  drafter without these two is not called for them (a drafter written before they existed);
* ``forget(seq_id, pos, draft_pos)``: forget everything the sequence holds from that
  point on: target position ``pos``, draft position ``draft_pos`` (each method uses the
  one its cache is laid out by). This is how rejected drafts, a shorter cached prompt
  and a reset (0, 0) all reach the drafter, always told *where the sequence now ends*;
* ``close()``: free what the drafter holds.

``n_max`` is a drafter's default draft length and ``n_max_limit`` the most a request may
ask for (``limit_reason`` says what bounds it, for messages). ``spec_type="none"`` has no drafter at all. The methods, and what the engine needs to
know of each, are in ``registry.py``. A drafter never turns on what it reads of the target: its
registry entry declares it, the engine turns it on before the drafter is made, and the step
hands it over in the ``TargetDecode``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, NamedTuple, Protocol, Sequence, runtime_checkable

import numpy as np


@dataclasses.dataclass(frozen=True)
class DraftMedia:
    """A media item as a vision draft model's own projector cut and encoded it (speculative/media.py):
    ``chunk`` (that projector's chunk: its rows and positions in the draft), ``embd`` float32
    [chunk.n_tokens, the draft's n_embd_inp], and ``target_rows``, the rows the target gave the item."""

    chunk: Any
    embd: np.ndarray
    target_rows: int


@dataclasses.dataclass(frozen=True)
class TargetRows:
    """A view of one batch the target just decoded.

    ``positions``: int32 [n_pos_sections, n_rows] (section-major; one section for text).
    ``has_embeddings``: media rows (embeddings) rather than token rows.
    ``first_draft_pos``: where these rows go in the draft's position space.
    ``pinned``: the rows belong to a media chunk whose positions do not advance row by row
    (``positions.is_pinned``, decided once for the whole chunk).
    ``tokens``: the token ids of text rows (None for media rows).
    ``seq_id``: the sequence they belong to; ``row_offset``: where they start among the rows
    of the target's last decode (several sequences' rows share one verify decode).
    ``draft_positions``: the sequence's position mode ("target" or "sequential").
    ``row_index``: where each row is among the rows of the target's last decode, when they
    are not the ``n_rows`` rows from ``row_offset`` on (the accepted path of a draft tree).
    ``draft_media``: on the first slice of a media chunk, the same item through the draft's own
    projector (a vision draft model; ``DraftMedia``), to decode at ``first_draft_pos``; else None.
    ``embeddings``: media rows only, what the target decoded them from (float32 [n_rows, n_embd_inp],
    the target projector's output for this slice): a view, not a copy, so it costs nothing to a
    drafter that does not read it (MTP does); None where not given (a test's view). Read it inside
    ``process``.
    """

    positions: np.ndarray
    has_embeddings: bool
    first_draft_pos: int
    pinned: bool = False
    tokens: np.ndarray | None = None
    seq_id: int = 0
    row_offset: int = 0
    draft_positions: str = "target"
    row_index: np.ndarray | None = None
    draft_media: DraftMedia | None = None
    embeddings: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)

    def decoded_rows(self) -> np.ndarray | slice:
        """These rows' indices among the rows of the target's last decode."""
        if self.row_index is not None:
            return self.row_index
        return slice(self.row_offset, self.row_offset + self.n_rows)

    @property
    def n_rows(self) -> int:
        return self.positions.shape[1]

    @property
    def section0(self) -> np.ndarray:
        return self.positions[0]


class TargetDecode:
    """A view of the target's last decode, handed to ``Drafter.process``: its ``rows`` (one
    ``TargetRows`` per sequence), and what the target computed for all of them.

    Reads native buffers that the target's next decode overwrites: a drafter reads what it
    needs inside ``process``. ``source`` is the target's context (None for a view without
    features, such as a test's or a text-only drafter's).
    """

    def __init__(self, rows: Sequence[TargetRows], source=None) -> None:
        self.rows = tuple(rows)
        self._source = source
        # Rows past the last one a sequence named are not read (a tree's other nodes come first).
        self.n_decoded = max((r.row_offset + r.n_rows if r.row_index is None else int(np.max(r.row_index)) + 1
                              for r in self.rows), default=0)

    def features(self, layers: Sequence[int], rows: TargetRows) -> np.ndarray:
        """The inputs of the target's ``layers`` at ``rows`` (side by side, in that order):
        float32 [rows.n_rows, len(layers) * n_embd], a copy. The layers are those the method's
        pairing named (registry.py), recorded since the engine opened the target."""
        if self._source is None:
            raise ValueError("this TargetDecode carries no features (made without the target's context)")
        at = rows.decoded_rows()
        return np.concatenate([self._source.layer_input(lid, self.n_decoded)[at] for lid in layers], axis=1)

    def hidden(self, rows: TargetRows) -> np.ndarray:
        """The target's final hidden state (after its output norm: what its head reads) at ``rows``:
        float32 [rows.n_rows, n_embd], a copy. Recorded for every row when the method's registry
        entry reads the "final hidden state" (llama.cpp's unmasked nextn embeddings)."""
        if self._source is None:
            raise ValueError("this TargetDecode carries no hidden states (made without the target's context)")
        return np.array(self._source.draft_embeddings(self.n_decoded)[rows.decoded_rows()])

    def hold(self, rows: TargetRows) -> "HeldRows":
        """``rows`` (text rows of this decode) with a copy of what the target computed for them
        (every recorded layer's input, the final hidden state when kept), so that a drafter can be
        shown them after the target's next decodes (``joined``)."""
        at = rows.decoded_rows()
        src, n = self._source, self.n_decoded
        layers = {} if src is None else {lid: src.layer_input(lid, n)[at].copy() for lid in src.recorded_layers}
        hidden = None if src is None or not src.records_draft_embeddings else src.draft_embeddings(n)[at].copy()
        if rows.row_offset or rows.row_index is not None:  # (dataclasses.replace is dear on a hot path)
            rows = dataclasses.replace(rows, row_offset=0, row_index=None)
        return HeldRows(rows, layers, hidden)

    @classmethod
    def joined(cls, held: Sequence["HeldRows"], max_rows: int) -> Iterator["TargetDecode"]:
        """Held text rows of one sequence, contiguous and in order, as decodes of whole held items
        of at most ``max_rows`` rows together (what a drafter's context takes in one batch; an item
        is one step's rows, never more than a batch). Each decode starts at its first item's own
        draft position."""
        chunk: list[HeldRows] = []
        n = 0  # rows in chunk
        for h in held:
            if chunk and n + h.rows.n_rows > max_rows:
                yield cls._join(chunk)
                chunk, n = [], 0
            chunk.append(h)
            n += h.rows.n_rows
        if chunk:
            yield cls._join(chunk)

    @classmethod
    def _join(cls, chunk: Sequence["HeldRows"]) -> "TargetDecode":
        rows = dataclasses.replace(chunk[0].rows, positions=np.concatenate([h.rows.positions for h in chunk], axis=1),
                                   tokens=np.concatenate([h.rows.tokens for h in chunk]))
        layers = {lid: np.concatenate([h.layers[lid] for h in chunk]) for lid in chunk[0].layers}
        hidden = None if chunk[0].hidden is None else np.concatenate([h.hidden for h in chunk])
        return cls([rows], _HeldOutputs(layers, hidden))


class HeldRows(NamedTuple):
    """Text rows the target decoded and a drafter has not been shown yet (``TargetDecode.hold``):
    the rows (laid out from row 0) and what the target computed for them, by layer and final."""

    rows: TargetRows
    layers: dict[int, np.ndarray]
    hidden: np.ndarray | None

    def head(self, pos: int) -> "HeldRows":
        """The rows before target position ``pos`` (a cut through them)."""
        n = int(np.searchsorted(self.rows.section0, pos))
        if n == self.rows.n_rows:
            return self
        return HeldRows(dataclasses.replace(self.rows, positions=self.rows.positions[:, :n], tokens=self.rows.tokens[:n]),
                        {lid: a[:n] for lid, a in self.layers.items()}, None if self.hidden is None else self.hidden[:n])


class _HeldOutputs:
    """What ``TargetDecode`` reads from the target's context, for held rows: copies, not views."""

    def __init__(self, layers: dict[int, np.ndarray], hidden: np.ndarray | None) -> None:
        self._layers, self._hidden = layers, hidden

    def layer_input(self, lid: int, n_rows: int) -> np.ndarray:
        if lid not in self._layers:
            raise ValueError(f"layer {lid} inputs were not recorded when these rows were decoded")
        return self._layers[lid][:n_rows]

    def draft_embeddings(self, n_rows: int) -> np.ndarray:
        if self._hidden is None:
            raise ValueError("the final hidden states were not kept when these rows were decoded")
        return self._hidden[:n_rows]


@dataclasses.dataclass(frozen=True)
class Proposal:
    """Drafted tokens, and the draft's logits at each drafted position [len(tokens), n_vocab]
    (None for a method without a distribution, such as n-gram lookup). The logits may be a
    view into the draft context's buffers: read them before the drafter is used again."""

    tokens: list[int]
    logits: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass(frozen=True)
class DraftRequest:
    """One sequence's request for a draft: ``id_last`` sits at target position ``pos`` (the
    sequence's ``pos_next``) and draft position ``draft_pos``."""

    seq_id: int
    id_last: int
    pos: int
    draft_pos: int
    n_max: int
    n_min: int = 0


class TraceEvent(NamedTuple):
    """One thing a drafter did to its cache, recorded while its ``trace`` is a list (None, the
    default: nothing is recorded): ``call`` (DFlash: "inject", "skip", "draft"; EAGLE3: "write",
    "seed", "restart", "skip"; MTP: "pair", "media", "skip", "draft"), the sequence, the first position
    (the draft's) and the rows."""

    call: str
    seq: int
    pos: int
    n_rows: int


@runtime_checkable
class Drafter(Protocol):
    name: str
    n_max: int
    n_min: int
    n_max_limit: int
    limit_reason: str  # what bounds n_max_limit ("the draft's block size 16 minus one"), or ""

    def process(self, decode: TargetDecode) -> None: ...

    def draft(self, requests: Sequence[DraftRequest]) -> list[Proposal]: ...

    # (begin and accept are optional: see the module)

    def forget(self, seq_id: int, pos: int, draft_pos: int) -> None: ...

    def close(self) -> None: ...


#: The most tokens a draft-model, n-gram, EAGLE3 or MTP draft proposes in one step (a DFlash
#: draft's block size bounds its own).
DRAFT_TOKEN_LIMIT = 32


def token_limit_reason(n_max_limit: int) -> str:
    """``limit_reason`` for a drafter bounded by ``DRAFT_TOKEN_LIMIT`` ("" once something lowered it)."""
    return "this method's limit" if n_max_limit == DRAFT_TOKEN_LIMIT else ""
