"""The engine used the way programs use a library: the public API, threads, interleaved
streams, cache identity, bad arguments, native failures in the middle of a step.

Each test here failed on the code before issue 11's fixes (see the issue for the symptoms).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import N_THREADS

import pyllama_spec as ps

PROMPT = f"Describe this: {ps.MEDIA_MARKER} in a few words."


def make_engine(models, *, spec_type="dflash", batch=64, ubatch=64, draft_max=7, n_ctx=2048, **kw):
    return ps.load(models.target, mmproj=models.mmproj, draft=models.draft if spec_type != "none" else None,
                   spec_type=spec_type, n_ctx=n_ctx, n_batch=batch, n_ubatch=ubatch, n_threads=N_THREADS,
                   draft_max=draft_max, flash_attn=False, **kw)


def consistent(engine) -> bool:
    """Target and draft memories end exactly where the engine's positions say the sequence ends."""
    p = engine.positions
    target_ok = engine.ctx.memory.pos_max() == p.pos_next - 1
    draft_ok = engine.drafter is None or engine.drafter.ctx.memory.pos_max() <= p.draft_pos_next - 1
    return target_ok and draft_ok


# --------------------------------------------------------------------------- the public API


def test_the_documented_names_are_importable_from_the_package():
    for name in ("load", "Engine", "EngineConfig", "Result", "Piece", "GenerationStats", "Conversation",
                 "MEDIA_MARKER", "PyllamaError", "ModelFileError", "DecodeError", "ContextOverflowError",
                 "IncompatibleModelsError", "ImageError", "ProjectorError", "ClosedError", "KVMemoryError",
                 "EngineBusyError", "GenerationCancelledError", "Model", "Context", "Batch", "Projector",
                 "Bitmap", "Chunks", "Submission"):
        assert getattr(ps, name) is not None, name
    assert set(ps.__all__) <= set(dir(ps))
    from pyllama_spec.serving.engine import load

    assert ps.load is load


# --------------------------------------------------------------------------- threads


def test_four_threads_sharing_one_engine_get_the_answers_they_would_get_alone(tiny_dense, big_image):
    prompts = [("Hello there", None), (PROMPT, big_image), ("Tell me about cats", None), ("Dogs?", None)]
    with make_engine(tiny_dense) as engine:
        def run(prompt, image):
            return engine.generate(prompt, images=[image] if image is not None else [], max_tokens=24).tokens

        expected = [run(p, im) for p, im in prompts]
        results: dict[int, list[int]] = {}
        errors: list[BaseException] = []

        def worker(i):
            try:
                for _ in range(3):
                    p, im = prompts[(i + _) % 4]
                    results[(i, _)] = (run(p, im), (i + _) % 4)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a generation hung"
        assert not errors, errors
        assert len(results) == 12
        for tokens, which in results.values():
            assert tokens == expected[which]
        assert consistent(engine)


def test_close_from_another_thread_waits_for_the_running_step(tiny_dense):
    engine = make_engine(tiny_dense)
    stream = engine.stream("Hello there", max_tokens=200)
    next(stream)
    closer = threading.Thread(target=engine.close)
    closer.start()
    closer.join(timeout=30)
    assert not closer.is_alive()
    with pytest.raises((ps.ClosedError, ps.GenerationCancelledError)):
        next(stream)


# --------------------------------------------------------------------------- interleaved streams


def test_a_second_stream_cancels_a_suspended_one_instead_of_corrupting_it(tiny_dense):
    with make_engine(tiny_dense) as engine:
        alone = engine.generate("Tell me about cats", max_tokens=24).tokens
        engine.reset_cache()
        first = engine.stream("Hello there", max_tokens=40)
        next(first)
        second = [t for piece in engine.stream("Tell me about cats", max_tokens=24) for t in piece.tokens]
        assert second == alone  # the newer generation is not disturbed by the suspended one
        with pytest.raises(ps.GenerationCancelledError, match="superseded"):
            next(first)
        assert consistent(engine)
        assert engine.generate("Tell me about cats", max_tokens=24).tokens == alone


def test_generate_inside_a_stream_loop_cancels_the_outer_stream(tiny_dense):
    with make_engine(tiny_dense) as engine:
        outer = engine.stream("Hello there", max_tokens=40)
        next(outer)
        inner = engine.generate("Tell me about cats", max_tokens=8)
        assert len(inner.tokens) == 8
        with pytest.raises(ps.GenerationCancelledError):
            next(outer)


def test_a_generation_started_from_a_progress_callback_is_refused(tiny_dense, big_image):
    with make_engine(tiny_dense) as engine:
        seen = []

        def progress(stage, done, total):
            if not seen:
                with pytest.raises(ps.EngineBusyError):
                    engine.generate("nested", max_tokens=2)
                seen.append(stage)

        engine.generate(PROMPT, images=[big_image], max_tokens=4, progress=progress)
        assert seen and consistent(engine)


