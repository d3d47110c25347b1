"""A request body as a JSON value, without holding the GIL long.

``json.loads`` is one C call: it holds the GIL for as long as it parses, so a body of a few
million numbers (64 MiB holds about 6 million) stops every other thread, the event loop's
included, for a second or more, even on a worker thread. ``parse_json_body`` reads a small body
with one ``json.loads`` and any other with ``parse_in_steps``: arrays and objects are walked
here, in Python, which lets other threads run between steps, and everything else is read by the
json module's own C code in bounded runs (``RUN_CHARS`` of scalar values, ``STRING_PIECE`` of
a string), so the value and the errors are json.loads's.

Freeing is the same: dropping a body of millions of values is one C call too (4 million floats in
100,000 lists: 60 ms of the GIL, 70-106 ms on a busy machine), so ``free_in_pieces`` frees a large
body on a thread, a piece at a time.

Every way a body can be wrong is a 400 (``bad_request``): not JSON, nested more than
``MAX_JSON_DEPTH`` levels, or more than ``MAX_JSON_CONTAINERS`` arrays and objects,
``MAX_JSON_VALUES`` values, ``MAX_OBJECT_MEMBERS`` members in an object: each bounds what a
body costs in memory and in time, parsing it and freeing it.
"""

from __future__ import annotations

import codecs
import json
import re
import sys
from typing import Any

from pyllama_spec.server.errors import bad_request

#: How deeply a request body may nest arrays and objects (an OpenAI request needs a handful of
#: levels, a tool's JSON schema a few dozen): deeper is a 400, whatever Python's stack would allow.
MAX_JSON_DEPTH = 100
#: Arrays and objects one request body may hold. Parsing costs about 60 bytes of memory and
#: some 0.3 us of the GIL per container, so a 64 MiB body of "[]," would take 1.5 GB and
#: seconds of every thread; no real request comes near this.
MAX_JSON_CONTAINERS = 100_000
#: Members one object may hold: adding to a dict of n entries may copy them all (some 70 ms of
#: the GIL at a million). A logit_bias over the largest vocabulary (262,144 tokens) fits.
MAX_OBJECT_MEMBERS = 300_000
#: Values one body may hold in its arrays and objects. Each costs some 30 bytes, and the GIL is held
#: for their number when a container of them is freed at once (4 million floats: 35 ms; in 100,000
#: lists 60-106 ms: ``free_in_pieces``) or walked by a collection (80-140 ms: the server keeps large
#: bodies from the collector). A tiny vocabulary's tokens of a 3.3 MB text (3.3 million) fit.
MAX_JSON_VALUES = 4_000_000
#: Values freed at a time by ``free_in_pieces`` (about 0.1 ms of the GIL).
FREE_PIECE = 10_000
#: A body with at most this many values (counted from its commas and colons) is parsed by one
#: ``json.loads``: some 15 ms of the GIL at worst (a float takes about 0.24 us to read).
ONE_CALL_VALUES = 50_000
#: Characters of a string read by one C call (about 2 ms of the GIL); a longer body takes steps.
STRING_PIECE = 1 << 20
#: Characters of scalar values (numbers, short strings) in an array or object read by one C call.
RUN_CHARS = 1 << 16

_DECODER = json.JSONDecoder()
_SCAN_VALUE = _DECODER.scan_once  # the C scanner: one JSON value from an index
_scanstring = json.decoder.scanstring  # the C string reader: from after the opening quote
_SPACE = re.compile(r"[ \t\n\r]*")
_HEX = "[0-9a-fA-F]"
#: The longest number a body may hold, in characters (json.loads refuses an integer of more than 4,300
#: digits, but reads a float of any length in one call: 60 million digits held the GIL 240 ms).
MAX_NUMBER_CHARS = 4400
_LONG_NUMBER = re.compile(rf"[-+0-9.eE]{{{MAX_NUMBER_CHARS + 1}}}")
_WS = r"[ \t\n\r]*"
_STRING = r'"(?:[^"\\]++|\\.)*+"'
_SCALAR = rf"(?:{_STRING}|[^\s\"\[\]{{}},:]++)"
#: A run of an array's scalar elements, and of an object's members with scalar values, each with
#: its comma (the json module then reads the run, and says what is wrong with it).
_ELEMENTS = re.compile(rf"(?:{_WS}{_SCALAR}{_WS},)*+")
_MEMBERS = re.compile(rf"(?:{_WS}{_STRING}{_WS}:{_WS}{_SCALAR}{_WS},)*+")
_CONTROL = re.compile(r"[\x00-\x1f]")
_LOW_SURROGATE_ESCAPE = re.compile(rf"\\u[dD][c-fC-F]{_HEX}{{2}}")
_PAIR_ESCAPE = re.compile(rf"\\u[dD][89abAB]{_HEX}{{2}}\\u[dD][c-fC-F]{_HEX}{{2}}")


