"""pyllama_spec.devtools.widen: the trained tiny pair zero-padded to wider shapes computes the same function.

At a small width (n_embd 256 = 4 heads of 64 / 2 KV heads, 6 layers, n_ff 512, f32) so that the
tests take seconds; the construction is the same at the bench size (1024 / 12 / 2816, f16:
``bench/dflash_bench_size.py`` measures it).

* the widened target's logits and layer inputs equal the trained target's (to float summation
  order with an f32 KV cache; through llama.cpp's default f16 KV cache about 1e-4 of the scale);
* its greedy continuations equal the trained target's, for text and after an image;
* the widened DFlash pair is lossless and accepts what the trained pair accepts;
* shapes, metadata, dtypes and the cache.
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
from pyllama_spec.gguf.reader import read_gguf, read_tensor

TRAINED = ps.embedded_models()
SMALL = dict(n_embd=256, n_layer=6, n_ff=512, dtype="f32")
READ_CONFIG = ('def read_config(path):\n    """Read a configuration file and return a dict."""\n'
               '    result = {}\n    with open(path) as f:\n        for line in f:\n            line = line.strip()\n'
               '            if not line or line.startswith("#"):\n                continue\n')
CASES = {"text": (PROMPT, False), "text2": (READ_CONFIG, False), "image": ("<__media__>\n" + READ_CONFIG, True)}
MAX_TOKENS = 48
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
