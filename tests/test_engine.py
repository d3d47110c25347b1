"""The speculative engine: the two failures it exists to avoid, and lossless verification.

Every test here runs the real library on tiny real GGUF files (see conftest.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import BIG_IMAGE_N_POS, BIG_IMAGE_N_TOKENS, N_THREADS

import pyllama_spec as ps
from pyllama_spec.devtools import tiny
from pyllama_spec.drafters import DraftRequest, TargetDecode, TargetRows
from pyllama_spec.serving.engine import load
from pyllama_spec.speculative import sequence
from pyllama_spec.speculative.positions import SequencePositions, is_pinned

PROMPT = f"Describe this: {ps.MEDIA_MARKER} in a few words."


def make_engine(models, *, spec_type="dflash", ubatch=64, batch=None, draft_max=7, mode="target", n_ctx=2048):
    return load(models.target, mmproj=models.mmproj, draft=models.draft if spec_type != "none" else None,
                spec_type=spec_type, n_ctx=n_ctx, n_batch=batch or ubatch, n_ubatch=ubatch, n_threads=N_THREADS,
                draft_max=draft_max, draft_positions=mode, flash_attn=False)


@pytest.fixture(scope="module")
def dense_seed1(tiny_dir):
    return tiny.make_tiny_set(tiny_dir, arch="hunyuan_vl", seed=1, window=32, predictable=0.5)


# --------------------------------------------------------------------------- 1. the overflow


@pytest.mark.parametrize("which,batch", [("dense", 64), ("hybrid", 64), ("dense", 128)])
def test_pinned_image_overflows_the_draft_without_the_skip_and_completes_with_it(
        which, batch, tiny_dense, tiny_hybrid, big_image, monkeypatch):
    models = tiny_dense if which == "dense" else tiny_hybrid
    with make_engine(models, ubatch=64, batch=batch) as engine:
        # without the rule: the image's rows reach the drafter as rows whose positions advance
        monkeypatch.setattr(sequence, "is_pinned", lambda n_tokens, n_pos: False)
        with pytest.raises(ps.DecodeError) as info:
            engine.generate(PROMPT, images=[big_image], max_tokens=4)
        err = info.value
        assert err.role == "draft" and err.rc == 1 and err.n_rows == 64
        assert "draft context" in str(err) and "64 rows" in str(err) and "rc = 1" in str(err)

        monkeypatch.undo()  # the same engine is still usable
        result = engine.generate(PROMPT, images=[big_image], max_tokens=8)
        assert len(result.tokens) == 8
        assert result.stats.prompt_tokens > result.stats.prompt_positions  # rows != positions


# --------------------------------------------------------------------------- 2. lossless


def _pairs(models, image, ubatch, draft_max, mode, temperature=0.0, prompt=PROMPT, max_tokens=24):
    images = [image] if ps.MEDIA_MARKER in prompt else []
    with make_engine(models, spec_type="none", ubatch=ubatch) as plain:
        expected = plain.generate(prompt, images=images, max_tokens=max_tokens, temperature=temperature, seed=3,
                                  verify="match")
    with make_engine(models, ubatch=ubatch, draft_max=draft_max, mode=mode) as spec:
        got = spec.generate(prompt, images=images, max_tokens=max_tokens, temperature=temperature, seed=3,
                            verify="match")
    return expected, got


@pytest.mark.parametrize("mode", ["target", "sequential"])
@pytest.mark.parametrize("which,draft_max,ubatch", [
    ("dense", 1, 16), ("dense", 3, 64), ("dense", 7, 512), ("dense", 15, 64),
    ("hybrid", 1, 64), ("hybrid", 3, 512), ("hybrid", 7, 16), ("hybrid", 15, 64),
    ("seed1", 3, 16), ("seed1", 15, 512),
])
def test_greedy_speculative_output_equals_target_only_with_an_image(
        mode, which, draft_max, ubatch, tiny_dense, tiny_hybrid, dense_seed1, big_image):
    models = {"dense": tiny_dense, "hybrid": tiny_hybrid, "seed1": dense_seed1}[which]
    expected, got = _pairs(models, big_image, ubatch, draft_max, mode)
    assert got.tokens == expected.tokens
    assert got.text == expected.text
    assert got.stats.drafted > 0
    assert got.stats.accepted > 0, "the predictable target should accept some drafts (accept path)"
    assert got.stats.accepted < got.stats.drafted or draft_max == 1, "rollback path should run"


@pytest.mark.parametrize("which", ["dense", "hybrid"])
def test_greedy_speculative_output_equals_target_only_for_text(which, tiny_dense, tiny_hybrid):
    models = tiny_dense if which == "dense" else tiny_hybrid
    expected, got = _pairs(models, None, 64, 7, "target", prompt="The quick brown fox jumps over", max_tokens=40)
    assert got.tokens == expected.tokens and got.stats.accepted > 0


def test_sampled_speculative_output_follows_the_target_sampler(tiny_dense, big_image):
    # With llama.cpp's rule, sampling at each verify position consumes the sampler's random
    # stream exactly as target-only decoding does, so with the same seed the outputs match.
    expected, got = _pairs(tiny_dense, big_image, 64, 7, "target", temperature=0.8)
    assert got.tokens == expected.tokens


# --------------------------------------------------------------------------- 3. positions after an image


@pytest.mark.parametrize("mode", ["target", "sequential"])
def test_every_draft_block_starts_at_the_sequence_next_position(mode, tiny_dense, big_image):
    with make_engine(tiny_dense, mode=mode) as engine:
        engine.drafter.trace = []
        starts = []
        original = engine.drafter.draft

        def traced_draft(requests):
            p = engine.positions
            assert [(r.pos, r.draft_pos) for r in requests] == [(p.pos_next, p.draft_pos_next)]
            starts.append((p.pos_next, p.draft_pos_next, p.n_rows))
            return original(requests)

        engine.drafter.draft = traced_draft
        result = engine.generate(PROMPT, images=[big_image], max_tokens=20)
    blocks = [e.pos for e in engine.drafter.trace if e.call == "draft"]
    assert len(blocks) == len(starts) > 0
    first_pos_next, first_draft_pos, first_rows = starts[0]
    assert first_pos_next == result.stats.prompt_positions  # pos_next, not the row count
    assert first_rows == result.stats.prompt_tokens and first_rows > first_pos_next
    expected = [d for _, d, _ in starts]
    assert blocks == expected
    if mode == "target":
        assert blocks == [p for p, _, _ in starts]
    else:
        assert first_draft_pos == first_rows  # every row got a draft position


def _block_logits_after_prefill(models, image, *, at_row_count=False):
    """Draft-block logits right after an image prompt, and the same block's with an empty draft cache."""
    with make_engine(models) as engine, ps.Bitmap.load(image) as bitmap:
        d = engine.drafter
        engine.sequences[0].reset()
        parts = engine.prompts.tokenize(PROMPT, [bitmap])
        _prefill(engine, parts)
        id_last = int(parts[-1][-1])
        p = engine.positions
        # at_row_count: the old placement, the block asked for at the row count as upstream's caller did
        request = DraftRequest(0, id_last, p.pos_next, p.n_rows if at_row_count else p.draft_pos_next, 7)
        d.draft([request])
        after_prefill = d.ctx.output_logits(8).copy()
        d.forget(0, 0, 0)
        d.draft([request])
        empty_cache = d.ctx.output_logits(8).copy()
    return after_prefill, empty_cache


