"""An HTTP fuzz test of the server: generated requests, valid shapes mixed with hostile values,
sent to every route of ONE real server on 127.0.0.1 (a subprocess: a native crash fails the
test instead of killing the test runner).

Every response must be: not a 5xx (but a 503 ``queue_full``, which one client never causes);
for a 4xx, a JSON body with an ``error`` object; within ``TIMEOUT`` seconds; a streamed answer
must not carry a ``server_error``; and after every example ``/health`` answers
``{"status": "ok"}`` quickly. The server's log must show no traceback.

The server caps ``max_tokens`` at 8 (default 4) over a 512-token context, so generations take
milliseconds; the examples of all tests together take about a minute (``FUZZ_SECONDS``).
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import N_THREADS, REPO_ROOT

httpx = pytest.importorskip("httpx", reason="the test extra brings httpx")
pytest.importorskip("uvicorn", reason="the server extra brings uvicorn")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

TIMEOUT = 20.0  # seconds for one response
HEALTH_TIMEOUT = 5.0
#: A fuzz test stops drawing new examples once it has run this long (the budget of each test).
FUZZ_SECONDS = {"generation": 30.0, "bodies": 15.0, "routes": 10.0, "grammars": 20.0}

SERVER = r"""
import json, logging, sys
from pathlib import Path
import uvicorn
import pyllama_spec as ps
from pyllama_spec.server import ServerSettings, create_app

cfg = json.loads(sys.argv[1])
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
logging.getLogger("pyllama_spec").setLevel(logging.ERROR)  # not the template fallback warnings
engine = ps.load(cfg["target"], mmproj=cfg["mmproj"], draft=cfg["draft"], n_ctx=512, n_batch=64, n_ubatch=64,
                 n_threads=cfg["n_threads"], draft_max=4, flash_attn=False)
settings = ServerSettings(alias="tiny", max_tokens=8, default_max_tokens=4, max_queue=4, max_images=2,
                          max_image_pixels=128 * 128, max_body_bytes=2**20, allowed_image_dir=Path(cfg["image_dir"]),
                          slot_save_path=Path(cfg["image_dir"]), endpoint_props=True)
