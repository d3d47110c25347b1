"""EAGLE3 drafting (drafters/eagle3.py) on tiny files: the writer's draft loads in llama-server and
here, bad pairings are refused with the reason, output equals the target's alone (greedy and seeded,
text and after an image, one slot and several, with and without a reduced vocabulary), and on text
the tokens and draft counts equal llama-server's ``--spec-type draft-eagle3`` on the same files."""

from __future__ import annotations

import json
import subprocess
import time
import types
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import BIG_IMAGE_N_TOKENS, LLAMA_SERVER, N_THREADS, TINY_ENGINE, needs_llama_server

import pyllama_spec as ps
from pyllama_spec.devtools import tiny
from pyllama_spec.errors import IncompatibleModelsError

DRAFT_MAX = 4
MAX_TOKENS = 24
D2T_SIZE = 64
IMAGE = np.zeros((672, 672, 3), np.uint8)  # 576 image rows over 24 pinned positions
PROMPTS = [("Describe the picture now", ()), (f"Describe {ps.MEDIA_MARKER} now", (IMAGE,))]
IDS = ["text", "image"]


@pytest.fixture(scope="module")
def drafts(tiny_dense, tmp_path_factory) -> dict[str, Path]:
    """EAGLE3 drafts for tiny_dense's target: with the whole vocabulary and with a reduced one (d2t)."""
    folder = tmp_path_factory.mktemp("eagle3")
    return {"full": tiny.write_eagle3_draft(folder / "eagle3.gguf", tiny_dense.target),
            "d2t": tiny.write_eagle3_draft(folder / "eagle3-d2t.gguf", tiny_dense.target, d2t=D2T_SIZE)}


def _load(models, draft=None, **kw):
    spec = {"draft": draft, "spec_type": "draft-eagle3"} if draft else {"spec_type": "none"}
    return ps.load(models.target, mmproj=models.mmproj, **TINY_ENGINE, draft_max=DRAFT_MAX, **spec, **kw)


@pytest.fixture(scope="module")
def expected(tiny_dense):
    """The target's own answers: greedy, and seeded at temperature 0.8."""
    with _load(tiny_dense) as base:
        return {(i, t): base.generate(p, images=im, max_tokens=MAX_TOKENS, temperature=t, seed=7).tokens
                for i, (p, im) in enumerate(PROMPTS) for t in (0.0, 0.8)}


# ------------------------------------------------------------------ the file and the pairing
def test_the_writer_gives_the_keys_and_tensors_llama_cpp_loads(drafts):
    from pyllama_spec.gguf.check import validate_gguf
    from pyllama_spec.gguf.reader import read_tensor

    full, reduced = validate_gguf(drafts["full"], "draft model"), validate_gguf(drafts["d2t"], "draft model")
    for info in (full, reduced):
        assert info.arch == "eagle3" and list(info.metadata["eagle3.target_layers"]) == list(tiny.EAGLE3_TARGET_LAYERS)
        assert info.metadata["eagle3.target_hidden_size"] == 64 and info.metadata["eagle3.block_count"] == 1
        assert info.tensors["fc.weight"].dims == (3 * 64, 64)
        assert info.tensors["blk.0.attn_q.weight"].dims == (2 * 64, 64)  # reads [token embedding, g]
        assert "token_embd.weight" not in info.tensors  # borrowed from the target
    assert "d2t" not in full.tensors and "output.weight" not in full.tensors
    ids = read_tensor(reduced, "d2t")
    assert ids.dtype == np.int64 and ids.shape == (D2T_SIZE,) and len(set(ids.tolist())) == D2T_SIZE
    assert tiny.ATTRACTOR_TOKEN_ID in ids and reduced.tensors["output.weight"].dims == (64, D2T_SIZE)


def _stub(**kw):
    return types.SimpleNamespace(arch="eagle3", path=Path("draft.gguf"), **kw)


def test_a_draft_naming_other_than_three_layers_is_refused(tiny_dense):
    from pyllama_spec.drafters.eagle3 import check_eagle3_pair

    with pytest.raises(ValueError, match="three layers"):
        tiny.write_eagle3_draft("/nonexistent.gguf", tiny_dense.target, target_layers=(1, 2))
    with pytest.raises(IncompatibleModelsError, match="exactly 3 target layers"):
        check_eagle3_pair(None, _stub(target_layer_ids=[1, 2]), None)


def test_a_draft_reading_layers_the_target_lacks_is_refused(drafts, tmp_path):
    short = tiny.write_target(tmp_path / "two-layers.gguf", n_layer=2)
    with pytest.raises(IncompatibleModelsError, match=r"has 2 layers \(entries \[2, 3\]"):
        ps.load(short, draft=drafts["full"], spec_type="draft-eagle3", n_threads=N_THREADS)


def test_a_draft_for_another_width_is_refused(tmp_path, tiny_dense, drafts):
    wide = tiny.write_target(tmp_path / "wide.gguf", n_embd=128)
    with pytest.raises(IncompatibleModelsError, match="target_hidden_size is 64 but the target's n_embd is 128"):
        ps.load(wide, draft=drafts["full"], spec_type="draft-eagle3", n_threads=N_THREADS)


