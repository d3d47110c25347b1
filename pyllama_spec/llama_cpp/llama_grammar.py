"""``LlamaGrammar`` as llama-cpp-python has it: a GBNF grammar that constrains a completion. The
grammar is checked by llama.cpp's own parser when it is made (as llama-cpp-python parses it then),
and a JSON schema becomes the grammar llama-cpp-python makes of it (its converter: ``schema_to_gbnf``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pyllama_spec.llama_cpp.schema_to_gbnf import json_schema_to_gbnf
from pyllama_spec.serving.grammars import GrammarError, check_grammar, check_schema_cost

LLAMA_GRAMMAR_DEFAULT_ROOT = "root"

#: llama-cpp-python's grammar of any JSON object (a chat format's ``response_format`` without a schema).
JSON_GBNF = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
"""


class LlamaGrammar:
    """A checked GBNF grammar; pass it as ``grammar=`` to ``create_completion`` or
    ``create_chat_completion``. ValueError (``GrammarError``) for one llama.cpp refuses."""

    def __init__(self, *args: Any, _grammar: str, **kwargs: Any) -> None:
        check_grammar(_grammar)
        self._grammar = _grammar
        self._root = LLAMA_GRAMMAR_DEFAULT_ROOT

    @classmethod
    def from_string(cls, grammar: str, verbose: bool = True) -> "LlamaGrammar":
        return cls(_grammar=grammar)

    @classmethod
    def from_file(cls, file: str | Path, verbose: bool = True) -> "LlamaGrammar":
        try:
            grammar = Path(file).read_text()
        except OSError as e:
            raise ValueError(f"cannot read the grammar file {file}: {e}") from e
        if not grammar.strip():
            raise ValueError(f"the grammar file {file} is empty")
        return cls.from_string(grammar, verbose=verbose)

    @classmethod
    def from_json_schema(cls, json_schema: str, verbose: bool = True) -> "LlamaGrammar":
        """The grammar llama-cpp-python makes of a JSON schema (its JSON text, or a dict): its own converter
        (``schema_to_gbnf``), after the cost check every schema gets here (``check_schema_cost``)."""
        text = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
        check_schema_cost(text)
        try:
            grammar = json_schema_to_gbnf(text)
        except ValueError as e:
            raise GrammarError(f"json_schema: {e}") from e
        except Exception as e:  # noqa: BLE001 - the copied converter's own failures (IndexError on "^*$", ...)
            raise GrammarError(f"json_schema: the schema cannot be converted ({type(e).__name__}: {e})") from e
        return cls(_grammar=grammar)

    @property
    def grammar(self) -> str:
        return self._grammar

    def __repr__(self) -> str:
        return f"LlamaGrammar({self._grammar[:60]!r}{'...' if len(self._grammar) > 60 else ''})"
