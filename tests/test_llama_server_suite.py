"""llama.cpp's own server tests (tools/server/tests/unit in the pinned source), unchanged, against
``pyllama-spec serve``, as their harness starts llama-server, on local stand-ins for the Hub models
(devtools/llama_server_suite.py). Every test llama-server passed on the same stand-ins (the recorded
bench/llama_server_suite_llama-server.json) passes here, or is a known difference with its reason
(``KNOWN_DIFFERENCES``), which must still fail (so the list stays true).

The files run here are the ones a client of the core API meets; with ``PYLLAMA_SPEC_SERVER_SUITE=all``
(.ci/run sets it) every file of the directory runs (about 7 minutes). The whole suite is recorded in
bench/llama_server_suite_serve.json (``python -m pyllama_spec.devtools.llama_server_suite --write``)."""

from __future__ import annotations

import json
import os

import pytest
from conftest import REPO_ROOT

pytest.importorskip("requests", reason="llama.cpp's server test harness imports requests (the test extra)")
pytest.importorskip("filelock", reason="llama.cpp's server test harness imports filelock (the test extra)")
pytest.importorskip("openai", reason="llama.cpp's server tests drive the openai client (the test extra)")
pytest.importorskip("uvicorn", reason="serve needs the server extra")

from pyllama_spec.devtools import llama_server_suite as suite  # noqa: E402

#: The files run on every test run (about three minutes): the core routes, embeddings and reranking.
FILES = ("test_basic.py", "test_tokenize.py", "test_embedding.py", "test_rerank.py", "test_vision_api.py",
         "test_speculative.py", "test_completion.py", "test_chat_completion.py", "test_metrics.py",
         "test_security.py", "test_ignore_eos.py", "test_ctx_shift.py")


def test_llama_servers_own_tests_pass_against_serve(tmp_path):
    if not suite.pinned_tests().exists():
        pytest.skip(f"{suite.pinned_tests()} is not in the build cache (python build.py extracts it)")
    reference = json.loads((REPO_ROOT / "bench" / "llama_server_suite_llama-server.json").read_text())
    whole = os.environ.get("PYLLAMA_SPEC_SERVER_SUITE") == "all"
    ours = suite.run(suite.prepare(tmp_path, "serve"), () if whole else FILES, timeout=3600)
    chosen = {t: o for t, o in reference.items() if whole or t.split("::")[0].removeprefix("unit/") in FILES}
    assert set(ours) == set(chosen), sorted(set(ours) ^ set(chosen))
    lost = sorted(t for t, o in chosen.items() if o == "passed" and ours[t] != "passed"
                  and suite.known_difference(t) is None)
    assert not lost, lost
    # a test named alone in the list must still fail (a whole file or group may pass a test here and there)
    stale = sorted(t for t in ours if ours[t] == "passed" and t in suite.KNOWN_DIFFERENCES)
    assert not stale, f"listed as known differences but passing now: {stale}"


def test_the_launcher_maps_hub_models_and_refuses_the_others(tmp_path, run_python):
    """The harness's LLAMA_SERVER_BIN_PATH: Hub arguments become a local file (and a vision model's
    projector), --offline goes, the rest of the command line is passed on; a model with no stand-in
    ends it with a message."""
    root = suite.prepare(tmp_path, "serve")
    launcher = root / "llama-server-stand-in"
    text = launcher.read_text()
    assert "ggml-org/tinygemma3-GGUF:Q8_0" in text and "trained-mmproj.gguf" in text
    res = run_python(f"import runpy, sys; sys.argv = [{str(launcher)!r}, '--hf-repo', 'bartowski/x', '--port', '1']; "
                     f"runpy.run_path({str(launcher)!r}, run_name='__main__')")
    assert res.returncode == 1 and "no local stand-in for bartowski/x" in res.stderr
    assert (root / "tmp" / "stories15M-q4_0.gguf").exists() and (root / "tmp" / "moe_shakespeare15M.gguf").exists()
    assert suite.known_difference("unit/test_mcp_servers.py::test_anything") is not None
    assert suite.known_difference("unit/test_basic.py::test_health") is None
