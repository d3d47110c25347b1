"""DFlash2 drafts: a tiny DFlash2 draft (``tiny.write_draft(dflash2=True)``) loads, drives the
engine, and the selector lattice it produces has the layout ``DFlashDrafter._read_lattice`` walks.

Upstream (src/models/dflash.cpp ``build_dflash2_selector``) packs, per block row i >= 1,
``top_k`` candidate ids (as floats) then a ``top_k x top_k`` score matrix indexed
[predecessor][successor]; row 0 (the anchor) is zero, the rest of each row is padding.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import LLAMA_SERVER, N_THREADS, TINY_ENGINE, needs_llama_server

import pyllama_spec
import pyllama_spec.serving.engine
from pyllama_spec.devtools import tiny
from pyllama_spec.gguf.writer import read_gguf_metadata

K = tiny.DFLASH2_SELECTOR_TOP_K
RANK = tiny.DFLASH2_SELECTOR_RANK
KERNEL = tiny.DFLASH2_CONV_KERNEL_SIZE
GROUP = tiny.DFLASH2_CONV_GROUP_SIZE
DRAFT_MAX = 7
MAX_TOKENS = 32


@pytest.fixture(scope="session", params=["hunyuan_vl", "qwen35"])
def tiny_dflash2(request, tiny_dir) -> tiny.TinyModels:
    """Target + mmproj + DFlash2 draft (window 32, predictable 0.5, seed 0)."""
    return tiny.make_tiny_set(tiny_dir, arch=request.param, seed=0, window=32, predictable=0.5, dflash2=True)


# -- the file ------------------------------------------------------------------------


def test_dflash2_draft_has_the_keys_and_tensors_llama_cpp_loads(tmp_path):
    plain = read_gguf_metadata(tiny.write_draft(tmp_path / "plain.gguf"), with_tensors=True)
    d2 = read_gguf_metadata(tiny.write_draft(tmp_path / "d2.gguf", dflash2=True), with_tensors=True)
    n_embd, n_vocab = 64, tiny.N_VOCAB
    assert d2["dflash.conv_kernel_size"] == KERNEL
    assert d2["dflash.conv_group_size"] == GROUP
    assert d2["dflash.selector_rank"] == RANK
    assert d2["dflash.selector_top_k"] == K
    t = d2["__tensors__"]
    # ggml dims as src/models/dflash.cpp creates them
    assert t["selector_predecessor.weight"][0] == (RANK, n_vocab)
    assert t["selector_successor.weight"][0] == (RANK, n_vocab)
    assert t["selector_hidden.weight"][0] == (n_embd, RANK)
    for side in ("attn", "ffn"):
        assert t[f"blk.0.{side}_conv_base"][0] == (n_embd, KERNEL, 2)
        assert t[f"blk.0.{side}_conv_proj.weight"][0] == (n_embd, 2 * KERNEL * (n_embd // GROUP))
    # a plain draft carries none of it; the DFlash2 draft keeps every plain tensor as it is
    dflash2_keys = {"dflash.conv_kernel_size", "dflash.conv_group_size", "dflash.selector_rank",
                    "dflash.selector_top_k"}
    assert not dflash2_keys & set(plain)
    assert set(d2) - set(plain) == dflash2_keys
    extra = set(t) - set(plain["__tensors__"])
    assert extra == {"selector_predecessor.weight", "selector_successor.weight", "selector_hidden.weight",
                     "blk.0.attn_conv_base", "blk.0.attn_conv_proj.weight",
                     "blk.0.ffn_conv_base", "blk.0.ffn_conv_proj.weight"}
    assert all(t[name] == dims for name, dims in plain["__tensors__"].items())


def test_dflash2_draft_refuses_what_llama_cpp_refuses(tmp_path):
    with pytest.raises(ValueError, match="selector_top_k"):
        tiny.write_draft(tmp_path / "a.gguf", dflash2=True, selector_top_k=8)  # 8 * 9 = 72 > 64
    with pytest.raises(ValueError, match="conv_group_size"):
        tiny.write_draft(tmp_path / "b.gguf", dflash2=True, conv_group_size=24)
    with pytest.raises(ValueError, match="selector_rank"):
        tiny.write_draft(tmp_path / "c.gguf", dflash2=True, selector_rank=0)
    # the largest lattice that fits a row: 7 + 7 * 7 = 56 <= 64
    tiny.write_draft(tmp_path / "d.gguf", dflash2=True, selector_top_k=7)


def test_make_tiny_set_dflash2_is_a_separate_set(tmp_path):
    plain = tiny.make_tiny_set(tmp_path, window=32, predictable=0.5)
    assert tiny.make_tiny_set(tmp_path, window=32, predictable=0.5, dflash2=False) == plain
    d2 = tiny.make_tiny_set(tmp_path, window=32, predictable=0.5, dflash2=True)
    assert d2.draft != plain.draft
    assert "dflash.selector_top_k" not in read_gguf_metadata(plain.draft)
    assert read_gguf_metadata(d2.draft)["dflash.selector_top_k"] == K


# -- natively -----------------------------------------------------------------------


def test_dflash2_draft_loads_as_dflash2(tiny_dflash2, tiny_dense):
    d2 = pyllama_spec.Model(tiny_dflash2.draft)
    try:
        assert d2.arch == "dflash"
        assert d2.dflash_selector_top_k == K
    finally:
        d2.close()
    plain = pyllama_spec.Model(tiny_dense.draft)
    try:
        assert plain.dflash_selector_top_k == 0
    finally:
        plain.close()


def _walk(lattice: np.ndarray, n: int, k: int) -> list[int]:
    """Upstream's walk (common/speculative.cpp, is_dflash2), written out independently."""
    out, pred = [], 0
    for i in range(1, n + 1):
        scores = lattice[i].reshape(-1)[k:k + k * k].reshape(k, k)[pred]
        pred = int(np.argmax(scores))
        out.append(int(lattice[i][pred]))
    return out


