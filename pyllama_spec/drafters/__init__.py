"""Speculative drafters behind one small protocol; one module per method.

The engine talks to a drafter through four calls:

* ``begin(positions)``: a new turn starts (after the sequence was truncated/reset);
* ``process(rows)``: the target just decoded these rows (prompt, media slices, verify
  batches); a drafter conditioned on the target (DFlash) reads features here;
* ``draft(id_last, n_max)``: propose up to n_max tokens following ``id_last``, which
  sits at the sequence's ``pos_next``;
* ``accept(keep_to)``: the target kept everything before position ``keep_to``; the
  drafter drops the rest of its own state.

``spec_type="none"`` has no drafter at all.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from ..positions import SequencePositions


@dataclasses.dataclass(frozen=True)
class TargetRows:
    """A view of one batch the target just decoded.

    ``positions``: int32 [n_pos_sections, n_rows] (section-major; one section for text).
    ``has_embeddings``: media rows (embeddings) rather than token rows.
    ``first_draft_pos``: where these rows go in the draft's position space.
    ``pinned``: the rows belong to a media chunk whose positions do not advance row by row
    (``positions.is_pinned``, decided once for the whole chunk).
    """

    positions: np.ndarray
    has_embeddings: bool
    first_draft_pos: int
    pinned: bool = False

    @property
    def n_rows(self) -> int:
        return self.positions.shape[1]

    @property
    def section0(self) -> np.ndarray:
        return self.positions[0]


class Drafter(Protocol):
    name: str

    def begin(self, positions: SequencePositions) -> None: ...

    def process(self, rows: TargetRows) -> None: ...

    def draft(self, id_last: int, n_max: int) -> list[int]: ...

    def accept(self, keep_to: int) -> None: ...

    def close(self) -> None: ...


SPEC_TYPES = ("none", "dflash")
