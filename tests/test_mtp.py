"""draft-mtp: the target's own multi-token-prediction head (drafters/mtp.py) on a tiny qwen35 target
that carries one (``tiny.write_target(mtp=True)``).

What it must do: refuse targets it cannot drive, with the reason; draft exactly as llama-server's
``--spec-type draft-mtp`` does on text (same tokens, same drafted and accepted counts); and stay
lossless with pictures in the prompt and on every slot, each slot accepting what it accepts alone.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import BIG_IMAGE_N_POS, BIG_IMAGE_N_TOKENS, N_THREADS

import pyllama_spec as ps
from pyllama_spec import native_build
from pyllama_spec.cli import main
from pyllama_spec.devtools import tiny

IMAGE_PROMPT = f"Describe this: {ps.MEDIA_MARKER} in a few words."
# ~170 text tokens between the image and the generation: drafting a hundred positions after it
LONG_AFTER = f"Look: {ps.MEDIA_MARKER} " + "and then the story goes on, line after line, " * 8 + "so:"
KW = dict(n_ctx=2048, n_batch=64, n_ubatch=64, n_threads=N_THREADS, flash_attn=False)


@pytest.fixture(scope="module")
def tiny_mtp(tiny_dir) -> tiny.TinyModels:
    """The hybrid qwen35 set (predictable 0.5) whose target carries an MTP block."""
    return tiny.make_tiny_set(tiny_dir, arch="qwen35", seed=0, window=32, predictable=0.5, mtp=True)


@pytest.fixture(scope="module")
def tiny_mtp_moe(tiny_dir) -> tiny.TinyModels:
    """The same around a qwen35moe target (experts in its layers and in its MTP block)."""
    return tiny.make_tiny_set(tiny_dir, arch="qwen35moe", seed=0, window=32, predictable=0.5, mtp=True)


def _load(models, spec_type="draft-mtp", **kw):
    return ps.load(models.target, mmproj=models.mmproj, spec_type=spec_type, **{**KW, **kw})


# --------------------------------------------------------------------------- refusals


def test_a_target_without_an_mtp_head_is_refused_with_the_reason(tiny_hybrid):
    with pytest.raises(ps.IncompatibleModelsError, match="no MTP head"):
        ps.load(tiny_hybrid.target, spec_type="draft-mtp", **KW)


def test_an_architecture_whose_mtp_graph_the_build_lacks_is_refused_with_the_reason(tiny_dense):
    with pytest.raises(ps.IncompatibleModelsError, match="no MTP graph for the target architecture 'hunyuan_vl'"):
        ps.load(tiny_dense.target, spec_type="draft-mtp", **KW)


def test_an_architecture_whose_mtp_mode_is_not_the_single_head_one_is_refused(tiny_dense):
    # e.g. step35's chained heads or gemma4's shared cache, in a build that has their graphs
    from pyllama_spec.bindings.model import Model
    from pyllama_spec.drafters import mtp

    with Model(tiny_dense.target, load_mtp=True) as target, \
            pytest.raises(ps.IncompatibleModelsError, match="single MTP head of qwen35, qwen35moe"):
        mtp.check_pair(target, None, {"mtp_target_archs": ["hunyuan_vl", "qwen35"]})


def test_the_writer_gives_an_mtp_head_that_llama_cpp_loads_to_qwen35_targets_only(tiny_mtp, tiny_mtp_moe, tmp_path):
    from pyllama_spec.bindings.model import Model

    for models in (tiny_mtp, tiny_mtp_moe):
        with Model(models.target, load_mtp=True) as target:
            assert (target.n_layer, target.n_layer_nextn) == (4, 1)  # the block after the 4 layers
    with pytest.raises(ValueError, match="mtp=True needs one of"):
        tiny.write_target(tmp_path / "t.gguf", arch="hunyuan_vl", mtp=True)


def test_the_cli_names_the_reason_a_target_cannot_draft_with_mtp(tiny_hybrid):
    result = CliRunner().invoke(main, ["generate", "-m", str(tiny_hybrid.target), "--spec-type", "draft-mtp",
                                       "-t", "1", "-n", "4", "-p", "hi"])
    assert result.exit_code != 0
    assert "no MTP head" in " ".join(result.output.split()), result.output


def test_serve_refuses_a_target_without_a_head_and_serves_one_with_it(tiny_hybrid, tiny_mtp):
    pytest.importorskip("starlette", reason="the server needs the 'server' extra")
    from serving import LocalServer, http

    from pyllama_spec.server import ServerSettings

    result = CliRunner().invoke(main, ["serve", "-m", str(tiny_hybrid.target), "--spec-type", "draft-mtp",
                                       "--port", "1", "-t", "1"])
    assert result.exit_code == 1 and "no MTP head" in " ".join(result.output.split()), result.output
    body = {"prompt": "The quick brown fox", "n_predict": 24, "temperature": 0, "cache_prompt": False}
    with _load(tiny_mtp, spec_type="none") as plain:
        expected = plain.generate(body["prompt"], max_tokens=24, temperature=0).text
    with _load(tiny_mtp, draft_max=4) as engine:
        server = LocalServer(engine, ServerSettings(alias="mtp"))
        try:
            status, answer = http(server.url, "/completion", body)
        finally:
            server.stop()
    assert status == 200 and answer["content"] == expected
    assert answer["timings"]["draft_n"] > 0 and answer["timings"]["draft_n_accepted"] > 0


def test_the_cli_chats_with_the_mtp_head(tiny_mtp):
    result = CliRunner().invoke(main, ["chat", "-m", str(tiny_mtp.target), "--mmproj", str(tiny_mtp.mmproj),
                                       "--spec-type", "draft-mtp", "-t", "1"], input="/quit\n", terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "draft-mtp" in " ".join(result.output.split()), result.output


# --------------------------------------------------------------------------- the head's cache


def test_the_heads_cache_ends_where_the_targets_does(tiny_mtp):
    with _load(tiny_mtp, draft_max=4) as engine:
        result = engine.generate("The quick brown fox", max_tokens=30, temperature=0)
        assert result.stats.accepted > 0
        head, target = engine.drafter.ctx.memory, engine.ctx.memory
        assert head.pos_max(0) == target.pos_max(0) == engine.positions.pos_next - 1
        assert head.pos_min(0) == 0


def test_media_rows_are_not_written_into_the_head_and_text_after_them_is_paired_at_its_positions(
        tiny_mtp, big_image):
    with _load(tiny_mtp, draft_max=4) as engine:
        engine.drafter.trace = []
        engine.generate(IMAGE_PROMPT, images=[big_image], max_tokens=8, temperature=0)
        trace = engine.drafter.trace
    media = [t for t in trace if t[0] == "media"]
    assert sum(n for *_, n in media) == BIG_IMAGE_N_TOKENS
    image_at = media[0][2]
    after = [t for t in trace if t[0] == "pair" and t[2] > image_at]
    # the text after the image starts at the image's position plus its positions, not its rows
    assert after[0][2] == image_at + BIG_IMAGE_N_POS
    drafts = [t for t in trace if t[0] == "draft"]
    assert drafts[0][2] > image_at + BIG_IMAGE_N_POS and drafts[0][2] < image_at + BIG_IMAGE_N_TOKENS


def test_the_first_text_token_after_an_image_pairs_with_the_hidden_state_of_its_last_row(tiny_mtp, big_image):
    # llama.cpp skips media batches without moving its carried state: the token after an image
    # pairs there with the hidden state of the text before the image
    with _load(tiny_mtp, draft_max=4) as engine:
        drafter = engine.drafter
        last_media_hidden, text_hidden, written = [], {}, []
        process, add = drafter.process, drafter._batch.add_tokens_with_states

        def recording_process(decode):
            for r in decode.rows:
                if r.has_embeddings:
                    last_media_hidden.append((int(r.section0[0]), decode.hidden(r)[-1]))
                else:
                    text_hidden.update(zip(r.section0.tolist(), decode.hidden(r)))
            process(decode)

        def recording_add(tokens, positions, states, **kw):
            written.extend(zip(np.asarray(positions).tolist(), np.array(states)))
            add(tokens, positions, states, **kw)

        drafter.process, drafter._batch.add_tokens_with_states = recording_process, recording_add
        engine.generate(IMAGE_PROMPT, images=[big_image], max_tokens=4, temperature=0)
    image_at, h_last = last_media_hidden[-1]
    first_after = {pos: state for pos, state in written}[image_at + BIG_IMAGE_N_POS]
    np.testing.assert_array_equal(first_after, h_last)
    # (what llama.cpp would pair it with: the last text row before the image)
    assert not np.allclose(first_after, text_hidden[image_at - 1])


class _Hidden:
    """A stand-in for the target's context in a TargetDecode: its hidden rows are given."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows

    def draft_embeddings(self, n: int) -> np.ndarray:
        return self.rows[:n]


