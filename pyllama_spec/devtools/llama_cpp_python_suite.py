"""llama-cpp-python 0.3.36's own test suite, run unchanged against the facade or against the real
package, on local stand-ins for the models it downloads from the Hub.

    python -m pyllama_spec.devtools.llama_cpp_python_suite                      # against the facade
    python -m pyllama_spec.devtools.llama_cpp_python_suite --python /venv/bin/python --real   # the real package
    python -m pyllama_spec.devtools.llama_cpp_python_suite --write tests/data/llama_cpp_python_results.json

The tests come from the sdist the build cache downloads (``python build.py``). A conftest gives them a
``huggingface_hub.hf_hub_download`` that maps each Hub file they ask for to a stand-in of the same kind
(nothing can be downloaded here), and, for the facade, points ``sys.modules["llama_cpp"]`` at it.
Tests that assert a downloaded model's exact words fail on a stand-in with either package; the
comparison is per test, with the real package run on the same stand-ins.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

from pyllama_spec.embedded import MODELS_DIR

#: The Hub files llama-cpp-python's tests ask for, and the local file of the same kind that stands in.
#: None: no stand-in of that kind here (its tests fail at the fixture, with either package).
STAND_INS: dict[tuple[str, str], str | None] = {
    ("lmstudio-community/Qwen3.5-0.8B-GGUF", "Qwen3.5-0.8B-Q8_0.gguf"): str(MODELS_DIR / "trained-qwen35-mtp.gguf"),
    ("ggml-org/models", "tinyllamas/stories15M-q4_0.gguf"): str(MODELS_DIR / "trained-target.gguf"),
    ("tiiuae/Falcon-H1-Tiny-90M-Instruct-GGUF", "Falcon-H1-Tiny-90M-Instruct-Q2_K.gguf"):
        str(MODELS_DIR / "trained-qwen35-mtp.gguf"),  # a hybrid (attention and recurrent layers) too
}
#: bge-small's stand-in: the tiny BERT with its vocabulary (devtools/tiny_bert.py), written by ``prepare``.
BGE_SMALL = ("CompendiumLabs/bge-small-en-v1.5-gguf", "bge-small-en-v1.5-q4_k_m.gguf")
#: mamba-130m's (recurrent-only): the tiny Mamba (devtools/tiny_mamba.py), written by ``prepare``.
MAMBA_130M = ("QuantFactory/mamba-130m-hf-GGUF", "mamba-130m-hf.Q2_K.gguf")

_CONFTEST = '''\
import sys, types
STAND_INS = {stand_ins!r}

def hf_hub_download(repo_id, filename, *args, **kwargs):
    path = STAND_INS.get((repo_id, filename), "missing")
    if path is None or path == "missing":
        raise FileNotFoundError(f"no local stand-in for {{repo_id}}/{{filename}} (nothing is downloaded here)")
    return path

hub = types.ModuleType("huggingface_hub")
hub.hf_hub_download = hf_hub_download
sys.modules["huggingface_hub"] = hub
{facade}
'''
_FACADE = "import pyllama_spec.llama_cpp\nsys.modules['llama_cpp'] = pyllama_spec.llama_cpp\n"


def sdist_path() -> Path:
    from pyllama_spec.native_build.common import cache_root
    from pyllama_spec.native_build.source import SDIST_NAME

    return cache_root() / "downloads" / SDIST_NAME


def prepare(folder: Path, *, facade: bool) -> Path:
    """The sdist's tests/ under ``folder`` with the conftest, and its ``vendor/llama.cpp/models`` (the
    vocabulary files test_llama.py reads) pointing at the pinned source's; returns the root to run in."""
    from pyllama_spec.native_build.source import pinned_source

    sdist = sdist_path()
    if not sdist.exists():
        raise FileNotFoundError(f"{sdist} is not in the build cache (python build.py downloads it)")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/tests/" in m.name and m.name.endswith(".py")]
        tar.extractall(folder, members=members, filter="data")
    root = next(folder.glob("*/tests")).parent
    from pyllama_spec.devtools.tiny_bert import make_bert
    from pyllama_spec.devtools.tiny_mamba import make_mamba

    stand_ins = {**STAND_INS, BGE_SMALL: str(make_bert(folder / "models")),
                 MAMBA_130M: str(make_mamba(folder / "models"))}
    (root / "tests" / "conftest.py").write_text(_CONFTEST.format(stand_ins=stand_ins, facade=_FACADE if facade else ""))
    models = root / "vendor" / "llama.cpp" / "models"
    models.parent.mkdir(parents=True, exist_ok=True)
    if not models.exists():
        models.symlink_to(pinned_source().path / "models")
    return root


def run(root: Path, *, python: str = sys.executable, files: tuple[str, ...] = (), timeout: float = 1800
        ) -> dict[str, str]:
    """Each test's outcome ("passed", "failed", "error", "skipped"), by its id."""
    cmd = [python, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "--tb=line",
           *(f"tests/{f}" for f in files or ("",))]
    res = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout,
                         env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    outcomes: dict[str, str] = {}
    for line in res.stdout.splitlines():
        m = re.match(r"^(PASSED|FAILED|ERROR|SKIPPED)(?: \[\d+\])? (tests/\S+)", line)
        if m:
            outcomes[m.group(2)] = m.group(1).lower()
    if not outcomes:
        raise RuntimeError(f"no test outcomes in the run's output:\n{res.stdout[-3000:]}\n{res.stderr[-2000:]}")
    return outcomes


def main(argv: list[str] | None = None) -> int:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=sys.executable, help="the interpreter to run the tests with")
    ap.add_argument("--real", action="store_true", help="import the real llama_cpp (installed in --python)")
    ap.add_argument("--write", help="write the outcomes as JSON to this file")
    ap.add_argument("files", nargs="*", help="test files (default: all of tests/)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        outcomes = run(prepare(Path(tmp), facade=not a.real), python=a.python, files=tuple(a.files))
    for test, outcome in sorted(outcomes.items()):
        print(f"{outcome:8} {test}")
    if a.write:
        Path(a.write).write_text(json.dumps(dict(sorted(outcomes.items())), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
