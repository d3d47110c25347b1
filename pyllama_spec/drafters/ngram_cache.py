"""llama.cpp's n-gram cache (``common/ngram-cache.{h,cpp}``), the heart of its ``ngram-cache``
speculative type, ported to Python.

An n-gram cache maps each n-gram (1 to 4 tokens) to the tokens seen right after it, with counts.
Drafting consults three of them, one token at a time, longest n-gram first:

* the *context* cache, built from the sequence itself as it grows (``update``);
* the *dynamic* cache, from earlier generations, and the *static* cache, of 2-grams from a large
  corpus: both loaded from files that llama.cpp's ``llama-lookup-create`` / ``llama-lookup-merge``
  write (``load``, ``save``: the same binary layout).

A candidate must reach a minimum sample size (the n-gram's total count) and share of it: lax
thresholds for the context cache (n-gram sizes 1..4: at least 2, 2, 1, 1 samples and 66, 50, 50,
50 %), strict ones for the dynamic cache (4, 3, 2, 2 and 75, 66, 66, 66 %). The static cache's
counts after the last two tokens weigh the candidates of both (validation), and it drafts on its
own (lax 2-gram thresholds) when they find nothing. The draft stops where nothing passes.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator, Mapping
from typing import Sequence

import numpy as np

from pyllama_spec.drafters import Proposal
from pyllama_spec.drafters.token_history import (
    HistoryDrafter,
    cut_at_separator,
    no_memory_parts,
    tokens_only_pairing,
)

NGRAM_MIN, NGRAM_MAX, NGRAM_STATIC = 1, 4, 2
TOKEN_NULL = -1  # LLAMA_TOKEN_NULL: pads an n-gram shorter than NGRAM_MAX; also "nothing drafted"

Ngram = tuple[int, ...]  # NGRAM_MAX ints, padded with TOKEN_NULL
Part = dict[int, int]  # common_ngram_cache_part: next token -> count

# If sample size or percentage are below these thresholds the draft is aborted early (indexed by
# n-gram size - 1, as in ngram-cache.cpp):
DRAFT_MIN_SAMPLE_SIZE_LAX = (2, 2, 1, 1)
DRAFT_MIN_PERCENT_LAX = (66, 50, 50, 50)
DRAFT_MIN_SAMPLE_SIZE_STRICT = (4, 3, 2, 2)
DRAFT_MIN_PERCENT_STRICT = (75, 66, 66, 66)

_PADDING = tuple([TOKEN_NULL] * NGRAM_MAX)
_RECORD_HEAD = NGRAM_MAX + 1  # int32s before a record's pairs: the n-gram, then ntokens


def _ngram(tokens: Sequence[int]) -> Ngram:
    """common_ngram(input, ngram_size): the tokens, padded to NGRAM_MAX with TOKEN_NULL."""
    return tuple(tokens) + _PADDING[len(tokens):]


class NgramCache(Mapping):
    """common_ngram_cache: n-gram (a tuple of NGRAM_MAX ints, padded with TOKEN_NULL) -> {next token: count}.

    A read-only ``Mapping`` over ``ngrams``, the underlying dict (modify it only through
    ``update`` / ``merge`` / ``load``). Each part keeps its tokens in insertion order, which
    decides ties in drafting (see ``_best_primary``).
    """

    def __init__(self, ngrams: dict[Ngram, Part] | None = None) -> None:
        self.ngrams: dict[Ngram, Part] = {} if ngrams is None else ngrams

    # Mapping protocol
    def __getitem__(self, ngram: Ngram) -> Part:
        return self.ngrams[ngram]

    def __iter__(self) -> Iterator[Ngram]:
        return iter(self.ngrams)

    def __len__(self) -> int:
        return len(self.ngrams)

    def __repr__(self) -> str:
        return f"NgramCache({len(self.ngrams)} n-grams)"

    def update(self, inp: Sequence[int], nnew: int, ngram_min: int = NGRAM_MIN, ngram_max: int = NGRAM_MAX) -> None:
        """common_ngram_cache_update: count, for every n-gram size, the n-gram before each of the
        last ``nnew`` tokens of ``inp`` followed by that token.

        ``inp`` may only have been appended to since the last call (the n-grams before the new
        tokens are read from it); a change in the middle needs a new cache.
        """
        if not 1 <= ngram_min <= ngram_max <= NGRAM_MAX:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max <= {NGRAM_MAX}, got {ngram_min}, {ngram_max}")
        inp_size = len(inp)
        # Only the new tokens and the ngram_max before them are read: convert just those (plain
        # ints, whatever sequence type came in), so an incremental update costs O(nnew).
        base = max(0, min(inp_size, inp_size - nnew) - ngram_max)
        tail = [int(t) for t in inp[base:]]
        table = self.ngrams
        for ngram_size in range(ngram_min, ngram_max + 1):
            i_start = max(inp_size - nnew, ngram_size)
            for i in range(i_start - base, inp_size - base):
                ngram = _ngram(tail[i - ngram_size:i])
                token = tail[i]
                part = table.get(ngram)
                if part is None:
                    table[ngram] = {token: 1}
                else:
                    part[token] = part.get(token, 0) + 1

    def merge(self, other: NgramCache) -> None:
        """common_ngram_cache_merge: add ``other``'s counts to this cache (``other`` is unchanged)."""
        table = self.ngrams
        for ngram, part in other.ngrams.items():
            merged = table.get(ngram)
            if merged is None:
                table[ngram] = dict(part)  # a copy, as the C++ emplaces one
                continue
            # reversed(): the C++ walks std::unordered_map, newest first for small parts (see
            # _best_primary), so its new tokens land in the target in that order.
            for token, count in reversed(part.items()):
                if count <= 0:
                    raise ValueError(f"n-gram {ngram}: token {token} has count {count} (must be > 0)")
                merged[token] = merged.get(token, 0) + count

    def save(self, path: str | os.PathLike) -> None:
        """common_ngram_cache_save: per n-gram a record of little-endian int32s: the NGRAM_MAX
        n-gram tokens, ntokens, then ntokens (token, count) pairs. No header, records back to back."""
        flat: list[int] = []
        for ngram, part in self.ngrams.items():
            if len(ngram) != NGRAM_MAX:
                raise ValueError(f"n-gram {ngram} does not have {NGRAM_MAX} tokens")
            if not part:
                raise ValueError(f"n-gram {ngram} has no tokens")  # GGML_ASSERT(!token_counts.empty())
            flat.extend(ngram)
            flat.append(len(part))
            # Newest first, as the C++ writes small parts (std::unordered_map order, see
            # _best_primary); load inserts in file order, so a round trip reverses the order in
            # which ties are broken, in llama.cpp and here alike.
            for token, count in reversed(part.items()):
                if count <= 0:
                    raise ValueError(f"n-gram {ngram}: token {token} has count {count} (must be > 0)")
                flat.append(token)
                flat.append(count)
        info = np.iinfo(np.int32)
        if flat and not (info.min <= min(flat) and max(flat) <= info.max):
            raise ValueError(f"{os.fspath(path)}: a token or count does not fit an int32")
        np.asarray(flat, dtype="<i4").tofile(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> NgramCache:
        """common_ngram_cache_load: read a file written by ``save`` or by llama.cpp.

        Raises ``ValueError`` naming the file and the byte offset on a missing/unreadable file, a
        truncated record, ntokens <= 0 or a count <= 0 (where the C++ aborts). Time and memory
        are linear in the file's size; ntokens is checked against the bytes left before use.
        """
        name = os.fspath(path)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ValueError(f"{name}: cannot read n-gram cache file: {e.strerror or e}") from e
        size = len(data)
        n_ints = size // 4
        words = np.frombuffer(data, dtype="<i4", count=n_ints)
        if not words.dtype.isnative:
            words = words.astype(np.int32)  # a big-endian host: native order for the walk below
        # One Python-level step per record only: find where each record starts. Records vary in
        # length, each start depends on the previous ntokens, so this walk can't be vectorised;
        # a memoryview of int32 gives plain Python ints cheaply.
        view = memoryview(words).cast("B").cast("i")
        starts: list[int] = []
        problem: str | None = None
        partial_pairs = 0  # complete pairs of a record cut short in its pairs (their counts are checked too)
        partial_start = -1
        pos = 0
        while 4 * pos < size:
            if pos + NGRAM_MAX > n_ints:
                problem = (f"record at byte offset {4 * pos} is truncated in its n-gram "
                           f"({size - 4 * pos} of {4 * NGRAM_MAX} bytes left)")
                break
            if pos + _RECORD_HEAD > n_ints:
                problem = (f"record at byte offset {4 * pos} is truncated in its ntokens field "
                           f"at byte offset {4 * (pos + NGRAM_MAX)}")
                break
            ntokens = view[pos + NGRAM_MAX]
            if ntokens <= 0:
                problem = (f"record at byte offset {4 * pos} has ntokens {ntokens} "
                           f"at byte offset {4 * (pos + NGRAM_MAX)} (must be > 0)")
                break
            end = pos + _RECORD_HEAD + 2 * ntokens
            if end > n_ints:
                have = (n_ints - pos - _RECORD_HEAD) // 2
                partial_start, partial_pairs = pos, have
                problem = (f"record at byte offset {4 * pos} claims {ntokens} (token, count) pairs "
                           f"({8 * ntokens} bytes from byte offset {4 * (pos + _RECORD_HEAD)}), which runs "
                           f"past the end of the file at byte offset {size} (only {have} complete pairs follow)")
                break
            starts.append(pos)
            pos = end

        starts_arr = np.asarray(starts, dtype=np.int64)
        ntok = words[starts_arr + NGRAM_MAX].astype(np.int64) if starts else np.zeros(0, np.int64)
        if partial_pairs:  # the C++ reads (and checks) these pairs before it hits the end
            starts_arr = np.append(starts_arr, partial_start)
            ntok = np.append(ntok, partial_pairs)
        # Every pair's position, vectorised: record start + head + 2 * (index within the record).
        first_pair = np.cumsum(ntok) - ntok
        pair_pos = np.repeat(starts_arr + _RECORD_HEAD - 2 * first_pair, ntok) + 2 * np.arange(int(ntok.sum()))
        counts = words[pair_pos + 1]
        bad = np.flatnonzero(counts <= 0)
        if bad.size:  # the earliest error in the file wins, as in the C++'s sequential read
            at = int(pair_pos[bad[0]] + 1)
            rec = int(starts_arr[np.searchsorted(starts_arr, at, side="right") - 1])
            raise ValueError(f"{name}: corrupt n-gram cache file: record at byte offset {4 * rec} has count {int(words[at])} "
                             f"at byte offset {4 * at} (must be > 0)")
        if problem is not None:
            raise ValueError(f"{name}: corrupt n-gram cache file: {problem}")

        # Build the dicts from flat lists, one comprehension each. The garbage collector is off
        # meanwhile: millions of new tuples and dicts would trigger its passes over and over.
        n_records = len(starts)
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            keys = list(zip(*(words[starts_arr[:n_records] + j].tolist() for j in range(NGRAM_MAX))))
            tokens = words[pair_pos].tolist()
            counts_l = counts.tolist()
            bounds_l = [0] + np.cumsum(ntok[:n_records]).tolist()  # record r's pairs: bounds_l[r]:bounds_l[r + 1]
            parts = [{tokens[a]: counts_l[a]} if b - a == 1 else dict(zip(tokens[a:b], counts_l[a:b]))
                     for a, b in zip(bounds_l, bounds_l[1:])]
            if sum(map(len, parts)) != len(tokens):
                # A token repeated within a record: the C++ emplace keeps its first count.
                for part, a, b in zip(parts, bounds_l, bounds_l[1:]):
                    if len(part) != b - a:
                        part.clear()
                        for token, count in zip(tokens[a:b], counts_l[a:b]):
                            part.setdefault(token, count)
            table: dict[Ngram, Part] = dict(zip(keys, parts))
            if len(table) != n_records:  # a repeated n-gram: emplace keeps the first record too
                table = {}
                for key, part in zip(keys, parts):
                    table.setdefault(key, part)
        finally:
            if gc_was_enabled:
                gc.enable()
        return cls(table)


def _best_static(nc_static: NgramCache, ngram_static: Ngram) -> int:
    """try_draft(nc_static, ngram_static): draft from the static cache alone (lax 2-gram thresholds)."""
    part_static = nc_static.ngrams.get(ngram_static)
    if part_static is None:
        return TOKEN_NULL
    max_count_static = 0
    sum_count_static = 0
    max_token = TOKEN_NULL
    # reversed(): ties go to the latest inserted token, see _best_primary.
    for token, count_static in reversed(part_static.items()):
        if count_static > max_count_static:
            max_token = token
            max_count_static = count_static
        sum_count_static += count_static
    if sum_count_static < DRAFT_MIN_SAMPLE_SIZE_LAX[NGRAM_STATIC - 1]:
        return TOKEN_NULL
    if 100 * max_count_static < DRAFT_MIN_PERCENT_LAX[NGRAM_STATIC - 1] * sum_count_static:
        return TOKEN_NULL
    return max_token


def _best_primary(nc_primary: NgramCache, ngrams_primary: list[Ngram | None], part_static: Part,
                  min_sample_size: Sequence[int], min_percent: Sequence[int]) -> int:
    """try_draft(nc_primary, ngrams_primary, part_static, ...): the longest n-gram first, the first
    one whose best candidate passes the thresholds drafts it. A candidate's weight is its count
    times 100 * its count in the static part (1 when the static part lacks it)."""
    for i in range(len(ngrams_primary) - 1, -1, -1):
        ngram_primary = ngrams_primary[i]
        if ngram_primary is None:
            continue
        part_primary = nc_primary.ngrams.get(ngram_primary)
        if part_primary is None:
            continue
        max_count_primary = 0
        max_count_static = 0
        sum_count_primary = 0
        max_token = TOKEN_NULL
        # Ties: the C++ keeps the first maximum (strict >) in std::unordered_map order. libstdc++
        # (std::hash<int> is the identity, 13 buckets up to 13 entries) visits the most recent
        # insertion first in a part of 1 or 2 tokens, and of up to 13 tokens none congruent mod 13;
        # past that (collisions, rehashes) its order is effectively arbitrary. So we visit parts
        # newest first: drafts match llama.cpp's on exact ties in such parts, and may differ on
        # exact ties in others. Python ints don't overflow; the C++ multiplies in int32, which
        # overflows (UB) once count * 100 * static count passes 2**31: there drafts may differ too.
        for token, count_primary in reversed(part_primary.items()):
            count_static_raw = part_static.get(token)
            count_static = 100 * count_static_raw if count_static_raw is not None else 1
            if count_primary * count_static > max_count_primary * max_count_static:
                max_token = token
                max_count_primary = count_primary
                max_count_static = count_static
            sum_count_primary += count_primary
        if sum_count_primary < min_sample_size[i]:
            continue
        if 100 * max_count_primary < min_percent[i] * sum_count_primary:
            continue
        if max_token != TOKEN_NULL:  # as in the C++, a TOKEN_NULL "draft" lets a shorter n-gram try
            return max_token
    return TOKEN_NULL


def draft_tokens(inp: Sequence[int], id_last: int, n_draft: int, context: NgramCache,
                 dynamic: NgramCache, static: NgramCache) -> list[int]:
    """common_ngram_cache_draft with draft=[id_last] at the start, as the ngram-cache type calls it;
    returns the drafted tokens WITHOUT the leading id_last. `inp` includes id_last as its last item
    (as in speculative.cpp's draft_one).

    Up to ``n_draft`` tokens; each is looked up with the n-grams ending at the previous one (the
    sequence ``inp`` + the tokens drafted so far). Context (lax thresholds), then dynamic (strict),
    then static alone.
    """
    inp_size = len(inp)
    if inp_size and int(inp[-1]) != id_last:
        raise ValueError(f"inp must end with id_last ({id_last}), it ends with {int(inp[-1])}")
    if inp_size < NGRAM_STATIC:
        return []
    # Only the last NGRAM_MAX tokens of inp are ever read (get_token in the C++); the drafted ones
    # are appended. The C++'s draft[0] (id_last) is skipped there, as it is inp's last token already.
    seq = [int(t) for t in inp[-NGRAM_MAX:]]
    n_seq_total = inp_size  # length of inp + drafted, for n-grams longer than what exists
    drafted: list[int] = []
    while len(drafted) < n_draft:
        ngram_static = _ngram(seq[-NGRAM_STATIC:])
        part_static = static.ngrams.get(ngram_static, {})

        # cd = context + dynamic. An n-gram longer than inp + draft (inp of 2 or 3 tokens) would
        # make the C++ read before its vectors (UB, never a real match): it is skipped here.
        ngrams_cd: list[Ngram | None] = [
            _ngram(seq[-size:]) if size <= n_seq_total else None for size in range(NGRAM_MIN, NGRAM_MAX + 1)
        ]
        token = _best_primary(context, ngrams_cd, part_static, DRAFT_MIN_SAMPLE_SIZE_LAX, DRAFT_MIN_PERCENT_LAX)
        if token == TOKEN_NULL:
            token = _best_primary(dynamic, ngrams_cd, part_static,
                                  DRAFT_MIN_SAMPLE_SIZE_STRICT, DRAFT_MIN_PERCENT_STRICT)
        if token == TOKEN_NULL:
            token = _best_static(static, ngram_static)
        if token == TOKEN_NULL:
            break
        drafted.append(token)
        seq.append(token)
        n_seq_total += 1
    return drafted


# --------------------------------------------------------------------------- the ngram-cache type

#: How far one draft goes (speculative.cpp's create_state_ngram_cache: "n_draft = 8").
N_DRAFT = 8

memory_parts = no_memory_parts  # the registry's functions (registry.py)


def check_pair(target, draft, build_record: dict):
    return tokens_only_pairing(N_DRAFT)


def make(setup) -> "NgramCacheDrafter":
    """The registry's constructor (registry.py): the -lcs / -lcd files are read here (a bad one is a
    ValueError at load, where llama.cpp aborts)."""
    s = setup.ngram
    return NgramCacheDrafter(static=s.lookup_cache_static, dynamic=s.lookup_cache_dynamic, n_max=setup.n_max)


class NgramCacheDrafter(HistoryDrafter):
    """``ngram-cache`` behind the drafter protocol (drafters/__init__.py): a context cache per sequence,
    and the dynamic and static caches read from files (never written back: llama.cpp's server does not
    save them either).

    As llama.cpp's driver (speculative.cpp ``draft_one``), the context cache is fed at each draft with
    the tokens past what it has seen (``cache_size``) plus ``id_last``, counted on their own: n-grams
    across two feeds are not counted, a step that accepted nothing adds nothing, and a new shorter
    prompt adds nothing until the sequence outgrows the old one. That keeps its drafts llama-server's.
    """

    name = "ngram-cache"

    def __init__(self, *, static: str | os.PathLike | None = None, dynamic: str | os.PathLike | None = None,
                 n_max: int = N_DRAFT) -> None:
        self.static = NgramCache.load(static) if static else NgramCache()
        self.dynamic = NgramCache.load(dynamic) if dynamic else NgramCache()
        self.n_max_limit = N_DRAFT
        self.n_max = max(1, min(n_max, N_DRAFT))
        self.n_min = 0
        self.limit_reason = f"ngram-cache's {N_DRAFT} tokens (llama.cpp's)"
        super().__init__()
        self._context: dict[int, NgramCache] = {}
        self._cache_size: dict[int, int] = {}

    def draft(self, requests) -> list[Proposal]:
        out = []
        for rq in requests:
            prompt = self._history.tokens(rq.seq_id)
            context = self._context.setdefault(rq.seq_id, NgramCache())
            seen = self._cache_size.get(rq.seq_id, 0)
            if seen < len(prompt) + 1:
                fresh = [*prompt[seen:].tolist(), rq.id_last]
                context.update(fresh, len(fresh))
                self._cache_size[rq.seq_id] = len(prompt) + 1
            inp = [*prompt[-NGRAM_MAX:].tolist(), rq.id_last]  # only the last NGRAM_MAX are read
            found = cut_at_separator(draft_tokens(inp, rq.id_last, N_DRAFT, context, self.dynamic, self.static))
            found = found[:rq.n_max]
            out.append(Proposal(found if len(found) >= max(rq.n_min, 1) else []))
        return out

    def close(self) -> None:
        super().close()
        self._context.clear()
        self._cache_size.clear()