def test_the_pairing_rule_carries_across_batches_and_moves_back_with_forget(tiny_mtp):
    from pyllama_spec.drafters import TargetDecode, TargetRows

    with _load(tiny_mtp, draft_max=4) as engine:
        drafter = engine.drafter
        written = {}
        add = drafter._batch.add_tokens_with_states

        def recording_add(tokens, positions, states, **kw):
            written.update(zip(np.asarray(positions).tolist(), np.array(states)))
            add(tokens, positions, states, **kw)

        drafter._batch.add_tokens_with_states = recording_add
        rng = np.random.default_rng(0)

        def feed(p0: int, n: int) -> np.ndarray:
            h = rng.standard_normal((n, drafter.ctx.model.n_embd)).astype(np.float32)
            rows = TargetRows(np.arange(p0, p0 + n, dtype=np.int32)[None], False, p0,
                              tokens=np.full(n, 97, dtype=np.int32))
            drafter.process(TargetDecode([rows], _Hidden(h)))
            return h

        drafter.forget(0, 0, 0)
        first = feed(0, 5)
        np.testing.assert_array_equal(written[0], 0.0)  # nothing before position 0
        np.testing.assert_array_equal(written[1], first[0])  # (x_p, h_{p-1})
        second = feed(5, 3)
        np.testing.assert_array_equal(written[5], first[4])  # carried across batches
        drafter.forget(0, 7, 7)  # a verify step kept up to position 6
        feed(7, 2)
        np.testing.assert_array_equal(written[7], second[1])
        written.clear()
        drafter.forget(0, 0, 0)  # a reset, then rows the head never saw before position 20 (a restored cache)
        later = feed(20, 3)
        assert 20 not in written  # its h_19 is unknown: left out rather than mispaired
        np.testing.assert_array_equal(written[21], later[0])


