"""Several requests at once (n_parallel slots, serving/slot_loop.py), as users run them: from threads and
through submit(), checked against the same requests run one at a time."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import N_THREADS, TINY_ENGINE, load_tiny

import pyllama_spec as ps
from pyllama_spec.devtools import tiny

PROMPTS = ["def f", "class Foo:", "import os\n", "The cat"]


@pytest.fixture(scope="module")
def pair():
    return ps.embedded_models()


@pytest.fixture(scope="module")
def sequential(pair):
    """Every prompt's greedy answer from a one-slot engine (with the demo image on the last two)."""
    image = tiny.draw_demo_image(224)
    with ps.load(pair.target, mmproj=pair.mmproj, draft=pair.draft, n_threads=N_THREADS) as engine:
        return image, [engine.generate(p, images=[image] if i >= 2 else [], max_tokens=48).tokens
                       for i, p in enumerate(PROMPTS)]


def test_concurrent_requests_equal_their_sequential_answers(pair, sequential):
    image, expected = sequential
    with ps.load(pair.target, mmproj=pair.mmproj, draft=pair.draft, n_threads=N_THREADS, n_parallel=4) as engine:
        subs = [engine.submit(p, images=[image] if i >= 2 else [], max_tokens=48) for i, p in enumerate(PROMPTS)]
        got = [s.result() for s in subs]
        shared = {n: c for n, c in engine.scheduler.slots_per_step.items() if n > 1}
    assert [r.tokens for r in got] == expected
    assert shared, "no step verified more than one slot"
    assert all(r.stats.drafted > 0 for r in got)


def test_threads_calling_generate_run_concurrently_and_losslessly(pair, sequential):
    image, expected = sequential
    out: dict[int, list[int]] = {}
    with ps.load(pair.target, mmproj=pair.mmproj, draft=pair.draft, n_threads=N_THREADS, n_parallel=2) as engine:
        def run(i):
            out[i] = engine.generate(PROMPTS[i], images=[image] if i >= 2 else [], max_tokens=48).tokens

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert [out[i] for i in range(len(PROMPTS))] == expected


def test_a_cancelled_request_frees_its_slot_and_the_others_are_unchanged(pair, sequential):
    _, expected = sequential
    with ps.load(pair.target, mmproj=pair.mmproj, draft=pair.draft, n_threads=N_THREADS, n_parallel=2) as engine:
        long = engine.submit(PROMPTS[0], max_tokens=2000)
        first = next(iter(long))
        assert first.tokens
        other = engine.submit(PROMPTS[1], max_tokens=48)
        long.cancel()
        with pytest.raises(ps.GenerationCancelledError):
            for _ in long:
                pass
        assert other.result().tokens == expected[1]
        # the cancelled slot's cache stayed consistent: the same prompt again gives its answer
        assert engine.generate(PROMPTS[0], max_tokens=48).tokens == expected[0]
        never = engine.stream(PROMPTS[2], max_tokens=8)  # never iterated: takes no slot
        assert engine.scheduler.n_active == 0 and engine.scheduler.n_pending == 0
        never.close()


def test_slots_refuse_what_they_cannot_hold(pair):
    with ps.load(pair.target, n_threads=N_THREADS) as engine:
        with pytest.raises(ValueError, match="n_parallel > 1"):
            engine.submit("hi")
    with pytest.raises(ValueError, match="cannot exceed n_batch"):
        ps.load(pair.target, n_threads=N_THREADS, n_parallel=8, n_batch=4, n_ubatch=4)
    with ps.load(pair.target, n_threads=N_THREADS, n_parallel=4, n_ctx=1024) as engine:
        share = engine.ctx.n_ctx_seq
        with pytest.raises(ps.ContextOverflowError, match=f"each of the 4 slots has {share}"):
            engine.generate("word " * share, max_tokens=4)
        assert engine.generate("def f", max_tokens=4).tokens  # still usable


