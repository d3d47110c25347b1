"""llama.cpp's GBNF grammars, checked natively, and llama-server's JSON-schema converter.

Both are llama.cpp's own code (the grammar parser in libllama, common/json-schema-to-grammar
in libllama-common) reached through the shim, which turns their C++ exceptions into errors:
a schema or grammar behaves here as it does in llama-server.
"""

from __future__ import annotations

import json

from pyllama_spec._native import ffi, lib


class GrammarError(ValueError):
    """A GBNF grammar or a JSON schema llama.cpp refused; the message says why."""


def _last_error() -> str:
    return ffi.string(lib.pyllama_last_error()).decode("utf-8", errors="replace")


def check_grammar(gbnf: str) -> None:
    """Raise GrammarError unless ``gbnf`` parses and has a ``root`` rule (llama.cpp's parser)."""
    if lib.pyllama_grammar_check(gbnf.encode()) != 0:
        raise GrammarError(f"the grammar does not parse: {_last_error()}")


def json_schema_to_grammar(schema) -> str:
    """The GBNF grammar llama-server makes of a JSON schema (a dict, or its JSON text); an
    empty schema means any JSON object, as there. GrammarError for a schema it refuses."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    raw = text.encode()
    n = lib.pyllama_json_schema_to_grammar(raw, ffi.NULL, 0)
    if n < 0:
        raise GrammarError(f"json_schema: {_last_error()}")
    buf = ffi.new("char[]", n + 1)
    lib.pyllama_json_schema_to_grammar(raw, buf, n + 1)
    return ffi.string(buf, n).decode("utf-8")
