"""The request body parser (server/json_body.py): json.loads's value and errors, in steps that
never hold the GIL long, within limits that bound a body's memory and time (issue 43, item 5)."""

from __future__ import annotations

import json
import threading
import time

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pytest.importorskip("starlette", reason="the server extra brings starlette")
from pyllama_spec.server import json_body  # noqa: E402
from pyllama_spec.server.errors import APIError  # noqa: E402
from pyllama_spec.server.json_body import parse_in_steps, parse_json_body  # noqa: E402

# surrogates written raw (json.dumps(ensure_ascii=False) keeps them) and as escapes, pairs included
_TEXT = st.text(st.characters(codec=None, blacklist_categories=()), max_size=30) | st.sampled_from(
    ["\U0001F600" * 5, "\ud83d", "\ude00x", "é\n\"\\/\t\x1f", "\\" * 7, ""])
_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _TEXT
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=8)
                       | st.dictionaries(_TEXT, inner, max_size=8), max_leaves=60)


@pytest.fixture
def tiny_steps(monkeypatch):
    """Pieces and runs of a few characters, so that every boundary case shows in small texts."""
    def use(piece: int, run: int) -> None:
        monkeypatch.setattr(json_body, "STRING_PIECE", piece)
        monkeypatch.setattr(json_body, "RUN_CHARS", run)
    return use


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=_VALUES, ascii_only=st.booleans(), indent=st.sampled_from([None, 0, 2]),
       piece=st.integers(1, 40), run=st.integers(1, 60))
def test_parse_in_steps_gives_what_json_loads_gives(tiny_steps, value, ascii_only, indent, piece, run):
    tiny_steps(piece, run)
    text = json.dumps(value, ensure_ascii=ascii_only, indent=indent)
    assert parse_in_steps(text) == json.loads(text)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=_VALUES, cut=st.integers(0, 10_000), insert=st.sampled_from(
    ["", ",", "]", "}", "[", "{", '"', "\\", ":", "x", "\x01", "\\u12", "1e", " ", "\\ud83d"]),
       piece=st.integers(1, 40), run=st.integers(1, 60))
@example(value=["a" * 30], cut=3, insert="", piece=7, run=5)  # an unterminated long string
def test_parse_in_steps_refuses_what_json_loads_refuses(tiny_steps, value, cut, insert, piece, run):
    """A valid text, cut short or with something inserted: refused by both or read alike."""
    tiny_steps(piece, run)
    text = json.dumps(value)
    cut = min(cut, len(text))
    text = text[:cut] + insert + text[cut + (1 if insert == "" else 0):]
    try:
        expected = json.loads(text)
    except ValueError:
        with pytest.raises(ValueError):
            parse_in_steps(text)
    else:
        assert parse_in_steps(text) == expected


@pytest.mark.parametrize("piece", range(1, 14))
def test_a_long_strings_pieces_never_split_an_escape_or_a_surrogate_pair(tiny_steps, piece):
    tiny_steps(piece, 4)
    text = json.dumps(["ab\U0001F600\\\"\u00e9\n" * 9, "\\" * 13 + "\U0001F600", "x\ud83d", "\ude00y"])
    assert parse_in_steps(text) == json.loads(text)


def test_the_limits_are_400s_that_name_them():
    def refused(raw: bytes) -> str:
        with pytest.raises(APIError) as e:
            parse_json_body(raw)
        assert e.value.status == 400
        return str(e.value)

    n = json_body.MAX_JSON_VALUES
    assert f"more than {n:,} values" in refused(b"[" + b"1," * n + b"1]")  # counted before it is parsed
    assert f"more than {n:,} values" in refused(b'[1, "a\\\\"' + b",2" * n + b"]")  # a string's end found
    assert len(parse_json_body(b"[" + b"1," * (n - 1) + b"1]")) == n
    # commas in strings are no values, nor bytes 0x2c of UTF-16 text (U+2C00)
    assert len(parse_json_body(json.dumps({"prompt": ',"\\' * (n + 5)}).encode())["prompt"]) == 3 * (n + 5)
    assert len(parse_json_body(json.dumps({"p": "\u2c00" * (n + 1)}, ensure_ascii=False).encode("utf-16-le"))["p"]) \
        == n + 1
    members = json_body.MAX_OBJECT_MEMBERS
    many = {f"k{i}": i for i in range(members + 1)}
    assert f"more than {members} members" in refused(json.dumps({"logit_bias": many}).encode())
    many.pop("k0")
    assert len(parse_json_body(json.dumps({"logit_bias": many}).encode())["logit_bias"]) == members
    # nesting, in one call and in steps (a body over one step's size)
    for pad in (b"", b" " * (json_body.STRING_PIECE + 1)):
        assert "nests too deeply" in refused(pad + b"[" * 101 + b"]" * 101)
        assert parse_json_body(pad + b"[" * 100 + b"]" * 100) is not None
        assert "not valid JSON" in refused(pad + b'{"a": [1, 2,]}')
    # a number read in steps is at most MAX_NUMBER_CHARS long (one C call reads all of a float)
    long_float = b"1." + b"0" * json_body.MAX_NUMBER_CHARS
    assert "a number of more than" in refused(b'{"x": ' + long_float + b"}" + b" " * json_body.STRING_PIECE)
    # UTF-16 is read in steps, its containers counted on its text: no false count on its bytes
    text = '{"prompt": "\u2200' + "\u5b5b" * 50_001 + '"}'
    assert parse_json_body(text.encode("utf-16-le")) == json.loads(text)
    # where a body is not UTF-8, in the body
    bad = b'{"prompt": "' + b"a" * (3 * json_body.STRING_PIECE) + b'\xff"}'
    assert "position 3145740" in refused(bad)


