"""How many tokens to draft at each step: a fixed number, or a rule that adapts it.

``AdaptiveLength`` (``draft_max="auto"``) picks the length that maximises the expected tokens
per second of the next step, from two running estimates:

* the chance a_i that the draft's i-th token is accepted when the ones before it were, per
  position (drafts get worse further out); with n drafts a step yields on average
  1 + a_1 + a_1 a_2 + ... + a_1...a_n tokens. Positions seen rarely lean on the overall rate;
* what a step costs (``StepCost``): time = base + per_row x rows, fitted to the steps so far
  (a decaying least-squares fit of each step's draft and verify time against its rows).

It needs no tuning per temperature or model: a draft that is rarely right, or verify rows
that are expensive (a small model on a CPU), shorten the drafts; a draft that keeps being
right and cheap rows (a large model on a GPU) lengthen them. For its first three steps it
explores from a draft of 3 with HF transformers' schedule (two more after a fully accepted
block, one fewer after a rejection).

With several slots in one step (serving/slot_loop.py) the rows of every slot share one target
decode, so a row's cost is the step's, not the slot's: ``plan_lengths`` hands out the
step's draft rows across the adaptive slots together, each next row to the slot whose next
draft token is likeliest to be kept, for as long as it raises the step's expected tokens per
second. A slot whose drafts are rarely right then gives its rows to one whose drafts are;
on hardware where rows are dear (a CPU) the step stays short as more slots join.

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


class StepCost:
    """Seconds a step takes as base + per_row x rows: a decaying least-squares fit."""

    DECAY = 0.9

    def __init__(self) -> None:
        self._w = self._sx = self._sy = self._sxx = self._sxy = 0.0

    def update(self, rows: int, seconds: float) -> None:
        if seconds <= 0:
            return
        d, x, y = self.DECAY, float(rows), seconds
        self._w, self._sx, self._sy = d * self._w + 1, d * self._sx + x, d * self._sy + y
        self._sxx, self._sxy = d * self._sxx + x * x, d * self._sxy + x * y

    def fit(self) -> tuple[float, float]:
        """(base, per_row). Until steps of different sizes were seen, a row is assumed free."""
        var = self._w * self._sxx - self._sx ** 2
        if self._w and var > 1e-12:
            per_row = max((self._w * self._sxy - self._sx * self._sy) / var, 0.0)
            return max((self._sy - per_row * self._sx) / self._w, 1e-9), per_row
        return (self._sy / self._w if self._w else 1.0), 0.0


class AdaptiveLength:
    """One generation's adaptive draft length. Alone, it fits its own ``StepCost``; given a
    shared one (every slot of an engine), the steps update that cost and ``plan_lengths``
    plans the slots together."""

    # Explore from a short draft for a few steps: long warm-up drafts cost most where the best
    # length is 1 (high temperature); a draft that keeps being right grows by 2 a step meanwhile.
    START = 3
    WARMUP_STEPS = 3
    DECAY = 0.9  # weight of the past in the acceptance estimates

    def __init__(self, start: int, limit: int, cost: StepCost | None = None) -> None:
        self.limit = max(1, limit)
        self.n = max(1, min(start, self.limit))
        self.steps = 0
        self.cost = cost or StepCost()
        self.owns_cost = cost is None
        # acceptance, per draft position: decayed counts of (reached, accepted)
        self._tried = [0.0] * self.limit
        self._kept = [0.0] * self.limit

    @property
    def warming_up(self) -> bool:
        return self.steps < self.WARMUP_STEPS

    def next(self) -> int:
        return self.n

    def update(self, drafted: int, accepted: int, seconds: float = 0.0) -> None:
        """After a step: ``drafted`` proposed, ``accepted`` kept; ``seconds`` (its time) feeds
        this rule's own cost fit, when it has one."""
        if drafted == 0 and self.n > 0 and self.warming_up:
            return  # nothing was proposed (no match, or too few): no evidence either way
        d = self.DECAY
        # Positions reached: every accepted one, plus the one rejected (when there was one).
        reached = min(accepted + (1 if accepted < drafted else 0), self.limit)
        for i in range(self.limit):
            self._tried[i] = d * self._tried[i] + (1 if i < reached else 0)
            self._kept[i] = d * self._kept[i] + (1 if i < accepted else 0)
        if self.owns_cost:
            self.cost.update(1 + drafted, seconds)
        self.steps += 1
        if self.warming_up:
            self.n = min(self.n + 2, self.limit) if accepted == drafted else max(1, self.n - 1)
            return
        self.n = self._best_length()

    def acceptance(self) -> list[float]:
        """a_i per position, shrunk towards the overall rate where a position was rarely reached."""
        tried, kept = sum(self._tried), sum(self._kept)
        overall = kept / tried if tried else 0.0
        prior = 2.0  # pseudo-observations at the overall rate
        return [min((k + prior * overall) / (t + prior), 0.999) for t, k in zip(self._tried, self._kept)]

    def gains(self) -> list[float]:
        """Expected tokens the i-th draft token adds to a step: a_1 x ... x a_i, for i = 1..limit."""
        out, term = [], 1.0
        for a in self.acceptance():
            term *= a
            out.append(term)
        return out

    def _best_length(self) -> int:
        """The length with the best expected tokens per second of a step of this rule alone."""
        base, per_row = self.cost.fit()
        best, best_rate, gain = 0, 0.0, 1.0
        for n, g in enumerate([0.0, *self.gains()]):
            gain += g
            rate = gain / (base + per_row * (1 + n))
            if rate > best_rate * 1.0001:
                best, best_rate = n, rate
        # Keep drafting at least one token: with none, the acceptance estimate could never recover.
        return max(best, 1)


def plan_lengths(rules: list, limits: list[int]) -> list[int]:
    """Draft lengths for one step shared by several generations (their rules, and the most each
    may draft now). Fixed rules, and adaptive ones still warming up, take their own length; the
    other adaptive rules that share a ``StepCost`` get the step's rows together: starting from
    one draft each (so their estimates keep learning), each further row goes to the slot whose
    next draft token adds the most expected tokens, while that raises the step's expected
    tokens per second, (T + g) / (C + per_row) > T / C."""
    lengths = [min(rule.next(), limit) for rule, limit in zip(rules, limits)]
    groups: dict[int, list[int]] = {}
    for i, rule in enumerate(rules):
        if isinstance(rule, AdaptiveLength) and not rule.owns_cost and not rule.warming_up and limits[i] > 0:
            groups.setdefault(id(rule.cost), []).append(i)
    for members in groups.values():
        if len(members) < 2:
            continue  # alone in its step: its own best length (as with one slot)
        base, per_row = rules[members[0]].cost.fit()
        if per_row <= 0:
            continue  # rows look free: every slot drafts its own best
        gains = {i: rules[i].gains() for i in members}
        for i in members:
            lengths[i] = 1
        rows = sum(1 + n for n in lengths)  # every slot's id_last and drafts, the plan's and the others'
        # Expected tokens of the step; a slot outside the plan counts its one certain token (a lower bound).
        expected = sum(1 + sum(gains[i][:lengths[i]]) if i in gains else 1 for i in range(len(rules)))
        cost = base + per_row * rows
        while True:
            open_ = [i for i in members if lengths[i] < min(limits[i], len(gains[i]))]
            if not open_:
                break
            i = max(open_, key=lambda j: gains[j][lengths[j]])
            g = gains[i][lengths[i]]
            if g * cost <= per_row * expected:  # one more row would lower the step's tokens per second
                break
            lengths[i] += 1
            expected += g
            cost += per_row
    return lengths
