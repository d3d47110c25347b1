"""``ngram-mod``: llama.cpp's hashed n-gram table (common/ngram-mod.cpp, ggml-org/llama.cpp#19164), ported.

One table of 4M slots, shared by every sequence, maps the hash of an ``n_match``-token n-gram to
the token that last followed it. A draft walks the table from the last ``n_match`` tokens: each
drafted token extends the key for the next, up to ``n_max`` tokens, and a walk that ends before
``n_min`` tokens drafts nothing. The table is filled from each prompt and, in chunks of 32, from
what is generated; it is cleared when a quarter of it is used, and after five drafts in a row of
which the target accepted less than a quarter. Reported at 2.5x on code refactoring upstream.

The behaviour, hash collisions and the shared table included, is llama.cpp's, so on text the
drafts are llama-server's.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from pyllama_spec.drafters import DraftRequest, Proposal
from pyllama_spec.drafters.token_history import (
    HistoryDrafter,
    cut_at_separator,
    no_memory_parts,
    tokens_only_pairing,
)

TABLE_SIZE = 4 * 1024 * 1024
EMPTY = -1
_MULT = 6364136223846793005
_MASK64 = (1 << 64) - 1
_OCCUPANCY_RESET = 0.25  # a begin that finds the table fuller than this clears it
_CHUNK = 32  # generated tokens are added to the table in chunks of this many

memory_parts = no_memory_parts  # the registry's functions (registry.py)


def check_pair(target, draft, build_record: dict):
    """Each drafter holds to its own length (registry.NGRAM_DRAFT_LIMIT bounds the settings)."""
    from pyllama_spec.drafters.registry import NGRAM_DRAFT_LIMIT

    return tokens_only_pairing(NGRAM_DRAFT_LIMIT)


def make(setup) -> "NgramModDrafter":
    """The registry's constructor (registry.py)."""
    s = setup.ngram
    return NgramModDrafter(n_match=s.mod_n_match, n_min=s.mod_n_min, n_max=s.mod_n_max, default_length=setup.n_max)


class NgramTable:
    """common_ngram_mod: hash of n tokens -> the token that followed (EMPTY: none)."""

    def __init__(self, n: int, size: int = TABLE_SIZE) -> None:
        self.n = n
        self._lead = pow(_MULT, n - 1, 1 << 64)  # the first token's weight in the hash (for roll)
        self.entries = np.full(size, EMPTY, dtype=np.int32)
        self.used = 0

    def _index(self, windows: np.ndarray) -> np.ndarray:
        """The slots of n-grams (rows of ``windows``): a 64-bit multiplicative hash, modulo the size."""
        h = np.zeros(len(windows), dtype=np.uint64)
        with np.errstate(over="ignore"):  # the hash wraps around 2**64, as size_t does
            for i in range(self.n):
                h = h * np.uint64(_MULT) + windows[:, i].astype(np.int64).astype(np.uint64)
        return (h % np.uint64(len(self.entries))).astype(np.int64)

    def add_all(self, tokens: np.ndarray, start: int, stop: int) -> None:
        """``add`` of the n-grams starting at start..stop-1 (each followed by its next token), in order."""
        if stop <= start:
            return
        windows = np.lib.stride_tricks.sliding_window_view(tokens[start:stop + self.n], self.n + 1)
        slots = self._index(windows[:, :self.n])
        self.used += len(np.unique(slots[self.entries[slots] == EMPTY]))
        self.entries[slots] = windows[:, self.n]  # a slot written twice keeps the later token, as in order

    def hash(self, key: Sequence[int]) -> int:
        """The 64-bit hash of an n-gram (idx before the modulo)."""
        h = 0
        for t in key:
            h = (h * _MULT + (t & _MASK64)) & _MASK64
        return h

    def roll(self, h: int, leaving: int, entering: int) -> int:
        """The hash of the n-gram one token on: ``leaving`` drops out at the front, ``entering`` comes in
        (the hash is a polynomial in _MULT modulo 2**64, so a step costs two products, not n)."""
        return ((h - (leaving & _MASK64) * self._lead) * _MULT + (entering & _MASK64)) & _MASK64

    def at(self, h: int) -> int:
        """The token stored for the n-gram of hash ``h`` (EMPTY: none)."""
        return int(self.entries[h % len(self.entries)])

    def get(self, key: Sequence[int]) -> int:
        return self.at(self.hash(key))

    def reset(self) -> None:
        self.entries.fill(EMPTY)
        self.used = 0


