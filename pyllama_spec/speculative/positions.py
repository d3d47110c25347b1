"""Position accounting for one sequence: the single owner of ``pos_next`` and the row count.

The rule the whole package hangs on: **positions, never token counts**, decide where
anything goes in either cache. A text token costs one cache row and one position; an
M-RoPE image costs ``n_tokens`` rows but only ``n_pos`` positions, all of its rows
sharing one section-0 position. Everything else asks this object where the sequence is.

Pure Python: nothing native here.
"""

from __future__ import annotations

import bisect
import dataclasses


def is_pinned(n_tokens: int, n_pos: int) -> bool:
    """True for a media chunk whose rows do not advance the position one by one (n_pos < n_tokens).

    An M-RoPE image's rows share one section-0 position; injecting them into a windowed
    draft cache cannot free cells (they all sit at one position), so the draft overflows,
    and a drafter skips them. The decision is made once per media chunk, never per decoded
    slice: the last slice of an image may hold a single row, which is still the image's.
    Audio and other 1-D media advance (n_pos == n_tokens) and are not pinned.
    """
    return n_pos < n_tokens


@dataclasses.dataclass
class _Segment:
    """From target position ``target_pos`` on, draft positions are ``draft_pos + (p - target_pos)``."""

    target_pos: int
    draft_pos: int
    rows: int  # cache rows used before this segment starts


#: Where a draft's rows go (``SequencePositions.draft_positions``): at the target's positions, or
#: at positions of the draft's own that advance one by one (image rows too).
DRAFT_POSITION_MODES = ("target", "sequential")


class SequencePositions:
    """Where one sequence stands: next position, cache rows used, and the draft's own positions.

    ``draft_positions="target"``: the draft shares the target's positions.
    ``draft_positions="sequential"``: every row injected into the draft (image rows too)
    gets the draft's next position, so nothing is pinned; a media item of ``n_tokens``
    rows spanning ``n_pos`` target positions moves the draft ``n_tokens`` positions.
    The map between the two spaces is kept exactly, segment by segment.
    """

    def __init__(self, draft_positions: str = "target") -> None:
        if draft_positions not in DRAFT_POSITION_MODES:
            raise ValueError(f"draft_positions must be 'target' or 'sequential', got {draft_positions!r}")
        self.draft_positions = draft_positions
        self.reset()

    def reset(self) -> None:
        self.pos_next = 0  # the target position the next row takes
        self.n_rows = 0  # cache rows the sequence occupies in the target
        self.draft_pos_next = 0  # the draft position the next row takes
        self._segments: list[_Segment] = [_Segment(0, 0, 0)]

    # --- advancing
    def advance_text(self, n: int) -> None:
        """n text rows were decoded at pos_next, pos_next+1, ..."""
        self.pos_next += n
        self.n_rows += n
        self.draft_pos_next += n

    def advance_media(self, n_tokens: int, n_pos: int, draft_n_pos: int | None = None) -> None:
        """A media item of n_tokens rows spanning n_pos positions was decoded at pos_next.

        ``draft_n_pos``: the positions the item spans in the draft, when the draft decodes it through
        a projector of its own (a vision draft model: its rows and M-RoPE grid may differ from the
        target's); the draft then moves by that, whatever the mode."""
        self.pos_next += n_pos
        self.n_rows += n_tokens
        if draft_n_pos is not None:
            self.draft_pos_next += draft_n_pos
        else:
            self.draft_pos_next += n_tokens if self.draft_positions == "sequential" else n_pos
        self._segments.append(_Segment(self.pos_next, self.draft_pos_next, self.n_rows))

    # --- mapping
    def draft_pos(self, target_pos: int) -> int:
        """The draft position of a target position at or after the last media item (text region)."""
        seg = self._segment_at(target_pos)
        return seg.draft_pos + (target_pos - seg.target_pos)

    def rows_at(self, target_pos: int) -> int:
        """Cache rows used by everything before target_pos (a text-region position)."""
        seg = self._segment_at(target_pos)
        return seg.rows + (target_pos - seg.target_pos)

    def _segment_at(self, target_pos: int) -> _Segment:
        i = bisect.bisect_right([s.target_pos for s in self._segments], target_pos) - 1
        return self._segments[max(i, 0)]

    # --- rolling back
    def truncate(self, target_pos: int) -> None:
        """Forget everything from target_pos on (target_pos must start a row, e.g. after a media item)."""
        if target_pos > self.pos_next:
            raise ValueError(f"cannot truncate to {target_pos}: the sequence ends at {self.pos_next}")
        while len(self._segments) > 1 and self._segments[-1].target_pos > target_pos:
            self._segments.pop()
        self.n_rows = self.rows_at(target_pos)
        self.draft_pos_next = self.draft_pos(target_pos)
        self.pos_next = target_pos

    def __repr__(self) -> str:
        return (f"SequencePositions(pos_next={self.pos_next}, n_rows={self.n_rows}, "
                f"draft_pos_next={self.draft_pos_next}, mode={self.draft_positions!r})")