uvicorn.run(create_app(engine, settings), host="127.0.0.1", port=cfg["port"], log_level="error")
"""


def _image_bytes(fmt: str, side: int, seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    pixels = (np.random.default_rng(seed).random((side, side, 3)) * 255).astype(np.uint8)
    Image.fromarray(pixels).save(buf, fmt)
    return buf.getvalue()


IMAGES = [_image_bytes("PNG", 16, 1), _image_bytes("JPEG", 16, 2), _image_bytes("WEBP", 16, 3),
          _image_bytes("GIF", 8, 4), _image_bytes("BMP", 8, 5), _image_bytes("PNG", 200, 6)]  # 200x200: too many pixels


class _Fuzzed:
    """The server subprocess, one HTTP client, and what was sent."""

    def __init__(self, models, folder: Path) -> None:
        image_dir = folder / "images"
        image_dir.mkdir()
        (image_dir / "ok.png").write_bytes(IMAGES[0])
        (image_dir / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
        (image_dir / "sub").mkdir()
        (image_dir / "loop.png").symlink_to(image_dir / "loop.png")
        (image_dir / "out.png").symlink_to("/etc/passwd")
        if hasattr(os, "mkfifo"):
            os.mkfifo(image_dir / "fifo.png")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        cfg = dict(target=str(models.target), mmproj=str(models.mmproj), draft=str(models.draft),
                   image_dir=str(image_dir), port=port, n_threads=N_THREADS)
        self.log_path = folder / "server.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed by stop()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        env.setdefault("OMP_NUM_THREADS", str(N_THREADS))
        self.proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SERVER), json.dumps(cfg)],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.client = httpx.Client(timeout=TIMEOUT)
        self.sent = 0
        self.statuses: dict[int, int] = {}
        self._log_seen = 0
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, f"the server exited: {self.log()}"
            assert time.monotonic() < deadline, f"the server did not start: {self.log()}"
            try:
                if self.client.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def new_log(self) -> str:
        text = self.log()
        new, self._log_seen = text[self._log_seen:], len(text)
        return new

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    # ------------------------------------------------------------------ one request, checked

    def send(self, method: str, path: str, *, content: bytes | None = None, headers: dict | None = None) -> None:
        shown = None if content is None else content[:600] + (b"..." if len(content) > 600 else b"")
        what = f"{method} {path} headers={headers} body={shown!r}"
        try:
            request = self.client.build_request(method, self.url + path, content=content, headers=headers)
        except (httpx.InvalidURL, httpx.LocalProtocolError, UnicodeError):
            return  # not a request httpx can send (a NUL in the path, ...)
        t0 = time.monotonic()
        try:
            r = self.client.send(request)
        except httpx.TimeoutException:
            pytest.fail(f"no answer within {TIMEOUT} s: {what}")
        except httpx.LocalProtocolError:  # refused by the client's own HTTP library, before sending
            return
        self.sent += 1
        elapsed = time.monotonic() - t0
        self.statuses[r.status_code] = self.statuses.get(r.status_code, 0) + 1
        assert elapsed < TIMEOUT, what
        self._check(r, method, what)
        self.check_health(what)

    def _check(self, r, method: str, what: str) -> None:
        status = r.status_code
        # llama.cpp logs the grammar it refuses (left recursion) as an error of its own; the 400 says why
        log = "".join(line for line in self.new_log().splitlines(keepends=True)
                      if not line.startswith("ERROR pyllama_spec.native: unsupported grammar"))
        assert "Traceback" not in log and "ERROR" not in log, f"the server logged an error for {what}:\n{log}"
        if status >= 500:
            queue_full = status == 503 and _json(r) and _json(r).get("error", {}).get("code") == "queue_full"
            assert queue_full, f"{status} for {what}: {r.text[:2000]}"
        if method == "HEAD":
            return
        if 400 <= status < 500:
            body = _json(r)
            assert isinstance(body, dict) and isinstance(body.get("error"), dict), f"{status} {r.text[:500]} for {what}"
            err = body["error"]
            assert isinstance(err.get("message"), str) and err["message"], f"{r.text[:500]} for {what}"
            assert "Traceback" not in r.text, what
        elif status == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
            # the SSE spec's line ends only: str.splitlines would also split at U+2028, U+0085, ...,
            # which a model's text may hold (raw in the JSON, as llama-server writes it too)
            events = [line[len("data: "):] for line in re.split(r"\r\n|\r|\n", r.text) if line.startswith("data: ")]
            assert events, f"an empty stream for {what}"
            for data in events:
                if data == "[DONE]":
                    continue
                event = json.loads(data)
                if "error" in event:  # an error after the 200 was sent: a request's fault, never the server's
                    assert event["error"].get("type") != "server_error", f"{data} for {what}"
        elif status == 200 and r.request.url.path in ("/v1/chat/completions", "/v1/completions", "/completion"):
            body = _json(r)
            if r.request.url.path == "/completion" and isinstance(body, list):  # several prompts: a list each
                assert body and all(isinstance(b, dict) for b in body), f"{r.text[:500]} for {what}"
            else:
                assert isinstance(body, dict), f"{r.text[:500]} for {what}"

    def check_health(self, after: str) -> None:
        t0 = time.monotonic()
        try:
            r = self.client.get(self.url + "/health", timeout=HEALTH_TIMEOUT)
        except httpx.TransportError as e:
            pytest.fail(f"/health did not answer after {after}: {e!r}; server alive: {self.proc.poll() is None}; "
                        f"log: {self.log()[-3000:]}")
        assert r.status_code == 200 and r.json() == {"status": "ok"}, f"/health: {r.status_code} {r.text} after {after}"
        assert time.monotonic() - t0 < HEALTH_TIMEOUT, after


def _json(r):
    try:
        return r.json()
    except ValueError:
        return None


@pytest.fixture(scope="module")
def fuzzed(tiny_dense, tmp_path_factory):
    server = _Fuzzed(tiny_dense, tmp_path_factory.mktemp("fuzz"))
    yield server
    server.stop()
    print(f"\nfuzz: {server.sent} requests sent (each followed by /health); statuses {sorted(server.statuses.items())}")
    assert server.proc.returncode in (0, -15), f"the server ended with {server.proc.returncode}: {server.log()[-3000:]}"


class _Budget:
    """A test's time: once it is spent, new examples send nothing (an example that failed still
    runs again when hypothesis replays it to report it)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.start, self.failed = seconds, None, set()

    def run(self, key, send) -> None:
        if self.start is None:
            self.start = time.monotonic()
        if time.monotonic() - self.start > self.seconds and repr(key) not in self.failed:
            return
        try:
            send()
        except BaseException:
            self.failed.add(repr(key))
            raise


