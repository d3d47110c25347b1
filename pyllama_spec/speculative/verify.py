"""Verification rules: which drafted tokens the target accepts, and the token after them.

* ``"match"`` (llama.cpp's rule): sample the target at each position; accept while the
  draft's token equals the sample. Exact for any draft, identical tokens to a target-only
  run for a seed, but at temperature > 0 it throws most good drafts away.
* ``"rejection"`` (Leviathan et al. 2023; Chen et al. 2023): accept draft token x at a
  position with probability min(1, p(x) / q(x)); on the first rejection, draw from the
  residual norm(max(0, p - q)); after a fully accepted block, draw a bonus token from p.
  The output follows the target's distribution exactly (not its tokens for a seed), and
  accepts far more at temperature > 0. A draft without a distribution (n-gram lookup, or
  an argmax draft) is a point mass: q(x) = 1.

p and q are the distributions after the same sampler chain (``sampling.distributions``).
The rules are pure numpy; the two verifier classes below read a generation's logits from
the target context (a wrapper object) and keep its random state.
"""

from __future__ import annotations

import numpy as np

from pyllama_spec.speculative.sampling import Dist, distributions_in_turn
from pyllama_spec.speculative.tree import walk

VERIFY_RULES = ("match", "rejection")


def accept_by_rejection(p: list[Dist], draft: list[int], q: list[Dist] | None, rng: np.random.Generator,
                        *, biased: bool = False) -> list[int]:
    """The tokens a verify step keeps: accepted drafts, then one token from the target.

    ``p``: the target's distribution at each verify row (len(draft) + 1 rows); ``q``: the
    draft's at each drafted position, or None for point-mass drafts. ``biased`` is a test
    hook only: after a rejection it draws from p instead of the residual (a classic bug that
    over-weights the draft's tokens), the wrong rule the statistical tests must detect.
    """
    k = len(draft)
    u = rng.random(k) if k else np.zeros(0)
    for i, x in enumerate(draft):
        px = p[i].prob_of(x)
        qx = 1.0 if q is None else q[i].prob_of(x)
        ratio = 1.0 if qx <= 0.0 and px > 0.0 else (px / qx if qx > 0.0 else 0.0)
        if u[i] < min(1.0, ratio):
            continue
        after = p[i] if biased else _residual(p[i], None if q is None else q[i], x)
        return [*draft[:i], after.sample(rng)]
    return [*draft, p[k].sample(rng)]


def _residual(p: Dist, q: Dist | None, rejected: int) -> Dist:
    """norm(max(0, p - q)) on p's support (where the residual can be positive)."""
    if q is None:  # a point mass at the rejected token
        qp = np.where(p.ids == rejected, 1.0, 0.0)
    else:  # q's probability of each of p's tokens
        order = np.argsort(q.ids)
        qs = q.ids[order]
        at = np.minimum(np.searchsorted(qs, p.ids), len(qs) - 1)
        qp = np.where(qs[at] == p.ids, q.probs[order][at], 0.0)
    r = np.maximum(p.probs - qp, 0.0)
    if r.sum() <= 0.0:  # p == q on p's support: any draw from p is exact
        return p
    return Dist(p.ids, r / r.sum())


# ----------------------------------------------------------------------------- per generation


class MatchVerifier:
    """llama.cpp's rule through the native sampler chain (the same tokens as target-only for a seed)."""

    rule = "match"

    def __init__(self, sampler) -> None:
        self.sampler = sampler

    def first(self, ctx, row: int = -1) -> int:
        return self.sampler.sample(ctx, row)

    def proposal_tokens(self, proposal) -> list[int]:
        return list(proposal.tokens)

    def accept(self, ctx, draft: list[int], proposal, row: int = 0) -> list[int]:
        """The verify rows [id_last, draft...] are output rows ``row``.. of ctx's last decode."""
        accepted: list[int] = []
        for i in range(len(draft) + 1):
            tok = self.sampler.sample(ctx, row + i)
            accepted.append(tok)
            if i >= len(draft) or tok != draft[i]:
                break
        return accepted


    def walk_tree(self, ctx, tree, row: int = 0) -> tuple[list[int], int]:
        """Verify a draft tree whose nodes are output rows ``row``.. of ctx's last decode: sample at
        each node of the path, in order, as target-only sampling would (tree.walk)."""
        return walk(tree, lambda node: self.sampler.sample(ctx, row + node))


class RejectionVerifier:
    """Rejection sampling over numpy distributions (temperature > 0).

    Drafts with logits are drawn from a distribution q of their own (x ~ q, as the method
    requires); drafts without (n-gram) are point masses. Any q keeps the output exact; how
    much is accepted depends on how close q is to p. q is the draft's logits through the
    same chain at ``draft_temperature_ratio`` x the temperature: a sharper q than the
    target's accepted far more on the trained pair (mean accepted length 2.4 -> 2.9-3.3 at
    temperature 0.8 over ratios 0.25-0.55; 1.0 is the draft's own tempered distribution,
    near 0 the argmax draft, which accepts as llama.cpp's rule does).
    """

    rule = "rejection"

    def __init__(self, params, seed: int, n_vocab: int, *, draft_temperature_ratio: float = 0.5,
                 biased: bool = False) -> None:
        import dataclasses

        self.params = params
        self.draft_params = dataclasses.replace(params, temperature=params.temperature * draft_temperature_ratio)
        self.rng = np.random.default_rng(seed & 0xFFFFFFFF)
        self.n_vocab = n_vocab
        self.biased = biased  # test hook: see accept_by_rejection
        self.generated: list[int] = []  # what the penalties see (as the native sampler's history)
        self._q = None

    def _seen(self, params) -> list[int]:
        """The generated tokens the penalties see: the last penalty_last_n (all with -1), not copied whole."""
        n = params.penalty_last_n
        return self.generated[-n:] if n > 0 else self.generated

    def _dist(self, row: np.ndarray, before=(), params=None):
        """One row's distribution; the penalties see the generated tokens, then ``before``."""
        params = params or self.params
        return distributions_in_turn(row[None, :], params, [*self._seen(params), *before], ())[0]

    def _dists(self, logits: np.ndarray, before: list[int], params=None):
        """Row i sees before[:i] too, as the native sampler accepts tokens one at a time."""
        params = params or self.params
        return distributions_in_turn(logits, params, self._seen(params), before)

    def first(self, ctx, row: int = -1) -> int:
        tok = self._dist(ctx.logits(row)).sample(self.rng)
        self.generated.append(tok)
        return tok

    def proposal_tokens(self, proposal) -> list[int]:
        self._q = None
        if proposal.logits is None or not len(proposal.tokens):
            return list(proposal.tokens)
        if not self.params.penalized:
            self._q = self._dists(proposal.logits, [], self.draft_params)
            return [q.sample(self.rng) for q in self._q]  # x_i ~ q_i
        tokens: list[int] = []
        self._q = []
        for row in proposal.logits:  # x_i ~ q_i, each row's penalty seeing the x before it
            q = self._dist(row, tokens, self.draft_params)
            self._q.append(q)
            tokens.append(q.sample(self.rng))
        return tokens

    def accept(self, ctx, draft: list[int], proposal, row: int = 0) -> list[int]:
        p = self._dists(np.asarray(ctx.output_logits(row + len(draft) + 1)[row:]), draft)
        out = accept_by_rejection(p, draft, self._q, self.rng, biased=self.biased)
        self.generated.extend(out)
        return out
