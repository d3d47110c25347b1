"""Prompt-lookup (n-gram) drafting: propose what followed the latest earlier occurrence of
the sequence's last few tokens. No second model, so it works with any target, and it
shines where answers copy the prompt (OCR, document QA, code edits).

The drafter keeps the sequence's tokens with their target positions; a media chunk is
one separator that no n-gram matches across. Lookup is vectorised over the history.
"""

from __future__ import annotations

import numpy as np

from . import Proposal, TargetRows

_SEPARATOR = -1  # stands for a media chunk in the history


class NgramDrafter:
    """The ``ngram-simple`` method behind the drafter protocol (see drafters/__init__.py).

    ``ngram_max`` .. ``ngram_min``: the longest key tried first, down to the shortest.
    """

    name = "ngram-simple"

    def __init__(self, *, n_max: int, n_min: int = 0, n_max_limit: int = 32, ngram_min: int = 2,
                 ngram_max: int = 4) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.n_max_limit = n_max_limit
        self.n_max = max(1, min(n_max, n_max_limit))
        self.n_min = min(n_min, self.n_max)
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self._tokens = np.zeros(0, dtype=np.int32)
        self._pos = np.zeros(0, dtype=np.int32)  # the target position of each history entry
        self._last_rows = 0  # history entries added by the last process() call

    # --- protocol
    def process(self, rows: TargetRows) -> None:
        if rows.tokens is None:  # media: one separator for the chunk, at its first position
            if len(self._tokens) and self._tokens[-1] == _SEPARATOR and self._pos[-1] == rows.section0[0]:
                self._last_rows = 0  # a later slice of the same chunk
                return
            add_tok = np.array([_SEPARATOR], dtype=np.int32)
            add_pos = rows.section0[:1].astype(np.int32)
        else:
            add_tok = np.asarray(rows.tokens, dtype=np.int32)
            add_pos = rows.section0.astype(np.int32)
        self._tokens = np.concatenate([self._tokens, add_tok])
        self._pos = np.concatenate([self._pos, add_pos])
        self._last_rows = len(add_tok)

    def draft(self, id_last: int, n_max: int | None = None, n_min: int | None = None) -> Proposal:
        n = min(self.n_max if n_max is None else n_max, self.n_max_limit)
        n_min = self.n_min if n_min is None else n_min
        ctx = np.append(self._tokens, np.int32(id_last))
        out = self._lookup(ctx, n)
        return Proposal(out if len(out) >= max(n_min, 1) else [])

    def accept(self, n_kept: int) -> None:
        drop = self._last_rows - n_kept
        if drop > 0:
            self._tokens, self._pos = self._tokens[:-drop], self._pos[:-drop]
        self._last_rows = 0

    def truncate(self, target_pos: int) -> None:
        keep = int(np.searchsorted(self._pos, target_pos, side="left"))
        self._tokens, self._pos = self._tokens[:keep], self._pos[:keep]

    def reset(self) -> None:
        self._tokens = np.zeros(0, dtype=np.int32)
        self._pos = np.zeros(0, dtype=np.int32)
        self._last_rows = 0

    def close(self) -> None:
        self.reset()

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
            follow = ctx[start:start + n_draft]
            cut = np.flatnonzero(follow == _SEPARATOR)
            if len(cut):
                follow = follow[:cut[0]]
            if len(follow):
                return follow.tolist()
        return []
