"""Log-probabilities of emitted tokens under the target's own distribution.

Every emitted token was sampled (or verified) at one output row of a target decode; that row's
logits are the target's distribution at the token's position, whether the token was drafted or
not. As llama-server's ``n_probs`` (with ``post_sampling_probs`` off) and OpenAI's ``logprobs``,
the probabilities are the softmax of the raw logits, before any sampler.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely tokens at this position: (token, logprob), best first


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