def parse_json_body(raw: bytes) -> Any:
    """A request body as a JSON value; anything json.loads refuses, or that passes this module's
    limits, is a 400. A small body is read by one ``json.loads``; any other in steps
    (``parse_in_steps``), so that no single C call holds the GIL for long."""
    try:
        if not takes_steps(raw):
            if _containers_at_least(raw, MAX_JSON_CONTAINERS + 1) > MAX_JSON_CONTAINERS:
                raise OverLimit(_TOO_MANY_CONTAINERS)
            value = json.loads(raw)
            # A body deep enough to nest this far has at least as many brackets: most are not walked.
            if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _too_deep(value, MAX_JSON_DEPTH):
                raise OverLimit(_TOO_DEEP)
            return value
        # refused before it is decoded and parsed where that is quick to know (31 million ids: 0.7 s)
        if _surely_too_many_values(raw):
            raise OverLimit(_TOO_MANY_VALUES)
        return parse_in_steps(_decode(raw))
    except OverLimit as e:
        raise bad_request(str(e)) from None
    except RecursionError:
        raise bad_request(_TOO_DEEP) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    except ValueError as e:  # an integer of more than sys.get_int_max_str_digits() digits
        raise bad_request(f"the request body is not valid JSON: {str(e).split(';')[0]}") from None


def takes_steps(raw: bytes) -> bool:
    """Whether ``parse_json_body`` reads ``raw`` in steps, slower than one json.loads but never
    holding the GIL long: a body over ``STRING_PIECE`` bytes, of many values, or not in UTF-8 (the
    containers are counted on its bytes only in UTF-8). The caller runs such a body off the event loop."""
    return (len(raw) > STRING_PIECE or raw.count(b",") + raw.count(b":") > ONE_CALL_VALUES
            or not json.detect_encoding(raw).startswith("utf-8"))


class OverLimit(ValueError):
    """A JSON text passes one of this module's limits (its message says which)."""


_TOO_DEEP = f"the request body nests too deeply (more than {MAX_JSON_DEPTH} levels of arrays and objects)"
_TOO_MANY_CONTAINERS = f"the request body holds more than {MAX_JSON_CONTAINERS} arrays and objects"
_TOO_MANY_VALUES = (f"the request body holds more than {MAX_JSON_VALUES:,} values (numbers, strings, arrays and "
                    "objects in arrays and objects)")
_TOO_MANY_MEMBERS = f"an object in the request body holds more than {MAX_OBJECT_MEMBERS} members"


def _decode(raw: bytes) -> str:
    """``raw`` as text, in the encoding json.loads would read it in, ``STRING_PIECE`` bytes per C call
    (ASCII in one: a copy, as quick as joining the pieces would be)."""
    encoding = json.detect_encoding(raw)
    if encoding == "utf-8" and raw.isascii():
        return raw.decode("ascii")
    decoder = codecs.getincrementaldecoder(encoding)("surrogatepass")
    view, pieces = memoryview(raw), []
    for at in range(0, len(raw), STRING_PIECE):
        try:
            pieces.append(decoder.decode(view[at:at + STRING_PIECE], final=at + STRING_PIECE >= len(raw)))
        except UnicodeDecodeError as e:  # where in the body, not in the piece
            raise UnicodeDecodeError(encoding, raw, at + e.start, at + e.end, e.reason) from None
    return "".join(pieces)


