"""The layer contract in pyproject.toml ([tool.importlinter]) holds, names every module of the
package, and would catch a module that imports from a layer above it, calls the native library
from outside the bindings, reaches the bindings from the server, imports devtools at run time, or
sits outside the layers.

import-linter is in the ``test`` extra: without it these tests fail, they do not skip."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT

try:
    import tomllib
except ImportError:  # Python 3.10: import-linter brings tomli there
    import tomli as tomllib

PACKAGE = REPO_ROOT / "pyllama_spec"
LAYERS = "Layers point one way"
NATIVE = "Only the binding layer calls the native library"
SERVER = "Server and facade speak to the engine, never to the bindings"


def _lint(root: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root))
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _broken(stdout: str) -> dict[str, str]:
    """Each broken contract's report, by the contract's name (lint-imports' "Broken contracts" part)."""
    _, _, broken = stdout.partition("Broken contracts\n----------------\n")
    parts = re.split(r"^(.+)\n-+\n", broken, flags=re.MULTILINE)
    return {name.strip(): body for name, body in zip(parts[1::2], parts[2::2])}


def _contract(name: str) -> dict:
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return next(c for c in config["contracts"] if c["name"] == name)


def _layer_names() -> set[str]:
    """The modules the layers contract names (each with all its submodules), as full names."""
    contract = _contract(LAYERS)
    prefixes = [f"{c}." for c in contract.get("containers", [])] or [""]
    return {prefix + name.strip() for prefix in prefixes for layer in contract["layers"]
            for name in re.split(r"[|:]", layer)}


def _modules() -> list[str]:
    """Every module of the package but the package itself (pyproject's root_package, which
    re-exports the layers' names), by its full name."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if len(parts) > 1:
            names.append(".".join(parts))
    return names


def _outside(named: set[str], modules: list[str]) -> list[str]:
    """The modules neither named nor inside a package that is."""
    return [m for m in modules if not any(".".join(m.split(".")[:n]) in named for n in range(2, m.count(".") + 2))]


def test_import_linter_is_installed():
    assert importlib.util.find_spec("importlinter") is not None, \
        "import-linter checks the layer contract: pip install -e '.[test]'"


def test_the_package_keeps_its_layer_contract():
    out = _lint(REPO_ROOT, REPO_ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_every_module_of_the_package_is_in_a_layer():
    assert not (outside := _outside(_layer_names(), _modules())), f"modules outside the layers contract: {outside}"


def test_every_module_but_the_bindings_is_kept_from_the_native_library():
    named = set(_contract(NATIVE)["source_modules"]) | {"pyllama_spec.bindings", "pyllama_spec._native"}
    assert not (outside := _outside(named, _modules())), f"modules {NATIVE!r} does not name: {outside}"


# (module, the import added to it, the contract it breaks, what lint-imports names)
# A module that does not exist is written as a new one; an existing one gets the line appended.
SCRATCH_IMPORTS = [
    ("gguf/scratch_import.py", "import pyllama_spec.serving", LAYERS,
     "pyllama_spec.gguf.scratch_import -> pyllama_spec.serving"),
    ("bindings/scratch_import.py", "import pyllama_spec.drafters", LAYERS,
     "pyllama_spec.bindings.scratch_import -> pyllama_spec.drafters"),
    ("serving/scratch_import.py", "import pyllama_spec._native", NATIVE,
     "pyllama_spec.serving.scratch_import -> pyllama_spec._native"),
    ("server/scratch_import.py", "import pyllama_spec.bindings.mtmd", SERVER,
     "pyllama_spec.server.scratch_import -> pyllama_spec.bindings.mtmd"),
    ("server/scratch_native.py", "import pyllama_spec._native", SERVER,
     "pyllama_spec.server.scratch_native -> pyllama_spec._native"),
    ("llama_cpp/scratch_import.py", "import pyllama_spec.bindings.model", SERVER,
     "pyllama_spec.llama_cpp.scratch_import -> pyllama_spec.bindings.model"),
    ("embedded.py", "import pyllama_spec.devtools.tiny", LAYERS,  # a runtime module importing devtools
     "pyllama_spec.embedded -> pyllama_spec.devtools.tiny"),
    ("cli/scratch_import.py", "import pyllama_spec.devtools.benchmark", LAYERS,  # not one of the developer's commands
     "pyllama_spec.cli.scratch_import -> pyllama_spec.devtools.benchmark"),
    ("errors.py", "import pyllama_spec.native_build", LAYERS,  # two independent modules of one layer
     "pyllama_spec.errors -> pyllama_spec.native_build"),
    ("scratch_import.py", "import os", LAYERS,  # a new module outside the layers
     "pyllama_spec.scratch_import"),
]


@pytest.fixture(scope="module")
def scratch_lint(tmp_path_factory) -> dict[str, str]:
    """lint-imports on a copy of the package with every scratch import added (one run for all)."""
    tmp = tmp_path_factory.mktemp("scratch")
    copy = tmp / "src" / "pyllama_spec"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("*.so*", "*.gguf", "lib", "static", "__pycache__"))
    for module, line, _, _ in SCRATCH_IMPORTS:
        target = copy / module
        target.write_text((target.read_text() if target.exists() else "") + f"\n{line}\n")
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp / "pyproject.toml")
    out = _lint(tmp / "src", tmp)
    assert out.returncode != 0 and "BROKEN" in out.stdout, out.stdout + out.stderr
    return _broken(out.stdout)


@pytest.mark.parametrize("module,line,contract,named", SCRATCH_IMPORTS, ids=[m for m, *_ in SCRATCH_IMPORTS])
def test_the_contract_breaks_on_an_import_against_the_layers(scratch_lint, module, line, contract, named):
    assert contract in scratch_lint, f"{contract!r} kept with {line!r} in {module}"
    assert named in scratch_lint[contract], scratch_lint[contract]
