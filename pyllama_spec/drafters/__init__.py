"""Speculative drafters behind one protocol; one module per method.

The engine is typed against ``Drafter`` and talks to every method through these calls:

* ``process(rows)``: the target just decoded these rows (prompt text, media slices,
  verify batches); DFlash injects the target's features here, n-gram records tokens;
* ``draft(id_last, n_max, n_min)``: a ``Proposal`` of up to n_max tokens following
  ``id_last``, which sits at the sequence's ``pos_next`` (none when fewer than n_min are
  found), with the draft's logits when the method has a distribution (rejection sampling
  verifies against it);
* ``accept(n_kept)``: the target kept the first n_kept rows of the last verify batch;
* ``truncate(target_pos)``: forget everything from that target position on (the prompt
  cache kept a shorter prefix); ``reset()``: forget everything;
* ``close()``: free what the drafter holds.

``n_max`` is a drafter's default draft length and ``n_max_limit`` the most a call may
ask for. ``spec_type="none"`` has no drafter at all.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

import numpy as np



@dataclasses.dataclass(frozen=True)
class TargetRows:
    """A view of one batch the target just decoded.

    ``positions``: int32 [n_pos_sections, n_rows] (section-major; one section for text).
    ``has_embeddings``: media rows (embeddings) rather than token rows.
    ``first_draft_pos``: where these rows go in the draft's position space.
    ``pinned``: the rows belong to a media chunk whose positions do not advance row by row
    (``positions.is_pinned``, decided once for the whole chunk).
    ``tokens``: the token ids of text rows (None for media rows).
    """

    positions: np.ndarray
    has_embeddings: bool
    first_draft_pos: int
    pinned: bool = False
    tokens: np.ndarray | None = None

    @property
    def n_rows(self) -> int:
        return self.positions.shape[1]

    @property
    def section0(self) -> np.ndarray:
        return self.positions[0]


@dataclasses.dataclass(frozen=True)
class Proposal:
    """Drafted tokens, and the draft's logits at each drafted position [len(tokens), n_vocab]
    (None for a method without a distribution, such as n-gram lookup). The logits may be a
    view into the draft context's buffers: read them before the drafter is used again."""

    tokens: list[int]
    logits: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.tokens)


@runtime_checkable
class Drafter(Protocol):
    name: str
    n_max: int
    n_min: int
    n_max_limit: int

    def process(self, rows: TargetRows) -> None: ...

    def draft(self, id_last: int, n_max: int | None = None, n_min: int | None = None) -> Proposal: ...

    def accept(self, n_kept: int) -> None: ...

    def truncate(self, target_pos: int) -> None: ...

    def reset(self) -> None: ...

    def close(self) -> None: ...


#: Speculative methods by llama.cpp's names ("dflash" is accepted for "draft-dflash").
SPEC_TYPES = ("none", "draft-dflash", "dflash", "draft-simple", "ngram-simple")
SPEC_ALIASES = {"dflash": "draft-dflash"}


def canonical_spec_type(spec_type: str) -> str:
    if spec_type not in SPEC_TYPES:
        raise ValueError(f"spec_type must be one of {SPEC_TYPES}, got {spec_type!r}")
    return SPEC_ALIASES.get(spec_type, spec_type)
