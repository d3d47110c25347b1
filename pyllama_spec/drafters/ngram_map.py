"""``ngram-map-k`` and ``ngram-map-k4v``: llama.cpp's n-gram maps (common/ngram-map.cpp), ported.

Both look the last ``size_n`` tokens (the key, ``id_last`` included) up in the sequence's history
and draft the ``size_m`` tokens that followed its latest earlier occurrence:

* ``ngram-map-k`` drafts after any match, and shortens the next draft from a key to what the
  target accepted of the last one from it;
* ``ngram-map-k4v`` keeps up to four different continuations of each key with their counts, and
  drafts only after ``min_hits`` sightings, with the most frequent continuation when it is at
  least twice as frequent as the others together.

A hash table (key hash -> latest index) finds most keys at once; the linear scans behind it are
numpy searches over the history. Histories, hash table and statistics are per sequence, and are
cleaned up when a new prompt is shorter than what they indexed (llama.cpp's ``begin``). The
behaviour, hash collisions included, is llama.cpp's, so on text the drafts are llama-server's.
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

MAX_VALUES = 4  # COMMON_NGRAM_MAX_VALUES: continuations kept per key
HASH_MAP_SIZE = 262144  # COMMON_NGRAM_HASH_MAP_SIZE
MAX_VALUE_COUNT = 16380  # COMMON_NGRAM_MAX_VALUE_COUNT
_LCG = 2654435761
_MASK = 0xFFFFFFFF

memory_parts = no_memory_parts  # the registry's functions (registry.py)


def check_pair(target, draft, build_record: dict):
    """Each drafter holds to its own length (registry.NGRAM_DRAFT_LIMIT bounds the settings)."""
    from pyllama_spec.drafters.registry import NGRAM_DRAFT_LIMIT

    return tokens_only_pairing(NGRAM_DRAFT_LIMIT)


def make(setup) -> "NgramMapDrafter":
    """The registry's constructor (registry.py): ngram-map-k or ngram-map-k4v, by the setup's method."""
    key_only = setup.method_name == "ngram-map-k"
    size_n, size_m, min_hits = setup.ngram.map_k if key_only else setup.ngram.map_k4v
    return NgramMapDrafter(key_only=key_only, size_n=size_n, size_m=size_m, min_hits=min_hits,
                           n_max=setup.n_max, n_min=setup.n_min)


@dataclasses.dataclass
class _Value:
    idx: int = 0  # where this continuation starts in the history (0: slot unused)
    num: int = 0  # how often it followed the key
    n_accepted: int = -1  # what the target accepted of the last draft from it


@dataclasses.dataclass
class _Key:
    idx: int  # where the key occurs in the history
    stat_idx: int = 0  # the history is counted up to here
    num: int = 0  # how often the key was looked up with a match
    values: list[_Value] = dataclasses.field(default_factory=list)


def _hashes(tokens: np.ndarray, starts: np.ndarray, n: int) -> np.ndarray:
    """common_ngram_map_hash of the n-grams at ``starts`` (uint32 LCG), modulo the table size."""
    h = np.zeros(len(starts), dtype=np.uint64)
    for i in range(n):
        h = (h * _LCG + tokens[starts + i].astype(np.int64).astype(np.uint64)) & _MASK
    return (h % HASH_MAP_SIZE).astype(np.int64)


def _last_match(tokens: np.ndarray, key: np.ndarray, lo: int, hi: int) -> int:
    """The largest j with lo < j <= hi where ``key`` starts in ``tokens`` (0: none; j = 0 is never a match)."""
    lo = max(lo, 0)
    if hi <= lo:
        return 0
    windows = np.lib.stride_tricks.sliding_window_view(tokens[lo + 1:hi + len(key)], len(key))
    hits = np.flatnonzero((windows == key).all(axis=1))
    return lo + 1 + int(hits[-1]) if len(hits) else 0


class NgramMap:
    """common_ngram_map for one sequence."""

    def __init__(self, size_key: int, size_value: int, key_only: bool, min_hits: int) -> None:
        self.n, self.m = size_key, size_value
        self.key_only, self.min_hits = key_only, min_hits
        self.keys: list[_Key] = []
        self._key_index: dict[bytes, int] = {}  # a key's tokens -> its place in keys (each key once)
        self.key_map = np.zeros(HASH_MAP_SIZE, dtype=np.uint32)  # key hash -> index of the key (0: none)
        self.key_map_last_idx = 0
        self.size_last_begin = 0  # the history's length at the last begin
        self.idx_last_check = 0
        self.last_draft: tuple[int, int] | None = None  # (key, value) of the last draft made

    def begin(self, tokens: np.ndarray) -> None:
        """common_ngram_map_begin: a new prompt; forget what was indexed past its end."""
        size_begin = len(tokens)
        cleanup = self.size_last_begin
        if cleanup > size_begin:
            cleanup = size_begin - self.n - self.m if size_begin > self.n + self.m else 0
        if size_begin < self.idx_last_check:
            stale = (self.key_map != 0) & (self.key_map >= cleanup)
            self.key_map[stale] = 0
            self.key_map_last_idx = cleanup - 1 if cleanup > 0 else 0
            kept = []
            for key in self.keys:
                if key.idx >= cleanup:
                    continue
                if not self.key_only:
                    key.values = [v for v in key.values if v.idx == 0 or v.idx < cleanup]
                    key.values += [_Value() for _ in range(MAX_VALUES - len(key.values))]
                    if key.values[0].idx == 0:
                        continue  # no continuation left
                kept.append(key)
            self.keys = kept
        self.idx_last_check = size_begin
        self.size_last_begin = size_begin
        # Keys are found by what the history holds at their index now (a new prompt may have changed
        # it), the first in the list winning, as llama.cpp's linear search finds them.
        self._key_index = {}
        for i, k in enumerate(self.keys):
            self._key_index.setdefault(tokens[k.idx:k.idx + self.n].tobytes(), i)

    def draft(self, inp: np.ndarray, sampled: int) -> list[int]:
        """common_ngram_map_draft: ``inp`` is the history (without ``sampled``, the last token)."""
        self.last_draft = None
        cur_len, n, m = len(inp), self.n, self.m
        if cur_len < 2 * n + m:
            return []
        self.idx_last_check = cur_len
        key = np.append(inp[cur_len - n + 1:], np.int32(sampled)).astype(np.int32)
        last_start = cur_len - n - m - 1  # the latest key start whose continuation is all in the history

        match_pos = 0
        idx_key = int(self.key_map[_hashes(key, np.zeros(1, dtype=np.int64), n)[0]])
        if idx_key != 0 and idx_key < last_start and np.array_equal(inp[idx_key:idx_key + n], key):
            match_pos = idx_key
        if match_pos == 0 and self.size_last_begin > n + m + 1:  # in the prompt, below the hashed part
            match_pos = _last_match(inp, key, self.key_map_last_idx, self.size_last_begin - n - m - 1)
        if match_pos == 0:  # in what was generated since (a reasoning block may be dropped later)
            match_pos = _last_match(inp, key, max(self.size_last_begin, self.key_map_last_idx), last_start)
        self._hash_new_keys(inp, last_start)
        if match_pos == 0:
            return []

        k = self._key_index.get(key.tobytes())
        if k is None:
            self.keys.append(_Key(idx=match_pos, values=[_Value(n_accepted=m) for _ in range(MAX_VALUES)]))
            k = self._key_index[key.tobytes()] = len(self.keys) - 1
        entry = self.keys[k]
        entry.num = min(entry.num + 1, MAX_VALUE_COUNT)

        if self.key_only:  # the m tokens after the key, as many as the target took of the last such draft
            self.last_draft = (k, 0)
            return inp[match_pos + n:match_pos + n + min(m, entry.values[0].n_accepted)].tolist()

        if entry.num < self.min_hits:
            return []
        self._count_values(entry, inp, key, match_pos)
        counts = [v.num for v in entry.values]
        best = max(range(MAX_VALUES), key=lambda v: (counts[v], -v))  # the first of the most frequent
        if counts[best] == 0:
            best = 0
        others = sum(counts) - counts[best]
        if others > 0 and counts[best] < 2 * others:
            return []  # no continuation clearly ahead
        self.last_draft = (k, best)
        # As llama.cpp: the tokens after the match (the latest occurrence), as long as the chosen
        # continuation's last acceptance allows.
        return inp[match_pos + n:match_pos + n + min(m, entry.values[best].n_accepted)].tolist()

    def accept(self, n_accepted: int) -> None:
        """common_ngram_map_accept: what the target kept of the last draft."""
        if self.last_draft is not None:
            k, v = self.last_draft
            self.keys[k].values[v].n_accepted = n_accepted

    def _hash_new_keys(self, inp: np.ndarray, last_start: int) -> None:
        """Put the keys not hashed yet in the table, latest first; a slot already taken keeps its key."""
        n, m, low = self.n, self.m, self.key_map_last_idx
        parts = []
        if self.size_last_begin > n + m + 1:
            parts.append(np.arange(self.size_last_begin - n - m - 1, low, -1))
        parts.append(np.arange(last_start, max(self.size_last_begin, low), -1))
        starts = np.concatenate(parts)
        if len(starts):
            h = _hashes(inp, starts, n)
            # each slot's first key in this order (the prompt's part first, as llama.cpp): a taken slot keeps its key
            h_first, first = np.unique(h, return_index=True)
            free = self.key_map[h_first] == 0
            self.key_map[h_first[free]] = starts[first[free]]
        self.key_map_last_idx = max(last_start, self.key_map_last_idx)

    def _count_values(self, entry: _Key, inp: np.ndarray, key: np.ndarray, match_pos: int) -> None:
        """Count the continuations after each occurrence of the key since the last count."""
        n, m = self.n, self.m
        span = inp[entry.stat_idx:match_pos + n]
        if len(span) >= n:
            hits = np.flatnonzero((np.lib.stride_tricks.sliding_window_view(span, n) == key).all(axis=1))
            for i in (entry.stat_idx + hits).tolist():
                start = i + n
                for v in entry.values:
                    if v.idx == 0:  # a new continuation
                        v.idx, v.num, v.n_accepted = start, 0, m
                    elif not np.array_equal(inp[start:start + m], inp[v.idx:v.idx + m]):
                        continue
                    v.num = min(v.num + 1, MAX_VALUE_COUNT)
                    break
        entry.stat_idx = match_pos


class NgramMapDrafter(HistoryDrafter):
    """``ngram-map-k`` (``key_only``) or ``ngram-map-k4v`` behind the drafter protocol
    (drafters/__init__.py), one ``NgramMap`` per sequence."""

    def __init__(self, *, key_only: bool, size_n: int = 12, size_m: int = 48, min_hits: int = 1,
                 n_max: int | None = None, n_min: int = 0) -> None:
        if size_n < 1 or size_m < 1:
            raise ValueError(f"the n-gram map needs size_n >= 1 and size_m >= 1, got {size_n}, {size_m}")
        self.name = "ngram-map-k" if key_only else "ngram-map-k4v"
        self._settings = (size_n, size_m, key_only, min_hits)
        self.n_max_limit = size_m
        self.n_max = size_m if n_max is None else max(1, min(n_max, size_m))
        self.n_min = min(n_min, self.n_max)
        self.limit_reason = f"its m-gram size {size_m} (--spec-{self.name}-size-m)"
        super().__init__()
        self._maps: dict[int, NgramMap] = {}

    def _map(self, seq_id: int) -> NgramMap:
        if seq_id not in self._maps:
            self._maps[seq_id] = NgramMap(*self._settings)
        return self._maps[seq_id]

    def begin(self, seq_id: int) -> None:
        self._map(seq_id).begin(self._history.tokens(seq_id))

    def draft(self, requests: Sequence[DraftRequest]) -> list[Proposal]:
        out = []
        for rq in requests:
            found = self._map(rq.seq_id).draft(self._history.tokens(rq.seq_id), rq.id_last)
            found = cut_at_separator(found)[:rq.n_max]
            out.append(Proposal(found if len(found) >= max(rq.n_min, 1) else []))
        return out

    def accept(self, seq_id: int, n_accepted: int) -> None:
        self._map(seq_id).accept(n_accepted)

    def close(self) -> None:
        super().close()
        self._maps.clear()