def test_a_non_eagle3_draft_is_refused(tiny_dense):
    with pytest.raises(IncompatibleModelsError, match=r"is a DFlash draft \('dflash'\), not an EAGLE3 draft: load it "
                                                      r"with spec_type='draft-dflash' \(--spec-type draft-dflash\)"):
        ps.load(tiny_dense.target, draft=tiny_dense.draft, spec_type="draft-eagle3", n_threads=N_THREADS)


@pytest.mark.parametrize("spec_type", ["draft-dflash", "draft-simple"])
def test_an_eagle3_draft_given_to_another_method_names_the_setting_that_reads_it(tiny_dense, drafts, spec_type):
    with pytest.raises(IncompatibleModelsError, match=r"is an EAGLE3 draft \('eagle3'\), not .*: load it with "
                                                      r"spec_type='draft-eagle3' \(--spec-type draft-eagle3\)"):
        ps.load(tiny_dense.target, draft=drafts["full"], spec_type=spec_type, n_threads=N_THREADS)


# ------------------------------------------------------------------ lossless
@pytest.mark.parametrize("vocab", ["full", "d2t"])
@pytest.mark.parametrize("which", [0, 1], ids=IDS)
def test_output_equals_the_target_alone_greedy_and_seeded(tiny_dense, drafts, expected, vocab, which):
    prompt, images = PROMPTS[which]
    with _load(tiny_dense, drafts[vocab]) as eng:
        eng.drafter.trace = []
        for temperature in (0.0, 0.8):
            r = eng.generate(prompt, images=images, max_tokens=MAX_TOKENS, temperature=temperature, seed=7)
            assert r.tokens == expected[(which, temperature)], temperature
            assert r.stats.drafted > 0
        if images:
            # the image's rows reached the draft's cache (llama.cpp's own EAGLE3 skips them)
            assert sum(n for call, _, _, n in eng.drafter.trace if call == "write") > BIG_IMAGE_N_TOKENS


@pytest.mark.parametrize("n_parallel", [1, 3])
def test_a_draft_left_blind_to_the_picture_starts_afresh_after_it(tiny_dense, drafts, expected, n_parallel):
    """``writes_media = False`` (to measure what seeing is worth): the image's rows are left out (its
    slices logged as "skip"), each sequence's draft starts afresh after them, and every answer is still
    the target's own, on one slot and on several at once."""
    jobs = [(i, p, im) for i, (p, im) in enumerate(PROMPTS)] * n_parallel
    # cache_prompt off: every picture is decoded (a job admitted to a slot that already holds its
    # picture would reuse it, and how often depends on when jobs finish)
    with _load(tiny_dense, drafts["full"], n_parallel=n_parallel) as eng:
        eng.drafter.writes_media = False
        eng.drafter.trace = []
        if n_parallel > 1:
            subs = [eng.submit(p, images=im, max_tokens=MAX_TOKENS, cache_prompt=False) for _, p, im in jobs]
            answers = [s.result().tokens for s in subs]
        else:
            answers = [eng.generate(p, images=im, max_tokens=MAX_TOKENS, cache_prompt=False).tokens
                       for _, p, im in jobs]
        assert answers == [expected[(i, 0.0)] for i, _, _ in jobs]
        trace = eng.drafter.trace
    n_pictures = sum(1 for _, _, im in jobs if im)
    assert sum(n for call, _, _, n in trace if call == "skip") == n_pictures * BIG_IMAGE_N_TOKENS
    # every answer's text rows written, and fewer rows in all than the pictures alone hold
    assert sum(n for call, _, _, n in trace if call == "write") < n_pictures * BIG_IMAGE_N_TOKENS
    assert sum(1 for call, *_ in trace if call == "restart") >= n_pictures


def test_several_slots_draft_together_and_each_gets_its_own_answer(tiny_dense, drafts, expected):
    jobs = [(i, p, im) for i, (p, im) in enumerate(PROMPTS)] * 2
    with _load(tiny_dense, drafts["d2t"], n_parallel=3) as eng:
        subs = [eng.submit(p, images=im, max_tokens=MAX_TOKENS) for _, p, im in jobs]
        results = [s.result() for s in subs]
        assert [r.tokens for r in results] == [expected[(i, 0.0)] for i, _, _ in jobs]
        assert sum(n for k, n in eng.scheduler.slots_per_step.items() if k > 1) > 0  # steps shared by slots


def test_a_reduced_vocabulary_drafts_target_ids_with_logits_over_the_target_vocabulary(tiny_dense, drafts):
    from pyllama_spec.gguf.reader import read_gguf, read_tensor

    ids = set(read_tensor(read_gguf(drafts["d2t"]), "d2t").tolist())
    with _load(tiny_dense, drafts["d2t"]) as eng:
        drafter, seen = eng.drafter, []
        draft = drafter.draft

        def spy(requests):
            out = draft(requests)
            seen.extend((p.tokens, np.array(p.logits)) for p in out if p.tokens)
            return out

        drafter.draft = spy
        eng.generate(PROMPTS[0][0], max_tokens=MAX_TOKENS)
        n_vocab = eng.model.n_vocab
    assert seen
    for tokens, logits in seen:
        assert set(tokens) <= ids  # target ids, from the draft's reduced vocabulary only
        assert logits.shape == (len(tokens), n_vocab)
        outside = np.ones(n_vocab, bool)
        outside[list(ids)] = False
        assert np.all(np.isneginf(logits[:, outside])) and np.all(np.isfinite(logits[:, ~outside]))
        assert tokens == np.argmax(logits, axis=1).tolist()