def test_every_draft_starts_at_the_sequence_next_position(tiny_mtp, big_image):
    with _load(tiny_mtp, draft_max=4) as engine:
        seen = []
        original = engine.drafter.draft

        def draft(requests):
            seen.extend((r.pos, engine.positions.pos_next) for r in requests)
            return original(requests)

        engine.drafter.draft = draft
        engine.generate(IMAGE_PROMPT, images=[big_image], max_tokens=16, temperature=0)
    assert seen and all(pos == pos_next for pos, pos_next in seen)


# --------------------------------------------------------------------------- lossless


@pytest.mark.parametrize("prompt,with_image", [("The quick brown fox jumps over", False),
                                               (IMAGE_PROMPT, True), (LONG_AFTER, True)])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_output_equals_target_only_text_and_after_an_image(tiny_mtp, tiny_mtp_moe, big_image, arch, prompt,
                                                           with_image, temperature):
    tiny_mtp = tiny_mtp if arch == "qwen35" else tiny_mtp_moe
    images = [big_image] if with_image else []
    args = dict(images=images, max_tokens=32, temperature=temperature, seed=3)
    with _load(tiny_mtp, spec_type="none") as plain:
        expected = plain.generate(prompt, **args)
    with _load(tiny_mtp, draft_max=4) as spec:
        got = spec.generate(prompt, **args)
    assert got.tokens == expected.tokens
    assert got.stats.drafted > 0 and got.stats.accepted > 0
    if with_image:
        assert got.stats.prompt_tokens > got.stats.prompt_positions  # an M-RoPE image: rows != positions


