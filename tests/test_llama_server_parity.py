"""Responses compared with llama-server's own, on the same files and requests.

llama-server is the one built from the pin (`python build.py --tools`; .ci/run builds it); it
runs the tiny target alone, this server runs the same target with its DFlash draft (greedy
output equals target-only output, so the two must agree token for token). Each test compares
what a client reads: the text, the tokens, the log-probabilities (to float32 rounding), the
fields present, the status codes of bad requests. Without llama-server they skip, saying so.
"""

from __future__ import annotations

import base64
import io
import json
import re
import math
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import LLAMA_SERVER, needs_llama_server

pytest.importorskip("starlette", reason="the server needs the 'server' extra")

from pyllama_spec.bindings.mtmd import MEDIA_MARKER  # noqa: E402
from pyllama_spec.server import ServerSettings  # noqa: E402

from serving import LocalServer, free_port  # noqa: E402
from serving import http as post  # noqa: E402

pytestmark = needs_llama_server
N_CTX = 2048


class _Process:
    def __init__(self, args: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)
        # flash attention off, as this project's default (llama-server's is auto): the same numerics
        self.proc = subprocess.Popen([str(LLAMA_SERVER), "-fa", "off", *args, "--host", "127.0.0.1",
                                      "--port", str(self.port)],
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


def _same_or_tied(x: dict, y: dict, theirs: list[dict], key: str) -> bool:
    """Entry x (ours) and y (theirs, at the same rank) name the same token, or two tokens tied to
    float32 rounding swapped places: x's token is elsewhere in their list with a value close to x's,
    or (a tie across the list's end) not in their list, its value close to their last one's."""
    if x["id"] == y["id"] or any(t["id"] == x["id"] and _close(t[key], x[key]) for t in theirs):
        return True
    return all(t["id"] != x["id"] for t in theirs) and _close(theirs[-1][key], x[key])


def _same_logprobs(ours: list, theirs: list) -> None:
    assert [e["id"] for e in ours] == [e["id"] for e in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert (a["token"], a["bytes"]) == (b["token"], b["bytes"])
        assert _close(a["logprob"], b["logprob"]), (a, b)
        # the alternatives: the same tokens, unless two are tied to float32 rounding
        assert len(a["top_logprobs"]) == len(b["top_logprobs"])
        for x, y in zip(a["top_logprobs"], b["top_logprobs"], strict=True):
            assert _close(x["logprob"], y["logprob"]), (x, y)
            assert _same_or_tied(x, y, b["top_logprobs"], "logprob"), (x, y)


def test_completion_text_tokens_and_fields_match(servers):
    (s1, a), (s2, b) = both(servers, "/completion", {"prompt": PROMPT, "n_predict": 16, "temperature": 0,
                                                     "return_tokens": True, "cache_prompt": False})
    assert s1 == s2 == 200
    assert (a["content"], a["tokens"], a["stop_type"]) == (b["content"], b["tokens"], b["stop_type"])
    assert (a["tokens_predicted"], a["tokens_evaluated"]) == (b["tokens_predicted"], b["tokens_evaluated"])
    assert set(b) == set(a), set(b) ^ set(a)  # every field llama-server gives, and no other
    assert set(b["generation_settings"]) == set(a["generation_settings"])
    for field in ("index", "prompt", "has_new_line", "truncated", "stop_type", "stopping_word", "tokens_cached"):
        assert a[field] == b[field], field
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
    """Chat's response_format: the chat layer's grammar for it (after the generation prompt; it lets
    the reply open a ```json block or start with whitespace), as llama-server's chat route builds
    it: the same message, the same tokens."""
    schema = {"type": "array", "items": {"type": "integer"}}
    messages = [{"role": "user", "content": "a number"}]
    body = {"messages": messages, "max_tokens": 20, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    (s1, a), (s2, b) = both(servers, "/v1/chat/completions", body)
    assert s1 == s2 == 200
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"]


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


@pytest.mark.parametrize("field", [{"echo": True}, {"best_of": 2}, {"suffix": "x"}])
def test_openai_completion_fields_llama_server_drops_are_refused_here(servers, field):
    """OpenAI's echo, best_of and suffix change what /v1/completions should answer; the pinned
    llama-server's parser would refuse them (oaicompat_completion_params_parse) but its route
    answers 200 and ignores them. A client asking for them gets a 400 here, not a quiet answer
    without them."""
    ours, theirs = servers
    (s1, a), (s2, b) = post(ours, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, **field}), \
        post(theirs, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, **field})
    assert (s1, s2) == (400, 200), (a, b)
    assert a["error"]["param"] == next(iter(field))


# --------------------------------------------------------------------------- llama-server's generation fields


def _forced(text: str) -> str:
    """A grammar that makes both servers write ``text`` (then lowercase letters)."""
    return "root ::= " + json.dumps(text) + " [a-z]*"


def _stream(base: str, path: str, body) -> list[dict]:
    req = urllib.request.Request(base + path, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        # SSE lines end at CR or LF only (str.splitlines would split a model's U+2028 too)
        return [json.loads(line[6:]) for line in re.split(r"\r\n|\r|\n", r.read().decode())
                if line.startswith("data: ") and line != "data: [DONE]"]


_SAME = ("index", "content", "tokens", "prompt", "tokens_evaluated", "tokens_predicted", "stop_type")


@pytest.mark.parametrize("prompt", [
    [100, 101, 102, 32, 97],
    [100, "ef add", 40, "a, b):"],
    ["def", "import os\n"],
    [[100, 101, 102], "x = ", {"prompt_string": "y = 2"}, {"prompt_string": [120, " = 3"]}],
    ["<|im_start|>user"],
])
def test_every_prompt_shape_gives_the_same_completions(servers, prompt):
    body = {"prompt": prompt, "n_predict": 6, "temperature": 0, "return_tokens": True, "cache_prompt": False}
    (s1, a), (s2, b) = both(servers, "/completion", body)
    assert s1 == s2 == 200
    a, b = (a, b) if isinstance(a, list) else ([a], [b])
    assert [{k: x[k] for k in _SAME} for x in a] == [{k: x[k] for k in _SAME} for x in b]


@pytest.mark.parametrize("path", ["/completion", "/v1/completions"])
@pytest.mark.parametrize("prompt", [[], 5, {"x": 1}, [1.5], [[1, 2], [3, [4]]], [97, 10**6], [97, -1]])
def test_a_prompt_llama_server_refuses_is_refused_with_the_same_status(servers, path, prompt):
    (s1, a), (s2, b) = both(servers, path, {"prompt": prompt, "n_predict": 2})
    assert s1 == s2 == 400, (a, b)
    assert a["error"]["type"] == b["error"]["type"]


def test_several_prompts_on_the_openai_route_are_its_choices_in_order(servers):
    body = {"prompt": ["ab", [99, 100], "x = 1"], "max_tokens": 4, "temperature": 0}
    (s1, a), (s2, b) = both(servers, "/v1/completions", body)
    assert s1 == s2 == 200
    assert [(c["index"], c["text"], c["finish_reason"]) for c in a["choices"]] == \
        [(c["index"], c["text"], c["finish_reason"]) for c in b["choices"]]


def test_a_stop_string_gives_the_same_final_fields_and_probabilities(servers):
    body = {"prompt": "code:\n", "n_predict": 20, "temperature": 0, "grammar": _forced("abc = def(ghi)\n"),
            "stop": ["zz", "def"], "n_probs": 2, "cache_prompt": False}
    (s1, a), (s2, b) = both(servers, "/completion", body)
    assert s1 == s2 == 200
    for field in ("content", "stop_type", "stopping_word", "tokens_predicted", "has_new_line", "truncated"):
        assert a[field] == b[field], field
    _same_logprobs(a["completion_probabilities"], b["completion_probabilities"])


def test_a_generation_that_fills_the_context_is_truncated_alike(servers):
    body = {"prompt": [97] * (N_CTX - 6), "n_predict": 40, "temperature": 0, "cache_prompt": False}
    (s1, a), (s2, b) = both(servers, "/completion", body)
    assert s1 == s2 == 200
    for field in ("truncated", "stop_type", "tokens_predicted", "content", "tokens_cached"):
        assert a[field] == b[field], field
    assert a["truncated"] is True


@pytest.mark.parametrize("text", ["x\n    y = 1\n  z\nw\n", "def f():\n  a\n    b\n\n  c\n d\n",
                                  "a\n\tb\n\t\tc\n  \n e\nf", "ab\ncd\n  ef\n gh\n"])
@pytest.mark.parametrize("n_indent", [0, 1, 3, 5])
def test_n_indent_cuts_the_same_line_streamed_or_not(servers, text, n_indent):
    body = {"prompt": "code:\n", "n_predict": 30, "temperature": 0, "grammar": _forced(text), "n_indent": n_indent,
            "cache_prompt": False}
    (s1, a), (s2, b) = both(servers, "/completion", body)
    assert s1 == s2 == 200
    for field in ("content", "stop_type", "tokens_predicted", "has_new_line"):
        assert a[field] == b[field], field
    ours, theirs = servers
    assert "".join(e["content"] for e in _stream(ours, "/completion", body)) == \
        "".join(e["content"] for e in _stream(theirs, "/completion", body))


def test_a_streamed_completion_has_the_same_chunks_progress_and_final_body(servers):
    body = {"prompt": PROMPT, "n_predict": 12, "temperature": 0, "cache_prompt": False, "return_progress": True,
            "timings_per_token": True}
    ours, theirs = servers
    a, b = _stream(ours, "/completion", body), _stream(theirs, "/completion", body)
    # this server sends a speculative step's tokens in one chunk, llama-server one token a chunk
    for events in (a, b):
        assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
        assert all("timings" in e for e in events if e["tokens"])
    assert "".join(e["content"] for e in a) == "".join(e["content"] for e in b)
    assert [t for e in a[:-1] for t in e["tokens"]] == [t for e in b[:-1] if "prompt_progress" not in e
                                                      for t in e["tokens"]]
    progress_a = [e["prompt_progress"] for e in a if "prompt_progress" in e]
    progress_b = [e["prompt_progress"] for e in b if "prompt_progress" in e]
    for p, q in ((progress_a[0], progress_b[0]), (progress_a[-1], progress_b[-1])):
        assert (p["total"], p["cache"], p["processed"]) == (q["total"], q["cache"], q["processed"])
    assert set(a[-1]) == set(b[-1]) and (a[-1]["content"], a[-1]["tokens"]) == ("", [])
    for field in ("stop_type", "tokens_predicted", "tokens_evaluated", "prompt", "has_new_line", "truncated"):
        assert a[-1][field] == b[-1][field], field


def test_response_fields_select_the_same_fields(servers):
    fields = ["content", "generation_settings/n_predict", "timings/prompt_n", "nothing", "stop_type/x", "tokens"]
    body = {"prompt": PROMPT, "n_predict": 5, "temperature": 0, "cache_prompt": False, "response_fields": fields}
    (s1, a), (s2, b) = both(servers, "/completion", body)
    assert s1 == s2 == 200 and a == b


def test_post_sampling_probs_of_greedy_sampling_match(servers):
    body = {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "n_probs": 3, "post_sampling_probs": True}
    (s1, a), (s2, b) = both(servers, "/completion", body)
    assert s1 == s2 == 200 and a["completion_probabilities"] == b["completion_probabilities"]


@pytest.mark.parametrize("sampling", [
    {"temperature": 1.0},  # llama-server's chain: top-k 40, top-p 0.95, min-p 0.05
    {"temperature": 0.7, "top_k": 0, "top_p": 0.8, "min_p": 0.0},
])
def test_post_sampling_probs_at_temperature_match_where_the_tokens_agree(servers, sampling):
    """A position's probabilities after the chain depend on the tokens drawn before it: compared
    while the entries agree (the first always: the same seed draws the same tokens here, as far as
    llama-server lists them one by one; it joins the tokens of a character split between them)."""
    body = {"prompt": PROMPT, "n_predict": 8, "n_probs": 10, "post_sampling_probs": True, "seed": 11,
            "cache_prompt": False, **sampling}
    (s1, a), (s2, b) = both(servers, "/completion", body)
    assert s1 == s2 == 200
    compared = []
    for x, y in zip(a["completion_probabilities"], b["completion_probabilities"]):
        if (x["id"], x["token"], x["bytes"]) != (y["id"], y["token"], y["bytes"]):
            break
        assert _close(x["prob"], y["prob"]), (x, y)
        assert len(x["top_probs"]) == len(y["top_probs"]), (x, y)
        for p, q in zip(x["top_probs"], y["top_probs"]):
            assert _close(p["prob"], q["prob"]), (p, q)
            assert _same_or_tied(p, q, y["top_probs"], "prob"), (p, q)
        compared.append(len(x["top_probs"]))
    print("entries compared:", len(compared), "top_probs listed:", compared)
    assert len(compared) >= 2 and max(compared) > 1  # a position where the chain kept several tokens


@pytest.mark.parametrize("path", ["/embedding", "/embeddings", "/v1/embeddings", "/rerank", "/reranking",
                                  "/v1/rerank", "/v1/reranking"])
def test_embedding_and_rerank_routes_are_refused_alike(servers, path):
    (s1, a), (s2, b) = both(servers, path, {"content": "hi", "input": "hi", "query": "a", "documents": ["b"]})
    assert s1 == s2 == 501
    assert (a["error"]["message"], a["error"]["type"]) == (b["error"]["message"], b["error"]["type"])


@pytest.fixture(scope="module")
def fim_servers(tiny_fim):
    """llama-server and this server on the FIM trio with its projector: two slots of 1024 rows,
    batches of 512, -n 200 (so /infill keeps 1024 - 512 - 400 = 112 extra tokens)."""
    import pyllama_spec as ps

    theirs = _Process(["-m", str(tiny_fim.target), "--mmproj", str(tiny_fim.mmproj), "-c", "2048", "-np", "2",
                       "-b", "512", "-n", "200", "--no-warmup", "-t", "2"])
    # the projector's flash attention off too, as llama-server's -fa off sets both: the same embeddings
    engine = ps.load(tiny_fim.target, mmproj=tiny_fim.mmproj, draft=tiny_fim.draft, n_ctx=2048, n_parallel=2,
                     n_batch=512, mmproj_flash_attn=False)
    ours = LocalServer(engine, ServerSettings(alias="tiny", default_max_tokens=200))
    yield ours.url, theirs.url
    ours.stop()
    engine.close()
    theirs.stop()


@pytest.mark.parametrize("body", [
    {"input_prefix": "def f(", "input_suffix": "):\n"},
    {"input_prefix": "def f(", "input_suffix": "):\n", "prompt": "x",
     "input_extra": [{"filename": "a.py", "text": "import os\n"}, {"text": "b"}]},
    {"input_prefix": [97, "<|fim_pad|>"], "input_suffix": "<|fim_pad|>", "prompt": "<|fim_pad|>"},
    {"input_prefix": "p" * 500 + "END", "input_suffix": "START" + "s" * 300,
     "input_extra": [{"filename": f"f{i}.py", "text": f"x{i} = {i}\n" * 6} for i in range(4)]},
])
def test_infill_gives_the_same_prompt_and_completion(fim_servers, body):
    body = {**body, "n_predict": 6, "temperature": 0, "return_tokens": True, "cache_prompt": False}
    (s1, a), (s2, b) = both(fim_servers, "/infill", body)
    assert s1 == s2 == 200, (a, b)
    for field in ("prompt", "tokens_evaluated", "content", "tokens"):
        assert a[field] == b[field], field


def test_a_multimodal_prompt_and_several_prompts_of_several_choices_match(fim_servers):
    from PIL import Image

    ours, theirs = fim_servers
    buf = io.BytesIO()
    Image.new("RGB", (224, 224), (200, 30, 40)).save(buf, "PNG")
    image = base64.b64encode(buf.getvalue()).decode()
    marker = post(theirs, "/props", None)[1]["media_marker"]  # llama-server draws one per start
    outs = []
    for base, mark in ((ours, MEDIA_MARKER), (theirs, marker)):
        prompt = ["ab", {"prompt_string": f"x{mark}hi", "multimodal_data": [image]}]
        outs.append(post(base, "/completion", {"prompt": prompt, "n_cmpl": 2, "n_predict": 4, "temperature": 0,
                                               "return_tokens": True}))
    (s1, a), (s2, b) = outs
    assert s1 == s2 == 200
    assert [{k: x[k] for k in _SAME} for x in a] == [{k: x[k] for k in _SAME} for x in b]
    assert [x["index"] for x in a] == [0, 1, 2, 3]


def test_infill_refusals_match(servers):
    (s1, a), (s2, b) = both(servers, "/infill", {"input_prefix": "a", "input_suffix": "b"})
    assert s1 == s2 == 501 and a["error"]["message"] == b["error"]["message"]


def _prometheus(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("llamacpp:")}


def test_metrics_carry_llama_servers_series_with_the_same_counts(tiny_dense):
    """A dashboard made for llama-server reads this server: its llamacpp:* series are here under
    the same names, and after the same requests the token counts agree (and one busy slot per
    decode on one slot)."""
    import pyllama_spec as ps

    theirs = _Process(["-m", str(tiny_dense.target), "-c", str(N_CTX), "-np", "1", "--no-warmup", "-t", "2",
                       "--metrics"])
    engine = ps.load(tiny_dense.target, n_ctx=N_CTX)
    ours = LocalServer(engine, ServerSettings(alias="tiny"))
    try:
        for url in (ours.url, theirs.url):
            for n in (8, 12):
                assert post(url, "/completion", {"prompt": PROMPT, "n_predict": n, "cache_prompt": False})[0] == 200
        a, b = _prometheus(ours.url), _prometheus(theirs.url)
        assert set(b) - set(a) == set()
        assert a["llamacpp:n_busy_slots_per_decode"] == b["llamacpp:n_busy_slots_per_decode"] == 1
        for name in ("tokens_predicted_total", "prompt_tokens_total", "prompt_tokens_cached_total",
                     "n_tokens_max", "spec_decode_num_draft_tokens_total", "requests_processing"):
            assert a[f"llamacpp:{name}"] == b[f"llamacpp:{name}"], name
    finally:
        ours.stop()
        engine.close()
        theirs.stop()


@pytest.mark.parametrize("extra", [{}, {"dry_penalty_last_n": -1}, {"dry_penalty_last_n": 8}])
def test_dry_gives_the_same_tokens_with_llama_servers_defaults(servers, extra):
    """DRY on (its multiplier only, llama-server's defaults for the rest: a look-back of 64
    tokens, allowed length 2, base 1.75, its sequence breakers): the same greedy tokens."""
    body = {"prompt": PROMPT + " x" * 40 + PROMPT, "n_predict": 24, "temperature": 0, "dry_multiplier": 2.0,
            "return_tokens": True, "cache_prompt": False, **extra}
    (s1, a), (s2, b) = both(servers, "/completion", body)
    if extra.get("dry_penalty_last_n") == -1:
        # -1 (the whole context, as llama.cpp's samplers and older llama-servers take it) is
        # refused by this pin's request schema (hard limits 0..INT32_MAX); taken here
        assert (s1, s2) == (200, 400), (a, b)
        return
    assert s1 == s2 == 200
    assert a["tokens"] == b["tokens"]
    assert a["generation_settings"]["dry_penalty_last_n"] == b["generation_settings"]["dry_penalty_last_n"]


@pytest.fixture(scope="module")
def trained_servers():
    """The embedded trained pair (its draft is accepted often): this server with the draft,
    llama-server with the target alone."""
    import pyllama_spec as ps

    em = ps.embedded_models()
    theirs = _Process(["-m", str(em.target), "-c", str(N_CTX), "-np", "1", "--no-warmup", "-t", "2"])
    engine = ps.load(em.target, draft=em.draft, n_ctx=N_CTX, draft_max=7)
    ours = LocalServer(engine, ServerSettings(alias="trained"))
    yield ours.url, theirs.url
    ours.stop()
    engine.close()
    theirs.stop()


@pytest.mark.parametrize("stop", ["name", "self", "\n"])
def test_a_stop_string_inside_a_speculative_step_counts_the_tokens_up_to_it(trained_servers, stop):
    """A stop string completed by a drafted token in the middle of a verified step: the tokens
    the step accepted after it were never generated (llama-server, one token at a time, never
    reaches them), so tokens_predicted and usage count up to the stop."""
    code = "class Counter:\n    def __init__(self, name):\n        self.name = name\n        self."
    body = {"prompt": code, "n_predict": 64, "temperature": 0, "stop": [stop], "cache_prompt": False}
    (s1, a), (s2, b) = both(trained_servers, "/completion", body)
    assert s1 == s2 == 200
    assert a["timings"]["draft_n_accepted"] > 0  # drafts were accepted on the way
    for field in ("content", "stop_type", "stopping_word", "tokens_predicted"):
        assert a[field] == b[field], field
    chat = {"prompt": code, "max_tokens": 64, "temperature": 0, "stop": [stop]}
    (s1, a), (s2, b) = both(trained_servers, "/v1/completions", chat)
    assert s1 == s2 == 200 and a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"]
