"""Each sequence's tokens as the target decoded them: what the n-gram drafters (and a Python draft
function) search, and what those drafters share (``HistoryDrafter``, their registry functions).

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


class _Seq:
    """One sequence's tokens and positions in buffers that grow by doubling: an append costs its rows."""

    def __init__(self) -> None:
        self.tokens = np.zeros(64, dtype=np.int32)
        self.pos = np.zeros(64, dtype=np.int32)
        self.n = 0

    def append(self, tokens: np.ndarray, pos: np.ndarray) -> None:
        need = self.n + len(tokens)
        if need > len(self.tokens):
            size = max(need, 2 * len(self.tokens))
            self.tokens = np.resize(self.tokens, size)
            self.pos = np.resize(self.pos, size)
        self.tokens[self.n:need] = tokens
        self.pos[self.n:need] = pos
        self.n = need


class TokenHistory:
    """Per sequence: the tokens (int32, a picture as one SEPARATOR) and each one's target position."""

    def __init__(self) -> None:
        self._seqs: dict[int, _Seq] = {}

    def tokens(self, seq_id: int) -> np.ndarray:
        """The sequence's tokens: a view, valid until its next change."""
        seq = self._seqs.get(seq_id)
        return _EMPTY if seq is None else seq.tokens[:seq.n]

    def add(self, decode) -> None:
        """Record the rows of a target decode (drafters' ``process``)."""
        for r in decode.rows:
            seq = self._seqs.setdefault(r.seq_id, _Seq())
            if r.tokens is None:  # media: one separator for the chunk, at its first position
                if seq.n and seq.tokens[seq.n - 1] == SEPARATOR and seq.pos[seq.n - 1] == r.section0[0]:
                    continue  # a later slice of the same chunk
                seq.append(np.array([SEPARATOR], dtype=np.int32), r.section0[:1].astype(np.int32))
            else:
                seq.append(np.asarray(r.tokens, dtype=np.int32), r.section0.astype(np.int32))

    def forget(self, seq_id: int, pos: int) -> None:
        """Keep what sits before target position ``pos`` (drafters' ``forget``)."""
        seq = self._seqs.get(seq_id)
        if seq is not None:
            seq.n = int(np.searchsorted(seq.pos[:seq.n], pos, side="left"))

    def clear(self) -> None:
        self._seqs.clear()


def cut_at_separator(draft: list[int]) -> list[int]:
    """A draft up to (not through) a picture."""
    return draft[:draft.index(SEPARATOR)] if SEPARATOR in draft else draft


class HistoryDrafter:
    """The drafter protocol's calls for a drafter that reads the tokens alone (the n-gram types, a
    Python draft function): every decode's rows into a ``TokenHistory`` (``self._history``), forgotten
    with the sequence. Subclasses draft from it, and add ``begin`` / ``accept`` where they use them."""

    def __init__(self) -> None:
        self._history = TokenHistory()

    def process(self, decode) -> None:
        self._history.add(decode)

    def forget(self, seq_id: int, pos: int, draft_pos: int) -> None:
        self._history.forget(seq_id, pos)

    def close(self) -> None:
        self._history.clear()


def no_memory_parts(settings) -> list:
    """The registry's memory parts (registry.py) of a drafter that reads the tokens alone: none counted
    (a token history per sequence; ngram-mod's 16 MiB table and the maps' 1 MiB per sequence are
    small beside a model)."""
    return []


def tokens_only_pairing(limit: int):
    """The registry's pairing (registry.py) of a drafter that reads the tokens alone: any target, no
    draft file, no distribution over the drafted tokens, drafts of at most ``limit``."""
    from pyllama_spec.drafters.registry import Pairing

    return Pairing(limit=limit, per_position_logits=False)
