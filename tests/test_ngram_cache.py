"""The n-gram cache port (pyllama_spec/drafters/ngram_cache.py) against llama.cpp's
common/ngram-cache.cpp: counts, drafting thresholds and static validation worked by hand from the
C++, the file layout, and every corrupt file refused with a ValueError (the C++ aborts)."""

from __future__ import annotations

import struct
import time
import tracemalloc

import numpy as np
import pytest

from pyllama_spec.drafters.ngram_cache import (
    NGRAM_MAX,
    NGRAM_MIN,
    NGRAM_STATIC,
    TOKEN_NULL,
    NgramCache,
    draft_tokens,
)

N = TOKEN_NULL


def g(*tokens: int) -> tuple[int, ...]:
    """An n-gram key: the tokens padded with TOKEN_NULL to NGRAM_MAX."""
    return tuple(tokens) + (N,) * (NGRAM_MAX - len(tokens))


def cache(table: dict) -> NgramCache:
    return NgramCache({key: dict(part) for key, part in table.items()})


EMPTY = NgramCache()


def record(ngram: tuple[int, ...], pairs: list[tuple[int, int]]) -> bytes:
    """One record as common_ngram_cache_save writes it: 4 int32 tokens, int32 ntokens, int32 pairs."""
    flat = [t for pair in pairs for t in pair]
    return struct.pack(f"<4ii{len(flat)}i", *ngram, len(pairs), *flat)


def test_constants():
    assert (NGRAM_MIN, NGRAM_MAX, NGRAM_STATIC, TOKEN_NULL) == (1, 4, 2, -1)


# ---------------------------------------------------------------- update


def test_update_counts_by_hand():
    c = NgramCache()
    c.update([1, 2, 3, 1, 2, 4], 6)
    # Each n-gram size 1..4, each position i >= size: the size tokens before i -> inp[i].
    assert dict(c) == {
        g(1): {2: 2},  # 1->2 twice
        g(2): {3: 1, 4: 1},
        g(3): {1: 1},
        g(1, 2): {3: 1, 4: 1},
        g(2, 3): {1: 1},
        g(3, 1): {2: 1},
        g(1, 2, 3): {1: 1},
        g(2, 3, 1): {2: 1},
        g(3, 1, 2): {4: 1},
        g(1, 2, 3, 1): {2: 1},
        g(2, 3, 1, 2): {4: 1},
    }
    assert len(c) == 11
    assert list(c[g(2)]) == [3, 4]  # insertion order (ties in drafting depend on it)


def test_update_ngram_range():
    c = NgramCache()
    c.update([1, 2, 3, 1, 2, 4], 6, 2, 2)  # the static caches' 2-grams
    assert dict(c) == {g(1, 2): {3: 1, 4: 1}, g(2, 3): {1: 1}, g(3, 1): {2: 1}}
    with pytest.raises(ValueError):
        c.update([1, 2], 2, 0, 4)
    with pytest.raises(ValueError):
        c.update([1, 2], 2, 1, 5)


def test_update_incremental_equals_whole():
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 6, 300).tolist()
    whole = NgramCache()
    whole.update(seq, len(seq))
    for cuts in ([1] * 300, [7, 50, 1, 1, 100, 141], [2, 298]):
        inc, end = NgramCache(), 0
        for step in cuts:
            end += step
            inc.update(seq[:end], step)  # only appended to: nnew = the new tail
        assert dict(inc) == dict(whole)
        assert all(list(inc[k]) == list(whole[k]) for k in whole)  # same order within each part


def test_update_takes_numpy_and_negative_tokens():
    c = NgramCache()
    c.update(np.array([5, -2, 5, -2], dtype=np.int32), 4)  # -2: a picture's separator
    assert dict(c) == {g(5): {-2: 2}, g(-2): {5: 1}, g(5, -2): {5: 1}, g(-2, 5): {-2: 1}, g(5, -2, 5): {-2: 1}}
    assert all(type(t) is int for key in c for t in key)


