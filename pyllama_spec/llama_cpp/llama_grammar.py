"""``LlamaGrammar`` as llama-cpp-python has it: a GBNF grammar that constrains a completion. The
grammar is checked by llama.cpp's own parser when it is made (as llama-cpp-python parses it then),
and a JSON schema becomes the grammar llama-server makes of it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pyllama_spec.serving.grammars import check_grammar, json_schema_to_grammar

LLAMA_GRAMMAR_DEFAULT_ROOT = "root"


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
        """The grammar of a JSON schema (its JSON text, or a dict)."""
        text = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
        return cls(_grammar=json_schema_to_grammar(text))

    @property
    def grammar(self) -> str:
        return self._grammar

    def __repr__(self) -> str:
        return f"LlamaGrammar({self._grammar[:60]!r}{'...' if len(self._grammar) > 60 else ''})"
