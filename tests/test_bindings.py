"""The cffi bindings against the real pinned libllama/libmtmd and the tiny GGUF models.

Each test states one property of Model, Context, Memory, Sampler, Batch, Projector,
Bitmap and Chunks that the speculative-decoding engine relies on.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from conftest import BIG_IMAGE_N_POS, BIG_IMAGE_N_TOKENS, N_THREADS
from conftest import explain_child as explain

import pyllama_spec
from pyllama_spec.bindings.batch import Batch
from pyllama_spec.bindings.context import Context
from pyllama_spec.bindings.model import Model
from pyllama_spec.bindings.sampler import Sampler
from pyllama_spec.bindings.mtmd import MEDIA_MARKER, Bitmap, Projector
from pyllama_spec.bindings.native_info import build_record
from pyllama_spec.devtools import tiny
from pyllama_spec.errors import ClosedError, KVMemoryError

PROMPT = "hello there, the answer is"
LONG_PROMPT = PROMPT + " not in the tiny models"  # > 17 tokens


def decode_text(ctx: Context, text: str, pos0: int = 0, *, outputs=True) -> np.ndarray:
    """Tokenize text with ctx's model and decode it at pos0.. (logits on the last row by default)."""
    toks = ctx.model.tokenize(text)
    out = outputs
    if outputs is True:
        out = np.zeros(len(toks), dtype=bool)
        out[-1] = True
    ctx.decode_tokens(toks, np.arange(pos0, pos0 + len(toks)), outputs=out)
    return toks


# ----------------------------------------------------------------------------- loading


@pytest.mark.parametrize("which,arch,recurrent", [("tiny_dense", "hunyuan_vl", False),
                                                   ("tiny_hybrid", "qwen35", True)])
def test_targets_load_with_their_facts(request, which, arch, recurrent):
    models = request.getfixturevalue(which)
    with Model(models.target) as m:
        assert m.arch == arch
        assert m.n_embd == 64 and m.n_layer == 4
        assert m.is_mrope and m.n_pos_per_embd == 4
        assert m.is_recurrent is recurrent
        assert m.n_vocab == tiny.N_VOCAB
        assert m.eos == tiny.EOS_TOKEN_ID and not m.add_bos
        assert m.target_layer_ids == []  # a target records no DFlash facts
        assert m.mask_token == -1  # only the draft's vocabulary names a mask token
        assert m.chat_template == tiny.CHAT_TEMPLATE


def test_draft_loads_with_dflash_facts(tiny_dense):
    with Model(tiny_dense.draft, role="draft") as d:
        assert d.arch == "dflash"
        assert d.n_embd == 64
        assert d.n_layer == 1
        assert d.target_layer_ids == [1, 3]
        assert d.mask_token == tiny.MASK_TOKEN_ID
        assert d.n_swa == 32  # the window the draft was written with
        assert d.meta("dflash.block_size") == "16"
        # temporal-only sections still make it an M-RoPE model: embedding rows take 4 positions
        assert d.is_mrope and d.n_pos_per_embd == 4


def test_mmproj_loads_for_its_target(tiny_dense):
    with Model(tiny_dense.target) as m, Projector(tiny_dense.mmproj, m, n_threads=N_THREADS) as p:
        assert p.supports_vision and not p.supports_audio
        assert p.uses_mrope
        assert p.model is m


def test_media_marker_is_mtmds_default():
    assert MEDIA_MARKER == "<__media__>"
    assert pyllama_spec.MEDIA_MARKER == MEDIA_MARKER


def test_native_log_reaches_python_logging(tiny_dense, caplog):
    caplog.set_level(logging.DEBUG, logger="pyllama_spec.native")
    with Model(tiny_dense.target):
        pass
    native = [r for r in caplog.records if r.name == "pyllama_spec.native"]
    assert native, "no native log line reached the 'pyllama_spec.native' logger"
    assert any(str(tiny_dense.target) in r.getMessage() for r in native)  # the loader names the file
    assert {r.levelno for r in native} & {logging.INFO, logging.DEBUG}
    assert all("\n" not in r.getMessage() for r in native)  # one record per whole line


