"""OpenAI-style requests in, checked generation arguments out; OpenAI-style errors.

Pure Python: reads JSON values, knows nothing of HTTP or of the engine's internals.
A request that is wrong in any way raises ``APIError`` with the status, type, code and
the parameter at fault, before anything reaches the engine.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import reprlib
from typing import Any, Callable

from pyllama_spec.server.chat_schema import chat_options, message_extras
from pyllama_spec.server.errors import bad_request
from pyllama_spec.server.images import ImageBudget, ImageLimits, decode_image_url
from pyllama_spec.server.prompts import parse_prompts
from pyllama_spec.serving.request import Request, RequestOptions
from pyllama_spec.speculative.positions import DRAFT_POSITION_MODES
from pyllama_spec.speculative.verify import VERIFY_RULES

_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = 80
_SHOW.maxlevel = 3


def _show(value: Any) -> str:
    """A request value for an error message: its repr, shortened (a value can be 60 MB long or
    nested a hundred levels deep; the message stays short)."""
    return _SHOW.repr(value)


@dataclasses.dataclass
class GenerationRequest:
    """What one HTTP request asks the engine for."""

    kind: str  # "chat", "completion" (/v1/completions) or "llama" (/completion)
    stream: bool
    include_usage: bool
    params: RequestOptions  # the generation's settings the request gave (the engine resolves the rest)
    n_images: int
    n: int = 1  # choices to generate (OpenAI's n, llama-server's n_cmpl), each on a slot of its own
    id_slot: int = -1  # llama-server's id_slot: the slot to run in (the first choice's), -1 any
    #: /completion's list of prompts: ``params`` with each prompt (and its images), each prompt its
    #: n choices (None: ``params`` holds the one prompt, or the messages)
    prompts: list[RequestOptions] | None = None
    options: ResponseOptions = dataclasses.field(default_factory=lambda: ResponseOptions())
    #: a chat request's rendered chat (server/chat.py's RenderedChat), once ``render_chat``
    #: rendered it: its parser reads the answer into content, reasoning and tool calls
    chat: Any = None
    #: each job's Request (prompt by prompt, choice by choice), once ``Service.prepare`` resolved them
    requests: list[Request] | None = None

    def job_options(self, default_seed: int) -> list[RequestOptions]:
        """The settings of each job (job k is choice k % n of prompt k // n, llama-server's index).
        Choice i samples with the request's seed + i (``default_seed``, the server's, when it gives
        none): n samples, each reproducible."""
        seed = default_seed if self.params.seed is None else self.params.seed
        return [p if self.n == 1 else p.replace(seed=(seed + i) & 0xFFFFFFFF)
                for p, i in itertools.product(self.prompts or [self.params], range(self.n))]


@dataclasses.dataclass(frozen=True)
class ResponseOptions:
    """llama-server's request fields that shape its answer rather than the generation
    (tools/server/server-schema.cpp); each route answers those its shape has."""

    return_tokens: bool = False  # /completion's tokens (else [] when not streaming)
    return_progress: bool = False  # prompt_progress events while streaming
    timings_per_token: bool = False  # timings in every streamed chunk
    response_fields: tuple[str, ...] = ()  # /completion's field filter ("a/b" unnests); () keeps all
    post_sampling_probs: bool = False  # probabilities after the sampler chain ("prob", "top_probs")
    verbose: bool = False  # OpenAI-shaped answers also carry "__verbose": the first choice's /completion body
    # context shift's settings: echoed in generation_settings; this server (as llama-server without
    # --context-shift, its default) ends a generation that fills the context instead of shifting it
    n_keep: int = 0
    n_discard: int = 0


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
        raise bad_request(f"'{name}' must be between {lo} and {hi}, got {_show(v)}", name)
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
    raise bad_request(f"'stop' must be a string or a list of at most 4 strings, got {_show(stop)}", "stop")


#: llama-server's sampling fields (tools/server/server-schema.cpp) with the range each takes
#: here: (request field, Engine keyword, low, high, integer). Out of range is a 400.
_SAMPLING_FIELDS = (
    ("top_k", "top_k", -1, 1_000_000, True),
    ("top_p", "top_p", 0.0, 1.0, False),
    ("min_p", "min_p", 0.0, 1.0, False),
    ("typical_p", "typical_p", 0.0, 1.0, False),
    ("top_n_sigma", "top_n_sigma", -1.0, 1000.0, False),
    ("xtc_probability", "xtc_probability", 0.0, 1.0, False),
    ("xtc_threshold", "xtc_threshold", 0.0, 1.0, False),
    ("dynatemp_range", "dynatemp_range", 0.0, 100.0, False),
    ("dynatemp_exponent", "dynatemp_exponent", 0.0, 100.0, False),
    ("repeat_last_n", "penalty_last_n", -1, 1_000_000, True),
    ("repeat_penalty", "repeat_penalty", 0.0, 100.0, False),
    ("frequency_penalty", "frequency_penalty", -100.0, 100.0, False),
    ("presence_penalty", "presence_penalty", -100.0, 100.0, False),
    ("dry_multiplier", "dry_multiplier", 0.0, 100.0, False),
    ("dry_base", "dry_base", 0.0, 100.0, False),
    ("dry_allowed_length", "dry_allowed_length", 0, 1_000_000, True),
    ("dry_penalty_last_n", "dry_penalty_last_n", -1, 1_000_000, True),
    ("mirostat", "mirostat", 0, 2, True),
    ("mirostat_tau", "mirostat_tau", 0.0, 100.0, False),
    ("mirostat_eta", "mirostat_eta", 0.0, 100.0, False),
    ("min_keep", "min_keep", 0, 1_000_000, True),
)
#: The most tokens a request's logit_bias may name (each costs a little at every sampled token), and
#: the most bytes of text it may give instead of ids (each text is tokenized).
MAX_LOGIT_BIAS = 4096
MAX_LOGIT_BIAS_TEXT = 64 * 1024


def _logit_bias(body: dict):
    """OpenAI's {"token id": bias} or llama-server's [[token, bias], ...] (a bias of false forbids
    the token); the ids are checked against the vocabulary by the engine. A token given as text
    stands for each token of that text, as in llama-server: in the list form any string, in the
    object form a key that is not a whole number (as strtol reads it); kept as the text here, and
    tokenized by ``Service.prepare`` (``text_bias``). At most MAX_LOGIT_BIAS entries and
    MAX_LOGIT_BIAS_TEXT bytes of text: the tokenizing is bounded before it starts."""
    lb = body.get("logit_bias")
    if lb is None:
        return None
    items = lb.items() if isinstance(lb, dict) else lb if isinstance(lb, list) else None
    if items is None:
        raise bad_request("'logit_bias' must be an object {token id: bias} or a list of [token, bias]", "logit_bias")
    out, text_bytes = [], 0
    for n, item in enumerate(items):
        if n >= MAX_LOGIT_BIAS:  # every entry counts, an empty text too: the loop is bounded
            raise bad_request(f"'logit_bias' may name at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
        if not (isinstance(item, (list, tuple)) and len(item) == 2):
            raise bad_request(f"'logit_bias' entries must be [token, bias] pairs, got {_show(item)}", "logit_bias")
        token, bias = item
        if bias is not False and (isinstance(bias, bool) or not isinstance(bias, (int, float))):
            raise bad_request(f"'logit_bias' bias must be a number or false, got {_show(bias)}", "logit_bias")
        if isinstance(lb, dict) and isinstance(token, str) and _WHOLE_NUMBER.fullmatch(token):
            token = int(token)
        elif isinstance(token, str):  # a text: each of its tokens (Service.prepare tokenizes it)
            text_bytes += len(token.encode("utf-8", errors="surrogatepass"))
            if text_bytes > MAX_LOGIT_BIAS_TEXT:
                raise bad_request(f"'logit_bias' texts may hold at most {MAX_LOGIT_BIAS_TEXT} bytes in all", "logit_bias")
            if not token:
                continue  # no token to bias
        elif isinstance(token, bool) or not isinstance(token, int):
            raise bad_request(f"'logit_bias' token must be an integer id or a text, got {_show(token)}", "logit_bias")
        out.append((token, bias))
    return out


#: An object key read as a token id: a whole number, as strtol reads one (leading blanks, a sign).
_WHOLE_NUMBER = re.compile(r"[ \t\n\v\f\r]*[+-]?[0-9]+")


def has_text_bias(options: RequestOptions) -> bool:
    """Whether a logit_bias entry of ``options`` is a text (to tokenize: ``text_bias``)."""
    return any(isinstance(token, str) for token, _ in options.sampling.get("logit_bias") or ())


def text_bias(options: RequestOptions, tokenize: Callable[[str], Any]) -> RequestOptions:
    """``options`` with each logit_bias entry given as text replaced by one per token of the text
    (``tokenize``: the model's, without special tokens; memoise it over a request's jobs)."""
    if not has_text_bias(options):
        return options
    out = []
    for token, bias in options.sampling["logit_bias"]:
        out.extend([(int(t), bias) for t in tokenize(token)] if isinstance(token, str) else [(token, bias)])
        if len(out) > MAX_LOGIT_BIAS:
            raise bad_request(f"'logit_bias' may name at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
    return options.replace(sampling={**options.sampling, "logit_bias": out})


def _constraint(body: dict) -> dict:
    """grammar (GBNF), json_schema, or OpenAI's response_format, as Engine keywords."""
    grammar, schema = body.get("grammar"), body.get("json_schema")
    if grammar is not None and not isinstance(grammar, str):
        raise bad_request("'grammar' must be a GBNF string", "grammar")
    if schema is not None and not isinstance(schema, (dict, bool)):
        raise bad_request("'json_schema' must be a JSON schema (an object)", "json_schema")
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            schema = fmt.get("schema", {})  # llama-server also takes a schema here
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema", {}) if isinstance(spec, dict) else None
            if not isinstance(schema, (dict, bool)):
                raise bad_request("'response_format.json_schema.schema' must be a JSON schema", "response_format")
        elif kind != "text":
            raise bad_request("'response_format.type' must be 'text', 'json_object' or 'json_schema'",
                              "response_format")
    if grammar:  # llama-server: grammar wins when both are given
        return {"grammar": grammar}
    if schema is not None:
        return {"json_schema": schema}
    return {}


