"""Multi-turn chat: cached-prefix reuse, the generate command, and the interactive chat on a real terminal."""

from __future__ import annotations

import io
import json
import os
import sys
import time

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import load_tiny, sigint_default

from pyllama_spec.cli import main
from pyllama_spec.serving.conversation import Conversation


def _engine(models, **kw):
    return load_tiny(models, n_ctx=4096, draft_max=7, **kw)


def _reply(conv, text):
    return "".join(p.text for p in conv.send(text))


def test_second_turn_reuses_the_cached_prefix_and_still_drafts(tiny_dense, big_image_png):
    with _engine(tiny_dense) as engine:
        conv = Conversation(engine, max_tokens=24)
        conv.attach(big_image_png)
        _reply(conv, "What is in this picture?")
        first = conv.last_stats
        assert engine.projector.n_encode_calls == 1 and first.prompt_reused == 0
        second_text = _reply(conv, "And the colours?")
        second = conv.last_stats
        # The image was not encoded again and the earlier turn's rows were not decoded again.
        assert engine.projector.n_encode_calls == 1
        # (Everything up to the first reply is reused; the tiny model's reply, re-tokenized from
        # its text, may differ from the generated tokens, and is decoded again from there.)
        assert second.prompt_reused >= first.prompt_tokens > 576
        assert second.prompt_tokens - second.prompt_reused < second.prompt_tokens - first.prompt_tokens + 1
        # The draft stayed aligned: it still drafts, and accepts, on the second turn.
        assert second.drafted > 0 and second.accepted > 0
        messages = list(conv.messages)
    # Lossless with reuse: a fresh engine given the whole conversation answers the same.
    with _engine(tiny_dense) as fresh:
        expected = fresh.generate(messages=messages[:-1], max_tokens=24)
    assert second_text == expected.text


def test_reuse_on_the_hybrid_target_stays_lossless(tiny_hybrid):
    with _engine(tiny_hybrid) as engine:
        conv = Conversation(engine, max_tokens=16)
        _reply(conv, "Hello there")
        second = _reply(conv, "Tell me more")
        messages = list(conv.messages)
    with _engine(tiny_hybrid) as fresh:
        assert fresh.generate(messages=messages[:-1], max_tokens=16).text == second


def test_reset_clears_the_conversation_and_the_caches(tiny_dense):
    with _engine(tiny_dense) as engine:
        conv = Conversation(engine, system="Be brief.", max_tokens=8)
        _reply(conv, "Hi")
        conv.reset()
        assert conv.messages == [{"role": "system", "content": "Be brief."}]
        assert engine.ctx.memory.pos_max() == -1
        _reply(conv, "Hi")
        assert conv.last_stats.prompt_reused == 0


def test_a_bad_image_path_fails_at_attach_and_the_conversation_goes_on(tiny_dense, tmp_path):
    from pyllama_spec.errors import ImageError

    (tmp_path / "notes.png").write_text("not an image")
    with _engine(tiny_dense) as engine:
        conv = Conversation(engine, max_tokens=4)
        with pytest.raises(ImageError, match="not found"):
            conv.attach(tmp_path / "missing.png")
        with pytest.raises(ImageError, match="cannot read"):
            conv.send(f"look @{tmp_path / 'notes.png'}").__next__()
        assert _reply(conv, "still here?")


def test_inline_image_reference_attaches_it(tiny_dense, big_image_png):
    with _engine(tiny_dense) as engine:
        conv = Conversation(engine, max_tokens=4)
        _reply(conv, f"what is @{big_image_png} showing")
        assert engine.projector.n_encode_calls == 1
        content = conv.messages[0]["content"]
        assert content[0] == {"type": "image", "image": str(big_image_png)}
        assert "@" not in content[1]["text"]


def test_save_writes_a_json_transcript_with_images_by_path(tiny_dense, big_image_png, tmp_path):
    with _engine(tiny_dense) as engine:
        conv = Conversation(engine, max_tokens=4)
        conv.attach(big_image_png)
        _reply(conv, "describe")
        data = json.loads(conv.save(tmp_path / "t.json").read_text())
    assert data["messages"][0]["content"][0]["image"] == str(big_image_png)
    assert data["messages"][1]["role"] == "assistant" and data["session"]["turns"] == 1


# --------------------------------------------------------------------------- generate (CliRunner)


def _model_args(models):
    return ["-m", str(models.target), "--mmproj", str(models.mmproj), "-md", str(models.draft), "-t", "1",
            "-b", "64", "-ub", "64", "--draft-max", "7"]