def test_build_record_names_the_pin_and_dflash_archs():
    rec = build_record()
    assert rec["pin"]["package"] == "llama-cpp-python"
    assert rec["pin"]["version"] == "0.3.36"
    sha = rec["pin"]["sha256"]
    assert len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)
    archs = set(rec["dflash_target_archs"])
    assert {"hunyuan_vl", "qwen35"} <= archs
    # qwen2vl/qwen3vl record their layer inputs only with patches/0001 (unpatched, they would abort).
    patched = "0001-record-layer-inputs-qwen-vl.patch" in rec["patches"]
    assert ({"qwen2vl", "qwen3vl", "qwen3vlmoe"} <= archs) == patched
    assert not patched or rec["source"]["origin"] == "pinned"


# ----------------------------------------------------------------------------- vocabulary


@pytest.mark.parametrize("text", ["hello there, the answer", "héllo wörld — 日本語 🙂", " leading and trailing  "])
def test_tokenize_detokenize_round_trip(tiny_dense, text):
    with Model(tiny_dense.target) as m:
        toks = m.tokenize(text)
        assert toks.dtype == np.int32 and len(toks) > 0
        assert ((0 <= toks) & (toks < m.n_vocab)).all()
        assert m.detokenize(toks) == text
        assert b"".join(m.token_to_bytes(int(t)) for t in toks) == text.encode("utf-8")


def test_a_token_outside_the_vocabulary_is_a_value_error_and_pieces_are_kept_once_read(tiny_dense, run_python):
    """llama.cpp throws std::out_of_range past its vocabulary (the process ends): checked first. A
    piece read once is kept (each streamed token asks for one), and still refused once closed."""
    proc = run_python(f"""
from pyllama_spec.bindings.model import Model
m = Model({str(tiny_dense.target)!r})
for bad in (-1, m.n_vocab, m.n_vocab + 5):
    for call in (lambda: m.token_to_bytes(bad), lambda: m.token_to_bytes(bad, special=True),
                 lambda: m.token_text(bad), lambda: m.detokenize([1, bad])):
        try:
            call()
        except ValueError as e:
            assert "not in the vocabulary" in str(e), e
        else:
            raise SystemExit("no ValueError for " + str(bad))
t = int(m.tokenize("hello")[0])
first = m.token_to_bytes(t)
assert m.token_to_bytes(t) is first and first
m.close()
try:
    m.token_to_bytes(t)
except Exception as e:
    print("closed:", type(e).__name__)
""")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "closed: ClosedError" in proc.stdout


def test_tokenize_parses_control_tokens(tiny_dense):
    with Model(tiny_dense.draft, role="draft") as d:
        assert d.tokenize(tiny.MASK_TOKEN).tolist() == [tiny.MASK_TOKEN_ID]
        assert d.tokenize(tiny.MASK_TOKEN, parse_special=False).tolist() != [tiny.MASK_TOKEN_ID]
        assert d.detokenize([tiny.MASK_TOKEN_ID], special=True) == tiny.MASK_TOKEN
        assert d.detokenize([tiny.MASK_TOKEN_ID]) == ""


# ----------------------------------------------------------------------------- decode, logits, sampling


def test_decode_gives_finite_logits_and_greedy_takes_argmax(tiny_dense, ctx_kwargs):
    with Model(tiny_dense.target) as m, Context(m, **ctx_kwargs) as ctx:
        decode_text(ctx, PROMPT)
        logits = ctx.logits()
        assert logits.shape == (m.n_vocab,) and logits.dtype == np.float32
        assert np.isfinite(logits).all()
        assert logits.std() > 0
        with Sampler(m) as greedy:
            assert greedy.greedy
            assert greedy.sample(ctx) == int(np.argmax(logits))


def test_logits_on_every_row_when_asked(tiny_dense, ctx_kwargs):
    with Model(tiny_dense.target) as m, Context(m, **ctx_kwargs) as ctx:
        n_prompt = len(m.tokenize(PROMPT))
        toks = decode_text(ctx, PROMPT, outputs=np.ones(n_prompt, dtype=bool))
        rows = np.stack([ctx.logits(i) for i in range(len(toks))])
        assert np.isfinite(rows).all()
        assert np.array_equal(rows[-1], ctx.logits(-1))
        assert not np.allclose(rows[0], rows[-1])


