"""llama-server's response fields for /completion (and /infill), field for field, with the request
options that shape them (schema.ResponseOptions): the final body (``to_json_non_oaicompat`` in
tools/server/server-task.cpp), a streamed chunk, ``generation_settings`` (``task_params::to_json``),
the ``prompt_progress`` events of ``return_progress``, and the ``response_fields`` filter.

Where this differs from llama-server:
* a progress event's ``tokens`` is ``[]`` (llama-server sends ``[0]``, a token it never sampled),
  and it carries no ``timings`` (the prompt's timings come with the first token);
* ``generation_settings`` describes this server: the sampling values as given (not rounded to
  float32), ``speculative.types`` this server's method, ``reasoning_format`` "none" (no reasoning is
  parsed out), ``n_predict`` the limit that applies (llama-server writes -1 for none; here there is
  always one, ``--n-predict`` or the server's default);
* a streamed chunk holds the tokens of one speculative step (llama-server: one token a chunk), with
  the step's ``pyllama_spec`` extension, also a token whose text is held back (half a character;
  llama-server streams no chunk for it);
* ``post_sampling_probs``: at temperature 0 the pick has probability 1 (as llama-server reports
  it); above, the probabilities come from the numpy copy of the sampler chain on each emitted
  token's own target row (speculative/logprobs.py), drafted tokens' too (llama-server lists none
  for the tokens of a speculative step), the penalties seeing the tokens generated before each, as
  this server's sampler does; a setting that copy does not apply
  (a grammar or JSON schema, mirostat, DRY, XTC, typical-p, top-n-sigma, dynamic temperature, another
  sampler order) is a 400 naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from pyllama_spec.server.schema import ResponseOptions
from pyllama_spec.serving.request import Request


def generation_params(service, request: Request, stream: bool) -> dict:
    """A generation's settings (its resolved ``request``: what it gave, else the server's defaults,
    its command line, else llama-server's) in llama-server's shape (its /slots ``params``, /props
    ``default_generation_settings.params``; task_params::to_json). Plain Python (no native call)."""
    sp, max_tokens = request.sampling, request.output.max_tokens
    return {
        "seed": request.seed, "temperature": sp.temperature, "dynatemp_range": sp.dynatemp_range,
        "dynatemp_exponent": sp.dynatemp_exponent, "top_k": sp.top_k, "top_p": sp.top_p,
        "min_p": sp.min_p, "top_n_sigma": sp.top_n_sigma, "xtc_probability": sp.xtc_probability,
        "xtc_threshold": sp.xtc_threshold, "typical_p": sp.typical_p, "repeat_last_n": sp.penalty_last_n,
        "repeat_penalty": sp.repeat_penalty, "presence_penalty": sp.presence_penalty,
        "frequency_penalty": sp.frequency_penalty, "dry_multiplier": sp.dry_multiplier,
        "dry_base": sp.dry_base, "dry_allowed_length": sp.dry_allowed_length,
        "dry_penalty_last_n": sp.dry_penalty_last_n, "mirostat": sp.mirostat,
        "mirostat_tau": sp.mirostat_tau, "mirostat_eta": sp.mirostat_eta,
        "max_tokens": max_tokens, "n_predict": max_tokens, "n_keep": 0, "n_discard": 0,
        "ignore_eos": request.ignore_eos, "stream": stream,
        "n_probs": request.output.logprobs or 0, "min_keep": sp.min_keep, "samplers": list(sp.samplers),
        "speculative.types": service.engine.config.spec_type, "lora": [],
    }


def generation_settings(service, request: Request, *, stream: bool, options: ResponseOptions) -> dict:
    """llama-server's ``generation_settings`` of one generation (its resolved ``request``): the
    fields /slots shows as its ``params`` (``generation_params``, the same task_params::to_json),
    and those only the final body has."""
    sp = request.sampling
    pairs = list(sp.logit_bias)
    if request.ignore_eos:  # the end-of-generation tokens forbidden, listed after the request's own (llama-server)
        pairs += [(t, float("-inf")) for t in service.engine.model.eog_tokens]
    # -inf (a forbidden token) is written as null, as llama-server's JSON writer does
    bias = [{"bias": None if b == float("-inf") else float(b), "token": int(t)} for t, b in pairs]
    out = generation_params(service, request, stream)
    out.update({
        "dry_sequence_breakers": list(sp.dry_sequence_breakers),
        "adaptive_target": -1.0, "adaptive_decay": 0.9,  # llama-server's adaptive sampler: not here
        "stop": list(request.output.stop), "n_keep": options.n_keep, "n_discard": options.n_discard,
        "logit_bias": bias, "grammar": sp.grammar or "", "grammar_lazy": False, "grammar_triggers": [],
        "preserved_tokens": [], "chat_format": "Content-only", "reasoning_format": "none",
        "reasoning_in_content": False, "generation_prompt": "", "timings_per_token": options.timings_per_token,
        "post_sampling_probs": options.post_sampling_probs, "backend_sampling": False,
        "lora": [] if request.lora is None else [{"id": i, "scale": s} for i, s in enumerate(request.lora)],
    })
    return out


def select_fields(paths: tuple[str, ...], body: dict) -> dict:
    """llama-server's ``response_fields``: only those fields, each under its path ("a/b" reads b in
    a, and is named "a/b"); a path that names nothing is left out. No paths: the whole body."""
    if not paths:
        return body
    out = {}
    for path in paths:
        value, found = body, True
        for key in path.split("/"):
            if isinstance(value, dict) and key in value:
                value = value[key]
            else:
                found = False
                break
        if found:
            out[path] = value
    return out


def wants(paths: tuple[str, ...], field: str) -> bool:
    """Whether the final body's ``field`` survives the ``response_fields`` filter."""
    return not paths or any(p == field or p.startswith(field + "/") for p in paths)


