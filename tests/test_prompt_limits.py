"""A prompt that cannot fit the context is refused before it costs more than a small multiple
of its own size: by its bytes over the longest token, or by counting the tokens of its first
pieces; never by tokenizing megabytes of text first (llama.cpp's tokenizer takes ~90 bytes of
memory per byte of text, inside one native call)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from conftest import load_tiny

import pyllama_spec as ps
from pyllama_spec.bindings.model import Model
from pyllama_spec.serving.prompt_parts import _pieces_at_line_starts

PACKAGE = Path(__file__).resolve().parents[1] / "pyllama_spec"
SOURCE = "".join((PACKAGE / f).read_text() for f in ("serving/engine.py", "speculative/generation.py"))  # Python code


@pytest.fixture(scope="module")
def engine():
    em = ps.embedded_models()
    with load_tiny(em, n_ctx=512) as e:
        yield e


def test_a_huge_prompt_is_refused_at_once_and_the_engine_goes_on(engine):
    start = time.perf_counter()
    with pytest.raises(ps.ContextOverflowError, match="at least .* cache rows"):
        engine.generate("y" * (60 * 2**20), max_tokens=4)
    assert time.perf_counter() - start < 2  # 30 s and 5 GB of memory when it was tokenized first
    assert engine.generate("def fibonacci(n):\n    if n", max_tokens=4).tokens


def test_a_huge_chat_message_and_a_huge_prompt_with_an_image_are_refused_too(engine):
    with pytest.raises(ps.ContextOverflowError):
        engine.generate(messages=[{"role": "user", "content": "x = 1\n" * 2_000_000}], max_tokens=4)
    with pytest.raises(ps.ContextOverflowError):
        engine.generate(f"{ps.MEDIA_MARKER}" + "z" * 2**24, images=[np.zeros((64, 64, 3), np.uint8)],
                        max_tokens=4)


def test_a_long_prompt_of_short_tokens_is_refused_by_counting_its_first_pieces(engine):
    # 8x the context in bytes but under the longest-token bound: counted piece by piece
    text = "x = 1\n" * (engine.ctx.n_ctx * 12 // 6)
    assert engine.model.tokens_at_least(len(text)) < engine.ctx.n_ctx
    with pytest.raises(ps.ContextOverflowError, match="counted over the first"):
        engine.generate(text, max_tokens=4)


def test_a_prompt_just_under_the_context_is_not_refused(engine):
    for n_lines in range(1, 400):  # the longest prompt of whole lines that fits
        if len(engine.model.tokenize("x\n" * (n_lines + 1), add_special=True)) + 1 > engine.ctx.n_ctx:
            break
    assert engine.generate("x\n" * n_lines, max_tokens=1).stats.prompt_tokens + 1 <= engine.ctx.n_ctx


def test_pieces_cut_where_a_line_starts_and_join_back_to_the_text():
    pieces = list(_pieces_at_line_starts([SOURCE], 4096))
    assert "".join(pieces) == SOURCE and len(pieces) > 10
    assert all(len(p) <= 4096 and p[-1] == "\n" for p in pieces[:-1])
    # text without line starts is cut at the size, and segments are never joined
    pieces = list(_pieces_at_line_starts(["no newline " * 1000, "next"], 4096))
    assert [len(p) for p in pieces] == [4096, 4096, 11000 - 8192, 4]


VOCABS = ["ggml-vocab-qwen2.gguf", "ggml-vocab-llama-bpe.gguf", "ggml-vocab-llama-spm.gguf",
          "ggml-vocab-gpt-2.gguf", "ggml-vocab-deepseek-coder.gguf"]


def _vocab(name: str) -> Path:
    from pyllama_spec.bindings.native_info import build_record

    src = build_record().get("source", {}).get("path")
    path = Path(src or "/nonexistent") / "models" / name
    if not path.exists():
        pytest.skip(f"{name} is in the pinned llama.cpp source tree, which this build does not have")
    return path


@pytest.mark.parametrize("name", VOCABS)
def test_counting_by_pieces_never_exceeds_the_whole_count_by_more_than_the_slack(name):
    """The piece count refuses a prompt only when it passes n_ctx by the slack per piece: on real
    vocabularies, over source code, a piece count is the whole count (BPE pre-tokenizers split at
    a line start) or within a few tokens of it (SentencePiece)."""
    from pyllama_spec.serving.prompt_parts import _COUNT_SLACK_PER_PIECE

    model = Model(_vocab(name), vocab_only=True)
    try:
        text = SOURCE * 4
        whole = len(model.tokenize(text))
        pieces = list(_pieces_at_line_starts([text], 8192))
        counted = sum(len(model.tokenize(p)) for p in pieces)
        assert counted <= whole + _COUNT_SLACK_PER_PIECE * len(pieces)
        assert model.tokens_at_least(len(text.encode())) <= whole
    finally:
        model.close()