def parse_in_steps(text: str) -> Any:
    """``json.loads(text)``, with the GIL let go every few milliseconds.

    Arrays and objects are kept on a stack of their own (no recursion). Inside them, a run of
    scalar values (numbers, short strings, literals) of up to ``RUN_CHARS`` characters is read by
    one ``json.loads``; any other value by the json module's C scanner, and a string longer than
    ``STRING_PIECE`` piece by piece. The value, and the errors (``json.JSONDecodeError``), are
    json.loads's."""
    end, opened, values = len(text), 0, 0  # arrays and objects opened, values read
    stack: list[list | dict] = []  # the open arrays and objects, innermost last
    keys: list[str | None] = []  # each open object's key awaiting its value (None for an array)
    at = _skip_space(text, 0)
    while True:
        # a value starts at `at`
        first = text[at:at + 1]
        if first == "[" or first == "{":
            opened += 1
            if opened > MAX_JSON_CONTAINERS:
                raise OverLimit(_TOO_MANY_CONTAINERS)
            if len(stack) >= MAX_JSON_DEPTH:
                raise OverLimit(_TOO_DEEP)
            at = _skip_space(text, at + 1)
            if text.startswith("]" if first == "[" else "}", at):
                value, at = [] if first == "[" else {}, at + 1
            else:
                container: list | dict = [] if first == "[" else {}
                stack.append(container)
                at, n = _run(text, at, container)
                values += n
                if values > MAX_JSON_VALUES:
                    raise OverLimit(_TOO_MANY_VALUES)
                if first == "[":
                    keys.append(None)
                else:
                    key, at = _key(text, at)
                    keys.append(key)
                continue
        elif first == '"' and _maybe_long(text, at + 1):
            value, at = _long_string(text, at + 1)
        else:
            if _LONG_NUMBER.match(text, at):
                raise OverLimit(f"the request body holds a number of more than {MAX_NUMBER_CHARS} characters")
            try:
                value, at = _SCAN_VALUE(text, at)
            except StopIteration as e:
                raise json.JSONDecodeError("Expecting value", text, e.value) from None
        # `value` is complete: it goes into the innermost open container, which may close in turn
        while True:
            if not stack:
                at = _skip_space(text, at)
                if at != end:
                    raise json.JSONDecodeError("Extra data", text, at)
                return value
            values += 1
            if values > MAX_JSON_VALUES:
                raise OverLimit(_TOO_MANY_VALUES)
            container, key = stack[-1], keys[-1]
            if key is None:
                container.append(value)
            else:
                container[key] = value
                if len(container) > MAX_OBJECT_MEMBERS:
                    raise OverLimit(_TOO_MANY_MEMBERS)
            at = _skip_space(text, at)
            sep = text[at:at + 1]
            if sep == ",":
                at, n = _run(text, _skip_space(text, at + 1), container)
                values += n
                if values > MAX_JSON_VALUES:
                    raise OverLimit(_TOO_MANY_VALUES)
                if key is not None:
                    keys[-1], at = _key(text, at)
                break  # the next value
            if sep == ("]" if key is None else "}"):
                value, at = stack.pop(), at + 1
                keys.pop()
                continue  # the closed container is itself a value
            raise json.JSONDecodeError("Expecting ',' delimiter", text, at)


def _skip_space(text: str, at: int) -> int:
    """The index after the spaces at ``at``, matched ``STRING_PIECE`` characters per C call."""
    while (end := _SPACE.match(text, at, at + STRING_PIECE).end()) == at + STRING_PIECE:
        at = end
    return end


def _run(text: str, at: int, container: list | dict) -> tuple[int, int]:
    """Reads the run of scalar values (or an object's members with scalar values), each with the
    comma after it, that starts at ``at``, into ``container``: the index after it, and how many
    values it held."""
    is_array = type(container) is list
    m = (_ELEMENTS if is_array else _MEMBERS).match(text, at, at + RUN_CHARS)
    last_comma = m.end() - 1
    if last_comma < at:
        return at, 0
    try:
        values = json.loads(("[" if is_array else "{") + text[at:last_comma] + ("]" if is_array else "}"))
    except json.JSONDecodeError as e:
        raise json.JSONDecodeError(e.msg, text, at + e.pos - 1) from None
    if is_array:
        container.extend(values)
    else:
        container.update(values)
        if len(container) > MAX_OBJECT_MEMBERS:
            raise OverLimit(_TOO_MANY_MEMBERS)
    return _skip_space(text, m.end()), len(values)


