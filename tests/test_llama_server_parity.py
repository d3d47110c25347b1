"""Responses compared with llama-server's own, on the same files and requests.

llama-server is the one built from the pin (`python build.py --tools`; .ci/run builds it); it
runs the tiny target alone, this server runs the same target with its DFlash draft (greedy
output equals target-only output, so the two must agree token for token). Each test compares
what a client reads: the text, the tokens, the log-probabilities (to float32 rounding), the
fields present, the status codes of bad requests. Without llama-server they skip, saying so.
"""

from __future__ import annotations

import json
import math
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="the server needs the 'server' extra")

from pyllama_spec import native_build  # noqa: E402
from pyllama_spec.server import ServerSettings  # noqa: E402

from serving import LocalServer, free_port  # noqa: E402

LLAMA_SERVER = native_build.find_llama_server()
pytestmark = pytest.mark.skipif(LLAMA_SERVER is None, reason="llama-server is not built here (python build.py "
                                                             "--tools builds it; .ci/run does)")
N_CTX = 2048


class _Process:
    def __init__(self, args: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([str(LLAMA_SERVER), *args, "--host", "127.0.0.1", "--port", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, Path(self.log.name).read_text()[-2000:]
            try:
                if post(self.url, "/health", None)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError("llama-server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def post(base: str, path: str, body, raw: bytes | None = None) -> tuple[int, object]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        text = e.read()
        try:
            return e.code, json.loads(text)
        except ValueError:
            return e.code, text.decode(errors="replace")


@pytest.fixture(scope="module")
def servers(tiny_dense):
    import pyllama_spec as ps

    theirs = _Process(["-m", str(tiny_dense.target), "-c", str(N_CTX), "-np", "1", "--no-warmup", "-t", "2"])
    engine = ps.load(tiny_dense.target, draft=tiny_dense.draft, n_ctx=N_CTX)
    ours = LocalServer(engine, ServerSettings(alias="tiny"))
    yield ours.url, theirs.url
    ours.stop()
    engine.close()
    theirs.stop()


def both(servers, path: str, body) -> tuple[tuple[int, object], tuple[int, object]]:
    ours, theirs = servers
    return post(ours, path, body), post(theirs, path, body)


PROMPT = "def add(a, b):"


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=2e-3, abs_tol=2e-3)


def _same_logprobs(ours: list, theirs: list) -> None:
    assert [e["id"] for e in ours] == [e["id"] for e in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert (a["token"], a["bytes"]) == (b["token"], b["bytes"])
        assert _close(a["logprob"], b["logprob"]), (a, b)
        # the alternatives: the same tokens, unless two are tied to float32 rounding
        assert len(a["top_logprobs"]) == len(b["top_logprobs"])
        for x, y in zip(a["top_logprobs"], b["top_logprobs"], strict=True):
            assert _close(x["logprob"], y["logprob"]), (x, y)
            assert x["id"] == y["id"] or _close(x["logprob"], y["logprob"])


def test_completion_text_tokens_and_fields_match(servers):
    (s1, a), (s2, b) = both(servers, "/completion", {"prompt": PROMPT, "n_predict": 16, "temperature": 0,
                                                     "return_tokens": True, "cache_prompt": False})
    assert s1 == s2 == 200
    assert (a["content"], a["tokens"], a["stop_type"]) == (b["content"], b["tokens"], b["stop_type"])
    assert (a["tokens_predicted"], a["tokens_evaluated"]) == (b["tokens_predicted"], b["tokens_evaluated"])
    missing = set(b) - set(a) - {"generation_settings"}  # see bench/RESULTS.md for what differs and why
    assert missing <= {"index", "id_slot", "prompt", "has_new_line", "truncated", "stopping_word"}, missing
    assert set(b["timings"]) <= set(a["timings"])


def test_n_probs_match_the_targets_own_distribution(servers):
    body = {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "n_probs": 3, "cache_prompt": False}
    (s1, a), (s2, b) = both(servers, "/completion", body)
    assert s1 == s2 == 200
    _same_logprobs(a["completion_probabilities"], b["completion_probabilities"])


def test_chat_text_and_logprobs_match(servers):
    body = {"messages": [{"role": "user", "content": "write a function"}], "max_tokens": 12, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    (s1, a), (s2, b) = both(servers, "/v1/chat/completions", body)
    assert s1 == s2 == 200
    ca, cb = a["choices"][0], b["choices"][0]
    assert ca["message"]["content"] == cb["message"]["content"]
    assert ca["finish_reason"] == cb["finish_reason"]
    assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"]
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    _same_logprobs(ca["logprobs"]["content"], cb["logprobs"]["content"])
    assert set(b) - set(a) <= {"system_fingerprint"}, set(b) - set(a)


def test_legacy_completions_logprobs_match(servers):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2}
    (s1, a), (s2, b) = both(servers, "/v1/completions", body)
    assert s1 == s2 == 200
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    _same_logprobs(a["choices"][0]["logprobs"]["content"], b["choices"][0]["logprobs"]["content"])


@pytest.mark.parametrize("constraint", [
    {"grammar": 'root ::= "x = " [0-9]+ ("," [0-9]+)*'},
    {"json_schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}},
])
def test_constrained_output_matches(servers, constraint):
    body = {"prompt": PROMPT, "n_predict": 24, "temperature": 0, "cache_prompt": False, **constraint}
    (s1, a), (s2, b) = both(servers, "/completion", body)
    assert s1 == s2 == 200
    assert a["content"] == b["content"]
    if "json_schema" in constraint and a["stop_type"] == "eos":
        assert isinstance(json.loads(a["content"])["n"], int)


def test_response_format_json_gives_the_schemas_grammar_output(servers):
    """Chat's response_format: the text llama-server's /completion gives for the same schema on the
    same rendered prompt. (llama-server's chat route builds its own grammar for it, which lets the
    reply start with whitespace, and then strips it: the text can differ; bench/RESULTS.md.)"""
    schema = {"type": "array", "items": {"type": "integer"}}
    messages = [{"role": "user", "content": "a number"}]
    ours, theirs = servers
    s1, a = post(ours, "/v1/chat/completions", {"messages": messages, "max_tokens": 20, "temperature": 0,
                                                 "response_format": {"type": "json_schema",
                                                                     "json_schema": {"schema": schema}}})
    _, rendered = post(theirs, "/apply-template", {"messages": messages})
    s2, b = post(theirs, "/completion", {"prompt": rendered["prompt"], "n_predict": 20, "temperature": 0,
                                         "json_schema": schema})
    assert s1 == s2 == 200
    assert a["choices"][0]["message"]["content"] == b["content"]


# Where this server answers differently, on purpose: llama-server answers a body that is not JSON
# with a 500 (its parser's exception); it is the client's error, a 400 here.
_OUR_STATUS = {b"{not json": 400}


@pytest.mark.parametrize("path,body,raw", [
    ("/completion", None, b"{not json"),
    ("/v1/chat/completions", {"messages": "hello"}, None),
    ("/v1/chat/completions", {}, None),
    ("/completion", {"prompt": PROMPT, "grammar": "root ::= ("}, None),
    ("/completion", {"prompt": PROMPT, "n_probs": "three"}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, None),
])
def test_bad_requests_are_refused_with_the_same_status(servers, path, body, raw):
    ours, theirs = servers
    (s1, a), (s2, b) = post(ours, path, body, raw), post(theirs, path, body, raw)
    if raw in _OUR_STATUS:
        assert (s1, s2) == (_OUR_STATUS[raw], 500), (a, b)
        return
    assert s1 == s2, (a, b)
    # error.code: llama-server writes the status there, this server OpenAI's string code
    assert isinstance(a, dict) and a["error"]["message"] and a["error"]["type"] == b["error"]["type"]
