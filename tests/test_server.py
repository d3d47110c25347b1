"""`pyllama-spec serve`'s app on loopback: the real openai client, plain HTTP, bad requests,
API keys, a full queue, clients that go away, and a bounded load test.

Every server here listens on 127.0.0.1 on a free port and is stopped by its fixture.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import io
import json
import socket
import re
import time

import numpy as np
import pytest
from conftest import TINY_ENGINE, load_tiny

import pyllama_spec as ps

httpx = pytest.importorskip("httpx", reason="the test extra brings httpx")
openai = pytest.importorskip("openai", reason="the test extra brings the openai client")
uvicorn = pytest.importorskip("uvicorn", reason="the server extra brings uvicorn")
from serving import LocalServer as Server  # noqa: E402

from pyllama_spec.server import ServerSettings  # noqa: E402


def _engine(models):
    return load_tiny(models, n_ctx=4096, draft_max=7, flash_attn=False)


def _png(seed: int, side: int = 224) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.random.default_rng(seed).random((side, side, 3)) * 255).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture(scope="module")
def served(tiny_dense):
    engine = _engine(tiny_dense)
    server = Server(engine, ServerSettings(alias="tiny", max_queue=64, max_image_pixels=1024 * 1024))
    yield server
    server.stop()
    engine.close()


@pytest.fixture(scope="module")
def reference(tiny_dense):
    """Answers from a separate engine on the same files, as Engine.generate gives them."""
    engine = _engine(tiny_dense)
    cache = {}

    def answer(text: str, png: bytes | None, max_tokens: int):
        key = (text, png, max_tokens)
        if key not in cache:
            content = text if png is None else [{"type": "image", "image": png}, {"type": "text", "text": text}]
            engine.reset_cache()
            cache[key] = engine.generate(messages=[{"role": "user", "content": content}], max_tokens=max_tokens)
        return cache[key]

    yield answer
    engine.close()


def _messages(text: str, png: bytes | None):
    if png is None:
        return [{"role": "user", "content": text}]
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_uri(png)}},
                                         {"type": "text", "text": text}]}]


# --------------------------------------------------------------------------- the openai client


def test_openai_client_chat_with_an_image_equals_engine_generate(served, reference):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused")
    png = _png(1)
    r = client.chat.completions.create(model="tiny", messages=_messages("What is in this picture?", png),
                                       max_tokens=24, temperature=0)
    expected = reference("What is in this picture?", png, 24)
    assert r.choices[0].message.content == expected.text
    assert r.choices[0].finish_reason == expected.finish_reason
    assert r.usage.completion_tokens == len(expected.tokens)
    assert r.usage.prompt_tokens == expected.stats.prompt_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    t = r.model_extra["timings"]
    assert t["predicted_n"] == r.usage.completion_tokens
    assert 0 <= t["draft_n_accepted"] <= t["draft_n"] and t["draft_n"] > 0
    assert t["prompt_n"] + t["cache_n"] == r.usage.prompt_tokens
    assert t["mean_accepted_length"] >= 1.0 and all(isinstance(v, (int, float)) for v in t.values())
    assert len(r.model_extra["per_position_acceptance"]) > 0  # beside timings: it holds numbers only


def test_openai_client_streamed_chat_equals_the_plain_answer(served, reference):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused")
    png = _png(2)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=_messages("Describe it", png), max_tokens=24, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    expected = reference("Describe it", png, 24)
    assert text == expected.text
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == expected.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.tokens)


def test_the_raw_stream_ends_with_done(served):
    with httpx.stream("POST", served.url + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert all(json.loads(ln[6:])["object"] == "chat.completion.chunk" for ln in lines[:-1])


def _stream(served, path: str, body: dict) -> list[dict]:
    """The JSON events of a streamed answer (without the closing [DONE])."""
    with httpx.stream("POST", served.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]


def _check_steps(steps: list[dict], n_max: int) -> None:
    """Each step: accepted draft tokens first, then the target's own; as many as it says it accepted."""
    for s in steps:
        flags = [t["draft"] for t in s["tokens"]]
        assert flags == [True] * s["accepted"] + [False] * (len(flags) - s["accepted"]), s
        assert 0 <= s["accepted"] <= s["drafted"] <= n_max
        assert len(s["tokens"]) <= s["accepted"] + 1  # a step adds at most one token of the target's own


