"""llama-server's samplers, grammars, JSON schemas, logit bias and logprobs, with drafts.

The contract that speculation keeps: greedy output equals target-only output, and seeded
sampling under "match" equals target-only output for the seed, whatever samplers are on; a
grammar's output always parses, and a drafted token the grammar forbids is rejected like any
other mismatch. On the trained tiny pair (the embedded default), whose DFlash draft accepts
often enough that a wrong bookkeeping of drafts would show.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import time
from pathlib import Path

import pytest
from conftest import N_THREADS, explain_child

import pyllama_spec as ps
from pyllama_spec.bindings.context import Context
from pyllama_spec.bindings.grammar import GrammarError, check_grammar, json_schema_to_grammar
from pyllama_spec.speculative.sampling import SamplingParams, distributions, sampler_order, sampling_params

PROMPT = 'def read_config(path):\n    """Read a configuration file and return a dict."""\n'
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "size": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["name", "size", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine():
    em = ps.embedded_models()
    with ps.load(em.target, draft=em.draft, n_ctx=2048, n_threads=N_THREADS) as e:
        yield e


def both(engine, **kw):
    """(with drafts, target only) for the same request."""
    return engine.generate(PROMPT, **kw), engine.generate(PROMPT, draft_max=0, **kw)


def test_greedy_with_a_grammar_equals_target_only_and_follows_the_grammar(engine):
    grammar = r'root ::= "    " [a-z_]+ " = " [a-z_]+ "(" [a-z_]* ")\n"'
    spec, plain = both(engine, max_tokens=40, grammar=grammar)
    assert spec.tokens == plain.tokens
    assert re.fullmatch(r"    [a-z_]+ = [a-z_]+\([a-z_]*\)\n", spec.text), spec.text
    assert spec.finish_reason == "stop"  # the grammar ended: only end-of-generation was left
    assert spec.stats.drafted > 0


def test_json_schema_output_parses_and_equals_target_only(engine):
    spec, plain = both(engine, max_tokens=120, json_schema=SCHEMA)
    assert spec.tokens == plain.tokens
    value = json.loads(spec.text)
    assert set(value) == {"name", "size", "ok"} and isinstance(value["size"], int) and isinstance(value["ok"], bool)
    s = spec.stats
    print(f"json_schema with DFlash: acceptance {s.acceptance_rate:.2f}, mean accepted length "
          f"{s.mean_accepted_length:.2f} over {s.generated_tokens} tokens")
    assert s.drafted > 0


def test_the_grammar_is_llama_servers_conversion_of_the_schema():
    g = json_schema_to_grammar(SCHEMA)
    assert g.startswith("name-kv ::=") or "root ::=" in g
    assert json_schema_to_grammar({}) == json_schema_to_grammar({"type": "object"})  # as llama-server
    with pytest.raises(GrammarError, match="json_schema"):
        json_schema_to_grammar("{not json")


@pytest.mark.parametrize("settings", [
    dict(repeat_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3, penalty_last_n=32),
    dict(dry_multiplier=0.8, dry_allowed_length=1),
    dict(xtc_probability=0.5, xtc_threshold=0.1),
    dict(typical_p=0.7, top_n_sigma=1.5),
    dict(mirostat=2, mirostat_tau=3.0),
    dict(samplers=["top_k", "temperature", "min_p"], dynatemp_range=0.3),
    dict(logit_bias={"32": -2.0, "10": 1.5}),
], ids=["penalties", "dry", "xtc", "typical-sigma", "mirostat", "order-dynatemp", "logit-bias"])
def test_seeded_match_sampling_equals_target_only_with_every_sampler(engine, settings):
    spec, plain = both(engine, max_tokens=48, temperature=0.9, seed=11, verify="match", **settings)
    assert spec.tokens == plain.tokens
    assert spec.stats.drafted > 0


def test_greedy_with_penalties_equals_target_only_and_changes_the_output(engine):
    spec, plain = both(engine, max_tokens=48, repeat_penalty=1.5, frequency_penalty=1.0)
    base = engine.generate(PROMPT, max_tokens=48)
    assert spec.tokens == plain.tokens != base.tokens


def test_a_forbidden_token_never_appears(engine):
    base = engine.generate(PROMPT, max_tokens=32)
    banned = base.tokens[0]
    spec, plain = both(engine, max_tokens=32, logit_bias={banned: False})
    assert banned not in spec.tokens and spec.tokens == plain.tokens


def test_logprobs_are_the_targets_whether_drafted_or_not(engine):
    spec, plain = (engine.stream(PROMPT, max_tokens=40, logprobs=3),
                   engine.stream(PROMPT, max_tokens=40, logprobs=3, draft_max=0))
    a = [(p, lp) for p in spec for lp in p.logprobs]
    b = [lp for p in plain for lp in p.logprobs]
    assert len(a) == len(b) == 40
    assert any(p.from_draft for p, _ in a)  # some tokens came from the draft
    for (_, x), y in zip(a, b):
        assert x.token == y.token
        assert x.logprob == pytest.approx(y.logprob, abs=2e-3)
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert x.top[0][1] >= x.logprob - 1e-9 and len(x.top) == 3
        assert all(lp <= 0 for _, lp in x.top)
    # greedy: every emitted token is the most likely one
    assert all(x.token == x.top[0][0] for (_, x) in a)


def test_logprobs_sum_to_one_over_the_vocabulary(engine):
    piece = next(iter(engine.stream(PROMPT, max_tokens=1, logprobs=engine.model.n_vocab if
                                    engine.model.n_vocab <= 100 else 100)))
    top = piece.logprobs[0].top
    assert sum(math.exp(lp) for _, lp in top) <= 1 + 1e-6


# --------------------------------------------------------------------------- post_sampling_probs


def _post_sampling(engine, prompt, n_probs=5, **kw):
    """(tokens, their TokenProb entries, pieces) of a generation with post_sampling_probs."""
    pieces = list(engine.stream(prompt, logprobs=n_probs, post_sampling_probs=True, **kw))
    return [t for p in pieces for t in p.tokens], [e for p in pieces for e in p.logprobs], pieces


def _target_rows(engine, prompt_ids: list[int], tokens: list[int]) -> np.ndarray:
    """The target's own logits (a context of its own, no draft) at each of ``tokens``: the row
    after the prompt and the tokens before it."""
    ids = [*prompt_ids, *tokens[:-1]]
    outputs = np.zeros(len(ids), dtype=bool)
    outputs[len(prompt_ids) - 1:] = True
    with Context(engine.model, n_ctx=512, n_batch=512, n_ubatch=512, n_threads=N_THREADS) as ctx:
        ctx.decode_tokens(ids, np.arange(len(ids)), outputs=outputs)
        return np.array(ctx.output_logits(len(tokens)))


@pytest.mark.parametrize("verify", ["match", "rejection"])
@pytest.mark.parametrize("settings", [
    dict(temperature=0.8),  # llama-server's chain (top-k 40, top-p 0.95, min-p 0.05) at 0.8
    # no top-k (the chain's sort is bounded by top-p), penalties over the last 8 tokens, a bias
    dict(temperature=1.5, top_k=0, top_p=0.9, min_p=0.0, repeat_penalty=1.3, frequency_penalty=0.2,
         presence_penalty=0.1, penalty_last_n=8, logit_bias={32: -1.0}),
])
def test_post_sampling_probs_are_the_chain_on_each_tokens_target_row(engine, settings, verify):
    """Every token's entry, drafted or not, is the numpy chain on the target's own logits at that
    position (decoded again here, target alone), the penalties seeing the tokens before it."""
    ids = [int(t) for t in engine.model.tokenize(PROMPT)]
    tokens, entries, pieces = _post_sampling(engine, ids, max_tokens=24, seed=7, verify=verify, **settings)
    assert pieces[-1].stats.prompt_tokens == len(ids)
    assert len(entries) == len(tokens) >= 12
    assert sum(p.from_draft for p in pieces) > 0  # tokens accepted from drafts have their entries too
    params = sampling_params(dict(settings), n_ctx=2048, n_vocab=engine.model.n_vocab)
    rows = _target_rows(engine, ids, tokens)
    for i, (tok, e) in enumerate(zip(tokens, entries)):
        want = distributions(rows[i][None], params, np.asarray(tokens[:i], dtype=np.int64))[0]
        assert e.token == tok and tok in want.ids  # the sampled token is in the chain's support
        assert e.prob == pytest.approx(want.prob_of(tok), abs=1e-3) and 0 < e.prob <= 1
        n = min(5, len(want.ids))
        assert [t for t, _ in e.top] == want.ids[:n].tolist(), i
        assert [p for _, p in e.top] == pytest.approx(want.probs[:n].tolist(), abs=1e-3)


def test_post_sampling_probs_follow_top_k_min_p_and_the_temperature(engine):
    """The chain's own rules, checked without its code: top-k 3 leaves at most 3 tokens (then the
    list sums to 1), min-p none below min_p x the best, and without a cut the probabilities are
    softmax(logits / T): the raw log-probabilities' (the ordinary logprobs) raised to 1 / T."""
    kw = dict(max_tokens=16, seed=3)
    _, entries, _ = _post_sampling(engine, PROMPT, temperature=1.0, top_k=3, **kw)
    assert any(len(e.top) == 3 for e in entries)
    for e in entries:
        assert len(e.top) <= 3 and sum(p for _, p in e.top) == pytest.approx(1.0)
        assert e.token in [t for t, _ in e.top] and e.prob == dict(e.top)[e.token]
    _, entries, _ = _post_sampling(engine, PROMPT, n_probs=20, temperature=1.0, top_k=0, top_p=1.0, min_p=0.3, **kw)
    assert any(len(e.top) > 1 for e in entries)
    for e in entries:
        probs = [p for _, p in e.top]
        assert min(probs) >= 0.3 * probs[0] - 1e-12
        assert len(probs) == 20 or sum(probs) == pytest.approx(1.0)
    first = next(iter(engine.stream(PROMPT, max_tokens=1, logprobs=20))).logprobs[0]  # raw softmax
    raw = {t: math.exp(lp) for t, lp in first.top}
    for t_ in (1.0, 0.5, 2.0):
        e = _post_sampling(engine, PROMPT, n_probs=20, max_tokens=1, temperature=t_, top_k=0, top_p=1.0,
                           min_p=0.0)[1][0]
        assert [t for t, _ in e.top] == list(raw)  # the same order, nothing cut
        z = sum(p ** (1 / t_) for p in raw.values()) / sum(p for _, p in e.top)  # the listed tokens' share
        if t_ == 1.0:
            assert z == pytest.approx(1.0, rel=1e-3)  # the softmax over the whole vocabulary itself
        for t, p in e.top:
            assert p == pytest.approx(raw[t] ** (1 / t_) / z, rel=1e-3), (t_, t)