def test_a_request_cancelled_inside_its_image_prefill_leaves_its_slot_consistent(pair):
    """Cancelled between two slices of its image (small batches: the image takes several), beside a
    decoding request: its partial image rows are removed, the slot keeps only the text before the
    image, the same request later gives its full answer, and the request beside it is unchanged."""
    image = tiny.draw_demo_image(224)
    with ps.load(pair.target, mmproj=pair.mmproj, draft=pair.draft, n_threads=N_THREADS, n_parallel=2,
                 n_batch=16, n_ubatch=16) as engine:
        with_image = engine.generate(PROMPTS[2], images=[image], max_tokens=24).tokens
        beside = engine.generate(PROMPTS[1], max_tokens=64).tokens
        engine.reset_cache()

        seen, handed_out = [], threading.Event()

        def progress(stage, done, total):  # on the scheduler thread
            handed_out.wait(10)  # `victim` is assigned
            seen.append(stage)
            if seen.count("prefill") >= 2 and "encode" in seen:
                victim.cancel()  # between two slices of the image's rows

        other = engine.submit(PROMPTS[1], max_tokens=64)
        victim = engine.submit(PROMPTS[2], images=[image], max_tokens=24, progress=progress)
        handed_out.set()
        with pytest.raises(ps.GenerationCancelledError):
            victim.result()
        seq = engine.sequences[victim.slot]
        assert seen.count("encode") == 1 and seen[-1] == "prefill"  # it stopped inside the image
        assert all(isinstance(part, np.ndarray) for part in seq.cached)  # no media: its rows were cut
        assert seq.positions.n_rows == sum(len(part) for part in seq.cached)
        assert other.result().tokens == beside
        # in its own slot (the text kept is under a tenth of the prompt: without id_slot the least
        # recently used slot, the other's, would take it)
        again = engine.submit(PROMPTS[2], images=[image], max_tokens=24, id_slot=victim.slot).result()
        assert again.tokens == with_image
        assert again.stats.prompt_reused > 0  # the text before the image was kept


def test_requests_that_arrive_together_start_decoding_together(pair, sequential):
    """Prompts waiting at the same turn are all prefilled in that turn (n_batch rows of budget),
    so they get their first tokens before the same step, and share every step after it."""
    _, expected = sequential
    with ps.load(pair.target, draft=pair.draft, n_threads=N_THREADS, n_parallel=4) as engine:
        held, go = threading.Event(), threading.Event()
        first_at: dict[int, int] = {}  # request -> scheduler steps run when its first token came
        pieces: dict[int, list] = {i: [] for i in range(3)}

        def hold(stage, n, total):  # on the scheduler thread, inside the first request's prefill
            held.set()
            go.wait(10)

        def events(i):
            def on_event(kind, value):  # on the scheduler thread
                if kind == "piece":
                    first_at.setdefault(i, engine.scheduler.steps)
                    pieces[i].append(value)
            return on_event

        first = engine.submit(PROMPTS[0], max_tokens=48, progress=hold)
        assert held.wait(10)
        others = [engine.submit(p, max_tokens=48, on_event=events(i)) for i, p in enumerate(PROMPTS[1:])]
        go.set()
        head = first.result()
        assert all(s.finished.wait(60) for s in others)
    assert head.tokens == expected[0]
    assert ps.Result.from_pieces(pieces[0]).tokens == expected[1]
    assert len(set(first_at.values())) == 1, first_at  # all three started in one turn


def test_an_action_on_a_busy_slot_returns_its_future_at_once_when_the_loop_has_its_thread(pair):
    """With the loop's own thread (n_parallel > 1, or a server), run_on_slot hands back the Future at
    once and the action runs when the slot frees: a server calls it on its event loop, which must not
    wait for another request's generation."""
    with ps.load(pair.target, draft=pair.draft, n_threads=N_THREADS, n_parallel=2) as engine:
        held, go = threading.Event(), threading.Event()

        def hold(stage, n, total):  # on the loop's thread, inside the request's prefill: slot 0 busy
            held.set()
            go.wait(10)  # (were run_on_slot to wait for the slot, it would return after this)

        busy = engine.submit(PROMPTS[0], max_tokens=8, progress=hold, id_slot=0)
        assert held.wait(30)
        action = engine.run_on_slot(0, lambda seq: seq.positions.n_rows)
        done_on_return = action.done()
        go.set()
        answer = busy.result()
        assert not done_on_return
        assert action.result(30) == answer.stats.prompt_tokens + len(answer.tokens) - 1