def test_sampler_with_temperature_is_deterministic_per_seed(tiny_dense, ctx_kwargs):
    with Model(tiny_dense.target) as m, Context(m, **ctx_kwargs) as ctx:
        decode_text(ctx, PROMPT)

        def draws(seed: int) -> list[int]:
            with Sampler(m, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=seed) as s:
                assert not s.greedy
                return [s.sample(ctx) for _ in range(24)]

        a, b, c = draws(7), draws(7), draws(8)
        assert a == b
        assert a != c
        assert len(set(a)) > 1  # it really samples


# ----------------------------------------------------------------------------- memory


def test_memory_tracks_positions_and_removes_a_tail(tiny_dense, ctx_kwargs):
    with Model(tiny_dense.target) as m, Context(m, **ctx_kwargs) as ctx:
        mem = ctx.memory
        assert mem.pos_max() == -1 and mem.pos_min() == -1
        toks = decode_text(ctx, PROMPT)
        n = len(toks)
        assert mem.pos_min() == 0 and mem.pos_max() == n - 1
        p = n - 5
        mem.remove(0, p, -1)
        assert mem.pos_max() == p - 1
        # decoding continues from the cut
        ctx.decode_tokens(toks[p:], np.arange(p, n), outputs=[False] * 4 + [True])
        assert mem.pos_max() == n - 1
        mem.clear()
        assert mem.pos_max() == -1


def test_hybrid_rollback_needs_n_rs_seq(tiny_hybrid, ctx_kwargs):
    with Model(tiny_hybrid.target) as m:
        assert m.is_recurrent
        with Context(m, **ctx_kwargs) as ctx:  # n_rs_seq = 0: no recurrent-state history
            n = len(decode_text(ctx, LONG_PROMPT))
            with pytest.raises(KVMemoryError, match="n_rs_seq"):
                ctx.memory.remove(0, n - 1, -1)
            assert ctx.memory.pos_max() == n - 1  # a refused rollback leaves the memory as it was
            ctx.memory.remove(0, 0, -1)  # dropping the whole sequence is always possible
            assert ctx.memory.pos_max() == -1

        for back in (1, 4, 16):
            with Context(m, n_rs_seq=16, **ctx_kwargs) as ctx:
                n = len(decode_text(ctx, LONG_PROMPT))
                ctx.memory.remove(0, n - back, -1)
                assert ctx.memory.pos_max() == n - back - 1
                ctx.memory.clear()
                assert ctx.memory.pos_max() == -1

        # n_rs_seq is also the rollback depth: 17 positions back is beyond 16 snapshots
        with Context(m, n_rs_seq=16, **ctx_kwargs) as ctx:
            n = len(decode_text(ctx, LONG_PROMPT))
            assert n > 17
            with pytest.raises(KVMemoryError):
                ctx.memory.remove(0, n - 17, -1)
            assert ctx.memory.pos_max() == n - 1


# ----------------------------------------------------------------------------- images


@pytest.fixture
def dense_vision(tiny_dense, ctx_kwargs):
    """(target model, target context, projector) on the dense tiny set, closed afterwards."""
    with Model(tiny_dense.target) as m, Context(m, **ctx_kwargs) as ctx, \
            Projector(tiny_dense.mmproj, m, n_threads=N_THREADS) as proj:
        yield m, ctx, proj


def test_image_prompt_splits_into_text_image_text(dense_vision, big_image):
    m, _, proj = dense_vision
    with proj.tokenize(f"look: {MEDIA_MARKER} what?", [Bitmap.load(big_image)]) as chunks:
        assert [c.type for c in chunks] == ["text", "image", "text"]
        first, img, last = chunks
        # mtmd wraps the image in the vision start/end control tokens
        assert first.tokens[-1] == tiny.TOKEN_ID[tiny.VISION_START]
        assert last.tokens[0] == tiny.TOKEN_ID[tiny.VISION_END]
        assert m.detokenize(first.tokens[:-1]) == "look: "
        assert img.n_tokens == BIG_IMAGE_N_TOKENS
        assert img.n_pos == BIG_IMAGE_N_POS < img.n_tokens  # rows != positions
        assert img.id is not None
        with pytest.raises(ValueError):
            img.tokens  # noqa: B018 - an image chunk has no token ids
        assert chunks.n_tokens == first.n_tokens + img.n_tokens + last.n_tokens
        assert chunks.n_pos == first.n_pos + img.n_pos + last.n_pos