def test_update_is_linear_in_nnew():
    seq = list(range(1_000_000))
    c = NgramCache()
    t0 = time.perf_counter()
    for _ in range(1000):
        c.update(seq, 1)  # a long input, one new token each call: O(1) work, not O(len(seq))
    assert time.perf_counter() - t0 < 2.0


# ---------------------------------------------------------------- draft


def test_draft_repetition():
    seq = [1, 2, 3, 4, 5] * 3
    c = NgramCache()
    c.update(seq, len(seq))
    assert draft_tokens(seq, 5, 8, c, EMPTY, EMPTY) == [1, 2, 3, 4, 5, 1, 2, 3]
    assert draft_tokens(seq, 5, 3, c, EMPTY, EMPTY) == [1, 2, 3]
    assert draft_tokens(np.array(seq), 5, 2, c, EMPTY, EMPTY) == [1, 2]


def test_draft_repetition_seen_once():
    # The 3-gram (1, 2, 3) -> 9 is seen once: sizes 3 and 4 need 1 sample and 50 %.
    seq = [1, 2, 3, 9, 1, 2, 3]
    c = NgramCache()
    c.update(seq, len(seq))
    assert draft_tokens(seq, 3, 8, c, EMPTY, EMPTY) == [9, 1, 2, 3, 9, 1, 2, 3]


def test_draft_needs_two_tokens_and_id_last():
    c = cache({g(5): {6: 9}})
    assert draft_tokens([5], 5, 8, c, EMPTY, EMPTY) == []  # inp shorter than NGRAM_STATIC
    assert draft_tokens([], 5, 8, c, EMPTY, EMPTY) == []
    with pytest.raises(ValueError, match="id_last"):
        draft_tokens([1, 5], 4, 8, c, EMPTY, EMPTY)


def test_context_lax_thresholds():
    # Size 1 needs 2 samples and 66 %.
    seq = [5, 6, 5]
    c = NgramCache()
    c.update(seq, 3)
    assert c[g(5)] == {6: 1}  # seen once
    assert draft_tokens(seq, 5, 8, c, EMPTY, EMPTY) == []
    inp = [1, 5]  # only the 1-gram (5) is in these caches
    assert draft_tokens(inp, 5, 8, cache({g(5): {6: 2, 7: 1}}), EMPTY, EMPTY) == [6]  # 200 >= 66 * 3
    assert draft_tokens(inp, 5, 8, cache({g(5): {6: 1, 7: 1}}), EMPTY, EMPTY) == []  # 100 < 66 * 2
    assert draft_tokens(inp, 5, 8, cache({g(5): {6: 2, 7: 2}}), EMPTY, EMPTY) == []  # 200 < 66 * 4
    # Size 2: 2 samples and 50 %; a tie at 50 % passes.
    assert draft_tokens(inp, 5, 8, cache({g(1, 5): {6: 1}}), EMPTY, EMPTY) == []
    assert draft_tokens(inp, 5, 8, cache({g(1, 5): {6: 1, 7: 1}}), EMPTY, EMPTY) == [7]  # tie: newest
    assert draft_tokens(inp, 5, 8, cache({g(1, 5): {6: 2, 7: 1, 8: 1}}), EMPTY, EMPTY) == [6]
    assert draft_tokens(inp, 5, 8, cache({g(1, 5): {6: 2, 7: 2, 8: 1}}), EMPTY, EMPTY) == []  # 40 %
    # Sizes 3, 4: 1 sample and 50 %.
    assert draft_tokens([4, 1, 5], 5, 8, cache({g(4, 1, 5): {6: 1}}), EMPTY, EMPTY) == [6]
    assert draft_tokens([3, 4, 1, 5], 5, 8, cache({g(3, 4, 1, 5): {6: 1}}), EMPTY, EMPTY) == [6]


def test_longest_ngram_first_and_fallback_to_shorter():
    c = cache({g(5): {6: 10}, g(4, 1, 5): {9: 1}})
    assert draft_tokens([4, 1, 5], 5, 1, c, EMPTY, EMPTY) == [9]
    # The 3-gram fails its threshold (33 %): the 1-gram drafts.
    c = cache({g(5): {6: 10}, g(4, 1, 5): {9: 1, 8: 1, 7: 1}})
    assert draft_tokens([4, 1, 5], 5, 1, c, EMPTY, EMPTY) == [6]