def test_a_draft_that_follows_the_target_is_accepted(tmp_path):
    models = tiny.make_tiny_set(tmp_path, predictable=1.0)
    draft = tiny.write_eagle3_draft(tmp_path / "eagle3.gguf", models.target)
    with _load(models, draft) as eng:
        r = eng.generate("Describe the picture now", max_tokens=MAX_TOKENS)
    assert r.stats.drafted > 0 and r.stats.accepted == r.stats.drafted


# ------------------------------------------------------------------ llama-server on the same files


@needs_llama_server
@pytest.mark.parametrize("predictable", [0.5, 1.0])
def test_text_tokens_and_draft_counts_equal_llama_servers(tmp_path, predictable):
    from serving import free_port

    models = tiny.make_tiny_set(tmp_path, predictable=predictable)
    draft = tiny.write_eagle3_draft(tmp_path / "eagle3.gguf", models.target)
    port = free_port()
    proc = subprocess.Popen([str(LLAMA_SERVER), "-m", str(models.target), "--spec-type", "draft-eagle3", "-md",
                             str(draft), "--spec-draft-n-max", str(DRAFT_MAX), "-c", "1024", "-np", "1",
                             "--no-warmup", "-t", "1", "-fa", "off", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "llama-server did not start"
            try:
                urllib.request.urlopen(url + "/health")
                break
            except OSError:
                time.sleep(0.2)
        body = json.dumps({"prompt": "def add(a, b):", "n_predict": 32, "temperature": 0,
                           "cache_prompt": False}).encode()
        req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
        theirs = json.load(urllib.request.urlopen(req))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    with ps.load(models.target, n_ctx=1024, n_threads=N_THREADS, draft=draft, spec_type="draft-eagle3",
                 draft_max=DRAFT_MAX) as eng:
        ours = eng.generate("def add(a, b):", max_tokens=32)
    assert ours.text == theirs["content"]
    assert (ours.stats.drafted, ours.stats.accepted) == (theirs["timings"]["draft_n"],
                                                         theirs["timings"]["draft_n_accepted"])


# ------------------------------------------------------------------ front ends
def test_ps_load_and_the_chat_command_take_draft_eagle3(tiny_dense, drafts):
    from pyllama_spec.cli import main

    with ps.load(tiny_dense.target, draft=drafts["full"], spec_type="eagle3", n_threads=N_THREADS) as eng:
        assert eng.drafter.name == "eagle3" and eng.generate("hi", max_tokens=8).stats.drafted > 0
    result = CliRunner().invoke(main, ["chat", "-t", "1", "-m", str(tiny_dense.target), "-md", str(drafts["full"]),
                                       "--spec-type", "draft-eagle3", "-n", "8"], input="hi\n/quit\n")
    assert result.exit_code == 0, result.output


def test_the_server_answers_image_chats_through_eagle3_on_two_slots(tiny_dense, drafts):
    """`serve -md eagle3.gguf --spec-type draft-eagle3 -np 2`: two image chats at once, each the
    target's own answer, with drafts proposed."""
    import base64
    import concurrent.futures
    import io

    from PIL import Image

    pytest.importorskip("starlette", reason="the server needs the 'server' extra")
    from serving import LocalServer, http

    from pyllama_spec.server import ServerSettings

    def body(seed):
        buf = io.BytesIO()
        Image.fromarray((np.random.default_rng(seed).random((64, 96, 3)) * 255).astype(np.uint8)).save(buf, "PNG")
        uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                                          {"type": "text", "text": "What is this?"}]}],
                "max_tokens": MAX_TOKENS, "temperature": 0}

    answers = {}
    for name, spec in (("target", {"spec_type": "none"}), ("eagle3", {"draft": drafts["d2t"],
                                                                      "spec_type": "draft-eagle3"})):
        engine = ps.load(tiny_dense.target, mmproj=tiny_dense.mmproj, n_ctx=4096, n_parallel=2, n_threads=N_THREADS,
                         draft_max=DRAFT_MAX, **spec)
        server = LocalServer(engine, ServerSettings(alias="tiny"))
        try:
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                answers[name] = list(pool.map(lambda s: http(server.url, "/v1/chat/completions", body(s)), (1, 2)))
        finally:
            server.stop()
            engine.close()
    for (s1, a), (s2, b) in zip(answers["eagle3"], answers["target"]):
        assert s1 == s2 == 200
        assert a["choices"][0]["message"] == b["choices"][0]["message"]
        assert a["timings"]["draft_n"] > 0
