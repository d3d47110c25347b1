"""`pyllama-spec serve --models-preset FILE` without -m: llama-server's router, started as a user
starts it (a subprocess), each model a `serve` process of its own.

The presets use the tiny models of conftest (tiny_dense with its draft and projector, the hybrid
tiny_hybrid target); every router listens on 127.0.0.1 on a free port, and each test that stops
one checks that no child outlives it. Where llama-server is built, GET /models is compared with
llama-server's own router on the same preset.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from conftest import FIELD_REPORT, LLAMA_SERVER, N_THREADS, field_report_preset, needs_llama_server

httpx = pytest.importorskip("httpx", reason="the test extra brings httpx")
openai = pytest.importorskip("openai", reason="the test extra brings the openai client")
pytest.importorskip("uvicorn", reason="the server extra brings uvicorn")

from pyllama_spec.devtools.rpc_server import free_port

CHAT = [{"role": "user", "content": "write a function"}]


def _serve_command() -> list[str]:
    return [sys.executable, "-m", "pyllama_spec.cli", "serve"]


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _child_of_model(router_pid: int, name: str) -> int:
    for pid in _children(router_pid):
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--alias" in args and args[args.index(b"--alias") + 1] == name.encode():
            return pid
    raise AssertionError(f"no child serves {name}")


def _until(predicate, within: float, what: str, every: float = 0.05):
    deadline = time.monotonic() + within
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within} s")
        time.sleep(every)


class Served:
    """A `pyllama-spec serve` process on a free port (its output in a file in ``folder``);
    ``stop()`` sends SIGTERM."""

    def __init__(self, args: list[str], folder: Path, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        fd, self.log = tempfile.mkstemp(prefix="serve-", suffix=".log", dir=folder)
        with os.fdopen(fd, "w") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen([*_serve_command(), *args, "--port", str(self.port)], stdout=log,
                                         stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 90
        while True:
            assert self.proc.poll() is None, f"serve exited {self.proc.returncode}:\n{self.output()}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve did not come up"
            time.sleep(0.1)

    def output(self) -> str:
        return Path(self.log).read_text(errors="replace")

    def models(self, **headers) -> dict:
        r = httpx.get(self.url + "/models", headers=headers, timeout=10)
        assert r.status_code == 200, r.text
        return {m["id"]: m for m in r.json()["data"]}

    def status(self, name: str) -> dict:
        return self.models()[name]["status"]

    def wait_status(self, name: str, value: str, within: float = 60) -> dict:
        return _until(lambda: (s := self.status(name))["value"] == value and s, within, f"{name} {value}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)


def _section(name: str, **keys) -> str:
    return f"[{name}]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items())


@pytest.fixture(scope="module")
def preset(tiny_dense, tiny_hybrid, tmp_path_factory) -> Path:
    """Three working models and one that cannot load (its model file is not a GGUF)."""
    folder = tmp_path_factory.mktemp("router")
    broken = folder / "broken.gguf"
    broken.write_bytes(b"this is not a GGUF file\n" * 10)
    path = folder / "models.ini"
    path.write_text(
        f"version = 1\n[*]\nthreads = {N_THREADS}\nctx-size = 2048\nbatch-size = 64\nubatch-size = 64\n"
        "no-warmup = true\n\n"
        + _section("dense", model=tiny_dense.target, **{"model-draft": tiny_dense.draft}, mmproj=tiny_dense.mmproj,
                   **{"spec-draft-n-max": 7}, alias="tiny,tiny-vl", tags="vision, dflash")
        + _section("hybrid", model=tiny_hybrid.target, **{"load-on-startup": "true"})
        + _section("long", model=tiny_dense.target, c=8192, **{"stop-timeout": 5})
        + _section("broken", model=broken))
    return path


@pytest.fixture(scope="module")
def router(preset):
    served = Served(["--models-preset", str(preset)], preset.parent)
    yield served
    pid = served.proc.pid
    kids = _children(pid)
    served.stop()
    assert not [k for k in kids if _alive(k)], "a child outlived its router"


@pytest.fixture(scope="module")
def single(tiny_dense, preset):
    """The dense section's model served alone, with the same arguments."""
    served = Served(["--threads", str(N_THREADS), "--ctx-size", "2048", "--batch-size", "64", "--ubatch-size", "64",
                     "-m", str(tiny_dense.target), "-md", str(tiny_dense.draft), "--mmproj", str(tiny_dense.mmproj),
                     "--spec-draft-n-max", "7", "--alias", "dense"], preset.parent)
    yield served
    served.stop()


