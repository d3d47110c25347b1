"""No two modules of the package import each other, directly or around a loop, at module level,
inside a function or for type checking only (``if TYPE_CHECKING:``): each layer points one way
(pyproject.toml's import-linter contract names them; tests/test_layers.py runs it)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pyllama_spec"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The package modules ``path`` imports anywhere, ``if TYPE_CHECKING:`` blocks included (a
    cycle of types is a cycle of concepts: it is broken by a protocol or a lower module, not hidden)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        for cand in candidates:
            while cand and cand not in known:
                cand = cand.rpartition(".")[0]
            if cand and cand != name and not name.startswith(cand + "."):  # a package's own __init__ is fine
                found.add(cand)
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(files)
    return {name: _imports(path, name, known) for name, path in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_package_has_no_import_cycle():
    graph = _graph()
    # a package __init__ re-exporting its modules is not a cycle with them
    for name in list(graph):
        graph[name] = {t for t in graph[name] if not (name.startswith(t + ".") or t.startswith(name + "."))}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_check_counts_imports_for_type_checking_only(tmp_path):
    (tmp_path / "pkg").mkdir()
    path = tmp_path / "pkg" / "a.py"
    path.write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg.b import B\n")
    assert _imports(path, "pkg.a", {"pkg", "pkg.a", "pkg.b"}) == {"pkg.b"}


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