def prompt_text(model, arrays: tuple) -> str:
    """llama-server's ``prompt``: the prompt's text tokens (media left out) detokenized, special
    tokens written out. Native work linear in the prompt: the caller runs a long one on a thread."""
    if not arrays:
        return ""
    return model.detokenize(np.concatenate(arrays), special=True)


@dataclasses.dataclass
class FinalFields:
    """What a generation's final body says beyond its stats, gathered by the route."""

    index: int
    content: str
    tokens: list
    id_slot: Any
    model: str
    prompt: str
    has_new_line: bool
    settings: dict


def final_body(f: FinalFields, last, timings: dict) -> dict:
    """The final /completion body (``last`` the generation's last piece), in llama-server's order;
    the caller adds ``completion_probabilities`` and applies ``response_fields``."""
    stats, ending = last.stats, last.ending
    return {"index": f.index, "content": f.content, "tokens": f.tokens, "id_slot": f.id_slot, "stop": True,
            "model": f.model, "tokens_predicted": stats.generated_tokens, "tokens_evaluated": stats.prompt_tokens,
            "generation_settings": f.settings, "prompt": f.prompt, "has_new_line": f.has_new_line,
            "truncated": ending.truncated, "stop_type": ending.stop_type, "stopping_word": ending.stopping_word,
            "tokens_cached": ending.cache_rows, "timings": timings}


class Progress:
    """One generation's ``prompt_progress`` (llama-server's return_progress), from the engine's
    progress events: ("cache", rows reused, rows in all, t), then ("prefill", rows decoded, rows
    to decode, t) after each batch."""

    def __init__(self) -> None:
        self.total = self.cache = 0
        self.t0: float | None = None

    def event(self, value) -> dict:
        stage, done, total, t = value
        if stage == "cache" or self.t0 is None:
            self.t0 = t
        if stage == "cache":
            self.cache, self.total = done, total
            processed = done
        else:
            processed = self.cache + done
        return {"total": self.total, "cache": self.cache, "processed": processed,
                "time_ms": int((t - self.t0) * 1000)}
