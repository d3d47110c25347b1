"""The reading world (``pyllama_spec.devtools.reading``, trained by tools/train_reading.py): its
pictures, its files, what its target reads, and drafting through its pictures.

* ``render`` draws any line the world can hold, the same pixels every time, and refuses what it
  cannot draw with a clear error;
* the PyTorch projector and target of the trainer compute what libmtmd and llama.cpp compute (on a
  random projector and on the committed files; skipped without torch, a training-only dependency);
* the committed target reads held-out strings out (at least 90% of their characters, greedy);
* the PyTorch target's layer inputs (what the EAGLE3 and DFlash drafts were trained on) are llama.cpp's,
  and so are the EAGLE3 and DFlash drafts' numbers through a reading picture;
* drafts through a reading picture are lossless, and a draft that sees the picture accepts far more
  of the read-out than the same draft blind: the MTP head and the EAGLE3 draft with the picture's rows
  in their caches against them without, the small draft model with its own projector against it
  without, the DFlash draft at sequential positions (the rows injected) against target positions.
"""

from __future__ import annotations

import importlib.util
import re
import sys

import numpy as np
import pytest
from conftest import N_THREADS, REPO_ROOT

import pyllama_spec as ps
from pyllama_spec.devtools import reading


def _module(name: str):
    """A tools/ script as a module (they are not part of the package)."""
    tools = str(REPO_ROOT / "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "tools" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
    return mod


def _trainer():
    pytest.importorskip("torch", reason="parity tests need PyTorch (pip install torch): training-only dependency")
    mod = _module("train_reading")
    mod._torch().set_num_threads(1)
    mod.T.EMULATE_F16_KV = True  # the contexts below use llama.cpp's default F16 KV cache
    return mod


@pytest.fixture(scope="module")
def files():
    return reading.models()


@pytest.fixture(scope="module")
def held_out():
    """24 strings no training run drew (held-out corpus lines, fresh identifiers and numbers)."""
    return _module("train_reading").held_out_strings(24)


# ----------------------------------------------------------------------------- pictures and files

def test_render_draws_one_character_a_cell_the_same_every_time():
    img = reading.render("x = 1")
    assert img.mode == "RGB" and img.size == (reading.CELL * reading.COLUMNS, reading.CELL)
    a = np.asarray(img)
    assert np.array_equal(a, np.asarray(reading.render("x = 1")))
    ground = a[0, 0]
    inked = [bool((a[:, i * reading.CELL:(i + 1) * reading.CELL] != ground).any()) for i in range(reading.COLUMNS)]
    assert inked == [True, False, True, False, True] + [False] * (reading.COLUMNS - 5)
    # another character, another cell's pixels; the same character, the same pixels
    cells = np.asarray(reading.render("abca")).reshape(reading.CELL, reading.COLUMNS, reading.CELL, 3)
    assert np.array_equal(cells[:, 0], cells[:, 3]) and not np.array_equal(cells[:, 0], cells[:, 1])


@pytest.mark.parametrize("text, error", [("", "1 to 16"), ("x" * 17, "1 to 16"), ("café", "printable ASCII"),
                                         ("a\tb", "printable ASCII")])
def test_render_refuses_what_it_cannot_draw(text, error):
    with pytest.raises(ValueError, match=error):
        reading.render(text)
    with pytest.raises(TypeError, match="must be a str"):
        reading.render(b"abc")


def test_varied_pictures_vary_but_keep_the_grid():
    rng = np.random.default_rng(0)
    a, b = reading.render_varied("abc", rng), reading.render_varied("abc", rng)
    assert a.shape == b.shape == (reading.CELL, reading.CELL * reading.COLUMNS, 3)
    assert not np.array_equal(a, b)
    assert (a[:, 3 * reading.CELL:] == a[0, -1]).all()  # cells past the text are ground only


def test_models_lists_the_committed_files_by_role(files):
    assert {"target", "mmproj"} <= set(files)
    assert all(p.is_file() for p in files.values())
    assert reading.PROMPT.count("<__media__>") == 1


# ----------------------------------------------------------------------------- parity with llama.cpp

def _close(a, b, rel, rel_typical):
    scale = max(1.0, float(np.abs(b).max()))
    rows = np.abs(a - b).reshape(len(a), -1).max(axis=1)
    print(f"parity: max |diff| {rows.max():.3g}, median row {np.median(rows):.3g}, scale {scale:.3g}")
    assert rows.max() <= rel * scale and np.median(rows) <= rel_typical * scale


def _libmtmd_rows(target_path, mmproj_path, picture):
    from pyllama_spec.bindings.model import Model
    from pyllama_spec.bindings.mtmd import Bitmap, Projector

    with Model(target_path) as m, Projector(mmproj_path, m, n_threads=N_THREADS) as proj:
        chunks = proj.tokenize(reading.PROMPT, [Bitmap(picture)])
        return proj.encode(chunks[1])


@pytest.mark.parametrize("which", ["random", "committed"])
def test_projector_equals_libmtmd(which, files, tmp_path):
    TR = _trainer()
    torch = TR._torch()
    if which == "random":  # every weight away from its trained value: a misplaced one shows
        proj = TR.make_projector(3)
        with torch.no_grad():
            for p in proj.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        mmproj = TR.write_mmproj(tmp_path / "mmproj.gguf", proj)
    else:
        mmproj = files["mmproj"]
    proj = TR.load_projector(mmproj)
    rng = np.random.default_rng(1)
    pictures = [reading.render_varied(text, rng) for text in ("def f(x):", "0123456789abcdef", "_")]
    # and pictures of several rows of cells (the merge order across row pairs), as training's others are
    pictures += [p for p in TR.other_pictures(6, 0) if p.shape[0] >= 56][:2]
    for picture in pictures:
        want = _libmtmd_rows(files["target"], mmproj, picture)
        with torch.no_grad():
            got = proj(torch.from_numpy(picture)[None])[0].numpy()
        # ggml's GELU reads a float16 table: a few 1e-4 of the rows' scale
        _close(got, want, rel=2e-3, rel_typical=1e-3)


def _read_out_parity(TR, model, model_path, mmproj_path, text):
    """``model`` (the trainer's module for ``model_path``) over [PROMPT with the picture of ``text``,
    the read-out of ``text``] gives llama.cpp's logits for the rows after the picture."""
    torch = TR._torch()
    from pyllama_spec.bindings.context import Context
    from pyllama_spec.bindings.model import Model
    from pyllama_spec.bindings.mtmd import Bitmap, Projector

    proj = TR.load_projector(mmproj_path)
    layout = TR.Layout(model_path, mmproj_path)
    picture = np.array(reading.render(text))
    read = np.frombuffer((text + "\n").encode(), np.uint8).astype(np.int64)
    with Model(model_path) as m, Projector(mmproj_path, m, n_threads=N_THREADS) as pj, \
            Context(m, n_ctx=512, n_batch=256, n_ubatch=256, n_threads=N_THREADS, flash_attn=False) as ctx:
        chunks = pj.tokenize(reading.PROMPT, [Bitmap(picture)])
        pre, media, post = chunks[0].tokens, chunks[1], chunks[2].tokens
        ctx.decode_tokens(pre, np.arange(len(pre)))
        pos = pj.decode_media(ctx, media, pj.encode(media), len(pre), n_batch=256)
        after = np.concatenate([post, read])
        ctx.decode_tokens(after, pos + np.arange(len(after)), outputs=True)
        want = ctx.output_logits(len(after)).copy()
    x = torch.from_numpy(np.concatenate([layout.pre, np.full(TR.N_CELLS, -1), layout.post, read]))[None]
    with torch.no_grad():
        logits, _ = model(x, torch.from_numpy(layout.positions(x.shape[1]))[None],
                          embd=TR._image_rows(layout, proj(torch.from_numpy(picture)[None]), x.shape[1]))
    _close(logits[0, -len(after):].numpy(), want, rel=2e-3, rel_typical=5e-4)


def test_target_reads_as_llama_cpp_computes(files, held_out):
    """The trainer's target (qwen35, rope base 20, no merges) through its projector."""
    TR = _trainer()
    target, _, cfg = TR.Q.load(files["target"])
    assert cfg.rope_base == TR.ROPE_BASE and not cfg.merges
    _read_out_parity(TR, target, files["target"], files["mmproj"], held_out[0])


def test_target_layer_inputs_equal_llama_cpps(files):
    """What the EAGLE3 and DFlash drafts read on text (tools/train_reading_drafts.py takes it from the
    PyTorch target): the inputs of layers 1, 2 and 3, against llama.cpp's."""
    from pyllama_spec.bindings.context import Context
    from pyllama_spec.bindings.model import Model

    TR = _trainer()
    torch = TR._torch()
    target, _, _ = TR.Q.load(files["target"])
    toks = TR.corpus_bytes(TR.T.corpus_files()[1])[:96]  # held-out code, one byte a token
    layers = (1, 2, 3)
    with Model(files["target"]) as m, Context(m, n_ctx=256, n_batch=256, n_ubatch=256, n_threads=N_THREADS) as ctx:
        ctx.enable_layer_inputs(layers)
        ctx.decode_tokens(toks.astype(np.int32), np.arange(len(toks)), outputs=True)
        want = {lid: ctx.layer_input(lid, len(toks)).copy() for lid in layers}
    with torch.no_grad():
        _, feats = target(torch.from_numpy(toks.astype(np.int64))[None], layer_ids=layers)
    for lid in layers:
        _close(feats[lid][0].numpy(), want[lid], rel=2e-3, rel_typical=5e-4)


def _after_a_picture(TR, files, text, cfg, kind):
    """One reading sequence (the picture of ``text``, the prompt, 24 greedy tokens) decoded by llama.cpp
    with every row's layer inputs, as tools/train_reading_drafts.py makes its training data."""
    gen = TR.T.generate_image_sequences if kind == "dflash" else TR.T.generate_image_continuations
    what = cfg if kind == "dflash" else cfg.target_layers
    return gen(files["target"], files["mmproj"], np.zeros(8, np.int64), [np.asarray(reading.render(text))], 1, 0, 24,
               what, 0, log=lambda *_: None, prompt=reading.PROMPT, one_each=True)


def test_eagle3_draft_equals_llama_cpp_through_a_picture(files, held_out):
    """The committed EAGLE3 draft in PyTorch (as trained) against llama.cpp: its cache rows over a reading
    picture's rows and the text after them, and a drafted chain from the last row. (A reading picture's
    16 rows span 16 positions, so both position modes lay them out alike; rows sharing a position are
    tests/test_trained_drafts.py's.)"""
    from test_trained_drafts import _check_eagle3

    TR = _trainer()
    _, ecfg = TR.T.load_eagle3(files["eagle3"])
    own, feats, greedy, pos = _after_a_picture(TR, files, held_out[2], ecfg, "eagle3").rows(0, "sequential")
    target, _, _ = TR.Q.load(files["target"])
    _check_eagle3(TR.T, np.ascontiguousarray(feats), own, pos, int(greedy[-1]), files=(files["target"], files["eagle3"]),
                  target_module=target)


@pytest.mark.parametrize("mode", ["target", "sequential"])
def test_dflash_draft_equals_llama_cpp_through_a_picture(files, held_out, mode):
    """The committed DFlash draft in PyTorch (as trained) against llama.cpp: a block at the read-out's first
    row over the rows before it as the draft holds them in ``mode`` (sequential: the picture's rows too)."""
    from pyllama_spec.bindings.batch import Batch
    from pyllama_spec.bindings.context import Context
    from pyllama_spec.bindings.model import Model

    TR = _trainer()
    torch = TR._torch()
    cfg = TR.T.PairConfig(merges=False)
    draft = TR.T.load_draft(files["dflash"], cfg)
    seqs = _after_a_picture(TR, files, held_out[3], cfg, "dflash")
    tokens, feats, _, pos, first = seqs.rows(0, mode, seqs.tokens.shape[1] - (seqs.n_image if mode == "target" else 0))
    a = first + len(TR.Layout(files["target"], files["mmproj"]).post)  # the read-out's first row
    rows = 8
    with Model(files["target"]) as m, Model(files["dflash"], role="draft") as d, \
            Context(m, n_ctx=256, n_batch=256, n_ubatch=256, n_threads=N_THREADS) as ctx, \
            Context(d, ctx_other=ctx, role="draft", n_ctx=256, n_batch=256, n_ubatch=256, n_threads=N_THREADS) as dctx:
        dctx.enable_draft_embeddings(True, True)
        dctx.set_causal_attn(False)
        p = pos[:a].astype(np.int32)
        with Batch(dctx) as batch:
            batch.add_embeddings(np.ascontiguousarray(feats[:a]), np.stack([p, p, p, np.zeros_like(p)], axis=1))
            dctx.decode(batch)
        block = [int(tokens[a])] + [d.mask_token] * (rows - 1)
        dctx.decode_tokens(block, int(pos[a]) + np.arange(rows), outputs=True)
        ours = dctx.output_logits(rows).copy()
    target, _, _ = TR.Q.load(files["target"])
    with torch.no_grad():
        theirs, _ = TR.T.draft_block_logits(draft, target, torch.from_numpy(feats)[None],
                                            torch.from_numpy(tokens.astype(np.int64))[None], torch.tensor([[a]]), cfg,
                                            torch.tensor([[rows]]), ctx_pos=torch.from_numpy(pos.astype(np.int64))[None])
    _close(ours, theirs[0, :rows].numpy(), rel=2e-3, rel_typical=5e-4)


def test_draft_vlm_equals_llama_cpp(files, held_out):
    """The trainer's draft VLM (hunyuan_vl, sections [1, 1, 6, 0], rope base 20) through its own projector."""
    TR = _trainer()
    draft, _, cfg = TR.T.load_pair(files["draft_vlm"])
    assert tuple(cfg.rope_sections) == (1, 1, 6, 0) and cfg.rope_base == TR.ROPE_BASE and not cfg.merges
    _read_out_parity(TR, draft, files["draft_vlm"], files["draft_vlm_mmproj"], held_out[1])


# ----------------------------------------------------------------------------- reading and drafting

def _read_out(eng, text):
    return eng.generate(reading.PROMPT, images=[reading.render(text)], max_tokens=len(text) + 1,
                        temperature=0.0, cache_prompt=False).text


def test_the_target_reads_strings_it_never_saw(files, held_out):
    right = total = 0
    with ps.load(files["target"], mmproj=files["mmproj"], n_threads=N_THREADS, spec_type="none") as eng:
        for s in held_out:
            got = _read_out(eng, s)
            right += sum(a == b for a, b in zip(got, s))
            total += len(s)
    print(f"read-out accuracy {right / total:.3f} over {len(held_out)} strings")
    assert right / total >= 0.9


def _readout_run(files, strings, kw, rows_in_cache=None):
    """Outputs, and acceptance over the steps that start inside each read-out."""
    accepted = drafted = 0
    outs = []
    with ps.load(files["target"], mmproj=files["mmproj"], n_threads=N_THREADS, draft_max=3, **kw) as eng:
        if rows_in_cache is not None:
            eng.drafter.writes_media = rows_in_cache
        for s in strings:
            toks: list[int] = []
            for piece in eng.stream(reading.PROMPT, images=[reading.render(s)], max_tokens=len(s) + 12,
                                    temperature=0.0, cache_prompt=False):
                if len(toks) < len(s) + 1:
                    accepted, drafted = accepted + piece.from_draft, drafted + piece.drafted
                toks.extend(piece.tokens)
            outs.append(toks)
    return outs, accepted / max(1, drafted)


@pytest.fixture(scope="module")
def target_only(files, held_out):
    with ps.load(files["target"], mmproj=files["mmproj"], n_threads=N_THREADS, spec_type="none") as eng:
        return [eng.generate(reading.PROMPT, images=[reading.render(s)], max_tokens=len(s) + 12,
                             temperature=0.0, cache_prompt=False).tokens for s in held_out[:12]]


@pytest.mark.parametrize("method", ["mtp", "draft model", "eagle3", "dflash"])
def test_a_draft_that_sees_the_picture_reads_it_where_a_blind_one_cannot(method, files, held_out, target_only):
    """Greedy, 12 held-out strings: lossless both ways; seeing accepts at least 3x blind on the read-out
    (measured on 24 strings: MTP 0.98 vs 0.16, the draft model 0.92 vs 0.07, EAGLE3 0.84 vs 0.06, DFlash
    1.00 vs 0.10; bench/reading_world.py).
    Seeing and blind: the MTP head and EAGLE3 with the picture's rows in their caches or without them;
    the draft model with its own projector or without it; DFlash at sequential positions (the rows
    injected) or at the target's (the pinned rows left out)."""
    strings = held_out[:12]
    if method in ("mtp", "eagle3"):
        kw = dict(spec_type="draft-mtp") if method == "mtp" else dict(spec_type="draft-eagle3", draft=files["eagle3"])
        seeing, seeing_rate = _readout_run(files, strings, kw, rows_in_cache=True)
        blind, blind_rate = _readout_run(files, strings, kw, rows_in_cache=False)
    elif method == "dflash":
        kw = dict(spec_type="draft-dflash", draft=files["dflash"])
        seeing, seeing_rate = _readout_run(files, strings, dict(kw, draft_positions="sequential"))
        blind, blind_rate = _readout_run(files, strings, dict(kw, draft_positions="target"))
    else:
        kw = dict(spec_type="draft-simple", draft=files["draft_vlm"])
        seeing, seeing_rate = _readout_run(files, strings, dict(kw, mmproj_draft=files["draft_vlm_mmproj"]))
        blind, blind_rate = _readout_run(files, strings, kw)
    assert seeing == target_only and blind == target_only
    print(f"{method}: read-out acceptance seeing {seeing_rate:.3f}, blind {blind_rate:.3f}")
    assert seeing_rate >= 0.7 and seeing_rate >= 3 * blind_rate


def _seeing(method: str, files) -> dict:
    """Engine settings of each method's seeing draft."""
    return {"mtp": dict(spec_type="draft-mtp"),
            "draft model": dict(spec_type="draft-simple", draft=files["draft_vlm"],
                                mmproj_draft=files["draft_vlm_mmproj"]),
            "eagle3": dict(spec_type="draft-eagle3", draft=files["eagle3"]),
            "dflash": dict(spec_type="draft-dflash", draft=files["dflash"], draft_positions="sequential")}[method]


@pytest.mark.parametrize("method", ["mtp", "draft model", "eagle3", "dflash"])
def test_seeing_drafts_on_four_slots_give_the_targets_tokens(method, files, held_out, target_only):
    """Four reading pictures at once through one engine's four slots: each answer is the target's own."""
    kw = _seeing(method, files)
    strings = held_out[:8]
    with ps.load(files["target"], mmproj=files["mmproj"], n_threads=N_THREADS, draft_max=3, n_parallel=4,
                 n_ctx=2048, **kw) as eng:
        subs = [eng.submit(reading.PROMPT, images=[reading.render(s)], max_tokens=len(s) + 12, temperature=0.0,
                           cache_prompt=False) for s in strings]
        results = [sub.result() for sub in subs]
    assert [r.tokens for r in results] == target_only[:8]
    # mostly read-out (a blind draft accepts about 0.4 of these answers, a seeing one over 0.9)
    assert sum(r.stats.accepted for r in results) / sum(r.stats.drafted for r in results) >= 0.75


def test_demo_reads_a_picture_with_blind_and_seeing_drafts(files):
    from click.testing import CliRunner

    from pyllama_spec.cli import main

    result = CliRunner().invoke(main, ["demo", "--reading", "a[i] = 7", "--max-tokens", "24", "--threads", "1"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "reading world" in out and "'a[i] = 7'" in out  # shown as typed, not read as markup
    assert re.search(r"draft\s+max\s+3", out)  # the reading world's draft length unless one is given
    assert "seeing" in out and "blind" in out and "NO" not in out


def test_demo_refuses_a_line_it_cannot_draw(files):
    from click.testing import CliRunner

    from pyllama_spec.cli import main

    result = CliRunner().invoke(main, ["demo", "--reading", "x" * 40])
    assert result.exit_code == 2 and "1 to 16 characters" in result.output
    result = CliRunner().invoke(main, ["demo", "--reading", "x", "--random-tiny"])
    assert result.exit_code == 2 and "leave out --random-tiny" in result.output