def test_streamed_chat_chunks_report_each_tokens_text_and_origin(served, reference):
    png = _png(4)
    expected = reference("Describe it", png, 40)
    chunks = _stream(served, "/v1/chat/completions", {"messages": _messages("Describe it", png), "max_tokens": 40})
    with_text = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert with_text and all("pyllama_spec" in c for c in with_text)
    for c in with_text:  # the tokens' texts make up the chunk's content
        assert "".join(t["text"] for t in c["pyllama_spec"]["tokens"]) == c["choices"][0]["delta"]["content"]
    steps = [c["pyllama_spec"] for c in chunks if "pyllama_spec" in c]
    assert [t["id"] for s in steps for t in s["tokens"]] == expected.tokens
    _check_steps(steps, n_max=7)
    assert steps[0] == {"tokens": steps[0]["tokens"], "drafted": 0, "accepted": 0}  # the prompt's own token
    timings = next(c["timings"] for c in chunks if "timings" in c)
    assert 0 < sum(s["accepted"] for s in steps) <= timings["draft_n_accepted"]
    assert sum(s["drafted"] for s in steps) == timings["draft_n"]  # every step is reported
    # the usage chunk and the role chunk carry no extension: they are no step
    assert "pyllama_spec" not in chunks[0] and chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}


def test_the_extension_reports_no_draft_tokens_when_drafting_is_off(served):
    chunks = _stream(served, "/v1/chat/completions",
                     {"messages": OK_MESSAGES, "max_tokens": 16, "speculative.n_max": 0})
    steps = [c["pyllama_spec"] for c in chunks if "pyllama_spec" in c]
    assert sum(len(s["tokens"]) for s in steps) == 16
    assert all(s["drafted"] == 0 and s["accepted"] == 0 and len(s["tokens"]) == 1 for s in steps)
    assert not any(t["draft"] for s in steps for t in s["tokens"])