def test_generate_json_prints_text_and_stats(tiny_dense, big_image_png):
    result = CliRunner().invoke(main, ["generate", *_model_args(tiny_dense), "-p", "Describe",
                                       "--image", str(big_image_png), "-n", "12", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert len(data["tokens"]) == 12 and data["finish_reason"] == "length"
    assert data["stats"]["prompt_tokens"] > data["stats"]["prompt_positions"]  # the image's rows
    assert data["stats"]["drafted"] > 0


@pytest.mark.parametrize("extra,needle", [
    (["--image", "/nonexistent/x.png"], "image not found"),
    (["-c", "256", "--image", "BIG"], "cache rows"),
])
def test_generate_errors_exit_non_zero_with_a_message(tiny_dense, big_image_png, extra, needle):
    extra = [str(big_image_png) if e == "BIG" else e for e in extra]
    result = CliRunner().invoke(main, ["generate", *_model_args(tiny_dense), "-p", "x", *extra])
    assert result.exit_code == 1
    assert needle in result.output  # CliRunner mixes stderr into output


def test_generate_with_a_missing_model_says_which_file(tmp_path):
    result = CliRunner().invoke(main, ["generate", "-m", str(tmp_path / "none.gguf"), "-p", "x"])
    assert result.exit_code == 1 and "none.gguf" in result.output


def test_chat_commands_through_cli_runner(tiny_dense, big_image_png, tmp_path):
    lines = [f"/image {big_image_png}", "describe it", "/stats", f"/save {tmp_path / 'c.json'}", "/reset",
             "/image /nope.png", "/bogus", "/help", "/quit"]
    result = CliRunner().invoke(main, ["chat", *_model_args(tiny_dense), "-n", "8"], input="\n".join(lines) + "\n")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "attached" in out and "tok/s" in out and "turns 1" in out
    assert "conversation and caches cleared" in out and "image not found" in out and "unknown command" in out
    assert json.loads((tmp_path / "c.json").read_text())["session"]["turns"] == 1


def test_a_turn_that_fails_leaves_the_conversation_as_it_was(tiny_dense, big_image_png, tmp_path):
    """An over-long image turn fails; the next, short, turn answers as in a fresh chat: neither the
    failed message nor its image is carried into it (it used to go with every later message)."""
    from pyllama_spec.errors import ContextOverflowError

    with load_tiny(tiny_dense, n_ctx=256, draft_max=7) as engine:
        conv = Conversation(engine, max_tokens=8)
        conv.attach(big_image_png)
        with pytest.raises(ContextOverflowError, match="n_ctx is 256"):
            _reply(conv, "look")  # the picture alone is over 256 rows
        assert conv.messages == [] and conv.pending_images == [] and conv.dropped_images == [str(big_image_png)]
        assert _reply(conv, "def f(x):")
        assert [m["role"] for m in conv.messages] == ["user", "assistant"]
    # the same through the command: an over-long turn, then a short one that answers
    lines = [f"look @{big_image_png}", "def f(x):", f"/save {tmp_path / 'c.json'}", "/quit"]
    result = CliRunner().invoke(main, ["chat", *_model_args(tiny_dense), "-c", "256", "-n", "8"],
                                input="\n".join(lines) + "\n")
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())  # as read, whatever the terminal's width wrapped
    assert out.count("n_ctx is 256") == 1, out  # the second turn does not fail
    assert f"the message was not kept, nor its image {big_image_png}: attach it again with /image" in out, out
    saved = json.loads((tmp_path / "c.json").read_text())
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]
    assert saved["messages"][0]["content"] == "def f(x):"
    with load_tiny(tiny_dense, n_ctx=256, draft_max=7) as engine:  # the answer a fresh chat gives
        fresh = Conversation(engine, max_tokens=8)
        assert saved["messages"][1]["content"] == _reply(fresh, "def f(x):")


# --------------------------------------------------------------------------- chat on a real terminal


ANSI = r"(?:\x1b\[[0-9;]*m)*"  # rich makes numbers bold even with NO_COLOR


def _expected_reply_start(models, image, message, n_chars=12):
    """What the chat will stream first for this message: the same Conversation, in-process."""
    with load_tiny(models, n_ctx=8192, draft_max=7) as engine:
        conv = Conversation(engine, max_tokens=40)
        conv.attach(image)
        text = "".join(p.text for p in conv.send(message))
    assert len(text.strip()) >= n_chars
    return text[:n_chars]


