"""The trained EAGLE3 draft and the trained draft VLM for the embedded target (pyllama_spec/models,
made by ``tools/train_tiny_pair.py --eagle3 / --draft-vlm``).

* parity: the PyTorch modules they were trained as give llama.cpp's numbers: the EAGLE3 draft's
  encoder output, its logits and pre-norm output on the rows of its cache and along a drafted
  chain (the training-time-test chain of the trainer is what llama.cpp's draft() computes), also
  over an image's rows laid out as the drafter lays them (several rows to a position); the draft
  VLM's logits on text and after a picture through its own projector (skipped without torch);
* the EAGLE3 draft through ``ps.load(..., spec_type="draft-eagle3")``: greedy output equals the
  target's alone, and drafts are accepted on held-out text and after a picture, in both
  ``draft_positions`` modes; the draft VLM as a (text-only) draft model likewise on text.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import CTX_KWARGS, LLAMA_SERVER, N_THREADS, held_out_prompts, needs_llama_server
from test_trained_pair import PROMPT, _close, _image_prompt_through_llama_cpp, _trainer

import pyllama_spec as ps
from pyllama_spec.bindings.batch import Batch
from pyllama_spec.bindings.context import Context
from pyllama_spec.bindings.model import Model
from pyllama_spec.embedded import MODELS_DIR

MODELS = Path(os.environ.get("PYLLAMA_SPEC_TRAINED_MODELS", MODELS_DIR))
TARGET = MODELS / "trained-target.gguf"
MMPROJ = MODELS / "trained-mmproj.gguf"
EAGLE3 = MODELS / "trained-eagle3.gguf"
VLM = MODELS / "trained-draft-vlm.gguf"
VLM_MMPROJ = MODELS / "trained-draft-vlm-mmproj.gguf"

BIG_BATCH = dict(CTX_KWARGS, n_batch=1024, n_ubatch=1024)  # a prompt and an image's rows in one batch
CHAIN = 4  # drafted rows compared after the seed row

pytestmark = pytest.mark.skipif(not all(f.exists() for f in (TARGET, MMPROJ, EAGLE3, VLM, VLM_MMPROJ)),
                                reason=f"trained drafts not found in {MODELS} (run tools/train_tiny_pair.py "
                                       "--eagle3 --draft-vlm --target-from ...)")

# held-out text (tools/measure_trained_pair.py's held-out files: sorted stdlib index % 10 == 0);
# the prompts are the first 400 characters from a line start a third into each file
HELD_OUT = 4
MAX_TOKENS = 48


def _held_out_prompts(n: int) -> list[str]:
    """tools/measure_trained_pair.py's held-out prompts (the fixed held-out snippet where this
    machine's Python has no such corpus)."""
    return held_out_prompts(n) or [PROMPT]


# ----------------------------------------------------------------------------- EAGLE3 parity


def _eagle3_through_llama_cpp(rows_tokens, rows_g_feats, rows_pos, id_last, n_chain, target_path=TARGET,
                              eagle3_path=EAGLE3):
    """The EAGLE3 drafter's calls on llama.cpp's draft context: encode the target features, write the
    cache rows (partner token, g) at their positions with outputs on every row, then a seed row and
    n_chain drafted rows each fed the previous row's pre-norm output. Returns g, the cache rows'
    (logits, prenorm), and the chain's tokens and (logits, prenorm)."""
    n = len(rows_tokens)
    with Model(target_path) as m, Model(eagle3_path, role="draft") as d, Context(m, **CTX_KWARGS) as ctx, \
            Context(d, ctx_other=ctx, role="draft", **BIG_BATCH) as dctx, Batch(dctx) as batch:
        dctx.enable_draft_embeddings(True, masked=True)
        batch.add_embeddings(rows_g_feats, np.arange(n, dtype=np.int32), outputs=True)
        dctx.encode(batch)
        g = dctx.draft_embeddings(n).copy()
        # the cache: rows 0..n-2 with the next row's token; the seed row n-1 with id_last
        partners = np.append(rows_tokens[1:], id_last).astype(np.int32)
        batch.clear()
        batch.add_tokens_with_states(partners, rows_pos, g, outputs=True)
        dctx.decode(batch)
        logits, prenorm = dctx.output_logits(n).copy(), dctx.draft_embeddings(n).copy()
        chain_tokens, chain_logits, chain_pre = [], [logits[-1]], [prenorm[-1]]
        for j in range(n_chain):
            tok = int(np.argmax(chain_logits[-1]))
            chain_tokens.append(tok)
            batch.clear()
            batch.add_tokens_with_states([tok], [int(rows_pos[-1]) + 1 + j], chain_pre[-1][None], outputs=True)
            dctx.decode(batch)
            chain_logits.append(dctx.output_logits(1)[0].copy())
            chain_pre.append(dctx.draft_embeddings(1)[0].copy())
    return g, partners, (logits, prenorm), chain_tokens, (np.stack(chain_logits), np.stack(chain_pre))


