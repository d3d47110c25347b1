"""A llama.cpp sampler chain over a Model's vocabulary, built as llama-server builds one.

The chain: logit bias -> grammar -> the samplers in the order asked (llama-server's
``samplers``: penalties, dry, top_n_sigma, top_k, typ_p, top_p, min_p, xtc, temperature) ->
the pick (a seeded draw; mirostat 1/2 after the temperature; the most likely token when the
temperature is 0). The grammar comes first (llama-server's "grammar first"), so a token it
forbids is never drawn; it sees every token the chain accepts, so its state follows exactly
the tokens of the output. Settings are ``spec.sampling.SamplingParams``' fields, as keywords.

A chat's constraint takes the grammar's place (the shim's pyllama_sampler_init_chat_constraint,
common_sampler's logic): a lazy grammar that applies from its first trigger on, a chat's grammar
that starts with the generation prompt already seen, and the reasoning budget, which forces the
end of thinking when it runs out (a lazy grammar sees no token while the model thinks).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Sequence

from pyllama_spec._native import ffi, lib
from pyllama_spec.bindings.grammar import GrammarError, _last_error, check_grammar
from pyllama_spec.bindings.handle import NativeHandle
from pyllama_spec.errors import forget_native_problems, with_native_log

if TYPE_CHECKING:
    from pyllama_spec.bindings.context import Context
    from pyllama_spec.bindings.model import Model

_DEFAULT_ORDER = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")


class Sampler(NativeHandle):
    """llama.cpp's sampler chain (see the module's doc); ``greedy`` when the temperature is <= 0."""

    _what = "sampler"

    def __init__(self, model: Model, *, temperature: float = 0.0, top_k: int = 40, top_p: float = 0.95,
                 min_p: float = 0.05, typical_p: float = 1.0, top_n_sigma: float = -1.0,
                 xtc_probability: float = 0.0, xtc_threshold: float = 0.1, repeat_penalty: float = 1.0,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0, penalty_last_n: int = 64,
                 dry_multiplier: float = 0.0, dry_base: float = 1.75, dry_allowed_length: int = 2,
                 dry_penalty_last_n: int = 64, dry_sequence_breakers: Sequence[str] = ("\n", ":", '"', "*"),
                 dynatemp_range: float = 0.0, dynatemp_exponent: float = 1.0, mirostat: int = 0,
                 mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, min_keep: int = 0,
                 logit_bias: Sequence[tuple[int, float]] = (), samplers: Sequence[str] = _DEFAULT_ORDER,
                 grammar: str | None = None, grammar_lazy: bool = False,
                 grammar_triggers: Sequence[tuple[int, str]] = (), preserved_tokens: Sequence[str] = (),
                 grammar_type: str = "user", generation_prompt: str = "", reasoning_budget_tokens: int = -1,
                 reasoning_budget_start: str = "", reasoning_budget_end: Sequence[str] = (),
                 reasoning_budget_message: str = "", seed: int = 0) -> None:
        self.temperature = temperature
        seed &= 0xFFFFFFFF
        n_vocab = model.n_vocab
        self._ptr = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        add = self._add
        if logit_bias:
            biases = ffi.new("llama_logit_bias[]", len(logit_bias))
            for i, (token, bias) in enumerate(logit_bias):
                biases[i].token, biases[i].bias = int(token), float(bias)
            add(lib.llama_sampler_init_logit_bias(n_vocab, len(logit_bias), biases))
        chat = _chat_constraint_spec(grammar, grammar_lazy, grammar_triggers, preserved_tokens, grammar_type,
                                     generation_prompt, reasoning_budget_tokens, reasoning_budget_start,
                                     reasoning_budget_end, reasoning_budget_message)
        if chat is not None:
            if grammar is not None:
                try:
                    check_grammar(grammar, n_vocab)
                except GrammarError:
                    self.close()
                    raise
            forget_native_problems()
            c = lib.pyllama_sampler_init_chat_constraint(model._vocab_ptr(), json.dumps(chat).encode())
            if c == ffi.NULL:
                reason = _last_error()
                if reason:  # (an empty reason: the budget is off and there is no grammar)
                    self.close()
                    raise GrammarError(with_native_log(f"llama.cpp refused the chat's constraint: {reason}"))
            else:
                add(c)
        elif grammar is not None:
            try:
                check_grammar(grammar, n_vocab)  # the parser's reason, which llama_sampler_init_grammar only prints
            except GrammarError:
                self.close()
                raise
            forget_native_problems()
            g = lib.llama_sampler_init_grammar(model._vocab_ptr(), grammar.encode(), b"root")
            if g == ffi.NULL:  # parsed, but refused (left recursion): the native log says which rule
                self.close()
                raise GrammarError(with_native_log("llama.cpp refused the grammar"))
            add(g)
        greedy = temperature <= 0.0
        for name in samplers:
            if name == "penalties":
                if (repeat_penalty != 1.0 or frequency_penalty or presence_penalty) and penalty_last_n != 0:
                    add(lib.llama_sampler_init_penalties(n_vocab, penalty_last_n, repeat_penalty,
                                                         frequency_penalty, presence_penalty))
            elif name == "dry":
                if dry_multiplier > 0 and dry_penalty_last_n != 0:
                    breakers = [ffi.new("char[]", b.encode()) for b in dry_sequence_breakers]
                    add(lib.llama_sampler_init_dry(model._vocab_ptr(), dry_multiplier, dry_base, dry_allowed_length,
                                                   dry_penalty_last_n, ffi.new("const char *[]", breakers),
                                                   len(breakers)))
            elif greedy:
                continue  # the filters below keep the most likely token; the pick is it
            elif name == "top_n_sigma":
                if top_n_sigma > 0:
                    add(lib.llama_sampler_init_top_n_sigma(top_n_sigma))
            elif name == "top_k":
                if top_k > 0:
                    add(lib.llama_sampler_init_top_k(top_k))
            elif name == "typ_p":
                if typical_p < 1.0:
                    add(lib.llama_sampler_init_typical(typical_p, min_keep))
            elif name == "top_p":
                if top_p < 1.0:
                    add(lib.llama_sampler_init_top_p(top_p, max(min_keep, 1)))
            elif name == "min_p":
                if min_p > 0.0:
                    add(lib.llama_sampler_init_min_p(min_p, max(min_keep, 1)))
            elif name == "xtc":
                if xtc_probability > 0 and xtc_threshold <= 0.5:
                    add(lib.llama_sampler_init_xtc(xtc_probability, xtc_threshold, min_keep, seed))
            elif name == "temperature":
                if mirostat == 0:
                    add(lib.llama_sampler_init_temp_ext(temperature, dynatemp_range, dynatemp_exponent))
            else:
                self.close()
                raise ValueError(f"unknown sampler {name!r}; use {', '.join(_DEFAULT_ORDER)}")
        if greedy:
            add(lib.llama_sampler_init_greedy())
        elif mirostat == 1:
            add(lib.llama_sampler_init_temp(temperature))
            add(lib.llama_sampler_init_mirostat(n_vocab, seed, mirostat_tau, mirostat_eta, 100))
        elif mirostat == 2:
            add(lib.llama_sampler_init_temp(temperature))
            add(lib.llama_sampler_init_mirostat_v2(seed, mirostat_tau, mirostat_eta))
        else:
            add(lib.llama_sampler_init_dist(seed))

    def _add(self, smpl) -> None:
        lib.llama_sampler_chain_add(self._ptr, smpl)  # the chain owns it from here

    def _free(self, ptr) -> None:
        lib.llama_sampler_free(ptr)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def sample(self, ctx: Context, i: int = -1) -> int:
        """Sample from output row i of ctx's last decode (and accept the token). GrammarError when
        the grammar allows no token there (every candidate forbidden, e.g. by a logit bias)."""
        token = lib.pyllama_sampler_sample(self.ptr, ctx.ptr, i)
        if token < 0:
            raise GrammarError(f"sampling failed: {_last_error()}")
        return int(token)

    def accept(self, token: int) -> None:
        if lib.pyllama_sampler_accept(self.ptr, token) != 0:
            raise GrammarError(f"token {token} cannot be accepted: {_last_error()}")

    def reset(self) -> None:
        lib.llama_sampler_reset(self.ptr)


def _chat_constraint_spec(grammar, lazy, triggers, preserved, grammar_type, generation_prompt, budget_tokens,
                          budget_start, budget_end, budget_message) -> dict | None:
    """The shim's spec of a chat's constraint (pyllama_sampler_init_chat_constraint), or None when
    the plain grammar sampler (or none) does: a lazy grammar, a chat's grammar that starts after the
    generation prompt, or a reasoning budget with its tags."""
    prefill = grammar_type != "user"
    budget = bool(budget_start and budget_end)
    if not (grammar is not None and (lazy or prefill)) and not budget:
        return None
    spec = {"grammar": grammar or "", "lazy": bool(lazy), "preserved_tokens": list(preserved),
            "triggers": [{"type": int(t), "value": v} for t, v in triggers], "generation_prompt": generation_prompt,
            "prefill_grammar": prefill, "reasoning_budget": None}
    if budget:
        spec["reasoning_budget"] = {"tokens": int(budget_tokens), "start": budget_start, "end": list(budget_end),
                                    "message": budget_message}
    return spec
