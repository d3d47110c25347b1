"""llama-server's token and template routes (server/tokens.py): /tokenize, /detokenize,
/apply-template and the chat token count /v1/chat/completions/input_tokens.

* Real vocabularies: the pinned llama.cpp source's models/ggml-vocab-*.gguf, loaded
  vocabulary-only (no weights: no Engine can hold them), through the routes' own functions, give
  the tokens of their .inp/.out test vectors and llama-server's round trips.
* Real chat templates: for each of models/templates/*.jinja, /apply-template's prompt is the text
  a chat generation renders (test_chat_tools.py compares them with llama-server's).
* Over HTTP on the tiny target: the same bodies and statuses as the pinned llama-server on the same
  files (the differences named in BAD_REQUESTS), bad requests answered 400, huge requests in time
  linear in their size while the server goes on answering.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import LLAMA_SERVER, N_THREADS, NO_LLAMA_SERVER

import pyllama_spec as ps
from pyllama_spec.bindings.model import Model

pytest.importorskip("starlette", reason="the server needs the 'server' extra")
from pyllama_spec.server import ServerSettings, tokens  # noqa: E402
from pyllama_spec.server.errors import APIError  # noqa: E402
from pyllama_spec.server.images import ImageLimits  # noqa: E402
from pyllama_spec.server.schema import RequestLimits, parse_chat  # noqa: E402

from serving import LocalServer  # noqa: E402
from test_llama_server_parity import _Process, post  # noqa: E402


def _source_models() -> Path:
    """The pinned llama.cpp source's models/ folder (as tests/test_prompt_limits.py finds it)."""
    from pyllama_spec.bindings.native_info import build_record

    src = build_record().get("source", {}).get("path")
    return Path(src or "/nonexistent") / "models"


MODELS = _source_models()
NO_SOURCE = "the pinned llama.cpp source tree (its models/ folder) is not on this machine"


# --- real vocabularies


#: Every vocabulary of the pinned source that comes with test vectors, and its tokenizer's family.
VOCABS = {"qwen2": "bpe", "qwen35": "bpe", "llama-bpe": "bpe", "gpt-2": "bpe", "deepseek-coder": "bpe",
          "deepseek-llm": "bpe", "command-r": "bpe", "falcon": "bpe", "mpt": "bpe", "refact": "bpe",
          "starcoder": "bpe", "gemma-4": "bpe", "llama-spm": "spm", "phi-3": "spm", "bert-bge": "wpm"}


def _vocab(name: str) -> Model:
    path = MODELS / f"ggml-vocab-{name}.gguf"
    if not path.exists():
        pytest.skip(NO_SOURCE)
    return Model(path, vocab_only=True)


def _vectors(name: str) -> list[tuple[str, list[int]]]:
    """The .inp/.out pairs, split as llama.cpp's tests/test-tokenizer-0.cpp splits them (bytes as
    they are: no newline translation)."""
    sep = "\n__ggml_vocab_test__\n"
    raw = (MODELS / f"ggml-vocab-{name}.gguf.inp").read_bytes().decode("utf-8")
    texts = raw.split(sep)
    if raw.endswith(sep):
        texts.pop()
    outs = (MODELS / f"ggml-vocab-{name}.gguf.out").read_bytes().decode().split("\n")[:len(texts)]
    return [(t, [int(x) for x in o.split()]) for t, o in zip(texts, outs, strict=True)]


def _body(response) -> dict:
    return json.loads(response.body)


def _piece_bytes(piece) -> bytes:
    return piece.encode() if isinstance(piece, str) else bytes(piece)


@pytest.mark.parametrize("name", sorted(VOCABS))
def test_tokenize_gives_each_vocabularys_test_vectors(name):
    """llama.cpp's own vectors (tokenized with add_special and parse_special off, as its
    test-tokenizer-0 does), through /tokenize's function; with pieces, the pieces are the text."""
    model = _vocab(name)
    try:
        vectors = _vectors(name)
        assert len(vectors) >= 40
        for text, expected in vectors:
            body = {"content": text, "add_special": False, "parse_special": False}
            assert _body(tokens.tokenize_response(model, body))["tokens"] == expected, text
            pieces = _body(tokens.tokenize_response(model, {**body, "with_pieces": True}))["tokens"]
            assert [p["id"] for p in pieces] == expected
            assert b"".join(_piece_bytes(p["piece"]) for p in pieces) == tokens.detokenize(model, expected).encode()
    finally:
        model.close()


