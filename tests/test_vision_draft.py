"""A vision draft model: draft-simple with a projector of its own (``mmproj_draft``). The draft, a
small VLM with the target's vocabulary, sees every picture through its own projector, at its own
positions, and the output stays the target's own, token for token."""

from __future__ import annotations

import io

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import BIG_IMAGE_N_POS, BIG_IMAGE_N_TOKENS, N_THREADS, TINY_ENGINE

import pyllama_spec as ps
from pyllama_spec.cli import main
from pyllama_spec.devtools import tiny
from pyllama_spec.speculative.media import encode_media, pair_with_draft

MARK = ps.MEDIA_MARKER
PROMPTS = {  # (prompt, number of images)
    "text": ("Tell me a story about a red fox.", 0),
    "one image": (f"Look: {MARK} What is it?", 1),
    "two images": (f"First {MARK} then {MARK} Which is brighter?", 2),
}
#: A 672x672 picture through the draft VLM's projector (patch 16): 441 rows over 21 positions
#: (the target's: 576 over 24).
DRAFT_IMAGE_N_TOKENS, DRAFT_IMAGE_N_POS = 441, 21


@pytest.fixture(scope="module")
def draft_vlm(tiny_dir) -> tiny.TinyDraftVLM:
    """A qwen2vl draft VLM, n_embd 128, 2 layers, its projector's patch 16 (another grid)."""
    return tiny.make_draft_vlm(tiny_dir)


@pytest.fixture(scope="module")
def small_image() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, (224, 336, 3), dtype=np.uint8)


def _images(n, big_image, small_image):
    return [big_image, small_image][:n]


def _load(models, **kw):
    kw.setdefault("n_ctx", 4096)
    return ps.load(models.target, mmproj=models.mmproj, **TINY_ENGINE, flash_attn=False, **kw)


def _vision(models, vlm, **kw):
    return _load(models, draft=vlm.model, mmproj_draft=vlm.mmproj, draft_max=5, **kw)


# --------------------------------------------------------------------------- lossless


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("kind", list(PROMPTS))
def test_the_vision_draft_model_gives_the_targets_own_tokens(kind, temperature, tiny_dense, draft_vlm, big_image,
                                                             small_image):
    prompt, n = PROMPTS[kind]
    images = _images(n, big_image, small_image)
    args = dict(images=images, max_tokens=24, temperature=temperature, seed=11)
    with _load(tiny_dense, spec_type="none") as plain:
        expected = plain.generate(prompt, **args)
    with _vision(tiny_dense, draft_vlm) as spec:
        assert spec.config.spec_type == "draft-simple"  # the default with a draft projector
        got = spec.generate(prompt, **args)
        again = spec.generate(prompt, **args)  # the cache (images too) reused, the draft cut with it
    assert got.tokens == expected.tokens and again.tokens == expected.tokens
    assert got.stats.drafted > 0 and again.stats.prompt_reused > 0


def test_several_slots_with_and_without_pictures_each_get_the_targets_own_tokens(tiny_dense, draft_vlm, big_image,
                                                                                 small_image):
    asks = [(PROMPTS[k][0], _images(PROMPTS[k][1], big_image, small_image), t)
            for k, t in (("two images", 0.0), ("one image", 0.8), ("text", 0.0), ("one image", 0.0))]
    with _load(tiny_dense, spec_type="none") as plain:
        expected = [plain.generate(p, images=im, max_tokens=20, temperature=t, seed=3).tokens for p, im, t in asks]
    with _vision(tiny_dense, draft_vlm, n_parallel=3) as spec:
        handles = [spec.submit(p, images=im, max_tokens=20, temperature=t, seed=3) for p, im, t in asks]
        results = [h.result() for h in handles]
    assert [r.tokens for r in results] == expected
    assert all(r.stats.drafted > 0 for r in results)
    assert spec.scheduler.slots_per_step[1] < spec.scheduler.steps  # slots did share steps


def test_a_picture_the_draft_cuts_into_more_rows_than_the_target_is_read_as_text_around_it(
        tiny_dense, tiny_dir, big_image):
    # patch 12: 784 rows where the target has 576. The draft's context is the target's size, so it
    # keeps to the target's row count: it skips that picture (and still drafts, losslessly).
    vlm = tiny.make_draft_vlm(tiny_dir, patch=12)
    prompt = PROMPTS["one image"][0]
    with _load(tiny_dense, spec_type="none") as plain:
        expected = plain.generate(prompt, images=[big_image], max_tokens=16)
    with _vision(tiny_dense, vlm) as spec:
        got = spec.generate(prompt, images=[big_image], max_tokens=16)
        assert spec.drafter.media_skipped == 1
        spec.sequences[0].show_drafter()  # the last step's row, held for the draft's next use
        # its positions still move by its own grid: 28 for the picture, not the target's 24
        p = spec.positions
        assert p.pos_next - p.draft_pos_next == BIG_IMAGE_N_POS - 28
        assert spec.drafter.ctx.memory.pos_max(0) == p.draft_pos_next - 1
    assert got.tokens == expected.tokens and got.stats.drafted > 0


