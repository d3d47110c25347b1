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


#: The most stacks llama.cpp's grammar engine may follow: after one advance of one stack, after one
#: accepted character from one stack (both counted on the grammar, ``grammar_cost``), and while
#: sampling (checked after every token: an ambiguous grammar can double them at every token, which
#: no count of the grammar alone sees; past the bound, sampling fails with GrammarError).
#: ``root ::= (.?){400} "b"`` (80,000 stacks after a character) took 6 s for 2 tokens on the embedded
#: pair's vocabulary of 269. The grammars of JSON schemas within their own limit (290 optional
#: properties: about 900 after a character) and of 100 tools on every template of the pinned source
#: (Llama 3.1's format the largest: about 1,700) stay inside.
MAX_GRAMMAR_STACKS = 4096
#: While sampling, also at most this many stacks times the vocabulary: sampling walks the candidate
#: tokens once per stack, about 4 ms a stack a token on Gemma 3's 262,144 (1,024 stacks there, some
#: 4 s a token at worst; 2,093 on Llama 3.1's 128,256, where 100 tools take about 1,700).
#: bench/RESULTS.md, "Grammars the sampler cannot afford".
MAX_GRAMMAR_STACKS_TIMES_VOCAB = 2 ** 28
lib.pyllama_grammar_limit(MAX_GRAMMAR_STACKS, float(MAX_GRAMMAR_STACKS_TIMES_VOCAB))


def grammar_cost(gbnf: str) -> tuple[float, float]:
    """(the most stacks one advance of llama.cpp's grammar engine makes, the most one accepted
    character makes), counted on the parsed rules in time linear in them; (-1, -1) for a grammar
    llama.cpp refuses for left recursion. GrammarError unless ``gbnf`` parses with a ``root`` rule."""
    cost = ffi.new("double[2]")
    if lib.pyllama_grammar_check(gbnf.encode(), cost) != 0:
        raise GrammarError(f"the grammar does not parse: {_last_error()}")
    return cost[0], cost[1]


def check_grammar(gbnf: str) -> None:
    """Raise GrammarError unless ``gbnf`` parses and has a ``root`` rule (llama.cpp's parser), and
    its engine's stacks stay within ``MAX_GRAMMAR_STACKS`` (``grammar_cost``)."""
    stacks, after_char = grammar_cost(gbnf)
    if max(stacks, after_char) > MAX_GRAMMAR_STACKS:
        raise GrammarError(
            f"the grammar lets too many items be skipped in a row: llama.cpp's grammar engine would follow "
            f"{_count(stacks)} paths at once, {_count(after_char)} after one character; at most {MAX_GRAMMAR_STACKS} "
            "are taken: make fewer adjacent items optional (x? x? x? ... is costly, x{0,n} is not)")


def _count(x: float) -> str:
    return f"{x:.3g}" if x >= 1e6 else f"{int(x)}"


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