def test_post_sampling_probs_at_temperature_0_give_the_pick_alone(engine):
    tokens, entries, _ = _post_sampling(engine, PROMPT, max_tokens=12, grammar='root ::= "x"+')
    assert [(e.token, e.prob, e.top) for e in entries] == [(t, 1.0, ((t, 1.0),)) for t in tokens]


@pytest.mark.parametrize("setting, name", [
    (dict(grammar='root ::= "a"+'), "grammar"),
    (dict(json_schema=SCHEMA), "grammar"),
    (dict(mirostat=2), "mirostat"),
    (dict(dry_multiplier=0.8), "dry_multiplier"),
    (dict(samplers=["temperature", "top_k"]), "samplers"),
])
def test_post_sampling_probs_refuse_what_the_chain_cannot_reproduce(engine, setting, name):
    with pytest.raises(ValueError, match=f"post_sampling_probs.*sets {name}"):
        engine.generate(PROMPT, max_tokens=2, temperature=0.8, logprobs=2, post_sampling_probs=True, **setting)
    # without it, or without probabilities asked, the same request runs
    assert engine.generate(PROMPT, max_tokens=2, temperature=0.8, logprobs=2, **setting).tokens
    assert engine.generate(PROMPT, max_tokens=2, temperature=0.8, post_sampling_probs=True, **setting).tokens