def test_image_rows_share_one_temporal_position(dense_vision, big_image):
    _, _, proj = dense_vision
    with proj.tokenize(MEDIA_MARKER, [Bitmap.load(big_image)]) as chunks:
        img = next(c for c in chunks if c.type == "image")
        pos0 = 10
        pos = img.decoder_positions(pos0)
        assert pos.shape == (BIG_IMAGE_N_TOKENS, 4)
        t, x, y, z = pos.T
        assert (t == pos0).all()  # section 0 (temporal) is the same for every row
        side = int(np.sqrt(BIG_IMAGE_N_TOKENS))
        assert sorted(set(x.tolist())) == list(range(pos0, pos0 + side))
        assert sorted(set(y.tolist())) == list(range(pos0, pos0 + side))
        assert (z == 0).all()
        assert len({(a, b) for a, b in zip(x.tolist(), y.tolist())}) == BIG_IMAGE_N_TOKENS  # one row per cell


def test_decode_media_advances_by_n_pos_and_shows_each_slice(dense_vision, big_image):
    m, ctx, proj = dense_vision
    with proj.tokenize(MEDIA_MARKER, [Bitmap.load(big_image)]) as chunks:
        img = next(c for c in chunks if c.type == "image")
        embd = proj.encode(img)
        assert embd.shape == (img.n_tokens, m.n_embd_inp) and np.isfinite(embd).all()
        assert proj.n_encode_calls == 1

        pos0 = 3
        ctx.decode_tokens(m.tokenize("abc"), np.arange(pos0))  # something before the image
        slices = []
        next_pos = proj.decode_media(ctx, img, embd, pos0, n_batch=64,
                                     on_batch=lambda b: slices.append((b.n_rows, b.positions.copy(), b.seq_id)))
        assert next_pos == pos0 + img.n_pos == pos0 + BIG_IMAGE_N_POS
        # the cache gained n_tokens rows, all at the image's one temporal position
        assert ctx.memory.pos_max() == pos0
        assert ctx.memory.pos_max() < pos0 + img.n_tokens - 1

        assert [n for n, _, _ in slices] == [64] * (BIG_IMAGE_N_TOKENS // 64)
        assert all(seq == 0 for _, _, seq in slices)
        for n, positions, _ in slices:
            assert positions.shape == (4, n)  # section-major: n_pos sections x rows
            assert (positions[0] == pos0).all()  # section 0 constant within the image
            assert (positions[3] == 0).all()
        seen = np.concatenate([p for _, p, _ in slices], axis=1).T
        # the context's sections are (t, y, x, z): mtmd writes .y to section 1 and .x to section 2,
        # so they are decoder_positions() (t, x, y, z) with the middle columns swapped
        assert np.array_equal(seen.astype(np.uint32), img.decoder_positions(pos0)[:, [0, 2, 1, 3]])
        # the engine decodes media slice by slice itself (sequence.py), with these same rows
        assert np.array_equal(seen, proj.media_positions(img, pos0))

        # text after the image continues at next_pos
        ctx.decode_tokens(m.tokenize("ok"), [next_pos, next_pos + 1], outputs=[False, True])
        assert ctx.memory.pos_max() == next_pos + 1
        assert np.isfinite(ctx.logits()).all()


def test_decode_media_callback_error_propagates(dense_vision, big_image):
    _, ctx, proj = dense_vision
    with proj.tokenize(MEDIA_MARKER, [Bitmap.load(big_image)]) as chunks:
        img = chunks[1] if chunks[0].is_text else chunks[0]
        embd = proj.encode(img)
        calls = []

        def stop(batch):
            calls.append(batch.n_rows)
            if len(calls) == 2:
                raise KeyError("stop here")

        with pytest.raises(KeyError, match="stop here"):
            proj.decode_media(ctx, img, embd, 0, n_batch=64, on_batch=stop)
        assert calls == [64, 64]  # the chunk stopped at the failing slice


def test_image_from_png_file_equals_the_array(dense_vision, big_image, big_image_png):
    _, _, proj = dense_vision
    a, b = Bitmap.load(big_image), Bitmap.load(big_image_png)
    assert (a.width, a.height) == (b.width, b.height) == (672, 672)
    assert a.id == b.id  # same pixels, same cache id
    with proj.tokenize(MEDIA_MARKER, [b]) as chunks:
        assert [c.n_tokens for c in chunks if not c.is_text] == [BIG_IMAGE_N_TOKENS]


# ----------------------------------------------------------------------------- DFlash building blocks


def test_layer_inputs_of_chosen_target_layers(tiny_dense, ctx_kwargs):
    with Model(tiny_dense.target) as m, Model(tiny_dense.draft, role="draft") as d, \
            Context(m, **ctx_kwargs) as ctx:
        ids = d.target_layer_ids
        ctx.enable_layer_inputs(ids)
        n = len(decode_text(ctx, PROMPT))
        feats = {lid: np.array(ctx.layer_input(lid, n)) for lid in ids}
        for lid, f in feats.items():
            assert f.shape == (n, m.n_embd) and f.dtype == np.float32
            assert np.isfinite(f).all()
            assert np.abs(f).max() > 0
        assert not np.allclose(feats[ids[0]], feats[ids[1]])
        # rows are per token: two different tokens give different inputs
        assert not np.allclose(feats[ids[0]][0], feats[ids[0]][1])

        not_enabled = next(i for i in range(m.n_layer) if i not in ids)
        with pytest.raises(ValueError, match="enable_layer_inputs"):
            ctx.layer_input(not_enabled, n)
        with pytest.raises(ValueError):
            ctx.layer_input(ids[0], 0)
        # the process is still alive and the context still works
        ctx.decode_tokens(m.tokenize("!"), [n], outputs=True)
        assert np.isfinite(ctx.logits()).all()


def _draft_context(d: Model, target_ctx: Context, ctx_kwargs: dict) -> Context:
    dctx = Context(d, ctx_other=target_ctx, role="draft", **ctx_kwargs)
    dctx.enable_draft_embeddings(True, True)
    dctx.set_causal_attn(False)
    return dctx


def test_one_dflash_feature_injection_and_draft_block(tiny_dense, ctx_kwargs):
    with Model(tiny_dense.target) as m, Model(tiny_dense.draft, role="draft") as d, \
            Context(m, **ctx_kwargs) as ctx:
        ids = d.target_layer_ids
        ctx.enable_layer_inputs(ids)
        n = len(decode_text(ctx, PROMPT))
        id_last = int(np.argmax(ctx.logits()))
        features = np.concatenate([ctx.layer_input(lid, n) for lid in ids], axis=1)
        assert features.shape == (n, len(ids) * m.n_embd)

        block_size = int(d.meta("dflash.block_size"))
        block = [id_last] + [d.mask_token] * (block_size - 1)
        block_pos = np.arange(n, n + block_size)

        dctx = _draft_context(d, ctx, ctx_kwargs)
        p = np.arange(n, dtype=np.int32)
        assert d.n_pos_per_embd == 4  # the draft ropes on the temporal section only: (p, p, p, 0)
        positions = np.stack([p, p, p, np.zeros_like(p)], axis=1)
        with Batch(dctx) as batch:
            batch.add_embeddings(features, positions)
            assert batch.has_embeddings and batch.n_rows == n
            assert batch.positions.tolist() == p.tolist()
            dctx.decode(batch)
        assert dctx.memory.pos_max() == n - 1

        dctx.decode_tokens(block, block_pos, outputs=True)
        assert dctx.memory.pos_max() == n + block_size - 1
        rows = np.stack([dctx.logits(i) for i in range(block_size)])
        assert rows.shape == (block_size, m.n_vocab)  # the target's vocabulary, through ctx_other
        assert np.isfinite(rows).all()
        # the predictable tiny draft proposes the attractor at every mask position
        assert (rows[1:].argmax(axis=1) == tiny.ATTRACTOR_TOKEN_ID).all()

        # the injected context matters: an empty draft cache gives other logits for the same block
        with _draft_context(d, ctx, ctx_kwargs) as empty:
            empty.decode_tokens(block, block_pos, outputs=True)
            assert not np.allclose(empty.logits(1), rows[1])

        # noise rows of the block are removed before verification
        dctx.memory.remove(0, n, -1)
        assert dctx.memory.pos_max() == n - 1
        dctx.close()


# ----------------------------------------------------------------------------- ownership


def test_closing_a_model_closes_its_contexts(tiny_dense, ctx_kwargs):
    m = Model(tiny_dense.target)
    ctx = Context(m, **ctx_kwargs)
    sampler = Sampler(m)
    m.close()
    assert m.closed and ctx.closed
    with pytest.raises(ClosedError):
        ctx.decode_tokens([1], [0])
    with pytest.raises(ClosedError):
        ctx.memory.pos_max()
    with pytest.raises(ClosedError):
        m.tokenize("hi")
    with pytest.raises(ClosedError):
        m.n_embd  # noqa: B018
    with pytest.raises(ClosedError):
        sampler.sample(ctx)
    assert isinstance(ClosedError("x"), ValueError)
    m.close()
    ctx.close()  # double close is fine
    sampler.close()
    sampler.close()
    with pytest.raises(ClosedError):
        sampler.accept(1)


def test_closing_the_target_context_closes_its_draft(tiny_dense, ctx_kwargs):
    with Model(tiny_dense.target) as m, Model(tiny_dense.draft, role="draft") as d:
        tctx = Context(m, **ctx_kwargs)
        dctx = _draft_context(d, tctx, ctx_kwargs)
        tctx.close()
        assert dctx.closed
        assert not d.closed  # the draft model itself stays usable
        with pytest.raises(ClosedError):
            dctx.logits()
        with pytest.raises(ClosedError):
            Context(d, ctx_other=tctx, **ctx_kwargs)  # cannot borrow from a closed context
        with pytest.raises(ClosedError):
            Batch(tctx)
        # a new pair works
        with Context(m, **ctx_kwargs) as t2, _draft_context(d, t2, ctx_kwargs) as d2:
            decode_text(t2, PROMPT)
            assert not d2.closed
    assert dctx.closed


def test_context_managers_close_on_exit(tiny_dense, ctx_kwargs, big_image):
    with Model(tiny_dense.target) as m:
        with Context(m, **ctx_kwargs) as ctx:
            assert not ctx.closed
        assert ctx.closed
        with Projector(tiny_dense.mmproj, m, n_threads=N_THREADS) as proj:
            with Bitmap.load(big_image) as bmp:
                chunks = proj.tokenize(MEDIA_MARKER, [bmp])
            assert bmp.closed
            with chunks:
                assert len(chunks) >= 1
            assert chunks.closed
            with pytest.raises(ClosedError):
                len(chunks)
        assert proj.closed
        with pytest.raises(ClosedError):
            proj.tokenize("hi")
        with pytest.raises(ClosedError):
            proj.tokenize(MEDIA_MARKER, [bmp])  # closed bitmap
        assert not m.closed
    assert m.closed
    with pytest.raises(ClosedError):
        Context(m, **ctx_kwargs)


def test_projector_is_unusable_after_its_model_closes(tiny_dense, run_python):
    # in a child process: today this is undefined behaviour in native code
    res = run_python("""
        import sys, numpy as np
        from pyllama_spec.bindings.model import Model
        from pyllama_spec.bindings.mtmd import Projector, Bitmap, MEDIA_MARKER
        from pyllama_spec.errors import ClosedError
        m = Model(sys.argv[1])
        p = Projector(sys.argv[2], m, n_threads=1)
        m.close()
        try:
            p.tokenize("hi " + MEDIA_MARKER, [Bitmap.load(np.zeros((64, 64, 3), np.uint8))])
        except ClosedError:
            sys.exit(0)
        except Exception as e:
            print("wrong error:", type(e).__name__, e)
            sys.exit(3)
        print("no error")
        sys.exit(4)
    """, str(tiny_dense.target), str(tiny_dense.mmproj))
    assert res.returncode == 0, explain(res)
