"""mkdocs hook: the README.md sections the home page shows, and README's links pointed at the site's pages.

A page line ``--8<-- "README.md:name"`` is replaced by README.md's lines between its markers
``<!-- --8<-- [start:name] -->`` and ``<!-- --8<-- [end:name] -->`` (``--8<-- "FILE"``: the whole
file), so that the README and the site say the same thing. README's links are written for GitHub: a
link into another section (``#the-native-build``) is pointed at the page that holds it, and ``docs/...``
files are the site's own. A missing file or section stops the build.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_INCLUDE = re.compile(r'^--8<-- "([^":]+)(?::([a-z0-9-]+))?"$', re.MULTILINE)

# README's section anchors -> the page that holds them (mkdocs.yml's nav)
_PAGES = {
    "two-commands": "index.md", "the-native-build": "native-build.md", "python-api": "python-api.md",
    "from-llama-cpp-python-one-import": "python-api.md", "which-drafting-method": "python-api.md",
    "threads-streams-and-ctrl-c": "python-api.md", "several-conversations-at-once-slots": "python-api.md",
    "command-line": "command-line.md", "beyond-one-machine-rpc-and-several-gpus": "rpc.md",
    "http-server-openai-compatible": "server.md", "the-chat-page": "server.md",
    "benchmarks-and-the-trained-pair": "benchmarks.md", "layout": "layout.md",
}


def section(path: str, name: str | None) -> str:
    text = (ROOT / path).read_text(encoding="utf-8")
    if name is None:
        return text
    found = re.search(rf"^<!-- --8<-- \[start:{name}\] -->\n(.*?)^<!-- --8<-- \[end:{name}\] -->$", text,
                      re.MULTILINE | re.DOTALL)
    if found is None:
        raise ValueError(f"{path} has no section {name!r} (its <!-- --8<-- [start:{name}] --> markers)")
    return re.sub(r"^<!-- --8<-- \[(start|end):[a-z0-9-]+\] -->\n", "", found.group(1), flags=re.MULTILINE)


def on_page_markdown(markdown: str, page, **_) -> str:
    markdown = _INCLUDE.sub(lambda m: section(m.group(1), m.group(2)), markdown)
    here = page.file.src_uri

    def anchor(m: re.Match) -> str:
        target = _PAGES.get(m.group(1))
        return m.group(0) if target in (None, here) else f"]({target}#{m.group(1)})"

    markdown = re.sub(r"\]\(#([a-z0-9-]+)\)", anchor, markdown)
    return markdown.replace("](docs/", "](").replace("](CHANGELOG.md)", "](changelog.md)")
