"""The layer contract in pyproject.toml ([tool.importlinter]) holds, and would catch a module
that imports from a layer above it or calls the native library from outside the bindings."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT

pytest.importorskip("importlinter", reason="the test extra brings import-linter")


def _lint(root: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root))
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_package_keeps_its_layer_contract():
    out = _lint(REPO_ROOT, REPO_ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


@pytest.mark.parametrize("module,line,broken", [
    ("spec/positions.py", "from pyllama_spec.serving import engine", "Layers point one way"),
    ("bindings/handle.py", "from pyllama_spec.drafters import dflash", "Layers point one way"),
    ("serving/gate.py", "from pyllama_spec._native import lib", "Only the binding layer"),
])
def test_the_contract_breaks_on_an_import_against_the_layers(tmp_path, module, line, broken):
    copy = tmp_path / "src" / "pyllama_spec"
    shutil.copytree(REPO_ROOT / "pyllama_spec", copy, ignore=shutil.ignore_patterns("*.so*", "*.gguf", "lib", "static"))
    target = copy / module
    target.write_text(target.read_text() + f"\n{line}\n")
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    out = _lint(tmp_path / "src", tmp_path)
    assert out.returncode != 0 and f"{broken}" in out.stdout and "BROKEN" in out.stdout, out.stdout
