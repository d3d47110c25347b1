"""``serve``'s banner, names and logging flags, as a user starts it: the banner names the chat page;
``-a`` gives the model several names and ``--tags`` its tags, as llama-server lists them; ``-v``
logs each request (method, path, client, status, then the bodies) and llama.cpp's own log, to
standard error and ``--log-file``; by default (``-lv 3``) no request is logged, as llama-server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from pyllama_spec.devtools.servers import running_server

pytest.importorskip("uvicorn", reason="the server needs the 'server' extra")
REPO = Path(__file__).resolve().parent.parent


def _serve(*args: str, log: Path, host: str | None = "127.0.0.1"):
    """``python -m pyllama_spec serve -t 1 ARGS`` from this checkout (as ``pyllama-spec serve``), its standard
    error in ``log``: a context yielding its URL (host None: ARGS give --host)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return running_server([sys.executable, "-m", "pyllama_spec", "serve", "-t", "1", *args], log=log, host=host,
                          env=env, cwd=REPO)


def _chat(url: str) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "def f():"}], "max_tokens": 4}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200


def test_verbose_logs_each_request_with_its_bodies_to_stderr_and_the_log_file(tmp_path):
    stderr, log_file = tmp_path / "stderr.txt", tmp_path / "serve.log"
    with _serve("-v", "--log-file", str(log_file), log=stderr) as url:
        _chat(url)
        urllib.request.urlopen(url + "/health", timeout=5).read()
    port = url.rsplit(":", 1)[1]
    for text in (stderr.read_text(), log_file.read_text()):
        assert "done request: POST /v1/chat/completions 127.0.0.1 200" in text
        assert 'request:  {"messages": [{"role": "user", "content": "def f():"}]' in text
        assert 'response: {"id":"chatcmpl-' in text and '"object":"chat.completion"' in text
        assert "GET /health" not in text  # polled routes are left out, as llama-server leaves them
    assert "llama_model_loader" in log_file.read_text() or "llama_context" in log_file.read_text()  # llama.cpp's log
    assert f"chat page http://127.0.0.1:{port}/ · API http://127.0.0.1:{port}/v1" in stderr.read_text()


def test_by_default_no_request_is_logged(tmp_path):
    stderr = tmp_path / "stderr.txt"
    with _serve(log=stderr) as url:
        _chat(url)
    assert "done request" not in stderr.read_text() and "llama_model_loader" not in stderr.read_text()


def test_an_unwritable_log_file_is_a_clear_error(tmp_path):
    res = subprocess.run([sys.executable, "-m", "pyllama_spec", "serve", "--log-file", str(tmp_path / "no" / "x.log")],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--log-file" in res.stderr and "cannot write the log there" in res.stderr


def test_several_aliases_and_tags_as_llama_server_lists_them(tmp_path):
    with _serve("-a", "tiny-coder, Coder,tiny-coder", "--tags", "code, small", log=tmp_path / "e.txt") as url:
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
            entry = json.load(r)["data"][0]
        body = json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}).encode()
        req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            model = json.load(r)["model"]
    # llama-server keeps them in a set: sorted, once each, the first is the id
    assert (entry["id"], entry["aliases"], entry["tags"], model) == ("Coder", ["Coder", "tiny-coder"],
                                                                      ["code", "small"], "Coder")


def test_several_hosts_and_a_unix_socket_are_all_served(tmp_path):
    import http.client
    import socket

    sock_path = tmp_path / "serve.sock"
    if len(str(sock_path)) > 100:  # AF_UNIX paths are at most 104-108 bytes
        pytest.skip(f"the temporary folder's path is too long for a UNIX socket ({len(str(sock_path))} bytes)")
    # 127.0.0.2 is loopback too on Linux; localhost usually names 127.0.0.1 again (then one socket serves both)
    with _serve("--host", f"127.0.0.1,127.0.0.2,localhost,{sock_path}", log=tmp_path / "e.txt", host=None) as url:
        class _UnixConnection(http.client.HTTPConnection):
            def connect(self):
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.connect(str(sock_path))

        conn = _UnixConnection("localhost")
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        with urllib.request.urlopen(url.replace("127.0.0.1", "127.0.0.2") + "/health", timeout=5) as r:
            assert r.status == 200
    res = subprocess.run([sys.executable, "-m", "pyllama_spec", "serve", "--host", " , "], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "give at least one address" in res.stderr
