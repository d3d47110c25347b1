"""DSpark (``draft-dspark``, drafters/dspark.py): a DFlash draft with a Markov head, drafted
anchor-first. A tiny DSpark draft (``tiny.write_draft(dspark=True)``) for the tiny target:
lossless on text and after a picture, on two slots asking different lengths at once; picked from
the file when no type is named, as llama.cpp picks it; and the same drafts as llama-server's
draft-dspark on the same files (with its confidence head cutting drafts under ``p_min`` too)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import LLAMA_SERVER, N_THREADS, needs_llama_server

import pyllama_spec as ps
from pyllama_spec.devtools import tiny
from pyllama_spec.devtools.servers import running_server
from pyllama_spec.errors import IncompatibleModelsError

PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
PICTURE_PROMPT = f"Describe this: {ps.MEDIA_MARKER} in a few words."


@pytest.fixture(scope="module")
def dspark(tiny_dir, tiny_dense) -> Path:
    """A DSpark draft for tiny_dense's target (its DFlash draft's geometry, plus the Markov and
    confidence heads)."""
    return tiny.write_draft(tiny_dir / "tiny-dspark.gguf", dspark=True, block_size=16)


def _load(tiny_dense, draft, **kw):
    kw = {"n_ctx": 2048, **kw}
    return ps.load(tiny_dense.target, mmproj=tiny_dense.mmproj, draft=draft, n_threads=N_THREADS, flash_attn=False,
                   **kw)


@pytest.mark.parametrize("kind", ["text", "picture"])
def test_dspark_is_lossless_and_drafts_up_to_the_whole_block(tiny_dense, dspark, big_image, kind):
    prompt, images = (PROMPT, []) if kind == "text" else (PICTURE_PROMPT, [big_image])
    with _load(tiny_dense, None, spec_type="none") as plain:
        expected = plain.generate(prompt, images=images, max_tokens=48, temperature=0).tokens
    with _load(tiny_dense, dspark) as engine:  # the type is read from the file
        assert engine.config.spec_type == "draft-dspark" and engine.drafter.n_max_limit == 16
        for draft_max in (5, 16):  # anchor-first: a draft as long as the block
            got = engine.generate(prompt, images=images, max_tokens=48, temperature=0, draft_max=draft_max)
            assert got.tokens == expected and got.stats.drafted > 0


def test_two_slots_asking_different_lengths_are_drafted_losslessly(tiny_dense, dspark):
    with _load(tiny_dense, None, spec_type="none") as plain:
        expected = plain.generate(PROMPT, max_tokens=48, temperature=0).tokens
    with _load(tiny_dense, dspark, n_parallel=2, n_ctx=4096) as engine:
        # the Markov head needs equal blocks in a decode: one draft decode per length
        handles = [engine.submit(PROMPT, max_tokens=48, temperature=0, draft_max=n) for n in (3, 9)]
        assert [h.result().tokens for h in handles] == [expected, expected]


def test_each_file_goes_to_its_own_type(tiny_dense, dspark):
    with pytest.raises(IncompatibleModelsError, match="is a DSpark draft .* spec_type='draft-dspark'"):
        _load(tiny_dense, dspark, spec_type="draft-dflash")
    with pytest.raises(IncompatibleModelsError, match="without DSpark's Markov head .* spec_type='draft-dflash'"):
        _load(tiny_dense, tiny_dense.draft, spec_type="draft-dspark")
    with _load(tiny_dense, tiny_dense.draft) as engine:
        assert engine.config.spec_type == "draft-dflash"


# --------------------------------------------------------------------------- llama-server's drafts

def _completion(args: list[str], command: list[str]) -> tuple[str, int, int]:
    from serving import http as post

    with running_server([*command, *args]) as url:
        status, body = post(url, "/completion", {"prompt": PROMPT, "n_predict": 64, "temperature": 0})
    assert status == 200, body
    return body["content"], body["timings"]["draft_n"], body["timings"]["draft_n_accepted"]


@needs_llama_server
@pytest.mark.parametrize("settings", [["--spec-draft-n-max", "5"], ["--spec-draft-n-max", "16"],
                                      ["--spec-draft-n-max", "8", "--spec-draft-p-min", "0.5"]])
def test_the_same_drafts_as_llama_servers_draft_dspark(tiny_dense, dspark, settings):
    args = ["-m", str(tiny_dense.target), "-md", str(dspark), "--spec-type", "draft-dspark", "-c", "1024", "-np", "1",
            "-t", "2", "-fa", "off", *settings]
    theirs = _completion([*args, "--no-warmup"], [str(LLAMA_SERVER)])
    ours = _completion(args, [sys.executable, "-m", "pyllama_spec", "serve"])
    assert ours == theirs and ours[1] > 0  # the text, and the drafts' total length and acceptance