def test_draft_logits_depend_on_the_injected_context(tiny_dense, big_image):
    with_context, without = _block_logits_after_prefill(tiny_dense, big_image)
    assert np.isfinite(with_context).all()
    assert not np.allclose(with_context, without)


def test_old_token_count_placement_loses_the_context(tiny_dense, big_image):
    # The bug upstream had: a block placed at the row count sits past the draft's window
    # after an image, so its logits equal an empty-cache draft's.
    misplaced, empty = _block_logits_after_prefill(tiny_dense, big_image, at_row_count=True)
    np.testing.assert_allclose(misplaced, empty, rtol=1e-5, atol=1e-5)


def _prefill(engine, parts) -> None:
    """Decode ``parts`` into the first sequence after what it holds (the prefill alone, no generation)."""
    from pyllama_spec.speculative.generation import prefill_parts
    from pyllama_spec.speculative.stats import GenerationStats

    for _ in prefill_parts(engine.sequences[0], parts, GenerationStats(), engine.ctx.n_batch, engine.projector):
        pass


# --------------------------------------------------------------------------- 4. what the draft holds


def _prefill_trace(models, mode, image):
    with make_engine(models, mode=mode) as engine:
        engine.drafter.trace = []
        bitmap = ps.Bitmap.load(image)
        engine.sequences[0].reset()
        parts = engine.prompts.tokenize(PROMPT, [bitmap])
        _prefill(engine, parts)
        bitmap.close()
        return engine.drafter.trace, parts, engine.positions.n_rows, engine.positions.pos_next, \
            engine.drafter.ctx.memory.pos_max()