def test_the_openai_client_ignores_the_extension_and_keeps_it_in_model_extra(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused")
    chunks = list(client.chat.completions.create(model="tiny", messages=OK_MESSAGES, max_tokens=12, stream=True))
    steps = [c.model_extra["pyllama_spec"] for c in chunks if "pyllama_spec" in (c.model_extra or {})]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(t["text"] for s in steps for t in s["tokens"]) and text


def test_streamed_completions_carry_the_extension_too(served):
    plain = httpx.post(served.url + "/completion", json={"prompt": "def main(", "n_predict": 20, "return_tokens": True},
                       timeout=60).json()
    llama = _stream(served, "/completion", {"prompt": "def main(", "n_predict": 20})
    # each step's chunk, then (as llama-server) the final body, with no text of its own
    llama, final = llama[:-1], llama[-1]
    assert all("pyllama_spec" in e and e["stop"] is False for e in llama)
    assert final["stop"] is True and final["content"] == "" and "pyllama_spec" not in final
    assert [t["id"] for e in llama for t in e["pyllama_spec"]["tokens"]] == plain["tokens"]
    assert "".join(t["text"] for e in llama for t in e["pyllama_spec"]["tokens"]) == plain["content"]
    _check_steps([e["pyllama_spec"] for e in llama], n_max=7)
    openai_style = _stream(served, "/v1/completions", {"prompt": "def main(", "max_tokens": 20})
    steps = [c["pyllama_spec"] for c in openai_style if "pyllama_spec" in c]
    assert "".join(t["text"] for s in steps for t in s["tokens"]) == plain["content"]


def test_the_chat_page_and_its_files_are_served_from_the_package_with_a_strict_policy(served):
    page = httpx.get(served.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "connect-src 'self'" in policy
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert {"/static/app.js", "/static/style.css", "/static/icon.svg"} <= set(assets)
    for path in assets:
        r = httpx.get(served.url + path)
        assert r.status_code == 200, path
        assert r.headers["content-security-policy"] == policy
        # nothing is fetched from anywhere else (the SVG namespace is a name, never fetched)
        assert not re.findall(r"https?://(?!www\.w3\.org/2000/svg)", r.text), path
    missing = httpx.get(served.url + "/static/nothing.js")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_the_package_data_ships_every_file_of_the_page():
    tomllib = pytest.importorskip("tomllib", reason="tomllib (to read pyproject.toml) is in Python >= 3.11")
    from fnmatch import fnmatch

    from conftest import REPO_ROOT

    data = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    static = REPO_ROOT / "pyllama_spec" / "server" / "static"
    files = [p.relative_to(static.parent).as_posix() for p in static.rglob("*") if p.is_file()]
    assert files and all(any(fnmatch(f, pat) for pat in data["pyllama_spec.server"]) for f in files), files


def test_completions_routes(served):
    r = httpx.post(served.url + "/v1/completions", json={"prompt": "def main(", "max_tokens": 6}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 6
    llama = httpx.post(served.url + "/completion", json={"prompt": "def main(", "n_predict": 6}, timeout=60).json()
    assert llama["content"] == body["choices"][0]["text"] and llama["tokens_predicted"] == 6
    assert "draft_n" in llama["timings"]


def test_llama_servers_unprefixed_paths_answer_as_the_v1_ones(served):
    """llama-server serves /chat/completions beside /v1/chat/completions, /completions as its own
    /completion, and /v1/health beside /health."""
    chat = {"messages": [{"role": "user", "content": "def main("}], "max_tokens": 6}
    a = httpx.post(served.url + "/v1/chat/completions", json=chat, timeout=60).json()
    b = httpx.post(served.url + "/chat/completions", json=chat, timeout=60).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"] and b["object"] == "chat.completion"
    legacy = httpx.post(served.url + "/completion", json={"prompt": "def main(", "n_predict": 6}, timeout=60).json()
    plural = httpx.post(served.url + "/completions", json={"prompt": "def main(", "n_predict": 6}, timeout=60).json()
    assert plural["content"] == legacy["content"] and plural["tokens_predicted"] == 6
    assert httpx.get(served.url + "/v1/health").json() == {"status": "ok"}


def test_ignore_eos_per_request_generates_up_to_max_tokens(served):
    """A request's ignore_eos (llama-server's field) forbids end-of-generation tokens for it only."""
    body = {"prompt": "def main(", "n_predict": 48, "logit_bias": [[served.engine.model.eos, 100]]}
    stopped = httpx.post(served.url + "/completion", json=body, timeout=60).json()
    assert stopped["stop_type"] == "eos" and stopped["tokens_predicted"] < 48
    forced = httpx.post(served.url + "/completion", json={**body, "ignore_eos": True}, timeout=60).json()
    assert forced["stop_type"] == "limit" and forced["tokens_predicted"] == 48
    bad = httpx.post(served.url + "/completion", json={**body, "ignore_eos": "yes"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "ignore_eos"


def test_per_request_speculative_settings(served):
    base = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 24}
    off = httpx.post(served.url + "/v1/chat/completions", json={**base, "speculative.n_max": 0}, timeout=60).json()
    on = httpx.post(served.url + "/v1/chat/completions", json={**base, "speculative.n_max": 15}, timeout=60).json()
    assert off["timings"]["draft_n"] == 0 and on["timings"]["draft_n"] > 0
    assert off["choices"][0]["message"]["content"] == on["choices"][0]["message"]["content"]
    bad = httpx.post(served.url + "/v1/chat/completions", json={**base, "speculative.n_max": 99}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative.n_max"


def test_info_routes(served):
    models = httpx.get(served.url + "/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and "multimodal" in models["data"][0]["capabilities"]
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    props = httpx.get(served.url + "/props").json()
    assert props["modalities"]["vision"] and props["default_generation_settings"]["speculative"]["n_max"] == 7
    metrics = httpx.get(served.url + "/metrics").text
    assert "pyllama_spec_generated_tokens_total" in metrics and "pyllama_spec_queue_depth 0" in metrics


# --------------------------------------------------------------------------- bad requests


def _post(served, body, *, raw: bytes | None = None, path="/v1/chat/completions", headers=None):
    if raw is not None:
        return httpx.post(served.url + path, content=raw, headers=headers or {"content-type": "application/json"},
                          timeout=60)
    return httpx.post(served.url + path, json=body, headers=headers, timeout=60)


OK_MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("body,status,param,code", [
    (b"{not json", 400, None, None),
    ([1, 2], 400, None, None),
    ({"messages": "hi"}, 400, "messages", None),
    ({"messages": []}, 400, "messages", None),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages", None),
    ({"messages": OK_MESSAGES, "max_tokens": -1}, 400, "max_tokens", None),
    ({"messages": OK_MESSAGES, "max_tokens": 10**9}, 400, "max_tokens", None),
    ({"messages": OK_MESSAGES, "max_tokens": "8"}, 400, "max_tokens", None),
    ({"messages": OK_MESSAGES, "temperature": "hot"}, 400, "temperature", None),
    ({"messages": OK_MESSAGES, "temperature": 1000}, 400, "temperature", None),  # llama-server takes up to 100 here
    ({"messages": OK_MESSAGES, "n": 2}, 400, "n", None),
    ({"messages": OK_MESSAGES, "stop": [1]}, 400, "stop", None),
    ({"messages": OK_MESSAGES, "stream": "yes"}, 400, "stream", None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                                                     "!!notbase64"}}]}]},
     400, "messages[0].content[0]", "invalid_image"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url",
                                                 "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}]},
     400, "messages[0].content[0]", "invalid_image"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "/etc/passwd"}}]}]},
     400, "messages[0].content[0]", "invalid_image"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]},
     400, "messages[0].content[0]", "invalid_image"),
    ({"messages": [{"role": "user", "content": [{"type": "audio", "x": 1}]}]}, 400, "messages[0].content", None),
    ({"messages": [{"role": "user", "content": "word " * 5000}]}, 400, "messages", "context_length_exceeded"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(served, body, status, param, code):
    r = _post(served, None if isinstance(body, bytes) else body, raw=body if isinstance(body, bytes) else None)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    # (a prompt over the context: llama-server's error type, which its clients read, with OpenAI's code)
    kind = "exceed_context_size_error" if code == "context_length_exceeded" else "invalid_request_error"
    assert err["message"] and err["type"] == kind and "Traceback" not in r.text
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    assert _post(served, {"messages": OK_MESSAGES, "max_tokens": 2}).status_code == 200


def test_an_oversized_image_is_refused(served):
    r = _post(served, {"messages": _messages("x", _png(3, side=1100))})  # 1.21 M pixels > the 1 M limit
    assert r.status_code == 400 and "pixels" in r.json()["error"]["message"]


def test_unknown_routes_and_methods(served):
    assert httpx.get(served.url + "/v2/nothing").status_code == 404
    r = httpx.get(served.url + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_a_body_over_the_limit_is_refused_with_413(tiny_dense):
    engine = _engine(tiny_dense)
    server = Server(engine, ServerSettings(max_body_bytes=1000))
    try:
        r = _post(server, {"messages": [{"role": "user", "content": "x" * 2000}]})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    finally:
        server.stop()
        engine.close()


# --------------------------------------------------------------------------- API key, queue, disconnects


def test_api_key_guards_every_route_but_health(tiny_dense):
    engine = _engine(tiny_dense)
    server = Server(engine, ServerSettings(api_key="s3cret"))
    try:
        assert httpx.get(server.url + "/health").status_code == 200
        # the page holds no data: it loads without the key, and asks for it
        assert httpx.get(server.url + "/").status_code == 200
        assert httpx.get(server.url + "/static/app.js").status_code == 200
        for path in ("/v1/models", "/props", "/metrics"):
            r = httpx.get(server.url + path)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret")
        assert client.chat.completions.create(model="x", messages=OK_MESSAGES, max_tokens=2).choices
    finally:
        server.stop()
        engine.close()


@contextlib.contextmanager
def _sent_raw(url: str, path: str, body: dict):
    """A POST of ``body`` on a socket of its own, left (closed) on the way out. For a streamed request
    that waits in the queue: its answer, headers included, starts when it runs (as llama-server's,
    so that an error before the stream is answered with its status), so no HTTP client returns."""
    data = json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        yield sock


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 5000}]}),
    ("/v1/completions", {"prompt": "word " * 5000}),
    ("/completion", {"prompt": "word " * 5000}),
], ids=["chat", "completions", "completion"])
def test_a_stream_whose_prompt_does_not_fit_is_a_400_before_it_starts(served, path, body):
    """As llama-server answers an error that comes before its stream: with its status and fields."""
    r = httpx.post(served.url + path, json={**body, "stream": True, "max_tokens": 4}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "exceed_context_size_error" and err["n_ctx"] == 4096 and err["n_prompt_tokens"] > 4096


def test_a_queued_stream_gets_its_headers_while_it_waits(tiny_dense, monkeypatch):
    """A stream waits for its first token at most OPENING_WAIT seconds before its answer starts: one
    that waits in the queue longer gets its 200 (and the pings that keep a proxy from timing out).
    The wait is made short here (the server runs in this process), far shorter than the generation
    ahead of it."""
    from pyllama_spec.server import generation

    monkeypatch.setattr(generation, "OPENING_WAIT", 0.05)
    engine = _engine(tiny_dense)
    server = Server(engine, ServerSettings(max_queue=2))
    long = {"messages": OK_MESSAGES, "max_tokens": 3000, "stream": True}
    try:
        with httpx.Client(timeout=60) as c1, httpx.Client(timeout=60) as c2:
            with c1.stream("POST", server.url + "/v1/chat/completions", json=long):  # generating now
                t0 = time.monotonic()
                with c2.stream("POST", server.url + "/v1/chat/completions", json=long) as queued:
                    assert time.monotonic() - t0 >= 0.05 * 0.9  # held for its first token that long
                    assert queued.status_code == 200
                    assert "pyllama_spec_queue_depth 1" in httpx.get(server.url + "/metrics").text  # still queued
    finally:
        server.stop()
        engine.close()


def test_a_full_queue_answers_503_with_retry_after_and_a_disconnected_stream_frees_the_engine(tiny_dense):
    engine = _engine(tiny_dense)
    server = Server(engine, ServerSettings(max_queue=1))
    long = {"messages": OK_MESSAGES, "max_tokens": 3000, "stream": True}
    try:
        with httpx.Client(timeout=60) as c1:
            with c1.stream("POST", server.url + "/v1/chat/completions", json=long) as first:
                it = first.iter_lines()
                next(ln for ln in it if '"content"' in ln and "assistant" not in ln)  # generating now
                with _sent_raw(server.url, "/v1/chat/completions", long):  # waits in the queue
                    deadline = time.monotonic() + 10
                    while httpx.get(server.url + "/metrics").text.count("pyllama_spec_queue_depth 1") == 0:
                        assert time.monotonic() < deadline
                        time.sleep(0.05)
                    full = httpx.post(server.url + "/v1/chat/completions", json={**long, "stream": False})
                    assert full.status_code == 503 and full.headers["retry-after"] == "1"
                    assert full.json()["error"]["code"] == "queue_full"
                # both clients leave here: their generations must stop within a step
        t0 = time.monotonic()
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": OK_MESSAGES, "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200
        assert time.monotonic() - t0 < 10  # not behind 2 x 3000 tokens of abandoned work
        metrics = httpx.get(server.url + "/metrics").text
        generated = float(re.search(r"^pyllama_spec_generated_tokens_total (\S+)$", metrics, re.M).group(1))
        assert 0 < generated < 3000  # the abandoned streams (counted too) did not run to their max_tokens
    finally:
        server.stop()
        engine.close()


# --------------------------------------------------------------------------- load


def test_load_32_clients_4_requests_each(served, reference):
    """32 concurrent clients x 4 requests: half with images, some streamed, some leaving early.

    Every completed answer equals its sequential greedy answer; none is lost; the server is
    healthy afterwards. The figures are printed (pytest -s) for bench/RESULTS.md.
    """
    texts = ["What is in this picture?", "Tell me a story", "def main(", "Describe it"]
    pngs = [_png(10), _png(11)]
    plan = []
    for client in range(32):
        for k in range(4):
            i = client * 4 + k
            plan.append(dict(text=texts[i % 4], png=pngs[i % 2] if i % 2 == 0 else None, stream=i % 3 == 0,
                             leave_early=i % 16 == 5, max_tokens=16))
    expected = {(p["text"], p["png"]): reference(p["text"], p["png"], 16).text for p in plan}
    latencies, done, left = [], [], []

    def one_client(items):
        with httpx.Client(timeout=120) as c:
            for p in items:
                body = {"messages": _messages(p["text"], p["png"]), "max_tokens": p["max_tokens"],
                        "stream": p["stream"]}
                t0 = time.perf_counter()
                if p["stream"]:
                    with c.stream("POST", served.url + "/v1/chat/completions", json=body) as r:
                        assert r.status_code == 200
                        text = []
                        for ln in r.iter_lines():
                            if not ln.startswith("data: ") or ln == "data: [DONE]":
                                continue
                            delta = json.loads(ln[6:])["choices"]
                            if delta:
                                text.append(delta[0]["delta"].get("content") or "")
                            if p["leave_early"] and len(text) >= 2:
                                break
                    if p["leave_early"]:
                        left.append(p)
                        continue
                    got = "".join(text)
                else:
                    r = c.post(served.url + "/v1/chat/completions", json=body)
                    assert r.status_code == 200, r.text
                    got = r.json()["choices"][0]["message"]["content"]
                latencies.append(time.perf_counter() - t0)
                done.append((p, got))

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(one_client, plan[c * 4:(c + 1) * 4]) for c in range(32)]
        for f in futures:
            f.result(timeout=600)
    wall = time.perf_counter() - t0
    assert len(done) + len(left) == len(plan)  # none lost
    for p, got in done:
        assert got == expected[(p["text"], p["png"])]
    assert httpx.get(served.url + "/health").status_code == 200
    lat = sorted(latencies)
    print(f"load: {len(plan)} requests ({len(left)} left early) in {wall:.1f} s = {len(plan) / wall:.1f} req/s; "
          f"latency p50 {lat[len(lat) // 2] * 1000:.0f} ms, p95 {lat[int(len(lat) * 0.95)] * 1000:.0f} ms")


