"""The code blocks of README.md and of the guide's pages (docs/: the API, the command line, the
server, several machines, ...) run as written, so the documentation cannot drift from the code.

Python blocks run in a fresh interpreter, in a folder where the file names they use
(t.gguf, m.gguf, d.gguf, photo.png) are the tiny models and a picture; a block that talks
to the server at 127.0.0.1:8080 gets a `pyllama-spec serve` on the embedded pair (on a
free port, written into the block). The server's bash block runs as written too, less its
install step (the test extra already installed the server extra).

Every block on the embedded pair (``ps.embedded_models()``, the server) must print code the
pair wrote: words that are not in the block itself, so an answer of whitespace (or one that
only echoes the prompt) fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT

README = (REPO_ROOT / "README.md").read_text()
#: The guide's pages with runnable examples, in the site's order (mkdocs.yml), after the README.
GUIDE_PAGES = ("native-build.md", "python-api.md", "command-line.md", "rpc.md", "server.md", "benchmarks.md")
DOCS = README + "".join((REPO_ROOT / "docs" / page).read_text() for page in GUIDE_PAGES)
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", DOCS, flags=re.DOTALL)
BASH_BLOCKS = re.findall(r"```bash\n(.*?)```", DOCS, flags=re.DOTALL)
SERVER = "127.0.0.1:8080"
RPC_HOSTS = ("192.168.1.20:50052", "192.168.1.21:50052")  # the RPC how-to's servers: loopback ones here
INSTALL_SERVER = 'python3 -m pip install -e ".[server]" && '
EMBEDDED = "ps.embedded_models()"
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def written_words(printed: str, source: str) -> set[str]:
    """The identifiers in ``printed`` that ``source`` does not contain: what the model wrote
    (none when it answered with whitespace or only the prompt came back)."""
    source = source.replace("\\n", "\n")  # an escaped newline in a literal ends the word before it
    return set(IDENTIFIER.findall(printed)) - set(IDENTIFIER.findall(source))


def assert_writes_code(printed: str, source: str) -> None:
    words = written_words(printed, source)
    assert len(words) >= 2, f"the block printed no code of the pair's ({sorted(words)}):\n{printed!r}"


def test_written_words_tell_code_from_whitespace():
    block = 'code = "def fibonacci(n):\\n    if n"\nprint(code + text)'
    assert not written_words("def fibonacci(n):\n    if n" + " " * 48, block)
    assert written_words("def fibonacci(n):\n    if not isinstance(object):", block) == {"not", "isinstance", "object"}
    assert not written_words("class Stack:", 'print("<__media__>\\nclass Stack:")')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served_embedded():
    """`pyllama-spec serve` on the embedded pair, on a free port; yields the port. One for the
    module: the client blocks only send it requests (sampled answers, no slot or setting changed)."""
    from serving import cli_server

    with cli_server("-t", "1") as url:
        yield int(url.rsplit(":", 1)[1])


def test_the_readme_has_the_blocks_it_should():
    assert any("ps.load" in b for b in PYTHON_BLOCKS)
    assert any(SERVER in b for b in PYTHON_BLOCKS)
    assert any("pyllama-spec serve" in b and "curl" in b for b in BASH_BLOCKS)
    # the first example (Python API) and the slots example run on files a newcomer has
    first = next(b for b in PYTHON_BLOCKS if "ps.load" in b)
    assert EMBEDDED in first and "t.gguf" not in first and "photo.png" not in first
    assert any(EMBEDDED in b and "n_parallel" in b and "t.gguf" not in b for b in PYTHON_BLOCKS)


@pytest.mark.parametrize("index", [i for i, b in enumerate(PYTHON_BLOCKS) if SERVER not in b])
def test_readme_python_block_runs_as_written(index, tiny_dense, big_image_png, run_python, tmp_path):
    for name, src in (("t.gguf", tiny_dense.target), ("m.gguf", tiny_dense.mmproj), ("d.gguf", tiny_dense.draft),
                      ("photo.png", big_image_png)):
        shutil.copy(src, tmp_path / name)
    code, servers = PYTHON_BLOCKS[index], []
    try:
        if any(h in code for h in RPC_HOSTS):
            from pyllama_spec.devtools.rpc_server import LocalRPCServer, server_binary

            if server_binary() is None:
                pytest.skip("this build has no ggml-rpc-server (python build.py --rpc) for the RPC how-to")
            for host in RPC_HOSTS:
                servers.append(LocalRPCServer(lifetime=300))
                code = code.replace(host, servers[-1].endpoint)
        res = run_python(code, cwd=tmp_path, timeout=300)
    finally:
        for server in servers:
            server.kill()
    assert res.returncode == 0, f"README block failed:\n{code}\n{res.stderr[-3000:]}"
    if EMBEDDED in code:  # the trained pair writes Python: the block must show some
        assert_writes_code(res.stdout, code)


@pytest.mark.parametrize("index", [i for i, b in enumerate(PYTHON_BLOCKS) if SERVER in b])
def test_readme_client_block_runs_against_the_server(index, served_embedded, run_python):
    code = PYTHON_BLOCKS[index].replace(SERVER, f"127.0.0.1:{served_embedded}")
    res = run_python(code, timeout=120)
    assert res.returncode == 0, f"README block failed:\n{code}\n{res.stderr[-3000:]}"
    assert "draft_n" in res.stdout
    # the answer's text, not the timings dict printed after it (its keys are words too)
    text = "\n".join(line for line in res.stdout.splitlines() if not line.startswith("{"))
    assert_writes_code(text, code)


def test_readme_server_bash_block_runs_as_written(tmp_path):
    block = next(b for b in BASH_BLOCKS if "pyllama-spec serve" in b and "curl" in b)
    assert block.startswith(INSTALL_SERVER)
    script = block[len(INSTALL_SERVER):].replace("8080", str(_free_port())) + "\nkill %1\n"
    script = script.replace("pyllama-spec serve", "pyllama-spec serve -t 1")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert '"chat.completion"' in res.stdout and '"draft_n"' in res.stdout, res.stdout[-2000:]
    answer = json.loads(next(line for line in res.stdout.splitlines() if '"chat.completion"' in line))
    assert_writes_code(answer["choices"][0]["message"]["content"], block)


def test_readme_tool_call_bash_block_runs_as_written(tmp_path):
    """The tool-call example: a server with a template that renders tools answers a forced call."""
    from pyllama_spec.bindings.native_info import build_record

    if not (Path(build_record().get("source", {}).get("path", "/nonexistent")) / "models" / "templates").is_dir():
        pytest.skip("the pinned llama.cpp source tree (its models/templates/) is not on this machine")
    block = next(b for b in BASH_BLOCKS if "pyllama-spec serve" in b and '"tools"' in b)
    script = block.replace("8081", str(_free_port())) + "\nkill %1\n"
    script = script.replace("pyllama-spec serve", "pyllama-spec serve -t 1")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    answer = json.loads(next(line for line in res.stdout.splitlines() if '"chat.completion"' in line))
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["click"]
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {}
    assert answer["timings"]["draft_n"] > 0


def test_the_two_commands_ci_runs_are_the_readmes_first_two():
    """.ci/run runs the README's "Two commands" as written, first then second, before anything else
    it installs, and checks them against the README with tools/readme_commands.py."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("readme_commands", REPO_ROOT / "tools" / "readme_commands.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    first, second = module.readme_commands(README)
    assert first == BASH_BLOCKS[0].strip() and second == BASH_BLOCKS[1].strip()
    assert first.startswith("python3 -m pip install -e .") and "pyllama-spec demo" in first
    assert second.startswith('python3 -m pip install -e ".[test]"') and "pytest" in second
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert "tools/readme_commands.py 1" in ci and "tools/readme_commands.py 2" in ci
    # the first things installed in the fresh venv: nothing before them can hide a failure
    runs = [line for line in ci.splitlines() if line.startswith("python3 -m pip")]
    assert runs[0].startswith(first + " ||") and runs[1].startswith(second + " ||"), runs[:2]
    assert ci.index(first + " ||") < ci.index(second + " ||") < ci.index("build.py --tools")


def test_an_image_chat_with_the_embedded_server_answers_with_code(served_embedded, tmp_path):
    """Issue 44: `serve` on the embedded pair answered a chat with a picture with blanks (60 spaces to
    the openai client); it writes Python now (DRY, given to the embedded pair)."""
    import base64
    import io
    import urllib.request

    from pyllama_spec.embedded import draw_demo_image

    buf = io.BytesIO()
    draw_demo_image(448).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "class Stack:"}]}],
            "max_tokens": 32, "temperature": 0}
    req = urllib.request.Request(f"http://127.0.0.1:{served_embedded}/v1/chat/completions",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        content = json.loads(r.read())["choices"][0]["message"]["content"]
    assert re.search(r"[A-Za-z_]{4,}", content), repr(content)