def test_target_mode_prefill_injects_text_rows_and_skips_pinned_image_rows(tiny_dense, big_image):
    trace, parts, rows, pos_next, draft_pos_max = _prefill_trace(tiny_dense, "target", big_image)
    text_rows = sum(len(p) for p in parts if isinstance(p, np.ndarray))
    image = next(p for p in parts if not isinstance(p, np.ndarray))
    injected = sum(e.n_rows for e in trace if e.call == "inject")
    skipped = sum(e.n_rows for e in trace if e.call == "skip")
    assert injected == text_rows
    assert skipped == image.n_tokens
    assert draft_pos_max == pos_next - 1  # the draft ends where the target does: at a position
    assert rows == text_rows + image.n_tokens


def test_sequential_mode_prefill_injects_every_row_at_consecutive_positions(tiny_dense, big_image):
    trace, parts, rows, pos_next, draft_pos_max = _prefill_trace(tiny_dense, "sequential", big_image)
    injects = [(e.pos, e.n_rows) for e in trace if e.call == "inject"]
    assert not [e for e in trace if e.call == "skip"]
    assert sum(n for _, n in injects) == rows
    expected_pos = 0
    for pos, n in injects:
        assert pos == expected_pos
        expected_pos += n
    assert draft_pos_max == rows - 1


# --------------------------------------------------------------------------- 5. advancing media


def test_media_rows_whose_positions_advance_are_injected(tiny_dense):
    with make_engine(tiny_dense) as engine:
        d = engine.drafter
        d.trace = []
        engine.sequences[0].reset()
        n = 8
        engine.ctx.decode_tokens(np.arange(97, 97 + n), np.arange(n))  # gives the target's layer inputs
        positions = np.tile(np.arange(n, dtype=np.int32), (4, 1))  # audio-like: every section advances
        d.process(TargetDecode([TargetRows(positions, True, 0, pinned=is_pinned(n, n))], engine.ctx))
        assert [(e.call, e.pos, e.n_rows) for e in d.trace] == [("inject", 0, n)]
        assert d.ctx.memory.pos_max() == n - 1
        pinned = np.full((4, n), n, dtype=np.int32)
        d.process(TargetDecode([TargetRows(pinned, True, n, pinned=is_pinned(n, 1))], engine.ctx))
        assert (d.trace[-1].call, d.trace[-1].pos, d.trace[-1].n_rows) == ("skip", n, n)


def test_is_pinned_when_a_chunk_has_fewer_positions_than_rows():
    assert is_pinned(576, 24)  # an M-RoPE image: 576 rows over 24 positions
    assert not is_pinned(1, 1)  # a one-row item advances
    assert not is_pinned(50, 50)  # audio and other 1-D media advance


