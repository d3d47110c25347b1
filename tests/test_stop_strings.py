"""Stop strings: the streaming matcher that holds back a possible stop string and cuts the output.

``TextAssembler`` (generation.py) turns token bytes into text. It holds back a partial UTF-8
character and the longest tail that may start a stop string, and cuts the output right before the
first stop string to complete. Each stop string is followed by a Knuth-Morris-Pratt matcher whose
failure function is built lazily, so a stop string of millions of characters costs nothing up front
and the work per token stays bounded by the text generated, not by the stop string's length.

The property tests compare it with a brute-force reference over small alphabets; the unit tests on
a fake model need no native library; the last tests run the committed trained pair end to end.
"""

from __future__ import annotations

import codecs
import random
import time
import tracemalloc

import pytest

from pyllama_spec.speculative.generation import TextAssembler

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # the seeded test below checks the same property without it
    given = None


class FakeModel:
    """Tokens are indices into a list of byte strings (a token may hold part of a UTF-8 character)."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def token_to_bytes(self, tok: int, special: bool = False) -> bytes:
        return self.pieces[tok]


#: Small pieces over "a", "b", "é" (2 bytes), "€" (3 bytes), split across tokens, and one stray byte.
PIECES = [b"a", b"b", b"ab", b"ba", b"aa", b"bb", b"aab", "é".encode(), b"\xc3", b"\xa9", b"a\xc3",
          b"\xa9b", "€".encode(), b"\xe2\x82", b"\xac", b"\xff", b"", b"abba"]
STOP_CHARS = "abé€"


def text_of(tokens: list[int], pieces=PIECES, final=True) -> str:
    """What the tokens decode to, the way a fresh incremental decoder gives it."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return "".join(dec.decode(pieces[t]) for t in tokens) + (dec.decode(b"", final=True) if final else "")


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """Brute force: the text up to the stop string that completes first (of those completing at the
    same character, the longest, which starts earliest), and whether one did."""
    best = None  # (end, -len)
    for s in stops:
        if s and (at := text.find(s)) >= 0:
            best = min(best or (at + len(s), -len(s)), (at + len(s), -len(s)))
    if best is None:
        return text, False
    return text[:best[0] + best[1]], True


def held_reference(text: str, stops: list[str]) -> int:
    """Brute force: the longest tail of ``text`` that is a proper prefix of a stop string."""
    return max((k for s in stops for k in range(len(s) - 1, 0, -1) if text.endswith(s[:k])), default=0)


def check_against_reference(tokens: list[int], stops: list[str], cuts: list[int], use_each: list[bool]) -> None:
    """Push ``tokens`` in the chunks ``cuts`` gives and check every push against the reference."""
    out = TextAssembler(FakeModel(PIECES), stops)
    live = [s for s in stops if s]
    final, stopped_ref = reference(text_of(tokens), live)
    released, stopped = "", False
    bounds = sorted(set(c % (len(tokens) + 1) for c in cuts) | {0, len(tokens)})
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        chunk = tokens[lo:hi]
        if use_each[i % len(use_each)]:
            texts, hit = out.push_each(chunk)
            assert len(texts) == len(chunk)
            got = "".join(texts)
        else:
            got, hit = out.push(chunk)
        assert not (stopped and got), "nothing is released after a stop string"
        released += got
        so_far = text_of(tokens[:hi], final=False)
        ref_so_far, hit_ref = reference(so_far, live)
        assert hit == (stopped or hit_ref), "the stop is reported at the push that completes it"
        stopped = hit
        assert final.startswith(released), "released text is a prefix of the final text"
        assert not any(s in released for s in live), "released text never holds a stop string"
        if hit:
            assert released == ref_so_far == final
        else:  # released as soon as it cannot start a stop string: only the longest such tail is held
            assert released == so_far[:len(so_far) - held_reference(so_far, live)]
            assert out.held == so_far[len(released):]
    rest = out.flush()
    assert out.stopped == stopped == stopped_ref
    if stopped:
        assert rest == "" and released == final
    else:
        assert released + rest == final == text_of(tokens), "everything is released after flush"


def random_case(rng: random.Random) -> tuple[list[int], list[str], list[int], list[bool]]:
    tokens = [rng.randrange(len(PIECES)) for _ in range(rng.randrange(0, 30))]
    alphabet = rng.choice(["ab", "ab", "a", "abé", STOP_CHARS])
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6))) for _ in range(rng.randint(0, 4))]
    cuts = [rng.randrange(0, 31) for _ in range(rng.randrange(0, 12))]
    return tokens, stops, cuts, [rng.random() < 0.3 for _ in range(3)]


