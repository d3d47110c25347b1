"""The prompts llama-cpp-python 0.3.36's named chat formats make of a few conversations, and the grammars
its converter makes of a few JSON schemas, recorded from the real package so that the facade's
(``pyllama_spec.llama_cpp.chat_formats``, ``LlamaGrammar.from_json_schema``) are compared with them.

    python -m pyllama_spec.devtools.llama_cpp_python_formats --python /venv/bin/python \\
        --write bench/llama_cpp_python_chat_formats_0.3.36.json

``--python``: an interpreter with the real llama-cpp-python 0.3.36 (built from the sdist the build cache
downloads: ``pip install --no-build-isolation <sdist>``). Without ``--write`` it prints the record.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

#: The conversations every format renders: a user alone, a system prompt and turns, an assistant turn
#: without content, content as parts, and roles a format may not know (tool, function).
CONVERSATIONS: list[list[dict]] = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hey."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": None},
     {"role": "user", "content": [{"type": "text", "text": "in parts"}]}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "Call it."},
     {"role": "assistant", "content": "ok"}, {"role": "tool", "content": "42", "tool_call_id": "c1"},
     {"role": "function", "name": "f", "content": "43"}, {"role": "user", "content": "And?"}],
]

#: The schemas whose grammars are recorded: objects with required and optional properties, arrays with
#: bounds, strings with a length, enums, nesting, references, and tool parameters.
SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "size": {"type": "number"},
                                      "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                                               "maxItems": 3}, "ok": {"type": "boolean"}},
     "required": ["name"]},
    {"type": "array", "items": {"enum": ["red", "green", 3, None]}},
    {"type": "object", "properties": {"inner": {"$ref": "#/$defs/point"}}, "$defs": {
        "point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                  "required": ["x", "y"]}}},
    {"type": "string", "pattern": "^[a-z]{2,4}-[0-9]+$"},
    {},
]

_RENDER = r'''
import json, re, sys
import llama_cpp.llama_chat_format as L
from llama_cpp.llama_grammar import json_schema_to_gbnf
given = json.loads(sys.stdin.read())
conversations = given["conversations"]
source = open(L.__file__).read()
out = {}
for name, function in re.findall(r'@register_chat_format\("([^"]+)"\)\s*\ndef (\w+)', source):
    rendered = []
    for messages in conversations:
        r = getattr(L, function)(messages=messages)
        rendered.append({"prompt": r.prompt, "stop": r.stop, "added_special": r.added_special})
    out[name] = rendered
grammars = [json_schema_to_gbnf(json.dumps(schema)) for schema in given["schemas"]]
print(json.dumps({"formats": out, "grammars": grammars}, sort_keys=True))
'''


def record(python: str) -> dict:
    """What the real package's formats make of ``CONVERSATIONS`` (by format name), and its converter of
    ``SCHEMAS``."""
    given = {"conversations": CONVERSATIONS, "schemas": SCHEMAS}
    done = subprocess.run([python, "-c", _RENDER], input=json.dumps(given), capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{python} could not render llama-cpp-python's chat formats:\n{done.stderr[-2000:]}")
    return {"llama_cpp_python": "0.3.36", "conversations": CONVERSATIONS, "schemas": SCHEMAS,
            **json.loads(done.stdout)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", required=True, help="an interpreter with the real llama-cpp-python 0.3.36")
    ap.add_argument("--write", type=Path, help="write the record here (JSON)")
    args = ap.parse_args(argv)
    text = json.dumps(record(args.python), indent=1) + "\n"  # keys as given: a schema's properties keep their order
    if args.write:
        args.write.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
