"""How many tokens to draft at each step: a fixed number, or a rule that adapts it.

``AdaptiveLength`` (``draft_max="auto"``) picks the length that maximises the expected tokens
per second of the next step, from two running estimates:

* the chance a_i that the draft's i-th token is accepted when the ones before it were, per
  position (drafts get worse further out); with n drafts a step yields on average
  1 + a_1 + a_1 a_2 + ... + a_1...a_n tokens. Positions seen rarely lean on the overall rate;
* what a step costs: time = base + per_row x n, fitted to the steps so far (a decaying
  least-squares fit: the draft and verify time of each step against its length).

It needs no tuning per temperature or model: a draft that is rarely right, or verify rows
that are expensive (a small model on a CPU), shorten the drafts; a draft that keeps being
right and cheap rows (a large model on a GPU) lengthen them. Until it has seen a few steps
it explores with HF transformers' schedule (two more after a fully accepted block, one
fewer after a rejection).

Pure Python: nothing native here.
"""

from __future__ import annotations


class FixedLength:
    def __init__(self, n: int) -> None:
        self.n = n

    def next(self) -> int:
        return self.n

    def update(self, drafted: int, accepted: int, seconds: float = 0.0) -> None:
        pass


class AdaptiveLength:
    WARMUP_STEPS = 6
    DECAY = 0.9  # weight of the past in each running estimate

    def __init__(self, start: int, limit: int) -> None:
        self.limit = max(1, limit)
        self.n = max(1, min(start, self.limit))
        self.steps = 0
        # acceptance, per draft position: decayed counts of (reached, accepted)
        self._tried = [0.0] * self.limit
        self._kept = [0.0] * self.limit
        # cost fit: decayed sums for time = base + per_row * n
        self._w = self._sx = self._sy = self._sxx = self._sxy = 0.0

    def next(self) -> int:
        return self.n

    def update(self, drafted: int, accepted: int, seconds: float = 0.0) -> None:
        if drafted == 0 and self.n > 0 and self.steps < self.WARMUP_STEPS:
            return  # nothing was proposed (no match, or too few): no evidence either way
        d = self.DECAY
        # Positions reached: every accepted one, plus the one rejected (when there was one).
        reached = min(accepted + (1 if accepted < drafted else 0), self.limit)
        for i in range(self.limit):
            self._tried[i] = d * self._tried[i] + (1 if i < reached else 0)
            self._kept[i] = d * self._kept[i] + (1 if i < accepted else 0)
        if seconds > 0:
            x, y = float(drafted), seconds
            self._w, self._sx, self._sy = d * self._w + 1, d * self._sx + x, d * self._sy + y
            self._sxx, self._sxy = d * self._sxx + x * x, d * self._sxy + x * y
        self.steps += 1
        if self.steps < self.WARMUP_STEPS:
            self.n = min(self.n + 2, self.limit) if accepted == drafted else max(1, self.n - 1)
            return
        self.n = self._best_length()

    def _acceptance(self) -> list[float]:
        """a_i per position, shrunk towards the overall rate where a position was rarely reached."""
        tried, kept = sum(self._tried), sum(self._kept)
        overall = kept / tried if tried else 0.0
        prior = 2.0  # pseudo-observations at the overall rate
        return [min((k + prior * overall) / (t + prior), 0.999) for t, k in zip(self._tried, self._kept)]

    def _best_length(self) -> int:
        accept = self._acceptance()
        var = self._w * self._sxx - self._sx ** 2
        if self._w and var > 1e-12:
            per_row = max((self._w * self._sxy - self._sx * self._sy) / var, 0.0)
            base = max((self._sy - per_row * self._sx) / self._w, 1e-9)
        else:  # every step had the same length so far: the cost of a row is unknown, assume small
            base, per_row = (self._sy / self._w if self._w else 1.0), 0.0
        best, best_rate = 0, 0.0
        gain = 1.0  # expected tokens of a step with n drafts: 1 + alpha + ... + alpha^n
        term = 1.0
        for n in range(0, self.limit + 1):
            if n:
                term *= accept[n - 1]
                gain += term
            rate = gain / (base + per_row * n)
            if rate > best_rate * 1.0001:
                best, best_rate = n, rate
        # Keep drafting at least one token: with none, the acceptance estimate could never recover.
        return max(best, 1)
