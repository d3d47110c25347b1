"""llama.cpp's grammar tools as the layers above the engine use them: check a GBNF grammar, and turn
a JSON schema into one (llama-server's json-schema-to-grammar). Both raise ``GrammarError`` (a
ValueError) with llama.cpp's reason."""

from __future__ import annotations

from pyllama_spec.bindings.grammar import GrammarError, check_grammar, json_schema_to_grammar

__all__ = ["GrammarError", "check_grammar", "json_schema_to_grammar"]