def _post(base: str, path: str, body, **kw) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=120, **kw)


# --------------------------------------------------------------------------- listing


def test_get_models_lists_every_preset_model_with_llama_servers_fields(router, preset):
    models = router.models()
    assert list(models) == ["broken", "dense", "hybrid", "long"]  # by name, as llama-server's map
    dense = models["dense"]
    assert (dense["aliases"], dense["tags"], dense["source"], dense["can_remove"]) == \
        (["tiny", "tiny-vl"], ["dflash", "vision"], "preset", False)  # sorted, as llama-server's sets
    assert dense["architecture"] == {"input_modalities": ["text", "image"], "output_modalities": ["text"]}
    assert models["long"]["architecture"]["input_modalities"] == ["text"]
    status = dense["status"]
    assert status["value"] in ("unloaded", "loading", "loaded")
    assert status["args"][-6:-2] == ["--host", "127.0.0.1", "--port", status["args"][-3]]
    assert status["args"][-2:] == ["--alias", "dense"]
    assert "model-draft = " in status["preset"] and "alias" not in status["preset"]
    # load-on-startup: loading at once, then loaded, with what the child knows of itself
    hybrid = router.wait_status("hybrid", "loaded")
    assert hybrid["value"] == "loaded"
    entry = router.models()["hybrid"]
    assert entry["meta"]["n_ctx"] == 2048 and entry["owned_by"] == "pyllama-spec"
    assert [m["id"] for m in httpx.get(router.url + "/v1/models").json()["data"]] == list(models)


def test_router_props_health_and_unknown_routes(router):
    props = httpx.get(router.url + "/props").json()
    assert (props["role"], props["max_instances"], props["models_autoload"]) == ("router", 4, True)
    assert httpx.get(router.url + "/health").json() == {"status": "ok"}
    assert httpx.get(router.url + "/no/such/route").status_code == 404
    # a model's own /props, by ?model=
    r = httpx.get(router.url + "/props", params={"model": "hybrid"}, timeout=60)
    assert r.status_code == 200 and r.json()["model_alias"] == "hybrid"


# --------------------------------------------------------------------------- routing


