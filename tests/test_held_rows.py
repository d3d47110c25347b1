"""A step that drafts nothing holds its rows for the drafter instead of paying a drafter decode for
them (``Sequence.hold_for_drafter``): they are shown in one batch before the drafter next works for
that sequence. What must hold: the drafter's state, and so every later draft, is what showing the
rows at once gives; the output stays the target's; a cut, a reset and a failed step leave nothing
behind; and no drafter decode runs in a step that drafted nothing.

Real drafters on the embedded trained files (DFlash, EAGLE3, the draft model, MTP, n-gram), with
the steps that draft chosen by a fixed schedule so that runs of plain steps alternate with drafts.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import N_THREADS, held_out_prompts
from test_trained_pair import PROMPT

import pyllama_spec as ps
from pyllama_spec.drafters import TargetDecode, TargetRows
from pyllama_spec.embedded import MODELS_DIR
from pyllama_spec.speculative import generation
from pyllama_spec.speculative.sequence import Sequence

TARGET, MMPROJ = MODELS_DIR / "trained-target.gguf", MODELS_DIR / "trained-mmproj.gguf"
MTP_TARGET = MODELS_DIR / "trained-qwen35-mtp.gguf"
METHODS = {  # spec type: (target, load keywords)
    "draft-dflash": (TARGET, dict(draft=MODELS_DIR / "trained-draft.gguf")),
    "draft-eagle3": (TARGET, dict(draft=MODELS_DIR / "trained-eagle3.gguf")),
    "draft-simple": (TARGET, dict(draft=MODELS_DIR / "trained-draft-vlm.gguf")),
    "draft-mtp": (MTP_TARGET, {}),
    "ngram-simple": (TARGET, {}),
}
ENGINE = dict(n_ctx=2048, n_batch=64, n_ubatch=64, n_threads=N_THREADS, flash_attn=False)


# ----------------------------------------------------------------------------- held rows, joined

class _Outputs:
    """What TargetDecode reads of a target context: layer inputs and final hidden states, by row."""

    def __init__(self, n_rows: int, layers=(1, 3), hidden=True) -> None:
        rng = np.random.default_rng(n_rows)
        self.recorded_layers = frozenset(layers)
        self.records_draft_embeddings = hidden
        self.layers = {lid: rng.random((n_rows, 4), dtype=np.float32) for lid in layers}
        self.hidden = rng.random((n_rows, 4), dtype=np.float32)

    def layer_input(self, lid, n_rows):
        return self.layers[lid][:n_rows]

    def draft_embeddings(self, n_rows):
        return self.hidden[:n_rows]


def _rows(pos: int, n: int, row_offset: int = 0) -> TargetRows:
    p = np.arange(pos, pos + n, dtype=np.int32)
    return TargetRows(p[None, :], False, pos + 100, tokens=p + 7, seq_id=2, row_offset=row_offset)


def test_held_rows_join_into_batches_with_what_the_target_computed_for_them():
    held, expected_layers, expected_hidden = [], {1: [], 3: []}, []
    for step in range(7):  # a step of two slots: this sequence's row is the second of two
        out = _Outputs(2 + step)
        rows = _rows(10 + step, 1, row_offset=1)
        held.append(TargetDecode([_rows(50, 1), rows], out).hold(rows))
        for lid in (1, 3):
            expected_layers[lid].append(out.layers[lid][1:2].copy())
        expected_hidden.append(out.hidden[1:2].copy())
        out.layers[1][:] = -1  # the target's next decode overwrites its buffers: the held rows are copies
    decodes = list(TargetDecode.joined(held, max_rows=3))
    assert [d.rows[0].n_rows for d in decodes] == [3, 3, 1]
    assert [d.rows[0].first_draft_pos for d in decodes] == [110, 113, 116]
    rows = [d.rows[0] for d in decodes]
    assert np.concatenate([r.section0 for r in rows]).tolist() == list(range(10, 17))
    assert np.concatenate([r.tokens for r in rows]).tolist() == list(range(17, 24))
    assert all(r.seq_id == 2 and r.row_offset == 0 and not r.has_embeddings for r in rows)
    got = np.concatenate([d.features([3, 1], r) for d, r in zip(decodes, rows)])
    want = np.concatenate([np.concatenate(expected_layers[3]), np.concatenate(expected_layers[1])], axis=1)
    assert np.array_equal(got, want)
    assert np.array_equal(np.concatenate([d.hidden(r) for d, r in zip(decodes, rows)]),
                          np.concatenate(expected_hidden))
    with pytest.raises(ValueError, match="layer 2 inputs were not recorded"):
        decodes[0].features([2], rows[0])


def test_a_cut_through_held_rows_keeps_those_before_it():
    out = _Outputs(5, hidden=False)
    h = TargetDecode([_rows(20, 5)], out).hold(_rows(20, 5))
    cut = h.head(23)
    assert cut.rows.section0.tolist() == [20, 21, 22] and cut.rows.tokens.tolist() == [27, 28, 29]
    assert np.array_equal(cut.layers[3], out.layers[3][:3]) and cut.hidden is None
    assert h.head(30) is h and h.head(20).rows.n_rows == 0


# ----------------------------------------------------------------------------- real drafters

class _Schedule:
    """Draft lengths by step: a draft of 3 every fifth step, nothing in between (plain steps)."""

    def __init__(self) -> None:
        self.step = 0

    def __call__(self, rules, limits):
        self.step += 1
        return [min(3 if self.step % 5 == 0 else 0, limit) for limit in limits]


def _shown_at_once(seq: Sequence, decode: TargetDecode, rows: TargetRows) -> None:
    seq.drafter.process(TargetDecode([rows], decode._source))


def _run(method, monkeypatch, *, hold: bool, prompts):
    target, kw = METHODS[method]
    monkeypatch.setattr(generation, "plan_lengths", _Schedule())
    if not hold:
        monkeypatch.setattr(Sequence, "hold_for_drafter", _shown_at_once)
    out = []
    with ps.load(target, spec_type=method, draft_max=3, **kw, **ENGINE) as engine:
        calls = []
        process = engine.drafter.process

        def counting(decode):
            calls.append(engine.sequences[0].positions.pos_next)
            process(decode)

        engine.drafter.process = counting
        chat = ""
        for p in prompts:  # one conversation: each prompt goes on from the last answer (held rows shown)
            chat += p
            r = engine.generate(chat, max_tokens=40, temperature=0)
            chat += r.text
            out.append((r.tokens, r.stats.drafted, r.stats.accepted, list(r.stats.per_position_accepted),
                        r.stats.target_steps))
    monkeypatch.undo()
    return out, calls


@pytest.mark.parametrize("method", list(METHODS))
def test_held_rows_give_the_drafts_that_showing_them_at_once_gives(method, monkeypatch):
    prompts = (held_out_prompts(2) or [PROMPT, PROMPT])[:2]
    prompts = [prompts[0][:200], "\n# and then\n" + prompts[1][:120]]
    held, held_calls = _run(method, monkeypatch, hold=True, prompts=prompts)
    at_once, at_once_calls = _run(method, monkeypatch, hold=False, prompts=prompts)
    assert held == at_once  # same tokens, same drafts kept at every position, same steps
    assert sum(r[1] for r in held) > 0  # the schedule drafted
    # a process call per drafting step and per batch of held rows: far fewer than one per step
    assert len(held_calls) < len(at_once_calls) - sum(r[4] for r in held) // 2
    target, kw = METHODS[method]
    with ps.load(target, spec_type="none", **ENGINE) as plain:
        chat = ""
        for p, r in zip(prompts, held):
            chat += p
            alone = plain.generate(chat, max_tokens=40, temperature=0)
            assert alone.tokens == r[0]
            chat += alone.text


def test_a_cut_shows_only_the_held_rows_before_it_and_a_failed_catch_up_leaves_nothing(monkeypatch):
    target, kw = METHODS["draft-eagle3"]
    schedule = {"lengths": 0}
    monkeypatch.setattr(generation, "plan_lengths", lambda rules, limits: [min(schedule["lengths"], n) for n in limits])
    with ps.load(target, spec_type="draft-eagle3", draft_max=3, **kw, **ENGINE) as engine, \
            ps.load(target, spec_type="none", **ENGINE) as plain:
        seq = engine.sequences[0]
        r = engine.generate(PROMPT, max_tokens=12, temperature=0)
        assert seq.holds_rows and r.stats.drafted == 0
        n_prompt = r.stats.prompt_tokens
        cached = np.concatenate(seq.cached)
        seen = []
        process = engine.drafter.process

        def recording(decode):
            seen.extend(int(p) for rows in decode.rows for p in rows.section0)
            process(decode)

        engine.drafter.process = recording
        # a prompt going on from the prompt and the answer's first 5 tokens: 4 of the held rows are kept
        rest = seq.keep_prefix([cached[:n_prompt + 5]])
        assert not seq.holds_rows and len(rest[0]) == 1
        assert seen == list(range(n_prompt, n_prompt + 4))

        engine.generate(PROMPT, max_tokens=12, temperature=0)
        seen.clear()
        seq.keep_prefix([cached[:n_prompt]])  # the cut is before every held row: none is shown
        assert not seq.holds_rows and not seen

        engine.generate(PROMPT, max_tokens=12, temperature=0)
        assert seq.holds_rows

        def failing(decode):
            raise RuntimeError("the drafter failed")

        engine.drafter.process = failing
        schedule["lengths"] = 3  # the next step drafts: the held rows are shown first, and that fails
        with pytest.raises(RuntimeError, match="the drafter failed"):
            engine.generate(PROMPT + r.text, max_tokens=12, temperature=0)
        assert not seq.holds_rows and seq.positions.n_rows == 0  # the failed sequence starts over
        engine.drafter.process = process
        again = engine.generate(PROMPT + r.text, max_tokens=12, temperature=0)
        assert again.tokens == plain.generate(PROMPT + r.text, max_tokens=12, temperature=0).tokens
        assert again.stats.drafted > 0


def _failing_once(engine):
    process, calls = engine.drafter.process, []

    def fail_once(decode):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the drafter failed")
        return process(decode)

    engine.drafter.process = fail_once


def test_a_drafter_failing_on_held_rows_at_a_cut_leaves_the_slot_usable():
    """A prompt that cuts through an answer shows the held rows before it; when the drafter fails there,
    the slot starts over (with --kv-unified the cut happens at admission; the facade's eval cuts too)."""
    target, kw = METHODS["draft-dflash"]
    with ps.load(target, spec_type="draft-dflash", draft_max=3, n_parallel=2, kv_unified=True, **kw,
                 **ENGINE) as engine, ps.load(target, spec_type="none", **ENGINE) as plain:
        first = engine.generate(PROMPT, max_tokens=12, temperature=0, draft_max=0)  # its rows held
        seq = next(s for s in engine.sequences if s.holds_rows)
        _failing_once(engine)
        with pytest.raises(RuntimeError, match="the drafter failed"):
            engine.generate(PROMPT + first.text[:6] + " zzz qqq", max_tokens=8, temperature=0)
        assert seq.n_cached_rows == seq.positions.n_rows == 0 and not seq.holds_rows
        again = engine.generate(PROMPT + first.text + " and more", max_tokens=8, temperature=0)
        assert again.tokens == plain.generate(PROMPT + first.text + " and more", max_tokens=8, temperature=0).tokens

    from pyllama_spec.serving.token_steps import TokenSteps

    target, kw = METHODS["draft-eagle3"]
    with ps.load(target, spec_type="draft-eagle3", draft_max=3, **kw, **ENGINE) as engine:
        engine.generate(PROMPT, max_tokens=12, temperature=0, draft_max=0)
        tokens = np.concatenate(engine.sequences[0].cached)
        steps = TokenSteps(engine)
        _failing_once(engine)
        with pytest.raises(RuntimeError, match="the drafter failed"):
            steps.eval(tokens[:-6], [1, 2])
        steps.eval(tokens, [3])  # the sequence started over: it decodes them all again


def test_a_long_run_without_drafts_holds_at_most_a_batch_and_auto_counts_the_catch_up(monkeypatch):
    monkeypatch.setattr(generation, "plan_lengths", lambda rules, limits: [0] * len(limits))
    target, kw = METHODS["draft-eagle3"]
    most = []
    hold = Sequence.hold_for_drafter

    def watching(seq, decode, rows):
        hold(seq, decode, rows)
        most.append(seq.held_rows)

    monkeypatch.setattr(Sequence, "hold_for_drafter", watching)
    with ps.load(target, spec_type="draft-eagle3", draft_max="auto", **kw, **ENGINE) as engine:
        r = engine.generate(PROMPT, max_tokens=200, temperature=0)
        assert r.stats.drafted == 0 and r.stats.target_steps >= 150
        assert max(most) == generation.HELD_ROWS_MAX  # shown in a batch once a batch is held
        cost = engine.step_cost
        assert cost.plain is not None and cost.plain > cost._plain  # each plain step's share of the catch-ups