def test_four_slots_are_lossless_and_each_accepts_what_it_accepts_alone(tiny_mtp, big_image):
    prompts = ["The quick brown fox", IMAGE_PROMPT, "def add(a, b):", LONG_AFTER]
    images = [[], [big_image], [], [big_image]]
    alone = []
    with _load(tiny_mtp, draft_max=4) as engine:
        for p, im in zip(prompts, images):
            alone.append(engine.generate(p, images=im, max_tokens=24, temperature=0))
    with _load(tiny_mtp, spec_type="none") as plain:
        expected = [plain.generate(p, images=im, max_tokens=24, temperature=0).tokens
                    for p, im in zip(prompts, images)]
    with _load(tiny_mtp, draft_max=4, n_parallel=4, n_ctx=4096) as engine:  # 1024 rows a slot
        subs = [engine.submit(p, images=im, max_tokens=24, temperature=0) for p, im in zip(prompts, images)]
        together = [s.result() for s in subs]
    for a, t, e in zip(alone, together, expected):
        assert a.tokens == t.tokens == e
        assert (t.stats.drafted, t.stats.accepted) == (a.stats.drafted, a.stats.accepted)
        assert t.stats.accepted > 0


# --------------------------------------------------------------------------- llama-server


LLAMA_SERVER = native_build.find_llama_server()


def _llama_server_completion(target: Path, body: dict, draft_max: int) -> dict:
    """One /completion on a fresh llama-server with --spec-type draft-mtp (a fresh one per prompt:
    its head carries the last hidden state of the previous request into the next prompt's first row)."""
    from serving import free_port

    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-mtp-", suffix=".log", delete=False)
    proc = subprocess.Popen([str(LLAMA_SERVER), "-m", str(target), "-c", "2048", "-np", "1", "--no-warmup",
                             "-t", str(N_THREADS), "-b", "64", "-ub", "64", "--spec-type", "draft-mtp",
                             "--spec-draft-n-max", str(draft_max), "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, Path(log.name).read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                assert time.monotonic() < deadline, "llama-server did not start"
                time.sleep(0.2)
        req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.skipif(LLAMA_SERVER is None, reason="llama-server is not built here (python build.py --tools builds it)")
@pytest.mark.parametrize("arch,prompt,draft_max", [("qwen35", "def add(a, b):", 4),
                                                   ("qwen35", "The quick brown fox jumps over", 3),
                                                   ("qwen35moe", "def add(a, b):", 4)])
def test_text_drafts_and_tokens_equal_llama_servers(tiny_mtp, tiny_mtp_moe, arch, prompt, draft_max):
    tiny_mtp = tiny_mtp if arch == "qwen35" else tiny_mtp_moe
    n = 40
    theirs = _llama_server_completion(tiny_mtp.target, {"prompt": prompt, "n_predict": n, "temperature": 0,
                                                        "cache_prompt": False, "return_tokens": True}, draft_max)
    with _load(tiny_mtp, draft_max=draft_max) as engine:
        ours = engine.generate(prompt, max_tokens=n, temperature=0)
    assert ours.tokens == theirs["tokens"]
    assert ours.stats.drafted == theirs["timings"]["draft_n"]
    assert ours.stats.accepted == theirs["timings"]["draft_n_accepted"]
    assert ours.stats.accepted > 0