def test_requests_are_routed_by_name_and_answer_as_the_model_served_alone(router, single):
    """The same request to the router (by the section's name, or an alias) and to `serve` of the
    same model alone: the same text, tokens and usage."""
    completion = {"prompt": "def add(a, b):", "n_predict": 12, "temperature": 0, "return_tokens": True,
                  "cache_prompt": False}
    ours = _post(router.url, "/completion", {**completion, "model": "dense"})
    alone = _post(single.url, "/completion", completion)
    assert ours.status_code == alone.status_code == 200, ours.text
    a, b = ours.json(), alone.json()
    assert (a["content"], a["tokens"], a["tokens_evaluated"]) == (b["content"], b["tokens"], b["tokens_evaluated"])
    chat = {"messages": CHAT, "max_tokens": 10, "temperature": 0}
    ours = _post(router.url, "/v1/chat/completions", {**chat, "model": "tiny-vl"})
    alone = _post(single.url, "/v1/chat/completions", chat)
    assert ours.status_code == 200, ours.text
    a, b = ours.json(), alone.json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"] and a["usage"] == b["usage"]
    assert a["model"] == "dense"  # the child knows the model by its section's name
    # another model answers for itself
    r = _post(router.url, "/v1/completions", {"model": "hybrid", "prompt": "x", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["model"] == "hybrid"


@pytest.mark.parametrize("stream", [False, True])
def test_the_openai_client_gets_the_single_servers_answers_streamed_or_not(router, single, stream):
    ours = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    alone = openai.OpenAI(base_url=single.url + "/v1", api_key="none", max_retries=0)

    def text(client) -> str:
        reply = client.chat.completions.create(model="dense", messages=CHAT, max_tokens=12, temperature=0,
                                               stream=stream)
        if not stream:
            return reply.choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in reply if c.choices)

    assert text(ours) == text(alone) != ""
    assert [m.id for m in ours.models.list()] == ["broken", "dense", "hybrid", "long"]


def test_a_stream_arrives_as_it_is_generated_not_at_the_end(router):
    body = {"model": "long", "prompt": "x", "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    arrivals = []
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
    assert len(arrivals) > 100
    assert arrivals[len(arrivals) // 2] - arrivals[0] > 0.05  # spread over the generation, not one burst


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("body,message", [
    ({"model": "nope", "messages": CHAT}, "model 'nope' not found"),
    ({"messages": CHAT}, "model name is missing from the request"),
    ({"model": 7, "messages": CHAT}, "model name is missing from the request"),
])
def test_an_unknown_or_missing_model_is_a_400_as_in_llama_server(router, body, message):
    r = _post(router.url, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["message"] == message
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_a_get_names_its_model_in_the_query(router):
    assert httpx.get(router.url + "/metrics").status_code == 400
    r = httpx.get(router.url + "/metrics", params={"model": "hybrid"}, timeout=60)
    assert r.status_code == 200 and "pyllama_spec_busy" in r.text


def test_a_model_that_fails_to_load_says_why_and_the_others_keep_working(router):
    r = _post(router.url, "/v1/chat/completions", {"model": "broken", "messages": CHAT, "max_tokens": 2})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    message = r.json()["error"]["message"]
    assert message.startswith("model name=broken failed to load") and "GGUF" in message, message
    status = router.status("broken")
    assert status["value"] == "unloaded" and status["failed"] is True and status["exit_code"] != 0
    assert "GGUF" in status["reason"]
    ok = _post(router.url, "/v1/chat/completions", {"model": "hybrid", "messages": CHAT, "max_tokens": 2})
    assert ok.status_code == 200


def test_a_body_over_the_limit_is_refused_before_it_is_read_and_a_slow_one_holds_up_nobody(router):
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n{"
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
        sock.sendall(head % (65 * 2**20))
        assert sock.recv(100).startswith(b"HTTP/1.1 413 ")
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as slow:
        slow.sendall(head % 1000)  # and the rest never comes
        t0 = time.monotonic()
        r = _post(router.url, "/completion", {"model": "hybrid", "prompt": "x", "n_predict": 2})
        assert r.status_code == 200 and time.monotonic() - t0 < 10
    r = httpx.post(router.url + "/v1/chat/completions", content=b"[" * 200_000 + b"]" * 200_000, timeout=30)
    assert r.status_code == 400 and "arrays and objects" in r.json()["error"]["message"]


# --------------------------------------------------------------------------- load, unload, events


def test_load_and_unload_answer_as_llama_server(router):
    if router.status("long")["value"] != "unloaded":
        assert _post(router.url, "/models/unload", {"model": "long"}).json() == {"success": True}
        router.wait_status("long", "unloaded")
    r = _post(router.url, "/models/unload", {"model": "long"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "model is not running"
    assert _post(router.url, "/models/load", {"model": "long"}).json() == {"success": True}
    assert router.status("long")["value"] in ("loading", "loaded")
    r = _post(router.url, "/models/load", {"model": "long"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "model is already running"
    router.wait_status("long", "loaded")
    assert _post(router.url, "/models/unload", {"model": "long"}).json() == {"success": True}
    status = router.wait_status("long", "unloaded")
    assert "failed" not in status  # a clean stop
    r = _post(router.url, "/models/load", {"model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["message"] == "model is not found"
    r = _post(router.url, "/models/unload", {"model": "nope"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "model is not found"
    # autoload off for one request: an unloaded model is not started
    r = httpx.post(router.url + "/v1/chat/completions", params={"autoload": "false"},
                   json={"model": "long", "messages": CHAT}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"] == "model is not loaded"
    assert router.status("long")["value"] == "unloaded"


def test_models_sse_reports_each_status_change(router):
    if router.status("long")["value"] != "unloaded":
        _post(router.url, "/models/unload", {"model": "long"})
        router.wait_status("long", "unloaded")
    events = []
    with httpx.stream("GET", router.url + "/models/sse", timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert _post(router.url, "/models/load", {"model": "long"}).status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if events[-1]["data"]["status"] == "loaded":
                    break
    assert events[0] == {"model": "long", "event": "model_status", "data": {"status": "loading"}}
    assert events[-1]["event"] == "status_change" and events[-1]["data"]["info"]["id"] == "long"


# --------------------------------------------------------------------------- children that go wrong


def test_a_child_killed_with_sigkill_is_reported_failed_and_the_next_request_starts_it_again(router):
    assert _post(router.url, "/completion", {"model": "long", "prompt": "x", "n_predict": 2}).status_code == 200
    os.kill(_child_of_model(router.proc.pid, "long"), signal.SIGKILL)
    status = router.wait_status("long", "unloaded", within=10)
    assert status["failed"] is True and status["exit_code"] == -signal.SIGKILL
    assert _post(router.url, "/completion", {"model": "hybrid", "prompt": "x", "n_predict": 2}).status_code == 200
    again = _post(router.url, "/completion", {"model": "long", "prompt": "x", "n_predict": 2})
    assert again.status_code == 200 and router.status("long")["value"] == "loaded"


def test_a_request_whose_child_crashes_under_it_gets_a_clear_error(router):
    _post(router.url, "/completion", {"model": "long", "prompt": "x", "n_predict": 1})  # loaded
    body = {"model": "long", "prompt": "x", "max_tokens": 6000, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(_post, router.url, "/v1/completions", body)
        _until(lambda: _busy(router, "long") == 1, 30, "generating")
        os.kill(_child_of_model(router.proc.pid, "long"), signal.SIGKILL)
        r = answer.result(timeout=30)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert r.json()["error"]["message"].startswith(f"model name=long exited with status {-signal.SIGKILL}")


def _generated(router, model: str) -> float:
    r = httpx.get(router.url + "/metrics", params={"model": model, "autoload": "false"}, timeout=10)
    assert r.status_code == 200, r.text  # the same child, not a new one
    return float(re.search(r"^pyllama_spec_generated_tokens_total (\S+)$", r.text, re.MULTILINE).group(1))


def _busy(router, model: str) -> int:
    r = httpx.get(router.url + "/metrics", params={"model": model, "autoload": "false"}, timeout=10)
    assert r.status_code == 200, r.text  # the same child, still running
    return int(float(re.search(r"^pyllama_spec_busy (\S+)$", r.text, re.MULTILINE).group(1)))


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_stops_the_childs_generation(router, stream):
    body = {"model": "long", "prompt": "x", "max_tokens": 6000, "temperature": 0, "ignore_eos": True, "stream": stream}
    _post(router.url, "/completion", {"model": "long", "prompt": "x", "n_predict": 1})  # loaded
    before = _generated(router, "long")
    if stream:
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as r:
            next(ln for ln in r.iter_lines() if '"text"' in ln)  # generating now
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(router.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    _until(lambda: _busy(router, "long") == 0, 10, "the child still generates for a client that left")
    assert _generated(router, "long") - before < 6000


# --------------------------------------------------------------------------- limits and keys


def test_models_max_evicts_the_least_recently_used_idle_model_never_a_busy_one(tiny_dense, tmp_path):
    path = tmp_path / "three.ini"
    path.write_text(f"[*]\nthreads = {N_THREADS}\nctx-size = 4096\nno-warmup = true\n"
                    + "".join(_section(n, model=tiny_dense.target) for n in ("a", "b", "c")))
    served = Served(["--models-preset", str(path), "--models-max", "2"], tmp_path)
    try:
        def ask(name: str, **more) -> httpx.Response:
            r = _post(served.url, "/completion", {"model": name, "prompt": "x", "n_predict": 2, **more})
            assert r.status_code == 200, r.text
            return r

        ask("a"), ask("b"), ask("a")  # b is now the least recently used
        ask("c")
        values = {n: m["status"]["value"] for n, m in served.models().items()}
        assert values == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        assert "failed" not in served.status("b")  # stopped, not crashed
        # /models/load at the limit: the least recently used idle one (a) makes room
        assert _post(served.url, "/models/load", {"model": "b"}).json() == {"success": True}
        served.wait_status("b", "loaded")
        assert served.status("a")["value"] == "unloaded" and served.status("c")["value"] == "loaded"
        # a model answering a request is never evicted, even the least recently used: c streams
        # (it was asked before b), and a's request stops b
        long = {"model": "c", "prompt": "x", "max_tokens": 3500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", served.url + "/v1/completions", json=long, timeout=120) as stream:
            lines = stream.iter_lines()
            next(ln for ln in lines if '"text"' in ln)
            ask("b")
            assert _busy(served, "c") == 1
            ask("a")
            assert _busy(served, "c") == 1  # still generating: it was never stopped
            assert '"text"' in next(ln for ln in lines if ln)  # and its stream goes on
        values = {n: m["status"]["value"] for n, m in served.models().items()}
        assert values == {"a": "loaded", "b": "unloaded", "c": "loaded"}
    finally:
        served.stop()


def test_the_router_checks_the_api_key_and_its_children_take_only_their_own(tiny_dense, tmp_path):
    path = tmp_path / "keyed.ini"
    path.write_text(_section("m", model=tiny_dense.target, threads=N_THREADS, c=1024))
    served = Served(["--models-preset", str(path), "--api-key", "s3cret"], tmp_path)
    try:
        assert httpx.get(served.url + "/health").status_code == 200
        assert httpx.get(served.url + "/models").status_code == 401
        r = _post(served.url, "/v1/chat/completions", {"model": "m", "messages": CHAT, "max_tokens": 2})
        assert r.status_code == 401
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="s3cret", max_retries=0)
        assert client.chat.completions.create(model="m", messages=CHAT, max_tokens=2).choices
        status = served.models(Authorization="Bearer s3cret")["m"]["status"]
        child = f"http://127.0.0.1:{status['args'][status['args'].index('--port') + 1]}"
        for key in (None, "s3cret"):  # the router's key does not open a child either
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = _post(child, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}, headers=headers)
            assert r.status_code == 401
    finally:
        served.stop()


# A stand-in for a model's process that ignores SIGTERM: `serve` itself always stops when asked,
# so only a stand-in shows the router's stop-timeout at work. It answers /health and /v1/models.
_STUBBORN_CHILD = """
import http.server, json, signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
port = int(sys.argv[sys.argv.index("--port") + 1])

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"status": "ok"} if self.path == "/health" else {"data": [{"id": "m"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def test_a_model_that_ignores_sigterm_is_killed_after_its_stop_timeout(tmp_path):
    from pyllama_spec.server.router.app import create_router_app
    from pyllama_spec.server.router.pool import ModelSpec, RouterSettings
    from pyllama_spec.server.run import make_server

    script = tmp_path / "stubborn.py"
    script.write_text(_STUBBORN_CHILD)
    app = create_router_app([ModelSpec("m", (), stop_timeout=1.5)],
                            RouterSettings(child_command=(sys.executable, str(script))))
    port = free_port()
    server = make_server(app, host="127.0.0.1", port=port, log_level="error")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        _until(lambda: server.started, 30, "the router started")
        assert _post(url, "/models/load", {"model": "m"}).json() == {"success": True}
        _until(lambda: httpx.get(url + "/models").json()["data"][0]["status"]["value"] == "loaded", 30, "loaded")
        t0 = time.monotonic()
        assert _post(url, "/models/unload", {"model": "m"}).json() == {"success": True}
        assert httpx.get(url + "/models").json()["data"][0]["status"]["value"] == "loaded"  # still stopping
        status = _until(lambda: (s := httpx.get(url + "/models").json()["data"][0]["status"])["value"] == "unloaded"
                        and s, 30, "unloaded")
        assert 1.5 <= time.monotonic() - t0 < 6
        # as in llama-server, a model that had to be killed shows failed
        assert status["failed"] is True and status["exit_code"] == -signal.SIGKILL
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert not thread.is_alive()


# --------------------------------------------------------------------------- reloading the preset


def _reload(served: Served) -> httpx.Response:
    """llama-server's reload: GET /models?reload=1 (any value) reads the preset file again."""
    return httpx.get(served.url + "/models", params={"reload": "1"}, timeout=60)


def _reload_preset(*sections: str) -> str:
    return f"[*]\nthreads = {N_THREADS}\nctx-size = 1024\nno-warmup = true\n\n" + "".join(sections)


def test_reload_removes_keeps_and_adds_models_as_the_preset_file_now_says(tiny_dense, tiny_hybrid, tmp_path):
    path = tmp_path / "reload.ini"
    path.write_text(_reload_preset(_section("a", model=tiny_dense.target),
                                   _section("b", model=tiny_hybrid.target, alias="bee")))
    served = Served(["--models-preset", str(path)], tmp_path)
    try:
        for name in ("a", "b"):
            assert _post(served.url, "/models/load", {"model": name}).json() == {"success": True}
            served.wait_status(name, "loaded")
        a_pid, b_pid = _child_of_model(served.proc.pid, "a"), _child_of_model(served.proc.pid, "b")
        # a removed; b kept (a new alias only: its process is the same); c added, and d, a Hub model
        path.write_text(_reload_preset(_section("b", model=tiny_hybrid.target, alias="bee,bz"),
                                       _section("c", model=tiny_dense.target),
                                       _section("d", **{"hf-repo": "ggml-org/test-model-stories260K"})))
        with httpx.stream("GET", served.url + "/models/sse", timeout=60) as events:
            r = _reload(served)
            assert r.status_code == 200, r.text
            seen = [json.loads(ln[6:]) for ln in itertools.takewhile(lambda ln: "models_reload" not in ln,
                                                                     events.iter_lines()) if ln.startswith("data: ")]
        assert {"model": "a", "event": "status_change", "data": {"status": "unloaded", "exit_code": 0}} in seen
        listed = {m["id"]: m for m in r.json()["data"]}
        assert list(listed) == ["b", "c", "d"] and list(served.models()) == ["b", "c", "d"]
        assert not _alive(a_pid), "the removed model's process still runs"
        assert listed["b"]["status"]["value"] == "loaded" and listed["b"]["aliases"] == ["bee", "bz"]
        assert _child_of_model(served.proc.pid, "b") == b_pid  # never restarted
        assert listed["c"]["status"]["value"] == listed["d"]["status"]["value"] == "unloaded"
        # requests follow the new list
        r = _post(served.url, "/completion", {"model": "a", "prompt": "x", "n_predict": 2})
        assert r.status_code == 400 and r.json()["error"]["message"] == "model 'a' not found"
        for name in ("bz", "c"):
            r = _post(served.url, "/completion", {"model": name, "prompt": "x", "n_predict": 2})
            assert r.status_code == 200, r.text
        r = _post(served.url, "/completion", {"model": "d", "prompt": "x", "n_predict": 2})
        assert r.status_code == 500 and "nothing is downloaded here" in r.json()["error"]["message"]
    finally:
        served.stop()


def test_a_preset_that_cannot_be_served_on_reload_is_a_500_and_the_models_stay(tiny_dense, tiny_hybrid, tmp_path):
    path = tmp_path / "reload.ini"
    good = _reload_preset(_section("a", model=tiny_dense.target),
                          _section("b", model=tiny_hybrid.target))
    path.write_text(good)
    served = Served(["--models-preset", str(path)], tmp_path)
    try:
        assert _post(served.url, "/models/load", {"model": "b"}).json() == {"success": True}
        served.wait_status("b", "loaded")
        b_pid = _child_of_model(served.proc.pid, "b")
        broken = {"[a\nmodel = x\n": "not an INI file", "[a]\nno-such-key = 1\n": "no-such-key",
                  "[a]\nctx-size = 64\n": "gives no model file",
                  _reload_preset(_section("a", model=tiny_dense.target, alias="b"),
                                 _section("b", model=tiny_hybrid.target)): "alias 'b' of model 'a' is already the name"}
        for text, message in broken.items():
            path.write_text(text)
            r = _reload(served)
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
            assert message in r.json()["error"]["message"]
            assert list(served.models()) == ["a", "b"]
        path.unlink()
        r = _reload(served)
        assert r.status_code == 500 and "cannot read the preset file" in r.json()["error"]["message"]
        # the server went on serving, b's process untouched; a good file is read again
        assert _post(served.url, "/completion", {"model": "b", "prompt": "x", "n_predict": 2}).status_code == 200
        assert _child_of_model(served.proc.pid, "b") == b_pid
        path.write_text(good + _section("e", model=tiny_dense.target))
        assert [m["id"] for m in _reload(served).json()["data"]] == ["a", "b", "e"]
    finally:
        served.stop()


def test_a_reload_while_a_model_loads_keeps_it_or_restarts_it_with_the_new_arguments(tiny_dense, tmp_path):
    path = tmp_path / "reload.ini"
    path.write_text(_reload_preset(_section("a", model=tiny_dense.target)))
    served = Served(["--models-preset", str(path)], tmp_path)
    try:
        # unchanged: the loading process is kept and finishes loading
        assert _post(served.url, "/models/load", {"model": "a"}).json() == {"success": True}
        pid = _until(lambda: next(iter(_children(served.proc.pid)), None), 10, "a's process")
        r = _reload(served)
        # (loading, unless the child was quicker than this test: the process kept is what counts)
        assert r.status_code == 200 and r.json()["data"][0]["status"]["value"] in ("loading", "loaded")
        served.wait_status("a", "loaded")
        assert _child_of_model(served.proc.pid, "a") == pid
        # changed while a request waits for it to load: stopped, started again with the new
        # arguments, and the request answered
        assert _post(served.url, "/models/unload", {"model": "a"}).json() == {"success": True}
        served.wait_status("a", "unloaded")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(_post, served.url, "/completion", {"model": "a", "prompt": "x", "n_predict": 2})
            _until(lambda: served.status("a")["value"] == "loading", 30, "a loading")
            path.write_text(_reload_preset(_section("a", model=tiny_dense.target, c=512)))
            r = _reload(served)
            assert r.status_code == 200, r.text
            assert "failed" not in r.json()["data"][0]["status"]  # stopped by the reload, not crashed
            assert answer.result(timeout=60).status_code == 200
        args = served.status("a")["args"]
        assert ("--ctx-size", "512") in zip(args, args[1:])  # the section's value, after [*]'s 1024
    finally:
        served.stop()


# --------------------------------------------------------------------------- shutdown


def test_sigterm_stops_every_child_and_a_killed_router_leaves_none_behind(tiny_dense, tiny_hybrid, tmp_path):
    path = tmp_path / "two.ini"
    path.write_text(f"[*]\nthreads = {N_THREADS}\nc = 1024\nload-on-startup = true\n"
                    + _section("x", model=tiny_dense.target) + _section("y", model=tiny_hybrid.target))
    for how in (signal.SIGTERM, signal.SIGKILL):
        served, kids = Served(["--models-preset", str(path)], tmp_path), []
        try:
            served.wait_status("x", "loaded")
            served.wait_status("y", "loaded")
            kids = _children(served.proc.pid)
            assert len(kids) == 2
            # a stream in flight when the router is told to stop
            stream = httpx.stream("POST", served.url + "/v1/completions", timeout=60,
                                  json={"model": "x", "prompt": "x", "max_tokens": 900, "ignore_eos": True,
                                        "stream": True})
            with stream as r:
                lines = r.iter_lines()
                next(ln for ln in lines if '"text"' in ln)
                t0 = time.monotonic()
                served.proc.send_signal(how)
                with contextlib.suppress(httpx.HTTPError):  # cut short (SIGKILL) or ended: it does not hang
                    list(lines)
            served.proc.wait(timeout=30)
            # SIGTERM: the router stops them; SIGKILL: each child sees its stdin close and goes
            _until(lambda kids=kids: not any(_alive(k) for k in kids), 20, f"children left after {how.name}")
            assert time.monotonic() - t0 < 20
        finally:
            served.stop()
            for k in kids:  # only when the test failed: no process of ours left behind
                if _alive(k):
                    os.kill(k, signal.SIGKILL)


# --------------------------------------------------------------------------- the field report, llama-server


def _field_report_preset(tiny) -> str:
    """The field report's preset, its files replaced by the tiny trio and its sizes by ones this
    machine holds (a bf16 cache: q8_0 blocks of 32 do not divide the tiny target's head width)."""
    lines = field_report_preset().splitlines()
    replace = {"model": tiny.target, "model-draft": tiny.draft, "mmproj": tiny.mmproj, "ctx-size": 2048,
               "cache-type-k": "bf16", "cache-type-v": "bf16", "batch-size": 512}
    out = []
    for line in lines:
        key = line.split("=", 1)[0].strip()
        if key in ("device", "spec-draft-device"):
            continue  # CUDA0 need not exist here
        out.append(f"{key} = {replace[key]}" if key in replace else line)
    return "\n".join(out) + f"\nthreads = {N_THREADS}\n"


def test_the_field_reports_preset_is_served_as_a_router(tiny_dense, tmp_path):
    if not FIELD_REPORT.exists():
        pytest.skip(f"the team's field report is not here ({FIELD_REPORT})")
    path = tmp_path / "field.ini"
    path.write_text(_field_report_preset(tiny_dense))
    served = Served(["--models-preset", str(path)], tmp_path)
    try:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list()] == ["Qwen3.8-27B Q5"]
        reply = client.chat.completions.create(model="Qwen3.8-27B Q5", messages=CHAT, max_tokens=8)
        assert reply.usage.completion_tokens > 0 and reply.model == "Qwen3.8-27B Q5"
        entry = served.models()["Qwen3.8-27B Q5"]
        assert entry["status"]["value"] == "loaded" and entry["meta"]["speculative"] == "draft-dflash"
        assert entry["architecture"]["input_modalities"] == ["text", "image"]
    finally:
        served.stop()
    log = served.output()
    for dropped in ("--fit-target 2000", "--mmproj-device CUDA1", "--threads-http 5"):
        assert f"[Qwen3.8-27B Q5] warning: ignored {dropped}" in log  # the child's warnings, passed on


@needs_llama_server
def test_get_models_has_the_shape_of_llama_servers_router_on_the_same_preset(tiny_dense, tiny_hybrid, tmp_path):
    path = tmp_path / "both.ini"
    path.write_text("version = 1\n[*]\nc = 1024\n"
                    + _section("dense", model=tiny_dense.target, mmproj=tiny_dense.mmproj, alias="d1,d2",
                               tags="small, test", **{"stop-timeout": 3}, threads=N_THREADS)
                    + _section("hybrid", model=tiny_hybrid.target, **{"load-on-startup": "true"},
                               threads=N_THREADS))
    theirs_port = free_port()
    cache = tmp_path / "cache"  # llama-server also lists its download cache: an empty one here
    cache.mkdir()
    theirs = subprocess.Popen([str(LLAMA_SERVER), "--models-preset", str(path), "--port", str(theirs_port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "LLAMA_CACHE": str(cache)})
    ours = Served(["--models-preset", str(path)], tmp_path)
    theirs_url = f"http://127.0.0.1:{theirs_port}"
    try:
        def loaded(url):
            try:
                data = httpx.get(url + "/models", timeout=5).json()["data"]
            except (httpx.HTTPError, ValueError):
                return None
            return data if {m["id"]: m["status"]["value"] for m in data}.get("hybrid") == "loaded" else None

        a = _until(lambda: loaded(ours.url), 60, "our hybrid loaded")
        b = _until(lambda: loaded(theirs_url), 60, "llama-server's hybrid loaded")
        assert [m["id"] for m in a] == [m["id"] for m in b]
        for x, y in zip(a, b, strict=True):
            assert set(y) <= set(x), set(y) - set(x)
            assert set(y["status"]) <= set(x["status"])
            for key in ("aliases", "tags", "object", "architecture", "source", "can_remove"):
                assert x[key] == y[key], key
            assert x["status"]["value"] == y["status"]["value"]
            assert x["status"]["args"][-2:] == ["--alias", x["id"]]
            assert set(y.get("meta", {})) - set(x.get("meta", {})) <= {"vocab_type", "ftype"}
        # the same errors for the same mistakes
        for body in ({"model": "nope", "messages": CHAT}, {"messages": CHAT}):
            r1, r2 = _post(ours.url, "/v1/chat/completions", body), _post(theirs_url, "/v1/chat/completions", body)
            assert r1.status_code == r2.status_code == 400
            assert r1.json()["error"]["message"] == r2.json()["error"]["message"]
        for path_, body in (("/models/load", {"model": "hybrid"}), ("/models/unload", {"model": "dense"}),
                            ("/models/load", {"model": "nope"}), ("/models/unload", {"model": "nope"})):
            r1, r2 = _post(ours.url, path_, body), _post(theirs_url, path_, body)
            assert r1.status_code == r2.status_code, (path_, body, r1.text, r2.text)
            assert r1.json()["error"]["type"] == r2.json()["error"]["type"]
        p1, p2 = httpx.get(ours.url + "/props").json(), httpx.get(theirs_url + "/props").json()
        assert set(p1) == set(p2) and (p1["role"], p1["max_instances"]) == (p2["role"], p2["max_instances"])
    finally:
        ours.stop()
        theirs.terminate()
        theirs.wait(timeout=30)


def test_a_page_the_router_allows_is_served_by_the_model_too(router):
    """The router checks a browser's Origin and Sec-Fetch-Site; its model's process sees neither (it
    would judge them against its own address and refuse a page the router allowed)."""
    headers = {"Origin": "http://localhost:5173", "Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "cors"}
    r = httpx.post(router.url + "/completion", json={"model": "hybrid", "prompt": "x", "n_predict": 2},
                   headers=headers, timeout=120)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:5173", r.text
    refused = httpx.post(router.url + "/completion", json={"model": "hybrid", "prompt": "x", "n_predict": 2},
                         headers={**headers, "Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"},
                         timeout=120)
    assert refused.status_code == 403
