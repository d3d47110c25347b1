"""llama.cpp's GBNF grammars, checked natively, and llama-server's JSON-schema converter.

Both are llama.cpp's own code (the grammar parser in libllama, common/json-schema-to-grammar
in libllama-common) reached through the shim, which turns their C++ exceptions into errors:
a schema or grammar behaves here as it does in llama-server.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from pyllama_spec._native import ffi, lib


class GrammarError(ValueError):
    """A GBNF grammar or a JSON schema llama.cpp refused; the message says why."""


def _last_error() -> str:
    return ffi.string(lib.pyllama_last_error()).decode("utf-8", errors="replace")


#: The most stacks llama.cpp's grammar engine may follow: after one advance of one stack, after one
#: accepted character from one stack (both counted on the grammar, ``grammar_cost``), and while
#: sampling (checked after every token: an ambiguous grammar can double them at every token, which
#: no count of the grammar alone sees; past the bound, sampling fails with GrammarError).
#: ``root ::= (.?){N} "b"`` makes N + 1 paths and N (N + 1) / 2 after a character: on the embedded pair's
#: vocabulary of 269, 16 tokens took 0.44 s at N = 25 and 2.5 s at 250 (a plain grammar: 0.006 s). The
#: grammars of JSON schemas within their own limit (290 optional properties: about 900 after a
#: character) and of 100 tools on every template of the pinned source (Llama 3.1's format the largest:
#: about 1,700) stay inside.
MAX_GRAMMAR_STACKS = 4096
#: While sampling, also at most this many stacks times the vocabulary: sampling walks the candidate
#: tokens once per stack, about 4 ms a stack a token on Gemma 3's 262,144 (1,024 stacks there, some
#: 4 s a token at worst; 2,093 on Llama 3.1's 128,256, where 100 tools take about 1,700).
#: bench/RESULTS.md, "Grammars the sampler cannot afford".
MAX_GRAMMAR_STACKS_TIMES_VOCAB = 2 ** 28
lib.pyllama_grammar_limit(MAX_GRAMMAR_STACKS, float(MAX_GRAMMAR_STACKS_TIMES_VOCAB))


class GrammarCost(NamedTuple):
    """What llama.cpp's grammar engine will follow, counted on the parsed rules (paths: an upper bound of
    its distinct stacks); all -1 for a left-recursive grammar."""

    stacks: float  # the most one advance of one stack makes
    after_char: float  # the most one accepted character makes, from one stack
    first: float  # the first advance's, from the root (what the first token is sampled over)


def grammar_cost(gbnf: str) -> GrammarCost:
    """The grammar's ``GrammarCost``, in time linear in its rules. GrammarError unless ``gbnf`` parses
    with a ``root`` rule."""
    cost = ffi.new("double[3]")
    if lib.pyllama_grammar_check(gbnf.encode(), cost) != 0:
        raise GrammarError(f"the grammar does not parse: {_last_error()}")
    return GrammarCost(cost[0], cost[1], cost[2])


def check_grammar(gbnf: str, n_vocab: int | None = None) -> None:
    """Raise GrammarError unless ``gbnf`` parses and has a ``root`` rule (llama.cpp's parser), is not
    left-recursive, and its engine's stacks stay within ``MAX_GRAMMAR_STACKS`` (``grammar_cost``) and,
    for a vocabulary of ``n_vocab`` tokens, its first ones within ``MAX_GRAMMAR_STACKS_TIMES_VOCAB``."""
    cost = grammar_cost(gbnf)
    if cost.stacks < 0:
        # llama.cpp's own check misses a rule that is empty only through another: its sampler then
        # grows stacks until the memory is gone
        raise GrammarError("the grammar is left-recursive: a rule can come back to itself before a character is "
                           "read (through rules that may be empty); llama.cpp cannot sample it")
    if max(cost.stacks, cost.after_char) > MAX_GRAMMAR_STACKS:
        raise GrammarError(
            f"the grammar lets too many items be skipped in a row: llama.cpp's grammar engine would follow up to "
            f"{_count(cost.stacks)} paths at once, {_count(cost.after_char)} after one character; at most "
            f"{MAX_GRAMMAR_STACKS} are taken: make fewer adjacent items optional (x? x? x? ... is costly, "
            "x{0,n} is not)")
    if n_vocab and cost.first * n_vocab > MAX_GRAMMAR_STACKS_TIMES_VOCAB:
        raise GrammarError(
            f"the grammar starts with {_count(cost.first)} paths at once; with a vocabulary of {n_vocab} tokens at "
            f"most {MAX_GRAMMAR_STACKS_TIMES_VOCAB // n_vocab} are taken (sampling checks every token once per path)")


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