def test_pinned_rule_is_decided_per_media_chunk(tiny_dense, big_image):
    # n_batch 115 decodes the image's 576 rows in six slices: five of 115 rows and a last one
    # of a single row. That row alone looks like text (is_pinned(1, 1) is False), yet it is the
    # image's: every slice is skipped, the draft holds nothing at the image's position.
    n_batch = 115
    assert BIG_IMAGE_N_TOKENS % n_batch == 1
    with make_engine(tiny_dense, ubatch=64, batch=n_batch) as engine:
        d = engine.drafter
        d.trace = []
        result = engine.generate(PROMPT, images=[big_image], max_tokens=1)
        trace = d.trace
    n_pre = next(e.pos for e in trace if e.call == "skip")  # the image's section-0 position
    skips = [(e.pos, e.n_rows) for e in trace if e.call == "skip"]
    assert skips == [(n_pre, n_batch)] * 5 + [(n_pre, 1)]
    injected = [(e.pos, e.n_rows) for e in trace if e.call == "inject"]
    assert all(pos + n <= n_pre or pos >= n_pre + BIG_IMAGE_N_POS for pos, n in injected), injected
    assert result.stats.prompt_tokens == sum(n for _, n in injected) + BIG_IMAGE_N_TOKENS


def test_sequence_positions_keep_the_two_spaces_mapped():
    p = SequencePositions("sequential")
    p.advance_text(6)
    p.advance_media(576, 24)
    p.advance_text(10)
    assert (p.pos_next, p.n_rows, p.draft_pos_next) == (40, 592, 592)
    assert p.draft_pos(35) == 587 and p.rows_at(35) == 587
    p.truncate(32)
    assert (p.pos_next, p.n_rows, p.draft_pos_next) == (32, 584, 584)
    p.truncate(3)
    assert (p.pos_next, p.n_rows, p.draft_pos_next) == (3, 3, 3)
    t = SequencePositions("target")
    t.advance_text(6)
    t.advance_media(576, 24)
    assert (t.pos_next, t.n_rows, t.draft_pos_next) == (30, 582, 30)


# --------------------------------------------------------------------------- 6. refusals at load


def test_refuses_a_target_that_does_not_record_layer_inputs(tiny_dense):
    from pyllama_spec.drafters.dflash import check_dflash_pair

    with ps.Model(tiny_dense.target) as target, ps.Model(tiny_dense.draft, role="draft") as draft:
        with pytest.raises(ps.IncompatibleModelsError, match="does not record its layer inputs"):
            check_dflash_pair(target, draft, ["qwen3", "qwen35"])
        check_dflash_pair(target, draft, ["hunyuan_vl"])  # the same pair passes when the build can


def test_refuses_target_layers_the_target_does_not_have(tiny_dense, tmp_path):
    bad = tiny.write_draft(tmp_path / "d.gguf", target_layers=(1, 6), target_n_layer=8)
    with pytest.raises(ps.IncompatibleModelsError, match="target layers"):
        load(tiny_dense.target, draft=bad, n_threads=N_THREADS)


class _TargetFacts:
    """The facts check_dflash_pair reads from a target, for widths the tiny writer cannot make (it writes 64)."""

    def __init__(self, model, **override):
        self.arch, self.n_layer, self.n_embd, self.n_vocab = model.arch, model.n_layer, model.n_embd, model.n_vocab
        self.path = model.path
        self.__dict__.update(override)


@pytest.mark.parametrize("override,match", [({"n_embd": 128}, "n_embd"), ({"n_vocab": 300}, "vocabulary")])
def test_refuses_a_draft_of_another_width_or_vocabulary(tiny_dense, override, match):
    from pyllama_spec.drafters.dflash import check_dflash_pair

    with ps.Model(tiny_dense.target) as target, ps.Model(tiny_dense.draft, role="draft") as draft:
        with pytest.raises(ps.IncompatibleModelsError, match=match):
            check_dflash_pair(_TargetFacts(target, **override), draft, None)


def test_refuses_a_draft_without_a_mask_token(tiny_dense, tmp_path):
    from pyllama_spec.gguf.writer import read_gguf_metadata  # noqa: F401  (the writer is ours)

    path = tmp_path / "nomask.gguf"
    tiny.write_draft(path)
    data = bytearray(path.read_bytes())
    key = b"tokenizer.ggml.mask_token_id"
    at = data.find(key)
    assert at > 0
    data[at:at + len(key)] = b"tokenizer.ggml.mask_token_xx"  # the key is gone, the file stays valid
    path.write_bytes(bytes(data))
    with pytest.raises(ps.IncompatibleModelsError, match="mask token"):
        load(tiny_dense.target, draft=path, n_threads=N_THREADS)


