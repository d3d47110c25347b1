"""The embedded default: the trained tiny pair ships inside the package, and demo, chat and
generate use it when no model is given (readable text, real acceptance)."""

from __future__ import annotations

import json
import re
import string
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import N_THREADS, REPO_ROOT

import pyllama_spec as ps
from pyllama_spec import embedded
from pyllama_spec.cli import main

READABLE = set(string.printable)


def _table_rows(output: str) -> dict[str, str]:
    """The demo table's rows, {label: value} (a value wrapped over lines is joined)."""
    rows, label = {}, None
    for line in output.splitlines():
        if line.count("│") != 3:
            continue
        key, value = (part.strip() for part in line.split("│")[1:3])
        if key:
            label = key
            rows[label] = value
        elif label:
            rows[label] += " " + value
    return rows


def test_the_embedded_pair_is_found_through_the_package():
    models = ps.embedded_models()
    package_dir = Path(ps.__file__).resolve().parent
    for path, name in ((models.target, "trained-target.gguf"), (models.mmproj, "trained-mmproj.gguf"),
                       (models.draft, "trained-draft.gguf")):
        assert path == package_dir / "models" / name
        assert path.is_file() and path.stat().st_size > 100_000
    assert not (REPO_ROOT / "tests" / "models").exists()  # one copy only


def test_a_non_editable_install_ships_the_embedded_pair():
    from setuptools.config.pyprojecttoml import read_configuration

    globs = read_configuration(REPO_ROOT / "pyproject.toml")["tool"]["setuptools"]["package-data"]["pyllama_spec"]
    shipped = {p for g in globs for p in (REPO_ROOT / "pyllama_spec").glob(g)}
    models = ps.embedded_models()
    assert {models.target, models.mmproj, models.draft} <= shipped


def test_missing_embedded_files_raise_a_model_file_error_naming_them(tmp_path, monkeypatch):
    monkeypatch.setattr(embedded, "MODELS_DIR", tmp_path)
    with pytest.raises(ps.ModelFileError, match="trained-target.gguf.*trained-draft.gguf") as e:
        ps.embedded_models()
    assert isinstance(e.value, OSError) and "reinstall" in str(e.value)


def test_the_demo_on_the_embedded_pair_prints_code_and_real_acceptance():
    result = CliRunner().invoke(main, ["demo", "--threads", str(N_THREADS), "--max-tokens", "48"],
                                terminal_width=200)
    assert result.exit_code == 0, result.output
    out = result.output
    # the continuation comes right after the prompt's code, before the table
    continuation = out.split(embedded.PROMPT, 1)[1].split("DFlash on a vision target", 1)[0]
    assert continuation.strip() and "\ufffd" not in continuation
    assert set(continuation) <= READABLE, repr(continuation)
    rows = _table_rows(out)
    drafted, accepted, rate = re.match(r"(\d+) / (\d+) \(acceptance ([\d.]+)", rows["drafted / accepted"]).groups()
    assert int(drafted) > 0 and int(accepted) > 0 and float(rate) > 0.2
    rows_, positions = map(int, re.match(r"(\d+) cache rows over (\d+) positions", rows["prompt"]).groups())
    assert rows["pinned image rows skipped"] == "576"  # the 672x672 test card: 9 ubatches of 64
    assert rows_ - positions == 576 - 24  # its 576 rows take 24 positions
    assert rows["first draft block at"].startswith(f"position {positions} (pos_next {positions},")
    assert rows["same output as target-only"] == "yes"


def test_chat_without_a_model_runs_a_turn_on_the_embedded_pair():
    result = CliRunner().invoke(main, ["chat", "-t", str(N_THREADS), "-n", "16"],
                                input="def add(a, b):\n/stats\n/quit\n")
    assert result.exit_code == 0, result.output
    out = result.output  # stdout and stderr
    assert "embedded trained pair" in out and "trained-target.gguf" in out
    assert "dflash" in out and "turns 1" in out and "tok/s" in out


def test_generate_without_a_model_keeps_stdout_for_the_answer():
    result = CliRunner().invoke(main, ["generate", "-t", str(N_THREADS), "-n", "12", "--raw", "--json",
                                       "-p", "def add(a, b):\n"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.strip().splitlines()[-1])  # the note about the pair went to stderr
    assert len(data["tokens"]) == 12 and data["stats"]["drafted"] > 0


def test_a_projector_or_draft_without_a_model_is_refused():
    result = CliRunner().invoke(main, ["generate", "--mmproj", "m.gguf", "-p", "x"])
    assert result.exit_code == 1 and "go with -m" in result.output
