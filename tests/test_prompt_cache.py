"""The prompt cache in host memory (llama-server's --cache-ram; serving/prompt_cache.py), as users
meet it: conversations that take turns on fewer slots than there are conversations, through the
Python API and `serve`; checked against the same requests on an engine without it."""

from __future__ import annotations

import logging

import pytest
from conftest import N_THREADS

import pyllama_spec as ps
from pyllama_spec.devtools import tiny

#: Conversations that share nothing, long enough that a reprocessed prompt shows.
CODE = ("def parse(lines):\n    out = []\n    for line in lines:\n        if line.startswith('#'):\n"
        "            continue\n        out.append(line.split(','))\n    return out\n\n")
OTHER = "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
THIRD = "import os\nimport sys\n\n\ndef main(argv):\n    for name in sorted(os.listdir(argv[1])):\n"


@pytest.fixture(scope="module")
def pair():
    return ps.embedded_models()


def _load(pair, **kw):
    return ps.load(pair.target, mmproj=pair.mmproj, draft=pair.draft, n_threads=N_THREADS, **kw)


def test_a_conversation_taken_up_again_after_another_reuses_its_prompt_image_and_all(pair):
    image = tiny.draw_demo_image(224)
    runs = {}
    for mib in (0, 64):
        with _load(pair, cache_ram_mib=mib) as engine:
            first = engine.generate(CODE * 3, images=[image], max_tokens=24)
            other = engine.generate(OTHER, max_tokens=24)
            again = engine.generate(CODE * 3, images=[image], max_tokens=24)
            runs[mib] = first, other, again
    (first, other, again), (c_first, c_other, c_again) = runs[0], runs[64]
    # the same text with the cache as without (the restored slot's drafter starts afresh: lossless)
    assert [r.tokens for r in runs[0]] == [r.tokens for r in runs[64]]
    assert again.stats.prompt_reused == 0  # one slot, another conversation in between: all decoded again
    # with the cache, all but the last prompt token (decoded again for its logits), image rows too
    assert c_again.stats.prompt_reused == c_first.stats.prompt_tokens - 1
    assert c_again.stats.prompt_decoded == 1


def test_the_oldest_saved_conversations_go_first_when_the_cache_is_full(pair, caplog):
    # ~540 bytes a cache row on the embedded target: 1 MiB holds two conversations of ~800 rows, not three
    conversations = [CODE * 5, OTHER * 10, THIRD * 8]
    with _load(pair, cache_ram_mib=1) as engine:
        rows = []
        for text in conversations:
            rows.append(engine.generate(text, max_tokens=8).stats.prompt_tokens + 8)
        seq = engine.sequences[0]
        per_row = seq.ctx.memory.seq_size(0) / seq.positions.n_rows
        assert (rows[0] + rows[1]) * per_row < 2**20 < sum(rows) * per_row  # the premise
        # The cache holds the first two (the third is in the slot); the fourth request, the second
        # conversation again, restores it, putting the third in the cache and dropping the first.
        assert engine.generate(conversations[1], max_tokens=8).stats.prompt_reused >= rows[1] - 9
        assert engine.generate(conversations[0], max_tokens=8).stats.prompt_reused == 0
        # a conversation larger than the whole cache is not saved, and says so
        with caplog.at_level(logging.WARNING, logger="pyllama_spec.prompt_cache"):
            engine.generate(CODE * 14, max_tokens=8)
            engine.generate(OTHER, max_tokens=8)
        assert "more than the cache's 1 MiB: not saved" in caplog.text
        assert engine.generate(CODE * 14, max_tokens=8).stats.prompt_reused == 0


def test_a_new_conversation_takes_the_least_recently_used_slot_not_one_that_shares_a_token(pair):
    """llama-server's choice: the slot whose cache holds more than a tenth of the prompt, else the
    least recently used; before, a slot sharing one token beat an empty one."""
    with _load(pair, n_parallel=2) as engine:
        first = engine.submit(CODE * 2, max_tokens=8)
        first.result()
        other = engine.submit("def " + OTHER, max_tokens=8)  # shares "def" with the first: under a tenth
        other.result()
        assert other.slot != first.slot
        back = engine.submit(CODE * 2 + "def main():\n", max_tokens=8)
        assert back.result().stats.prompt_reused > 0 and back.slot == first.slot


