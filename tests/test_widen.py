"""pyllama_spec.devtools.widen: the trained tiny pair zero-padded to wider shapes computes the same function.

At a small width (n_embd 256 = 4 heads of 64 / 2 KV heads, 6 layers, n_ff 512, f32) so that the
tests take seconds; the construction is the same at the bench size (1024 / 12 / 2816, f16:
``bench/dflash_bench_size.py`` measures it).

* the widened target's logits and layer inputs equal the trained target's (to float summation
  order with an f32 KV cache; through llama.cpp's default f16 KV cache about 1e-4 of the scale);
* its greedy continuations equal the trained target's, for text and after an image;
* the widened DFlash pair is lossless and accepts what the trained pair accepts;
* the widened EAGLE3 draft with the widened target is lossless and proposes what the trained EAGLE3
  draft proposes with the trained target: the same tokens at every draft, logits to summation order
  with f32 caches;
* the widened draft model (``trained-draft-vlm.gguf``, 48 wide, GQA ratio 3, as ``draft-simple``)
  beside the widened target is lossless and proposes what the trained draft model proposes beside
  the trained target;
* the widened qwen35 target with its MTP head (``trained-qwen35-mtp.gguf``: a gated delta net and
  gated attention, widened with zero heads and zero layers of both kinds) gives the trained logits and
  s_r times the trained hidden state, for text and after a picture; with ``draft-mtp`` it is lossless
  and drafts, accepts and proposes (logits to summation order with f32 caches) what the trained one does;
* shapes, metadata, dtypes and the cache; bad inputs refused.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import N_THREADS

import pyllama_spec as ps
from pyllama_spec.bindings.context import Context
from pyllama_spec.bindings.model import Model
from pyllama_spec.devtools import tiny, widen
from pyllama_spec.embedded import MODELS_DIR, PROMPT
from pyllama_spec.errors import IncompatibleModelsError
from pyllama_spec.gguf.reader import read_gguf, read_tensor
from pyllama_spec.gguf.writer import GGUFWriter

TRAINED = ps.embedded_models()
SMALL = dict(n_embd=256, n_layer=6, n_ff=512, dtype="f32")
READ_CONFIG = ('def read_config(path):\n    """Read a configuration file and return a dict."""\n'
               '    result = {}\n    with open(path) as f:\n        for line in f:\n            line = line.strip()\n'
               '            if not line or line.startswith("#"):\n                continue\n')
CASES = {"text": (PROMPT, False), "text2": (READ_CONFIG, False), "image": ("<__media__>\n" + READ_CONFIG, True)}
MAX_TOKENS = 48
EAGLE3 = MODELS_DIR / widen.EAGLE3
BLACK = np.zeros((672, 672, 3), np.uint8)


@pytest.fixture(scope="module")
def wide(tiny_dir) -> tiny.TinyModels:
    return widen.widen_trained_pair(tiny_dir, **SMALL)


def _logits_and_features(path, text: str, kv: str):
    with Model(path) as m, Context(m, n_ctx=512, n_batch=256, n_ubatch=256, n_threads=N_THREADS,
                                   flash_attn=False, type_k=kv, type_v=kv) as ctx:
        toks = m.tokenize(text)
        ctx.enable_layer_inputs([1, 2, 3])
        ctx.decode_tokens(toks, np.arange(len(toks)), outputs=True)
        return ctx.output_logits(len(toks)).copy(), {i: ctx.layer_input(i, len(toks)).copy() for i in (1, 2, 3)}


@pytest.mark.parametrize("kv,rel", [("f32", 1e-5), ("f16", 3e-4)])
def test_widened_target_gives_the_trained_logits(wide, kv, rel):
    ours, ours_f = _logits_and_features(wide.target, READ_CONFIG, kv)
    theirs, theirs_f = _logits_and_features(TRAINED.target, READ_CONFIG, kv)
    scale = float(np.abs(theirs).max())
    assert np.abs(ours - theirs).max() <= rel * scale
    assert np.array_equal(ours.argmax(1), theirs.argmax(1))
    s_r = np.sqrt(SMALL["n_embd"] / 64)  # the widened residual is the trained one times s_r, in dims 0..63
    for i, f in theirs_f.items():
        assert np.abs(ours_f[i][:, :64] / s_r - f).max() <= rel * max(1.0, float(np.abs(f).max())) * 10
        assert not ours_f[i][:, 64:].any()


def _generate(models, draft_max: int | None = None) -> dict:
    with ps.load(models.target, mmproj=models.mmproj, draft=models.draft if draft_max else None,
                 draft_max=draft_max or 7, n_threads=N_THREADS) as engine:
        return {name: engine.generate(p, images=[BLACK] if img else [], max_tokens=MAX_TOKENS, temperature=0.0,
                                      cache_prompt=False) for name, (p, img) in CASES.items()}


@pytest.fixture(scope="module")
def target_only(wide) -> dict:
    return {"trained": _generate(TRAINED), "wide": _generate(wide)}


def test_widened_greedy_continuations_equal_the_trained_ones(target_only):
    for name in CASES:
        trained, ours = target_only["trained"][name].tokens, target_only["wide"][name].tokens
        assert len(trained) == MAX_TOKENS
        assert ours == trained, name


@pytest.mark.parametrize("draft_max", [3, 7])
def test_widened_dflash_pair_is_lossless_and_accepts_as_trained(wide, target_only, draft_max):
    trained, ours = _generate(TRAINED, draft_max), _generate(wide, draft_max)
    for name in CASES:
        assert ours[name].tokens == target_only["wide"][name].tokens, name  # lossless
        a, b = ours[name].stats, trained[name].stats
        assert a.drafted > 0 and a.mean_accepted_length > 1.5, (name, a.as_dict())
        assert abs(a.acceptance_rate - b.acceptance_rate) <= 0.05, (name, a.acceptance_rate, b.acceptance_rate)


def test_shapes_metadata_and_dtypes(tiny_dir, wide):
    t, d, mm = read_gguf(wide.target), read_gguf(wide.draft), read_gguf(wide.mmproj)
    assert t.metadata["hunyuan_vl.embedding_length"] == 256 and t.metadata["hunyuan_vl.block_count"] == 6
    assert (t.metadata["hunyuan_vl.attention.head_count"], t.metadata["hunyuan_vl.attention.head_count_kv"],
            t.metadata["hunyuan_vl.attention.key_length"]) == (4, 2, 64)
    assert list(t.metadata["hunyuan_vl.rope.dimension_sections"]) == [8, 12, 12, 0]
    assert list(d.metadata["dflash.rope.dimension_sections"]) == [32, 0, 0, 0]
    assert list(d.metadata["dflash.target_layers"]) == [1, 2, 3]
    assert d.tensors["fc.weight"].dims == (3 * 256, 256) and d.tensors["blk.1.ffn_up.weight"].dims == (256, 512)
    assert mm.metadata["clip.vision.projection_dim"] == 256 and mm.tensors["mm.2.weight"].dims == (128, 256)
    # layers past the trained four are all zero
    assert not read_tensor(t, "blk.5.ffn_down.weight").any() and not read_tensor(t, "blk.4.attn_q.weight").any()
    # the trained weights are in place: rows of trained head 1 at wide head 1, pair i at pair 4 i
    q_t = read_tensor(read_gguf(MODELS_DIR / "trained-target.gguf"), "blk.0.attn_q.weight")
    q_w = read_tensor(t, "blk.0.attn_q.weight")
    assert np.array_equal(q_w[64 + 4 * 3, :64], 2 * q_t[16 + 3, :])  # dim 3 of head 1 (scaled by s_h = 2)
    assert np.array_equal(q_w[64 + 32 + 4 * 2, :64], 2 * q_t[16 + 8 + 2, :])  # dim 8 + 2: the pair's other half
    with Model(wide.target) as m:
        assert m.n_params == tiny.bench_n_params(n_embd=256, n_layer=6, n_ff=512)["target"]
    # cached: a second call reuses the files; f16 stores the matrices as F16 and the norms as F32
    mtime = wide.target.stat().st_mtime_ns
    assert widen.widen_trained_pair(tiny_dir, **SMALL) == wide and wide.target.stat().st_mtime_ns == mtime
    half = widen.widen_trained_pair(tiny_dir, **dict(SMALL, dtype="f16"))
    h = read_gguf(half.target)
    assert half.target != wide.target
    assert h.tensors["blk.0.attn_q.weight"].type_name == "F16" and h.tensors["token_embd.weight"].type_name == "F16"
    assert h.tensors["blk.0.attn_norm.weight"].type_name == "F32"
    assert read_gguf(half.mmproj).tensors["mm.2.weight"].type_name == "F32"  # the mmproj keeps its f32


def test_bad_widths_are_refused(tiny_dir):
    with pytest.raises(ValueError):
        widen.widen_trained_pair(tiny_dir, n_embd=128)  # 2 heads of 64: fewer than the trained 4
    with pytest.raises(ValueError):
        widen.widen_trained_pair(tiny_dir, n_embd=256, n_layer=3)


# ----------------------------------------------------------------------------- EAGLE3


@pytest.fixture(scope="module")
def wide_eagle3(tiny_dir):
    return widen.widen_trained_eagle3(tiny_dir, n_embd=SMALL["n_embd"], n_ff=SMALL["n_ff"], dtype=SMALL["dtype"])


def _eagle3_run(target, mmproj, draft, draft_max: int | None, kv: str, spec_type: str = "draft-eagle3",
                cases: dict = CASES):
    """Greedy results for ``cases`` (``spec_type``, EAGLE3 by default, or target-only when ``draft_max``
    is None) and every proposal the drafter made, in order: (tokens, a copy of its logits)."""
    proposals = []
    with ps.load(target, mmproj=mmproj, draft=draft if draft_max else None,
                 spec_type=spec_type if draft_max else "none", draft_max=draft_max or 7, n_threads=N_THREADS,
                 cache_type_k=kv, cache_type_v=kv) as engine:
        if draft_max:
            draft_fn = engine.drafter.draft

            def recording(requests):
                out = draft_fn(requests)
                proposals.extend((list(p.tokens), None if p.logits is None else np.array(p.logits)) for p in out)
                return out

            engine.drafter.draft = recording
        results = {name: engine.generate(p, images=[BLACK] if img else [], max_tokens=MAX_TOKENS, temperature=0.0,
                                         cache_prompt=False) for name, (p, img) in cases.items()}
    return results, proposals


@pytest.mark.parametrize("draft_max,kv,rel", [(3, "f16", 1e-3), (7, "f16", 1e-3), (7, "f32", 1e-5)])
def test_widened_eagle3_is_lossless_and_proposes_what_the_trained_one_proposes(wide, wide_eagle3, target_only,
                                                                                draft_max, kv, rel):
    ours, ours_p = _eagle3_run(wide.target, wide.mmproj, wide_eagle3, draft_max, kv)
    theirs, theirs_p = _eagle3_run(TRAINED.target, TRAINED.mmproj, EAGLE3, draft_max, kv)
    alone = target_only["wide"] if kv == "f16" else _eagle3_run(wide.target, wide.mmproj, None, None, kv)[0]
    for name in CASES:
        assert ours[name].tokens == alone[name].tokens, name  # lossless
        assert ours[name].tokens == theirs[name].tokens, name
        a, b = ours[name].stats, theirs[name].stats
        assert a.drafted > 0 and a.mean_accepted_length > 1.5, (name, a.as_dict())
        assert (a.drafted, a.accepted, a.target_steps) == (b.drafted, b.accepted, b.target_steps), name
    # every draft: the same tokens, and the draft's logits over the vocabulary (f16 caches round
    # the K/V of the two drafts apart by about 1e-4 of the scale)
    assert [t for t, _ in ours_p] == [t for t, _ in theirs_p] and sum(len(t) for t, _ in ours_p) > 20
    for (tokens, x), (_, y) in zip(ours_p, theirs_p):
        if tokens:
            assert x.shape == y.shape == (len(tokens), x.shape[1])
            assert np.abs(x - y).max() <= rel * float(np.abs(y).max())


def test_widened_eagle3_shapes_metadata_and_cache(tiny_dir, wide_eagle3):
    e = read_gguf(wide_eagle3)
    m = e.metadata
    assert (m["eagle3.embedding_length"], m["eagle3.target_hidden_size"], m["eagle3.feed_forward_length"]) == \
        (256, 256, 512)
    assert (m["eagle3.attention.head_count"], m["eagle3.attention.head_count_kv"], m["eagle3.attention.key_length"],
            m["eagle3.rope.dimension_count"]) == (4, 2, 64, 64)
    assert list(m["eagle3.target_layers"]) == [1, 2, 3] and "eagle3.rope.dimension_sections" not in m
    assert e.tensors["fc.weight"].dims == (3 * 256, 256) and e.tensors["blk.0.attn_q.weight"].dims == (2 * 256, 256)
    assert "token_embd.weight" not in e.tensors and "output.weight" not in e.tensors  # the target's, as trained
    t = read_gguf(EAGLE3)
    q_t, q_w = read_tensor(t, "blk.0.attn_q.weight"), read_tensor(e, "blk.0.attn_q.weight")
    # plain (NORM) rope rotates adjacent dims: dim 2i + 1 of trained head 1 is dim 4 * 2i + 1 of wide head 1,
    # q scaled by s_h = 2; the attention input is [embedding | g]: trained column 64 + c is wide column 256 + c
    assert np.array_equal(q_w[64 + 8 * 3 + 1, :64], 2 * q_t[16 + 2 * 3 + 1, :64])
    assert np.array_equal(q_w[64 + 8 * 3 + 1, 256:256 + 64], 2 * q_t[16 + 2 * 3 + 1, 64:])
    assert not q_w[64 + 8 * 3 + 2].any() and not q_w[:, 64:256].any() and not q_w[:, 256 + 64:].any()
    k_t, k_w = read_tensor(t, "blk.0.attn_k.weight"), read_tensor(e, "blk.0.attn_k.weight")
    assert np.array_equal(k_w[64 + 8 * 5, 256:256 + 64], k_t[16 + 2 * 5, 64:])  # K unscaled
    fc_t, fc_w = read_tensor(t, "fc.weight"), read_tensor(e, "fc.weight")
    assert np.array_equal(fc_w[:64, 2 * 256:2 * 256 + 64], fc_t[:, 2 * 64:]) and not fc_w[64:].any()
    # norms over the residual (s_r = 2 at 256) divided by s_r; attn_output / ffn_down times s_r
    for name, scale, at in (("attn_norm_2", 0.5, np.s_[:64]), ("ffn_down", 2.0, np.s_[:64, :256])):
        w_, t_ = read_tensor(e, f"blk.0.{name}.weight"), read_tensor(t, f"blk.0.{name}.weight")
        assert np.array_equal(w_[at], t_ * scale)
    with Model(wide_eagle3, role="draft") as d:
        assert d.n_params == 3 * 256 * 256 + 2 * 256 * (4 * 64 + 2 * 2 * 64) + 256 * 4 * 64 + 3 * 256 * 512 + 4 * 256
    mtime = wide_eagle3.stat().st_mtime_ns
    again = widen.widen_trained_eagle3(tiny_dir, n_embd=256, n_ff=512, dtype="f32")
    assert again == wide_eagle3 and wide_eagle3.stat().st_mtime_ns == mtime
    half = read_gguf(widen.widen_trained_eagle3(tiny_dir, n_embd=256, n_ff=512, dtype="f16"))
    assert half.tensors["fc.weight"].type_name == "F16" and half.tensors["blk.0.attn_q.weight"].type_name == "F16"
    assert half.tensors["blk.0.attn_norm.weight"].type_name == "F32"


def _eagle3_variant(path, *, drop=(), add_tensors=None, overrides=None, add_values=None, src=EAGLE3):
    """The trained EAGLE3 draft (or ``src``) with tensors dropped / added and keys changed / added."""
    info = read_gguf(src)
    w = GGUFWriter()
    widen._copy_metadata(w, info, overrides or {})
    for key, (vtype, value) in (add_values or {}).items():
        w.add_value(key, vtype, value)
    for name in info.tensors:
        if name not in drop:
            w.add_tensor(name, read_tensor(info, name))
    for name, x in (add_tensors or {}).items():
        w.add_tensor(name, x)
    w.write(path)
    return path


def test_bad_eagle3_inputs_are_refused(tmp_path, wide, wide_eagle3):
    from pyllama_spec.gguf.reader import ValueType

    target = MODELS_DIR / "trained-target.gguf"
    write = lambda src, tgt=target, **kw: widen.write_widened_eagle3(  # noqa: E731
        tmp_path / "out.gguf", src, tgt, **dict(dict(n_embd=256, n_ff=512, dtype="f32"), **kw))
    with pytest.raises(ValueError, match="expected a 'eagle3' file"):
        write(MODELS_DIR / "trained-draft.gguf")  # a DFlash draft
    with pytest.raises(ValueError, match="n_embd must be"):
        write(EAGLE3, n_embd=200)
    with pytest.raises(ValueError, match="fewer than the trained"):
        write(EAGLE3, n_embd=128)  # 2 heads of 64: fewer than the trained 4
    with pytest.raises(ValueError, match="n_ff 128 below the trained 256"):
        write(EAGLE3, n_ff=128)
    with pytest.raises(ValueError, match="target_hidden_size"):
        write(_eagle3_variant(tmp_path / "hidden.gguf", overrides={"eagle3.target_hidden_size": 128}))
    with pytest.raises(ValueError, match="target_layers"):
        write(_eagle3_variant(tmp_path / "layers.gguf", overrides={"eagle3.target_layers": [1, 2, 4]}))
    with pytest.raises(ValueError, match="norm_before_residual"):
        write(_eagle3_variant(tmp_path / "nbr.gguf",
                              add_values={"eagle3.norm_before_residual": (ValueType.BOOL, True)}))
    with pytest.raises(ValueError, match="token_embd"):
        write(_eagle3_variant(tmp_path / "embd.gguf", add_tensors={
            "token_embd.weight": read_tensor(read_gguf(target), "token_embd.weight")}))
    with pytest.raises(ValueError, match="do not know how to pad|does not know how to pad"):
        write(_eagle3_variant(tmp_path / "extra.gguf",
                              add_tensors={"blk.0.attn_q_norm.weight": np.ones(16, np.float32)}))
    assert not (tmp_path / "out.gguf").exists()
    # the widened draft pairs only with a target of its width: the loader says so before any context
    with pytest.raises(IncompatibleModelsError, match="target_hidden_size is 256"):
        ps.load(TRAINED.target, draft=wide_eagle3, spec_type="draft-eagle3", n_threads=N_THREADS)
    with pytest.raises(IncompatibleModelsError, match="target_hidden_size is 64"):
        ps.load(wide.target, draft=EAGLE3, spec_type="draft-eagle3", n_threads=N_THREADS)



# ----------------------------------------------------------------------------- draft model (draft-simple)

DRAFT_MODEL = MODELS_DIR / widen.DRAFT_MODEL
SMALL_DM = dict(n_embd=192, n_ff=256, dtype="f32")  # 3 heads of 64 / 1 KV head (ratio 3), s_r = s_h = 2


@pytest.fixture(scope="module")
def wide_draft_model(tiny_dir):
    return widen.widen_trained_draft_model(tiny_dir, **SMALL_DM)


@pytest.mark.parametrize("draft_max,kv,rel", [(3, "f16", 1e-3), (7, "f16", 1e-3), (7, "f32", 1e-5)])
def test_widened_draft_model_is_lossless_and_proposes_what_the_trained_one_proposes(wide, wide_draft_model,
                                                                                    target_only, draft_max, kv, rel):
    ours, ours_p = _eagle3_run(wide.target, wide.mmproj, wide_draft_model, draft_max, kv, "draft-simple")
    theirs, theirs_p = _eagle3_run(TRAINED.target, TRAINED.mmproj, DRAFT_MODEL, draft_max, kv, "draft-simple")
    alone = target_only["wide"] if kv == "f16" else _eagle3_run(wide.target, wide.mmproj, None, None, kv)[0]
    for name in CASES:
        assert ours[name].tokens == alone[name].tokens, name  # lossless
        assert ours[name].tokens == theirs[name].tokens, name
        a, b = ours[name].stats, theirs[name].stats
        assert a.drafted > 0, (name, a.as_dict())
        assert (a.drafted, a.accepted, a.target_steps) == (b.drafted, b.accepted, b.target_steps), name
    assert [t for t, _ in ours_p] == [t for t, _ in theirs_p] and sum(len(t) for t, _ in ours_p) > 20
    compared = 0
    for (tokens, x), (_, y) in zip(ours_p, theirs_p):
        assert (x is None) == (y is None)
        if tokens and x is not None:
            assert x.shape == y.shape
            assert np.abs(x - y).max() <= rel * float(np.abs(y).max())
            compared += 1
    assert compared  # the draft model gives its logits: the check above ran


def test_widened_draft_model_shapes_metadata_and_cache(tiny_dir, wide_draft_model):
    e = read_gguf(wide_draft_model)
    m = e.metadata
    assert (m["hunyuan_vl.embedding_length"], m["hunyuan_vl.block_count"], m["hunyuan_vl.feed_forward_length"]) == \
        (192, 2, 256)
    assert (m["hunyuan_vl.attention.head_count"], m["hunyuan_vl.attention.head_count_kv"],
            m["hunyuan_vl.attention.key_length"], m["hunyuan_vl.rope.dimension_count"]) == (3, 1, 64, 64)
    assert list(m["hunyuan_vl.rope.dimension_sections"]) == [8, 12, 12, 0]
    t = read_gguf(DRAFT_MODEL)
    q_t, q_w = read_tensor(t, "blk.0.attn_q.weight"), read_tensor(e, "blk.0.attn_q.weight")
    # NeoX/M-RoPE pairs (i, i + 8) of a trained head of 16 go to (4 i, 32 + 4 i) of the wide head; q times s_h = 2
    assert np.array_equal(q_w[2 * 64 + 4 * 3, :48], 2 * q_t[2 * 16 + 3, :])
    assert np.array_equal(q_w[2 * 64 + 32 + 4 * 2, :48], 2 * q_t[2 * 16 + 8 + 2, :])
    assert not q_w[:, 48:].any() and not q_w[2 * 64 + 1].any()
    k_t, k_w = read_tensor(t, "blk.1.attn_k.weight"), read_tensor(e, "blk.1.attn_k.weight")
    assert k_w.shape == (64, 192) and np.array_equal(k_w[4 * 5, :48], 2 * k_t[5, :])
    emb_t, emb_w = read_tensor(t, "token_embd.weight"), read_tensor(e, "token_embd.weight")
    assert np.array_equal(emb_w[:, :48], 2 * emb_t) and not emb_w[:, 48:].any()  # s_r = 2
    assert np.array_equal(read_tensor(e, "output_norm.weight")[:48], read_tensor(t, "output_norm.weight") / 2)
    with Model(wide_draft_model, role="draft") as d:
        per_layer = 192 * (3 * 64 + 2 * 64) + 3 * 64 * 192 + 3 * 192 * 256 + 2 * 192 + 2 * 64
        assert d.n_params == 2 * 269 * 192 + 192 + 2 * per_layer
    mtime = wide_draft_model.stat().st_mtime_ns
    again = widen.widen_trained_draft_model(tiny_dir, **SMALL_DM)
    assert again == wide_draft_model and wide_draft_model.stat().st_mtime_ns == mtime
    half = read_gguf(widen.widen_trained_draft_model(tiny_dir, **dict(SMALL_DM, dtype="f16")))
    assert [half.tensors[n].type_name for n in ("blk.0.attn_q.weight", "token_embd.weight",
                                                "blk.0.attn_norm.weight")] == ["F16", "F16", "F32"]


def test_bad_draft_model_widths_are_refused(tmp_path):
    for kw, match in ((dict(n_embd=256), "times a power of 4"),  # 256 / 48 is no integer
                      (dict(n_embd=384), "times a power of 4"),  # 8: the residual scale would be sqrt(8)
                      (dict(n_embd=768, n_head=24, n_head_kv=8), "head dim 32"),  # q/k scale sqrt(2)
                      (dict(n_embd=768, n_head=12, n_head_kv=6), "GQA ratio"),
                      (dict(n_embd=192, n_ff=128), "n_ff 128 below the trained 2 / 192"),
                      (dict(n_embd=192, n_layer=1, n_ff=256), "n_layer 1 / n_ff 256 below")):
        with pytest.raises(ValueError, match=match):
            widen.widen_trained_draft_model(tmp_path, **kw)
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="both n_head and n_head_kv"):
        widen.write_widened_hunyuan_vl(tmp_path / "out.gguf", DRAFT_MODEL, n_embd=768, n_layer=2, n_ff=256,
                                       dtype="f32", n_head=12)
    assert not (tmp_path / "out.gguf").exists()


# ----------------------------------------------------------------------------- qwen35 + its MTP head (draft-mtp)

QWEN35 = MODELS_DIR / widen.QWEN35_MTP
QWEN35_MMPROJ = MODELS_DIR / widen.QWEN35_MTP_MMPROJ
# s_r = s_h = 2; layers 4-6 zero delta nets, 7 a zero attention layer, the MTP block at 8
SMALL_MTP = dict(n_embd=256, n_layer=8, n_ff=512, dtype="f32")
STACK = ('class Stack:\n    """A last-in, first-out container."""\n\n    def __init__(self):\n'
         '        self._items = []\n\n    def push(self, item):\n        self._items.append(item)\n\n'
         '    def pop(self):\n        ')
# the trained qwen35 answers READ_CONFIG (CASES) with indentation only: prompts it answers with code
MTP_CASES = {"text": (PROMPT, False), "stack": (STACK, False), "image": ("<__media__>\n" + STACK, True)}
NOISE = np.random.default_rng(0).integers(0, 256, (336, 448, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def wide_qwen35(tiny_dir) -> tiny.TinyModels:
    return widen.widen_trained_qwen35_mtp(tiny_dir, **SMALL_MTP)


def _qwen35_logits_and_hidden(target, mmproj, text: str, image=None):
    """llama.cpp's logits and final hidden states (h_nextn, what the MTP head reads) of the text rows of
    [picture,] text, with f32 KV caches."""
    from pyllama_spec.bindings.mtmd import MEDIA_MARKER, Bitmap, Projector

    with Model(target) as m, Projector(mmproj, m, n_threads=N_THREADS) as proj, \
            Context(m, n_ctx=1024, n_batch=256, n_ubatch=256, n_threads=N_THREADS, flash_attn=False,
                    type_k="f32", type_v="f32") as ctx:
        ctx.enable_draft_embeddings(True, masked=False)
        pos = 0
        if image is None:
            toks = m.tokenize(text)
        else:
            pre, media, post = proj.tokenize(MEDIA_MARKER + text, [Bitmap(image)])
            assert media.type == "image"
            ctx.decode_tokens(pre.tokens, np.arange(len(pre.tokens)))
            pos = proj.decode_media(ctx, media, proj.encode(media), len(pre.tokens), n_batch=256)
            toks = post.tokens
        ctx.decode_tokens(toks, pos + np.arange(len(toks)), outputs=True)
        return ctx.output_logits(len(toks)).copy(), ctx.draft_embeddings(len(toks)).copy()


@pytest.mark.parametrize("picture", [None, "noise"])
def test_widened_qwen35_gives_the_trained_logits_and_hidden_state(wide_qwen35, picture):
    image = None if picture is None else NOISE
    ours, ours_h = _qwen35_logits_and_hidden(wide_qwen35.target, wide_qwen35.mmproj, STACK, image)
    theirs, theirs_h = _qwen35_logits_and_hidden(QWEN35, QWEN35_MMPROJ, STACK, image)
    assert len(theirs) > 50
    assert np.abs(ours - theirs).max() <= 1e-5 * float(np.abs(theirs).max())
    assert np.array_equal(ours.argmax(1), theirs.argmax(1))
    # the final norm's output is s_r times the trained one (module docstring), in dims 0..63
    s_r = np.sqrt(SMALL_MTP["n_embd"] / 64)
    assert np.abs(ours_h[:, :64] / s_r - theirs_h).max() <= 1e-5 * float(np.abs(theirs_h).max())
    assert not ours_h[:, 64:].any()


@pytest.fixture(scope="module")
def qwen35_alone(wide_qwen35) -> dict:
    """The widened qwen35 target alone, per KV cache type."""
    return {kv: _eagle3_run(wide_qwen35.target, wide_qwen35.mmproj, None, None, kv, cases=MTP_CASES)[0]
            for kv in ("f16", "f32")}


@pytest.mark.parametrize("draft_max,kv,rel", [(1, "f16", 1e-3), (3, "f16", 1e-3), (3, "f32", 1e-5)])
def test_widened_qwen35_mtp_is_lossless_and_drafts_what_the_trained_one_drafts(wide_qwen35, qwen35_alone,
                                                                                draft_max, kv, rel):
    ours, ours_p = _eagle3_run(wide_qwen35.target, wide_qwen35.mmproj, None, draft_max, kv, "draft-mtp", MTP_CASES)
    theirs, theirs_p = _eagle3_run(QWEN35, QWEN35_MMPROJ, None, draft_max, kv, "draft-mtp", MTP_CASES)
    for name in MTP_CASES:
        alone = qwen35_alone[kv][name].tokens
        assert len(alone) == MAX_TOKENS and len(set(alone)) >= 8, name  # text, not a run of one token
        assert ours[name].tokens == alone, name  # lossless
        assert ours[name].tokens == theirs[name].tokens, name
        a, b = ours[name].stats, theirs[name].stats
        assert a.drafted > 0 and a.accepted / a.drafted > 0.3, (name, a.as_dict())
        assert (a.drafted, a.accepted, a.target_steps) == (b.drafted, b.accepted, b.target_steps), name
    # every draft: the same tokens, and the head's logits over the vocabulary
    assert [t for t, _ in ours_p] == [t for t, _ in theirs_p] and sum(len(t) for t, _ in ours_p) > 20
    compared = 0
    for (tokens, x), (_, y) in zip(ours_p, theirs_p):
        if tokens:
            assert x.shape == y.shape == (len(tokens), x.shape[1])
            assert np.abs(x - y).max() <= rel * float(np.abs(y).max())
            compared += 1
    assert compared


def test_widened_qwen35_shapes_metadata_dtypes_and_cache(tiny_dir, wide_qwen35):
    assert wide_qwen35.draft is None  # the head is a block of the target
    w, t = read_gguf(wide_qwen35.target), read_gguf(QWEN35)
    m = w.metadata
    assert (m["qwen35.embedding_length"], m["qwen35.block_count"], m["qwen35.nextn_predict_layers"],
            m["qwen35.feed_forward_length"]) == (256, 9, 1, 512)
    assert (m["qwen35.attention.head_count"], m["qwen35.attention.head_count_kv"],
            m["qwen35.attention.key_length"], m["qwen35.rope.dimension_count"]) == (4, 2, 64, 64)
    assert list(m["qwen35.rope.dimension_sections"]) == [12, 12, 8, 0]  # [3, 3, 2, 0] times 4
    # delta nets: heads of the trained 16 dims, 16 key = 16 value heads (the trained 4 first)
    assert (m["qwen35.ssm.state_size"], m["qwen35.ssm.group_count"], m["qwen35.ssm.time_step_rank"],
            m["qwen35.ssm.inner_size"], m["qwen35.ssm.conv_kernel"]) == (16, 16, 16, 256, 4)
    assert list(m["qwen35.attention.recurrent_layers"]) == [True, False, False, False, True, True, True, False,
                                                           False]
    rd = lambda info, name: read_tensor(info, name)  # noqa: E731
    # attn_qkv / conv channels [q | k | v heads]: trained k head 1 dim 3 (row 64 + 16 + 3) at 256 + 16 + 3,
    # v head 2 dim 5 (row 128 + 32 + 5) at 512 + 32 + 5; unscaled (the input norm gives the trained input)
    qkv_t, qkv_w = rd(t, "blk.0.attn_qkv.weight"), rd(w, "blk.0.attn_qkv.weight")
    assert qkv_w.shape == (3 * 256, 256) and not qkv_w[:, 64:].any()
    assert np.array_equal(qkv_w[256 + 19, :64], qkv_t[64 + 19])
    assert np.array_equal(qkv_w[512 + 37, :64], qkv_t[128 + 37])
    assert not qkv_w[64:256].any() and not qkv_w[256 + 64:512].any() and not qkv_w[512 + 64:].any()
    conv_t, conv_w = rd(t, "blk.0.ssm_conv1d.weight"), rd(w, "blk.0.ssm_conv1d.weight")
    assert np.array_equal(conv_w[512 + 37], conv_t[128 + 37]) and not conv_w[512 + 64:].any()
    for name in ("ssm_a", "ssm_dt.bias"):
        x_t, x_w = rd(t, f"blk.0.{name}"), rd(w, f"blk.0.{name}")
        assert np.array_equal(x_w[:4], x_t) and not x_w[4:].any()
    out_t, out_w = rd(t, "blk.0.ssm_out.weight"), rd(w, "blk.0.ssm_out.weight")
    assert np.array_equal(out_w[:64, :64], 2 * out_t) and not out_w[64:].any() and not out_w[:, 64:].any()
    # gated attention: head 1's query dim 3 (trained row 32 + 3) at wide row 128 + 4 * 3, times s_h = 2;
    # its gate dim 3 (trained row 32 + 16 + 3) at 128 + 64 + 4 * 3, unscaled
    q_t, q_w = rd(t, "blk.1.attn_q.weight"), rd(w, "blk.1.attn_q.weight")
    assert q_w.shape == (2 * 4 * 64, 256)
    assert np.array_equal(q_w[128 + 12, :64], 2 * q_t[32 + 3]) and np.array_equal(q_w[128 + 64 + 12, :64], q_t[48 + 3])
    # the embedding times s_r, the final norm as trained, the output head / s_r
    assert np.array_equal(rd(w, "token_embd.weight")[:, :64], 2 * rd(t, "token_embd.weight"))
    assert np.array_equal(rd(w, "output_norm.weight")[:64], rd(t, "output_norm.weight"))
    assert np.array_equal(rd(w, "output.weight")[:, :64], rd(t, "output.weight") / 2)
    # the MTP block (trained blk.4) after the trunk: eh_proj's [embedding | h] halves at columns 0 and 256, x s_r
    eh_t, eh_w = rd(t, "blk.4.nextn.eh_proj.weight"), rd(w, "blk.8.nextn.eh_proj.weight")
    assert np.array_equal(eh_w[:64, :64], 2 * eh_t[:, :64])
    assert np.array_equal(eh_w[:64, 256:256 + 64], 2 * eh_t[:, 64:]) and not eh_w[64:].any()
    assert np.array_equal(rd(w, "blk.8.nextn.hnorm.weight")[:64], rd(t, "blk.4.nextn.hnorm.weight") / 2)
    assert np.array_equal(rd(w, "blk.8.attn_k_norm.weight")[::4][:8], rd(t, "blk.4.attn_k_norm.weight")[:8] / 2)
    # layers past the trained four are all zero, a delta net (5) and an attention layer (7) alike
    for name in ("blk.5.attn_qkv.weight", "blk.5.ssm_a", "blk.5.ssm_norm.weight", "blk.7.attn_q.weight",
                 "blk.7.post_attention_norm.weight", "blk.7.ffn_down.weight"):
        assert not rd(w, name).any(), name
    # the projector's merger output padded, times s_r
    mm_t, mm_w = read_gguf(QWEN35_MMPROJ), read_gguf(wide_qwen35.mmproj)
    assert mm_w.metadata["clip.vision.projection_dim"] == 256 and mm_w.tensors["mm.2.weight"].dims == (128, 256)
    assert np.array_equal(rd(mm_w, "mm.2.weight")[:64], 2 * rd(mm_t, "mm.2.weight"))
    E, V, F = 256, 269, 512
    attn = E * 2 * 4 * 64 + 2 * E * 2 * 64 + 4 * 64 * E + 2 * 64
    delta = 3 * E * E + E * E + 3 * E * 4 + 2 * 16 + 2 * 16 * E + 16 + E * E
    layer = 2 * E + 3 * E * F
    mtp = attn + layer + 2 * E * E + 2 * E
    with Model(wide_qwen35.target) as model:
        assert model.n_params == 2 * V * E + E + 4 * (attn + layer) + 4 * (delta + layer) + mtp
    # cached: a second call reuses the files; f16 stores the matrices as F16, norms / conv / ssm_a as F32
    mtime = wide_qwen35.target.stat().st_mtime_ns
    assert widen.widen_trained_qwen35_mtp(tiny_dir, **SMALL_MTP) == wide_qwen35
    assert wide_qwen35.target.stat().st_mtime_ns == mtime
    half = widen.widen_trained_qwen35_mtp(tiny_dir, **dict(SMALL_MTP, dtype="f16"))
    h = read_gguf(half.target)
    assert half.target != wide_qwen35.target
    assert [h.tensors[n].type_name for n in ("blk.0.attn_qkv.weight", "blk.0.ssm_beta.weight", "blk.1.attn_q.weight",
                                             "blk.8.nextn.eh_proj.weight", "output.weight")] == ["F16"] * 5
    assert [h.tensors[n].type_name for n in ("blk.0.ssm_conv1d.weight", "blk.0.ssm_a", "blk.0.ssm_norm.weight",
                                             "blk.8.nextn.enorm.weight", "output_norm.weight")] == ["F32"] * 5


def test_bad_qwen35_widths_and_files_are_refused(tmp_path):
    for kw, match in ((dict(n_embd=128), "times a power of 4"),  # s_r would be sqrt(2)
                      (dict(n_embd=512), "times a power of 4"),
                      (dict(n_embd=200), "times a power of 4"),
                      (dict(n_embd=256, n_layer=3), "n_layer 3 / n_ff 2240 below the trained 4 / 256"),
                      (dict(n_embd=256, n_ff=128), "n_layer 12 / n_ff 128 below the trained 4 / 256"),
                      (dict(n_embd=256, dtype="q8_0"), "dtype")):
        with pytest.raises(ValueError, match=match):
            widen.widen_trained_qwen35_mtp(tmp_path / "out", **kw)
    assert not (tmp_path / "out").exists()
    write = lambda src: widen.write_widened_qwen35(tmp_path / "out.gguf", src, **SMALL_MTP)  # noqa: E731
    with pytest.raises(ValueError, match="expected a 'qwen35' file"):
        write(MODELS_DIR / "trained-target.gguf")
    with pytest.raises(ValueError, match="as many key as value heads"):  # 2 key heads for 4 value heads
        write(_eagle3_variant(tmp_path / "gqa.gguf", src=QWEN35, overrides={"qwen35.ssm.group_count": 2}))
    with pytest.raises(ValueError, match="one MTP"):
        write(_eagle3_variant(tmp_path / "nextn.gguf", src=QWEN35, overrides={"qwen35.nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match="does not know how to pad"):  # an own head norm for the MTP block
        write(_eagle3_variant(tmp_path / "head.gguf", src=QWEN35, add_tensors={
            "blk.4.nextn.shared_head_norm.weight": np.ones(64, np.float32)}))
    with pytest.raises(ValueError, match="deepstack"):
        widen.write_widened_mmproj(tmp_path / "out.gguf", _eagle3_variant(
            tmp_path / "deep.gguf", src=QWEN35_MMPROJ, overrides={"clip.vision.is_deepstack_layers": [True]}),
            n_embd=256)
    assert not (tmp_path / "out.gguf").exists()


def test_a_moved_mtp_block_left_unwritten_is_refused(tmp_path, monkeypatch):
    """The MTP block moves from trained blk.4 to blk.{n_layer}; the wide blk.4 is a zero trunk layer that carries
    the same names, which must not stand in for the moved block's tensors."""
    n_layer = SMALL_MTP["n_layer"]
    add = GGUFWriter.add_tensor

    def add_all_but_the_heads_norm(self, name, *args, **kwargs):
        if name == f"blk.{n_layer}.attn_norm.weight":
            return None
        return add(self, name, *args, **kwargs)

    monkeypatch.setattr(GGUFWriter, "add_tensor", add_all_but_the_heads_norm)
    with pytest.raises(ValueError, match=r"does not know how to pad: \['blk\.4\.attn_norm\.weight'\]"):
        widen.widen_trained_qwen35_mtp(tmp_path, **SMALL_MTP)
