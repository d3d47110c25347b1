"""Synthetic acceptance (llama-server's --spec-synth-rates / --spec-synth-len; speculative/synthetic.py):
the rates as llama.cpp resolves them, the verifier's rule, and the engine on the embedded pair, where
rates of 0 give target-only's tokens and rates of 1 keep every draft."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import N_THREADS, REPO_ROOT

import pyllama_spec as ps
from pyllama_spec.speculative.synthetic import SyntheticVerifier, conditional_probabilities, synthetic_rates

PROMPT = "def read_config(path):\n"


def test_rates_as_given_and_their_checks():
    assert synthetic_rates([1.0, 0.5, 0.5], n_max=3) == [1.0, 0.5, 0.5]
    assert synthetic_rates(n_max=3) == []
    for bad, match in (([0.5, 0.6, 0.1], "non-increasing"), ([1.5, 1, 1], r"within \[0, 1\]"),
                       ([float("nan")] * 3, "finite"), ([1, 1], "must contain 3 values")):
        with pytest.raises(ValueError, match=match):
            synthetic_rates(bad, n_max=3)
    with pytest.raises(ValueError, match="mutually exclusive"):
        synthetic_rates([1, 1, 1], 2.0, n_max=3)
    with pytest.raises(ValueError, match="at least one speculative token"):
        synthetic_rates([], 2.0, n_max=0)


def test_a_mean_length_becomes_geometric_rates_of_that_mean():
    rates = synthetic_rates(length=3.0, n_max=5)
    p = rates[0]
    assert rates == pytest.approx([p ** (i + 1) for i in range(5)])
    assert 1.0 + sum(rates) == pytest.approx(3.0, abs=1e-6)  # the mean tokens a step yields
    assert synthetic_rates(length=1.0, n_max=4) == [0.0] * 4
    assert synthetic_rates(length=5.0, n_max=4) == [1.0] * 4
    for bad in (0.5, 5.5, float("inf")):
        with pytest.raises(ValueError, match=r"within \[1, 5\]"):
            synthetic_rates(length=bad, n_max=4)


def test_conditional_probabilities():
    assert conditional_probabilities([1.0, 0.5, 0.25]) == (1.0, 0.5, 0.5)
    assert conditional_probabilities([0.5, 0.0, 0.0]) == (0.5, 0.0, 0.0)


class _Sampler:
    """The target's tokens, row by row."""

    def __init__(self, tokens):
        self.tokens = tokens

    def sample(self, ctx, row):
        return self.tokens[row]


def test_the_verifier_keeps_drafts_at_its_rates_never_an_end_token_and_ends_with_the_targets():
    target = [10, 11, 12, 13]
    always = SyntheticVerifier(_Sampler(target), (1.0, 1.0, 1.0), seed=0, end_tokens=frozenset({2}))
    assert always.accept(None, [5, 6, 7], None) == [5, 6, 7, 13]  # every draft kept, then the target's token
    assert always.accept(None, [5, 2, 7], None) == [5, 11]  # a drafted end token is the target's row instead
    never = SyntheticVerifier(_Sampler(target), (0.0, 0.0, 0.0), seed=0, end_tokens=frozenset())
    assert never.accept(None, [10, 11, 12], None) == [10]  # even a draft the target agrees with
    longer = SyntheticVerifier(_Sampler(target), (1.0,), seed=0, end_tokens=frozenset())
    assert longer.accept(None, [5, 6, 7], None) == [5, 11]  # past its rates: never kept
    half = [SyntheticVerifier(_Sampler(target * 50), (0.5,), seed=s, end_tokens=frozenset()) for s in range(400)]
    kept = sum(len(v.accept(None, [99], None)) - 1 for v in half)
    assert 150 < kept < 250  # about half


@pytest.fixture(scope="module")
def pair():
    m = ps.embedded_models()
    return m.target, m.draft


def _load(pair, **kw):
    return ps.load(pair[0], draft=pair[1], n_ctx=1024, n_batch=64, n_ubatch=64, n_threads=N_THREADS,
                   draft_max=5, **kw)


def test_rates_of_zero_give_target_only_tokens_and_rates_of_one_keep_every_draft(pair):
    with _load(pair) as engine:
        plain = engine.generate(PROMPT, max_tokens=40, draft_max=0).tokens
    with pytest.warns(UserWarning, match="synthetic speculative acceptance is on"):
        never = _load(pair, synth_rates=[0.0] * 5)
    with never:
        r = never.generate(PROMPT, max_tokens=40)
        assert r.tokens == plain and r.stats.drafted > 0 and r.stats.accepted == 0
    with pytest.warns(UserWarning):
        always = _load(pair, synth_rates=[1.0] * 5)
    with always:
        r = always.generate(PROMPT, max_tokens=40, ignore_eos=True)
        assert r.stats.drafted > 0 and r.stats.accepted == r.stats.drafted
        assert len(r.tokens) == 40 and r.finish_reason == "length"
        # a grammar the kept drafts do not follow is not an error: the sampler took the target's tokens
        g = always.generate(PROMPT, max_tokens=6, grammar='root ::= "a"{5,5}')
        assert g.stats.drafted > 0 and g.stats.accepted == g.stats.drafted and g.tokens


def test_a_seed_gives_the_same_decisions(pair):
    with pytest.warns(UserWarning):
        engine = _load(pair, synth_len=2.5)
    with engine:
        runs = [engine.generate(PROMPT, max_tokens=48, temperature=0.7, seed=7) for _ in range(2)]
    same = [(r.tokens, r.stats.drafted, r.stats.accepted) for r in runs]
    assert same[0] == same[1]
    assert 0 < runs[0].stats.accepted < runs[0].stats.drafted


def test_settings_that_cannot_work_are_refused(pair):
    m = ps.embedded_models()
    with pytest.raises(ValueError, match="needs a drafter"):
        ps.load(m.target, synth_len=2.0)
    with pytest.raises(ValueError, match="mutually exclusive"):
        ps.load(m.target, draft=m.draft, synth_len=2.0, synth_rates=[1.0])
    with pytest.raises(ValueError, match="draft tree"):
        ps.load(m.target, draft=m.draft, synth_len=2.0, draft_tree=8)
    with pytest.raises(ValueError, match="must contain 5 values"):  # the draft length, known once loaded
        _load(pair, synth_rates=[1.0, 1.0])


def test_the_cli_takes_llama_servers_flags():
    m = ps.embedded_models()
    base = [sys.executable, "-m", "pyllama_spec", "generate", "-m", str(m.target), "-md", str(m.draft),
            "--spec-draft-n-max", "3", "-t", str(N_THREADS), "-n", "16", "-p", PROMPT]
    ok = subprocess.run([*base, "--spec-synth-rates", "1,1,1"], capture_output=True, text=True, cwd=REPO_ROOT,
                        timeout=120)
    assert ok.returncode == 0 and "acceptance 1.00" in ok.stdout + ok.stderr, ok.stderr[-2000:]
    assert "generated text is not the model's" in ok.stderr
    bad = subprocess.run([*base, "--spec-synth-rates", "1,0.5"], capture_output=True, text=True, cwd=REPO_ROOT,
                         timeout=120)
    assert bad.returncode != 0 and "must contain 3 values" in bad.stderr, bad.stderr[-2000:]
    typo = subprocess.run([*base, "--spec-synth-rates", "1,x,0"], capture_output=True, text=True, cwd=REPO_ROOT,
                          timeout=120)
    assert typo.returncode == 2 and "not a comma-separated list of numbers" in typo.stderr