def test_any_saved_conversation_comes_back_not_only_the_oldest(pair):
    """A, B, C, then B and A again on one slot: each restored from wherever it sits in the cache
    (restoring one that was not the oldest once failed the request)."""
    conversations = [CODE * 3, OTHER * 3, THIRD * 3]
    with _load(pair, cache_ram_mib=64) as engine:
        first = [engine.generate(text, max_tokens=8) for text in conversations]
        for k in (1, 0, 2):
            again = engine.generate(conversations[k], max_tokens=8)
            assert again.stats.prompt_reused == first[k].stats.prompt_tokens - 1, k
            assert again.tokens == first[k].tokens


def test_a_request_that_names_its_slot_goes_through_the_cache_too(pair):
    """llama-server's rule: a named slot holding another conversation is saved before it is
    overwritten, and the named request's own saved prompt put back."""
    with _load(pair, n_parallel=2, cache_ram_mib=64, cache_idle_slots=False) as engine:
        first = engine.submit(CODE * 3, max_tokens=8, id_slot=0).result()
        engine.submit(OTHER * 3, max_tokens=8, id_slot=0).result()
        again = engine.submit(CODE * 3, max_tokens=8, id_slot=0).result()
        assert again.stats.prompt_reused == first.stats.prompt_tokens - 1


def test_idle_slots_are_copied_into_the_cache_when_a_request_starts(pair, caplog):
    for idle in (True, False):
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="pyllama_spec.prompt_cache"):
            with _load(pair, n_parallel=2, cache_ram_mib=64, cache_idle_slots=idle) as engine:
                first = engine.submit(CODE * 3, max_tokens=8)
                first.result()
                engine.submit(OTHER * 3, max_tokens=8).result()  # the other slot; the first's is idle
                engine.submit(OTHER * 3 + "x = 1\n", max_tokens=8).result()  # the first's held already
        copies = [r.getMessage() for r in caplog.records if "saved idle slot" in r.getMessage()]
        assert copies == ([f"slot {first.slot}: saved idle slot to the prompt cache "
                           "(__TEST_TAG_CACHE_IDLE_SLOT__)"] if idle else [])


def test_a_cache_fault_costs_the_request_its_reuse_not_its_answer(pair, monkeypatch, caplog):
    from pyllama_spec.serving.prompt_cache import PromptCache

    with _load(pair, cache_ram_mib=64) as engine:
        expected = engine.generate(CODE * 3, max_tokens=8).tokens
        engine.generate(OTHER, max_tokens=8)

        def broken(*args, **kwargs):
            raise RuntimeError("a fault in the cache")

        monkeypatch.setattr(PromptCache, "best_for", broken)
        with caplog.at_level(logging.ERROR, logger="pyllama_spec.prompt_cache"):
            again = engine.generate(CODE * 3, max_tokens=8)
        assert again.tokens == expected and again.stats.prompt_reused == 0
        assert "prompt cache: failed on slot 0; the slot starts empty" in caplog.text


def test_closing_the_engine_gives_the_cache_back(pair):
    engine = _load(pair, cache_ram_mib=64)
    engine.generate(CODE * 3, max_tokens=8)
    engine.generate(OTHER, max_tokens=8)
    cache = engine._loop._prompt_cache
    assert cache.size > 0 and len(cache.entries) == 1
    engine.close()
    assert cache.size == 0 and not cache.entries


def test_cache_ram_is_checked_at_load(pair):
    with pytest.raises(ValueError, match="cache_ram_mib must be an integer >= -1"):
        _load(pair, cache_ram_mib=-2)


def test_serve_keeps_conversations_in_host_memory_by_default_as_llama_server(pair):
    """`serve` with llama-server's default --cache-ram (8192 MiB) on one slot: a chat taken up again
    after another answers from its cached prompt (timings.cache_n); --cache-ram 0 turns it off."""
    from serving import cli_server, http

    def chat(base, text):
        status, body = http(base, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0})
        assert status == 200, body
        return body

    cached = {}
    for flags in ((), ("--cache-ram", "0")):
        with cli_server("-t", str(N_THREADS), *flags) as base:
            first = chat(base, CODE * 3)
            chat(base, OTHER)
            again = chat(base, CODE * 3)
            assert again["choices"][0]["message"] == first["choices"][0]["message"]
            cached[flags] = (first["timings"]["prompt_n"], again["timings"]["cache_n"])
    prompt_n, cache_n = cached[()]
    assert cache_n == prompt_n - 1  # all but the last prompt token, decoded again for its logits
    assert cached[("--cache-ram", "0")][1] < prompt_n / 10  # only the chat template's opening, shared by both