def _check_eagle3(T, feats, own_tokens, pos, id_last, rows_to_compare=None, files=(TARGET, EAGLE3),
                  target_module=None):
    """The EAGLE3 draft ``files`` = (its target, the draft) in PyTorch against llama.cpp; ``target_module``:
    the PyTorch target whose token embedding and output head the draft borrows (default: ``files[0]``
    read as train_tiny_pair's hunyuan_vl)."""
    torch = T._torch()
    target = target_module
    if target is None:
        target, _, _ = T.load_pair(files[0])
    draft, _ = T.load_eagle3(files[1])
    g_cpp, partners, (logits, prenorm), chain_tokens, (chain_logits, chain_pre) = _eagle3_through_llama_cpp(
        own_tokens, feats, pos, id_last, CHAIN, *files)
    rows = slice(None) if rows_to_compare is None else rows_to_compare
    with torch.no_grad():
        f = torch.from_numpy(feats)[None]
        g = draft.encode(f)
        _close(g_cpp, g[0].numpy())
        p = torch.from_numpy(pos.astype(np.int64))[None]
        ours, pre = draft(target.tok_embd[torch.from_numpy(partners.astype(np.int64))][None], g, p, target.output)
        _close(logits[rows], ours[0].numpy()[rows])
        _close(prenorm[rows], pre[0].numpy()[rows])
        # the training-time-test chain from the last row, fed the tokens llama.cpp drafted
        n = len(own_tokens)
        chain_partners = torch.from_numpy(np.concatenate([partners, chain_tokens]).astype(np.int64))[None]
        steps = T.eagle3_chain_logits(draft, target.tok_embd, target.output, chain_partners, f, p,
                                      torch.ones(1, n, dtype=torch.bool), torch.tensor([[n - 1]]), CHAIN + 1)
    _close(chain_logits, torch.stack([s[0, 0] for s in steps]).numpy())


def test_eagle3_parity_with_pytorch_on_text():
    """Cache rows and a drafted chain, text at consecutive positions."""
    T = _trainer()
    _, ecfg = T.load_eagle3(EAGLE3)
    assert ecfg.target_layers == (1, 2, 3)
    with Model(TARGET) as m, Context(m, **BIG_BATCH) as ctx:
        toks = m.tokenize(PROMPT)[:160]
        n = len(toks)
        ctx.enable_layer_inputs(ecfg.target_layers)
        ctx.decode_tokens(toks, np.arange(n), outputs=True)
        id_last = int(np.argmax(ctx.logits(-1)))
        feats = np.concatenate([ctx.layer_input(lid, n) for lid in ecfg.target_layers], axis=1).copy()
    _check_eagle3(T, feats, toks, np.arange(n, dtype=np.int32), id_last)