def test_resuming_a_stream_after_close_raises_closed_error(tiny_dense):
    engine = make_engine(tiny_dense)
    stream = engine.stream("Hello there", max_tokens=40)
    next(stream)
    engine.close()
    with pytest.raises(ps.ClosedError):
        next(stream)
    with pytest.raises(ps.ClosedError):
        engine.generate("x", max_tokens=1)


# --------------------------------------------------------------------------- cache identity


def test_two_images_with_the_same_bytes_and_other_shapes_are_not_confused(tiny_dense):
    wide = np.full((112, 224, 3), 128, dtype=np.uint8)
    tall = np.full((224, 112, 3), 128, dtype=np.uint8)
    assert wide.tobytes() == tall.tobytes()
    with make_engine(tiny_dense, spec_type="none") as fresh:
        expected = fresh.generate(PROMPT, images=[tall], max_tokens=12)
    with make_engine(tiny_dense, spec_type="none") as engine:
        engine.generate(PROMPT, images=[wide], max_tokens=12)
        second = engine.generate(PROMPT, images=[tall], max_tokens=12)
        text_before_image = len(engine.model.tokenize(PROMPT.split(ps.MEDIA_MARKER)[0], add_special=True))
    # Only the text before the image (and mtmd's <|vision_start|>) was reused, no image row.
    assert second.stats.prompt_reused <= text_before_image + 1
    assert second.tokens == expected.tokens


# --------------------------------------------------------------------------- the pinned rule per chunk


def test_the_last_one_row_slice_of_an_image_is_not_injected(tiny_dense, big_image):
    # 576 image rows in slices of 115: the last slice holds one row. It belongs to a pinned
    # image, so it is skipped like the rest.
    with make_engine(tiny_dense, batch=115, ubatch=115) as engine:
        engine.drafter.trace = []
        result = engine.generate(PROMPT, images=[big_image], max_tokens=4)
        skipped = [e.n_rows for e in engine.drafter.trace if e.call == "skip"]
        assert sum(skipped) == 576 and skipped[-1] == 576 % 115 == 1
        first_block = next(e.pos for e in engine.drafter.trace if e.call == "draft")
        assert first_block == result.stats.prompt_positions
        injected = [e.pos for e in engine.drafter.trace if e.call == "inject"]
        assert engine.drafter.ctx.memory.pos_max() < result.stats.prompt_positions + 8
        assert injected


# --------------------------------------------------------------------------- arguments


def test_max_tokens_zero_fills_the_cache_and_generates_nothing(tiny_dense):
    with make_engine(tiny_dense) as engine:
        result = engine.generate("Hello there", max_tokens=0)
        assert result.tokens == [] and result.text == "" and result.finish_reason == "length"
        assert result.stats.prompt_tokens > 0 and consistent(engine)
        again = engine.generate("Hello there", max_tokens=4)
        assert again.stats.prompt_reused == result.stats.prompt_tokens - 1  # the prompt stayed cached


@pytest.mark.parametrize("bad", [-1, 2.5, "8", True])
def test_a_bad_max_tokens_is_refused_at_the_call(tiny_dense, bad):
    with make_engine(tiny_dense) as engine:
        with pytest.raises(ValueError, match="max_tokens"):
            engine.stream("Hello", max_tokens=bad)
        assert len(engine.generate("Hello", max_tokens=2).tokens) == 2


def test_a_batch_that_fails_half_way_through_an_add_is_left_empty_on_both_sides(tiny_dense, ctx_kwargs):
    with ps.Model(tiny_dense.target) as model:
        ctx = ps.Context(model, **ctx_kwargs)
        batch = ps.Batch(ctx)
        batch.add_tokens([1, 2], [0, 1])
        with pytest.raises(ps.NativeCallError, match="cleared"):
            batch.add_tokens([3, model.n_vocab + 5, 4], [2, 3, 4])
        assert batch.n_rows == 0
        batch.add_tokens([5, 6, 7], [0, 1, 2], outputs=True)
        ctx.decode(batch)
        # The native batch held only these three rows: nothing of the failed add was decoded.
        assert ctx.memory.pos_max() == 2 and ctx.last_decode_rows == 3
        batch.close()


# --------------------------------------------------------------------------- native faults mid-step


@pytest.mark.parametrize("which", ["dense", "hybrid"])
def test_a_decode_aborted_anywhere_leaves_the_engine_consistent_and_usable(which, tiny_dense, tiny_hybrid,
                                                                           big_image):
    from pyllama_spec._native import abort_after

    models = tiny_dense if which == "dense" else tiny_hybrid
    with make_engine(models, spec_type="none") as plain:
        expected = plain.generate(PROMPT, images=[big_image], max_tokens=16).tokens
    failures = 0
    with make_engine(models) as engine:
        # Abort checks run between graph nodes of every decode (target and draft, prompt,
        # image slices, draft blocks, verify batches): spread the fault over all of them.
        for n in (1, 7, 40, 150, 400, 900, 1600, 2500, 4000, 6000):
            abort_after(n)
            try:
                engine.generate(PROMPT, images=[big_image], max_tokens=16)
            except ps.DecodeError as e:
                failures += 1
                assert e.rc == 2 and "aborted" in str(e)
            finally:
                abort_after(0)
            assert engine.generate(PROMPT, images=[big_image], max_tokens=16).tokens == expected, n
            assert consistent(engine)
    assert failures >= 5  # the faults did land mid-generation