def _samplers(body: dict):
    names = body.get("samplers")
    if names is None:
        return None
    if isinstance(names, str) or (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        return names  # checked (names, or the one-letter string) by the engine
    raise bad_request("'samplers' must be a list of sampler names or a string of their letters", "samplers")


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives to list per token, or None: OpenAI chat's logprobs (bool) +
    top_logprobs, the completions' logprobs (int), llama-server's n_probs."""
    if "n_probs" in body and body["n_probs"] is not None:
        n = _number(body, "n_probs", 0, 0, 100, integer=True)
        return n or None
    lp = body.get("logprobs")
    if lp is None or lp is False:
        return None
    if chat:
        if lp is not True:
            raise bad_request("'logprobs' must be a boolean", "logprobs")
        return _number(body, "top_logprobs", 0, 0, 20, integer=True)
    return _number(body, "logprobs", 0, 0, 100, integer=True)


def _sampling(body: dict, max_tokens_limit: int, default_max_tokens: int) -> dict:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens is None:
        max_tokens = default_max_tokens
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 0 <= max_tokens <= max_tokens_limit:
        raise bad_request(f"'{name}' must be an integer between 0 and {max_tokens_limit}, got {_show(max_tokens)}",
                          name)
    out = dict(
        max_tokens=max_tokens,
        stop=_stop(body),
        cache_prompt=_bool(body, "cache_prompt", True),  # llama-server's key: reuse the cached prefix
    )
    if "ignore_eos" in body:
        out["ignore_eos"] = _bool(body, "ignore_eos", False)
    # Absent: the server's defaults (its command line's --temp and --seed) apply.
    temperature = _number(body, "temperature", None, -100.0, 100.0)
    if temperature is not None:
        out["temperature"] = max(0.0, float(temperature))  # llama-server samples greedily at <= 0
    seed = _number(body, "seed", None, -(2**63), 2**64 - 1, integer=True)
    if seed is not None:
        out["seed"] = int(seed) & 0xFFFFFFFF
    for field, kw, lo, hi, integer in _SAMPLING_FIELDS:
        v = _number(body, field, None, lo, hi, integer=integer)
        if v is not None:
            out[kw] = max(v, 0) if field == "top_k" else v  # top_k <= 0: the whole vocabulary
    if "repeat_penalty" in out and out["repeat_penalty"] == 0:
        raise bad_request("'repeat_penalty' must be > 0 (1.0: off)", "repeat_penalty")
    breakers = body.get("dry_sequence_breakers")
    if breakers is not None:
        if not (isinstance(breakers, list) and breakers and all(isinstance(b, str) and b for b in breakers)):
            raise bad_request("'dry_sequence_breakers' must be a non-empty list of non-empty strings",
                              "dry_sequence_breakers")
        out["dry_sequence_breakers"] = breakers
    for key, value in (("logit_bias", _logit_bias(body)), ("samplers", _samplers(body))):
        if value is not None:
            out[key] = value
    out.update(_constraint(body))
    return out


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
        if rule not in VERIFY_RULES:
            raise bad_request("'speculative.verify' must be 'rejection' or 'match'", "speculative.verify")
        out["verify"] = rule
    if "speculative.draft_positions" in body:
        mode = body["speculative.draft_positions"]
        if mode not in DRAFT_POSITION_MODES:
            raise bad_request("'speculative.draft_positions' must be 'target' or 'sequential'",
                              "speculative.draft_positions")
        out["draft_positions"] = mode
    return {k: v for k, v in out.items() if v is not None}


def _choices(body: dict, n_max: int) -> int:
    """OpenAI's n or llama-server's n_cmpl: at most one choice per slot (-np), as in llama-server."""
    name = "n_cmpl" if "n_cmpl" in body else "n"
    n = _number(body, name, 1, 1, 2**31 - 1, integer=True)
    if n > n_max:
        raise bad_request(f"'{name}' must be between 1 and {n_max} (each choice takes a slot: start the server "
                          f"with -np {n} or more), got {n}", name)
    return n


def _id_slot(body: dict, n_slots: int) -> int:
    """llama-server's id_slot: run on that slot (-1: any). llama-server wraps a number past the
    last slot around; an id that names no slot is a 400 here."""
    return _number(body, "id_slot", -1, -1, n_slots - 1, integer=True)


def parse_lora(value: Any, n_adapters: int, name: str = "lora") -> list[dict]:
    """llama-server's LoRA list (a request's ``lora`` field, POST /lora-adapters' body):
    [{"id": i, "scale": s}, ...] over the adapters loaded with --lora (one not listed runs at
    scale 0; a missing scale is 0, as there). An id that names no adapter, or a scale that is
    not a finite number, is a 400 here (llama-server skips the one and reads the other as 0)."""
    if not isinstance(value, list):
        raise bad_request(f"'{name}' must be an array of objects with 'id' and 'scale' fields", name)
    out = []
    for k, entry in enumerate(value):
        if not isinstance(entry, dict):
            raise bad_request(f"'{name}[{k}]' must be an object with 'id' and 'scale' fields", name)
        i, scale = entry.get("id"), entry.get("scale")
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_adapters:
            have = f"ids 0 to {n_adapters - 1}" if n_adapters else "none (start the server with --lora FILE)"
            raise bad_request(f"'{name}[{k}].id' {_show(i)} names no LoRA adapter; this server's adapters have "
                              f"{have} (GET /lora-adapters)", name)
        scale = 0.0 if scale is None else scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise bad_request(f"'{name}[{k}].scale' must be a finite number, got {_show(scale)}", name)
        out.append({"id": i, "scale": float(scale)})
    return out


def _lora(body: dict, n_adapters: int) -> dict:
    """The request's ``lora`` as an Engine keyword (none when absent: the global scales apply)."""
    return {} if body.get("lora") is None else {"lora": parse_lora(body["lora"], n_adapters)}


def _llama_fields(body: dict) -> tuple[ResponseOptions, dict]:
    """llama-server's fields beyond OpenAI's, on every generation route: the response options, and
    its line rules as Engine keywords (n_indent, t_max_predict_ms; absent or <= 0: off), with
    post_sampling_probs (the engine computes those probabilities)."""
    fields = body.get("response_fields")
    if not (isinstance(fields, list) and all(isinstance(f, str) for f in fields)):
        fields = []  # llama-server reads a value of another type as none given
    options = ResponseOptions(
        return_tokens=_bool(body, "return_tokens", False), return_progress=_bool(body, "return_progress", False),
        timings_per_token=_bool(body, "timings_per_token", False), response_fields=tuple(fields),
        post_sampling_probs=_bool(body, "post_sampling_probs", False), verbose=_bool(body, "verbose", False),
        n_keep=_number(body, "n_keep", 0, -1, 2**31 - 1, integer=True),
        n_discard=_number(body, "n_discard", 0, 0, 2**31 - 1, integer=True))
    args = {}
    n_indent = _number(body, "n_indent", 0, 0, 2**31 - 1, integer=True)
    t_max = _number(body, "t_max_predict_ms", 0, -1, 2**63 - 1, integer=True)
    if n_indent:
        args["n_indent"] = n_indent
    if t_max > 0:
        args["t_max_predict_ms"] = t_max
    if options.post_sampling_probs:
        args["post_sampling_probs"] = True
    return options, args


def _n_and_stream(body: dict) -> tuple[bool, bool]:
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
    n_max: int = 1  # most choices per request: the server's slots
    n_lora: int = 0  # LoRA adapters loaded (--lora): the ids a request's lora may name
    n_vocab: int = 2**31 - 1  # token ids a prompt may hold: 0 to n_vocab - 1
    max_prompts: int = 16  # prompts x choices per request: the server's queue (--max-queue)


def _content_parts(content: Any, where: str, limits: RequestLimits, images: list, budget: ImageBudget) -> Any:
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
            budget.take(1, "messages")
            data = decode_image_url(url, limits.images, f"{where}.content[{k}]", budget)
            images.append(data)
            parts.append({"type": "image", "image": data})
        else:
            raise bad_request(f"{where}.content[{k}] has unsupported type {_show(kind)} (use 'text' or 'image_url')",
                              f"{where}.content")
    return parts


def parse_chat(body: Any, limits: RequestLimits) -> GenerationRequest:
    """POST /v1/chat/completions."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    out, images, budget = [], [], ImageBudget(limits.images)
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object", "messages")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad_request(f"{where}.role must be system, developer, user, assistant or tool, got {_show(role)}",
                              "messages")
        extras = message_extras(m, where)  # tool_calls, tool_call_id, name, reasoning_content
        content = m.get("content")
        if role == "assistant" and "content" not in m and "tool_calls" not in m:
            raise bad_request(f"{where}: Assistant message must contain either 'content' or 'tool_calls'!", "messages")
        if content is None and role == "assistant":
            content = ""
        # developer stays developer: the template layer maps it to system (but for GPT-OSS's), as llama-server
        out.append({"role": role, "content": _content_parts(content, where, limits, images, budget), **extras})
    stream, include_usage = _n_and_stream(body)
    sampling = _sampling(body, limits.max_tokens, limits.default_max_tokens)
    if body.get("json_schema") is not None and body.get("grammar"):
        raise bad_request("Cannot use both json_schema and grammar", "grammar")
    # a response format is the chat template's to turn into a grammar (after the generation prompt,
    # with the template's reasoning); a grammar of the caller's stays the sampler's
    chat = chat_options(body, json_schema=sampling.pop("json_schema", None), grammar=sampling.get("grammar"))
    logprobs = _logprobs(body, chat=True)
    if logprobs is not None and stream and chat.tools:
        raise bad_request("logprobs is not supported with tools + stream", "logprobs")
    options, line_rules = _llama_fields(body)
    params = RequestOptions.of(messages=out, chat_options=chat, **sampling,
                               **_speculative(body, limits.draft_max, limits.draft_tree),
                               logprobs=logprobs, **_lora(body, limits.n_lora), **line_rules)
    return GenerationRequest("chat", stream, include_usage, params, len(images),
                             _choices(body, limits.n_max), _id_slot(body, limits.n_max), options=options)


def parse_completion(body: Any, limits: RequestLimits, *, llama_style: bool = False) -> GenerationRequest:
    """POST /v1/completions (OpenAI) or /completion (llama-server: n_predict, content). ``prompt``
    takes llama-server's shapes (server/prompts.py): text, token ids, both mixed, multimodal
    objects, or a list of prompts, each with its n choices."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if not llama_style:  # OpenAI's fields llama-server refuses on /v1/completions (its messages)
        if _bool(body, "echo", False):
            raise bad_request("Only no echo is supported", "echo")
        for name in ("best_of", "suffix"):
            if name in body:
                raise bad_request(f"Unsupported param: {name}", name)
    n = _choices(body, limits.n_max)
    prompts = parse_prompts(body.get("prompt"), n_vocab=limits.n_vocab, images=limits.images,
                            max_prompts=max(1, limits.max_prompts // n))
    if llama_style and "n_predict" in body:
        body = dict(body, max_tokens=None if body["n_predict"] == -1 else body["n_predict"])
    stream, include_usage = _n_and_stream(body)
    options, line_rules = _llama_fields(body)
    params = RequestOptions.of(**_sampling(body, limits.max_tokens, limits.default_max_tokens),
                               **_speculative(body, limits.draft_max, limits.draft_tree),
                               logprobs=_logprobs(body, chat=False), **_lora(body, limits.n_lora), **line_rules)
    n_images = sum(len(p.get("images", ())) for p in prompts)
    return GenerationRequest("llama" if llama_style else "completion", stream, include_usage, params,
                             n_images, n, _id_slot(body, limits.n_max), prompts=[params.replace(**p) for p in prompts],
                             options=options)
