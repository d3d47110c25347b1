"""Prompt-lookup (n-gram) drafting: propose what followed the latest earlier occurrence of
the sequence's last few tokens. No second model, so it works with any target, and it
shines where answers copy the prompt (OCR, document QA, code edits).

The drafter keeps the sequence's tokens with their target positions; a media chunk is
one separator that no n-gram matches across. Lookup is vectorised over the history.

When the continuation of the match runs into the end of the history (the key repeats with a
short period: a loop, repeated rows, indentation), the draft goes on copying its own tokens,
as an overlapping LZ77 copy does: the period repeated up to n_max. llama.cpp's ngram-simple
stops at the end of the history, so on a period-2 loop it drafts one or two tokens a step.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from pyllama_spec.drafters import DRAFT_TOKEN_LIMIT, DraftRequest, Proposal, token_limit_reason
from pyllama_spec.drafters.token_history import SEPARATOR as _SEPARATOR
from pyllama_spec.drafters.token_history import HistoryDrafter, no_memory_parts, tokens_only_pairing

memory_parts = no_memory_parts  # the registry's functions (registry.py)


def check_pair(target, draft, build_record: dict):
    return tokens_only_pairing(DRAFT_TOKEN_LIMIT)


def make(setup) -> "NgramDrafter":
    """The registry's constructor (registry.py)."""
    return NgramDrafter(n_max=setup.n_max, n_min=setup.n_min, n_max_limit=setup.pairing.limit)


class NgramDrafter(HistoryDrafter):
    """The ``ngram-simple`` method behind the drafter protocol (see drafters/__init__.py).

    ``ngram_max`` .. ``ngram_min``: the longest key tried first, down to the shortest.
    ``copy_past_end``: continue a repetition past the end of the history (False: stop there,
    as llama.cpp does). Each sequence has a history of its own.
    """

    name = "ngram-simple"

    def __init__(self, *, n_max: int, n_min: int = 0, n_max_limit: int = DRAFT_TOKEN_LIMIT, ngram_min: int = 2,
                 ngram_max: int = 4, copy_past_end: bool = True) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.n_max_limit = n_max_limit
        self.n_max = max(1, min(n_max, n_max_limit))
        self.n_min = min(n_min, self.n_max)
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.copy_past_end = copy_past_end
        super().__init__()

    # --- protocol
    @property
    def limit_reason(self) -> str:
        return token_limit_reason(self.n_max_limit)

    def draft(self, requests: Sequence[DraftRequest]) -> list[Proposal]:
        out = []
        for rq in requests:
            n = min(rq.n_max, self.n_max_limit)
            ctx = np.append(self._history.tokens(rq.seq_id), np.int32(rq.id_last))
            found = self._lookup(ctx, n)
            out.append(Proposal(found if len(found) >= max(rq.n_min, 1) else []))
        return out

    # --- lookup
    def _lookup(self, ctx: np.ndarray, n_draft: int) -> list[int]:
        for k in range(min(self.ngram_max, len(ctx) - 1), self.ngram_min - 1, -1):
            key = ctx[-k:]
            if (key == _SEPARATOR).any():
                continue
            # Windows of the history before the key itself; the latest match wins.
            windows = np.lib.stride_tricks.sliding_window_view(ctx[:-1], k)
            hits = np.flatnonzero((windows == key).all(axis=1))
            if len(hits) == 0:
                continue
            start = int(hits[-1]) + k
            # ctx[start:] is one period of the repetition; past the history's end the draft copies
            # its own tokens, i.e. that period again (an overlapping copy).
            past_end = start + n_draft > len(ctx) and self.copy_past_end
            follow = np.resize(ctx[start:], n_draft) if past_end else ctx[start:start + n_draft]
            cut = np.flatnonzero(follow == _SEPARATOR)
            if len(cut):
                follow = follow[:cut[0]]
            if len(follow):
                return follow.tolist()
        return []