def test_eagle3_parity_over_an_images_rows_at_shared_positions():
    """An image's rows in "target" mode (drafters/eagle3.py _lay_out: 64 rows over its 8 positions,
    so several rows share a position and see each other): the text after it agrees."""
    from pyllama_spec.drafters.eagle3 import _lay_out, _Rows, media_token

    T = _trainer()
    torch = T._torch()
    _, ecfg = T.load_eagle3(EAGLE3)
    image = np.random.default_rng(3).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    rows, logits, _, n_text = _image_prompt_through_llama_cpp(image, PROMPT[:80])
    target, _, _ = T.load_pair(TARGET)
    with torch.no_grad():
        _, f = target(torch.from_numpy(rows["tokens"].astype(np.int64))[None], torch.from_numpy(rows["pos"])[None],
                      layer_ids=list(ecfg.target_layers),
                      embd=torch.from_numpy(rows["embd"].astype(np.float32))[None])
    feats = torch.cat([f[lid] for lid in ecfg.target_layers], -1)[0].numpy()
    # own tokens: the media token on image rows; positions as the drafter's "target" mode lays them
    with Model(TARGET) as m:
        media = media_token(m)
    image_rows = rows["tokens"] < 0
    own = np.where(image_rows, media, rows["tokens"]).astype(np.int32)
    section0 = rows["pos"][:, 0].astype(np.int32)
    index = np.arange(len(own), dtype=np.float32)[:, None]
    placed, n_placed = _lay_out(_Rows(own, index, section0, image_rows), None)
    assert n_placed == len(own) and len(np.unique(placed.pos)) < len(placed.pos)  # rows share positions
    src = placed.g[:, 0].astype(np.int64)
    # the text rows' features came from PyTorch's target here (its llama.cpp parity is tested elsewhere)
    _check_eagle3(T, np.ascontiguousarray(feats[src]), placed.tokens, placed.pos, int(np.argmax(logits[-1])),
                  rows_to_compare=slice(-n_text, None))


# ----------------------------------------------------------------------------- draft VLM parity


def test_draft_vlm_parity_with_pytorch_on_text():
    T = _trainer()
    torch = T._torch()
    vlm, _, cfg = T.load_pair(VLM)
    assert (cfg.target_n_layer, cfg.n_embd) == (2, 48)
    with Model(VLM) as m, Context(m, **BIG_BATCH) as ctx:
        toks = m.tokenize(PROMPT)
        n = len(toks)
        ctx.decode_tokens(toks, np.arange(n), outputs=True)
        ours = ctx.output_logits(n).copy()
    with torch.no_grad():
        logits, _ = vlm(torch.from_numpy(toks.astype(np.int64))[None])
    _close(ours, logits[0].numpy())


@pytest.mark.parametrize("picture", ["black", "noise"])
def test_draft_vlm_parity_after_an_image_through_its_own_projector(picture):
    T = _trainer()
    torch = T._torch()
    vlm, _, _ = T.load_pair(VLM)
    image = (np.zeros((336, 448, 3), np.uint8) if picture == "black"
             else np.random.default_rng(0).integers(0, 256, (336, 448, 3), dtype=np.uint8))
    rows, ours, _, n = _image_prompt_through_llama_cpp(image, PROMPT[:120], model=VLM, mmproj=VLM_MMPROJ)
    assert rows["embd"].shape[1] == 48  # its own projector's rows
    with torch.no_grad():
        logits, _ = vlm(torch.from_numpy(rows["tokens"].astype(np.int64))[None], torch.from_numpy(rows["pos"])[None],
                        embd=torch.from_numpy(rows["embd"].astype(np.float32))[None])
    _close(ours, logits[0, -n:].numpy())


# ----------------------------------------------------------------------------- lossless + accepted


@pytest.fixture(scope="module")
def baseline():
    """Target-only greedy tokens for the held-out prompts, as text and after a black picture."""
    prompts = _held_out_prompts(HELD_OUT)
    image = [np.zeros((672, 672, 3), np.uint8)]
    with ps.load(TARGET, mmproj=MMPROJ, n_threads=N_THREADS) as eng:
        return prompts, {
            "text": [eng.generate(p, max_tokens=MAX_TOKENS, cache_prompt=False).tokens for p in prompts],
            "image": [eng.generate(ps.MEDIA_MARKER + "\n" + p, images=image, max_tokens=MAX_TOKENS,
                                   cache_prompt=False).tokens for p in prompts]}


def _run(eng, prompts, kind):
    image = [np.zeros((672, 672, 3), np.uint8)]
    tokens, drafted, accepted, steps, generated = [], 0, 0, 0, 0
    for p in prompts:
        if kind == "text":
            res = eng.generate(p, max_tokens=MAX_TOKENS, cache_prompt=False)
        else:
            res = eng.generate(ps.MEDIA_MARKER + "\n" + p, images=image, max_tokens=MAX_TOKENS, cache_prompt=False)
        tokens.append(res.tokens)
        s = res.stats
        drafted, accepted, steps, generated = (drafted + s.drafted, accepted + s.accepted,
                                               steps + s.target_steps, generated + s.generated_tokens)
    return tokens, dict(acceptance=accepted / max(1, drafted), mean_accepted_length=generated / max(1, steps))


