"""The documentation site builds, strictly: the README sections its home page includes exist, every link
resolves (a broken one fails the build), and the API reference renders from the docstrings."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

pytest.importorskip("mkdocs", reason="the docs extra brings MkDocs (pip install -e '.[docs]'; the test extra has it)")
pytest.importorskip("mkdocstrings", reason="the docs extra brings mkdocstrings")


def _build(root, site) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"),
                           "-d", str(site)], cwd=root, capture_output=True, text=True, timeout=300)


def test_the_site_builds_strictly_with_every_page(tmp_path):
    r = _build(REPO_ROOT, tmp_path / "site")
    assert r.returncode == 0, r.stdout + r.stderr
    api = (tmp_path / "site" / "python-api" / "index.html").read_text()
    assert "Which drafting method" in api  # the guide's section, on its page
    assert 'href="../rpc/#beyond-one-machine-rpc-and-several-gpus"' in api  # a link to another page's section
    index = (tmp_path / "site" / "index.html").read_text()
    assert "At a glance" in index and 'href="python-api/"' in index  # the README's front page, its links the site's
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    assert "EngineConfig" in reference and "ContextOverflowError" in reference  # from the docstrings
    assert "The three files of the embedded trained pair" in reference  # embedded_models()'s docstring


def test_a_broken_link_fails_the_build(tmp_path):
    copy = tmp_path / "repo"
    copy.mkdir()
    for name in ("mkdocs.yml", "README.md", "CHANGELOG.md"):
        shutil.copy(REPO_ROOT / name, copy / name)
    shutil.copytree(REPO_ROOT / "docs", copy / "docs")
    shutil.copytree(REPO_ROOT / "pyllama_spec", copy / "pyllama_spec", ignore=shutil.ignore_patterns("*.so", "lib"))
    (copy / "docs" / "layout.md").write_text("# Layout\n\nSee [the missing page](nowhere.md).\n")
    r = _build(copy, tmp_path / "site")
    assert r.returncode != 0 and "nowhere.md" in r.stdout + r.stderr
