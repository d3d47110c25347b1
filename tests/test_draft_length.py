"""Draft lengths planned across the slots of one step (draft_length.plan_lengths), and the
engine-level promise: planned lengths change speed, never the greedy output."""

from __future__ import annotations

import random

import pytest
from conftest import N_THREADS

import pyllama_spec as ps
from pyllama_spec.devtools import tiny
from pyllama_spec.speculative.draft_length import (
    AdaptiveLength,
    FixedLength,
    StepCost,
    plan_lengths,
)


def _cost(base: float, per_row: float) -> StepCost:
    """A StepCost that has seen steps of several sizes following base + per_row x rows."""
    cost = StepCost()
    for rows in (2, 5, 9, 14, 3, 8, 17, 4):
        cost.update(rows, base + per_row * rows)
    return cost


def _trained(cost: StepCost, alpha: float, limit: int = 15, seed: int = 0) -> AdaptiveLength:
    """A rule past its warm-up whose drafts are each kept with probability alpha."""
    rule = AdaptiveLength(7, limit, cost=cost)
    rng = random.Random(seed)
    for _ in range(40):
        n = rule.next()
        kept = 0
        while kept < n and rng.random() < alpha:
            kept += 1
        rule.update(n, kept)
    assert not rule.warming_up
    return rule


def _expected_rate(rules, lengths, cost: StepCost) -> float:
    base, per_row = cost.fit()
    tokens = sum(1 + sum(r.gains()[:n]) for r, n in zip(rules, lengths))
    return tokens / (base + per_row * sum(1 + n for n in lengths))


def test_the_step_cost_fit_recovers_base_and_per_row():
    base, per_row = _cost(0.004, 0.0015).fit()
    assert base == pytest.approx(0.004, rel=1e-6) and per_row == pytest.approx(0.0015, rel=1e-6)
    assert StepCost().fit()[1] == 0.0  # nothing seen: a row is assumed free


def test_rows_go_to_the_slot_whose_drafts_are_kept():
    cost = _cost(0.010, 0.002)
    good, bad = _trained(cost, 0.9), _trained(cost, 0.1, seed=1)
    lengths = plan_lengths([good, bad], [15, 15])
    assert lengths[0] > 3 * lengths[1] and lengths[1] >= 1  # the bad one keeps one draft, to keep learning


def test_the_plan_is_the_best_split_of_the_step():
    """Against every split of the rows (small limits: brute force), the greedy plan's expected
    tokens per second is the best."""
    cost = _cost(0.006, 0.001)
    rules = [_trained(cost, a, limit=6, seed=i) for i, a in enumerate((0.85, 0.6, 0.3))]
    lengths = plan_lengths(rules, [6, 6, 6])
    best = max(_expected_rate(rules, (a, b, c), cost)
               for a in range(1, 7) for b in range(1, 7) for c in range(1, 7))
    assert _expected_rate(rules, lengths, cost) == pytest.approx(best, rel=1e-9)


def test_dear_rows_shorten_every_draft_as_slots_join():
    """Slots whose drafts are alike (the same history): long drafts where rows are cheap (a large
    model on a GPU), short ones where rows cost as much as a step (a small model on a CPU), and
    shorter still as more slots share the step."""
    cheap, dear = _cost(0.020, 0.0002), _cost(0.001, 0.001)
    assert all(n >= 10 for n in plan_lengths([_trained(cheap, 0.9) for _ in range(4)], [15] * 4))
    assert all(n <= 4 for n in plan_lengths([_trained(dear, 0.9) for _ in range(4)], [15] * 4))
    by_slots = [sum(plan_lengths([_trained(dear, 0.9) for _ in range(k)], [15] * k)) / k for k in (1, 2, 4, 8)]
    assert by_slots == sorted(by_slots, reverse=True) and by_slots[-1] < by_slots[0]


def test_fixed_warming_up_and_limited_slots_keep_their_own_length():
    cost = _cost(0.001, 0.001)
    fixed, fresh = FixedLength(7), AdaptiveLength(5, 15, cost=cost)
    trained = [_trained(cost, 0.9, seed=i) for i in range(2)]
    lengths = plan_lengths([fixed, fresh, *trained], [15, 15, 2, 0])
    assert lengths[:2] == [7, 5]  # fixed, and still in its warm-up
    assert lengths[2] <= 2 and lengths[3] == 0  # the most each may draft now
    alone = AdaptiveLength(7, 15)  # its own cost: planned alone, as with one slot
    assert plan_lengths([alone], [15]) == [alone.next()]


