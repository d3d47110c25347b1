"""Vertex AI's prediction protocol (server/vertex.py), as llama-server serves it with AIP_MODE=PREDICTION:
POST /predict runs each instance as its route answers it; the health alias; the port from the
environment; the refusals, per instance and for the whole request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest
from conftest import REPO_ROOT, load_tiny
from serving import LocalServer, free_port, http

from pyllama_spec.devtools.servers import stop, wait_healthy
from pyllama_spec.server import ServerSettings, create_app
from pyllama_spec.server.vertex import MAX_INSTANCES, VertexSettings, request_format

pytest.importorskip("uvicorn", reason="serve needs the server extra")


def test_a_routes_request_format_is_its_camel_case_name():
    assert request_format("/v1/chat/completions") == "chatCompletions"
    assert request_format("/chat/completions") == "chatCompletions"
    assert request_format("/apply-template") == "applyTemplate"
    assert request_format("/completion") == "completion"
    assert request_format("/slots/{id_slot}") == "slots"


def test_the_settings_come_from_vertex_ais_variables():
    assert VertexSettings.from_environ({}) is None
    assert VertexSettings.from_environ({"AIP_MODE": "TRAINING"}) is None
    assert VertexSettings.from_environ({"AIP_MODE": "PREDICTION"}) == VertexSettings("/predict", "", 8080)
    v = VertexSettings.from_environ({"AIP_MODE": "PREDICTION", "AIP_PREDICT_ROUTE": "v1/models/m:predict",
                                     "AIP_HEALTH_ROUTE": "ping", "AIP_HTTP_PORT": "9000"})
    assert v == VertexSettings("/v1/models/m:predict", "/ping", 9000)
    with pytest.raises(ValueError, match="AIP_HTTP_PORT"):
        VertexSettings.from_environ({"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "http"})


def _post(url: str, path: str, body, key: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


@pytest.fixture(scope="module")
def server(tiny_dense):
    with load_tiny(tiny_dense, n_ctx=2048, n_parallel=2) as engine, \
            LocalServer(engine, ServerSettings(api_key="k", vertex=VertexSettings(health_route="/ping"))) as s:
        yield s


def test_each_instance_is_answered_as_its_route_answers_it(server):
    chat = {"messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8, "temperature": 0}
    status, direct = _post(server.url, "/v1/chat/completions", chat, key="k")
    assert status == 200
    status, body = _post(server.url, "/predict", {"instances": [
        {"@requestFormat": "chatCompletions", **chat},
        {"@requestFormat": "/v1/chat/completions", **chat, "stream": True},  # a prediction is never a stream
        {"@requestFormat": "tokenize", "content": "hello"},
    ]}, key="k")
    assert status == 200 and len(body["predictions"]) == 3
    for p in body["predictions"][:2]:
        assert p["object"] == "chat.completion"
        assert p["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    assert body["predictions"][2] == _post(server.url, "/tokenize", {"content": "hello"}, key="k")[1]


def test_a_bad_instance_gets_its_error_and_the_others_their_answers(server):
    status, body = _post(server.url, "/predict", {"instances": [
        {"@requestFormat": "nothing"}, {"content": "no format"}, 3,
        {"@requestFormat": "chatCompletions", "messages": []},
        {"@requestFormat": "tokenize", "content": "a"},
    ]}, key="k")
    assert status == 200
    errors = [p.get("error", {}).get("message", "") for p in body["predictions"][:4]]
    assert "no handler registered for @requestFormat: nothing" in errors[0]
    assert "@requestFormat" in errors[1] and "JSON object" in errors[2] and "messages" in errors[3]
    assert body["predictions"][4]["tokens"]


def test_a_path_served_for_get_and_post_is_its_get_as_llama_server_dispatches_it(server):
    status, body = _post(server.url, "/predict", {"instances": [{"@requestFormat": "props"},
                                                                {"@requestFormat": "/props"}]}, key="k")
    assert status == 200 and all("default_generation_settings" in p for p in body["predictions"]), body


def test_a_lone_surrogate_in_an_instance_is_that_instances_business(server):
    raw = b'{"instances": [{"@requestFormat": "tokenize", "content": "a\\ud800b"}, ' \
          b'{"@requestFormat": "tokenize", "content": "ok"}]}'
    req = urllib.request.Request(server.url + "/predict", raw, {"Content-Type": "application/json",
                                                               "Authorization": "Bearer k"})
    with urllib.request.urlopen(req, timeout=60) as r:
        body = json.load(r)
    assert r.status == 200 and len(body["predictions"]) == 2 and body["predictions"][1]["tokens"]


def test_an_instance_naming_no_json_route_gets_its_error(server):
    status, body = _post(server.url, "/predict", {"instances": [
        {"@requestFormat": ""}, {"@requestFormat": "/"}, {"@requestFormat": "/slots/{id_slot}"}]}, key="k")
    assert status == 200
    assert all("no handler registered" in p["error"]["message"] for p in body["predictions"]), body


def test_a_large_instance_is_freed_with_its_request(server):
    import gc

    text = "é" * 200_000  # 400 KB of UTF-8: parsed on a thread, the collector frozen while it lives
    status, body = _post(server.url, "/predict", {"instances": [{"@requestFormat": "tokenize", "content": text}]},
                         key="k")
    assert status == 200 and len(body["predictions"][0]["tokens"]) > 0
    deadline = time.monotonic() + 10
    while gc.get_freeze_count() and time.monotonic() < deadline:  # freed on a thread, a piece at a time
        time.sleep(0.05)
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize(("body", "message"), [
    ({}, "array field named instances"), ({"instances": {"a": 1}}, "array field named instances"),
    ([1], "JSON object"), ({"instances": [{"@requestFormat": "tokenize", "content": "a"}] * (MAX_INSTANCES + 1)},
                           f"maximum size of {MAX_INSTANCES}"),
])
def test_a_request_that_is_not_a_prediction_is_a_400(server, body, message):
    status, answer = _post(server.url, "/predict", body, key="k")
    assert status == 400 and message in answer["error"]["message"]


def test_the_key_is_asked_of_predictions_not_of_the_health_check(server):
    assert _post(server.url, "/predict", {"instances": []})[0] == 401
    assert _post(server.url, "/predict", {"instances": []}, key="k") == (200, {"predictions": []})
    assert http(server.url, "/ping") == (200, {"status": "ok"})


def test_the_health_route_may_be_health_itself(tiny_dense):
    with load_tiny(tiny_dense, n_ctx=1024) as engine:
        for route in ("/health", "/v1/health"):
            create_app(engine, ServerSettings(vertex=VertexSettings(health_route=route)))  # no alias, no error


@pytest.mark.parametrize("vertex", [VertexSettings(predict_route="/completion"),
                                    VertexSettings(health_route="/v1/chat/completions"),
                                    VertexSettings(health_route="/predict")])
def test_a_vertex_route_on_a_served_route_is_refused(tiny_dense, vertex):
    with load_tiny(tiny_dense, n_ctx=1024) as engine:
        with pytest.raises(ValueError, match="already serves"):
            create_app(engine, ServerSettings(api_key="k", vertex=vertex))


def test_serve_listens_where_vertex_ai_says(tiny_dense):
    port = free_port()
    env = dict(os.environ, AIP_MODE="PREDICTION", AIP_HTTP_PORT=str(port), AIP_HEALTH_ROUTE="/ping",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pyllama_spec", "serve", "-m", str(tiny_dense.target),
                                 "--port", str(free_port()), "-c", "1024"], stdout=subprocess.DEVNULL,
                                stderr=log, env=env, cwd=REPO_ROOT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc, log.name, 120)
            assert http(url, "/ping") == (200, {"status": "ok"})
            status, body = _post(url, "/predict", {"instances": [{"@requestFormat": "completion", "prompt": "a",
                                                                  "n_predict": 2}]})
            assert status == 200 and body["predictions"][0]["tokens_predicted"] == 2
        finally:
            stop(proc)
        log.seek(0)
        assert f"listening on AIP_HTTP_PORT {port}" in log.read()
