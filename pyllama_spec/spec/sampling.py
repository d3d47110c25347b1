"""The sampler chain in numpy: logits rows -> the distributions a sampler draws from.

The same chain as ``llama.Sampler`` builds natively (llama.cpp's order): presence penalty
-> top-k -> top-p -> min-p -> temperature -> softmax. Rejection sampling needs the target's
and the draft's distributions *after* this chain, for whole verify blocks at once, so it
is written here over numpy arrays (rows at a time, no loop over the vocabulary).

Distributions are kept sparse when top-k bounds them: ``Dist(ids, probs)`` per row.
Pure Python + numpy: nothing native here.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    presence_penalty: float = 0.0
    penalty_last_n: int = 64

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclasses.dataclass
class Dist:
    """One row's distribution: token ids and their probabilities (summing to 1)."""

    ids: np.ndarray  # int64 [m]
    probs: np.ndarray  # float64 [m]

    def prob_of(self, token: int) -> float:
        hit = np.flatnonzero(self.ids == token)
        return float(self.probs[hit[0]]) if len(hit) else 0.0

    def dense(self, n_vocab: int) -> np.ndarray:
        out = np.zeros(n_vocab)
        out[self.ids] = self.probs
        return out

    def sample(self, rng: np.random.Generator) -> int:
        return int(self.ids[min(np.searchsorted(np.cumsum(self.probs), rng.random() * self.probs.sum()),
                                len(self.ids) - 1)])


def distributions(logits: np.ndarray, params: SamplingParams, recent: np.ndarray | None = None) -> list[Dist]:
    """The chain applied to each row of ``logits`` [n, n_vocab]; ``recent``: tokens the presence
    penalty applies to (the last ``penalty_last_n`` of the sequence)."""
    x = np.array(logits, dtype=np.float64, copy=True)
    n, n_vocab = x.shape
    if params.presence_penalty and recent is not None and len(recent):
        x[:, np.unique(np.asarray(recent)[-params.penalty_last_n:])] -= params.presence_penalty
    k = params.top_k if 0 < params.top_k < n_vocab else n_vocab
    if k < n_vocab:
        ids = np.argpartition(-x, k - 1, axis=1)[:, :k]
    else:
        ids = np.broadcast_to(np.arange(n_vocab), (n, n_vocab))
    vals = np.take_along_axis(x, ids, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")  # candidates by logit, highest first
    ids, vals = np.take_along_axis(ids, order, axis=1), np.take_along_axis(vals, order, axis=1)
    keep = np.ones_like(vals, dtype=bool)
    # top-p and min-p see the candidates' softmax at temperature 1, as llama.cpp's chain does.
    p1 = np.exp(vals - vals[:, :1])
    p1 /= p1.sum(axis=1, keepdims=True)
    if params.top_p < 1.0:
        before = np.cumsum(p1, axis=1) - p1  # mass of the better candidates
        keep &= before < params.top_p
    if params.min_p > 0.0:
        keep &= p1 >= params.min_p * p1[:, :1]
    keep[:, 0] = True  # min_keep = 1
    t = max(params.temperature, 1e-6)
    out = []
    for r in range(n):
        v = vals[r][keep[r]] / t
        p = np.exp(v - v.max())
        out.append(Dist(ids[r][keep[r]].astype(np.int64), p / p.sum()))
    return out