@pytest.mark.parametrize("name", sorted(VOCABS))
def test_detokenize_round_trips_as_llama_servers_does(name):
    """/detokenize joins the pieces: the text back for byte-level BPE; for SentencePiece the text
    behind the space prefix the tokenizer added (llama-server does not strip it); WordPiece
    normalises (lower case, spaces), so only its vectors are checked."""
    model = _vocab(name)
    try:
        for text, expected in _vectors(name):
            back = _body(tokens.detokenize_response(model, {"tokens": expected}))["content"]
            if VOCABS[name] == "bpe":
                assert back == text
                assert tokens.tokenize_content(model, back, parse_special=False).tolist() == expected
            elif VOCABS[name] == "spm":
                assert back == (" " + text if text else "")
    finally:
        model.close()


def test_a_piece_that_is_not_utf8_is_its_list_of_bytes():
    """SentencePiece's byte fallback: a character the vocabulary lacks is one token per byte, each
    piece a list of byte values (llama-server's README example); whole characters are strings."""
    model = _vocab("llama-spm")
    try:
        pieces = _body(tokens.tokenize_response(model, {"content": "🦙 á", "with_pieces": True}))["tokens"]
        assert [p["piece"] for p in pieces] == [" ", [0xF0], [0x9F], [0xA6], [0x99], " á"]
        assert tokens.detokenize(model, [p["id"] for p in pieces[1:3]]) == "\ufffd"  # half a character
    finally:
        model.close()


def test_add_special_and_parse_special_on_a_real_vocabulary():
    model = _vocab("llama-bpe")
    try:
        def tok(**body):
            return _body(tokens.tokenize_response(model, body))["tokens"]

        hi = tok(content="Hi")
        assert tok(content="Hi", add_special=True) == [model.bos, *hi]  # BOS: the vocabulary adds it
        assert tok(content="<|begin_of_text|>Hi") == [model.bos, *hi]  # parse_special is on by default
        assert len(tok(content="<|begin_of_text|>Hi", parse_special=False)) > 3  # the marker's text
        # llama-server's mixed content: ids kept in place, BOS only for a string that comes first
        assert tok(content=["Hi", 7, "Hi"], add_special=True) == [model.bos, *hi, 7, *hi]
        assert tok(content=[7, "Hi"], add_special=True) == [7, *hi]
    finally:
        model.close()


# --- real chat templates

TEMPLATES = MODELS / "templates"
CONVERSATION = {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"},
                             {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is 2+2?"}]}
LIMITS = RequestLimits(max_tokens=64, default_max_tokens=16, draft_max=0, images=ImageLimits())

TEMPLATE_NAMES = sorted(p.name for p in TEMPLATES.glob("*.jinja")) or ["(no templates)"]


def test_every_vocabulary_and_template_of_the_pinned_source_is_covered():
    if not MODELS.exists():
        pytest.skip(NO_SOURCE)
    assert {p.name for p in MODELS.glob("ggml-vocab-*.gguf.inp")} == {f"ggml-vocab-{n}.gguf.inp" for n in VOCABS}
    assert len(TEMPLATE_NAMES) >= 60


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_apply_template_gives_what_the_chat_route_renders_with_each_real_template(name, tiny_dense):
    """An engine loaded with the template (llama-server's --chat-template-file): /apply-template's
    prompt is the text its chat generations render (Engine.prompts.text_and_images, which a chat request's
    generation calls), by the template itself."""
    if not TEMPLATES.exists():
        pytest.skip(NO_SOURCE)
    text = (TEMPLATES / name).read_text()
    with ps.load(tiny_dense.target, n_ctx=256, n_threads=N_THREADS, chat_template=text) as engine:
        prompt, images = tokens.chat_prompt(engine, CONVERSATION, LIMITS)
        params = parse_chat(CONVERSATION, LIMITS).params
        fed, _, chat = engine.prompts.text_and_images(engine.resolve(params).prompt)
    assert prompt == fed and images == [] and chat.renderer == "jinja"
    # every message's text (not always in order: Mistral-Nemo puts the system text last)
    assert all(m["content"] in prompt for m in CONVERSATION["messages"]), prompt


# --- HTTP: this server, and llama-server on the same files


@pytest.fixture(scope="module")
def ours(tiny_server):
    """The session's shared server (conftest's ``tiny_server``): these tests only read from it."""
    return tiny_server.url


@pytest.fixture(scope="module")
def theirs(tiny_dense):
    if LLAMA_SERVER is None:
        pytest.skip(NO_LLAMA_SERVER)
    proc = _Process(["-m", str(tiny_dense.target), "--mmproj", str(tiny_dense.mmproj), "-c", "2048", "-np", "1",
                     "--no-warmup", "-t", "2"])
    yield proc.url
    proc.stop()


def _png(side: int = 64) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.random.default_rng(0).random((side, side, 3)) * 255).astype(np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _with_image(text: str) -> list:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": _png()}},
                                         {"type": "text", "text": "what is it?"}]}]


