"""Speculative drafters behind one protocol; one module per method.

The engine is typed against ``Drafter`` and talks to every method through these calls.
A drafter serves ``n_seq`` sequences (one per slot; see sequence.py), named by ``seq_id``:

* ``process(decode)``: the target just decoded a batch; ``decode`` (a ``TargetDecode``)
  gives its rows, one ``TargetRows`` per sequence in it (prompt text, media slices, the
  verify rows of every slot), and what the target computed for them (``features``).
  DFlash injects the target's features here, MTP writes each token (and each media row, by its
  ``embeddings``) with the target's hidden state of the row before it (``hidden``), n-gram
  records tokens;
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
from typing import Any, NamedTuple, Protocol, Sequence, runtime_checkable

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