def test_dynamic_strict_thresholds():
    inp = [1, 5]
    # Size 1: 4 samples and 75 %.
    assert draft_tokens(inp, 5, 8, EMPTY, cache({g(5): {6: 3, 7: 1}}), EMPTY) == [6]  # 300 >= 75 * 4
    assert draft_tokens(inp, 5, 8, EMPTY, cache({g(5): {6: 3}}), EMPTY) == []  # 3 samples
    assert draft_tokens(inp, 5, 8, EMPTY, cache({g(5): {6: 2, 7: 1}}), EMPTY) == []  # 3 samples
    assert draft_tokens(inp, 5, 8, EMPTY, cache({g(5): {6: 5, 7: 2}}), EMPTY) == []  # 500 < 75 * 7
    assert draft_tokens(inp, 5, 8, cache({g(5): {6: 2, 7: 1}}), EMPTY, EMPTY) == [6]  # lax: passes
    # Size 2: 3 samples and 66 %.
    assert draft_tokens(inp, 5, 8, EMPTY, cache({g(1, 5): {6: 2, 7: 1}}), EMPTY) == [6]
    assert draft_tokens(inp, 5, 8, EMPTY, cache({g(1, 5): {6: 2}}), EMPTY) == []
    assert draft_tokens(inp, 5, 8, cache({g(1, 5): {6: 2}}), EMPTY, EMPTY) == [6]  # lax: passes
    # Sizes 3, 4: 2 samples and 66 %.
    assert draft_tokens([4, 1, 5], 5, 8, EMPTY, cache({g(4, 1, 5): {6: 1}}), EMPTY) == []
    assert draft_tokens([4, 1, 5], 5, 8, EMPTY, cache({g(4, 1, 5): {6: 2}}), EMPTY) == [6]
    assert draft_tokens([4, 1, 5], 5, 8, EMPTY, cache({g(4, 1, 5): {6: 2, 7: 2}}), EMPTY) == []
    # The context cache is asked first; the dynamic cache only when it drafts nothing.
    both = draft_tokens(inp, 5, 1, cache({g(1, 5): {6: 2}}), cache({g(1, 5): {7: 9}}), EMPTY)
    assert both == [6]


def test_static_validation_changes_the_choice():
    inp = [1, 5]
    ctx = cache({g(1, 5): {6: 2, 7: 2}})  # a tie between two candidates
    assert draft_tokens(inp, 5, 8, ctx, EMPTY, EMPTY) == [7]
    # Weights: count * 100 * static count (1 where the static part lacks the token).
    assert draft_tokens(inp, 5, 8, ctx, EMPTY, cache({g(1, 5): {6: 1}})) == [6]  # 200 > 2
    assert draft_tokens(inp, 5, 8, ctx, EMPTY, cache({g(1, 5): {6: 1, 7: 2}})) == [7]  # 400 > 200
    assert draft_tokens(inp, 5, 8, ctx, EMPTY, cache({g(1, 5): {6: 3, 7: 2}})) == [6]  # 600 > 400
    # The static part is the one after the last two tokens (1, 5), not the n-gram's.
    assert draft_tokens(inp, 5, 8, ctx, EMPTY, cache({g(9, 5): {6: 1}})) == [7]
    # Validation that picks a minority candidate fails the percentage: a shorter n-gram drafts.
    ctx = cache({g(1, 5): {6: 3, 7: 2}, g(5): {8: 2}})
    assert draft_tokens(inp, 5, 1, ctx, EMPTY, EMPTY) == [6]
    assert draft_tokens(inp, 5, 1, ctx, EMPTY, cache({g(1, 5): {7: 1}})) == [8]  # 7: 2 of 5 < 50 %
    # It weighs the dynamic cache's candidates too.
    dyn = cache({g(1, 5): {6: 3, 7: 3}})
    assert draft_tokens(inp, 5, 8, EMPTY, dyn, EMPTY) == []  # 50 % < 66 %
    dyn = cache({g(1, 5): {6: 4, 7: 2}})
    assert draft_tokens(inp, 5, 8, EMPTY, dyn, cache({g(1, 5): {7: 1}})) == []  # 7: 2 of 6


