"""llama-server's token and template routes: ``POST /tokenize``, ``/detokenize``,
``/apply-template`` and the chat token count ``/chat/completions/input_tokens`` (also under /v1/).

Tokens are the target's vocabulary, as llama-server's are (tools/server/server-context.cpp):
/tokenize takes a string, or llama-server's mixed list of strings and token ids; a piece, and
/detokenize's text, is each token's ``common_token_to_piece`` (special tokens written out) joined.
/apply-template renders a chat body as the chat route does (``schema.parse_chat``, then the
engine's chat templates through ``Engine.chat_params``: tools, tool results, reasoning and all), so
its prompt is the text the chat route feeds the model, with the media marker where each image goes;
input_tokens counts the rows the chat route tokenizes that prompt into, images included.

Every bit of tokenizer and template work runs on a thread, never on the event loop: llama.cpp's
tokenizer only reads a loaded vocabulary and may run beside the engine's worker (llama-server
tokenizes on its HTTP threads too), and mtmd_tokenize is thread-safe by its header. The work is
linear in the request; requests over ``PARSE_ON_A_THREAD_ABOVE`` bytes take turns
(server/offload.py's ``ThreadRunner``), because llama.cpp's tokenizer holds some 30 to 60 bytes
of memory per byte of text while it runs.

Where this differs from llama-server: a request llama-server answers with a 500 (a value of the
wrong JSON type, a token id outside the vocabulary) or reads past (a flag that is not a boolean,
a token id that is not an integer, a body that is not an object) is a 400 here.
"""

from __future__ import annotations

import json
import reprlib
from typing import Any, Callable

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pyllama_spec.server.errors import bad_request
from pyllama_spec.server.offload import ThreadRunner
from pyllama_spec.server.schema import RequestLimits, parse_chat
from pyllama_spec.server.service import RouteSpec, Service, read_json
from pyllama_spec.serving.engine import Engine

#: The engine's model (``Engine.model``), as these routes use it: tokenize, detokenize,
#: token_to_bytes, n_vocab. The server names no binding-layer type.
Vocabulary = Any

#: Token ids in /tokenize's mixed content are llama_token (int32), passed through unchecked as
#: llama-server passes them (it wraps a larger number around; that is a 400 here).
_INT32 = range(-(2**31), 2**31)

_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = 60


