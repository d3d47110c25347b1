"""llama.cpp's own server test suite (``tools/server/tests/unit/`` in the pinned source), run unchanged
against ``pyllama-spec serve`` or against llama-server from the same pin, on local stand-ins for the
models it downloads.

    python -m pyllama_spec.devtools.llama_server_suite                       # against serve
    python -m pyllama_spec.devtools.llama_server_suite --server llama-server # the reference
    python -m pyllama_spec.devtools.llama_server_suite --write F.json test_embedding.py test_rerank.py

Its harness (``utils.py``) starts the server binary named by ``LLAMA_SERVER_BIN_PATH`` with
llama-server's flags, the model given as a Hub repository and file (``--hf-repo``, ``--hf-file``),
and downloads a few files with ``download_file`` into ``./tmp``. Nothing is downloaded here, so:

* ``LLAMA_SERVER_BIN_PATH`` is a small launcher written into the run's folder: it replaces the Hub
  arguments by a local file of the same kind (``STAND_INS``; a vision model's projector with it, as
  ``-hf`` brings one), drops ``--offline``, and runs the chosen server with the rest of the command
  line unchanged. A model with no stand-in ends the launcher with a message (its tests fail on both
  servers alike);
* the files ``download_file`` would fetch are put in ``./tmp`` first where a stand-in exists
  (``DOWNLOADS``), so it finds them there;
* ``wget`` (which ``utils.py`` imports for ``download_file``) is a module that refuses to download.

Both servers get the same stand-ins, so the per-test outcomes compare (``bench/llama_server_*.json``).
Tests that assert a downloaded model's own words fail on both.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from pyllama_spec.embedded import MODELS_DIR

def stand_ins(folder: Path) -> dict[str, tuple[str, str | None]]:
    """The Hub models the suite asks for, as the launcher looks them up (``repo`` or ``repo/file``), and
    the (model, projector or None) standing in, written under ``folder`` where they are generated. A
    model not here has no stand-in of its kind (an 8B model's words, a split GGUF, ...)."""
    from pyllama_spec.devtools import tiny
    from pyllama_spec.devtools.tiny_bert import make_bert

    target, mmproj = str(MODELS_DIR / "trained-target.gguf"), str(MODELS_DIR / "trained-mmproj.gguf")
    fim = tiny.make_tiny_set(folder, arch="hunyuan_vl", seed=0, window=32, predictable=0.5, fim=True).target
    return {
        "ggml-org/models/tinyllamas/stories260K.gguf": (target, None),  # the harness's default model
        "ggml-org/test-model-stories260K": (target, None),
        "ggml-org/stories15M_MOE/stories15M_MOE-F16.gguf": (target, None),
        "ggml-org/test-model-stories260K-infill": (str(fim), None),
        "ggml-org/models/bert-bge-small/ggml-model-f16.gguf": (str(make_bert(folder)), None),
        "ggml-org/models/jina-reranker-v1-tiny-en/ggml-model-f16.gguf": (str(make_bert(folder, rerank=True)), None),
        "ggml-org/tinygemma3-GGUF:Q8_0": (target, mmproj),
    }


def downloads(folder: Path) -> dict[str, str]:
    """``download_file``'s files (by name in ./tmp) and their stand-ins: a draft model with the
    target's vocabulary, and a LoRA adapter of the stories15M_MOE stand-in."""
    from pyllama_spec.devtools.tiny_lora import write_lora

    lora = folder / "moe_shakespeare15M.gguf"
    if not lora.exists():
        write_lora(lora, MODELS_DIR / "trained-target.gguf")
    return {"stories15M-q4_0.gguf": str(MODELS_DIR / "trained-draft-vlm.gguf"), "moe_shakespeare15M.gguf": str(lora)}


#: Tests llama-server passes on the stand-ins that serve does not, by test id or a prefix of ids, and
#: why: each a choice made here or a feature not built yet, said so. tests/test_llama_server_suite.py
#: fails on any other such test, and on a test listed here that passes now (the list stays true).
KNOWN_DIFFERENCES: dict[str, str] = {
    "unit/test_mcp_servers.py::": "MCP servers (--mcp-servers-config, --mcp-servers-json, the web UI's MCP "
                                  "proxy) are not served here",
    "unit/test_tools_builtin.py::": "llama-server's built-in tools (--tools: files, shell commands) are not served "
                                    "here",
    "unit/test_proxy.py::": "the web UI's CORS proxy (--ui-mcp-proxy) is not served here",
    "unit/test_security.py::test_cors_proxy_only_forwards_explicit_proxy_headers": "the web UI's CORS proxy is "
                                                                                   "not served here",
    "unit/test_security.py::test_cors_options[": "--cors-origins defaults to localhost here (llama-server's "
                                                 "default is '*'): without an API key any web page the user opens "
                                                 "could otherwise drive the server; --cors-origins '*' gives "
                                                 "llama-server's answers",
    "unit/test_metrics.py::test_metrics_disabled": "/metrics is always served here (llama-server needs --metrics)",
    "unit/test_router.py::test_router_props": "serve without -m serves the embedded pair (the first run's model); "
                                              "its router is --models-preset without -m",
    "unit/test_router.py::test_router_delete_model": "the router's Hub cache (downloads, deleting them) is not "
                                                     "here: nothing is downloaded",
    "unit/test_router.py::test_router_chat_completion_stream[non-existent/model-False]": "serve without -m serves "
                                                                                         "the embedded pair, not a "
                                                                                         "router",
    "unit/test_compat_anthropic.py::test_anthropic_empty_messages": "an empty messages list is a 400 here: there is "
                                                                    "nothing to answer",
    "unit/test_compat_anthropic.py::test_anthropic_vision_format_accepted": "an image sent to a server without a "
                                                                            "projector is a 400 here (a 500 there)",
    "unit/test_compat_anthropic.py::test_anthropic_tool_result_with_image": "an image sent to a server without a "
                                                                            "projector is a 400 here (a 500 there)",
    "unit/test_compat_oai_responses.py::test_responses_stream_with_llama_telemetry": "a Responses stream cut by "
                                                                                     "max_output_tokens ends with "
                                                                                     "OpenAI's response.incomplete "
                                                                                     "(status incomplete), where "
                                                                                     "llama-server sends "
                                                                                     "response.completed; its progress "
                                                                                     "and per-token timings are sent",
}


def known_difference(test: str) -> str | None:
    """Why ``test`` is known to fail here where llama-server passes it, or None."""
    return next((why for key, why in KNOWN_DIFFERENCES.items() if test == key or
                 (key.endswith(("::", "[")) and test.startswith(key))), None)


_LAUNCHER = '''#!{python}
"""llama-server's command line with its Hub model replaced by a local stand-in (see
pyllama_spec/devtools/llama_server_suite.py)."""
import os, sys
STAND_INS = {stand_ins!r}
SERVER = {server!r}
args, repo, file, i = [], None, None, 1
argv = sys.argv
while i < len(argv):
    a = argv[i]
    if a in ("-hf", "-hfr", "--hf-repo") and i + 1 < len(argv):
        repo, i = argv[i + 1], i + 2
    elif a in ("-hff", "--hf-file") and i + 1 < len(argv):
        file, i = argv[i + 1], i + 2
    elif a == "--offline":
        i += 1
    else:
        args.append(a)
        i += 1
if repo is not None:
    key = repo if file is None else repo + "/" + file
    found = STAND_INS.get(key)
    if found is None:
        sys.exit(f"no local stand-in for {{key}} (nothing is downloaded here)")
    model, mmproj = found
    args = ["-m", model, *args]
    if mmproj is not None and "--no-mmproj" not in args:
        args = ["--mmproj", mmproj, *args]
os.execv(SERVER[0], [*SERVER, *args])
'''

_WGET = '''"""Nothing is downloaded here: the suite's files are put in ./tmp first (llama_server_suite.py)."""


def download(url, out=None, bar=None):
    raise OSError(f"nothing is downloaded here: {url}")
'''


def pinned_tests() -> Path:
    from pyllama_spec.native_build.source import pinned_source

    return pinned_source().path / "tools" / "server" / "tests"


def server_command(which: str) -> list[str]:
    """How the launcher starts ``which``: "serve" (this checkout's ``pyllama-spec serve``) or
    "llama-server" (from the same pin, ``python build.py --tools``)."""
    if which == "serve":
        return [sys.executable, "-m", "pyllama_spec", "serve"]
    from pyllama_spec import native_build

    path = native_build.find_llama_server()
    if path is None:
        raise FileNotFoundError("llama-server is not built (python build.py --tools builds it)")
    return [str(path)]


def prepare(folder: Path, which: str) -> Path:
    """The suite copied under ``folder`` with its launcher, the wget stand-in and ./tmp's files; returns
    the folder to run pytest in."""
    root = folder / "tests"
    shutil.copytree(pinned_tests(), root)
    models = folder / "models"
    models.mkdir(exist_ok=True)
    launcher = root / "llama-server-stand-in"
    launcher.write_text(_LAUNCHER.format(python=sys.executable, stand_ins=stand_ins(models),
                                         server=server_command(which)))
    launcher.chmod(0o755)
    (root / "wget.py").write_text(_WGET)
    tmp = root / "tmp"
    tmp.mkdir(exist_ok=True)
    for name, path in downloads(models).items():
        shutil.copyfile(path, tmp / name)
    return root


def run(root: Path, files: tuple[str, ...] = (), *, timeout: float = 7200, extra: tuple[str, ...] = ()
        ) -> dict[str, str]:
    """Each test's outcome ("passed", "failed", "error", "skipped"), by its id (``unit/FILE::TEST``),
    read from pytest's JUnit XML report (test ids may hold spaces)."""
    from pyllama_spec.devtools.rpc_server import free_port

    # PORT: the harness's server port (8080 by default), a free one so that two runs can go at once
    env = dict(os.environ, LLAMA_SERVER_BIN_PATH=str(root / "llama-server-stand-in"), PYTHONDONTWRITEBYTECODE="1",
               PORT=os.environ.get("PORT") or str(free_port()))
    repo = Path(__file__).resolve().parents[2]  # this checkout, for `python -m pyllama_spec` in the launcher
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    report = root / "report.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=line", f"--junit-xml={report}",
           *extra, *(f"unit/{f}" for f in files or ("",))]
    res = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout, env=env)
    if not report.exists():
        raise RuntimeError(f"pytest wrote no report:\n{res.stdout[-3000:]}\n{res.stderr[-2000:]}")
    return outcomes_of(report)


