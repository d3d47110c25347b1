"""The PyTorch qwen35 target and MTP head of tools/train_qwen35_mtp.py compute what llama.cpp computes.

On a random file written by the trainer (and on the committed trained one, when present):

* the target's logits and the hidden state its MTP head reads (``h_nextn``), on text and after an
  image's M-RoPE rows (a ``qwen3vl_merger`` projector), equal llama.cpp's; its first layer is a
  gated delta net, the others full attention with an output gate (``layer plan`` in the trainer);
* the MTP head's logits and hidden state, given the rows (x_i, h_{i-1}) in an MTP context, equal
  llama.cpp's, and so does a chained draft step (a drafted token with the head's own hidden state),
  the step the trainer's second pass teaches.

The parity tests are skipped without torch (a training-only dependency). Without torch, on the
committed files: speculative greedy output with ``spec_type="draft-mtp"`` equals target-only output
and the head's drafts are accepted, for text prompts and after an image.
"""

from __future__ import annotations

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
from pyllama_spec.devtools import tiny
from pyllama_spec.embedded import MODELS_DIR

MODELS = Path(os.environ.get("PYLLAMA_SPEC_TRAINED_MODELS", MODELS_DIR))
TRAINED = MODELS / "trained-qwen35-mtp.gguf"
TRAINED_MMPROJ = MODELS / "trained-qwen35-mtp-mmproj.gguf"
PROMPT = ('def read_config(path):\n    """Read a configuration file and return a dict."""\n'
          '    result = {}\n    with open(path) as f:\n        for line in f:\n            line = line.strip()\n')
BIG_BATCH = dict(CTX_KWARGS, n_batch=256, n_ubatch=256)