@dataclasses.dataclass
class _SeqInfo:
    i_last: int = 0  # the history is in the table up to here
    n_draft_last: int = 0  # the length of the last draft
    n_low: int = 0  # drafts in a row of which less than a quarter was accepted


class NgramModDrafter(HistoryDrafter):
    """``ngram-mod`` behind the drafter protocol (drafters/__init__.py)."""

    name = "ngram-mod"

    def __init__(self, *, n_match: int = 24, n_min: int = 48, n_max: int = 64, table_size: int = TABLE_SIZE,
                 default_length: int | None = None) -> None:
        if n_match < 1 or n_max < 1 or n_min < 0:
            raise ValueError(f"ngram-mod needs n_match >= 1, n_max >= 1 and n_min >= 0, got {n_match}, {n_max}, {n_min}")
        self.walk_min, self.walk_max = n_min, n_max  # a walk that ends before walk_min drafts nothing
        self.n_max_limit = n_max
        self.n_max = n_max if default_length is None else max(1, min(default_length, n_max))
        self.n_min = 0  # the requests' own n_min (draft_min) still applies
        self.limit_reason = f"its --spec-ngram-mod-n-max {n_max}"
        self.table = NgramTable(n_match, table_size)
        super().__init__()
        self._seqs: dict[int, _SeqInfo] = {}

    def _info(self, seq_id: int) -> _SeqInfo:
        return self._seqs.setdefault(seq_id, _SeqInfo())

    def begin(self, seq_id: int) -> None:
        info, prompt, n = self._info(seq_id), self._history.tokens(seq_id), self.table.n
        info.i_last = info.n_draft_last = 0
        if len(prompt) < n:
            return
        self.table.add_all(prompt, 0, len(prompt) - n)
        info.i_last = len(prompt) - n
        if self.table.used / len(self.table.entries) > _OCCUPANCY_RESET:
            self.table.reset()

    def draft(self, requests: Sequence[DraftRequest]) -> list[Proposal]:
        out = []
        for rq in requests:
            # the walk goes to n_max, as llama.cpp's (its n_min check and the length accept() judges
            # are the whole walk's); the request's budget cuts it after
            found = cut_at_separator(self._draft_one(rq))[:rq.n_max]
            out.append(Proposal(found if len(found) >= max(rq.n_min, 1) else []))
        return out

    def _draft_one(self, rq: DraftRequest) -> list[int]:
        info, prompt, n = self._info(rq.seq_id), self._history.tokens(rq.seq_id), self.table.n
        info.n_draft_last = 0
        cur_len = len(prompt)
        if cur_len < n:
            return []
        if info.i_last + _CHUNK < cur_len:  # the generated tokens, in chunks
            self.table.add_all(prompt, info.i_last, cur_len - n)
            info.i_last = cur_len - n
        key = [*prompt[cur_len - n + 1:].tolist(), rq.id_last]
        h = self.table.hash(key)  # then rolled a token at a time as the walk extends the key
        drafted: list[int] = []
        for i in range(self.walk_max):
            token = self.table.at(h)
            if token == EMPTY:
                if i < self.walk_min:
                    return []
                break
            drafted.append(token)
            key.append(token)
            h = self.table.roll(h, key[i], token)
        info.n_draft_last = len(drafted)
        return drafted

    def accept(self, seq_id: int, n_accepted: int) -> None:
        info = self._info(seq_id)
        if info.n_draft_last > 0:
            if n_accepted / info.n_draft_last < 0.25:
                info.n_low += 1
                if info.n_low >= 5:  # the table has gone stale for this text: start over
                    self.table.reset()
                    info.n_low = info.i_last = 0
            else:
                info.n_low = 0

    def close(self) -> None:
        super().close()
        self._seqs.clear()