# --------------------------------------------------------------------------- the draft's cache


def _cache_rows(ctx, seq_id: int, row_bytes: int, empty_bytes: int) -> float:
    return (len(ctx.memory.save_seq(seq_id)) - empty_bytes) / row_bytes


def test_the_draft_holds_its_own_projectors_rows_and_text_after_a_picture_goes_at_its_own_positions(
        tiny_dense, draft_vlm, big_image):
    prompt, _ = PROMPTS["one image"]
    with _vision(tiny_dense, draft_vlm) as spec:
        # What a row of the draft's cache weighs, from two text prompts (every cell, text or image,
        # is serialized alike: its position, its M-RoPE extra positions, its K and V).
        draft = spec.drafter.ctx
        spec.generate("ab", max_tokens=0, cache_prompt=False)
        n_short, short = spec.positions.n_rows, len(draft.memory.save_seq(0))
        spec.generate("ab cd ef gh ij kl mn op", max_tokens=0, cache_prompt=False)
        n_long, long = spec.positions.n_rows, len(draft.memory.save_seq(0))
        row = (long - short) // (n_long - n_short)
        empty = short - n_short * row

        spec.generate(prompt, images=[big_image], max_tokens=0, cache_prompt=False)
        p = spec.positions
        n_text = p.n_rows - BIG_IMAGE_N_TOKENS
        assert p.pos_next == n_text + BIG_IMAGE_N_POS  # the target: its picture spans 24 positions
        assert p.draft_pos_next == n_text + DRAFT_IMAGE_N_POS  # the draft: its own grid's 21
        assert _cache_rows(draft, 0, row, empty) == n_text + DRAFT_IMAGE_N_TOKENS
        assert draft.memory.pos_max(0) == p.draft_pos_next - 1  # the text after it at the draft's positions

        # generating on: the draft keeps ending where the sequence does, in its own positions
        spec.generate(prompt, images=[big_image], max_tokens=12)
        p = spec.positions
        assert p.pos_next - p.draft_pos_next == BIG_IMAGE_N_POS - DRAFT_IMAGE_N_POS
        assert draft.memory.pos_max(0) <= p.draft_pos_next - 1


def test_each_projector_encodes_the_picture_once_and_both_encodes_can_run_at_once(tiny_dense, draft_vlm,
                                                                                  big_image):
    with _vision(tiny_dense, draft_vlm) as spec:
        bitmap = ps.Bitmap.load(big_image)
        try:
            parts = spec.prompts.tokenize(PROMPTS["one image"][0], [bitmap])
            chunk = next(p for p in parts if not isinstance(p, np.ndarray))
            assert (chunk.n_tokens, chunk.draft.n_tokens) == (BIG_IMAGE_N_TOKENS, DRAFT_IMAGE_N_TOKENS)
            one_after_other = encode_media(spec.projector, chunk, concurrent=False)
            at_once = encode_media(spec.projector, chunk, concurrent=True)
        finally:
            bitmap.close()
        assert np.array_equal(one_after_other.target, at_once.target)
        assert np.array_equal(one_after_other.draft, at_once.draft)
        assert at_once.draft.shape == (DRAFT_IMAGE_N_TOKENS, 128)  # the draft's width, not the target's 64

        before = (spec.projector.n_encode_calls, spec.draft_projector.n_encode_calls)
        spec.generate(PROMPTS["one image"][0], images=[big_image], max_tokens=4)
        after = (spec.projector.n_encode_calls, spec.draft_projector.n_encode_calls)
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)


def test_a_picture_moves_the_drafts_position_by_its_own_projectors_positions_and_a_cut_maps_back():
    from pyllama_spec.speculative.positions import SequencePositions

    for mode in ("target", "sequential"):  # the draft's own grid decides, whatever the mode
        p = SequencePositions(mode)
        p.advance_text(5)
        p.advance_media(BIG_IMAGE_N_TOKENS, BIG_IMAGE_N_POS, DRAFT_IMAGE_N_POS)
        p.advance_text(7)
        assert (p.pos_next, p.draft_pos_next, p.n_rows) == (36, 33, 5 + BIG_IMAGE_N_TOKENS + 7)
        p.truncate(31)  # back into the text after the picture
        assert (p.pos_next, p.draft_pos_next) == (31, 28)
        p.truncate(5)  # back to where the picture started
        assert (p.pos_next, p.draft_pos_next, p.n_rows) == (5, 5, 5)


