"""A short smoke run of the benchmark harness on the tiny models (benchmarks are not tests: no timings checked)."""

from __future__ import annotations

import json

from click.testing import CliRunner
from conftest import needs_llama_server

from pyllama_spec import native_build
from pyllama_spec.cli import main


@needs_llama_server
def test_bench_smoke_runs_both_engines_and_they_agree(tiny_dense, tmp_path):
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(main, ["bench", "-m", str(tiny_dense.target), "--mmproj", str(tiny_dense.mmproj),
                                       "-md", str(tiny_dense.draft), "-t", "1", "-n", "16", "--repeats", "1",
                                       "--json-out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    engines = {s["engine"] for s in data["samples"]}
    assert engines == {"llama-server dflash", "pyllama-spec dflash", "pyllama-spec target-only",
                       "llama-server target-only"}
    ratios = data["summary"]["ratios"]
    # Greedy on the same files: both engines produce the same tokens, with and without an image.
    assert ratios["same tokens (text)"] and ratios["same tokens (image)"]
    assert all(v > 0 for k, v in data["rss_mib"].items())
    assert "| ratio | value |" in result.output


def test_bench_without_a_server_says_how_to_build_one(monkeypatch):
    monkeypatch.setattr(native_build, "find_llama_server", lambda: None)
    result = CliRunner().invoke(main, ["bench"])
    assert result.exit_code == 2 and "build.py --tools" in result.output


def test_bench_refuses_two_model_sets_at_once(monkeypatch):
    monkeypatch.setattr(native_build, "find_llama_server", lambda: "/bin/true")
    result = CliRunner().invoke(main, ["bench", "--large", "--widened"])
    assert result.exit_code == 2 and "pick one" in result.output
