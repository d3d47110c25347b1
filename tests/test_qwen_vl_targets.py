"""Qwen2-VL and Qwen3-VL (deepstack) targets feeding a DFlash draft after a large image.

These targets record their layer inputs only in a build with
``patches/0001-record-layer-inputs-qwen-vl.patch``.  The image (576 rows over 24
M-RoPE positions) is several times larger than the ubatch (64) and the draft's
window (32): without the pinned-media skip the windowed draft cache overflows, and
a draft block placed at a token count instead of ``pos_next`` sees no target context.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import BIG_IMAGE_N_POS, BIG_IMAGE_N_TOKENS, N_THREADS

from pyllama_spec.bindings.context import Context
from pyllama_spec.bindings.model import Model
from pyllama_spec.bindings.mtmd import MEDIA_MARKER, Bitmap, Projector
from pyllama_spec.devtools import tiny
from pyllama_spec.serving.engine import load

N_BATCH = 64
WINDOW = 32
PROMPT = f"Describe {MEDIA_MARKER} now"
# more text rows after the image, for the layer-input comparison
LONG_PROMPT = f"Describe {MEDIA_MARKER} now, and then the rest of the story in detail"
ENGINE_KW = dict(n_ctx=1024, n_batch=N_BATCH, n_ubatch=N_BATCH, n_threads=N_THREADS, draft_max=7, flash_attn=False)
CTX_KW = dict(n_ctx=1024, n_batch=N_BATCH, n_ubatch=N_BATCH, n_threads=N_THREADS, flash_attn=False)
N_DEEPSTACK = len(tiny.QWEN3VL_DEEPSTACK_LAYERS)


@pytest.fixture(scope="module", params=["qwen2vl", "qwen3vl"])
def qwen_vl(request, tiny_dir) -> tuple[str, tiny.TinyModels]:
    arch = request.param
    return arch, tiny.make_tiny_set(tiny_dir, arch=arch, seed=0, window=WINDOW, predictable=0.5)


@pytest.fixture(scope="module")
def tiny_qwen3vl(tiny_dir) -> tiny.TinyModels:
    return tiny.make_tiny_set(tiny_dir, arch="qwen3vl", seed=0, window=WINDOW, predictable=0.5)


def test_target_and_projector_load_and_split_the_image(qwen_vl, big_image):
    arch, models = qwen_vl
    n_deep = N_DEEPSTACK if arch == "qwen3vl" else 0
    with Model(models.target) as model:
        assert model.arch == arch and model.n_embd == 64 and model.n_layer == 4 and model.is_mrope
        assert model.n_embd_inp == 64 * (1 + n_deep)
        with Context(model, **CTX_KW) as ctx:
            tokens = model.tokenize("hello there", add_special=True)
            ctx.decode_tokens(tokens, np.arange(len(tokens), dtype=np.int32), outputs=True)
            assert np.isfinite(ctx.logits(-1)).all()
        with Projector(models.mmproj, model, n_threads=N_THREADS) as proj, Bitmap.load(big_image) as bitmap:
            chunks = proj.tokenize(PROMPT, [bitmap])
            assert [c.type for c in chunks] == ["text", "image", "text"]
            image = chunks[1]
            assert (image.n_tokens, image.n_pos) == (BIG_IMAGE_N_TOKENS, BIG_IMAGE_N_POS)
            embd = proj.encode(image)
            assert embd.shape == (BIG_IMAGE_N_TOKENS, model.n_embd_inp) and np.isfinite(embd).all()
            if n_deep:  # every deepstack slice carries features
                assert all(np.abs(embd[:, k * 64:(k + 1) * 64]).mean() > 0.1 for k in range(1 + n_deep))


def test_dflash_after_big_image_matches_target_only_and_drafts_at_pos_next(qwen_vl, big_image):
    arch, models = qwen_vl
    with load(models.target, mmproj=models.mmproj, draft=models.draft, **ENGINE_KW) as engine:
        assert engine.drafter.config.sliding_window == WINDOW
        engine.drafter.trace = []
        result = engine.generate(PROMPT, images=[big_image], max_tokens=24)
        trace = list(engine.drafter.trace)
    with load(models.target, mmproj=models.mmproj, spec_type="none", **ENGINE_KW) as engine:
        reference = engine.generate(PROMPT, images=[big_image], max_tokens=24)

    assert len(reference.tokens) == 24
    assert result.tokens == reference.tokens, arch
    stats = result.stats
    assert stats.prompt_tokens == reference.stats.prompt_tokens
    # M-RoPE: the image takes 576 rows but only 24 positions
    assert stats.prompt_positions == stats.prompt_tokens - (BIG_IMAGE_N_TOKENS - BIG_IMAGE_N_POS)
    assert stats.drafted > 0 and stats.accepted > 0  # the draft ran, and the accept path was taken

    # the image's pinned rows were skipped, not injected into the windowed draft cache
    assert sum(e.n_rows for e in trace if e.call == "skip") == BIG_IMAGE_N_TOKENS
    drafts = [(e.pos, e.n_rows) for e in trace if e.call == "draft"]
    assert drafts, trace
    assert drafts[0][0] == stats.prompt_positions < stats.prompt_tokens
    # every later block also starts at pos_next: within the positions the generation spans
    end = stats.prompt_positions + len(result.tokens)
    assert all(stats.prompt_positions <= pos < end for pos, _ in drafts), drafts
    assert [pos for pos, _ in drafts] == sorted(pos for pos, _ in drafts)


def _decode_reference(model: Model, proj: Projector, image: np.ndarray, layers, *, prompt: str,
                      deepstack_scale: float = 1.0) -> dict:
    """Target-only prefill of ``prompt``; returns the layer inputs of the first image batch and of
    the final text chunk.  ``deepstack_scale`` multiplies the image's deepstack slices."""
    out = {}
    with Context(model, **CTX_KW) as ctx, Bitmap.load(image) as bitmap:
        ctx.enable_layer_inputs(layers)
        chunks = proj.tokenize(prompt, [bitmap])
        pos = 0
        for i, chunk in enumerate(chunks):
            if chunk.is_text:
                tokens = chunk.tokens
                assert len(tokens) <= N_BATCH
                ctx.decode_tokens(tokens, np.arange(pos, pos + len(tokens), dtype=np.int32),
                                  outputs=i == len(chunks) - 1)
                pos += len(tokens)
                if i == len(chunks) - 1:
                    out["text"] = {lid: ctx.layer_input(lid, len(tokens)).copy() for lid in layers}
            else:
                embd = proj.encode(chunk)
                embd[:, model.n_embd:] *= deepstack_scale

                def on_batch(b, ctx=ctx):
                    if "image" not in out:
                        out["image"] = {lid: ctx.layer_input(lid, b.n_rows).copy() for lid in layers}

                out["embd"] = embd
                pos = proj.decode_media(ctx, chunk, embd, pos, n_batch=N_BATCH, on_batch=on_batch)
    return out