def test_refuses_a_prompt_over_the_context_before_decoding(tiny_dense, big_image):
    with make_engine(tiny_dense, n_ctx=256) as engine:
        with pytest.raises(ps.ContextOverflowError, match="576|cache rows"):
            engine.generate(PROMPT, images=[big_image], max_tokens=4)
        assert engine.ctx.memory.pos_max() == -1  # nothing was decoded
        assert engine.generate("hi", max_tokens=3).tokens  # and the engine still works


def test_spec_none_and_dflash_need_the_right_arguments(tiny_dense):
    with pytest.raises(ValueError, match="needs a draft"):
        load(tiny_dense.target, spec_type="dflash", n_threads=N_THREADS)
    with pytest.raises(ValueError, match="spec_type"):
        load(tiny_dense.target, draft=tiny_dense.draft, spec_type="eagle", n_threads=N_THREADS)


# --------------------------------------------------------------------------- API surface


def test_stream_yields_pieces_and_ends_with_stats(tiny_dense):
    with make_engine(tiny_dense) as engine:
        pieces = list(engine.stream(messages=[{"role": "user", "content": "Hi"}], max_tokens=12))
        whole = engine.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=12)
    assert pieces[-1].stats is not None and pieces[-1].finish_reason == "length"
    assert all(p.stats is None for p in pieces[:-1])
    assert "".join(p.text for p in pieces) == whole.text
    assert [t for p in pieces for t in p.tokens] == whole.tokens and len(whole.tokens) == 12
    s = whole.stats
    assert s.generated_tokens == 12 and s.prefill_seconds > 0 and s.decode_seconds > 0
    assert 0 <= s.acceptance_rate <= 1 and s.mean_accepted_length >= 1
    assert len(s.per_position_acceptance) > 0
    # every step drafted here (n_max >= 1, no rule stops it): each verify step had a draft, and
    # the drafts proposed at position 0 are one per such step
    assert 0 < s.spec_steps <= s.target_steps and s.per_position_drafted[0] == s.spec_steps
    # The native time is measured inside the wall time: target + draft + Python add up to it
    # (python_seconds is clamped at 0, so this fails when a stopwatch counts time twice).
    assert s.target_seconds > 0 and s.draft_seconds > 0
    assert s.target_seconds + s.draft_seconds + s.python_seconds == pytest.approx(s.total_seconds, abs=1e-6)
    assert s.decode_target_seconds + s.decode_draft_seconds <= s.decode_seconds + 1e-6
    assert 0 < s.decode_target_seconds <= s.target_seconds and 0 < s.decode_draft_seconds <= s.draft_seconds


def test_pieces_say_which_tokens_came_from_the_draft():
    """Per-token text and origin (what the server's stream and the chat page show): on the trained
    pair, greedy, the first token is the target's, every step ends with one target token, the
    accepted drafts add up to the stats, and the token texts join to the text, stop string included."""
    m = ps.embedded_models()
    with load(m.target, mmproj=m.mmproj, draft=m.draft, n_threads=N_THREADS) as engine:
        pieces = list(engine.stream("def f", max_tokens=60))
        stop = "".join(p.text for p in pieces)[20:23]
        cut = list(engine.stream("def f", max_tokens=60, stop=stop))
    stats = pieces[-1].stats
    assert pieces[0].from_draft == 0 and pieces[0].drafted == 0
    assert 0 < sum(p.from_draft for p in pieces) <= stats.accepted  # (the last step may be cut)
    for p in pieces + cut:
        assert len(p.token_texts) == len(p.tokens) and "".join(p.token_texts) == p.text
        assert 0 <= p.from_draft <= min(p.drafted, len(p.tokens))
    for p in pieces[1:-1]:  # whole steps: the drafts the target took, then its own token
        assert p.from_draft == len(p.tokens) - 1
    assert cut[-1].finish_reason == "stop" and not "".join(p.text for p in cut).count(stop)


def test_stop_strings_cut_the_output(tiny_dense):
    with make_engine(tiny_dense, spec_type="none") as engine:
        full = engine.generate("The", max_tokens=30).text
        stop = full[5:7]
        cut = engine.generate("The", max_tokens=30, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full[:full.find(stop)]