def _key(text: str, at: int) -> tuple[str, int]:
    """An object's key at ``at`` and the index after its colon and the spaces after that."""
    if not text.startswith('"', at):
        raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, at)
    if _maybe_long(text, at + 1):
        key, at = _long_string(text, at + 1)
    else:
        key, at = _scanstring(text, at + 1)
    at = _skip_space(text, at)
    if not text.startswith(":", at):
        raise json.JSONDecodeError("Expecting ':' delimiter", text, at)
    return key, _skip_space(text, at + 1)


def _maybe_long(text: str, start: int) -> bool:
    """Whether the string whose text begins at ``start`` may be longer than ``STRING_PIECE``: its
    first quote is not within that, or is escaped (then ``_long_string`` finds the right one)."""
    quote = text.find('"', start, start + STRING_PIECE)
    return quote < 0 or text[quote - 1] == "\\"


def _long_string(text: str, start: int) -> tuple[str, int]:
    """The string whose text begins at ``start`` (after its opening quote), and the index after
    its closing quote: read ``STRING_PIECE`` characters at a time, each piece ending between two
    escapes (never between a surrogate pair's halves), so that joined they are the string json reads."""
    quote = text.find('"', start)
    if quote >= 0 and text.find("\\", start, quote) < 0:
        # no escape (a prompt without newlines, an image's base64): the text is the string, once it is
        # known to hold no control character; one copy instead of pieces copied and joined
        for at in range(start, quote, STRING_PIECE):
            if bad := _CONTROL.search(text, at, min(at + STRING_PIECE, quote)):
                raise json.JSONDecodeError("Invalid control character at", text, bad.start())
        return text[start:quote], quote + 1
    pieces, at = [], start
    while True:
        cut, closed = _piece_end(text, at, min(at + STRING_PIECE, len(text)))
        if closed:
            piece, after = _scanstring(text, at)  # reads up to `cut`, the closing quote
            pieces.append(piece)
            return "".join(pieces), after
        if cut >= len(text):
            try:
                _scanstring(text, at)  # a bad escape or control character before the end: json says so
            except json.JSONDecodeError as e:
                if not e.msg.startswith("Unterminated"):
                    raise
            raise json.JSONDecodeError("Unterminated string starting at", text, start - 1)
        try:
            piece, _ = _scanstring(text[at:cut] + '"', 0)
        except json.JSONDecodeError as e:
            raise json.JSONDecodeError(e.msg, text, at + e.pos) from None
        pieces.append(piece)
        at = cut


def _piece_end(text: str, at: int, limit: int) -> tuple[int, bool]:
    """Where the piece of a string's text that starts at ``at`` (after a whole escape) ends:
    ``(index of the closing quote, True)`` when it comes before ``limit``, else ``(cut, False)``
    with ``cut`` at most a few characters from ``limit`` and not inside an escape or a pair.
    Backslashes are counted at C speed (``rstrip``) over stretches that begin after a whole escape."""
    # The closing quote, found at C speed: with the escaped backslashes blanked out first (each
    # backslash starts an escape of one character, so pairs go left to right), every quote left
    # behind a backslash is escaped. (A loop over the quotes cost a Python step each: 30 million
    # escaped quotes took seconds.)
    flat = text[at:limit].replace("\\\\", "  ").replace('\\"', "  ")
    if (quote := flat.find('"')) >= 0:
        return at + quote, True
    pos = at
    backslash = text.rfind("\\", pos, limit)
    if backslash < 0 or backslash < limit - 6:  # no escape (at most 6 characters) reaches `limit`, nor a pair's halves
        return limit, False
    stretch = text[pos:backslash + 1]
    if (len(stretch) - len(stretch.rstrip("\\"))) % 2 == 0:  # it ends an escaped backslash
        return backslash + 1, False
    if _LOW_SURROGATE_ESCAPE.match(text, backslash):  # perhaps a pair's second half: keep it with the first
        return backslash + 6, False
    if backslash > at:
        return backslash, False
    # the piece would be one escape that reaches past `limit` (pieces of a few characters): all of it
    if not text.startswith("\\u", at):
        return at + 2, False
    return at + (12 if _PAIR_ESCAPE.match(text, at) else 6), False