BUDGETS = {name: _Budget(seconds) for name, seconds in FUZZ_SECONDS.items()}


FUZZ = settings(deadline=None, database=None, phases=[Phase.explicit, Phase.generate], print_blob=True,
                suppress_health_check=list(HealthCheck))

# --------------------------------------------------------------------------- strategies

HUGE_INTS = st.sampled_from([2**31, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**100, -(10**4000), 10**4299])
text = st.text(st.characters(codec=None, exclude_categories=()), max_size=30)  # any code point: NULs, surrogates
plain_text = st.text(max_size=30)
scalars = (st.none() | st.booleans() | st.integers() | HUGE_INTS
           | st.floats(allow_nan=True, allow_infinity=True) | text)
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(text, kids, max_size=4),
                           max_leaves=12)


class _Raw:
    """JSON text spliced into a body as it is encoded: what json.dumps cannot write (nesting deeper
    than Python's stack, integers longer than int() reads) or writes otherwise (1e999, -0)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __repr__(self) -> str:
        return f"_Raw({self.data[:24]!r}... {len(self.data)} bytes)"


raw_values = st.one_of(
    st.integers(95, 105).map(lambda n: _Raw(b"[" * n + b"]" * n)),  # about MAX_JSON_DEPTH
    st.integers(95, 3000).map(lambda n: _Raw(b"[" * n + b"]" * n)),  # past Python's recursion limit
    st.integers(95, 3000).map(lambda n: _Raw(b'{"a":' * n + b"0" + b"}" * n)),
    st.integers(4290, 6000).map(lambda n: _Raw(b"9" * n)),  # int(): at most 4300 digits
    st.sampled_from([b"1e999", b"-1e999", b"1e-400", b"-0", b"-0.0", b"0." + b"1" * 5000, b"NaN", b"-Infinity",
                     b"1" + b"0" * 4300, b"1E+2", b'"\\ud800"', b'"\\u0000"']).map(_Raw),
)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@st.composite
def mutated_image(draw) -> bytes:
    data = bytearray(draw(st.sampled_from(IMAGES)))
    for _ in range(draw(st.integers(0, 6))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    cut = draw(st.integers(0, len(data)))
    return bytes(data[:cut] if draw(st.booleans()) else data)


MIMES = st.sampled_from(["image/png", "image/jpeg", "image/jpg", "image/webp", "IMAGE/PNG", "image/gif", "text/plain",
                         "", "image/png;charset=utf-8", "image/png ;x=y"])
image_urls = st.one_of(
    st.sampled_from(IMAGES).map(lambda b: "data:image/png;base64," + _b64(b)),
    st.builds(lambda m, b: f"data:{m};base64,{_b64(b)}", MIMES, mutated_image()),
    st.builds(lambda m, s: f"data:{m};base64,{s}", MIMES, text),
    st.builds(lambda h, s: f"{h},{s}", st.sampled_from(["data:", "DATA:image/png;BASE64", "data:;base64",
                                                        "data:image/png", "data:image/png;base64;x", "Data:image/png;"
                                                        "base64"]), text | st.binary(max_size=40).map(_b64)),
    st.sampled_from(["ok.png", "./ok.png", "sub/../ok.png", "file://ok.png", "bad.png", "sub", "loop.png", "out.png",
                     "fifo.png", "missing.png", "/etc/passwd", "../../../../etc/passwd", "file:///etc/hostname",
                     "a\x00b.png", "x" * 300, "/".join(["d"] * 3000), "http://127.0.0.1:1/x.png", "https://x/a.png",
                     "", ".", "~/x.png", "%2e%2e/etc/passwd"]),
    text,
)
parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text | json_values}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": image_urls})}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": image_urls | json_values}),
    st.fixed_dictionaries({"type": st.sampled_from(["image", "input_audio", "media_marker", "TEXT", ""]),
                           "text": text}),
    st.dictionaries(text, json_values, max_size=3),
    json_values,
)
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | text | json_values
contents = text | st.lists(parts, max_size=3) | json_values | raw_values
messages_ = st.lists(st.fixed_dictionaries({"role": roles, "content": contents},
                                           optional={"name": text, "tool_calls": json_values})
                     | json_values, max_size=3) | json_values
_DELETE = object()
numbers = st.integers(-5, 20) | st.floats(allow_nan=True, allow_infinity=True) | HUGE_INTS | json_values | raw_values

FIELD_VALUES = {
    "messages": messages_,
    "messages.0.content": contents,
    "messages.0.role": roles,
    "messages.0.content.parts": st.lists(parts, min_size=1, max_size=3),
    "prompt": text | st.lists(text, max_size=2) | json_values | st.just("word " * 600)
    # llama-server's shapes: token ids (some outside the vocabulary), mixed, objects, lists of them
    | st.lists(st.integers(-5, 400) | text, max_size=6)
    | st.lists(st.lists(st.integers(-2, 300), max_size=4) | text | json_values, max_size=3)
    | st.fixed_dictionaries({"prompt_string": text | st.lists(st.integers(0, 300) | text, max_size=4) | json_values},
                            optional={"multimodal_data": st.lists(text, max_size=2) | json_values}),
    "return_tokens": st.booleans() | json_values,
    "return_progress": st.booleans() | json_values,
    "timings_per_token": st.booleans() | json_values,
    "post_sampling_probs": st.booleans() | json_values,
    "response_fields": st.lists(text, max_size=3) | json_values,
    "n_indent": numbers,
    "t_max_predict_ms": numbers,
    "n_keep": numbers,
    "n_discard": numbers,
    "stop": text | st.lists(text, max_size=6) | json_values,
    "max_tokens": numbers | st.just(-1),
    "max_completion_tokens": numbers,
    "n_predict": numbers | st.just(-1),
    "temperature": numbers | st.floats(0, 2),
    "top_p": numbers | st.floats(0, 1),
    "top_k": numbers,
    "min_p": numbers | st.floats(0, 1),
    "presence_penalty": numbers | st.floats(-2, 2),
    "seed": numbers,
    "n": numbers,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | json_values}) | json_values,
    "cache_prompt": st.booleans() | json_values,
    "speculative.n_max": st.integers(-1, 8) | st.just("auto") | json_values,
    "speculative.n_min": st.integers(-1, 8) | json_values,
    "speculative.tree": st.integers(-1, 3) | json_values,
    "speculative.verify": st.sampled_from(["rejection", "match"]) | json_values,
    "speculative.draft_positions": st.sampled_from(["target", "sequential"]) | json_values,
    "chat_template_kwargs": (st.dictionaries(st.sampled_from(["enable_thinking", "tools", "messages", "bos_token",
                                                              "add_generation_prompt", "self", "media_marker",
                                                              "raise_exception", "x"]) | text,
                                             json_values | raw_values, min_size=1, max_size=3)
                             | json_values),
    "model": text | json_values,
    "extra": json_values | raw_values,
    # tool calls and reasoning (the chat route's)
    "tools": st.lists(st.fixed_dictionaries(
        {"type": st.just("function") | text, "function": st.fixed_dictionaries(
            {"name": st.just("f") | text | json_values},
            optional={"parameters": json_values | st.just({"type": "object", "properties": {"x": {"type": "string"}}}),
                      "description": text})}) | json_values, max_size=2) | json_values,
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | json_values
    | st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({"name": text})}),
    "parallel_tool_calls": st.booleans() | json_values,
    "reasoning_format": st.sampled_from(["none", "deepseek", "deepseek-legacy", "auto"]) | json_values,
    "reasoning_budget_tokens": numbers,
    "messages.0.tool_calls": st.lists(st.fixed_dictionaries(
        {"type": st.just("function"), "id": text | json_values,
         "function": st.fixed_dictionaries({"name": text, "arguments": text | json_values})}) | json_values,
        max_size=2) | json_values,
}
CHAT_ONLY = ("chat_template_kwargs", "tools", "tool_choice", "parallel_tool_calls", "reasoning_format",
             "reasoning_budget_tokens")
CHAT_FIELDS = [f for f in FIELD_VALUES if f not in ("prompt", "n_predict")]
COMPLETION_FIELDS = [f for f in FIELD_VALUES if not f.startswith("messages") and f not in CHAT_ONLY]
GENERATION_ROUTES = ["/v1/chat/completions", "/v1/completions", "/completion"]
#: Every route that reads a generation request (the Messages and Responses APIs translate theirs).
BODY_ROUTES = GENERATION_ROUTES + ["/v1/messages", "/v1/responses"]


def _base(path: str) -> dict:
    if path == "/v1/chat/completions":
        return {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    return {"prompt": "def f(", "max_tokens": 2}


def _set(body: dict, field: str, value) -> None:
    if field.startswith("messages.0."):
        m = body.get("messages")
        if not (isinstance(m, list) and m and isinstance(m[0], dict)):
            body["messages"] = m = [{"role": "user", "content": "Hi"}]
        m[0][{"messages.0.role": "role", "messages.0.tool_calls": "tool_calls"}.get(field, "content")] = value
    elif field == "extra":
        body["unknown_field"] = value
    elif value is _DELETE:
        body.pop(field, None)
    else:
        body[field] = value


def _encode(body, how: str) -> bytes:
    raws: list[bytes] = []

    def swap(v):  # each _Raw becomes a marker string, replaced by its text once dumped
        if isinstance(v, _Raw):
            raws.append(v.data)
            return f"\x00raw{len(raws) - 1}\x00"
        if isinstance(v, list):
            return [swap(x) for x in v]
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        return v

    text = json.dumps(swap(body), ensure_ascii=how != "utf8")
    for i, data in enumerate(raws):
        text = text.replace(f'"\\u0000raw{i}\\u0000"', data.decode())
    if how == "utf8":  # a lone surrogate makes this invalid UTF-8: the server must say so
        return text.encode("utf-8", "surrogatepass")
    return text.encode("ascii" if how == "ascii" else "utf-16" if how == "utf16" else "utf-32")


@st.composite
def generation_requests(draw):
    path = draw(st.sampled_from([GENERATION_ROUTES[0]] * 2 + GENERATION_ROUTES))  # chat: half of them
    body = _base(path)
    fields = CHAT_FIELDS if path == "/v1/chat/completions" else COMPLETION_FIELDS
    # one field changed, sometimes two: the rest stays valid, so the change reaches the engine
    for field in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=2, unique=True)):
        removable = not field.startswith("messages.0.") and field != "extra"
        _set(body, field, _DELETE if removable and draw(st.integers(0, 7)) == 0 else draw(FIELD_VALUES[field]))
    if draw(st.booleans()):
        body["stream"] = True
    how = draw(st.sampled_from(["ascii"] * 6 + ["utf8", "utf8", "utf16", "utf32"]))
    return path, _encode(body, how)


# --------------------------------------------------------------------------- the tests


def _header_safe(s: str) -> bool:  # what h11 lets a client send
    return s == s.strip() and all(32 <= ord(c) < 127 for c in s)


@settings(FUZZ, max_examples=3000)
@given(req=generation_requests())
@example(req=("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": '
                                      b'{"messages": 1}}'))
@example(req=("/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000))
@example(req=("/v1/completions", b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}"))
@example(req=("/completion", b'{"prompt": "x", "n_predict": NaN, "temperature": Infinity}'))
def test_fuzz_generation_requests(fuzzed, req):
    path, content = req
    BUDGETS["generation"].run(req, lambda: fuzzed.send("POST", path, content=content,
                                                       headers={"content-type": "application/json"}))


CONTENT_TYPES = st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded",
                                 "multipart/form-data; boundary=x", "", "application/json; charset=utf-16",
                                 "image/png", "application/json\x7f"])


@settings(FUZZ, max_examples=1000)
@given(path=st.sampled_from(BODY_ROUTES), body=json_values | st.binary(max_size=300),
       content_type=CONTENT_TYPES | plain_text, how=st.sampled_from(["ascii", "utf8", "utf16"]))
@example(path="/v1/chat/completions", body=b"", content_type="application/json", how="ascii")
@example(path="/completion", body=b"\xff\xfe\x00", content_type="application/json", how="ascii")
def test_fuzz_random_bodies_and_content_types(fuzzed, path, body, content_type, how):
    content = body if isinstance(body, bytes) else _encode(body, how)
    headers = {"content-type": content_type} if _header_safe(content_type) else {}
    BUDGETS["bodies"].run((path, content, headers), lambda: fuzzed.send("POST", path, content=content, headers=headers))


ALL_ROUTES = GENERATION_ROUTES + ["/v1/models", "/models", "/health", "/props", "/metrics", "/", "/static/app.js",
                                  "/static/../app.py", "/static/%2e%2e/app.py", "/static/", "/v2/nothing",
                                  "/v1/chat/completions/", "/V1/MODELS", "//health", "/static/\x00",
                                  "/tokenize", "/detokenize", "/apply-template", "/v1/chat/completions/input_tokens",
                                  "/slots", "/slots/0", "/slots/0?action=save", "/slots/0?action=restore",
                                  "/slots/0?action=erase", "/slots/-1?action=save", "/slots/99999999999?action=erase",
                                  "/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/responses",
                                  "/v1/responses/input_tokens"]
METHODS = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
path_strings = st.text(st.characters(min_codepoint=33, max_codepoint=0x10FFFF, exclude_characters="?#"),
                       max_size=20).map(lambda s: "/" + s)


@settings(FUZZ, max_examples=1000)
@given(method=METHODS, path=st.sampled_from(ALL_ROUTES) | path_strings,
       query=st.none() | st.dictionaries(plain_text, plain_text, max_size=3),
       body=st.none() | json_values.map(lambda v: _encode(v, "ascii")) | st.binary(max_size=100),
       auth=st.none() | plain_text)
@example(method="GET", path="/static/..%2f..%2fapp.py", query=None, body=None, auth=None)
@example(method="POST", path="/health", query=None, body=b"{}", auth=None)
def test_fuzz_routes_and_methods(fuzzed, method, path, query, body, auth):
    headers = {"authorization": auth} if auth is not None and _header_safe(auth) else None
    if query:
        path = path + "?" + str(httpx.QueryParams(query))
    BUDGETS["routes"].run((method, path, body, headers),
                          lambda: fuzzed.send(method, path, content=body, headers=headers))


# --------------------------------------------------------------------------- grammars and JSON schemas

# GBNF as llama.cpp's parser reads it: literals, classes, rule names, groups, alternatives and every
# repetition, bounds up to and past its 2,000 "no maximum" line, comments and newlines inside braces
bounds = st.integers(0, 3) | st.integers(0, 2500) | st.just(100_000)
repetitions = st.one_of(st.sampled_from(["", "*", "+", "?"]), bounds.map(lambda m: f"{{{m}}}"),
                        bounds.map(lambda m: f"{{{m},}}"), st.tuples(bounds, bounds).map(lambda t: f"{{{min(t)},{max(t)}}}"),
                        st.just("{ # a comment\n 2 ,\n 3 }"), st.just("{2,1}"), st.just("{"), st.just("{,5}"))
atoms = st.one_of(st.sampled_from(['"x"', '"ab"', "[a-z]", "[^\\n]", ".", "r1", "r2", "root", "undefined", '""',
                                   '"\\u00e9"', "[\\x00-\\U0010FFFF]"]), plain_text.map(json.dumps))
expressions = st.recursive(st.tuples(atoms, repetitions).map("".join), lambda inner: st.one_of(
    st.lists(inner, min_size=1, max_size=4).map(" ".join),
    st.lists(inner, min_size=2, max_size=3).map(" | ".join),
    st.tuples(inner, repetitions).map(lambda t: f"({t[0]}){t[1]}")), max_leaves=10)
grammars = st.one_of(
    st.lists(st.tuples(st.sampled_from(["root", "r1", "r2"]), expressions), min_size=1, max_size=4).map(
        lambda rules: "\n".join(f"{name} ::= {body}" for name, body in rules)),
    st.builds(lambda e, n: "root ::= r0\n" + "".join(f"r{i} ::= {e}\n" for i in range(n)), expressions,
              st.integers(1, 3000)),
    text)

# JSON schemas as json-schema-to-grammar reads them, nested, with junk where a schema goes
schema_leaves = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null", "object",
                                                    "array", "nonsense"])},
                          optional={"minLength": bounds, "maxLength": bounds, "minimum": numbers, "maximum": numbers,
                                    "pattern": st.sampled_from(["^a+$", "[0-9]{2,5}", "(a|b)*c", "(((", "x{99999}"]) | text,
                                    "format": st.sampled_from(["date", "time", "date-time", "uuid", "email", "x"])}),
    st.fixed_dictionaries({"enum": st.lists(json_values, max_size=4)}),
    st.fixed_dictionaries({"const": json_values}),
    st.just({"$ref": "#/$defs/missing"}), st.just({"$ref": "https://example.com/s.json"}), st.just({}), st.just(True),
    json_values)
schemas = st.recursive(schema_leaves, lambda inner: st.one_of(
    st.fixed_dictionaries({"type": st.just("array"), "items": inner},
                          optional={"minItems": bounds, "maxItems": bounds, "prefixItems": st.lists(inner, max_size=3)}),
    st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(plain_text, inner, max_size=5)},
                          optional={"required": st.lists(plain_text, max_size=3) | json_values,
                                    "additionalProperties": st.booleans() | inner}),
    st.builds(lambda key, subs: {key: subs}, st.sampled_from(["anyOf", "oneOf", "allOf"]), st.lists(inner, max_size=3)),
    st.fixed_dictionaries({"$defs": st.fixed_dictionaries({"missing": inner}), "$ref": st.just("#/$defs/missing")}),
    st.integers(1, 400).map(lambda n: {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}})),
    max_leaves=12)


@st.composite
def grammar_requests(draw):
    """A generation request whose grammar, schema, response format or tool parameters are drawn."""
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    kind = draw(st.sampled_from(["grammar", "json_schema", "response_format", "tools", "responses"]))
    if kind == "grammar":
        path, body = draw(st.sampled_from(GENERATION_ROUTES[1:])), {"prompt": "x", "max_tokens": 2,
                                                                   "grammar": draw(grammars)}
    elif kind == "json_schema":
        path, body = "/completion", {"prompt": "x", "n_predict": 2, "json_schema": draw(schemas)}
    elif kind == "response_format":
        path, body = "/v1/chat/completions", {**chat, "response_format": draw(st.one_of(
            st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
                {"name": st.just("x"), "schema": schemas}, optional={"strict": st.booleans()})}),
            st.fixed_dictionaries({"type": st.just("json_object")}, optional={"schema": schemas}), json_values))}
    elif kind == "tools":
        path, body = "/v1/chat/completions", {**chat, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": draw(schemas)}}], "tool_choice": draw(st.sampled_from(["auto", "required"]))}
    else:
        path, body = "/v1/responses", {"input": "Hi", "max_output_tokens": 2, "text": {"format": {
            "type": "json_schema", "name": "x", "schema": draw(schemas)}}}
    if draw(st.booleans()):
        body["stream"] = True
    return path, _encode(body, "ascii")


@settings(FUZZ, max_examples=1000)
@given(req=grammar_requests())
@example(req=("/completion", json.dumps({"prompt": "x", "n_predict": 2, "grammar": "root ::= r0\n" + "".join(
    f'r{i} ::= "x"{{0,2000}}\n' for i in range(11800))}).encode()))
@example(req=("/completion", json.dumps({"prompt": "x", "n_predict": 2, "json_schema": {
    "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20000)}}}).encode()))
@example(req=("/v1/chat/completions", json.dumps({  # the chat template's grammar: x{1330,110}, never parsed to an end
    "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "array", "items": {"type": "string"}, "minItems": 1331, "maxItems": 111}}}}).encode()))
@example(req=("/v1/chat/completions", json.dumps({
    "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "tool_choice": "required", "tools": [{
        "type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": ["a"],
                                                                     "properties": {"a": {"type": "string", "minLength": 9, "maxLength": 3}}}}}]}).encode()))
def test_fuzz_grammars_and_json_schemas(fuzzed, req):
    """Issue 43: no grammar or schema, however costly to convert or expand, gets a 5xx, kills the
    server or keeps /health waiting (each request is followed by /health, answered within
    HEALTH_TIMEOUT)."""
    path, content = req
    BUDGETS["grammars"].run(req, lambda: fuzzed.send("POST", path, content=content,
                                                     headers={"content-type": "application/json"}))