def _engine(models, **kw):
    return pyllama_spec.serving.engine.load(models.target, mmproj=models.mmproj, **TINY_ENGINE, draft_max=DRAFT_MAX,
                                            **kw)


@pytest.mark.parametrize("with_image", [False, True], ids=["text", "image"])
def test_dflash2_generation_equals_target_only_and_reads_a_valid_lattice(tiny_dflash2, with_image):
    images = (np.zeros((672, 672, 3), np.uint8),) if with_image else ()
    prompt = f"Describe {pyllama_spec.MEDIA_MARKER} now" if with_image else "Describe the picture now"

    base = _engine(tiny_dflash2, spec_type="none")
    try:
        expected = base.generate(prompt, images=images, max_tokens=MAX_TOKENS)
        n_vocab = base.model.n_vocab
    finally:
        base.close()

    eng = _engine(tiny_dflash2, draft=tiny_dflash2.draft)
    records: list[tuple[np.ndarray, list[int]]] = []
    try:
        drafter = eng.drafter
        assert drafter is not None and drafter.config.is_dflash2 and drafter.config.selector_top_k == K
        read = drafter._read_lattice

        def spy(n: int, at: int = 0) -> list[int]:
            lattice = np.array(drafter.ctx.draft_embeddings(at + n + 1)[at:])  # copy: the next decode reuses the buffer
            out = read(n, at)
            records.append((lattice, out))
            return out

        drafter._read_lattice = spy
        result = eng.generate(prompt, images=images, max_tokens=MAX_TOKENS)
    finally:
        eng.close()

    assert result.tokens == expected.tokens  # greedy speculative output == target only
    s = result.stats
    assert s.drafted > 0 and records, "the DFlash2 drafter proposed nothing"
    assert s.drafted == sum(len(out) for _, out in records)
    # the predictable target makes the attractor a good guess: some drafts must be accepted
    assert 0 < s.accepted <= s.drafted

    varies_with_predecessor = False
    for lattice, out in records:
        n = len(out)
        assert lattice.shape == (n + 1, 64)
        assert all(0 <= t < n_vocab for t in out), out
        assert np.all(lattice[0] == 0.0), "row 0 (the anchor) should be the zero row upstream packs"
        cand = lattice[1:, :K]
        assert np.all(np.isfinite(lattice))
        assert np.all(cand == np.round(cand)), "candidate ids are not integral: lattice layout differs"
        assert cand.min() >= 0 and cand.max() < n_vocab
        assert all(len(set(row)) == K for row in cand.tolist()), "top-k candidates should be distinct"
        assert np.all(lattice[1:, K + K * K:] == 0.0), "padding after the score matrix should be zero"
        scores = lattice[1:, K:K + K * K].reshape(n, K, K)
        # position 1's predecessor is the anchor token: one score row, repeated for every predecessor
        assert np.all(scores[0] == scores[0][:1])
        varies_with_predecessor |= any(not np.all(m == m[:1]) for m in scores[1:])
        assert out == _walk(lattice, n, K)
    assert varies_with_predecessor, "no lattice row's scores depended on the predecessor"


class _FakeDraftContext:
    def __init__(self, lattice: np.ndarray) -> None:
        self.lattice = lattice

    def draft_embeddings(self, n_rows: int) -> np.ndarray:
        assert n_rows <= len(self.lattice)
        return self.lattice[:n_rows]


