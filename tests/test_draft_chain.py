"""Context.draft_chain (bindings): a drafter's chain of one-token decodes in one native call gives
exactly what the same decodes driven from Python give (tokens, logits rows, the draft's cache),
with and without state rows, for several sequences with their own lengths, cut by p_min; a
failed or interrupted decode in the middle of the chain is a DecodeError that leaves the context
usable. EAGLE3, MTP and the draft model draft through it (their own tests prove them lossless)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY_ENGINE

import pyllama_spec as ps
from pyllama_spec import _native
from pyllama_spec.bindings.batch import Batch
from pyllama_spec.devtools import tiny
from pyllama_spec.errors import DecodeError


def _python_chain(ctx, batch, seq_ids, next_pos, n_max, *, p_min, top_k, feed_states):
    """The loop the drafters ran in Python before the chain went native: decode, take each row's
    best token (its top-k probability at least p_min), feed it back at the next position."""
    active = list(range(len(seq_ids)))
    tokens = [[] for _ in seq_ids]
    rows = [[] for _ in seq_ids]
    step = 0
    while active:
        ctx.decode(batch)
        logits = ctx.output_logits(len(active))
        states = ctx.draft_embeddings(len(active)) if feed_states else None
        batch.clear()
        going = []
        for j, i in enumerate(active):
            best = int(np.argmax(logits[j]))
            if p_min > 0:
                top = np.sort(np.partition(logits[j], -top_k)[-top_k:])[::-1]
                if 1.0 / np.exp(top - logits[j][best]).sum() < p_min:
                    continue
            tokens[i].append(best)
            rows[i].append(logits[j].copy())
            if len(tokens[i]) >= n_max[i]:
                continue
            at = [next_pos[i] + step]
            if feed_states:
                batch.add_tokens_with_states([best], at, states[j:j + 1], outputs=True, seq_id=seq_ids[i])
            else:
                batch.add_tokens([best], at, outputs=True, seq_id=seq_ids[i])
            going.append(i)
        active = going
        step += 1
    return [(t, np.stack(r) if r else None) for t, r in zip(tokens, rows)]


def _seed(batch, rng, n_embd, feed_states, seeds):
    """Each sequence's first rows: (seq_id, tokens, first position); the last row gives the output."""
    batch.clear()
    for seq, toks, pos0 in seeds:
        pos = np.arange(pos0, pos0 + len(toks), dtype=np.int32)
        outputs = np.zeros(len(toks), dtype=bool)
        outputs[-1] = True
        if feed_states:
            g = rng.standard_normal((len(toks), n_embd)).astype(np.float32)
            batch.add_tokens_with_states(toks, pos, g, outputs=outputs, seq_id=seq)
        else:
            batch.add_tokens(toks, pos, outputs=outputs, seq_id=seq)


def _both_ways(ctx, feed_states, seeds, n_max, *, p_min=0.0):
    """The chain natively and from Python, from the same seeds and an empty cache each time."""
    results = []
    for run in ("native", "python"):
        rng = np.random.default_rng(5)
        for seq, _, _ in seeds:
            ctx.memory.remove(seq, -1, -1)
        batch = Batch(ctx)
        try:
            _seed(batch, rng, ctx.model.n_embd, feed_states, seeds)
            next_pos = [pos0 + len(toks) for _, toks, pos0 in seeds]
            args = ([s for s, _, _ in seeds], next_pos, n_max)
            if run == "native":
                got = ctx.draft_chain(batch, *args, p_min=p_min, top_k=10, feed_states=feed_states)
                assert batch.n_rows == 0
            else:
                got = _python_chain(ctx, batch, *args, p_min=p_min, top_k=10, feed_states=feed_states)
            cache = [(ctx.memory.pos_min(s), ctx.memory.pos_max(s)) for s, _, _ in seeds]
            results.append((got, cache))
        finally:
            batch.close()
    return results


def _assert_same(native, python):
    (got, cache), (want, want_cache) = native, python
    assert cache == want_cache  # the chain's rows are in the draft's cache either way
    for (toks, rows), (want_toks, want_rows) in zip(got, want):
        assert toks == want_toks
        if want_rows is None:
            assert rows is None or len(rows) == 0
        else:
            np.testing.assert_array_equal(rows, want_rows)


@pytest.fixture(scope="module")
def eagle3_engine(tiny_dense, tmp_path_factory):
    draft = tiny.write_eagle3_draft(tmp_path_factory.mktemp("chain") / "eagle3.gguf", tiny_dense.target)
    with ps.load(tiny_dense.target, draft=draft, spec_type="draft-eagle3", n_parallel=2, **TINY_ENGINE) as engine:
        yield engine