def routes(service: Service) -> list[RouteSpec]:
    """The routes under llama-server's paths."""
    run = ThreadRunner()

    def handler(route):
        return lambda request: route(service, request, run)

    return [
        ("/tokenize", ["POST"], handler(_tokenize_route)),
        ("/detokenize", ["POST"], handler(_detokenize_route)),
        ("/apply-template", ["POST"], handler(_apply_template_route)),
        *((p, ["POST"], handler(_input_tokens_route))
          for p in ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens")),
    ]


# --- the routes


async def _tokenize_route(service: Service, request: Request, run: ThreadRunner) -> Response:
    body, size = await _body(service, request)
    return await run(size, tokenize_response, service.engine.model, body)


async def _detokenize_route(service: Service, request: Request, run: ThreadRunner) -> Response:
    body, size = await _body(service, request)
    return await run(size, detokenize_response, service.engine.model, body)


async def _apply_template_route(service: Service, request: Request, run: ThreadRunner) -> Response:
    body, size = await _body(service, request)

    def answer() -> Response:
        prompt, _ = chat_prompt(service.engine, body, service.limits)
        return _json({"prompt": prompt}, "messages")

    return await run(size, answer)


async def _input_tokens_route(service: Service, request: Request, run: ThreadRunner) -> Response:
    body, size = await _body(service, request)

    def answer() -> Response:
        text, images = chat_prompt(service.engine, body, service.limits)
        return _json({"input_tokens": service.engine.count_tokens(text, images),
                      "object": "response.input_tokens"}, "messages")

    return await run(size, answer)


async def _body(service: Service, request: Request) -> tuple[dict, int]:
    body, size = await read_json(request, service.settings.max_body_bytes, service.settings.body_timeout)
    if not isinstance(body, dict):  # llama-server reads nothing from it and answers as if it were {}
        raise bad_request("the request body must be a JSON object")
    return body, size


def _json(value: dict, param: str) -> Response:
    """The response, rendered here (on a thread) rather than on the event loop."""
    try:
        return JSONResponse(value)
    except UnicodeEncodeError:  # a lone surrogate ("\ud800") from the request's JSON, kept in the text
        raise bad_request(f"'{param}' holds a lone UTF-16 surrogate, which is not text", param) from None


# --- /tokenize and /detokenize, on a Model (a vocabulary-only one will do)

#: Tokens handled per C-level step (a join, a JSON dump, a type check): each step holds the GIL
#: for a few milliseconds at most, so the event loop's thread runs between them.
_STEP = 1 << 16


def tokenize_response(model: Vocabulary, body: dict) -> Response:
    """/tokenize: ``{"tokens": [ids]}``, or ``[{"id", "piece"}]`` with ``with_pieces``."""
    add_special = _flag(body, "add_special", False)
    parse_special = _flag(body, "parse_special", True)
    with_pieces = _flag(body, "with_pieces", False)
    # llama-server answers a body without content with no tokens
    ids = tokenize_content(model, body["content"], add_special=add_special,
                           parse_special=parse_special) if "content" in body else np.zeros(0, np.int32)
    if not with_pieces:
        return _json_array("tokens", ids, str)
    if len(ids) and (ids.min() < 0 or ids.max() >= model.n_vocab):  # ids given in a mixed content
        bad = int(ids[(ids < 0) | (ids >= model.n_vocab)][0])
        raise _not_in_vocabulary(model, bad, "content")
    return _json_array("tokens", ids, token_entries(model, ids).__getitem__)


def detokenize_response(model: Vocabulary, body: dict) -> Response:
    """/detokenize: ``{"content": text}``."""
    tokens = body.get("tokens", [])  # absent: "" (llama-server)
    if not isinstance(tokens, list):
        raise bad_request(f"'tokens' must be a list of token ids, got {type(tokens).__name__}", "tokens")
    return _json({"content": detokenize(model, check_token_ids(model, tokens, "tokens"))}, "tokens")


def tokenize_content(model: Vocabulary, content: Any, *, add_special: bool = False,
                     parse_special: bool = True) -> np.ndarray:
    """llama-server's ``tokenize_mixed``: the tokens (int32) of a string, or of a list of strings and
    token ids in order, where only a string that comes first gets BOS/EOS (``add_special``) and
    each id is kept as it is (any int32: checked against the vocabulary only where it is read)."""
    if isinstance(content, str):
        return _tokens(model, content, add_special, parse_special)
    if not isinstance(content, list):
        raise bad_request(f"'content' must be a string or a list of strings and token ids, got "
                          f"{type(content).__name__}", "content")
    # Ids gather in a list that becomes int32 arrays of _STEP ids (an array per id would cost some
    # 100 bytes); the arrays are joined _STEP // 16 at a time, so that no one concatenation of
    # millions holds the GIL long, and what is kept is 4 bytes a token.
    parts: list[np.ndarray] = []  # joined arrays
    pending: list[np.ndarray] = []  # arrays not joined yet
    ids: list[int] = []
    for i, part in enumerate(content):
        if type(part) is int and part in _INT32:
            ids.append(part)
        elif isinstance(part, str):
            pending += _int32_arrays(ids)
            ids = []
            pending.append(_tokens(model, part, add_special and i == 0, parse_special))
        else:
            raise bad_request(f"'content[{i}]' must be a string or a token id (a 32-bit integer), got "
                              f"{_SHOW.repr(part)}", "content")
        if len(ids) >= _STEP:
            pending += _int32_arrays(ids)
            ids = []
        if len(pending) >= _STEP // 16:
            parts.append(np.concatenate(pending))
            pending = []
    parts += [*pending, *_int32_arrays(ids)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def _int32_arrays(ids: list[int]) -> list[np.ndarray]:
    """``ids`` as int32 arrays of ``_STEP`` ids each (one C call each, a few milliseconds of the GIL)."""
    return [np.array(ids[at:at + _STEP], np.int32) for at in range(0, len(ids), _STEP)]


def _tokens(model: Vocabulary, text: str, add_special: bool, parse_special: bool) -> np.ndarray:
    try:
        return model.tokenize(text, add_special=add_special, parse_special=parse_special)
    except UnicodeEncodeError:
        raise bad_request("'content' holds a lone UTF-16 surrogate, which is not text", "content") from None


def check_token_ids(model: Vocabulary, tokens: list, param: str) -> list[int]:
    """``tokens`` when every one is a token of the model's vocabulary; else a 400 naming the first
    that is not (llama-server answers an id outside the vocabulary with a 500, and reads a float
    or a boolean as an integer)."""
    n_vocab = model.n_vocab
    for at in range(0, len(tokens), _STEP):
        step = tokens[at:at + _STEP]
        if not set(map(type, step)) <= {int}:  # not a bool: type() is exact
            bad = next(t for t in step if type(t) is not int)
            raise bad_request(f"'{param}' must hold token ids (integers), got {_SHOW.repr(bad)}", param)
        if min(step) < 0 or max(step) >= n_vocab:
            raise _not_in_vocabulary(model, next(t for t in step if not 0 <= t < n_vocab), param)
    return tokens


def _not_in_vocabulary(model: Vocabulary, token: int, param: str):
    return bad_request(f"'{param}' holds {_SHOW.repr(token)}, which is not a token of this model's vocabulary "
                       f"(0 to {model.n_vocab - 1})", param)


def _pieces(model: Vocabulary, tokens) -> dict[int, bytes]:
    """Each distinct token's piece, special tokens written out (llama-server's common_token_to_piece):
    one native call per distinct token, however long the list."""
    distinct = np.unique(tokens).tolist() if isinstance(tokens, np.ndarray) else set(tokens)
    return {t: model.token_to_bytes(t, special=True) for t in distinct}


def detokenize(model: Vocabulary, tokens: list[int]) -> str:
    """The tokens' pieces joined, as llama-server's /detokenize joins them (no leading space
    removed, special tokens written out); bytes that are not UTF-8 become U+FFFD, as llama-server's
    JSON writer replaces them. The ids must be the vocabulary's (``check_token_ids``)."""
    piece = _pieces(model, tokens).__getitem__
    steps = [b"".join(map(piece, tokens[at:at + _STEP])) for at in range(0, len(tokens), _STEP)]
    return b"".join(steps).decode("utf-8", errors="replace")


def token_entries(model: Vocabulary, tokens: np.ndarray) -> dict[int, str]:
    """``{"id", "piece"}`` of each distinct token, as JSON text: a piece is its text, or the list of
    its bytes when llama-server's UTF-8 check refuses it (half a character)."""
    return {t: _dumps({"id": t, "piece": piece_value(data)}) for t, data in _pieces(model, tokens).items()}


def piece_value(data: bytes) -> str | list[int]:
    """A piece as /tokenize shows it: a string when llama-server's ``is_valid_utf8`` takes the
    bytes, else the list of byte values."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    if _utf8_shaped(data):  # lead and continuation bytes in place, but overlong or a surrogate:
        return data.decode("utf-8", errors="replace")  # a string, which llama-server's JSON writer replaces
    return list(data)


def _utf8_shaped(data: bytes) -> bool:
    """llama-server's ``is_valid_utf8``: every lead byte followed by its continuation bytes (it does
    not refuse overlong forms, surrogates or code points past U+10FFFF, as Python's decoder does)."""
    i, n = 0, len(data)
    while i < n:
        b = data[i]
        size = 1 if b <= 0x7F else 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 0
        if size == 0 or i + size > n or any(c & 0xC0 != 0x80 for c in data[i + 1:i + size]):
            return False
        i += size
    return True


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))  # as JSONResponse


def _json_array(key: str, ids: np.ndarray, item: Callable[[int], str]) -> Response:
    """``{key: [item(id), ...]}`` written a step at a time (one json.dumps of millions of items
    would hold the GIL, and so the event loop, for a second)."""
    steps = [",".join(map(item, ids[at:at + _STEP].tolist())) for at in range(0, len(ids), _STEP)]
    return Response(f'{{"{key}":[{",".join(steps)}]}}', media_type="application/json")


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):  # llama-server reads past it (the default); a 400 here
        raise bad_request(f"'{name}' must be a boolean, got {type(value).__name__}", name)
    return value


# --- /apply-template and input_tokens, on the Engine


def chat_prompt(engine: Engine, body: Any, limits: RequestLimits) -> tuple[str, list]:
    """The prompt text the chat route would feed the model for chat ``body``, and its images in
    marker order: the body read by the chat route's own parser (what it refuses is refused here),
    rendered with the engine's chat templates and chat settings (``Engine.chat_params``), as the chat
    route renders it: tools, tool results, reasoning, add_generation_prompt, continue_final_message.
    """
    params = parse_chat(body, limits).params
    try:
        chat = engine.chat_params(params.messages, params.chat_options)
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    return chat.prompt, list(chat.images)