# --------------------------------------------------------------------------- acceptance


def test_after_a_picture_a_draft_that_sees_it_accepts_as_much_as_on_text_and_more_than_a_text_only_draft(
        tiny_dir, big_image, small_image):
    """The target as its own draft, with its own projector (so acceptance means something). The
    set is random (make_tiny_set's predictable=0): with the predictable structure the target's
    next token follows the current token alone, the picture changes nothing, and a text-only
    draft accepts everything too (test_drafters shows it); here the picture shifts the target's
    choices, and a draft that does not see it misses them."""
    models = tiny.make_tiny_set(tiny_dir, arch="hunyuan_vl", seed=0, predictable=0.0)
    rates = {}
    for name, mmproj_draft in (("text-only", None), ("vision", models.mmproj)):
        with _load(models, draft=models.target, mmproj_draft=mmproj_draft, spec_type="draft-simple",
                   draft_max=4) as spec:
            accepted = drafted = 0
            for image in (big_image, small_image):  # right after a picture
                s = spec.generate(f"Look: {MARK} What is it?", images=[image], max_tokens=32,
                                  cache_prompt=False).stats
                accepted, drafted = accepted + s.accepted, drafted + s.drafted
            text = spec.generate("Tell me what you think of this.", max_tokens=32, cache_prompt=False).stats
            rates[name] = (accepted / drafted, text.accepted / text.drafted)
    print(f"\nacceptance after a picture / on text: text-only draft model {rates['text-only'][0]:.3f} / "
          f"{rates['text-only'][1]:.3f}; vision draft model {rates['vision'][0]:.3f} / {rates['vision'][1]:.3f}")
    vision_after, vision_text = rates["vision"]
    assert vision_after >= 0.9 * vision_text
    assert vision_after > rates["text-only"][0]


# --------------------------------------------------------------------------- refusals


def test_the_writer_refuses_a_qwen3vl_draft_too_shallow_for_its_deepstack_and_writes_one_that_loads(tmp_path):
    # two deepstack slices go to layers 0 and 1, and never to the last: two layers cannot hold them
    with pytest.raises(ValueError, match="at least 3 layers"):
        tiny.make_draft_vlm(tmp_path, arch="qwen3vl", patch=14, n_layer=2)
    vlm = tiny.make_draft_vlm(tmp_path, arch="qwen3vl", patch=14, n_layer=3)
    with ps.Model(vlm.model) as m:
        assert m.arch == "qwen3vl"


def test_a_draft_projector_of_another_width_than_the_draft_is_refused_at_load(tiny_dense, draft_vlm):
    with pytest.raises(ps.ProjectorError, match="qwen2vl draft .*n_embd_inp 128"):
        _load(tiny_dense, draft=draft_vlm.model, mmproj_draft=tiny_dense.mmproj)


def test_a_draft_with_another_vocabulary_is_refused_at_load_with_or_without_its_projector(tiny_dense, tiny_fim):
    for mmproj_draft in (None, tiny_fim.mmproj):
        with pytest.raises(ps.IncompatibleModelsError, match="needs the target's vocabulary"):
            _load(tiny_dense, draft=tiny_fim.target, mmproj_draft=mmproj_draft, spec_type="draft-simple")


def test_a_draft_projector_needs_a_target_projector_a_draft_model_and_draft_simple(tiny_dense, draft_vlm, tmp_path):
    with pytest.raises(ps.IncompatibleModelsError, match="the target has no projector"):
        ps.load(tiny_dense.target, draft=draft_vlm.model, mmproj_draft=draft_vlm.mmproj, n_threads=N_THREADS)
    with pytest.raises(ValueError, match="needs a draft model .* and spec_type 'draft-simple'"):
        _load(tiny_dense, mmproj_draft=draft_vlm.mmproj)
    with pytest.raises(ValueError, match="spec_type 'draft-simple', got spec_type 'draft-dflash'"):
        _load(tiny_dense, draft=tiny_dense.draft, spec_type="draft-dflash", mmproj_draft=draft_vlm.mmproj)
    with pytest.raises(ps.ModelFileError, match="draft mmproj"):
        _load(tiny_dense, draft=draft_vlm.model, mmproj_draft=tmp_path / "missing.gguf")


class _Piece:
    """A tokenized media piece as pair_with_draft reads it: its kind and the picture it comes from."""

    is_text = False
    draft = None

    def __init__(self, type: str, id: str) -> None:
        self.type, self.id = type, id