@pytest.mark.parametrize("raw", [b"[" + b" " * 30_000_000 + b"1]", b'{"a":' + b"\n" * 30_000_000 + b"2}"],
                         ids=["spaces", "newlines"])
def test_long_runs_of_space_are_read_in_steps_too(raw):
    assert parse_json_body(raw) == json.loads(raw)


def _longest_wait_beside(work) -> float:
    """The longest a thread that sleeps 1 ms at a time waits for the GIL while ``work()`` runs on another."""
    stop, longest = threading.Event(), [0.0]

    def probe():
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            longest[0], last = max(longest[0], now - last), now

    thread = threading.Thread(target=probe)
    thread.start()
    time.sleep(0.05)
    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    stop.set()
    thread.join()
    return longest[0]


def test_a_body_of_millions_of_values_lets_other_threads_run():
    """json.loads holds the GIL for the whole body (3 million floats: about 0.6 s here); the stepped
    parse lets another thread in every few milliseconds. Compared as a ratio, on the same body."""
    raw = json.dumps({"messages": [], "unused": [i * 0.001 for i in range(3_000_000)]}).encode()
    values: list = []  # kept until measured: freeing them is not what is compared here
    whole = _longest_wait_beside(lambda: values.append(json.loads(raw)))
    stepped = _longest_wait_beside(lambda: values.append(parse_json_body(raw)))
    assert all(len(v["unused"]) == 3_000_000 for v in values)
    assert stepped * 4 < whole, (stepped, whole)


def test_freeing_a_body_in_pieces_lets_other_threads_run():
    """Dropping a body of 3.9 million floats in 99,000 lists is one C call: 60-106 ms of the GIL (the
    event loop's /health waits that long). free_in_pieces, which the server runs on a thread for a large
    body once its route is done, empties it 10,000 values at a time. Compared as a ratio, on the same body."""
    raw = json.dumps({"messages": [{"role": "user", "content": "hi"}],
                      "unused": [[i * 0.001] * 39 for i in range(99_000)]}).encode()
    at_once, in_pieces = [], []
    for _ in range(2):  # the better of two each: a loaded machine's scheduling adds to either
        whole, pieces = [parse_json_body(raw)], [parse_json_body(raw)]
        at_once.append(_longest_wait_beside(whole.pop))
        in_pieces.append(_longest_wait_beside(lambda: json_body.free_in_pieces(pieces)))
        assert pieces == []
    assert min(in_pieces) * 3 < max(at_once), (in_pieces, at_once)  # 6-7 ms against 60-106 ms here


def test_free_in_pieces_leaves_what_something_else_holds_as_it_is():
    messages = [{"role": "user", "content": "hi"}]
    options = {"max_tokens": 4, "stop": ["x"]}
    body = {"messages": messages, "options": options, "unused": [[1.0, 2.0], {"a": [3]}]}
    values = [body, {"more": [[4.0] * 3] * 5}]
    del body  # given away: values holds it alone
    json_body.free_in_pieces(values)
    assert values == [] and messages == [{"role": "user", "content": "hi"}]
    assert options == {"max_tokens": 4, "stop": ["x"]}
    held = {"k": [1, 2]}
    json_body.free_in_pieces([held])  # still held here: left whole
    assert held == {"k": [1, 2]}


def test_a_string_of_millions_of_escaped_quotes_costs_about_what_json_loads_does():
    """Issue 43: 30 million escaped quotes took 7.8 s (a Python step per quote found the closing one)."""
    import time

    body = ('{"prompt": "' + '\\"' * 4_000_000 + '"}').encode()
    t = time.perf_counter()
    plain = json.loads(body)
    loads = time.perf_counter() - t
    t = time.perf_counter()
    assert parse_json_body(body) == plain
    ours = time.perf_counter() - t
    assert ours < 20 * loads + 0.05, (ours, loads)  # measured: about 3x (0.08 s at 3 million)