# --------------------------------------------------------------------------- the chat's numbers


def test_an_interrupted_reply_counts_in_the_session_stats(tiny_dense):
    from pyllama_spec.serving.conversation import Conversation

    with make_engine(tiny_dense) as engine:
        conv = Conversation(engine, max_tokens=10_000)
        stream = conv.send("Hello there")
        said = [next(stream) for _ in range(5)]
        stream.close()  # as the CLI's Ctrl-C does: the reply stops between two steps
        n_said = sum(len(p.tokens) for p in said)
        assert conv.session.generations == 1
        assert conv.session.generated_tokens >= n_said > 0
        assert conv.messages[-1]["role"] == "assistant"


# --------------------------------------------------------------------------- per-call speculative settings


def test_per_call_draft_settings_change_drafting_and_stay_lossless(tiny_dense, big_image):
    with make_engine(tiny_dense, spec_type="none") as plain:
        expected = plain.generate(PROMPT, images=[big_image], max_tokens=24).tokens
    with make_engine(tiny_dense, draft_max=3) as engine:
        off = engine.generate(PROMPT, images=[big_image], max_tokens=24, draft_max=0)
        assert off.tokens == expected and off.stats.drafted == 0
        long = engine.generate(PROMPT, images=[big_image], max_tokens=24, draft_max=15)
        assert long.tokens == expected and max(len(long.stats.per_position_drafted), 0) > 3
        seq = engine.generate(PROMPT, images=[big_image], max_tokens=24, draft_positions="sequential")
        assert seq.tokens == expected and seq.stats.prompt_reused == 0  # a new layout: nothing reused
        assert engine.positions.draft_positions == "sequential" and consistent(engine)
        for bad in (dict(draft_max=16), dict(draft_max=-1), dict(draft_min=5, draft_max=2),
                    dict(draft_positions="nope")):
            with pytest.raises(ValueError):
                engine.stream(PROMPT, images=[big_image], max_tokens=4, **bad)


def test_adaptive_draft_length_is_lossless_and_adapts(tiny_dense, big_image):
    from pyllama_spec.speculative.draft_length import AdaptiveLength

    with make_engine(tiny_dense, spec_type="none") as plain:
        expected = plain.generate(PROMPT, images=[big_image], max_tokens=48).tokens
    with make_engine(tiny_dense, draft_max=7) as engine:
        fixed = engine.generate(PROMPT, images=[big_image], max_tokens=48)
        got = engine.generate(PROMPT, images=[big_image], max_tokens=48, draft_max="auto")
        assert got.tokens == expected == fixed.tokens
        # This random tiny pair rejects most drafts: the schedule drafts short blocks most steps.
        by_position = got.stats.per_position_drafted + [0] * 15  # positions never drafted: 0
        assert by_position[0] > 2 * by_position[6] and fixed.stats.per_position_drafted[6] > 0
    schedule = AdaptiveLength(start=7, limit=15)
    seen = []
    for drafted, accepted in [(7, 7), (9, 9), (11, 2)]:  # warm-up (WARMUP_STEPS): HF's schedule
        schedule.update(drafted, accepted, 0.01)
        seen.append(schedule.next())
    # two steps of HF's schedule (+2 after a full block); after the third step the rule decides:
    # every step took 0.01 s whatever its rows, so rows look free and it drafts the limit
    assert AdaptiveLength.WARMUP_STEPS == 3 and seen == [9, 11, 15]


def _settle(schedule, alpha, base, per_row, steps=60):
    """Feed a schedule steps whose acceptance and cost follow the given model."""
    import random

    rng = random.Random(0)
    for _ in range(steps):
        n = schedule.next()
        accepted = 0
        while accepted < n and rng.random() < alpha:
            accepted += 1
        schedule.update(n, accepted, base + per_row * n)
    return schedule.next()


def test_adaptive_length_weighs_acceptance_against_the_cost_of_a_row():
    from pyllama_spec.speculative.draft_length import AdaptiveLength

    # A draft that is nearly always right and rows that cost little (a large model on a GPU): long drafts.
    assert _settle(AdaptiveLength(7, 15), alpha=0.95, base=0.020, per_row=0.0002) >= 12
    # The same draft with rows that cost as much as a step (a tiny model on a CPU): short drafts.
    assert _settle(AdaptiveLength(7, 15), alpha=0.95, base=0.001, per_row=0.001) <= 4
    # A draft that is rarely right: one token.
    assert _settle(AdaptiveLength(7, 15), alpha=0.1, base=0.020, per_row=0.0002) <= 2
