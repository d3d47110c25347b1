"""Synthetic acceptance, for benchmarks: drafts accepted at random rates instead of by the target.

llama-server's ``--spec-synth-rates P0,P1,...`` / ``--spec-synth-len L``: the target still decodes
every verify row and samples its token there, but draft token i is kept with a set probability
rather than when it equals that sample, so a run measures the speed a drafter of a given acceptance
would reach, on the real hardware and batch shapes. **The text is not the model's**: it holds
drafted tokens the target did not choose (llama-server warns the same).

* ``rates[i]``: the unconditional chance that a draft's first i + 1 tokens are all kept
  (non-increasing, in [0, 1], one per drafted position: the engine's draft length);
* ``--spec-synth-len L``: the mean tokens a step yields (the target's own included), turned into
  geometric rates p, p^2, ... with p found by bisection, as llama.cpp's
  ``common_speculative_synth_rates_resolve`` does;
* the verifier keeps draft token i with the conditional probability ``rates[i] / rates[i - 1]``,
  from a generator seeded with the request's seed (the same seed, the same decisions); a drafted
  end-of-generation token is never kept (it would end the text early).

Where this differs from llama-server: the native sampler here samples and takes the target's own token
at each row in one call, so a kept draft token is not what its penalties and grammar saw (they follow
the target's token; llama-server gives the penalties the kept draft token and leaves its grammar where
it was). Either way a grammar never refuses a step and the output is as invalid as the mode says; what
the mode measures, how many drafts a step keeps and what a step costs, does not depend on it. A draft tree is verified
by llama.cpp's match rule (llama-server has no trees).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from pyllama_spec.speculative.verify import MatchVerifier


def synthetic_rates(rates: Sequence[float] = (), length: float | None = None, *, n_max: int) -> list[float]:
    """The unconditional per-position rates for a drafter of ``n_max`` tokens, from ``rates`` or the
    mean acceptance ``length``; [] when neither is given. ValueError as llama.cpp words them."""
    rates = [float(r) for r in rates]
    if not rates and length is None:
        return []
    check_settings(rates, length)
    if n_max <= 0:
        raise ValueError("synthetic acceptance requires at least one speculative token (a drafter and a draft "
                         "length of 1 or more)")
    if rates:
        if len(rates) != n_max:
            raise ValueError(f"synthetic acceptance rates must contain {n_max} values (one per drafted "
                             f"position: the draft length), got {len(rates)}")
        return rates
    length = float(length)
    if not math.isfinite(length) or not 1.0 <= length <= n_max + 1:
        raise ValueError(f"synthetic acceptance length must be finite and within [1, {n_max + 1}], got {length}")
    if length == n_max + 1:
        p = 1.0
    elif length == 1.0:
        p = 0.0
    else:  # the p whose p + p^2 + ... + p^n_max is length - 1 (the sum grows with p)
        lo, hi = 0.0, 1.0
        for _ in range(32):
            mid = 0.5 * (lo + hi)
            if sum(mid ** (j + 1) for j in range(n_max)) < length - 1.0:
                lo = mid
            else:
                hi = mid
        p = 0.5 * (lo + hi)
    return [p ** (i + 1) for i in range(n_max)]


def check_settings(rates: Sequence[float], length: float | None) -> None:
    """What can be checked before the draft length is known: rates or a length, each rate valid."""
    if len(rates) and length is not None:
        raise ValueError("synthetic acceptance length and rates are mutually exclusive (synth_len, synth_rates)")
    for i, r in enumerate(rates):
        if not math.isfinite(r) or not 0.0 <= r <= 1.0:
            raise ValueError(f"synthetic acceptance rates must be finite and within [0, 1], got {r}")
        if i and r > rates[i - 1]:
            raise ValueError("synthetic acceptance rates must be monotonically non-increasing, got "
                             f"{rates[i - 1]} then {r}")


def conditional_probabilities(rates: Sequence[float]) -> tuple[float, ...]:
    """The chance of keeping draft token i once the ones before it were kept (0 after a rate of 0)."""
    out, before = [], 1.0
    for r in rates:
        out.append(r / before if before > 0.0 else 0.0)
        before = r
    return tuple(out)


class SyntheticVerifier(MatchVerifier):
    """Keeps draft token i with ``probs[i]`` (see the module); the target's sample ends the step."""

    rule = "synthetic"

    def __init__(self, sampler, probs: Sequence[float], seed: int, end_tokens: frozenset[int]) -> None:
        super().__init__(sampler)
        self.probs = tuple(probs)
        self.rng = np.random.default_rng(seed & 0xFFFFFFFF)
        self.end_tokens = end_tokens

    def accept(self, ctx, draft: list[int], proposal, row: int = 0) -> list[int]:
        kept: list[int] = []
        for i, x in enumerate(draft):
            sampled = self.sampler.sample(ctx, row + i)  # the target's token (the sampler takes it)
            p = self.probs[i] if i < len(self.probs) else 0.0  # a request drafting longer: never kept
            if self.rng.random() < p and x not in self.end_tokens:
                kept.append(x)
                continue
            return [*kept, sampled]
        return [*kept, self.sampler.sample(ctx, row + len(draft))]