def test_planned_lengths_across_slots_are_lossless():
    """Auto lengths planned across 3 slots (text and image) give each request its greedy answer."""
    pair = ps.embedded_models()
    image = tiny.draw_demo_image(224)
    prompts = [("def f", []), ("import os\n", [image]), ("class Foo:", [])]
    with ps.load(pair.target, mmproj=pair.mmproj, draft=pair.draft, n_threads=N_THREADS) as one:
        expected = [one.generate(p, images=im, max_tokens=64).tokens for p, im in prompts]
    with ps.load(pair.target, mmproj=pair.mmproj, draft=pair.draft, n_threads=N_THREADS, n_parallel=3,
                 draft_max="auto") as engine:
        for _ in range(2):  # the second round starts with a step cost learned in the first
            engine.reset_cache()
            subs = [engine.submit(p, images=im, max_tokens=64) for p, im in prompts]
            results = [s.result() for s in subs]
            assert [r.tokens for r in results] == expected
        assert sum(n for k, n in engine.scheduler.slots_per_step.items() if k > 1) > 0
        drafted = [r.stats.per_position_drafted for r in results]
        assert any(d[0] > 0 for d in drafted) and all(len(d) <= 15 for d in drafted)


def test_draft_max_auto_at_load_and_its_refusals(tmp_path):
    pair = ps.embedded_models()
    with ps.load(pair.target, draft=pair.draft, n_threads=N_THREADS, draft_max="auto") as engine:
        r = engine.generate("def f", max_tokens=24)
        assert r.stats.drafted > 0
        fixed = engine.generate("def f", max_tokens=24, draft_max=3)  # a call may still fix it
        assert fixed.tokens == r.tokens and max(i for i, n in enumerate(fixed.stats.per_position_drafted) if n) < 3
    for bad in ("fast", -1, 2.5, True):
        with pytest.raises(ValueError, match="draft_max"):
            ps.load(pair.target, draft=pair.draft, n_threads=N_THREADS, draft_max=bad)


def _run(rule: AdaptiveLength, steps: int, alpha, *, base: float, per_row: float, plain: float, seed: int = 0):
    """Feed ``rule`` ``steps`` steps: a draft of n costs base + per_row x (1 + n) and each token is kept
    with probability alpha(step); a step without one costs ``plain``. Returns the lengths it chose."""
    rng, chosen = random.Random(seed), []
    for step in range(steps):
        n = rule.next()
        chosen.append(n)
        kept = 0
        while kept < n and rng.random() < alpha(step):
            kept += 1
        rule.update(n, kept, base + per_row * (1 + n) if n else plain)
    return chosen


def test_auto_drafts_nothing_where_no_length_pays_and_probes_back_when_it_does():
    rule = AdaptiveLength(AdaptiveLength.START, 15)
    # a draft call costs as much as the target's step, rows are dear, and drafts are rarely right
    chosen = _run(rule, 200, lambda step: 0.15, base=0.010, per_row=0.002, plain=0.006)
    tail = chosen[100:]
    assert tail.count(0) > 0.9 * len(tail)  # off, but for the probes
    probes = [i for i in range(1, len(chosen)) if chosen[i] and not chosen[i - 1]]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and max(gaps) <= AdaptiveLength.PROBE_MAX + 2  # backing off, bounded
    # the text turns repetitive: a probe finds drafts kept, and drafting resumes
    chosen = _run(rule, 300, lambda step: 0.98, base=0.010, per_row=0.002, plain=0.006, seed=1)
    assert sum(1 for n in chosen[-100:] if n > 0) > 90 and max(chosen[-100:]) >= 5


def test_where_drafting_pays_auto_keeps_drafting_but_for_a_plain_step_now_and_then():
    rule = AdaptiveLength(AdaptiveLength.START, 15)
    chosen = _run(rule, 300, lambda step: 0.9, base=0.010, per_row=0.0005, plain=0.009)
    assert chosen[50:].count(0) <= 300 // AdaptiveLength.PLAIN_EVERY + 1 and min(n for n in chosen[50:] if n) >= 3