def test_other_slots_keep_decoding_while_an_image_is_encoded(tiny_dense):
    """A big image's encode runs on the encoder thread: the slot beside it streams tokens during
    the encode (with the encode inline it would stream none), and both answers stay exact."""
    side = 1344
    img = (np.random.default_rng(0).random((side, side, 3)) * 255).astype(np.uint8)
    prompt = f"Look: {ps.MEDIA_MARKER} and say"
    kw = dict(mmproj=tiny_dense.mmproj, draft=tiny_dense.draft, **TINY_ENGINE, draft_max=7)
    with ps.load(tiny_dense.target, n_ctx=8192, **kw) as one:
        expected_image = one.generate(prompt, images=[img], max_tokens=8).tokens
        expected_text = one.generate("Tell me", max_tokens=1500).tokens
    with ps.load(tiny_dense.target, n_ctx=2 * 8192, n_parallel=2, **kw) as engine:
        arrivals, phases, pieces = [], [], []

        def on_event(kind, value):
            if kind == "piece":
                arrivals.append(time.perf_counter())
                pieces.append(value)

        text = engine.submit("Tell me", max_tokens=1500, on_event=on_event)
        while not arrivals:
            time.sleep(0.001)
        image = engine.submit(prompt, images=[img], max_tokens=8,
                              progress=lambda stage, d, t: phases.append((stage, time.perf_counter())))
        got_image = image.result().tokens
        assert text.finished.wait(120)
    start = next(t for stage, t in phases if stage == "encode")
    end = next(t for stage, t in phases if stage == "prefill" and t > start)  # its first slice: encoded
    during = [t for t in arrivals if start < t < end]
    assert end - start > 0.05  # a real encode, long enough to see
    assert len(during) >= 3, (len(during), end - start)
    assert got_image == expected_image
    assert ps.Result.from_pieces(pieces).tokens == expected_text


def test_a_request_cancelled_while_its_image_is_encoded_ends_cleanly(tiny_dense):
    img = (np.random.default_rng(1).random((1344, 1344, 3)) * 255).astype(np.uint8)
    with load_tiny(tiny_dense, n_ctx=2 * 8192, draft_max=7, n_parallel=2) as engine:
        encoding = threading.Event()
        sub = engine.submit(f"Look: {ps.MEDIA_MARKER} and say", images=[img], max_tokens=8,
                            progress=lambda stage, d, t: encoding.set() if stage == "encode" else None)
        assert encoding.wait(30)
        sub.cancel()  # while the encoder thread holds its chunk
        with pytest.raises(ps.GenerationCancelledError):
            sub.result()
        assert engine.scheduler.n_active == 0
        assert engine.sequences[sub.slot].positions.n_rows == sum(
            len(p) for p in engine.sequences[sub.slot].cached)  # only whole text parts
        assert engine.generate("Tell me", max_tokens=8).tokens  # the engine goes on


def test_a_submissions_result_can_be_asked_for_again_and_after_reading_its_pieces(pair, sequential):
    _, expected = sequential
    with ps.load(pair.target, mmproj=pair.mmproj, draft=pair.draft, n_threads=N_THREADS, n_parallel=2) as engine:
        first, second = engine.submit(PROMPTS[0], max_tokens=48), engine.submit(PROMPTS[1], max_tokens=48)
        assert first.result().tokens == expected[0]
        assert first.result().tokens == expected[0]  # it waited forever: the pieces were consumed
        head = next(iter(second))  # a piece read by the caller is still part of the result
        assert head.tokens and second.result().tokens == expected[1]
        assert [t for piece in second for t in piece.tokens] == expected[1]  # and iterating replays it
        cancelled = engine.submit(PROMPTS[0], max_tokens=400)
        cancelled.cancel()
        for _ in range(2):
            with pytest.raises(ps.GenerationCancelledError):
                cancelled.result()