@pytest.mark.parametrize("n_vocab", [300, 5000])
def test_the_chain_without_top_k_sorts_only_what_it_can_keep_and_gives_the_whole_sorts_answer(n_vocab):
    """Without top-k, top-p and min-p are found from a threshold (sampling._untruncated): the same
    tokens, order and probabilities as sorting the whole row, here sorted whole (ties included)."""
    rng = np.random.default_rng(n_vocab)
    for _ in range(200):
        x = rng.normal(size=n_vocab) * rng.choice([0.2, 1.0, 4.0])
        if rng.random() < 0.3:
            x = np.round(x, 1)  # ties, which stay in id order
        if rng.random() < 0.3:
            x[rng.integers(0, n_vocab, n_vocab // 3)] = -np.inf
        params = SamplingParams(temperature=float(rng.choice([0.5, 1.0])), top_k=0,
                                top_p=float(rng.choice([0.5, 0.9, 0.99, 1.0])), min_p=float(rng.choice([0.0, 0.0, 0.05])))
        got = distributions(x[None], params)[0]
        order = np.argsort(-x, kind="stable")
        p1 = np.exp(x[order] - x[order[0]])
        p1 /= p1.sum()
        keep = p1 >= params.min_p * p1[0]
        if params.top_p < 1.0:
            keep &= np.cumsum(p1) - p1 < params.top_p  # the mass of the better tokens
        keep[0] = True
        v = x[order][keep] / params.temperature
        want = np.exp(v - v.max())
        assert got.ids.tolist() == order[keep].tolist()
        np.testing.assert_allclose(got.probs, want / want.sum(), rtol=1e-9)


def test_rejection_refuses_samplers_it_cannot_apply(engine):
    with pytest.raises(ValueError, match="grammar.*verify='match'"):
        engine.generate(PROMPT, max_tokens=4, temperature=0.8, verify="rejection", grammar='root ::= "a"')
    # the numpy chain's own settings are fine
    engine.generate(PROMPT, max_tokens=4, temperature=0.8, verify="rejection", logit_bias={5: -1.0},
                    frequency_penalty=0.5)


@pytest.mark.parametrize("bad, match", [
    (dict(grammar="root ::= foo"), "undefined rule identifier 'foo'"),
    (dict(grammar='x ::= "a"'), "no 'root' rule"),
    # root named only in a zero repetition: a symbol and no rule (llama.cpp read past its rules: a crash
    # the HTTP fuzz test found)
    (dict(grammar="r1 ::= root{0} | root{0}"), "no 'root' rule"),
    (dict(grammar="root ::= " + "(" * 300 + '"a"' + ")" * 300), "nests groups 300 deep"),
    (dict(grammar='root ::= "' + "a" * 300_000 + '"'), "at most"),
    # the grammar, smaller: its repetitions write out 2.4 million symbols (half a second here)
    (dict(grammar="root ::= r0\n" + "".join(f'r{i} ::= "x"{{0,2000}}\n' for i in range(300))),
     "about 2400302 symbols once written out"),
    (dict(grammar="root ::= root \"a\""), "left-recursive"),  # left recursion: refused before llama.cpp sees it
    (dict(json_schema={"type": "object", "properties": 5}), "json_schema"),
    (dict(logit_bias={10**9: 1.0}), "not in the vocabulary"),
    (dict(logit_bias=[[1, "x"]]), "must be a number"),
    (dict(samplers=["top_k", "nope"]), "unknown sampler"),
    (dict(mirostat=3), "mirostat must be"),
    (dict(repeat_penalty=0.0), "repeat_penalty"),
    (dict(top_k=1.5), "top_k must be an integer"),
    (dict(logprobs=-1), "logprobs"),
])
def test_bad_sampling_settings_are_refused_before_anything_runs(engine, bad, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(PROMPT, max_tokens=4, **bad)
    assert engine.generate(PROMPT, max_tokens=4).tokens  # and the engine still works


@pytest.mark.parametrize("gbnf, symbols", [
    ('root ::= "abc" [a-z]', 7),  # each rule's name, a literal's characters, a class's
    ('root ::= "x"{0,2000}', 1 + 2000 + 3 * 2000),  # 2,000 copies, each optional one a rule of its own
    ('root ::= ("a" [b-c]){3}', 8),  # a group is repeated as one reference to its rule
    ('root ::= ( ("x"){0,10} ){0,10}', 82),  # nested repetitions do not multiply what is written out
    ('root ::= "x"{0,150000}', 5),  # above 2,000, llama.cpp reads no maximum: x{0,}
    ('root ::= "{0,9999}" [{}] # x{0,9999}\n', 11),  # braces in literals, classes and comments are not repetitions
    ('root ::= ("x"{0, # a comment\n 2000})', 1 + 2000 + 3 * 2000 + 1),  # nor do comments hide one
    ('root ::= a | b\na ::= "x"+\nb ::= "y"*', 14),
    # a repetition of a repetition copies all of it again, as llama.cpp's does (its last_sym_start stays)
    ('root ::= "' + "a" * 1000 + '"{1}{2000}', 1 + 1000 + 1000 * 1999),  # {n}: n copies, no rules
    ('root ::= ("ab" # a comment is a space\n{2000})', 1 + 2 + 2 * 1999 + 1),
    ('root ::= "x"{0000000000000000002000}', 1 + 2000),  # every digit is read, leading zeros and all
])
def test_a_grammars_written_out_size_is_estimated_from_its_text(gbnf, symbols):
    from pyllama_spec.speculative.sampling import _parsed_size

    assert _parsed_size(gbnf)[1] == symbols


@pytest.mark.parametrize("gbnf", [
    'root ::= "a"{' + "#" * 40,  # backtracking over comments in braces took days at 40
    'root ::= "a"{' + " " * 200_000 + "x",  # and quadratic time over spaces
    'root ::= "a"{' + "#\n" * 100_000 + "1}",  # each comment's end is found once, not searched to the end
    "root ::= " + "[" * 200_000, 'root ::= ' + '"' * 200_001, "root ::= " + "{" * 100_000,  # unterminated
])
def test_the_estimate_takes_time_linear_in_the_grammar(gbnf):
    import time

    from pyllama_spec.speculative.sampling import check_grammar_size

    t0 = time.perf_counter()
    check_grammar_size(gbnf)  # what it is left to llama.cpp's parser to refuse
    assert time.perf_counter() - t0 < 2  # a few hundred ms at most on a loaded 2-core machine


def test_the_estimate_refuses_what_costs_and_takes_what_llama_cpp_parses_at_once(engine):
    hidden = "root ::= (" + '"x"{0,#\n2000}' * 300 + ")"  # comments in braces: 2.4 million symbols, 0.2 s
    with pytest.raises(ValueError, match="symbols once written out"):
        engine.generate(PROMPT, max_tokens=2, grammar=hidden)
    # a long string or array in a schema: llama.cpp writes "no maximum" past 2,000, at no cost
    engine.generate(PROMPT, max_tokens=2, json_schema={"type": "string", "maxLength": 150_000})
    engine.generate(PROMPT, max_tokens=2, json_schema={"type": "array", "items": {"type": "integer"},
                                                       "maxItems": 100_000})


@pytest.mark.parametrize("gbnf, limit", [
    # llama.cpp ends a comment at "\r" too: the rest of the text is grammar (it crashed the parser's stack,
    # or took a gigabyte, hidden from the estimate)
    ("# c\rroot ::= " + "(" * 100_000 + '"x"' + ")" * 100_000, "nests groups"),
    ('# c\rroot ::= "' + "x" * 30_000 + '"{2000}\r', "symbols once written out"),
    ('root ::= ("x"{#\r1} "' + "y" * 30_000 + '"{2000})', "symbols once written out"),
    # each group and optional rule is named after its rule: a long name costs again with every one (1 GB)
    ('root ::= "x"\n' + "A" * 30_000 + " ::= " + ".?" * 30_000, "names"),
    ('root ::= "x"\n' + "A" * 200_000 + " ::= " + '("x")' * 200, "names"),  # groups alone (40 MB of names)
], ids=["comment ended by CR", "CR after a repetition", "CR in braces", "long rule name", "long name, groups"])
def test_the_estimate_reads_what_llama_cpps_parser_reads(gbnf, limit):
    from pyllama_spec.speculative.sampling import check_grammar_size

    with pytest.raises(ValueError, match=limit):
        check_grammar_size(gbnf)


@pytest.mark.parametrize("kwargs", [
    {"grammar": 'root ::= "x"{2,1}'},
    {"json_schema": {"type": "array", "items": {"type": "string"}, "minItems": 5, "maxItems": 2}},
    {"json_schema": {"type": "string", "minLength": 5, "maxLength": 2}},
], ids=["grammar", "minItems over maxItems", "minLength over maxLength"])
def test_a_repetition_whose_maximum_is_below_its_minimum_is_refused_before_the_parser(engine, kwargs):
    """llama.cpp's parser computes n - m of x{m,n} unsigned: with n < m it writes rules until the memory
    is gone (llama-server from the pin, capped at 6 GB: a 400 after 22 s). JSON schemas convert to such
    a repetition, so do the facade's grammars."""
    from pyllama_spec.llama_cpp.llama_grammar import LlamaGrammar
    from pyllama_spec.serving.grammars import GrammarError

    with pytest.raises(ValueError, match="the maximum is below the minimum"):
        engine.generate(PROMPT, max_tokens=2, **kwargs)
    if "grammar" in kwargs:
        with pytest.raises(GrammarError, match="the maximum is below the minimum"):
            LlamaGrammar.from_string(kwargs["grammar"])
    assert engine.generate(PROMPT, max_tokens=2, grammar='root ::= "x"{1,1}').text == "x"


@pytest.mark.parametrize("n", [1, 25, 127, 400])
def test_the_grammar_cost_counts_the_paths_of_optional_items_in_a_row(n):
    """(.?){n} "b": one advance makes n + 1 paths (a "." at each of the n places, or the "b"), the first
    from the root too, and a character accepted from the first makes n + (n - 1) + ... + 1 (each "."
    matched, advanced again)."""
    from pyllama_spec.bindings.grammar import grammar_cost

    assert grammar_cost(f'root ::= (.?){{{n}}} "b"') == (n + 1, n * (n + 1) / 2, n + 1)


def test_the_grammar_cost_of_everyday_grammars_is_small():
    from pyllama_spec.bindings.grammar import MAX_GRAMMAR_STACKS, grammar_cost

    # a bounded repetition nests: no run (the root may be empty: the first advance has its empty stack too)
    assert grammar_cost('root ::= [a-z]{0,2000} "x"*') == (2, 3, 3)
    # x+ of an x that may be empty comes back to its rule before a character, but last in its alternative:
    # the engine meets the same stack again (chat templates' tool grammars: "(tool-call? space)+")
    assert max(grammar_cost('root ::= ("a"? " "?)+ "b"')) < 20
    assert max(grammar_cost(json_schema_to_grammar(SCHEMA))) < 100
    many = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(290)}}  # the schema limit
    assert max(grammar_cost(json_schema_to_grammar(many))) < MAX_GRAMMAR_STACKS / 4
    # the ways an item can be empty make no stacks of their own (an empty derivation pops what it
    # pushes): 12 nested pairs of optional items start with 25 paths, not the 12,286 of counting each way
    nested = grammar_cost('root ::= (("a"? "b"?)?){12} "z"')
    assert nested.stacks == 25 and max(nested) < MAX_GRAMMAR_STACKS / 10


def test_rules_that_start_with_each_other_count_the_stacks_of_them_all():
    """a ::= e s | "q0" | ... and s ::= e a | "x" (e empty) start with each other, last in their
    alternatives: from either, the engine reaches the first terminals of both (2,001). Forty optional
    s in a row then make 80,041 stacks at the first advance; counting s without a's terminals said 2,042
    (a helper's review), and it was taken."""
    from pyllama_spec.bindings.grammar import grammar_cost

    alternatives = " | ".join(f'"q{i}"' for i in range(2000))
    grammar = (f'root ::= a | t\na ::= e s | {alternatives}\ns ::= e a | "x"\ne ::= y\ny ::= ""\n'
               f't ::= {"s? " * 40}"end"')
    cost = grammar_cost(grammar)
    assert cost.first >= 80_041
    with pytest.raises(GrammarError, match="paths at once"):
        check_grammar(grammar)


def test_the_grammar_cost_of_llama_cpps_example_grammars_is_small():
    from pyllama_spec.bindings.grammar import grammar_cost
    from pyllama_spec.bindings.native_info import build_record

    source = build_record().get("source", {}).get("path")
    grammars = sorted(Path(source or "/nonexistent").joinpath("grammars").glob("*.gbnf"))
    if not grammars:
        pytest.skip("the pinned llama.cpp source tree (its grammars/) is not on this machine")
    for path in grammars:
        assert max(grammar_cost(path.read_text())) < 100, path.name


@pytest.mark.parametrize("grammar", [
    'root ::= root "a" | "b"',
    'root ::= x root "a" | "b"\nx ::= "c"?',
    # a turn through a rule that also ends its own alternative: "z" pushed at every turn (a helper's review)
    'root ::= s\ns ::= e b | e a "z"\nb ::= e a\na ::= e s | "q"\ne ::= "k"?',
], ids=["plain", "through a rule that may be empty", "through a rule the first search finished"])
def test_a_left_recursive_grammar_is_refused_before_the_sampler_sees_it(engine, grammar):
    """llama.cpp refuses the first at init, but misses the second (its check counts a rule as empty only
    when an alternative is literally empty), and its sampler then grew stacks until the process died
    (std::bad_alloc). Both are a GrammarError here, and the engine goes on."""
    from pyllama_spec.bindings.grammar import check_grammar, grammar_cost

    assert grammar_cost(grammar) == (-1, -1, -1)
    with pytest.raises(GrammarError, match="left-recursive"):
        check_grammar(grammar)
    with pytest.raises(GrammarError, match="left-recursive"):
        engine.generate(PROMPT, max_tokens=4, grammar=grammar)
    assert engine.generate(PROMPT, max_tokens=2).tokens


def test_a_grammar_of_too_many_optional_items_in_a_row_is_refused_before_sampling(engine):
    """root ::= (.?){400} "b" is 20 bytes and 80,200 paths after a character (at 250 items, 16 tokens took
    2.5 s where a plain grammar takes 6 ms); it is refused from its rules, by the engine and by the
    facade's LlamaGrammar; (.?){60} is taken."""
    from pyllama_spec.llama_cpp.llama_grammar import LlamaGrammar

    t0 = time.perf_counter()
    for grammar in ('root ::= (.?){400} "b"', 'root ::= ((" "?){100}){100}'):
        with pytest.raises(GrammarError, match="paths at once.*at most 4096"):
            engine.generate(PROMPT, max_tokens=2, grammar=grammar)
        with pytest.raises(GrammarError, match="paths at once"):
            LlamaGrammar.from_string(grammar)
    assert time.perf_counter() - t0 < 5
    assert engine.generate(PROMPT, max_tokens=3, grammar='root ::= (.?){60} "b"').tokens


def test_an_ambiguous_grammar_fails_once_its_stacks_pass_the_bound_and_the_engine_goes_on(engine):
    """r ::= "a" r "b" | "a" r "c" | "d": after n "a"s llama.cpp's engine follows 2^n stacks (every
    mix of the closers still owed), which no count of the grammar sees. Forced to "a" by a logit
    bias, 16 tokens took 139 s on this pair and 40 would take years; sampling now fails with
    GrammarError once the stacks pass MAX_GRAMMAR_STACKS (12 tokens in)."""
    grammar = 'root ::= r "x"\nr ::= "a" r "b" | "a" r "c" | "d"'
    (a,) = engine.model.tokenize("a", add_special=False)
    t0 = time.perf_counter()
    with pytest.raises(GrammarError, match="too ambiguous"):
        engine.generate(PROMPT, max_tokens=40, grammar=grammar, logit_bias={a: 100.0})
    assert time.perf_counter() - t0 < 30  # 0.3 s here
    forced = engine.generate(PROMPT, max_tokens=8, grammar=grammar, logit_bias={a: 100.0})
    assert forced.text == "a" * 8  # within the bound, the same grammar runs as before
    assert engine.generate(PROMPT, max_tokens=3).tokens


def test_a_generation_whose_grammar_fails_ends_alone_and_the_other_slot_goes_on():
    """Two slots step together; one's sampler fails (its grammar's stacks pass the bound). It ended
    both requests (the step raised for every slot in it): now that one alone ends, and the other
    writes what it writes alone."""
    em = ps.embedded_models()
    grammar = 'root ::= r "x"\nr ::= "a" r "b" | "a" r "c" | "d"'
    with ps.load(em.target, draft=em.draft, n_ctx=2048, n_parallel=2, n_threads=N_THREADS) as e:
        alone = e.generate(PROMPT, max_tokens=64)
        (a,) = e.model.tokenize("a", add_special=False)
        for _ in range(2):
            normal = e.submit(PROMPT, max_tokens=64)
            bad = e.submit(PROMPT, max_tokens=40, grammar=grammar, logit_bias={a: 100.0})
            with pytest.raises(GrammarError, match="too ambiguous"):
                bad.result()
            assert normal.result().tokens == alone.tokens


def test_unknown_sampling_settings_are_a_type_error(engine):
    with pytest.raises(TypeError, match="unknown sampling setting"):
        engine.generate(PROMPT, max_tokens=2, temprature=0.5)


def test_a_grammar_nothing_can_satisfy_is_an_error_not_a_crash(run_python):
    # the grammar allows only "x"-tokens and the bias forbids every token: llama.cpp throws
    # inside the sampler; the shim turns it into GrammarError
    res = run_python("""
        import pyllama_spec as ps
        from pyllama_spec.bindings.grammar import GrammarError
        em = ps.embedded_models()
        with ps.load(em.target, n_ctx=512, n_threads=1, spec_type="none") as e:
            bias = {t: False for t in range(e.model.n_vocab)}
            try:
                e.generate("x", max_tokens=4, grammar='root ::= "x"+', logit_bias=bias)
            except GrammarError as err:
                print("GrammarError:", err)
            print("after:", len(e.generate("x", max_tokens=3).tokens))
    """, timeout=120)
    assert res.returncode == 0, explain_child(res)
    assert "GrammarError:" in res.stdout and "after: 3" in res.stdout


def test_sampler_names_as_llama_server_takes_them():
    assert sampler_order(["Top-K", "nucleus", "temp", "typ", "minp"]) == ("top_k", "top_p", "temperature", "typ_p",
                                                                         "min_p")
    assert sampler_order("dkypmxt") == ("dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
    with pytest.raises(ValueError, match="letter"):
        sampler_order("kq")
    p = sampling_params({"penalty_last_n": -1, "logit_bias": {"7": -np.inf}}, n_ctx=512, n_vocab=100)
    assert p.penalty_last_n == 512 and p.dry_penalty_last_n == 64 and p.logit_bias == ((7, -np.inf),)  # 64: its default
    assert sampling_params({"dry_penalty_last_n": -1}, n_ctx=512, n_vocab=100).dry_penalty_last_n == 512
