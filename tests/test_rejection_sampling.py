"""Rejection sampling is lossless in distribution, and the test can tell when it is not.

Over thousands of seeds, the short continuations generated with a DFlash draft and
rejection sampling must follow the same distribution as target-only sampling: chi-square
tests of homogeneity of the token at each of the first 3 positions (categories with few
samples pooled; Bonferroni over the positions), at a false-alarm rate of 0.1% (alpha =
0.001). The seeds are fixed, so
the outcome is reproducible. The same test must reject a deliberately biased rule (after a
rejection, drawing from p instead of the residual max(0, p - q): a classic bug).
"""

from __future__ import annotations

import collections
import functools

import numpy as np
import pytest
from conftest import TINY_ENGINE

import pyllama_spec as ps
from pyllama_spec.serving import prepared as prepared_module  # where a generation gets its verifier
from pyllama_spec.speculative.sampling import SamplingParams, distributions
from pyllama_spec.speculative.verify import RejectionVerifier, accept_by_rejection

scipy_stats = pytest.importorskip("scipy.stats", reason="the chi-square test uses scipy (test extra)")

ALPHA = 1e-3
N_SEEDS = 2000
PROMPT = "def add(a, b):\n    return"
SAMPLING = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)  # the defaults, at 0.8
#: Every sampler the rejection rule applies itself, on at once: the penalties over the prompt and
#: what was generated, a logit bias, then top-k, top-p, min-p and the temperature.
WHOLE_CHAIN = dict(SAMPLING, repeat_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3, penalty_last_n=16,
                   logit_bias={13: 2.0, 32: -1.5})


def _continuations(models, spec_type, n_seeds, seed0, verify="rejection", sampling=SAMPLING):
    """Counts of each (position, token) of 3-token continuations, and the acceptance rate."""
    out = collections.Counter()
    drafted = accepted = 0
    with ps.load(models.target, draft=models.draft if spec_type != "none" else None, spec_type=spec_type,
                 n_ctx=512, **TINY_ENGINE, draft_max=3, flash_attn=False) as e:
        for seed in range(seed0, seed0 + n_seeds):
            r = e.generate(PROMPT, max_tokens=3, seed=seed, verify=verify, **sampling)
            out.update(enumerate(r.tokens))
            drafted += r.stats.drafted
            accepted += r.stats.accepted
    return out, (accepted / drafted if drafted else 0.0)


def _homogeneity_p_value(a: collections.Counter, b: collections.Counter, min_expected: float = 5.0) -> float:
    """The smallest p-value of the per-position chi-square tests, Bonferroni-corrected (x 3)."""
    return min(1.0, 3 * min(_position_p_value({k[1]: v for k, v in a.items() if k[0] == i},
                                              {k[1]: v for k, v in b.items() if k[0] == i}, min_expected)
                            for i in range(3)))


def _position_p_value(a: dict, b: dict, min_expected: float) -> float:
    keys = sorted(set(a) | set(b))
    table = np.array([[a.get(k, 0) for k in keys], [b.get(k, 0) for k in keys]], dtype=float)
    expected = table.sum(axis=0) * table.sum(axis=1, keepdims=True) / table.sum()
    big = expected.min(axis=0) >= min_expected
    pooled = np.column_stack([table[:, big], table[:, ~big].sum(axis=1)]) if (~big).any() else table[:, big]
    pooled = pooled[:, pooled.sum(axis=0) > 0]
    return float(scipy_stats.chi2_contingency(pooled, correction=False)[1])


@pytest.fixture(scope="module")
def trained():
    """The embedded trained pair: its draft is close to its target, so the residual matters."""
    return ps.embedded_models()


@pytest.fixture(scope="module")
def reference(trained):
    """Target-only sampling through llama.cpp's native sampler chain."""
    return _continuations(trained, "none", N_SEEDS, 100_000, verify="match")[0]


def test_the_numpy_sampler_chain_follows_the_native_one(trained, reference):
    numpy_chain, _ = _continuations(trained, "none", N_SEEDS, 0)
    p = _homogeneity_p_value(numpy_chain, reference)
    print(f"numpy chain vs native: p = {p:.3g}")
    assert p > ALPHA


def test_rejection_sampling_follows_the_target_distribution(trained, reference):
    spec, acceptance = _continuations(trained, "draft-dflash", N_SEEDS, 0)
    p = _homogeneity_p_value(spec, reference)
    print(f"rejection sampling: p = {p:.3g}, acceptance {acceptance:.3f}")
    assert acceptance > 0.05  # drafts were accepted, so the rule was exercised
    assert p > ALPHA


def test_rejection_sampling_follows_the_target_distribution_with_the_whole_chain(trained):
    """Penalties and a logit bias change p and q at every position (the penalties from the
    tokens generated so far): the rule must still give the target's distribution."""
    reference, _ = _continuations(trained, "none", N_SEEDS, 200_000, verify="match", sampling=WHOLE_CHAIN)
    plain, _ = _continuations(trained, "none", N_SEEDS, 300_000, verify="match")
    assert _homogeneity_p_value(reference, plain) < ALPHA  # the chain does change the distribution
    spec, acceptance = _continuations(trained, "draft-dflash", N_SEEDS, 0, sampling=WHOLE_CHAIN)
    p = _homogeneity_p_value(spec, reference)
    print(f"rejection sampling, whole chain: p = {p:.3g}, acceptance {acceptance:.3f}")
    assert acceptance > 0.05
    assert p > ALPHA


def test_the_same_test_detects_a_biased_acceptance_rule(trained, reference, monkeypatch):
    monkeypatch.setattr(prepared_module, "RejectionVerifier", functools.partial(RejectionVerifier, biased=True))
    biased, acceptance = _continuations(trained, "draft-dflash", N_SEEDS, 0)
    p = _homogeneity_p_value(biased, reference)
    print(f"biased rule: p = {p:.3g}, acceptance {acceptance:.3f}")
    assert p < ALPHA


# --------------------------------------------------------------------------- the rule on its own


def test_one_step_of_the_rule_gives_p_exactly_in_expectation():
    # The exact output distribution of one position, computed by enumerating draft tokens:
    # P(out = y) = q(y) min(1, p(y)/q(y)) + (1 - sum_x q(x) min(1, p(x)/q(x))) r(y) = p(y).
    rng = np.random.default_rng(0)
    logits_p, logits_q = rng.normal(size=(2, 12)), rng.normal(size=(1, 12))
    params = SamplingParams(temperature=0.9, top_k=8, top_p=1.0, min_p=0.0)
    p = distributions(logits_p, params)
    q = distributions(logits_q, params)[0]
    counts = np.zeros(12)
    draws = 60_000
    for _ in range(draws):
        x = q.sample(rng)
        out = accept_by_rejection(p, [x], [q], rng)
        counts[out[0]] += 1
    expected = p[0].dense(12)
    assert np.abs(counts / draws - expected).max() < 0.01


def test_sampler_chain_matches_llama_cpp_semantics():
    logits = np.log(np.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    d = distributions(logits, SamplingParams(temperature=1.0, top_k=4, top_p=0.8, min_p=0.0))[0]
    assert d.ids.tolist() == [0, 1, 2]  # top-k 4, then top-p keeps up to the token crossing 0.8
    d = distributions(logits, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.35))[0]
    assert d.ids.tolist() == [0, 1]  # min-p: at least 0.35 x the best
    d = distributions(logits, SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0))[0]
    p = np.array([0.5, 0.2, 0.15, 0.1, 0.05]) ** 2
    assert np.allclose(d.probs, p / p.sum())
