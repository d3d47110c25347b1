"""The trained tiny pair (pyllama_spec/models, the embedded default; made by tools/train_tiny_pair.py).

* parity: the PyTorch modules the pair was trained as give the same logits as llama.cpp
  (target, on text and after an image's M-RoPE rows; draft block given the same injected
  target features, also at positions that jump as after a skipped image), so acceptance numbers
  measured with llama.cpp are those of the trained draft (skipped without torch);
* speculative greedy output with the trained draft equals target-only output, and the draft is
  accepted, for a text prompt and after an image, in both ``draft_positions`` modes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import CTX_KWARGS, N_THREADS, REPO_ROOT

from pyllama_spec.bindings.batch import Batch
from pyllama_spec.bindings.context import Context
from pyllama_spec.bindings.model import Model
from pyllama_spec.embedded import MODELS_DIR
from pyllama_spec.serving import engine as engine_mod

MODELS = Path(os.environ.get("PYLLAMA_SPEC_TRAINED_MODELS", MODELS_DIR))
TARGET = MODELS / "trained-target.gguf"
DRAFT = MODELS / "trained-draft.gguf"
MMPROJ = MODELS / "trained-mmproj.gguf"

# held-out text style (Python source); the corpus never saw this exact snippet
PROMPT = ('def read_config(path):\n    """Read a configuration file and return a dict."""\n'
          '    result = {}\n    with open(path) as f:\n        for line in f:\n            line = line.strip()\n'
          '            if not line or line.startswith("#"):\n                continue\n')
IMAGE_PROMPT = "<__media__>\n" + PROMPT
# a held-out snippet (optparse.py) whose continuation the draft predicts partly, not a run of
# whitespace that any draft predicts: shows the context's effect
GAP_PROMPT = ("<__media__>\n        # one short option and one long option, either of which\n"
              "        # could be None.\n        opts = [opt for opt in opts if opt]\n        if not opts:\n"
              "            raise TypeError(\"at least one option string must be supplied\")\n        return opts\n\n"
              "    def _set_opt_strings(self, opts):\n        for ")

BIG_BATCH = dict(CTX_KWARGS, n_batch=256, n_ubatch=256)  # the whole prompt in one batch

pytestmark = pytest.mark.skipif(not (TARGET.exists() and DRAFT.exists() and MMPROJ.exists()),
                                reason=f"trained pair not found in {MODELS} (run tools/train_tiny_pair.py)")


def _trainer():
    """tools/train_tiny_pair.py as a module (it is not part of the package)."""
    pytest.importorskip("torch", reason="parity tests need PyTorch (pip install torch): training-only dependency")
    spec = importlib.util.spec_from_file_location("train_tiny_pair", REPO_ROOT / "tools" / "train_tiny_pair.py")
    mod = sys.modules.get("train_tiny_pair")
    if mod is None:
        mod = importlib.util.module_from_spec(spec)
        sys.modules["train_tiny_pair"] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
    mod._torch().set_num_threads(1)
    mod.EMULATE_F16_KV = True  # the contexts below use llama.cpp's default F16 KV cache
    return mod


def _close(a: np.ndarray, b: np.ndarray, rel: float = 1e-3, rel_typical: float = 1e-4) -> float:
    """Rows [n, width] agree: max |diff| <= rel x scale, and the median row's max |diff| <=
    rel_typical x scale (scale = the largest |value|, at least 1).

    With llama.cpp's F16 KV cache (emulated on the PyTorch side) most rows agree to about 1e-6
    of the scale; a few rows differ more where an F16 rounding falls the other way.
    """
    scale = max(1.0, float(np.abs(b).max()))
    rows = np.abs(a - b).reshape(len(a), -1).max(axis=1)
    err, typical = float(rows.max()), float(np.median(rows))
    print(f"parity: max |diff| {err:.3g}, median row {typical:.3g}, scale {scale:.3g}")
    assert err <= rel * scale, f"max |diff| {err:.3g} > {rel} x scale {scale:.3g}"
    assert typical <= rel_typical * scale, f"median row |diff| {typical:.3g} > {rel_typical} x scale {scale:.3g}"
    return err


# ----------------------------------------------------------------------------- parity


def test_target_parity_with_pytorch():
    T = _trainer()
    torch = T._torch()
    target, _, cfg = T.load_pair(TARGET)
    with Model(TARGET) as m, Context(m, **BIG_BATCH) as ctx:
        toks = m.tokenize(PROMPT)
        n = len(toks)
        assert 100 < n <= BIG_BATCH["n_batch"]  # byte-level: about one token per character
        lids = list(range(1, cfg.target_n_layer))
        ctx.enable_layer_inputs(lids)
        ctx.decode_tokens(toks, np.arange(n), outputs=True)
        ours = ctx.output_logits(n).copy()
        feats_cpp = {lid: ctx.layer_input(lid, n).copy() for lid in lids}
    with torch.no_grad():
        logits, feats = target(torch.from_numpy(toks.astype(np.int64))[None], layer_ids=lids)
    _close(ours, logits[0].numpy())
    for lid in lids:
        _close(feats_cpp[lid], feats[lid][0].numpy())
    # the trained target predicts this text far better than chance (ln 269 = 5.6 nats)
    logp = torch.log_softmax(torch.from_numpy(ours[:-1]), -1)
    nll = -logp[torch.arange(n - 1), torch.from_numpy(toks[1:].astype(np.int64))].mean()
    assert float(nll) < 3.0


def _image_prompt_through_llama_cpp(image: np.ndarray, text: str, model: Path = TARGET, mmproj: Path = MMPROJ):
    """Decode [<image>, text] with the trained target (or ``model`` with its projector ``mmproj``) in
    llama.cpp: the rows as PyTorch's target takes them (tokens, -1 on image rows; projector
    embeddings; M-RoPE positions [T, 4]) and llama.cpp's logits and layer inputs for the text rows
    after the image."""
    from pyllama_spec.bindings.mtmd import MEDIA_MARKER, Bitmap, Projector

    with Model(model) as m, Projector(mmproj, m, n_threads=N_THREADS) as proj, Context(m, **BIG_BATCH) as ctx:
        ctx.enable_layer_inputs(range(1, m.n_layer))
        chunks = proj.tokenize(MEDIA_MARKER + text, [Bitmap(image)])
        assert [c.type for c in chunks] == ["text", "image", "text"]
        pre, media, post = chunks[0].tokens, chunks[1], chunks[2].tokens
        ctx.decode_tokens(pre, np.arange(len(pre)))
        embd = proj.encode(media)
        seen = []
        pos = proj.decode_media(ctx, media, embd, len(pre), n_batch=BIG_BATCH["n_batch"],
                                on_batch=lambda b: seen.append(b.positions.T.copy()))
        # (t, h, w, e) as the helper decoded them: decoder_positions() (t, x, y, z), middle columns swapped
        image_pos = media.decoder_positions(len(pre))[:, [0, 2, 1, 3]].astype(np.int64)
        assert np.array_equal(np.concatenate(seen), image_pos)
        n = len(post)
        ctx.decode_tokens(post, pos + np.arange(n), outputs=True)
        logits = ctx.output_logits(n).copy()
        feats = {lid: ctx.layer_input(lid, n).copy() for lid in range(1, m.n_layer)}
    n_img = len(image_pos)
    text_pos = lambda p0, k: np.stack([p0 + np.arange(k)] * 3 + [np.zeros(k, np.int64)], axis=1)  # noqa: E731
    rows = dict(tokens=np.concatenate([pre, np.full(n_img, -1), post]),
                embd=np.concatenate([np.zeros((len(pre), embd.shape[1])), embd, np.zeros((n, embd.shape[1]))]),
                pos=np.concatenate([text_pos(0, len(pre)), image_pos, text_pos(pos, n)]))
    return rows, logits, feats, n


@pytest.mark.parametrize("picture", ["black", "noise"])
def test_target_parity_after_an_image(picture):
    """M-RoPE image rows: PyTorch's target (as the training script feeds it images) gives
    llama.cpp's logits and layer inputs for the text after a picture."""
    T = _trainer()
    torch = T._torch()
    target, _, cfg = T.load_pair(TARGET)
    image = (np.zeros((336, 448, 3), np.uint8) if picture == "black"
             else np.random.default_rng(0).integers(0, 256, (336, 448, 3), dtype=np.uint8))
    rows, ours, feats_cpp, n = _image_prompt_through_llama_cpp(image, PROMPT[:120])
    with torch.no_grad():
        logits, feats = target(torch.from_numpy(rows["tokens"].astype(np.int64))[None],
                               torch.from_numpy(rows["pos"])[None], layer_ids=list(feats_cpp),
                               embd=torch.from_numpy(rows["embd"].astype(np.float32))[None])
    _close(ours, logits[0, -n:].numpy())
    for lid, f in feats_cpp.items():
        _close(f, feats[lid][0, -n:].numpy())