def test_assembler_matches_the_brute_force_reference_on_seeded_random_cases():
    """Without hypothesis too: 3000 seeded random token streams, stop lists and chunkings."""
    rng = random.Random(20240607)
    for _ in range(3000):
        check_against_reference(*random_case(rng))


if given is not None:
    @settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(tokens=st.lists(st.integers(0, len(PIECES) - 1), max_size=40),
           stops=st.lists(st.one_of(st.text(alphabet="ab", max_size=6), st.text(alphabet=STOP_CHARS, max_size=6)),
                          max_size=4),
           cuts=st.lists(st.integers(0, 40), max_size=15),
           use_each=st.lists(st.booleans(), min_size=1, max_size=4))
    def test_assembler_matches_the_brute_force_reference_property(tokens, stops, cuts, use_each):
        """Hypothesis: at every push the released text is a prefix of the final text, holds no stop
        string, and holds back only the longest tail that may start one; after flush everything is out."""
        check_against_reference(tokens, stops, cuts, use_each)


def push_text(stops: list[str], chunks: list[str]) -> tuple[list[str], bool, str]:
    model = FakeModel([c.encode() for c in chunks])
    out = TextAssembler(model, stops)
    got = [out.push([i])[0] for i in range(len(chunks))]
    return got, out.stopped, out.flush()


def test_the_first_stop_string_to_complete_wins_whatever_the_list_order():
    assert push_text(["abcd", "bc"], ["abcd"]) == (["a"], True, "")
    assert push_text(["bc", "abcd"], ["ab", "cd"]) == (["", "a"], True, "")  # "ab" may start "abcd"


def test_of_stop_strings_completing_at_the_same_character_the_earliest_start_wins():
    assert push_text(["cd", "abcd", "d"], ["xab", "cd"]) == (["x", ""], True, "")
    assert push_text(["d", "bcd"], ["xabcd"]) == (["xa"], True, "")


def test_a_possible_stop_string_is_held_back_and_released_when_it_can_no_longer_start_one():
    assert push_text(["</end>"], ["hi <", "/e", "x", "!"]) == (["hi ", "", "</ex", "!"], False, "")
    got, stopped, rest = push_text(["</end>"], ["hi <", "/e", "nd>", "more"])
    assert got == ["hi ", "", "", ""] and stopped and rest == ""
    got, stopped, rest = push_text(["abc"], ["xa", "b"])
    assert got == ["x", ""] and not stopped and rest == "ab", "the held tail comes out at flush"


def test_the_held_tail_is_the_longest_over_all_stop_strings():
    out = TextAssembler(FakeModel([b"xaab", b"z"]), ["aab!", "b?", "ab."])
    assert out.push([0]) == ("x", False) and out.held == "aab"
    assert out.push([1]) == ("aabz", False) and out.held == ""


def test_empty_stop_strings_are_ignored():
    assert push_text(["", "c"], ["ab", "cd"]) == (["ab", ""], True, "")
    assert push_text([""], ["ab", "cd"]) == (["ab", "cd"], False, "")


def test_partial_utf8_is_held_back_by_the_decoder_and_a_stop_string_can_span_tokens():
    e = "é".encode()
    out = TextAssembler(FakeModel([b"a" + e[:1], e[1:] + b"b", e[:1]]), ["éb"])
    assert out.push([0]) == ("a", False)
    assert out.push([1]) == ("", True) and out.push([2]) == ("", True) and out.flush() == ""
    out = TextAssembler(FakeModel([b"a" + e[:1], e[1:] + b"b", e[:1]]), ["zz"])
    assert out.push_each([0, 1, 2]) == (("a", "éb", ""), False) and out.flush() == "\ufffd"


def test_push_each_gives_each_tokens_text_and_nothing_after_the_stop():
    out = TextAssembler(FakeModel([b"one ", b"two ", b"STOP", b"three"]), ["STOP"])
    assert out.push_each([0, 1, 2, 3]) == (("one ", "two ", "", ""), True)
    assert out.push([0]) == ("", True) and out.flush() == ""