def test_static_drafts_alone():
    inp = [1, 5]
    # Its own thresholds are the lax ones of size 2: 2 samples and 50 %.
    assert draft_tokens(inp, 5, 8, EMPTY, EMPTY, cache({g(1, 5): {6: 2, 7: 1}})) == [6]
    assert draft_tokens(inp, 5, 8, EMPTY, EMPTY, cache({g(1, 5): {6: 1}})) == []
    assert draft_tokens(inp, 5, 8, EMPTY, EMPTY, cache({g(1, 5): {6: 1, 7: 1, 8: 1}})) == []
    # Its 2-grams run on through the drafted tokens.
    st = cache({g(1, 5): {6: 2}, g(5, 6): {7: 5}, g(6, 7): {8: 1}})
    assert draft_tokens(inp, 5, 8, EMPTY, EMPTY, st) == [6, 7]


def test_draft_is_independent_of_history_length():
    seq = np.arange(2_000_000, dtype=np.int32) % 50_000
    c = cache({g(49_998, 49_999): {0: 2}, g(0): {1: 2}, g(1): {2: 2}})
    t0 = time.perf_counter()
    for _ in range(200):
        assert draft_tokens(seq, 49_999, 3, c, EMPTY, EMPTY) == [0, 1, 2]
    assert time.perf_counter() - t0 < 1.0


# ---------------------------------------------------------------- merge, save, load


def test_merge():
    a = cache({g(1): {2: 1}, g(1, 2): {3: 2}})
    b = cache({g(1): {2: 3, 4: 1}, g(7): {8: 1}})
    a.merge(b)
    assert dict(a) == {g(1): {2: 4, 4: 1}, g(1, 2): {3: 2}, g(7): {8: 1}}
    b[g(7)][8] = 100  # a copy was merged, not b's part itself
    assert a[g(7)] == {8: 1}
    assert dict(b) == {g(1): {2: 3, 4: 1}, g(7): {8: 100}}
    with pytest.raises(ValueError):
        a.merge(cache({g(1): {2: 0}}))


def test_save_load_round_trip(tmp_path):
    seq = np.random.default_rng(1).integers(-2, 20, 500).tolist()
    c = NgramCache()
    c.update(seq, len(seq))
    path = tmp_path / "ctx.lcd"
    c.save(path)
    assert path.stat().st_size == 4 * sum(NGRAM_MAX + 1 + 2 * len(p) for p in c.values())
    loaded = NgramCache.load(path)
    assert loaded == c and len(loaded) == len(c)

    other = NgramCache()
    other.update(seq[::-1], len(seq))
    c.merge(other)
    c.save(str(tmp_path / "merged.lcd"))
    merged = NgramCache.load(str(tmp_path / "merged.lcd"))
    assert merged == c
    assert merged[g(seq[0])][seq[1]] >= 1


def test_load_layout_by_hand(tmp_path):
    path = tmp_path / "hand.lcd"
    path.write_bytes(record((1, 2, N, N), [(3, 5)]) + record((7, N, N, N), [(8, 1), (9, 4)])
                     + record((-2, 0, 1, 2), [(-2, 2147483647)]))
    c = NgramCache.load(path)
    assert dict(c) == {g(1, 2): {3: 5}, g(7): {8: 1, 9: 4}, (-2, 0, 1, 2): {-2: 2147483647}}
    assert list(c[g(7)]) == [8, 9]  # file order


def test_save_layout_by_hand(tmp_path):
    path = tmp_path / "out.lcd"
    cache({g(1, 2): {3: 5}, g(7): {8: 1, 9: 4}}).save(path)
    # Parts are written newest first, as libstdc++ iterates a small std::unordered_map.
    assert path.read_bytes() == record((1, 2, N, N), [(3, 5)]) + record((7, N, N, N), [(9, 4), (8, 1)])
    NgramCache().save(path)
    assert path.read_bytes() == b""
    assert len(NgramCache.load(path)) == 0
    with pytest.raises(ValueError):
        cache({g(1): {}}).save(path)
    with pytest.raises(ValueError):
        cache({g(1): {2: 0}}).save(path)
    with pytest.raises(ValueError):
        cache({g(1): {2: 2**31}}).save(path)


