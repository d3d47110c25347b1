"""llama-server's ``POST /infill``: code completion between a prefix and a suffix with the model's
fill-in-the-middle tokens, answered as /completion answers (every /completion field applies).

The prompt is laid out as llama-server's ``format_prompt_infill`` (tools/server/server-common.cpp):

    [extra][BOS]<FIM_PRE>prefix prompt<FIM_SUF>suffix<FIM_MID>

``input_prefix`` / ``input_suffix`` are text (or llama-server's mixed lists of text and token ids),
tokenized without parsing special tokens; ``prompt`` is text, tokenized with them. The prefix keeps
its last 3/4 of a batch of tokens, the suffix its first quarter less the prompt's. ``input_extra``
({"filename", "text"} chunks) goes before, repo-level when the model has FIM_REP and FIM_SEP tokens
(``<FIM_REP>myproject\\n<FIM_SEP>{filename}\\n{text}...<FIM_SEP>filename\\n``), else each chunk after
a ``\\n\\n--- snippet ---\\n\\n`` line; of it, the last ``n_ctx - n_batch - 2 * n_predict`` tokens are
kept (n_predict the server's -n). A model without FIM_PRE, FIM_SUF or FIM_MID is answered with
llama-server's 501.

Where this differs from llama-server: a missing ``input_prefix`` / ``input_suffix`` or a value of the
wrong type is a 400 (llama-server: a 500, or it reads past a ``prompt`` that is not a string);
--spm-infill (suffix first) is not offered; n_predict is serve's -n, whose default is 512 here and
-1 (none) in llama-server, so by default fewer extra tokens are kept here (1026 fewer).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from pyllama_spec.server.errors import APIError, bad_request
from pyllama_spec.server.generation import answer
from pyllama_spec.server.offload import ThreadRunner
from pyllama_spec.server.schema import parse_completion
from pyllama_spec.server.service import (
    RouteSpec,
    Service,
    read_json,
)

#: llama-server's separator before each extra chunk when the model has no FIM_SEP token.
_SNIPPET = "\n\n--- snippet ---\n\n"
_ROLES = (("pre", "prefix"), ("suf", "suffix"), ("mid", "middle"))


def routes(service: Service) -> list[RouteSpec]:
    fim = service.engine.model.fim_tokens  # read once, before any generation runs
    # llama-server's -n (-1: none; serve's -n -1 makes the default max_tokens the --max-tokens cap)
    settings = service.settings
    n_predict = -1 if settings.default_max_tokens >= settings.max_tokens else settings.default_max_tokens
    layout = {"fim": fim, "n_batch": service.engine.config.n_batch, "n_ctx": service.facts["n_ctx_slot"],
              "n_predict": n_predict}
    missing = "".join(f"{what} token is missing. " for role, what in _ROLES if fim[role] < 0)
    run = ThreadRunner()  # native tokenizing: never on the event loop; large inputs one at a time

    async def infill(request: Request) -> Response:
        if missing:
            raise APIError(501, f"Infill is not supported by this model: {missing}", type="not_supported_error",
                           code="not_supported")
        body, size = await read_json(request, service.settings.max_body_bytes, service.settings.body_timeout)
        prefix, suffix, extra, prompt = _fields(body, service.limits.n_vocab)

        def build():
            tokens = infill_tokens(service.engine.model, prefix, suffix, extra, prompt, **layout)
            return parse_completion(dict(body, prompt=tokens.tolist()), service.limits, llama_style=True)

        req = await run(size, build)
        return await answer(service, request, req)

    return [("/infill", ["POST"], infill)]


def _fields(body: Any, n_vocab: int) -> tuple[Any, Any, list, str]:
    """input_prefix, input_suffix, input_extra and prompt, checked as llama-server checks them."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for name in ("input_prefix", "input_suffix"):
        if name not in body:
            raise bad_request(f'"{name}" is required', name)
        _check_mixed(body[name], name, n_vocab)
    prompt = body.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise bad_request('"prompt" must be a string', "prompt")
    extra = body.get("input_extra")
    extra = [] if extra is None else extra
    if not isinstance(extra, list):
        raise bad_request('"input_extra" must be an array of {"filename": string, "text": string}', "input_extra")
    for chunk in extra:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise bad_request('extra_context chunk must contain a "text" field with a string value', "input_extra")
        if chunk.get("filename") is not None and not isinstance(chunk["filename"], str):
            raise bad_request("extra_context chunk's \"filename\" field must be a string", "input_extra")
    return body["input_prefix"], body["input_suffix"], extra, prompt or ""


def _check_mixed(value: Any, name: str, n_vocab: int) -> None:
    """A string, or a list of strings and token ids in the vocabulary (llama-server's tokenize_mixed)."""
    if isinstance(value, str):
        return
    if not isinstance(value, list):
        raise bad_request(f'"{name}" must be a string or a list of strings and token ids', name)
    for v in value:
        if isinstance(v, str):
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad_request(f'"{name}" must be a string or a list of strings and token ids', name)
        if not 0 <= v < n_vocab:
            raise bad_request(f'"{name}" holds token id {v}, outside the vocabulary (0 to {n_vocab - 1})', name)


def infill_tokens(model, prefix: Any, suffix: Any, extra: list, prompt: str, *, fim: dict, n_batch: int,
                  n_ctx: int, n_predict: int, spm: bool = False) -> np.ndarray:
    """The /infill prompt's tokens, as llama-server's ``format_prompt_infill`` lays them out (see the
    module); native tokenizing, linear in the input: run it on a thread."""
    def text(s: str, special: bool = False) -> list[int]:
        return model.tokenize(s, add_special=False, parse_special=special).tolist()

    def mixed(value: Any) -> list[int]:
        if isinstance(value, str):
            return text(value)
        return [t for v in value for t in (text(v) if isinstance(v, str) else [v])]

    tokens_prefix, tokens_suffix, tokens_prompt = mixed(prefix), mixed(suffix), text(prompt, special=True)
    extra_tokens: list[int] = []
    if fim["rep"] >= 0:
        extra_tokens += [fim["rep"], *text("myproject\n")]  # llama-server's project name
    for chunk in extra:
        if fim["sep"] >= 0:
            extra_tokens += [fim["sep"], *text((chunk.get("filename") or "tmp") + "\n")]
        else:
            extra_tokens += text(_SNIPPET)
        extra_tokens += text(chunk["text"])
    if fim["sep"] >= 0:
        extra_tokens += [fim["sep"], *text("filename\n")]  # llama-server's name for the current file

    # the prefix and suffix fit a batch, 3:1; the extra chunks fill the rest of the context
    n_prefix_take = min(len(tokens_prefix), 3 * (n_batch // 4))
    n_suffix_take = min(len(tokens_suffix), max(0, n_batch // 4 - (2 + len(tokens_prompt))))
    n_extra_take = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_tokens))
    head = [fim["pre"], *tokens_prefix[len(tokens_prefix) - n_prefix_take:], *tokens_prompt]
    tail = [fim["suf"], *tokens_suffix[:n_suffix_take]]
    first, second = (tail, head) if spm else (head, tail)
    if model.add_bos:
        first = [model.bos, *first]
    out = extra_tokens[len(extra_tokens) - n_extra_take:] + first + second + [fim["mid"]]
    return np.asarray(out, dtype=np.int32)