HELLO = "hello world á <|mask|> \u00e2\u0082"
SAME_ANSWERS = [
    ("/tokenize", {"content": HELLO}),
    ("/tokenize", {"content": HELLO, "with_pieces": True}),  # pieces of half a character: byte lists
    ("/tokenize", {"content": HELLO, "add_special": True, "parse_special": False}),
    ("/tokenize", {"content": ["hello", 5, "world", 99999, -3], "add_special": True}),
    ("/tokenize", {"content": [5, "hello"], "add_special": True}),
    ("/tokenize", {"content": ""}),
    ("/tokenize", {"content": "a", "add_special": None}),  # null: the default
    ("/tokenize", {}),  # no content: no tokens
    ("/detokenize", {"tokens": [257, 108, 108, 111, 268, 226, 130, 226, 130, 172, 195]}),
    ("/detokenize", {"tokens": []}),
    ("/detokenize", {}),
    ("/apply-template", CONVERSATION),
    ("/apply-template", {**CONVERSATION, "add_generation_prompt": False}),
    ("/apply-template", {"messages": [{"role": "developer", "content": "x"}, {"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "chat_template_kwargs": {"x": 1}}),
    ("/apply-template", {"messages": _with_image("look:")}),  # the media marker where the image goes
    # (tools in play on this template, which cannot render them, take the generic format here: llama-server
    # drops them; tests/test_generic_tools.py)
    ("/apply-template", {**CONVERSATION, "tools": [{"type": "function", "function": {"name": "f"}}],
                         "tool_choice": "none"}),
    ("/apply-template", {**CONVERSATION, "reasoning_effort": "low"}),
    ("/v1/chat/completions/input_tokens", CONVERSATION),
    ("/chat/completions/input_tokens", {"messages": _with_image("look:"), "max_tokens": 3}),  # images counted
]


def _marker(url: str) -> str:
    with urllib.request.urlopen(url + "/props") as r:
        return json.loads(r.read())["media_marker"]


@pytest.mark.parametrize("path,body", SAME_ANSWERS, ids=lambda v: v if isinstance(v, str) else json.dumps(v)[:60])
def test_same_answers_as_llama_server(ours, theirs, path, body):
    (s1, a), (s2, b) = post(ours, path, body), post(theirs, path, body)
    assert s1 == s2 == 200, (a, b)
    if path == "/apply-template":  # llama-server draws a new media marker each time it starts
        b = {"prompt": b["prompt"].replace(_marker(theirs), _marker(ours))}
    assert a == b


#: (path, body, this server's status, llama-server's): where llama-server answers a client's error
#: with a 500 (its JSON library's exception, a vector's range check), or reads past a value of
#: the wrong type (a default for a flag that is not a boolean; 1.5 or true read as the id 1),
#: this server answers 400.
BAD_REQUESTS = [
    ("/tokenize", {"content": None}, 400, 500),
    ("/tokenize", {"content": 5}, 400, 500),
    ("/tokenize", {"content": ["a", [1]]}, 400, 500),
    ("/tokenize", {"content": ["a", None]}, 400, 500),
    ("/tokenize", {"content": ["a", 99999], "with_pieces": True}, 400, 500),
    ("/tokenize", {"content": ["a", -1], "with_pieces": True}, 400, 500),
    ("/tokenize", {"content": ["a", 1.5]}, 400, 200),
    ("/tokenize", {"content": ["a", 2**32 + 1]}, 400, 200),
    ("/tokenize", {"content": "a", "add_special": "yes"}, 400, 200),
    ("/tokenize", {"content": "a", "with_pieces": 1}, 400, 200),
    ("/tokenize", [1, 2], 400, 200),
    ("/detokenize", {"tokens": "abc"}, 400, 500),
    ("/detokenize", {"tokens": 5}, 400, 500),
    ("/detokenize", {"tokens": None}, 400, 500),
    ("/detokenize", {"tokens": ["1"]}, 400, 500),
    ("/detokenize", {"tokens": [99999]}, 400, 500),
    ("/detokenize", {"tokens": [-1]}, 400, 500),
    ("/detokenize", {"tokens": [1.5]}, 400, 200),
    ("/detokenize", {"tokens": [True]}, 400, 200),
    ("/apply-template", {}, 400, 400),
    ("/apply-template", {"messages": "hi"}, 400, 400),
    ("/apply-template", {"messages": [{"role": "user"}]}, 400, 400),
    ("/apply-template", {"messages": [{"role": "user", "content": 5}]}, 400, 400),
    ("/apply-template", {"messages": [{"role": "user", "content": [{"type": "foo"}]}]}, 400, 400),
    ("/apply-template", {**CONVERSATION, "continue_final_message": True}, 400, 400),
    ("/apply-template", {"messages": [{"content": "x"}]}, 400, 500),
    ("/apply-template", {**CONVERSATION, "add_generation_prompt": "no"}, 400, 200),
    ("/apply-template", {"messages": [{"role": "user", "content": "\ud800"}]}, 400, 500),
    ("/v1/chat/completions/input_tokens", {}, 400, 400),
    ("/chat/completions/input_tokens", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400, 500),
]
_BAD_IDS = [json.dumps([p, b])[:70] for p, b, _, _ in BAD_REQUESTS]


@pytest.mark.parametrize("path,body,status,_", BAD_REQUESTS, ids=_BAD_IDS)
def test_bad_requests_are_answered_400_with_an_error_body(ours, path, body, status, _):
    s, a = post(ours, path, body)
    assert s == status, a
    assert a["error"]["message"] and a["error"]["type"] == "invalid_request_error", a


@pytest.mark.parametrize("path,body,_,status", BAD_REQUESTS, ids=_BAD_IDS)
def test_bad_requests_beside_llama_servers_status(theirs, path, body, _, status):
    """llama-server's statuses as BAD_REQUESTS records them: if one changes, the table (and the
    differences it documents) must be looked at again."""
    s, b = post(theirs, path, body)
    assert s == status, b


def _greedy(ours: str, path: str, body: dict) -> dict:
    s, a = post(ours, path, {**body, "temperature": 0, "cache_prompt": False})
    assert s == 200, a
    return a


def test_apply_template_prompt_is_what_the_chat_route_feeds_the_model(ours):
    """The prompt /apply-template shows, sent to /completion, gives the chat route's greedy answer;
    input_tokens counts the chat route's prompt tokens, with an image and without."""
    prompt = post(ours, "/apply-template", CONVERSATION)[1]["prompt"]
    chat = _greedy(ours, "/v1/chat/completions", {**CONVERSATION, "max_tokens": 12})
    completion = _greedy(ours, "/completion", {"prompt": prompt, "n_predict": 12})
    assert completion["content"] == chat["choices"][0]["message"]["content"]
    assert completion["tokens_evaluated"] == chat["usage"]["prompt_tokens"]
    for messages in (CONVERSATION["messages"], _with_image("look:")):
        counted = post(ours, "/v1/chat/completions/input_tokens", {"messages": messages})[1]
        chat = _greedy(ours, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
        assert counted == {"input_tokens": chat["usage"]["prompt_tokens"], "object": "response.input_tokens"}


def test_tokenize_and_detokenize_round_trip_over_http(ours):
    text = "def add(a, b):\n    return a + b  # ünïcödé 🦙"
    ids = post(ours, "/tokenize", {"content": text})[1]["tokens"]
    assert post(ours, "/detokenize", {"tokens": ids})[1] == {"content": text}


def test_image_parts_without_a_projector_are_a_400(tiny_dense):
    """llama-server: a 500 ("image input is not supported"); the client's error here."""
    engine = ps.load(tiny_dense.target, n_ctx=256, n_threads=N_THREADS)
    server = LocalServer(engine, ServerSettings(alias="tiny"))
    try:
        for path in ("/apply-template", "/v1/chat/completions/input_tokens"):
            s, a = post(server.url, path, {"messages": _with_image("look:")})
            assert s == 400 and "image" in a["error"]["message"], a
    finally:
        server.stop()
        engine.close()


def _health_while(ours: str, path: str, body: bytes) -> tuple[int, object, float, float]:
    """(status, answer, seconds) of a request, and the slowest /health answer while it ran."""
    def send():
        t0 = time.monotonic()
        s, a = post(ours, path, None, raw=body)
        return s, a, time.monotonic() - t0

    slowest = 0.0
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        job = pool.submit(send)
        while not job.done():
            t0 = time.monotonic()
            assert post(ours, "/health", None)[0] == 200
            slowest = max(slowest, time.monotonic() - t0)
            time.sleep(0.05)
        s, a, took = job.result()
    return s, a, took, slowest


def test_a_huge_token_list_is_detokenized_in_linear_time_while_the_server_goes_on(ours):
    n = 2_000_000
    ids = [257, 108, 108, 111, 32] * (n // 5)
    s, a, took, slowest = _health_while(ours, "/detokenize", json.dumps({"tokens": ids}).encode())
    assert s == 200 and a["content"] == "hello " * (n // 5)
    assert took < 30 and slowest < 2, (took, slowest)  # most of it is json.loads, which holds the GIL
    # one bad id at the very end: refused, as quickly
    s, a, took, _ = _health_while(ours, "/detokenize", json.dumps({"tokens": ids + [10**6]}).encode())
    assert s == 400 and "1000000" in a["error"]["message"] and took < 30


def test_a_huge_text_is_tokenized_on_a_thread_while_the_server_goes_on(ours):
    text = "def add(a, b):\n    return a + b\n" * 100_000  # 3.3 MB
    s, a, took, slowest = _health_while(ours, "/tokenize", json.dumps({"content": text}).encode())
    assert s == 200 and len(a["tokens"]) >= len(text) // 8
    # the tokenizer runs on a thread, without the GIL: /health is answered all along
    assert took < 60 and slowest < max(0.25, took / 3), (took, slowest)
    s, a = post(ours, "/detokenize", {"tokens": a["tokens"]})
    assert s == 200 and a["content"] == text


def test_large_requests_at_once_each_get_their_own_answer(ours):
    texts = [f"line {k}: " + "x = y + z\n" * 60_000 for k in range(3)]  # 600 kB each: the large path

    def ask(text):
        s, a = post(ours, "/tokenize", {"content": text, "with_pieces": True})
        return s, "".join(p["piece"] for p in a["tokens"])

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        assert list(pool.map(ask, texts)) == [(200, t) for t in texts]


def test_chat_prompt_refuses_what_the_chat_route_refuses(tiny_dense):
    """The chat route's own parser reads /apply-template's body: the same 400s, before rendering."""
    with ps.load(tiny_dense.target, n_ctx=256, n_threads=N_THREADS) as engine:
        for body in ({"messages": []}, {**CONVERSATION, "chat_template_kwargs": {"messages": 1}},
                     {**CONVERSATION, "max_tokens": -1}):
            with pytest.raises(APIError) as e:
                parse_chat(body, LIMITS)
            with pytest.raises(APIError) as mine:
                tokens.chat_prompt(engine, body, LIMITS)
            assert e.value.status == 400
            assert (mine.value.status, mine.value.message) == (e.value.status, e.value.message)