def _lattice_drafter(lattice: np.ndarray, *, p_min: float = 0.0):
    from pyllama_spec.drafters.dflash import DFlashConfig, DFlashDrafter

    d = object.__new__(DFlashDrafter)  # only what _read_lattice touches
    d.config = DFlashConfig(target_layers=(1,), block_size=16, mask_token=tiny.MASK_TOKEN_ID, sliding_window=0,
                            causal=False, selector_top_k=K)
    d.ctx = _FakeDraftContext(lattice)
    d.p_min = p_min
    d._n_vocab = tiny.N_VOCAB
    return d


def _random_lattice(rng: np.random.Generator, n: int) -> np.ndarray:
    lattice = np.zeros((n + 1, 64), np.float32)
    for i in range(1, n + 1):  # different candidates on every row, so a row mix-up shows
        lattice[i, :K] = rng.choice(tiny.N_VOCAB, K, replace=False)
        lattice[i, K:K + K * K] = rng.standard_normal(K * K)
    return lattice


@needs_llama_server
def test_dflash2_drafts_and_accepts_what_llama_servers_draft_dflash_does(tiny_dflash2):
    """On text, greedy, against llama-server's draft-dflash on the same files: the same text and the
    same drafted and accepted counts, prompt by prompt (the lattice walk picks the same tokens)."""
    from serving import LocalServer
    from serving import http as post

    from pyllama_spec.devtools.servers import running_server
    from pyllama_spec.server import ServerSettings

    def answers(url: str) -> list[tuple[str, int, int]]:
        out = []
        for prompt in ("Describe the picture now", "the quick brown fox", "one two three four five"):
            status, body = post(url, "/completion", {"prompt": prompt, "n_predict": 64, "temperature": 0,
                                                     "cache_prompt": False})
            assert status == 200, body
            out.append((body["content"], body["timings"]["draft_n"], body["timings"]["draft_n_accepted"]))
        return out

    m = tiny_dflash2
    e = TINY_ENGINE
    args = ["-m", str(m.target), "-md", str(m.draft), "--spec-type", "draft-dflash", "--spec-draft-n-max",
            str(DRAFT_MAX), "-c", "2048", "-b", str(e["n_batch"]), "-ub", str(e["n_ubatch"]), "-np", "1",
            "-t", str(N_THREADS), "-fa", "off", "--no-warmup"]
    with running_server([str(LLAMA_SERVER), *args]) as url:
        theirs = answers(url)
    with _engine(m, draft=m.draft, n_ctx=2048) as engine, LocalServer(engine, ServerSettings()) as ours:
        assert engine.drafter.config.is_dflash2
        mine = answers(ours.url)
    assert mine == theirs
    assert sum(d for _, d, _ in mine) > 0 and sum(a for _, _, a in mine) > 0


def test_read_lattice_walks_rows_and_predecessors_as_upstream():
    rng = np.random.default_rng(7)
    for _ in range(50):
        n = int(rng.integers(1, 15))
        lattice = _random_lattice(rng, n)
        assert _lattice_drafter(lattice)._read_lattice(n) == _walk(lattice, n, K)
    # a hand-made walk: row 1 picks candidate 2 (from predecessor 0), row 2 then reads score row 2
    lattice = np.zeros((3, 64), np.float32)
    lattice[1, :K] = [10, 11, 12, 13]
    lattice[1, K:K + K * K] = np.tile([0.0, 0.0, 5.0, 0.0], K)
    lattice[2, :K] = [20, 21, 22, 23]
    m = np.zeros((K, K), np.float32)
    m[0, 1] = 9.0  # what predecessor 0 would choose
    m[2, 3] = 9.0  # what predecessor 2 chooses
    lattice[2, K:K + K * K] = m.reshape(-1)
    assert _lattice_drafter(lattice)._read_lattice(2) == [12, 23]


def test_read_lattice_stops_below_p_min():
    lattice = np.zeros((4, 64), np.float32)
    for i in (1, 2, 3):
        lattice[i, :K] = [30 + i, 40 + i, 50 + i, 60 + i]
    lattice[1, K:K + K * K] = np.tile([8.0, 0.0, 0.0, 0.0], K)  # confident: p ~ 0.999
    lattice[2, K:K + K * K] = 0.0  # flat: p = 1 / K
    lattice[3, K:K + K * K] = np.tile([8.0, 0.0, 0.0, 0.0], K)
    assert _lattice_drafter(lattice, p_min=0.5)._read_lattice(3) == [31]
    assert _lattice_drafter(lattice, p_min=0.0)._read_lattice(3) == [31, 32, 33]  # a flat row: first index