def test_qwen3vl_layer_inputs_read_after_the_image_are_the_true_inputs(tiny_qwen3vl, big_image):
    models = tiny_qwen3vl
    layers = (1, 2, 3)  # not 0: its input is a strided view of the deepstack input (see report)
    with load(models.target, mmproj=models.mmproj, draft=models.draft, **ENGINE_KW) as engine:
        assert set(engine.drafter.config.target_layers) <= set(layers)
        engine.ctx.enable_layer_inputs(layers)
        captured: list[tuple[bool, int, dict]] = []
        process = engine.drafter.process

        def capture(batch):  # right after the target decoded these rows, before the drafter reads them
            for rows in batch.rows:
                n, at = rows.n_rows, rows.row_offset
                captured.append((rows.has_embeddings, int(rows.section0[0]),
                                 {lid: engine.ctx.layer_input(lid, at + n)[at:].copy() for lid in layers}))
            process(batch)

        engine.drafter.process = capture
        engine.generate(LONG_PROMPT, images=[big_image], max_tokens=1)  # prefill (and one sampled token) only

        ref = _decode_reference(engine.model, engine.projector, big_image, layers, prompt=LONG_PROMPT)
        # the same prompt with the image's deepstack features off
        flat = _decode_reference(engine.model, engine.projector, big_image, layers, prompt=LONG_PROMPT,
                                 deepstack_scale=0.0)
        # the same text after another image
        other = _decode_reference(engine.model, engine.projector, 255 - np.asarray(big_image), layers,
                                  prompt=LONG_PROMPT)

    media = [c for c in captured if c[0]]
    text_after = [c for c in captured if not c[0] and c[1] > media[0][1]]
    assert len(media) == BIG_IMAGE_N_TOKENS // N_BATCH and len(text_after) == 1, [c[:2] for c in captured]
    final = text_after[0][2]
    n_text = len(ref["text"][1])
    assert n_text > 5
    for lid in layers:
        assert final[lid].shape == (n_text, 64)
        np.testing.assert_allclose(final[lid], ref["text"][lid], atol=1e-4, rtol=0, err_msg=f"layer {lid}")
        # the comparison can tell: the text rows' inputs depend on the image before them
        assert not np.allclose(final[lid], other["text"][lid], atol=1e-3, rtol=0), lid
        # and the engine's image rows too (the draft skips them, the target still records them)
        np.testing.assert_allclose(media[0][2][lid], ref["image"][lid], atol=1e-4, rtol=0)

    # Layer 1's input on image rows is layer 0's output plus the first deepstack slice: switching the
    # deepstack off changes it by exactly that slice (layer 0 does not see deepstack features).
    first = slice(0, N_BATCH)
    np.testing.assert_allclose(ref["image"][1] - flat["image"][1], ref["embd"][first, 64:128], atol=1e-4, rtol=0)
    assert np.abs(ref["embd"][first, 64:128]).mean() > 0.1
    # ...and the text rows after the image see them only through attention over image rows that
    # carry them: not in layer 1's input (layer 0 attends to deepstack-free rows), in the later ones
    np.testing.assert_allclose(ref["text"][1], flat["text"][1], atol=1e-5, rtol=0)
    for lid in (2, 3):
        assert not np.allclose(ref["text"][lid], flat["text"][lid], atol=1e-4, rtol=0), lid


def test_a_draft_reading_layer_0_of_a_deepstack_target_is_refused(tiny_dir, tmp_path):
    """Layer 0's input on Qwen3-VL is a strided view of the wider (deepstack) input: reading it aborts natively."""
    import pyllama_spec as ps
    from pyllama_spec.drafters.dflash import check_dflash_pair

    models = tiny.make_tiny_set(tiny_dir, arch="qwen3vl", window=32, predictable=0.5)
    draft0 = tiny.write_draft(tmp_path / "d0.gguf", target_layers=(0, 2))
    with ps.Model(models.target) as target, ps.Model(draft0, role="draft") as draft:
        assert target.n_embd_inp > target.n_embd
        with pytest.raises(ps.IncompatibleModelsError, match="layer 0"):
            check_dflash_pair(target, draft, None)
