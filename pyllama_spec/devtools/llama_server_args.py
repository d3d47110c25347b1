"""llama-server's command-line flags, read from the pinned llama.cpp's ``common/arg.cpp``.

Every ``add_opt(common_arg(...))`` there declares one option: its names, its ``--no-`` names
(a boolean pair), how many values it takes (0, 1 or 2), its environment variable
(``set_env``), and the programs it belongs to (``set_examples`` / ``set_excludes``; none means
every program). This module reads those declarations the way a C++ reader would (string
literals, nesting), keeps the ones llama-server takes, and writes them as the table
``pyllama_spec/cli/llama_server_flags.py`` that ``pyllama-spec serve`` reads to accept every
llama-server command line. Regenerate after moving the pin::

    python -m pyllama_spec.devtools.llama_server_args [path/to/llama.cpp]

``tests/test_llama_server_cli.py`` checks the committed table against the built source, and
against ``llama-server --help`` when llama-server is built (``python build.py --tools``).
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

TABLE_PATH = Path(__file__).resolve().parents[1] / "cli" / "llama_server_flags.py"


@dataclasses.dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # "-c", "--ctx-size"
    negative: tuple[str, ...]  # "--no-mmap": a boolean pair when not empty
    values: int  # 0, 1 or 2 values follow the name on a command line
    env: str | None  # LLAMA_ARG_...
    summary: str  # the first line of its help
    preset_only: bool = False  # a key of --models-preset files only, not a command-line flag

    @property
    def key(self) -> str:
        """The name a preset file uses: the longest name without its dashes."""
        return max(self.names, key=len).lstrip("-")


# ----------------------------------------------------------------------------- a C++ reader


def _skip_string(text: str, i: int) -> int:
    """The index after the string literal starting at text[i] (a ``"``; raw strings R"(...)" too)."""
    if text.startswith('R"', i - 1) and text[i] == '"':
        delim = text[i + 1:text.index("(", i)]
        return text.index(")" + delim + '"', i) + len(delim) + 2
    j = i + 1
    while text[j] != '"':
        j += 2 if text[j] == "\\" else 1
    return j + 1


def _matching(text: str, i: int) -> int:
    """The index of the bracket closing the one at text[i]; strings, chars and comments skipped."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = [pairs[text[i]]]
    j = i + 1
    while stack:
        c = text[j]
        if c == '"':
            j = _skip_string(text, j)
            continue
        if c == "'":
            j = text.index("'", j + 2 if text[j + 1] == "\\" else j + 1) + 1
            continue
        if text.startswith("//", j):
            j = text.index("\n", j)
            continue
        if text.startswith("/*", j):
            j = text.index("*/", j) + 2
            continue
        if c in pairs:
            stack.append(pairs[c])
        elif c in ")}]":
            if c != stack.pop():
                raise ValueError(f"unbalanced {c!r} at offset {j}")
        j += 1
    return j - 1


def _split_top_level(text: str) -> list[str]:
    """A C++ argument list split at its top-level commas."""
    parts, start, j = [], 0, 0
    while j < len(text):
        c = text[j]
        if c == '"':
            j = _skip_string(text, j)
            continue
        if c in "({[":
            j = _matching(text, j) + 1
            continue
        if text.startswith("//", j):
            j = text.index("\n", j)
            continue
        if c == ",":
            parts.append(text[start:j].strip())
            start = j + 1
        j += 1
    parts.append(text[start:].strip())
    return [q for q in (_without_comments(p) for p in parts) if q]


def _without_comments(text: str) -> str:
    """C++ text without its // and /* */ comments (string literals kept whole)."""
    out, j = [], 0
    while j < len(text):
        if text[j] == '"':
            end = _skip_string(text, j)
            out.append(text[j:end])
            j = end
        elif text.startswith("//", j):
            j = text.find("\n", j)
            j = len(text) if j < 0 else j
        elif text.startswith("/*", j):
            j = text.index("*/", j) + 2
        else:
            out.append(text[j])
            j += 1
    return "".join(out).strip()


def _literals(text: str) -> list[str]:
    """The string literals in a piece of C++ (adjacent ones are separate items)."""
    out, j = [], 0
    while j < len(text):
        if text[j] == '"':
            end = _skip_string(text, j)
            out.append(bytes(text[j + 1:end - 1], "utf-8").decode("unicode_escape"))
            j = end
        else:
            j += 1
    return out


# ----------------------------------------------------------------------------- arg.cpp


def _chained_calls(text: str, i: int) -> tuple[dict[str, str], int]:
    """The ``.set_x(...)`` calls after a ``common_arg(...)`` ending at text[i-1]."""
    calls = {}
    while True:
        m = re.compile(r"\s*\.\s*(\w+)\s*\(").match(text, i)
        if not m:
            return calls, i
        close = _matching(text, m.end() - 1)
        calls[m.group(1)] = text[m.end():close]
        i = close + 1


def parse_arg_cpp(text: str) -> list[Flag]:
    """The options llama-server takes, in declaration order (a name declared twice, as ``-np``
    is in per-program branches, keeps the server's declaration: the later in the file)."""
    flags: dict[tuple[str, ...], Flag] = {}
    for m in re.finditer(r"(?:add_opt|args\.push_back)\(\s*common_arg\(", text):
        if "//" in text[text.rfind("\n", 0, m.start()):m.start()]:
            continue  # commented out
        close = _matching(text, m.end() - 1)
        args = _split_top_level(text[m.end():close])
        calls, _ = _chained_calls(text, close + 1)
        examples = calls.get("set_examples", "LLAMA_EXAMPLE_COMMON")
        if "LLAMA_EXAMPLE_" not in examples:  # a named list: static ... mmproj_examples = {...};
            named = re.search(r"\b" + examples.strip() + r"\s*=\s*\{([^}]*)\}", text)
            examples = named.group(1) if named else ""
        examples = re.findall(r"LLAMA_EXAMPLE_\w+", examples)
        excludes = re.findall(r"LLAMA_EXAMPLE_\w+", calls.get("set_excludes", ""))
        if not ({"LLAMA_EXAMPLE_SERVER", "LLAMA_EXAMPLE_COMMON"} & set(examples)) \
                or "LLAMA_EXAMPLE_SERVER" in excludes:
            continue
        names = tuple(_literals(args[0]))
        lambda_at = next(k for k, a in enumerate(args) if a.startswith("["))
        middle = args[1:lambda_at]  # (help), (hint, help), (negative names, help), (hint, hint2, help)
        negative: tuple[str, ...] = ()
        if len(middle) >= 2 and middle[0].startswith("{"):
            negative, values = tuple(_literals(middle[0])), 0
        else:
            values = len(middle) - 1
        env = _literals(calls["set_env"])[0] if "set_env" in calls and '"' in calls["set_env"] else None
        if env is None and "set_env" in calls:  # a named constant: COMMON_ARG_PRESET_...
            env = calls["set_env"].strip()
        summary = "".join(_literals(middle[-1])).split("\n")[0].strip()
        summary = re.sub(r"\s*\(default:.*", "", summary).rstrip(" .")
        flag = Flag(names, negative, values, env, summary, preset_only="set_preset_only" in calls)
        flags.pop(names, None)
        flags[names] = flag
    return list(flags.values())


def _constants(text: str) -> dict[str, str]:
    """``#define NAME "value"`` string constants (the preset keys' names)."""
    return dict(re.findall(r'#define\s+(\w+)\s+"([^"]*)"', text))


def read_flags(source: Path) -> list[Flag]:
    """llama-server's flags in a llama.cpp tree."""
    text = (source / "common" / "arg.cpp").read_text()
    consts = {}
    for header in ("common/arg.h", "common/preset.h", "common/common.h"):
        if (source / header).exists():
            consts.update(_constants((source / header).read_text()))
    out = []
    for f in parse_arg_cpp(text):
        if f.env and f.env in consts:
            f = dataclasses.replace(f, env=consts[f.env])
        out.append(f)
    return out


def render_table(flags: list[Flag], origin: str) -> str:
    lines = [
        f'"""llama-server\'s command-line flags, generated from {origin} by',
        "``python -m pyllama_spec.devtools.llama_server_args``: do not edit by hand.",
        "",
        "Each entry: (names, negative names, values taken, environment variable, preset only, summary).",
        '"""',
        "",
        "FLAGS = (",
    ]
    for f in flags:
        lines.append(f"    ({f.names!r}, {f.negative!r}, {f.values}, {f.env!r}, {f.preset_only!r},")
        lines.append(f"     {f.summary!r}),")
    lines.append(")")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv:
        source = Path(argv[0])
    else:
        from pyllama_spec.bindings.native_info import build_record

        source = Path(build_record()["source"]["path"])
    flags = read_flags(source)
    TABLE_PATH.write_text(render_table(flags, f"llama.cpp's common/arg.cpp ({source.name})"))
    print(f"{len(flags)} flags -> {TABLE_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
