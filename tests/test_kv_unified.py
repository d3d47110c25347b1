"""One pool of cache cells for every slot (llama-server's --kv-unified; serving/slot_loop.py's
shared cells), through the Python API as a server drives it: prompts past a slot's share, idle
slots giving their cells up, answers that outgrow the pool, prompts that hold it between them.
Every answer is checked against the same request alone on a one-slot engine of the same n_ctx."""

from __future__ import annotations

import pytest
# the conversations, and the embedded pair's fixture and loader, of the prompt cache's tests
from test_prompt_cache import CODE, OTHER, _load, pair  # noqa: F401 - pair is a fixture

import pyllama_spec as ps
from pyllama_spec.devtools import tiny


def _alone(pair, prompt, n_ctx, max_tokens):
    with _load(pair, n_ctx=n_ctx) as engine:
        return engine.generate(prompt, max_tokens=max_tokens)


def test_a_prompt_past_its_slots_share_fits_the_shared_pool(pair):
    prompt = CODE * 5  # ~770 rows: past 1024 / 2
    with _load(pair, n_ctx=1024, n_parallel=2) as engine:
        with pytest.raises(ps.ContextOverflowError):
            engine.submit(prompt, max_tokens=8).result()
    with _load(pair, n_ctx=1024, n_parallel=2, kv_unified=True) as engine:
        got = engine.submit(prompt, max_tokens=8).result()
    assert got.tokens == _alone(pair, prompt, 1024, 8).tokens


def test_idle_slots_give_up_their_cells_saved_to_the_prompt_cache_when_there_is_one(pair):
    for mib in (0, 64):
        with _load(pair, n_ctx=1024, n_parallel=2, kv_unified=True, cache_ram_mib=mib,
                   cache_idle_slots=False) as engine:
            first = engine.submit(CODE * 2, max_tokens=8)  # ~310 rows, then idle in its slot
            first.result()
            big = engine.submit(OTHER * 9, max_tokens=8)  # ~790 rows: more than the pool has free
            assert big.result().tokens == _alone(pair, OTHER * 9, 1024, 8).tokens
            assert engine.sequences[first.slot].positions.n_rows == 0  # its cells went to the other
            again = engine.submit(CODE * 2, max_tokens=8).result()
            assert again.tokens == first.result().tokens
            reused = again.stats.prompt_reused
            assert (reused == first.result().stats.prompt_tokens - 1) if mib else reused < 10


def test_answers_that_outgrow_the_pool_fail_one_the_one_holding_most_and_the_others_go_on(pair):
    """Two answers of 300 tokens after ~150-row prompts in a 512-cell pool: when the pool is
    full the slot holding the most fails as llama-server's do ("Context size has been exceeded";
    llama-server fails every slot), and the other, given its cells, writes its whole answer."""
    prompts = [CODE, OTHER * 2]
    with _load(pair, n_ctx=512, n_parallel=2, kv_unified=True) as engine:
        subs = [engine.submit(p, max_tokens=300) for p in prompts]
        outcomes = []
        for sub in subs:
            try:
                outcomes.append(sub.result())
            except ps.ContextFullError as e:
                assert "Context size has been exceeded" in str(e)
                outcomes.append(None)
    alone = [_alone(pair, p, 512, 300) for p in prompts]
    assert all(len(a.tokens) == 300 for a in alone)  # the premise: alone, each fits
    assert sorted(o is None for o in outcomes) == [False, True]
    assert [o.tokens for o in outcomes if o] == [a.tokens for o, a in zip(outcomes, alone) if o]


def test_prompts_read_at_once_that_hold_the_pool_between_them_all_answer(pair):
    """Two ~600-row prompts read in slices at once into a 1024-cell pool: when neither can go
    on, one gives its rows back and reads its prompt again once the other has answered, and
    the other, answering, is not cut short for the cells of a prompt being read."""
    prompts = [CODE * 4, OTHER * 7]
    with _load(pair, n_ctx=1024, n_parallel=2, kv_unified=True, n_batch=64, n_ubatch=64) as engine:
        got = [s.result() for s in [engine.submit(p, max_tokens=300) for p in prompts]]
    assert [g.tokens for g in got] == [_alone(pair, p, 1024, 300).tokens for p in prompts]
    assert all(600 < g.stats.prompt_tokens < 1024 - 300 for g in got)  # the premise: both did not fit at once


def test_an_image_read_in_slices_holds_its_cells_from_its_first_slice(pair):
    """A 576-row image read in 64-row slices beside a long answer: the rows of its slices count
    from the first (they are in the cache before the image's positions move), so it waits for
    cells instead of failing the decode."""
    from pyllama_spec import MEDIA_MARKER

    image = tiny.draw_demo_image(672)
    with _load(pair, n_ctx=1024, n_parallel=2, kv_unified=True, n_batch=64, n_ubatch=64) as engine:
        answer = engine.submit(OTHER * 5, max_tokens=500)
        pieces = iter(answer)
        next(pieces)  # it decodes
        picture = engine.submit(f"Describe {MEDIA_MARKER} now", images=[image], max_tokens=4)
        for _ in pieces:
            pass
        assert picture.result().stats.prompt_tokens > 576
        assert len(answer.result().tokens) == 500


def test_a_slot_taken_by_a_new_prompt_gives_up_its_old_rows_at_once(pair):
    """A slot holding an old conversation, taken by a short prompt while another slot answers:
    its old rows are dropped when it is taken (not at its first slice), so the answer beside it
    is not cut short for cells the new prompt does not keep."""
    with _load(pair, n_ctx=512, n_parallel=2, kv_unified=True) as engine:
        engine.submit(CODE * 2, max_tokens=1).result()  # ~310 rows, idle in its slot
        answer = engine.submit(OTHER, max_tokens=300)
        pieces = iter(answer)
        next(pieces)
        short = engine.submit("x = 1\n" * 20, max_tokens=4)
        for _ in pieces:
            pass
        assert len(short.result().tokens) == 4
        assert answer.result().tokens == _alone(pair, OTHER, 512, 300).tokens