# 50 context rows > the draft's 32-position window; 4 rows: a draft_max 3 block; gap: the
# positions jump by that much halfway (text after a skipped image in "target" mode), so the
# window holds fewer rows than positions, as the training script's image sequences assume
@pytest.mark.parametrize("n_ctx_rows,block_rows,gap", [(20, 16, 0), (50, 16, 0), (50, 4, 0), (40, 16, 12)])
def test_draft_block_parity_with_pytorch(n_ctx_rows, block_rows, gap):
    T = _trainer()
    torch = T._torch()
    target, draft, cfg = T.load_pair(TARGET, DRAFT)
    with Model(TARGET) as m, Model(DRAFT, role="draft") as d, Context(m, **CTX_KWARGS) as ctx:
        toks = m.tokenize(PROMPT)[:n_ctx_rows]
        n = len(toks)
        ids = d.target_layer_ids
        assert tuple(ids) == tuple(cfg.target_layers)
        ctx.enable_layer_inputs(ids)
        ctx.decode_tokens(toks, np.arange(n), outputs=True)
        id_last = int(np.argmax(ctx.logits(-1)))
        features = np.concatenate([ctx.layer_input(lid, n) for lid in ids], axis=1).copy()

        bs = cfg.block_size
        assert block_rows <= bs
        with Context(d, ctx_other=ctx, role="draft", **CTX_KWARGS) as dctx:
            dctx.enable_draft_embeddings(True, True)
            dctx.set_causal_attn(False)
            p = np.arange(n, dtype=np.int32)
            p[n // 2:] += gap
            with Batch(dctx) as batch:
                batch.add_embeddings(features, np.stack([p, p, p, np.zeros_like(p)], axis=1))
                dctx.decode(batch)
            block = [id_last] + [d.mask_token] * (block_rows - 1)
            a = int(p[-1]) + 1
            dctx.decode_tokens(block, np.arange(a, a + block_rows), outputs=True)
            ours = dctx.output_logits(block_rows).copy()

    with torch.no_grad():
        feats = torch.from_numpy(np.concatenate([features, np.zeros_like(features[:1])]))[None]
        tokens = torch.from_numpy(np.append(toks, id_last).astype(np.int64))[None]
        lengths = torch.tensor([[block_rows]])
        ctx_pos = torch.from_numpy(np.append(p, a).astype(np.int64))[None]
        theirs, _ = T.draft_block_logits(draft, target, feats, tokens, torch.tensor([[n]]), cfg, lengths,
                                         ctx_pos=ctx_pos)
    _close(ours, theirs[0, :block_rows].numpy())
    # the context matters: without it (a block at position 0) the logits differ
    with torch.no_grad():
        blind, _ = T.draft_block_logits(draft, target, feats, tokens, torch.tensor([[0]]), cfg, lengths)
    assert not np.allclose(blind[0, 1:block_rows].numpy(), ours[1:], atol=1e-2)
    if gap:  # and the positions matter: the same rows at consecutive positions give other logits
        with torch.no_grad():
            packed, _ = T.draft_block_logits(draft, target, feats, tokens, torch.tensor([[n]]), cfg, lengths)
        assert not np.allclose(packed[0, :block_rows].numpy(), ours, atol=1e-2)


# ----------------------------------------------------------------------------- lossless + accepted

MAX_TOKENS = 48


@pytest.fixture(scope="module")
def baseline():
    """Target-only greedy tokens for the text and the image prompt."""
    with engine_mod.load(TARGET, mmproj=MMPROJ, n_threads=N_THREADS) as eng:
        text = eng.generate(PROMPT, max_tokens=MAX_TOKENS).tokens
        image = eng.generate(IMAGE_PROMPT, images=[np.zeros((672, 672, 3), np.uint8)], max_tokens=MAX_TOKENS,
                             cache_prompt=False).tokens
    assert len(text) >= MAX_TOKENS // 2 and len(image) >= MAX_TOKENS // 2  # no early end of generation
    return {"text": text, "image": image}


@pytest.mark.parametrize("draft_positions", ["target", "sequential"])
@pytest.mark.parametrize("kind", ["text", "image"])
def test_trained_draft_is_lossless_and_accepted(baseline, kind, draft_positions):
    with engine_mod.load(TARGET, mmproj=MMPROJ, draft=DRAFT, n_threads=N_THREADS, draft_max=7,
                         draft_positions=draft_positions) as eng:
        if kind == "text":
            res = eng.generate(PROMPT, max_tokens=MAX_TOKENS)
        else:
            res = eng.generate(IMAGE_PROMPT, images=[np.zeros((672, 672, 3), np.uint8)], max_tokens=MAX_TOKENS)
    assert res.tokens == baseline[kind]
    s = res.stats
    assert s.drafted > 0 and s.accepted > 0, s.as_dict()
    assert s.mean_accepted_length > 1.2, s.as_dict()


def test_committed_files_are_small_and_documented():
    for f in (TARGET, DRAFT, MMPROJ):
        assert f.stat().st_size < 2_000_000, f
    readme = (MODELS / "README.md").read_text()
    assert "tools/train_tiny_pair.py" in readme and "--seed" in readme


def test_blocks_at_the_token_count_lose_the_context_after_an_image():
    """The old placement (draft block at the row count, 552 rows past the image's 24 positions, so
    outside the draft's window) stays lossless but accepts less than blocks at the target's position."""
    image = [np.zeros((672, 672, 3), np.uint8)]
    with engine_mod.load(TARGET, mmproj=MMPROJ, n_threads=N_THREADS) as eng:
        reference = eng.generate(GAP_PROMPT, images=image, max_tokens=MAX_TOKENS).tokens
    accepted = {}
    for old in (False, True):
        with engine_mod.load(TARGET, mmproj=MMPROJ, draft=DRAFT, n_threads=N_THREADS, draft_max=7) as eng:
            if old:  # each block asked for at the sequence's row count, as upstream's caller placed it
                draft = eng.drafter.draft
                eng.drafter.draft = lambda requests: draft(
                    [dataclasses.replace(rq, draft_pos=eng.positions.n_rows) for rq in requests])
            res = eng.generate(GAP_PROMPT, images=image, max_tokens=MAX_TOKENS)
        assert res.tokens == reference
        accepted[old] = res.stats.mean_accepted_length
    assert accepted[False] > accepted[True], accepted
