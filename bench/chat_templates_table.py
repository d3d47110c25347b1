#!/usr/bin/env python3
"""The per-family table of bench/RESULTS.md's "Agents" section: every chat template of the pinned
source renders an agent turn (two tools, an image, an assistant's tool call with its reasoning, the
tool's result, a follow-up) here and on llama-server built from the pin (`/apply-template`, same
tiny model), and the parser sample cases (tests/chat_samples.py: llama.cpp's test-chat.cpp outputs,
which tests/test_chat_tools.py parses) per family. Needs llama-server (python build.py --tools).

    python bench/chat_templates_table.py > /tmp/table.md
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from chat_samples import MALFORMED, SAMPLES  # noqa: E402
from serving import http  # noqa: E402
from test_chat_tools import AGENT_TURN, TEMPLATE_NAMES, TEMPLATES, _LlamaServer, _ours, _template  # noqa: E402

import pyllama_spec as ps  # noqa: E402
from pyllama_spec.devtools import tiny  # noqa: E402

#: A family per file-name fragment, first match wins (more specific fragments first).
FAMILIES = [("qwen3.5", "Qwen3.5"), ("qwen3-coder", "Qwen3-Coder"), ("qwq", "Qwen (QwQ)"), ("qwen3", "Qwen3"),
            ("qwen2.5", "Qwen2.5"), ("mimo-vl", "MiMo-VL (Qwen2.5-VL based)"), ("hermes", "Hermes (NousResearch)"),
            ("llama-3", "Llama 3.x"), ("distill-llama", "DeepSeek R1 distills"), ("distill-qwen", "DeepSeek R1 distills"),
            ("deepseek-r1", "DeepSeek R1 distills"), ("deepseek", "DeepSeek V3/V4"), ("devstral", "Mistral"),
            ("ministral", "Mistral"), ("mistral", "Mistral"), ("gemma-4", "Gemma 4"), ("gemma-2", "Gemma 2"),
            ("kimi", "Kimi"), ("glm", "GLM"), ("minimax", "MiniMax"), ("cohere", "Cohere Command"),
            ("granite", "IBM Granite"), ("functionary", "Functionary"), ("gpt-oss", "GPT-OSS"), ("lfm", "LFM"),
            ("nemotron", "NVIDIA Nemotron"), ("apriel", "Apriel"), ("seed-oss", "Seed-OSS"), ("gigachat", "GigaChat"),
            ("laguna", "poolside Laguna"), ("phi-3", "Phi-3.5"), ("smollm", "SmolLM3"), ("rwkv", "RWKV World")]


@dataclasses.dataclass
class Row:
    name: str
    rendered: str  # "yes", "without tools" or "refused"
    as_llama_server: str


def family(name: str) -> str:
    low = name.lower()
    return next((fam for key, fam in FAMILIES if key in low), "other: " + name.removesuffix(".jinja"))


def render_all(models) -> list[Row]:
    rows = []
    for name in TEMPLATE_NAMES:
        theirs = _LlamaServer(["-m", str(models.target), "--mmproj", str(models.mmproj), "-c", "512", "-np", "1",
                               "--no-warmup", "-t", "1", "--chat-template-file", str(TEMPLATES / name)])
        try:
            try:
                engine = ps.load(models.target, n_ctx=256, n_threads=1, chat_template=_template(name))
            except ValueError:
                rows.append(Row(name, "refused at load", "refused at start" if theirs.refused else "served there"))
                continue
            with engine:
                (s1, a), (s2, b) = _ours(engine, AGENT_TURN), http(theirs.url, "/apply-template", AGENT_TURN)
            rendered = ("refused" if s1 != 200 else "yes" if "Get the current time" in a["prompt"] else "without tools")
            same = ("same prompt" if s1 == s2 == 200 and a == b else "both 400" if s1 == s2
                    else f"{s1} here, {s2} there")
            rows.append(Row(name, rendered, same))
        finally:
            theirs.stop()
    return rows


def markdown(rows: list[Row]) -> str:
    samples = collections.Counter(c[0] for c in SAMPLES)
    malformed = collections.Counter(c[0] for c in MALFORMED)
    words = {"yes": "yes", "without tools": "yes, without the tools (the template has no place for them)",
             "refused": "refused: the template raises on this turn", "refused at load": "refused at load"}
    groups: dict[str, list[Row]] = collections.defaultdict(list)
    for r in rows:
        groups[family(r.name)].append(r)
    out = ["| family | templates | agent turn rendered (tools, image, tool call + result, reasoning) "
           "| parser cases (test-chat.cpp's outputs + malformed) | as llama-server |", "|---|---|---|---|---|"]
    for fam in sorted(groups):
        rs = groups[fam]
        ok, bad = sum(samples[r.name] for r in rs), sum(malformed[r.name] for r in rs)
        parsed = (f"{ok} + {bad}, parsed as llama.cpp's test expects" if ok or bad
                  else "no sample output in test-chat.cpp (the parser is llama.cpp's for the format it detects)")
        names = ", ".join(f"`{r.name.removesuffix('.jinja')}`" for r in rs)
        out.append(f"| {fam} | {names} | "
                   f"{'; '.join(sorted({words[r.rendered] for r in rs}))} | {parsed} | "
                   f"{'; '.join(sorted({r.as_llama_server for r in rs}))} |")
    return "\n".join(out)


def main() -> int:
    models = tiny.make_tiny_set(Path(tempfile.mkdtemp()), arch="hunyuan_vl", seed=0, window=32, predictable=0.5)
    print(markdown(render_all(models)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