def test_projectors_that_cut_a_picture_into_different_numbers_of_pieces_are_refused_at_the_request():
    # A projector that tiles a large picture (an overview and slices) makes several pieces of it.
    text = np.zeros(3, np.int32)
    target = [text, _Piece("image", "a"), text, _Piece("image", "b"), text]
    with pytest.raises(ps.ImageError, match="cuts this prompt's media into 3 piece.*the target's into 2"):
        pair_with_draft(target, [_Piece("image", "a"), _Piece("image", "a"), _Piece("image", "b")])
    with pytest.raises(ps.ImageError):  # as many pieces, but not of the same pictures
        pair_with_draft(target, [_Piece("image", "a"), _Piece("image", "a")])
    twins = [_Piece("image", "a"), _Piece("image", "b")]
    pair_with_draft(target, twins)
    assert [target[1].draft, target[3].draft] == twins


# --------------------------------------------------------------------------- CLI and server


def _png(image: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, "PNG")
    return buf.getvalue()


def test_chat_takes_mmproj_draft_and_drafts_after_a_picture(tiny_dense, draft_vlm, small_image, tmp_path):
    png = tmp_path / "picture.png"
    png.write_bytes(_png(small_image))
    result = CliRunner().invoke(main, ["chat", "-m", str(tiny_dense.target), "--mmproj", str(tiny_dense.mmproj),
                                       "-md", str(draft_vlm.model), "--mmproj-draft", str(draft_vlm.mmproj),
                                       "-t", "1", "-n", "12", "--draft-max", "4"],
                                input=f"/image {png}\nWhat is it?\n/quit\n", terminal_width=200)
    out = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert "speculative: draft-simple" in out
    drafted = int(out.split("drafted/accepted ")[1].split("/")[0])
    assert drafted > 0, out


def test_serve_with_a_draft_projector_answers_an_image_chat_with_the_targets_answer_and_drafts(
        tiny_dense, draft_vlm, small_image):
    pytest.importorskip("starlette", reason="the server needs the 'server' extra")
    from serving import LocalServer, cli_server, http, image_chat

    from pyllama_spec.server import ServerSettings

    body = image_chat(_png(small_image), "What is this?", 16)
    with _load(tiny_dense, spec_type="none") as plain, LocalServer(plain, ServerSettings(alias="tiny")) as server:
        status, expected = http(server.url, "/v1/chat/completions", body)
    assert status == 200

    with cli_server("-m", str(tiny_dense.target), "--mmproj", str(tiny_dense.mmproj), "-md", str(draft_vlm.model),
                    "--mmproj-draft", str(draft_vlm.mmproj), "-t", "1", "-a", "tiny") as url:
        status, answer = http(url, "/v1/chat/completions", body)
    assert status == 200, answer
    assert answer["choices"][0]["message"] == expected["choices"][0]["message"]
    assert answer["timings"]["draft_n"] > 0


def test_the_server_answers_two_image_chats_at_once_through_the_vision_draft_on_two_slots(
        tiny_dense, draft_vlm, big_image, small_image):
    """Two slots, a picture each (of other sizes: each projector cuts each its own way), asked at
    once: each is the target's own answer, drafted by a draft that saw its picture."""
    import concurrent.futures

    pytest.importorskip("starlette", reason="the server needs the 'server' extra")
    from serving import LocalServer, http, image_chat

    from pyllama_spec.server import ServerSettings

    bodies = [image_chat(_png(im), "What is this?", 16) for im in (big_image, small_image)]
    answers = {}
    for name, spec in (("target", {"spec_type": "none"}),
                       ("vision draft", {"draft": draft_vlm.model, "mmproj_draft": draft_vlm.mmproj})):
        with _load(tiny_dense, n_parallel=2, **spec) as engine, \
                LocalServer(engine, ServerSettings(alias="tiny")) as server:
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                answers[name] = list(pool.map(lambda b: http(server.url, "/v1/chat/completions", b), bodies))
            if name == "vision draft":
                assert engine.drafter.media_skipped == 0  # the draft decoded both pictures
    for (s1, a), (s2, b) in zip(answers["vision draft"], answers["target"]):
        assert s1 == s2 == 200
        assert a["choices"][0]["message"] == b["choices"][0]["message"]
        assert a["timings"]["draft_n"] > 0


def test_serve_refuses_a_draft_projector_without_a_draft_model(tiny_dense, draft_vlm):
    result = CliRunner().invoke(main, ["serve", "-m", str(tiny_dense.target), "--mmproj", str(tiny_dense.mmproj),
                                       "--mmproj-draft", str(draft_vlm.mmproj), "--port", "1", "-t", "1"])
    assert result.exit_code == 1
    assert "needs a draft model" in " ".join(result.output.split()), result.output
