"""llama.cpp's grammar tools as the layers above the bindings use them, with a cost check first.

llama.cpp's json-schema-to-grammar (llama-server's, and the chat templates' for tool parameters and
response formats) spends time that grows with the cube of an object's optional properties (an object of
800 optional properties takes 2 s here, 1,000 stall 3-9 s) and recurses once per optional property: about
20,000 overflow its stack and kill the process, llama-server's too. ``check_schema_cost`` walks a
schema first, in time linear in its size, and refuses one whose conversion would cost more than
``MAX_SCHEMA_COST`` (the sum over its objects of the cube of their optional properties: one object of
up to 290 optional properties, about 0.15 s) or that nests deeper than ``MAX_SCHEMA_DEPTH``.
``GrammarError`` (a ValueError) names the limit.
"""

from __future__ import annotations

import json
from typing import Any

from pyllama_spec.bindings.grammar import GrammarError
from pyllama_spec.bindings.grammar import check_grammar as _parse
from pyllama_spec.bindings.grammar import json_schema_to_grammar as _convert
from pyllama_spec.speculative.sampling import check_grammar_size

#: The most conversion work a schema may ask: the sum over its objects of (optional properties) ** 3.
MAX_SCHEMA_COST = 290 ** 3
#: The deepest a schema may nest (objects, arrays, combinators), as containers.
MAX_SCHEMA_DEPTH = 128

__all__ = ["GrammarError", "MAX_SCHEMA_COST", "MAX_SCHEMA_DEPTH", "check_grammar", "check_schema_cost",
           "json_schema_to_grammar"]


def check_grammar(gbnf: str) -> None:
    """Raise GrammarError unless ``gbnf`` parses and has a ``root`` rule (llama.cpp's parser: the
    bindings' ``check_grammar``, which the layers above call through this one), after the size check:
    a grammar whose repetitions would write out too many symbols, or whose ``{m,n}`` has n < m (the
    parser never ends on it), is refused before the parser sees it."""
    try:
        check_grammar_size(gbnf)
    except ValueError as e:  # the estimate's refusal, as the grammar tools' error
        raise GrammarError(str(e)) from None
    _parse(gbnf)


def check_schema_cost(schema: Any, what: str = "json_schema") -> None:
    """Refuse (GrammarError) a schema whose conversion to a grammar would cost more than the limits.
    A schema given as JSON text is parsed first; one that is not a schema is left to the converter."""
    if isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except ValueError:
            return  # the converter says what is wrong with it
    cost, stack = 0, [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"{what}: nested deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                required = node.get("required")
                required = set(required) if isinstance(required, list) and all(
                    isinstance(r, str) for r in required) else set()
                optional = sum(1 for name in props if name not in required)
                cost += optional ** 3
                if cost > MAX_SCHEMA_COST:
                    raise GrammarError(
                        f"{what}: an object with {optional} optional properties (or objects with that many together) "
                        f"makes a grammar too costly to build: at most {round(MAX_SCHEMA_COST ** (1 / 3))} optional "
                        "properties in one object; list more of them in 'required'")
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))


def json_schema_to_grammar(schema: Any) -> str:
    """The GBNF grammar llama-server makes of a JSON schema (a dict, or its JSON text), after the cost
    check; an empty schema means any JSON object, as there. GrammarError for a schema it refuses."""
    check_schema_cost(schema)
    return _convert(schema)