def _trainer():
    """tools/train_qwen35_mtp.py as a module (it is not part of the package)."""
    pytest.importorskip("torch", reason="parity tests need PyTorch (pip install torch): training-only dependency")
    tools = str(REPO_ROOT / "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    mod = sys.modules.get("train_qwen35_mtp")
    if mod is None:
        spec = importlib.util.spec_from_file_location("train_qwen35_mtp", REPO_ROOT / "tools" / "train_qwen35_mtp.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["train_qwen35_mtp"] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
    mod._torch().set_num_threads(1)
    mod.T.EMULATE_F16_KV = True  # the contexts below use llama.cpp's default F16 KV cache
    return mod


def _close(a: np.ndarray, b: np.ndarray, rel: float = 1e-3, rel_typical: float = 1e-4) -> float:
    """Rows agree: max |diff| <= rel x scale, median row's max |diff| <= rel_typical x scale
    (scale: the largest |value|, at least 1); see tests/test_trained_pair.py."""
    scale = max(1.0, float(np.abs(b).max()))
    rows = np.abs(a - b).reshape(len(a), -1).max(axis=1)
    err, typical = float(rows.max()), float(np.median(rows))
    print(f"parity: max |diff| {err:.3g}, median row {typical:.3g}, scale {scale:.3g}")
    assert err <= rel * scale, f"max |diff| {err:.3g} > {rel} x scale {scale:.3g}"
    assert typical <= rel_typical * scale, f"median row |diff| {typical:.3g} > {rel_typical} x scale {scale:.3g}"
    return err


@pytest.fixture(scope="module")
def random_files(tmp_path_factory):
    Q = _trainer()
    folder = tmp_path_factory.mktemp("qwen35-mtp")
    target = Q.write_random(folder / "random-qwen35-mtp.gguf", seed=1)
    mmproj = tiny.write_mmproj(folder / "mmproj.gguf", target_n_embd=Q.N_EMBD, seed=1, projector="qwen3vl_merger")
    return target, mmproj


def _files(which, random_files):
    if which == "random":
        return random_files
    if not (TRAINED.exists() and TRAINED_MMPROJ.exists()):
        pytest.skip(f"the trained qwen35 + MTP files are not in {MODELS} (run tools/train_qwen35_mtp.py)")
    return TRAINED, TRAINED_MMPROJ


def _llama_cpp_text(target, toks):
    """llama.cpp's logits and h_nextn rows of the target for one batch of text."""
    with Model(target) as m, Context(m, **BIG_BATCH) as ctx:
        ctx.enable_draft_embeddings(True, masked=False)
        ctx.decode_tokens(toks, np.arange(len(toks)), outputs=True)
        return ctx.output_logits(len(toks)).copy(), ctx.draft_embeddings(len(toks)).copy()


@pytest.mark.parametrize("which", ["random", "trained"])
def test_target_logits_and_hidden_state_equal_llama_cpp(which, random_files):
    Q = _trainer()
    torch = Q._torch()
    target_path, _ = _files(which, random_files)
    target, head, cfg = Q.load(target_path)
    assert head is not None and cfg.recurrent[0] and not any(cfg.recurrent[1:])
    with Model(target_path) as m:
        toks = m.tokenize(PROMPT)
    assert 100 < len(toks) <= BIG_BATCH["n_batch"]
    logits_cpp, h_cpp = _llama_cpp_text(target_path, toks)
    with torch.no_grad():
        logits, h = target(torch.from_numpy(toks.astype(np.int64))[None])
    _close(logits_cpp, logits[0].numpy())
    _close(h_cpp, h[0].numpy())
    if which == "trained":  # far better than chance (ln 269 = 5.6 nats)
        logp = torch.log_softmax(torch.from_numpy(logits_cpp[:-1]), -1)
        nll = -logp[torch.arange(len(toks) - 1), torch.from_numpy(toks[1:].astype(np.int64))].mean()
        assert float(nll) < 3.0


def _image_prompt_through_llama_cpp(target_path, mmproj_path, image, text):
    """[<image>, text] through llama.cpp: the rows as the PyTorch target takes them (tokens, -1 on
    image rows; embeddings; M-RoPE positions [T, 4]) and llama.cpp's logits / h_nextn of the text after."""
    from pyllama_spec.bindings.mtmd import MEDIA_MARKER, Bitmap, Projector

    with Model(target_path) as m, Projector(mmproj_path, m, n_threads=N_THREADS) as proj, \
            Context(m, **BIG_BATCH) as ctx:
        ctx.enable_draft_embeddings(True, masked=False)
        chunks = proj.tokenize(MEDIA_MARKER + text, [Bitmap(image)])
        assert [c.type for c in chunks] == ["text", "image", "text"]
        pre, media, post = chunks[0].tokens, chunks[1], chunks[2].tokens
        ctx.decode_tokens(pre, np.arange(len(pre)))
        embd = proj.encode(media)
        seen = []
        pos = proj.decode_media(ctx, media, embd, len(pre), n_batch=BIG_BATCH["n_batch"],
                                on_batch=lambda b: seen.append(b.positions.T.copy()))
        image_pos = media.decoder_positions(len(pre))[:, [0, 2, 1, 3]].astype(np.int64)
        assert np.array_equal(np.concatenate(seen), image_pos)
        n = len(post)
        ctx.decode_tokens(post, pos + np.arange(n), outputs=True)
        logits, h = ctx.output_logits(n).copy(), ctx.draft_embeddings(n).copy()
    n_img = len(image_pos)
    text_pos = lambda p0, k: np.stack([p0 + np.arange(k)] * 3 + [np.zeros(k, np.int64)], axis=1)
    rows = dict(tokens=np.concatenate([pre, np.full(n_img, -1), post]),
                embd=np.concatenate([np.zeros((len(pre), embd.shape[1])), embd, np.zeros((n, embd.shape[1]))]),
                pos=np.concatenate([text_pos(0, len(pre)), image_pos, text_pos(pos, n)]))
    return rows, logits, h, n


@pytest.mark.parametrize("which", ["random", "trained"])
@pytest.mark.parametrize("picture", ["black", "noise"])
def test_target_parity_after_an_image(which, picture, random_files):
    Q = _trainer()
    torch = Q._torch()
    target_path, mmproj_path = _files(which, random_files)
    target, _, _ = Q.load(target_path)
    image = (np.zeros((336, 448, 3), np.uint8) if picture == "black"
             else np.random.default_rng(0).integers(0, 256, (336, 448, 3), dtype=np.uint8))
    rows, logits_cpp, h_cpp, n = _image_prompt_through_llama_cpp(target_path, mmproj_path, image, PROMPT[:100])
    with torch.no_grad():
        logits, h = target(torch.from_numpy(rows["tokens"].astype(np.int64))[None],
                           torch.from_numpy(rows["pos"])[None],
                           embd=torch.from_numpy(rows["embd"].astype(np.float32))[None])
    _close(logits_cpp, logits[0, -n:].numpy())
    _close(h_cpp, h[0, -n:].numpy())


@pytest.mark.parametrize("which", ["random", "trained"])
def test_mtp_head_and_a_chained_step_equal_llama_cpp(which, random_files):
    Q = _trainer()
    torch = Q._torch()
    target_path, _ = _files(which, random_files)
    target, head, _ = Q.load(target_path)
    with Model(target_path) as m:
        toks = m.tokenize(PROMPT)[:120]
    n = len(toks)
    _, h_cpp = _llama_cpp_text(target_path, toks)
    # the head's rows: (x_i, h_{i-1}) at position i, h_{-1} = 0 (as llama.cpp's driver starts)
    states = np.concatenate([np.zeros((1, h_cpp.shape[1]), np.float32), h_cpp[:-1]])
    extra = int(np.argmax(h_cpp[-1]) % 200)  # any token: the chained step's "drafted" one
    with Model(target_path, load_mtp=True) as m, \
            Context(m, **BIG_BATCH, mtp=True, role="draft") as mctx, Batch(mctx) as batch:
        mctx.enable_draft_embeddings(True, masked=True)
        batch.add_tokens_with_states(toks, np.arange(n), states, outputs=True)
        mctx.decode(batch)
        mtp_logits_cpp, m_cpp = mctx.output_logits(n).copy(), mctx.draft_embeddings(n).copy()
        batch.clear()
        batch.add_tokens_with_states([extra], [n], m_cpp[-1:], outputs=True)
        mctx.decode(batch)
        chained_cpp = mctx.output_logits(1).copy()
    with torch.no_grad():
        x = torch.from_numpy(toks.astype(np.int64))[None]
        emb = target.embed(x)
        pos = Q._default_pos(x, None)
        causal = torch.ones(n, n, dtype=torch.bool).tril()[None]
        logits, mh = head(emb, torch.from_numpy(states)[None], pos, causal, target.output_norm, target.output)
        # chained: the last row of the trainer's second pass over [toks, extra]
        x2 = torch.cat([x, torch.tensor([[extra]])], 1)
        emb2, pos2 = target.embed(x2), Q._default_pos(x2, None)
        h2 = torch.cat([torch.from_numpy(states), torch.from_numpy(h_cpp[-1:])])[None]
        kv = head.first_pass_kv(emb2, h2, pos2)
        m_prev = torch.cat([torch.zeros(1, 1, Q.N_EMBD), mh], 1)
        causal2 = torch.ones(n + 1, n + 1, dtype=torch.bool).tril()[None]
        chained, _ = head.chained(emb2, m_prev, pos2, causal2, kv, target.output_norm, target.output)
    _close(mtp_logits_cpp, logits[0].numpy())
    _close(m_cpp, mh[0].numpy())
    _close(chained_cpp, chained[0, -1:].numpy())


# ----------------------------------------------------------------------------- lossless + accepted

# held-out style (Python source): neither snippet is in the training files
HELD_OUT_PROMPTS = [
    PROMPT,
    ("class Stack:\n    \"\"\"A last-in, first-out container.\"\"\"\n\n    def __init__(self):\n"
     "        self._items = []\n\n    def push(self, item):\n        self._items.append(item)\n\n"
     "    def pop(self):\n        "),
]
MAX_TOKENS = 48


def _trained_or_skip():
    if not (TRAINED.exists() and TRAINED_MMPROJ.exists()):
        pytest.skip(f"the trained qwen35 + MTP files are not in {MODELS} (run tools/train_qwen35_mtp.py)")


@pytest.mark.parametrize("with_image", [False, True])
@pytest.mark.parametrize("prompt", HELD_OUT_PROMPTS, ids=["read_config", "stack"])
def test_trained_mtp_head_is_lossless_and_accepted(prompt, with_image):
    import pyllama_spec as ps

    _trained_or_skip()
    images = [np.zeros((672, 672, 3), np.uint8)] if with_image else []
    text = ps.MEDIA_MARKER + "\n" + prompt if with_image else prompt
    kw = dict(mmproj=TRAINED_MMPROJ, n_threads=N_THREADS, n_ctx=2048)
    with ps.load(TRAINED, spec_type="none", **kw) as plain:
        expected = plain.generate(text, images=images, max_tokens=MAX_TOKENS, temperature=0)
    assert len(expected.tokens) >= MAX_TOKENS // 2  # no early end of generation
    assert len(set(expected.tokens)) >= 8  # real text, not a run of one token that any head predicts
    with ps.load(TRAINED, spec_type="draft-mtp", draft_max=3, **kw) as spec:
        got = spec.generate(text, images=images, max_tokens=MAX_TOKENS, temperature=0)
    assert got.tokens == expected.tokens
    s = got.stats
    print(s.as_dict())
    assert s.drafted > 0 and s.accepted / s.drafted > 0.3, s.as_dict()
    assert s.mean_accepted_length > 1.5, s.as_dict()


def test_committed_files_are_small_and_documented():
    _trained_or_skip()
    for f in (TRAINED, TRAINED_MMPROJ):
        assert f.stat().st_size < 1_600_000, f
    readme = (MODELS / "README.md").read_text()
    assert "tools/train_qwen35_mtp.py" in readme and "--seed" in readme