def test_reset_cache_forgets_the_saved_conversations_too(pair):
    with _load(pair, cache_ram_mib=64) as engine:
        engine.generate(CODE * 3, max_tokens=8)
        engine.generate(OTHER, max_tokens=8)  # CODE's cache goes to host memory
        engine.reset_cache()
        assert engine.generate(CODE * 3, max_tokens=8).stats.prompt_reused == 0


def test_a_hybrid_target_takes_back_a_conversation_that_goes_on(tiny_hybrid, caplog):
    """A recurrent state cannot be cut back: a saved conversation is put back when the prompt goes
    on from all of it (the next turn of a chat), never to be cut and thrown away."""
    from conftest import load_tiny

    with load_tiny(tiny_hybrid, draft=None, cache_ram_mib=64) as engine:
        first = engine.generate(CODE * 2, max_tokens=8)
        engine.generate(OTHER, max_tokens=8)
        with caplog.at_level(logging.DEBUG, logger="pyllama_spec.prompt_cache"):
            same = engine.generate(CODE * 2, max_tokens=8)  # would need the entry cut back: not loaded
        assert same.stats.prompt_reused == 0 and same.tokens == first.tokens
        assert "restored" not in caplog.text  # (restored, it would have been reset at once, and lost)
        engine.generate(OTHER, max_tokens=8)
        # the next turn: the prompt, the answer (as tokens: this toy writes bytes of no text), more
        go_on = engine.generate([CODE * 2, *same.tokens, "\ndef main():\n"], max_tokens=8)
        assert go_on.stats.prompt_reused >= first.stats.prompt_tokens


def test_with_one_pool_of_cells_the_idle_slots_give_theirs_up_before_a_saved_prompt_comes_back(pair, monkeypatch):
    """llama.cpp reads every cell up to the last one used: a saved prompt put back while the idle slots
    still held their rows went above them and stayed there once they were emptied, and every later
    decode of that answer read the whole span (1.5x the target's step on the embedded pair)."""
    from pyllama_spec.serving.prompt_cache import PromptCache

    held_at_restore = []
    load = PromptCache.load

    def recording(self, seq, entry):
        others = [s for s in engine.sequences if s is not seq]
        held_at_restore.append(sum(s.positions.n_rows for s in others))
        return load(self, seq, entry)

    monkeypatch.setattr(PromptCache, "load", recording)
    conversations = [CODE * 3, OTHER * 3, THIRD * 3]
    with _load(pair, n_parallel=2, kv_unified=True, cache_ram_mib=64, cache_idle_slots=True) as engine:
        first = [engine.generate(text, max_tokens=8) for text in conversations]
        again = [engine.generate(text, max_tokens=8) for text in conversations]
    assert [r.tokens for r in again] == [r.tokens for r in first]
    assert held_at_restore and held_at_restore == [0] * len(held_at_restore)
    assert all(r.stats.prompt_reused == f.stats.prompt_tokens - 1 for r, f in zip(again, first))


@pytest.mark.parametrize("kv_unified", [False, True])
def test_saving_the_idle_slots_never_drops_the_prompt_a_request_is_taking_back(pair, kv_unified):
    """llama-server's order: the saved prompt a request takes is chosen (and leaves the cache) before
    the idle slots are copied in, so their copies cannot push it out of a full cache."""
    with _load(pair, n_parallel=2, kv_unified=kv_unified, cache_ram_mib=1, cache_idle_slots=True) as engine:
        first = engine.generate(CODE * 5, max_tokens=8)  # slot 0
        engine.generate(OTHER * 10, max_tokens=8)  # slot 1; slot 0 copied as idle
        engine.generate(THIRD * 8, max_tokens=8)  # slot 0; slot 1 copied: the cache holds CODE and OTHER
        again = engine.generate(CODE * 5, max_tokens=8)  # slot 1, the least recently used
        assert again.stats.prompt_reused == first.stats.prompt_tokens - 1
        assert again.tokens == first.tokens