# --------------------------------------------------------------------------- slots (-np N)


@pytest.fixture(scope="module")
def served_slots(tiny_dense):
    """A server with 3 slots: requests generated at once, their drafts verified in one target batch."""
    engine = load_tiny(tiny_dense, n_ctx=3 * 4096, draft_max=7, flash_attn=False, n_parallel=3)
    server = Server(engine, ServerSettings(alias="tiny", max_queue=64, max_image_pixels=1024 * 1024))
    server.engine = engine
    yield server
    server.stop()
    engine.close()


def _chat(c, url: str, text: str, png: bytes | None, max_tokens: int, stream: bool) -> str:
    body = {"messages": _messages(text, png), "max_tokens": max_tokens, "stream": stream}
    if not stream:
        r = c.post(url + "/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]
    text_out = []
    with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for ln in r.iter_lines():
            if ln.startswith("data: ") and ln != "data: [DONE]":
                choices = json.loads(ln[6:])["choices"]
                if choices:
                    text_out.append(choices[0]["delta"].get("content") or "")
    return "".join(text_out)


def test_slots_answer_concurrent_requests_as_one_slot_would(served_slots, reference):
    """9 requests from 9 clients at once on 3 slots, mixed text/image, streamed and not, different
    lengths: every answer equals its sequential greedy answer, and steps were shared by slots."""
    sched = served_slots.engine.scheduler
    shared_before = sum(n for k, n in sched.slots_per_step.items() if k > 1)
    plan = [("What is in this picture?", _png(20), 24, True), ("Tell me a story", None, 40, False),
            ("def main(", None, 8, True), ("Describe it", _png(21), 16, False), ("Hi", None, 30, True),
            ("What is in this picture?", _png(21), 12, False), ("def add(a, b):", None, 20, False),
            ("Describe it", _png(20), 28, True), ("Tell me a story", None, 5, True)]
    expected = [reference(text, png, n).text for text, png, n, _ in plan]

    def client(item):
        with httpx.Client(timeout=120) as c:
            return _chat(c, served_slots.url, *item)

    with concurrent.futures.ThreadPoolExecutor(len(plan)) as pool:
        got = list(pool.map(client, plan))
    assert got == expected
    assert sum(n for k, n in sched.slots_per_step.items() if k > 1) > shared_before  # verified together
    props = httpx.get(served_slots.url + "/props").json()
    assert props["total_slots"] == 3
    metrics = httpx.get(served_slots.url + "/metrics").text
    assert "pyllama_spec_slots 3" in metrics and "pyllama_spec_busy 0" in metrics


def test_slots_a_client_that_leaves_frees_its_slot_and_the_others_are_unchanged(served_slots, reference):
    long = {"messages": OK_MESSAGES, "max_tokens": 3000, "stream": True}
    png = _png(22)
    expected = reference("Describe it", png, 64).text
    sched = served_slots.engine.scheduler
    with httpx.Client(timeout=120) as c1, httpx.Client(timeout=120) as c2, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        with c1.stream("POST", served_slots.url + "/v1/chat/completions", json=long) as first:
            lines = first.iter_lines()  # kept: closing this iterator would close the connection
            next(ln for ln in lines if '"content"' in ln and "assistant" not in ln)  # generating now
            other = pool.submit(_chat, c2, served_slots.url, "Describe it", png, 64, True)
            deadline = time.monotonic() + 20
            while sched.n_active < 2:  # the other request is in its slot
                assert time.monotonic() < deadline and not other.done()
                time.sleep(0.01)
        # the long stream's client left here, while the other was prefilling or decoding beside it
        assert other.result(timeout=120) == expected
    deadline = time.monotonic() + 10
    while "pyllama_spec_busy 0" not in httpx.get(served_slots.url + "/metrics").text:
        assert time.monotonic() < deadline, "the abandoned slot was not freed"
        time.sleep(0.05)
    assert sched.n_active == 0


def test_slots_a_full_queue_answers_503_while_the_slots_keep_serving(tiny_dense):
    engine = ps.load(tiny_dense.target, n_ctx=2 * 4096, **TINY_ENGINE, flash_attn=False, n_parallel=2)
    server = Server(engine, ServerSettings(max_queue=1))
    long = {"messages": OK_MESSAGES, "max_tokens": 3000, "stream": True}
    url = server.url + "/v1/chat/completions"
    try:
        with contextlib.ExitStack() as stack:
            for _ in range(2):  # two in the slots (their headers come with their first tokens)
                c = stack.enter_context(httpx.Client(timeout=60))
                stack.enter_context(c.stream("POST", url, json=long))
            stack.enter_context(_sent_raw(server.url, "/v1/chat/completions", long))  # one waiting
            deadline = time.monotonic() + 20
            while "pyllama_spec_queue_depth 1" not in (m := httpx.get(server.url + "/metrics").text):
                assert time.monotonic() < deadline, m
                time.sleep(0.05)
            assert "pyllama_spec_busy 2" in m
            full = httpx.post(url, json={**long, "stream": False})
            assert full.status_code == 503 and full.headers["retry-after"] == "1"
            assert full.json()["error"]["code"] == "queue_full"
        t0 = time.monotonic()  # every client left: their slots free within a step
        r = httpx.post(url, json={"messages": OK_MESSAGES, "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and time.monotonic() - t0 < 10
        generated = float(re.search(r"^pyllama_spec_generated_tokens_total (\S+)$",
                                    httpx.get(server.url + "/metrics").text, re.M).group(1))
        assert 0 < generated < 3000  # the abandoned ones were counted, and stopped early
    finally:
        server.stop()
        engine.close()


def test_cache_prompt_false_decodes_the_whole_prompt_again(served):
    body = {"messages": [{"role": "user", "content": "Tell me about the cache"}], "max_tokens": 4}
    url = served.url + "/v1/chat/completions"
    assert httpx.post(url, json=body, timeout=60).status_code == 200
    again = httpx.post(url, json=body, timeout=60).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    fresh = httpx.post(url, json={**body, "cache_prompt": False}, timeout=60).json()
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert fresh["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"]
    bad = httpx.post(url, json={**body, "cache_prompt": "no"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_prompt"


def test_a_draft_tree_server_answers_as_target_only_and_reports_it():
    """`serve --draft-tree N` on the trained pair: sampled answers equal target-only answers for a
    seed (`speculative.tree` per request, 0 = a chain), /props says the tree size, bad sizes are 400."""
    m = ps.embedded_models()
    engine = load_tiny(m, n_ctx=2048, draft_max=15, draft_tree=24)
    server = Server(engine, ServerSettings(alias="trained"))
    try:
        url = server.url + "/v1/completions"
        base = {"prompt": ps.embedded.PROMPT, "max_tokens": 40, "temperature": 0.8, "seed": 7}
        plain = httpx.post(url, json={**base, "speculative.n_max": 0}, timeout=60).json()
        tree = httpx.post(url, json=base, timeout=60).json()
        chain = httpx.post(url, json={**base, "speculative.tree": 0}, timeout=60).json()
        assert tree["choices"][0]["text"] == plain["choices"][0]["text"] == chain["choices"][0]["text"]
        assert tree["timings"]["draft_n"] > chain["timings"]["draft_n"] > 0
        assert httpx.get(server.url + "/props").json()["default_generation_settings"]["speculative"]["tree"] == 24
        bad = httpx.post(url, json={**base, "speculative.tree": 25}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative.tree"
        rejection = httpx.post(url, json={**base, "speculative.verify": "rejection"}, timeout=60)
        assert rejection.status_code == 400 and "tree" in rejection.json()["error"]["message"]
    finally:
        server.stop()
        engine.close()


def test_n_choices_each_take_a_slot_and_sample_with_seed_plus_their_index(served_slots):
    """n (OpenAI) / n_cmpl (llama-server): up to -np choices, generated at once on the slots. Choice
    i is the single request with seed + i; greedy choices are all the greedy answer; the stream's
    chunks carry each choice's index; usage counts the prompt once; more choices than slots is a 400."""
    url = served_slots.url
    base = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 24,
            "temperature": 0.9, "seed": 5}

    def one(seed):
        r = httpx.post(url + "/v1/chat/completions", json={**base, "seed": seed}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    singles = [one(5), one(6), one(7)]
    r = httpx.post(url + "/v1/chat/completions", json={**base, "n": 3}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == [s["choices"][0]["message"]["content"]
                                                                  for s in singles]
    assert len({c["message"]["content"] for c in body["choices"]}) > 1  # sampled apart
    assert body["usage"]["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    greedy = client.chat.completions.create(model="tiny", messages=base["messages"], max_tokens=16, temperature=0,
                                            n=2)
    assert len(greedy.choices) == 2 and greedy.choices[0].message.content == greedy.choices[1].message.content

    streamed = {0: [], 1: []}
    finished = set()
    for chunk in client.chat.completions.create(model="tiny", messages=base["messages"], max_tokens=24,
                                                temperature=0.9, seed=5, n=2, stream=True):
        for choice in chunk.choices:
            streamed[choice.index].append(choice.delta.content or "")
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    assert ["".join(streamed[i]) for i in (0, 1)] == [c["message"]["content"] for c in body["choices"][:2]]

    llama = httpx.post(url + "/completion", json={"prompt": "Tell me a story", "n_predict": 8, "n_cmpl": 2},
                       timeout=120)
    assert llama.status_code == 200 and [c["index"] for c in llama.json()] == [0, 1]
    for name in ("n", "n_cmpl"):
        bad = httpx.post(url + "/v1/chat/completions", json={**base, name: 4}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == name
        assert "-np 4" in bad.json()["error"]["message"]
    assert httpx.post(url + "/v1/chat/completions", json={**base, "n": 0}, timeout=60).status_code == 400


def test_api_keys_in_a_list_and_in_anthropics_header(tiny_dense):
    """--api-key a,b (and --api-key-file): any listed key opens, in Authorization: Bearer or in
    X-Api-Key as llama-server reads it; /health and /v1/health stay open."""
    engine = ps.load(tiny_dense.target, n_ctx=1024, **TINY_ENGINE, flash_attn=False)
    server = Server(engine, ServerSettings(api_key="first,second"))
    try:
        for path in ("/health", "/v1/health"):
            assert httpx.get(server.url + path).status_code == 200
        for headers, status in [({}, 401), ({"Authorization": "Bearer first"}, 200),
                                ({"Authorization": "Bearer second"}, 200), ({"Authorization": "Bearer first,second"}, 401),
                                ({"Authorization": "Bearer"}, 401), ({"X-Api-Key": "second"}, 200),
                                ({"X-Api-Key": "third"}, 401), ({"Authorization": "Bearer x", "X-Api-Key": "first"}, 401)]:
            assert httpx.get(server.url + "/v1/models", headers=headers).status_code == status, headers
    finally:
        server.stop()
        engine.close()
