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

Where no length pays, it drafts nothing: a step without a draft skips the drafter's calls (its
row is shown to the drafter later, in a batch), so its time is measured apart (``StepCost.plain``,
the target's decode of one token and its row's share of that batch), and when
one token a step at that cost beats every drafting length the rule stops drafting. So that it
can find out when drafting pays again (the text turns repetitive, a picture's answer begins),
it probes with a draft of ``START`` after ``PROBE_AFTER`` steps without, then after twice as many, up
to ``PROBE_MAX`` apart. A probe starts the acceptance estimates afresh (what was measured before
drafting stopped is old news): drafts kept resume drafting, drafts rejected keep it off.

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
        self._plain: float | None = None  # seconds of a step that drafted nothing (a decaying mean)
        self._catch_up = 0.0  # seconds the drafter takes later for such a step's row (a decaying mean)

    @property
    def plain(self) -> float | None:
        """What a step that drafts nothing costs: its own time, and its row's share of the drafter's
        later catch-up (``Sequence.show_drafter``); None until one was timed."""
        return None if self._plain is None else self._plain + self._catch_up

    def update_plain(self, seconds: float) -> None:
        """A step without a draft call: the target's decode of its one token and what is around it."""
        if seconds > 0:
            self._plain = seconds if self._plain is None else self.DECAY * self._plain + (1 - self.DECAY) * seconds

    def update_catch_up(self, rows: int, seconds: float) -> None:
        """The drafter was shown ``rows`` held by steps that drafted nothing, in ``seconds``."""
        if rows > 0 and seconds > 0:
            self._catch_up = self.DECAY * self._catch_up + (1 - self.DECAY) * seconds / rows

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
    PROBE_AFTER = 8  # steps without a draft before the first probe; doubled after each probe that fails
    PROBE_MAX = 128
    PLAIN_EVERY = 64  # drafting steps between two plain ones that keep the plain step's cost current
    PLAIN_FIRST = 8  # drafting steps after the warm-up before the first plain one (when none was timed yet)

    def __init__(self, start: int, limit: int, cost: StepCost | None = None) -> None:
        self.limit = max(1, limit)
        self.n = max(1, min(start, self.limit))
        self.steps = 0
        self.cost = cost or StepCost()
        self.owns_cost = cost is None
        # acceptance, per draft position: decayed counts of (reached, accepted)
        self._tried = [0.0] * self.limit
        self._kept = [0.0] * self.limit
        self._idle = 0  # steps since drafting stopped (n == 0), towards the next probe
        self._probe_after = self.PROBE_AFTER
        self._since_plain = self.PLAIN_EVERY - self.PLAIN_FIRST  # drafting steps since the last plain one
        self._measuring_plain = False  # this step drafts nothing only to time a plain step
        self._probing = False  # this step drafts to see whether drafting pays again

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
        if self.n == 0 and drafted == 0 and self.owns_cost:
            self.cost.update_plain(seconds)  # alone, this rule times its own plain steps
        if self.n == 0 and drafted == 0 and self._measuring_plain:  # a plain step timed: back to drafting
            self._measuring_plain = False
            self.n = self._best_length()
            return
        if drafted == 0 and (self.n == 0 or self._probing):  # off (or a probe found nothing): probe now and then
            self._probing, self.n = False, 0
            self._idle += 1
            if self._idle >= self._probe_after:
                self._idle, self._probe_after = 0, min(2 * self._probe_after, self.PROBE_MAX)
                self.n, self._probing = min(self.START, self.limit), True
            return
        d = self.DECAY
        if self._probing:  # drafting was off for a while: the probe starts the estimates afresh
            self._tried, self._kept = [0.0] * self.limit, [0.0] * self.limit
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
        if self._probing:
            self._probing = False
            if accepted == drafted > 0:  # the probe's drafts were all kept: look again soon
                self._probe_after = self.PROBE_AFTER
        if self.n > 0:
            self._probe_after = self.PROBE_AFTER  # drafting pays: the next stop probes early again
            self._since_plain += 1
            if self._since_plain >= self.PLAIN_EVERY:  # time a plain step now and then (costs and
                self._since_plain = 0  # contexts change): the choice between drafting and not needs both
                self._measuring_plain, self.n = True, 0

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
        """The length with the best expected tokens per second of a step of this rule alone: 0 (no
        draft) when a plain step, measured apart, beats them all."""
        base, per_row = self.cost.fit()
        best, best_rate, gain = 1, 0.0, 1.0
        for n, g in enumerate(self.gains(), start=1):
            gain += g
            rate = gain / (base + per_row * (1 + n))
            if rate > best_rate * 1.0001:
                best, best_rate = n, rate
        plain = self.cost.plain
        if plain is not None and 1.0 / plain > best_rate:
            return 0
        return best


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
        if isinstance(rule, AdaptiveLength) and not rule.owns_cost and not rule.warming_up and limits[i] > 0 \
                and rule.next() > 0:  # a rule that stopped drafting (or times a plain step) keeps its 0
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
