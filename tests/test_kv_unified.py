"""One pool of cache cells for every slot (llama-server's --kv-unified; serving/slot_loop.py's
shared cells), through the Python API as a server drives it: prompts past a slot's share, idle
slots giving their cells up, answers that outgrow the pool, prompts that hold it between them.
Every answer is checked against the same request alone on a one-slot engine of the same n_ctx."""

from __future__ import annotations

import pytest
from conftest import N_THREADS

import pyllama_spec as ps

CODE = ("def parse(lines):\n    out = []\n    for line in lines:\n        if line.startswith('#'):\n"
        "            continue\n        out.append(line.split(','))\n    return out\n\n")
OTHER = "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"


@pytest.fixture(scope="module")
def pair():
    return ps.embedded_models()


def _load(pair, **kw):
    return ps.load(pair.target, mmproj=pair.mmproj, draft=pair.draft, n_threads=N_THREADS, **kw)


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


def test_answers_that_outgrow_the_pool_end_as_at_the_end_of_a_context_and_the_others_go_on(pair):
    """Two answers of 300 tokens after ~150-row prompts in a 512-cell pool: when the pool is
    full the slot holding the most ends (finish_reason "length"), the other writes on; each
    answer is the start of its answer alone."""
    prompts = [CODE, OTHER * 2]
    with _load(pair, n_ctx=512, n_parallel=2, kv_unified=True) as engine:
        got = [s.result() for s in [engine.submit(p, max_tokens=300) for p in prompts]]
    alone = [_alone(pair, p, 512, 300) for p in prompts]
    assert all(len(a.tokens) == 300 for a in alone)  # the premise: alone, each fits
    # the one holding the most when the pool filled ends short; the other, given its cells, runs on
    assert sorted(len(g.tokens) < 300 for g in got) == [False, True], [len(g.tokens) for g in got]
    assert all(g.finish_reason == "length" for g in got)
    for g, a in zip(got, alone):
        assert g.tokens == a.tokens[:len(g.tokens)]


def test_prompts_read_at_once_that_hold_the_pool_between_them_all_answer(pair):
    """Two ~600-row prompts read in slices at once into a 1024-cell pool: when neither can go
    on, one gives its rows back and reads its prompt again once the other has answered."""
    prompts = [CODE * 4, OTHER * 7]
    with _load(pair, n_ctx=1024, n_parallel=2, kv_unified=True, n_batch=64, n_ubatch=64) as engine:
        got = [s.result() for s in [engine.submit(p, max_tokens=16) for p in prompts]]
    assert [g.tokens for g in got] == [_alone(pair, p, 1024, 16).tokens for p in prompts]
    assert all(600 < g.stats.prompt_tokens < 1024 - 16 for g in got)  # the premise: both did not fit at once