def outcomes_of(report: Path) -> dict[str, str]:
    import xml.etree.ElementTree as ET

    outcomes: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        test = f"{module}.py::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcome = ("error" if "error" in kinds else "failed" if "failure" in kinds else
                   "skipped" if "skipped" in kinds else "passed")
        if outcomes.get(test) in (None, "passed"):  # a test that passed and then errored in teardown: an error
            outcomes[test] = outcome
    return outcomes


def main(argv: list[str] | None = None) -> int:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", choices=("serve", "llama-server"), default="serve")
    ap.add_argument("--write", help="write the outcomes as JSON to this file")
    ap.add_argument("--deselect", action="append", default=[], help="a test id pytest leaves out (repeatable)")
    ap.add_argument("files", nargs="*", help="test files of tools/server/tests/unit (default: all)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        outcomes = run(prepare(Path(tmp), a.server), tuple(a.files),
                       extra=tuple(x for d in a.deselect for x in ("--deselect", d)))
    for test, outcome in sorted(outcomes.items()):
        print(f"{outcome:8} {test}")
    counts = {k: sum(v == k for v in outcomes.values()) for k in ("passed", "failed", "error", "skipped")}
    print(" ".join(f"{n} {k}" for k, n in counts.items()))
    if a.write:
        Path(a.write).write_text(json.dumps(dict(sorted(outcomes.items())), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