@pytest.mark.parametrize("draft_positions", ["target", "sequential"])
@pytest.mark.parametrize("kind", ["text", "image"])
def test_trained_eagle3_is_lossless_and_accepted(baseline, kind, draft_positions):
    prompts, expected = baseline
    with ps.load(TARGET, mmproj=MMPROJ, draft=EAGLE3, spec_type="draft-eagle3", draft_max=7,
                 draft_positions=draft_positions, n_threads=N_THREADS) as eng:
        tokens, stats = _run(eng, prompts, kind)
    print(kind, draft_positions, stats)
    assert tokens == expected[kind]
    # a random EAGLE3 draft accepts about nothing (mean accepted length 1.0)
    assert stats["acceptance"] > 0.3 and stats["mean_accepted_length"] > 2.0, stats


def test_trained_draft_vlm_as_a_draft_model_is_lossless_and_accepted(baseline):
    prompts, expected = baseline
    with ps.load(TARGET, mmproj=MMPROJ, draft=VLM, spec_type="draft-simple", draft_max=7,
                 n_threads=N_THREADS) as eng:
        tokens, stats = _run(eng, prompts, "text")
    print("draft VLM, text", stats)
    assert tokens == expected["text"]
    assert stats["acceptance"] > 0.3 and stats["mean_accepted_length"] > 2.0, stats


def test_the_new_files_are_small_and_documented():
    for f in (EAGLE3, VLM, VLM_MMPROJ):
        assert f.stat().st_size < 2_000_000, f
    readme = (MODELS / "README.md").read_text()
    for section in ("## EAGLE3 draft (`trained-eagle3.gguf`)", "## Draft VLM (`trained-draft-vlm.gguf`"):
        assert section in readme
    assert "--eagle3" in readme and "--draft-vlm" in readme


@needs_llama_server
@pytest.mark.parametrize("draft_max", [3, 5])
def test_the_draft_model_drafts_and_accepts_what_llama_servers_draft_simple_does(draft_max):
    """draft-simple on text against llama-server's on the same files (the draft VLM as a text-only
    draft model, greedy): the same text and the same drafted and accepted counts, at llama-server's
    default length and at this project's."""
    from pyllama_spec.devtools.servers import stop, wait_healthy
    from pyllama_spec.ports import free_port

    prompts = held_out_prompts(3)
    if not prompts:
        pytest.skip("this Python has none of the standard library's source files the held-out prompts come from")
    port = free_port()
    with tempfile.NamedTemporaryFile(suffix=".log") as log:
        proc = subprocess.Popen([str(LLAMA_SERVER), "-m", str(TARGET), "-md", str(VLM), "--spec-type", "draft-simple",
                                 "--spec-draft-n-max", str(draft_max), "--spec-draft-n-min", "0", "-c", "4096",
                                 "-np", "1", "--no-warmup", "-t", "1", "-fa", "off", "--host", "127.0.0.1",
                                 "--port", str(port)], stdout=log, stderr=log)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc, log.name)
            theirs = []
            for p in prompts:
                body = json.dumps({"prompt": p, "n_predict": 48, "temperature": 0, "cache_prompt": False}).encode()
                req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
                theirs.append(json.load(urllib.request.urlopen(req, timeout=120)))
        finally:
            stop(proc)
    with ps.load(TARGET, n_ctx=4096, n_threads=1, flash_attn=False, draft=VLM, spec_type="draft-simple",
                 draft_max=draft_max) as eng:
        for p, t in zip(prompts, theirs):
            ours = eng.generate(p, max_tokens=48, cache_prompt=False)
            assert ours.text == t["content"]
            assert (ours.stats.drafted, ours.stats.accepted) == (t["timings"]["draft_n"],
                                                                 t["timings"]["draft_n_accepted"])
            assert ours.stats.drafted > 0