def _too_deep(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists and dicts more than ``limit`` levels deep (level by level,
    without recursion)."""
    level, depth = [value], 0
    while level:
        depth += 1
        if depth > limit:
            return True
        children = []
        for v in level:
            items = v.values() if type(v) is dict else v
            children += [c for c in items if type(c) is list or type(c) is dict]
        level = children
    return False


#: Strings ``_surely_too_many_values`` skips at most (one find each, some 0.1 s of Python in all).
MAX_STRINGS_SKIPPED = 50_000


def _surely_too_many_values(raw: bytes) -> bool:
    """Whether ``raw`` holds more than ``MAX_JSON_VALUES`` commas outside its strings, so more values
    (commas are fewer than the values they separate): counted at C speed, ``STRING_PIECE`` bytes per
    call, on UTF-8 alone (where a comma's byte is a comma), strings skipped only when the plain count is
    over and they are at most ``MAX_STRINGS_SKIPPED``. False where unsure: the parse counts then."""
    def count(byte: bytes) -> int:
        return sum(raw.count(byte, at, at + STRING_PIECE) for at in range(0, len(raw), STRING_PIECE))

    if not json.detect_encoding(raw).startswith("utf-8") or count(b",") <= MAX_JSON_VALUES:
        return False
    if count(b'"') > 2 * MAX_STRINGS_SKIPPED:
        return False
    return _outside_strings_at_least(raw, (b",",), MAX_JSON_VALUES + 1) > MAX_JSON_VALUES


def _containers_at_least(raw: bytes, enough: int) -> int:
    """A number that is at least ``enough`` exactly when ``raw`` opens at least ``enough`` arrays
    and objects ('[' and '{' outside strings). Brackets are counted at C speed; only when there
    are that many in all are strings skipped, one bytes.find per string (a regex over strings
    took 22 s on one 60 MB string)."""
    total = raw.count(b"[") + raw.count(b"{")
    if total < enough:
        return total
    return _outside_strings_at_least(raw, (b"[", b"{"), enough)


def _outside_strings_at_least(raw: bytes, chars: tuple[bytes, ...], enough: int) -> int:
    """How many of ``chars`` ``raw`` holds outside its strings, counted until ``enough`` (at C speed
    between strings, at most ``STRING_PIECE`` bytes per call; each string skipped by a find of its
    closing quote, one not escaped by an odd run of backslashes)."""
    found, at, n = 0, 0, len(raw)
    while at < n:
        quote = raw.find(b'"', at)
        end = n if quote < 0 else quote
        for piece in range(at, end, STRING_PIECE):
            found += sum(raw.count(c, piece, min(piece + STRING_PIECE, end)) for c in chars)
            if found >= enough:
                return found
        if quote < 0:
            return found
        at = quote + 1
        while True:  # the closing quote: one not escaped by an odd run of backslashes
            close = raw.find(b'"', at)
            if close < 0:
                return found  # an unterminated string: json.loads will say so
            k = close - 1
            while k >= at and raw[k] == 0x5C:  # each backslash is looked at once, by the quote after it
                k -= 1
            at = close + 1
            if (close - 1 - k) % 2 == 0:
                break
    return found


def free_in_pieces(values: list) -> None:
    """Empty ``values`` (a list the caller gives away), and every array and object in it that nothing
    else holds, ``FREE_PIECE`` values at a time: between pieces the interpreter may hand the GIL to
    another thread (the event loop), where dropping the whole at once would hold it throughout.
    What something else still holds (a request's messages, kept by the job) is left as it is, to be
    freed with its last holder."""
    # what sys.getrefcount says of a container held here alone, measured by the same statements as the
    # loop's below (2 up to CPython 3.13: the name and the call's argument; fewer where loads borrow)
    probe = [[]]
    value = probe.pop()
    held_alone = sys.getrefcount(value)
    del value
    todo = values
    while todo:
        value = todo.pop()
        # held here alone: nothing else can see it being emptied
        if type(value) is list and sys.getrefcount(value) <= held_alone:
            while value:
                piece = value[-FREE_PIECE:]
                del value[-FREE_PIECE:]
                todo.extend(v for v in piece if type(v) is list or type(v) is dict)
                del piece
        elif type(value) is dict and sys.getrefcount(value) <= held_alone:
            while value:
                _, v = value.popitem()
                if type(v) is list or type(v) is dict:
                    todo.append(v)
                del v
        del value
