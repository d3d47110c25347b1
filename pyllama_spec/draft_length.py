"""How many tokens to draft at each step: a fixed number, or an adaptive schedule.

``AdaptiveLength`` is HF transformers' heuristic schedule for assisted generation: after a
step whose drafts were all accepted, draft two more next time; after a rejection, one
fewer; always within [1, limit]. It needs no tuning per temperature: at high temperatures
(or after an image, or in unpredictable text) it shortens drafts that would be thrown away,
and it lengthens them where the draft keeps being right.

Pure Python: nothing native here.
"""

from __future__ import annotations


class FixedLength:
    def __init__(self, n: int) -> None:
        self.n = n

    def next(self) -> int:
        return self.n

    def update(self, drafted: int, accepted: int) -> None:
        pass


class AdaptiveLength:
    def __init__(self, start: int, limit: int) -> None:
        self.limit = max(1, limit)
        self.n = max(1, min(start, self.limit))

    def next(self) -> int:
        return self.n

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return  # nothing was proposed (no match, or too few): no evidence either way
        self.n = min(self.n + 2, self.limit) if accepted == drafted else max(1, self.n - 1)