def _costs(stop: str, chunks: list[str]) -> tuple[float, int, str, bool]:
    """CPU seconds and tracemalloc peak (bytes) to push ``chunks`` one token at a time and flush.

    This thread's CPU time: the work, which load from other processes on a shared machine does
    not stretch as it stretches the wall clock."""
    model = FakeModel([c.encode() for c in chunks])
    tracemalloc.start()
    try:
        t = time.thread_time()
        out = TextAssembler(model, [stop, "never", stop])
        text = "".join(out.push([i])[0] for i in range(len(chunks))) + out.flush()
        seconds = time.thread_time() - t
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return seconds, peak, text, out.stopped


N = 16_000_000


@pytest.mark.parametrize("kind", ["x", "a...ab"])
def test_a_16_million_character_stop_string_costs_nothing_up_front_nor_per_token(kind):
    """1000 tokens against a 16,000,000-character stop string: well under a second and well under
    1 MB, whether the text never starts it, matches a long prefix of it, or (a...ab, the KMP worst
    case) keeps falling back from a long partial match."""
    stop = "x" * N if kind == "x" else "a" * N + "b"
    c = stop[0]
    streams = {
        "unrelated": ["hello world " for _ in range(1000)],
        "prefix": [c * 4 for _ in range(1000)],  # all held: 4000 chars of the stop string
        "fallbacks": [c * 7 + "y" if i % 3 == 2 else c * 5 for i in range(1000)],
        "single chars": [c if i % 50 else "z" for i in range(1000)],
    }
    for name, chunks in streams.items():
        seconds, peak, text, stopped = _costs(stop, chunks)
        assert text == "".join(chunks) and not stopped, name
        assert seconds < 0.5, f"{name}: {seconds:.3f} s"
        assert peak < 1_000_000, f"{name}: {peak} bytes"


def test_a_long_stop_string_is_found_when_it_completes_across_many_tokens():
    """A 1,000,000-character stop string spread over 5000 tokens, after "x": cut right before it."""
    model = FakeModel([b"x", b"ab" * 100, b"tail"])
    out = TextAssembler(model, ["ab" * 500_000, "abx"])
    t = time.perf_counter()
    got = out.push([0, 1])[0]
    got += "".join(out.push_each([1] * 4998)[0])
    assert not out.stopped and got == "x" and len(out.held) == 999_800
    got += out.push([1, 2])[0]
    assert got == "x" and out.stopped and out.flush() == ""
    assert time.perf_counter() - t < 10  # linear: a million characters through the matcher


# ------------------------------------------------------------------ end to end, on the trained pair

@pytest.fixture(scope="module")
def trained_engine():
    import pyllama_spec as ps

    em = ps.embedded_models()
    with ps.load(em.target, draft=em.draft, n_threads=1, n_ctx=2048) as engine:
        yield engine


#: The trained pair continues this with code ("def fibonacci(n):\n" alone gives 32 spaces).
PROMPT = "def fibonacci(n):\n    if n"


def test_a_stop_string_from_the_output_cuts_it_right_before_it(trained_engine):
    text = trained_engine.generate(PROMPT, max_tokens=32).text
    stop = text.strip()[6:9]
    assert len(stop.strip()) == 3 and text.find(stop) > 0
    cut = trained_engine.generate(PROMPT, max_tokens=32, stop=["never there \x00", stop])
    assert cut.finish_reason == "stop"
    assert cut.text == text[:text.find(stop)] and stop not in cut.text
    pieces = list(trained_engine.stream(PROMPT, max_tokens=32, stop=[stop]))
    assert "".join(p.text for p in pieces) == cut.text and pieces[-1].finish_reason == "stop"


def test_a_million_character_stop_string_that_never_occurs_is_as_fast_as_none(trained_engine):
    """The first one matches the output's first characters, then never goes on: held, then released."""
    plain = trained_engine.generate(PROMPT, max_tokens=32)
    stops = [plain.text[:5] + "\x00" * 999_995, "y" * 1_000_000]
    plain_s, long_s = [], []
    for _ in range(2):  # interleaved, the best of two each: the machine is shared
        t = time.perf_counter()
        plain = trained_engine.generate(PROMPT, max_tokens=32)
        plain_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        long = trained_engine.generate(PROMPT, max_tokens=32, stop=stops)
        long_s.append(time.perf_counter() - t)
    assert long.text == plain.text and long.finish_reason == plain.finish_reason == "length"
    assert long.tokens == plain.tokens
    assert min(long_s) < 1.5 * min(plain_s) + 0.2, (plain_s, long_s)
