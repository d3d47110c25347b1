"""OpenAI-style requests in, checked generation arguments out; OpenAI-style errors.

Pure Python: reads JSON values, knows nothing of HTTP or of the engine's internals.
A request that is wrong in any way raises ``APIError`` with the status, type, code and
the parameter at fault, before anything reaches the engine.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .images import ImageLimits, decode_image_url


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "code", "param"}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",  # noqa: A002
                 code: str | None = None, param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclasses.dataclass
class GenerationRequest:
    """What one HTTP request asks the engine for."""

    kind: str  # "chat", "completion" (/v1/completions) or "llama" (/completion)
    stream: bool
    include_usage: bool
    engine_args: dict  # keyword arguments of Engine.stream
    n_images: int


# --- field readers: each names the parameter it refuses

def _number(body: dict, name: str, default, lo: float, hi: float, *, integer: bool = False):
    if name not in body or body[name] is None:
        return default
    v = body[name]
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok:
        raise bad_request(f"'{name}' must be {'an integer' if integer else 'a number'}, got {type(v).__name__}",
                          name)
    if not lo <= v <= hi:
        raise bad_request(f"'{name}' must be between {lo} and {hi}, got {v}", name)
    return v


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be a boolean, got {type(v).__name__}", name)
    return v


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        return list(stop)
    raise bad_request("'stop' must be a string or a list of at most 4 strings", "stop")


def _sampling(body: dict, max_tokens_limit: int, default_max_tokens: int) -> dict:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens is None:
        max_tokens = default_max_tokens
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 0 <= max_tokens <= max_tokens_limit:
        raise bad_request(f"'{name}' must be an integer between 0 and {max_tokens_limit}, got {max_tokens!r}", name)
    seed = _number(body, "seed", 0, -(2**63), 2**64 - 1, integer=True)
    return dict(
        max_tokens=max_tokens,
        temperature=float(_number(body, "temperature", 0.0, 0.0, 2.0)),
        top_p=float(_number(body, "top_p", 0.95, 0.0, 1.0)),
        top_k=int(_number(body, "top_k", 40, 0, 1_000_000, integer=True)),
        min_p=float(_number(body, "min_p", 0.05, 0.0, 1.0)),
        presence_penalty=float(_number(body, "presence_penalty", 0.0, -2.0, 2.0)),
        seed=int(seed) & 0xFFFFFFFF,
        stop=_stop(body),
        cache_prompt=_bool(body, "cache_prompt", True),  # llama-server's key: reuse the cached prefix
    )


def _speculative(body: dict, engine_limit: int, tree_limit: int = 0) -> dict:
    """llama-server's per-request keys (speculative.n_max / n_min), plus speculative.draft_positions,
    speculative.verify and speculative.tree (drafted tokens verified as a tree; 0: a chain)."""
    out = {}
    if "speculative.tree" in body:
        out["draft_tree"] = _number(body, "speculative.tree", None, 0, tree_limit, integer=True)
    if body.get("speculative.n_max") == "auto":
        out["draft_max"] = "auto"  # the adaptive schedule (draft_length.py)
    elif "speculative.n_max" in body:
        out["draft_max"] = _number(body, "speculative.n_max", None, 0, engine_limit, integer=True)
    if "speculative.n_min" in body:
        out["draft_min"] = _number(body, "speculative.n_min", None, 0, engine_limit, integer=True)
    if isinstance(out.get("draft_min"), int) and isinstance(out.get("draft_max"), int) \
            and out["draft_min"] > out["draft_max"]:
        raise bad_request("'speculative.n_min' cannot exceed 'speculative.n_max'", "speculative.n_min")
    if "speculative.verify" in body:
        rule = body["speculative.verify"]
        if rule not in ("rejection", "match"):
            raise bad_request("'speculative.verify' must be 'rejection' or 'match'", "speculative.verify")
        out["verify"] = rule
    if "speculative.draft_positions" in body:
        mode = body["speculative.draft_positions"]
        if mode not in ("target", "sequential"):
            raise bad_request("'speculative.draft_positions' must be 'target' or 'sequential'",
                              "speculative.draft_positions")
        out["draft_positions"] = mode
    return {k: v for k, v in out.items() if v is not None}


def _n_and_stream(body: dict) -> tuple[bool, bool]:
    n = body.get("n", 1)
    if n != 1 or isinstance(n, bool):
        raise bad_request("only n = 1 is supported", "n")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    include_usage = bool(options and options.get("include_usage"))
    return stream, include_usage


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    max_tokens: int  # largest max_tokens accepted
    default_max_tokens: int
    draft_max: int  # largest speculative.n_max accepted (what the engine can draft)
    images: ImageLimits
    draft_tree: int = 0  # largest speculative.tree accepted (the engine's draft_tree)


def _content_parts(content: Any, where: str, limits: RequestLimits, images: list) -> Any:
    """A message's content with every image_url part decoded (and checked) into image bytes."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of parts", f"{where}.content")
    parts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict):
            raise bad_request(f"{where}.content[{k}] must be an object", f"{where}.content")
        kind = part.get("type")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content[{k}].text must be a string", f"{where}.content")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            ref = part.get("image_url")
            url = ref.get("url") if isinstance(ref, dict) else ref
            if not isinstance(url, str):
                raise bad_request(f"{where}.content[{k}].image_url.url must be a string", f"{where}.content")
            if len(images) >= limits.images.max_images:
                raise bad_request(f"at most {limits.images.max_images} images per request", "messages",
                                  code="too_many_images")
            data = decode_image_url(url, limits.images, f"{where}.content[{k}]")
            images.append(data)
            parts.append({"type": "image", "image": data})
        else:
            raise bad_request(f"{where}.content[{k}] has unsupported type {kind!r} (use 'text' or 'image_url')",
                              f"{where}.content")
    return parts


def parse_chat(body: Any, limits: RequestLimits) -> GenerationRequest:
    """POST /v1/chat/completions."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    out, images = [], []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object", "messages")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad_request(f"{where}.role must be system, user or assistant, got {role!r}", "messages")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        out.append({"role": "system" if role == "developer" else role,
                    "content": _content_parts(content, where, limits, images)})
    stream, include_usage = _n_and_stream(body)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    args = dict(messages=out, **_sampling(body, limits.max_tokens, limits.default_max_tokens),
                **_speculative(body, limits.draft_max, limits.draft_tree), chat_template_kwargs=kwargs)
    return GenerationRequest("chat", stream, include_usage, args, len(images))


def parse_completion(body: Any, limits: RequestLimits, *, llama_style: bool = False) -> GenerationRequest:
    """POST /v1/completions (OpenAI) or /completion (llama-server: n_predict, content)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise bad_request("'prompt' must be a non-empty string", "prompt")
    if llama_style and "n_predict" in body:
        body = dict(body, max_tokens=None if body["n_predict"] == -1 else body["n_predict"])
    stream, include_usage = _n_and_stream(body)
    args = dict(prompt=prompt, **_sampling(body, limits.max_tokens, limits.default_max_tokens),
                **_speculative(body, limits.draft_max, limits.draft_tree))
    return GenerationRequest("llama" if llama_style else "completion", stream, include_usage, args, 0)
