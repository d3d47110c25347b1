"""`serve --sleep-idle-seconds N` (llama-server's): after N seconds without a request the model is
unloaded (the Engine closed: model, contexts, projector, drafter) and the next request that needs it
loads it again, others waiting for that one load (server/sleep.py). llama.cpp's own tests of it
(tools/server/tests/unit/test_sleep.py: which routes wake it, /metrics while asleep) run in
tests/test_llama_server_suite.py's suite.

Timings hold on a loaded 2-core machine: a server sleeps 1 s after its last request (3 s where a test
reads the process right after one), the tests wait up to 30 s for that and never check "awake" right
after a request; a generation meant to outlast the sleep is checked to have taken long enough.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import click
import httpx
import pytest
from conftest import REPO_ROOT, TINY_ENGINE, load_tiny
from serving import LocalServer, free_port, http

import pyllama_spec as ps
from pyllama_spec.server import ServerSettings

pytest.importorskip("uvicorn", reason="serve needs the server extra")

SLEEP = 1  # seconds without a request before the model is unloaded
ASLEEP_WITHIN = 30.0  # how long a test waits for that (a loaded machine is slow)
GREEDY = {"prompt": "Hello there", "n_predict": 12, "temperature": 0, "return_tokens": True}


def is_sleeping(url: str) -> bool:
    status, props = http(url, "/props")
    assert status == 200, props
    return props["is_sleeping"]


def eventually(condition, what: str) -> None:
    """``condition()`` becomes true within ASLEEP_WITHIN seconds: /props says "asleep" as the unload
    begins, on a thread, and the engine is closed a moment later."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < ASLEEP_WITHIN, f"not {what} within {ASLEEP_WITHIN} s"
        time.sleep(0.02)


def wait_asleep(url: str) -> float:
    """Seconds until /props says the model sleeps (polling does not wake it)."""
    start = time.monotonic()
    while not is_sleeping(url):
        assert time.monotonic() - start < ASLEEP_WITHIN, f"not asleep {ASLEEP_WITHIN} s after the last request"
        time.sleep(0.1)
    return time.monotonic() - start


def completion(url: str, body: dict = GREEDY) -> dict:
    status, answer = http(url, "/completion", body)
    assert status == 200, answer
    return answer


def sleepy(engine) -> LocalServer:
    return LocalServer(engine, ServerSettings(alias="tiny", sleep_idle_seconds=SLEEP))


def test_asleep_the_engine_is_closed_and_the_next_request_gets_the_same_answer(tiny_dense):
    engine = load_tiny(tiny_dense, n_ctx=2048)  # target, projector and DFlash draft
    try:
        with sleepy(engine) as server:
            service = server.app.state.service
            before = completion(server.url)
            wait_asleep(server.url)
            # everything native is freed
            eventually(lambda: engine.model.closed, "closed")
            assert engine.model.closed and engine.ctx.closed and engine.projector.closed
            assert engine.draft_model.closed and engine.drafter.ctx.closed
            assert service.worker is None
            # the routes that describe the server answer without loading it
            assert http(server.url, "/health")[0] == 200
            status, models = http(server.url, "/v1/models")
            assert status == 200 and models["data"][0]["id"] == "tiny"
            metrics = httpx.get(server.url + "/metrics")
            assert metrics.status_code == 200 and "llamacpp:tokens_predicted_total 12\n" in metrics.text
            assert is_sleeping(server.url) and engine.model.closed

            after = completion(server.url)  # loads the same configuration again
            assert (after["content"], after["tokens"]) == (before["content"], before["tokens"])
            # (not "awake now": a stall of the idle time on a loaded machine would put it to sleep again)
            assert service.engine is not engine
            assert service.engine.projector is not None and service.engine.drafter is not None
            assert service.engine.ctx.n_ctx == engine.config.n_ctx == 2048
            # counters go on over both engines
            assert "llamacpp:tokens_predicted_total 24\n" in httpx.get(server.url + "/metrics").text
        assert service.engine.model.closed  # the server closes the engine it loaded
    finally:
        engine.close()


