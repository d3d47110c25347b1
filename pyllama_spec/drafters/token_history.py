"""Each sequence's tokens as the target decoded them: what the n-gram drafters search.

llama-server hands its n-gram drafters the slot's text tokens (``get_text_tokens``: a picture's
rows left out, so the text on either side of a picture joins up). Here a picture stands as one
``SEPARATOR``, so no n-gram matches across it and no draft copies through it (drafts are cut at
it: ``cut_at_separator``). On text the two are the same list.

The history follows ``process`` (prompt slices and verify rows) and ``forget`` (rejected drafts,
a shorter cached prompt, a reset), so at a draft it holds exactly the tokens the sequence's cache
holds, without ``id_last``.
"""

from __future__ import annotations

import numpy as np

SEPARATOR = -2  # stands for a media chunk; never a token id (llama.cpp's LLAMA_TOKEN_NULL is -1)
_EMPTY = np.zeros(0, dtype=np.int32)


class TokenHistory:
    """Per sequence: the tokens (int32, a picture as one SEPARATOR) and each one's target position."""

    def __init__(self) -> None:
        self._seqs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def tokens(self, seq_id: int) -> np.ndarray:
        return self._seqs.get(seq_id, (_EMPTY, _EMPTY))[0]

    def add(self, decode) -> None:
        """Record the rows of a target decode (drafters' ``process``)."""
        for r in decode.rows:
            tokens, pos = self._seqs.get(r.seq_id, (_EMPTY, _EMPTY))
            if r.tokens is None:  # media: one separator for the chunk, at its first position
                if len(tokens) and tokens[-1] == SEPARATOR and pos[-1] == r.section0[0]:
                    continue  # a later slice of the same chunk
                add_tok = np.array([SEPARATOR], dtype=np.int32)
                add_pos = r.section0[:1].astype(np.int32)
            else:
                add_tok = np.asarray(r.tokens, dtype=np.int32)
                add_pos = r.section0.astype(np.int32)
            self._seqs[r.seq_id] = (np.concatenate([tokens, add_tok]), np.concatenate([pos, add_pos]))

    def forget(self, seq_id: int, pos: int) -> None:
        """Keep what sits before target position ``pos`` (drafters' ``forget``)."""
        tokens, at = self._seqs.get(seq_id, (_EMPTY, _EMPTY))
        keep = int(np.searchsorted(at, pos, side="left"))
        self._seqs[seq_id] = (tokens[:keep], at[:keep])

    def clear(self) -> None:
        self._seqs.clear()


def cut_at_separator(draft: list[int]) -> list[int]:
    """A draft up to (not through) a picture."""
    return draft[:draft.index(SEPARATOR)] if SEPARATOR in draft else draft