def test_interactive_chat_in_a_pseudo_terminal(tiny_dense, big_image_png, tmp_path):
    pexpect = pytest.importorskip("pexpect", reason="pexpect (the test extra) drives the pseudo-terminal")
    from PIL import Image

    huge = tmp_path / "huge.png"  # 2304 image rows: an encode of about 2 s on one thread
    Image.fromarray((np.random.default_rng(0).random((1344, 1344, 3)) * 255).astype(np.uint8)).save(huge)
    message = "describe the picture at length"
    reply_start = _expected_reply_start(tiny_dense, big_image_png, message)
    env = dict(os.environ, NO_COLOR="1", COLUMNS="200")
    args = [*_model_args(tiny_dense), "-n", "100000", "-c", "131072"]
    child = pexpect.spawn(sys.executable, ["-m", "pyllama_spec", "chat", *args], env=env, encoding="utf-8",
                          timeout=60, dimensions=(50, 200), preexec_fn=sigint_default)  # Ctrl-C below
    child.logfile_read = screen = io.StringIO()
    try:
        child.expect("> ")
        child.sendline(f"/image {big_image_png}")
        child.expect("attached")
        child.expect("> ")
        child.sendline("/image /no/such/file.png")
        child.expect("image not found")
        child.expect("> ")
        # A very long reply, interrupted with Ctrl-C once it is really streaming.
        child.sendline(message)
        child.expect_exact(message)  # the terminal's echo of what was typed
        child.expect_exact(reply_start)  # the model's own words: the reply is streaming
        time.sleep(0.3)
        child.sendintr()
        child.expect("reply interrupted")
        child.expect("> ")
        child.sendline("/stats")
        child.expect(rf"turns {ANSI}1{ANSI} · generated {ANSI}(\d+){ANSI} tokens")
        assert int(child.match.group(1)) > 0  # the interrupted reply counts
        child.expect("> ")
        # Ctrl-C while a large image is still being encoded: the reply never starts.
        child.sendline(f"/image {huge}")
        child.expect("attached")
        child.expect("> ")
        child.sendline("and this one?")
        child.expect_exact("and this one?")
        time.sleep(0.5)
        child.sendintr()
        child.expect("interrupted before the reply began", timeout=15)
        child.expect("the message was not kept, nor its image")  # the next message goes without it
        child.expect("> ")
        child.sendline("/stats")
        child.expect(rf"turns {ANSI}1{ANSI} ")  # nothing was said, so no turn was added
        child.expect("> ")
        child.sendline("/reset")
        child.expect("conversation and caches cleared")
        child.expect("> ")
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    assert "Exception ignored" not in screen.getvalue()  # no interrupt was swallowed by a callback


def test_generate_with_draft_max_auto_and_a_bad_draft_max(tiny_dense):
    args = [a for a in _model_args(tiny_dense) if a not in ("--draft-max", "7")]
    result = CliRunner().invoke(main, ["generate", *args, "--draft-max", "auto", "-p", "x", "-n", "12", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["stats"]["drafted"] > 0
    for bad in ("fast", "-2"):
        result = CliRunner().invoke(main, ["generate", *args, "--draft-max", bad, "-p", "x"])
        assert result.exit_code == 2 and "--draft-max" in result.output, result.output


def test_generate_with_a_draft_tree_gives_the_target_only_text(tmp_path):
    """`generate --draft-tree N` on the embedded pair at --temp 0.8: the text of --draft-max 0, more
    drafts accepted than the chain's; a tree it cannot verify ends with a message."""
    def run(*extra):
        result = CliRunner().invoke(main, ["generate", "-t", "1", "-b", "64", "-ub", "64", "-p", "def add(a, b):\n",
                                           "-n", "40", "--temp", "0.8", "--seed", "3", "--json", *extra])
        assert result.exit_code == 0, result.output
        return json.loads(result.output[result.output.index("{"):])  # after the embedded-pair line

    plain, chain = run("--draft-max", "0"), run("--draft-max", "15")
    tree = run("--draft-max", "15", "--draft-tree", "24")
    assert tree["text"] == plain["text"] == chain["text"]
    assert tree["stats"]["accepted"] > chain["stats"]["accepted"]
    bad = CliRunner().invoke(main, ["generate", "-t", "1", "-p", "x", "--draft-tree", "8", "--verify", "rejection"])
    assert bad.exit_code == 1 and "draft_tree" in bad.output, bad.output


def test_an_image_chat_on_the_embedded_default_answers_with_code(tmp_path):
    """Issue 44: on the embedded pair, a chat with a picture answered with blanks only (greedy, the tiny
    pair repeats a space after a picture); without -m the commands give it DRY, and it writes Python,
    through chat and generate, with the same text as target-only."""
    import re

    from pyllama_spec.embedded import draw_demo_image

    card = tmp_path / "card.png"
    draw_demo_image(448).save(card)
    def reply(*extra: str) -> str:
        result = CliRunner().invoke(main, ["chat", "-t", "1", "-n", "32", *extra],
                                    input=f"@{card} def draw(picture):\n/quit\n", terminal_width=200)
        assert result.exit_code == 0, result.output
        return result.output.split("/help for commands\n> ", 1)[1].split(" tok/s")[0]  # the answer, its footer

    assert re.search(r"[A-Za-z_]{4,}", reply()), reply()  # identifiers, not blanks
    assert not re.search(r"[A-Za-z_]{4,}", reply("--dry-multiplier", "0").rsplit("\n", 1)[0])  # blanks without
    outs = []
    for spec in ("draft-dflash", "none"):
        r = CliRunner().invoke(main, ["generate", "-t", "1", "--spec-type", spec, "--image", str(card), "-p",
                                      "class Stack:", "-n", "32", "--json"])
        assert r.exit_code == 0, r.output
        outs.append(json.loads(r.output[r.output.index("{"):])["text"])
    assert outs[0] == outs[1] and re.search(r"[A-Za-z_]{4,}", outs[0]), outs