def test_load_repeats_keep_the_first(tmp_path):
    # std::unordered_map::emplace keeps the first of a repeated key, in a part and in the cache.
    path = tmp_path / "rep.lcd"
    path.write_bytes(record(g(1), [(2, 3), (4, 1), (2, 9)]) + record(g(5), [(6, 1)]) + record(g(1), [(7, 7)]))
    assert dict(NgramCache.load(path)) == {g(1): {2: 3, 4: 1}, g(5): {6: 1}}


GOOD = record(g(1, 2), [(3, 5)])  # 28 bytes


@pytest.mark.parametrize("body, where", [
    (GOOD + struct.pack("<2i", 1, 2), "byte offset 28 is truncated in its n-gram"),
    (GOOD + b"\x01\x00", "byte offset 28 is truncated in its n-gram"),
    (GOOD + struct.pack("<4i", 1, 2, N, N), "byte offset 44"),  # ntokens missing
    (GOOD + struct.pack("<4i2i", 1, 2, N, N, 0, 0)[:18], "byte offset 44"),  # ntokens cut
    (GOOD + struct.pack("<4ii3i", 1, 2, N, N, 2, 3, 4, 5), "byte offset 28 claims 2"),  # in a pair
    (GOOD + struct.pack("<4ii", 1, 2, N, N, 1) + b"\x03\x00\x00", "byte offset 28 claims 1"),
    (GOOD + struct.pack("<4ii2i", 1, 2, N, N, 0, 3, 4), "ntokens 0 at byte offset 44"),
    (GOOD + struct.pack("<4ii2i", 1, 2, N, N, -3, 3, 4), "ntokens -3 at byte offset 44"),
    (GOOD + record(g(4), [(3, 1), (5, 0)]), "count 0 at byte offset 60"),
    (GOOD + record(g(4), [(3, -7)]), "count -7 at byte offset 52"),
    # The first error in the file is the one reported: a bad count before a truncated pair.
    (record(g(4), [(3, 0), (5, 1)])[:-4], "count 0 at byte offset 24"),
])
def test_load_corrupt(tmp_path, body, where):
    path = tmp_path / "bad.lcd"
    path.write_bytes(body)
    with pytest.raises(ValueError) as info:
        NgramCache.load(path)
    assert str(path) in str(info.value)
    assert where in str(info.value)


def test_load_huge_ntokens_fails_fast(tmp_path):
    path = tmp_path / "huge.lcd"
    path.write_bytes(struct.pack("<4ii5i", 1, 2, N, N, 2**30, 3, 4, 5, 6, 7))
    assert path.stat().st_size == 40
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(ValueError, match="claims 1073741824") as info:
            NgramCache.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 0.5
    assert peak < 1 << 20  # nothing sized by ntokens
    assert str(path) in str(info.value)


def test_load_missing_or_unreadable(tmp_path):
    for path in (tmp_path / "missing.lcd", tmp_path):
        with pytest.raises(ValueError) as info:
            NgramCache.load(path)
        assert str(path) in str(info.value)


def test_load_big_file_is_fast(tmp_path):
    n = 2_000_000
    i = np.arange(n, dtype=np.int64)
    records = np.empty((n, 7), dtype="<i4")
    records[:, 0], records[:, 1], records[:, 2:4] = i % 50_000, i // 50_000, N
    records[:, 4], records[:, 5], records[:, 6] = 1, i % 1000, 1 + i % 7
    path = tmp_path / "big.lcd"
    records.tofile(path)
    t0 = time.perf_counter()
    c = NgramCache.load(path)
    elapsed = time.perf_counter() - t0
    print(f"loaded {n} records ({path.stat().st_size / 1e6:.0f} MB) in {elapsed:.2f} s")
    assert len(c) == n
    assert c[(123, 4, N, N)] == {(4 * 50_000 + 123) % 1000: 1 + (4 * 50_000 + 123) % 7}
    assert elapsed < 20