def test_two_requests_arriving_asleep_both_succeed_with_one_load(tiny_dense, monkeypatch):
    from pyllama_spec.server import service as service_module
    from pyllama_spec.serving.engine import Engine

    loads = []

    engine = ps.load(tiny_dense.target, n_ctx=1024, **TINY_ENGINE)
    try:
        with sleepy(engine) as server:
            service = server.app.state.service

            def slow_load(config):
                """The load, held until both requests wait for it."""
                loads.append(config)
                deadline = time.monotonic() + ASLEEP_WITHIN
                while service.sleep.holders < 2 and time.monotonic() < deadline:
                    time.sleep(0.01)
                return Engine(config)

            monkeypatch.setattr(service_module, "Engine", slow_load)
            before = completion(server.url)
            wait_asleep(server.url)
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                answers = list(pool.map(lambda _: completion(server.url), range(2)))
            assert len(loads) == 1
            assert [(a["content"], a["tokens"]) for a in answers] == [(before["content"], before["tokens"])] * 2
    finally:
        engine.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_generation_longer_than_the_idle_time_is_not_interrupted(tiny_dense, stream):
    """A drafter that takes 50 ms a step: 60 tokens take about 3 s, three times the idle time."""

    def slow_draft(input_ids):
        time.sleep(0.05)
        return []

    engine = ps.load(tiny_dense.target, spec_type="draft-python", draft_callable=slow_draft, n_ctx=1024,
                     **TINY_ENGINE)
    body = {**GREEDY, "n_predict": 60, "ignore_eos": True, "stream": stream}
    try:
        with sleepy(engine) as server:
            start = time.monotonic()
            if stream:
                pieces = []
                with httpx.stream("POST", server.url + "/completion", json=body, timeout=120) as r:
                    assert r.status_code == 200
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            pieces.append(json.loads(line[6:]))
                last = pieces[-1]
                assert last["stop"] and last["tokens_predicted"] == 60
            else:
                answer = completion(server.url, body)
                assert answer["tokens_predicted"] == 60 and answer["stop_type"] == "limit"
            took = time.monotonic() - start
            # every token came (an unload under it would have ended it): never unloaded while it ran
            assert took > 2.5 * SLEEP, f"the generation took {took:.1f} s: too short to show anything"
            wait_asleep(server.url)  # and it sleeps once it is over
            eventually(lambda: engine.model.closed, "closed")
    finally:
        engine.close()


def test_a_model_that_cannot_be_loaded_again_is_a_clear_500_until_it_can(tiny_dense, tmp_path):
    target = tmp_path / "target.gguf"
    shutil.copyfile(tiny_dense.target, target)
    engine = ps.load(target, n_ctx=1024, **TINY_ENGINE)
    try:
        with sleepy(engine) as server:
            before = completion(server.url)
            wait_asleep(server.url)
            target.unlink()
            status, answer = http(server.url, "/completion", GREEDY)
            assert status == 500, answer
            assert answer["error"]["code"] == "model_reload_failed"
            assert "could not be loaded again after sleeping" in answer["error"]["message"]
            assert str(target) in answer["error"]["message"]
            assert is_sleeping(server.url) and http(server.url, "/health")[0] == 200
            shutil.copyfile(tiny_dense.target, target)  # the next request tries again
            assert completion(server.url)["tokens"] == before["tokens"]
    finally:
        engine.close()


def test_lora_scales_set_by_post_outlive_a_sleep(tmp_path):
    from pyllama_spec.devtools.tiny_lora import write_lora
    from pyllama_spec.embedded import MODELS_DIR

    adapter = write_lora(tmp_path / "adapter.gguf", MODELS_DIR / "trained-target.gguf")
    engine = ps.load(MODELS_DIR / "trained-target.gguf", lora=[adapter], n_ctx=1024, **TINY_ENGINE)
    try:
        with sleepy(engine) as server:
            assert http(server.url, "/lora-adapters", [{"id": 0, "scale": 0.25}])[0] == 200
            wait_asleep(server.url)
            status, adapters = http(server.url, "/lora-adapters")  # needs the model: wakes it
            assert status == 200 and adapters[0]["scale"] == 0.25
    finally:
        engine.close()


def _rss(pid: int) -> int:
    """A process's resident memory, bytes."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_serve_gives_its_memory_back_while_asleep(tiny_dense, tmp_path):
    """`pyllama-spec serve --sleep-idle-seconds 3` as a user starts it: a 131,072-token context holds a
    128 MiB KV cache; asleep, the process is smaller by most of it, and awake again as large. (3 s: the
    memory awake is read right after a request, which a stall of a loaded machine must not outlast.)"""
    from pyllama_spec.devtools.servers import stop, wait_healthy

    port, log = free_port(), tmp_path / "serve.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "pyllama_spec", "serve", "-m", str(tiny_dense.target),
                                 "-c", "131072", "-t", "1", "--sleep-idle-seconds", "3",
                                 "--port", str(port)], stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
        before = completion(url)
        awake = _rss(proc.pid)
        wait_asleep(url)
        eventually(lambda: awake - _rss(proc.pid) > 64 * 2**20, f"smaller by 64 MiB than {awake} bytes")
        asleep = _rss(proc.pid)
        assert completion(url)["tokens"] == before["tokens"]
        assert _rss(proc.pid) - asleep > 64 * 2**20
    finally:
        stop(proc)
    assert "the model is unloaded" in log.read_text()


def test_bad_values_are_clear_command_line_errors():
    from pyllama_spec.cli import options
    from pyllama_spec.cli.serve import serve

    for value in ("0", "-2", "soon"):
        with pytest.raises(click.BadParameter) as e:
            serve.make_context("serve", ["--sleep-idle-seconds", value])
        assert "--sleep-idle-seconds" in e.value.format_message() or e.value.param_hint
        if value != "soon":
            assert "-1 never to sleep" in e.value.format_message()
    # llama-server's spellings, honoured (no longer dropped with a warning)
    with options.err_console.capture() as captured:
        ctx = serve.make_context("serve", ["--sleep_idle_seconds=5"])
    assert ctx.params["sleep_idle_seconds"] == 5 and "sleep" not in captured.get()
    assert serve.make_context("serve", []).params["sleep_idle_seconds"] == -1
