"""Log-probabilities of emitted tokens under the target's own distribution, and their
probabilities after the sampler chain.

Every emitted token was sampled (or verified) at one output row of a target decode; that row's
logits are the target's distribution at the token's position, whether the token was drafted or
not. As llama-server's ``n_probs`` (with ``post_sampling_probs`` off) and OpenAI's ``logprobs``,
the probabilities are the softmax of the raw logits, before any sampler (``token_logprobs``).

With ``post_sampling_probs`` they are those the sampler chain leaves (``token_post_sampling_probs``):
at temperature 0 the pick alone, with probability 1 (llama-server's greedy sampler); above, the
row through the numpy copy of the chain (sampling.distributions: logit bias, penalties, top-k,
top-p, min-p, temperature), the penalties seeing the tokens generated before the row. The
settings that copy cannot reproduce (a grammar, mirostat, ...: ``SamplingParams.rejection_unsupported``)
are refused (``check_post_sampling``) rather than answered with other numbers.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pyllama_spec.speculative.sampling import SamplingParams, distributions_in_turn


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely tokens at this position: (token, logprob), best first


@dataclasses.dataclass(frozen=True)
class TokenProb:
    """A token's probability after the sampler chain, and the chain's most likely tokens there:
    (token, probability), best first, none at probability 0 (so fewer than asked when the chain
    keeps fewer: then they sum to 1)."""

    token: int
    prob: float
    top: tuple[tuple[int, float], ...]


def check_post_sampling(params: SamplingParams) -> None:
    """A ValueError naming the settings whose probabilities after the chain this module cannot
    give (none at temperature 0, where the pick has probability 1)."""
    unsupported = [] if params.greedy else params.rejection_unsupported()
    if unsupported:
        grammar = " (a json_schema, response_format or tools make one)" if "grammar" in unsupported else ""
        raise ValueError(f"post_sampling_probs at temperature > 0 gives the probabilities after logit bias, "
                         f"penalties, top-k, top-p, min-p and temperature, in llama.cpp's order; this request "
                         f"also sets {', '.join(unsupported)}{grammar}, whose probabilities are not computed here: "
                         f"leave post_sampling_probs out for those before sampling, or sample at temperature 0")


def token_post_sampling_probs(ctx, rows: list[int], tokens: list[int], n_top: int, params: SamplingParams,
                              history=()) -> list[TokenProb]:
    """The probability of ``tokens[i]`` after the sampler chain ``params`` at output row ``rows[i]``
    of ``ctx``'s last decode, with the chain's ``n_top`` most likely tokens there; the penalties
    see ``history`` (the tokens generated before ``tokens[0]``: its last penalty_last_n are
    enough) and ``tokens[:i]``. O(n_vocab) a row (sampling.distributions). Reads the rows before
    the next decode; ``check_post_sampling(params)`` must have passed."""
    if params.greedy:  # llama-server's greedy sampler: the pick, alone
        return [TokenProb(int(t), 1.0, ((int(t), 1.0),) if n_top else ()) for t in tokens]
    dists = distributions_in_turn(np.stack([ctx.logits(r) for r in rows]), params, list(history), tokens)
    out = []
    for dist, token in zip(dists, tokens):  # each best first
        n = min(n_top, len(dist.ids))
        top = tuple((int(t), float(p)) for t, p in zip(dist.ids[:n], dist.probs[:n]) if p > 0.0)
        out.append(TokenProb(int(token), dist.prob_of(int(token)), top))
    return out


def token_logprobs(ctx, rows: list[int], tokens: list[int], n_top: int) -> list[TokenLogprob]:
    """The log-probability of ``tokens[i]`` at output row ``rows[i]`` of ``ctx``'s last decode,
    with the ``n_top`` most likely tokens there. Reads the rows before the next decode."""
    out = []
    for row, token in zip(rows, tokens):
        x = ctx.logits(row).astype(np.float64)
        m = x.max()
        lse = m + np.log(np.exp(x - m).sum())
        top: tuple[tuple[int, float], ...] = ()
        if n_top:
            k = min(n_top, len(x))
            ids = np.argpartition(-x, k - 1)[:k]
            ids = ids[np.argsort(-x[ids], kind="stable")]
            top = tuple((int(i), float(x[i] - lse)) for i in ids)
        out.append(TokenLogprob(int(token), float(x[token] - lse), top))
    return out