@pytest.fixture(scope="module")
def draft_model_engine(tiny_dense):
    with ps.load(tiny_dense.target, draft=tiny_dense.target, spec_type="draft-simple", n_parallel=2,
                 **TINY_ENGINE) as engine:
        yield engine


SEEDS = [(0, [5, 9, 11], 0), (1, [7, 3], 4)]


@pytest.mark.parametrize("n_max", [[4, 4], [1, 6], [6, 2]])
def test_a_chain_with_state_rows_equals_the_python_loop(eagle3_engine, n_max):
    native, python = _both_ways(eagle3_engine.drafter.ctx, True, SEEDS, n_max)
    _assert_same(native, python)
    assert [len(t) for t, _ in native[0]] == n_max  # p_min 0: every sequence drafts its whole length


def test_a_chain_without_state_rows_equals_the_python_loop(draft_model_engine):
    native, python = _both_ways(draft_model_engine.drafter.ctx, False, SEEDS, [5, 3])
    _assert_same(native, python)
    for toks, rows in native[0]:
        assert rows.shape == (len(toks), draft_model_engine.model.n_vocab) and rows.dtype == np.float32


def test_p_min_ends_a_sequence_before_an_unsure_token(eagle3_engine):
    ctx = eagle3_engine.drafter.ctx
    # find a p_min that cuts some draft short here (the random states make unsure rows)
    (full, _), _ = _both_ways(ctx, True, SEEDS, [6, 6])
    assert all(len(t) == 6 for t, _ in full)
    for p_min in (0.2, 0.5, 0.9, 0.99):
        native, python = _both_ways(ctx, True, SEEDS, [6, 6], p_min=p_min)
        _assert_same(native, python)
        if any(len(t) < 6 for t, _ in native[0]):
            break
    else:
        pytest.fail("no p_min cut a draft short")
    for (toks, _), (full_toks, _) in zip(native[0], full):
        assert toks == full_toks[:len(toks)]  # cut, never changed


def test_no_sequence_is_no_decode_and_arguments_that_do_not_fit_are_refused_before_any(eagle3_engine,
                                                                                        draft_model_engine):
    ctx = eagle3_engine.drafter.ctx
    batch = Batch(ctx)
    try:
        assert ctx.draft_chain(batch, [], [], []) == []
        for seq in (0, 1):
            ctx.memory.remove(seq, -1, -1)
        _seed(batch, np.random.default_rng(0), ctx.model.n_embd, True, SEEDS)
        for args, match in [(([0, 1], [3], [4, 4]), "one position and one length per sequence"),
                            (([0, 1], [3, 6], [4]), "one position and one length per sequence"),
                            (([0, 1], [3, 6], [4, 0]), "at least 1"),
                            (([0], [3], [4]), "one output row per sequence")]:
            with pytest.raises(ValueError, match=match):
                ctx.draft_chain(batch, *args, feed_states=True)
        assert batch.n_rows == 5 and ctx.memory.pos_max(0) == -1  # nothing was decoded
    finally:
        batch.close()
    # states are read from the output rows' embeddings: a context that keeps none cannot feed them
    plain = draft_model_engine.drafter.ctx
    batch = Batch(plain)
    try:
        batch.add_tokens([5], [0], outputs=True)
        with pytest.raises(ValueError, match="masked=True"):
            plain.draft_chain(batch, [0], [1], [3], feed_states=True)
    finally:
        batch.close()


def test_a_decode_failing_in_the_middle_of_the_chain_raises_and_leaves_the_context_usable(eagle3_engine):
    ctx = eagle3_engine.drafter.ctx
    batch = Batch(ctx)
    try:
        # the n-th abort check lands in a later decode of the chain for some n: find one (the first
        # decode's rows are then in the cache, the chain's last ones are not)
        for n_checks in range(8, 2000, 8):
            for seq in (0, 1):
                ctx.memory.remove(seq, -1, -1)
            _seed(batch, np.random.default_rng(1), ctx.model.n_embd, True, SEEDS)
            _native.abort_after(n_checks)
            try:
                with pytest.raises(DecodeError, match="draft"):
                    ctx.draft_chain(batch, [0, 1], [3, 6], [6, 6], feed_states=True)
            finally:
                _native.abort_after(0)
            assert batch.n_rows == 0 and batch.n_outputs == 0  # cleared, whatever ended the chain
            if ctx.memory.pos_max(0) >= 3:  # the seed (0..2) and at least one drafted row went in
                break
        else:
            pytest.fail("no abort landed after the chain's first decode")
    finally:
        batch.close()
    # the engine drafts and answers as before
    with ps.load(eagle3_engine.model.path, spec_type="none", **TINY_ENGINE) as plain:
        want = plain.generate("Describe the picture now", max_tokens=16).tokens
    assert eagle3_engine.generate("Describe the picture now", max_tokens=16).tokens == want
