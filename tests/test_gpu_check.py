"""tools/gpu_check.py's CPU dry run: every step but the GPU ones, so the script cannot rot
between the sessions that have a GPU. It needs llama-server (`build.py --tools`, as .ci/run does)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import LLAMA_SERVER, REPO_ROOT


def test_gpu_check_dry_run_writes_its_report(tmp_path):
    if LLAMA_SERVER is None:
        pytest.skip("llama-server is not built (python build.py --tools): the check benchmarks against it")
    out = tmp_path / "gpu-check"
    res = subprocess.run([sys.executable, "tools/gpu_check.py", str(out), "--dry-run", "--tests",
                          "tests/test_gpu.py tests/test_bindings.py", "--bench-tokens", "8", "--bench-repeats", "1"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["ok"] and report["dry_run"]
    assert [s["step"] for s in report["steps"]] == ["find the GPU", "build (cached)", "install", "the GPU is used",
                                                    "tests", "bench vs llama-server"]
    assert all(s["ok"] for s in report["steps"])
    assert "passed" in report["steps"][4]["result"]
    assert json.loads((out / "bench.json").read_text())
    assert "| bench vs llama-server | yes |" in (out / "gpu_check.md").read_text()
