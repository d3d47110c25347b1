"""The one place a request is checked and given the engine's defaults: ``RequestOptions`` (what a
caller gave) in, ``Request`` (serving/request.py) out, before anything runs.

As llama-server's ``params_from_json_cmpl``: a setting the request leaves out takes the engine's
(its command line's ``--temp``, ``--draft-max``, ...), then llama.cpp's; a value out of range is a
``ValueError`` (or ``TypeError`` for a setting that does not exist) naming it. A ``json_schema``
becomes its grammar here, once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from pyllama_spec.serving.config import EngineConfig, check_tree_settings
from pyllama_spec.serving.chat_template import ChatOptions, ChatParams, as_list
from pyllama_spec.serving.request import DraftSettings, OutputOptions, PromptInput, Request, RequestOptions
from pyllama_spec.speculative.logprobs import check_post_sampling
from pyllama_spec.speculative.positions import DRAFT_POSITION_MODES
from pyllama_spec.speculative.sampling import MAX_TOP_LOGPROBS, sampling_params
from pyllama_spec.speculative.verify import VERIFY_RULES


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    """What a request is checked against: the engine's vocabulary, context share and drafter."""

    n_vocab: int
    n_ctx_seq: int  # one slot's share of the context
    has_drafter: bool
    draft_n_max: int  # the engine's draft length (0 without a drafter)
    draft_n_min: int
    draft_n_max_limit: int  # the most the drafter can draft in one step (0 without one)


class RequestResolver:
    """Resolves ``RequestOptions`` into a ``Request`` for one engine (see the module).

    ``lora_scales`` turns a request's ``lora`` list into a scale per adapter (serving/lora.py);
    ``grammar_of_schema`` is llama.cpp's json-schema-to-grammar (bindings/grammar.py).
    """

    def __init__(self, config: EngineConfig, limits: EngineLimits, *, lora_scales: Callable[[Any], tuple],
                 grammar_of_schema: Callable[[Any], str]) -> None:
        self.config, self.limits = config, limits
        self._lora_scales, self._grammar_of_schema = lora_scales, grammar_of_schema
        # The engine's own sampling defaults; a default json_schema (llama-server's --json-schema) is
        # turned into its grammar once, here, not for every request.
        self._defaults = dict(config.sampling)
        if self._defaults.get("json_schema") is not None and not self._defaults.get("grammar"):
            try:
                self._defaults["grammar"] = grammar_of_schema(self._defaults.pop("json_schema"))
            except ValueError as e:
                raise ValueError(f"the sampling defaults are not valid: {e}") from None

    def resolve(self, o: RequestOptions) -> Request:
        """``o`` checked (before anything runs) and completed with the engine's defaults."""
        cfg = self.config
        max_tokens = o.max_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {max_tokens!r}")
        prompt = self._prompt(o)
        draft = self._draft(o)
        defaults = dict(self._defaults)  # the engine's (llama-server's --temp, ...), then the call's
        default_seed = defaults.pop("seed", 0)
        seed = default_seed if o.seed is None else o.seed
        sampling = dict(o.sampling)
        if sampling.get("grammar") or sampling.get("json_schema"):
            defaults.pop("grammar", None), defaults.pop("json_schema", None)  # the call's constraint replaces it
        sampling = {**defaults, **sampling}
        ignore_eos = bool(sampling.pop("ignore_eos", False))
        schema = sampling.pop("json_schema", None)
        if schema is not None:  # llama-server: json_schema gives the grammar unless one is given too
            if sampling.get("grammar"):
                raise ValueError("give grammar= or json_schema=, not both")
            sampling["grammar"] = self._grammar_of_schema(schema)
        params = sampling_params(sampling, n_ctx=self.limits.n_ctx_seq, n_vocab=self.limits.n_vocab)
        if draft.verify == "rejection" and not params.greedy and params.rejection_unsupported():
            raise ValueError(f"verify='rejection' applies logit bias, penalties, top-k, top-p, min-p and temperature "
                             f"in llama.cpp's order; this request also sets "
                             f"{', '.join(params.rejection_unsupported())}: use verify='match' (the default)")
        if draft.tree:  # greedy decoding verifies by "match" whatever the rule
            check_tree_settings(draft.n_max, draft.verify if not params.greedy else "match")
        logprobs = o.logprobs
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, (int, np.integer))
                                     or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS} (the most likely tokens "
                             f"listed at each position), got {logprobs!r}")
        if not isinstance(o.post_sampling_probs, bool):
            raise ValueError(f"post_sampling_probs must be a boolean, got {o.post_sampling_probs!r}")
        if o.post_sampling_probs and logprobs is not None:  # a chat rendered already brings its constraint
            check_post_sampling(dataclasses.replace(params, **o.chat.sampling()) if isinstance(o.chat, ChatParams)
                                else params)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        for name, v in (("n_indent", o.n_indent), ("t_max_predict_ms", o.t_max_predict_ms)):
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer)) or not v >= 0:
                raise ValueError(f"{name} must be a number >= 0 (0: off), got {v!r}")
        output = OutputOptions(max_tokens=int(max_tokens), stop=(o.stop,) if isinstance(o.stop, str) else tuple(o.stop),
                               logprobs=None if logprobs is None else int(logprobs), n_indent=int(o.n_indent),
                               t_max_predict_ms=float(o.t_max_predict_ms), post_sampling_probs=o.post_sampling_probs)
        return Request(prompt=prompt, sampling=params, seed=int(seed), draft=draft, output=output,
                       cache_prompt=o.cache_prompt, lora=None if o.lora is None else self._lora_scales(o.lora),
                       progress=o.progress, ignore_eos=ignore_eos, resolved_by=self)

    # ------------------------------------------------------------------ parts
    def _prompt(self, o: RequestOptions) -> PromptInput:
        if (o.prompt is not None) + (o.messages is not None) + (o.chat is not None) != 1:
            raise ValueError("give exactly one of prompt=, messages= or chat=")
        if o.chat is not None and not isinstance(o.chat, ChatParams):
            raise ValueError(f"chat must be what chat_params() renders, got {type(o.chat).__name__}")
        chat_options = o.chat_options
        if chat_options is not None and not isinstance(chat_options, ChatOptions):
            raise ValueError(f"chat_options must be a ChatOptions, got {type(chat_options).__name__}")
        if o.chat_template_kwargs:
            chat_options = dataclasses.replace(chat_options or ChatOptions(), template_kwargs={
                **((chat_options.template_kwargs or {}) if chat_options else {}), **o.chat_template_kwargs})
        text = o.prompt
        if text is not None and not isinstance(text, str):
            text = self._mixed_prompt(text, o.images)
        return PromptInput(text=text, messages=o.messages, chat=o.chat, images=tuple(as_list(o.images)),
                           chat_options=chat_options)

    def _draft(self, o: RequestOptions) -> DraftSettings:
        """The call's draft settings, checked against what this engine can do."""
        cfg, lim = self.config, self.limits
        has_drafter = lim.has_drafter
        if o.draft_max == "auto" and not has_drafter:
            raise ValueError('draft_max="auto" needs a drafter (spec_type other than "none")')
        engine_max = ("auto" if cfg.draft_max == "auto" else lim.draft_n_max) if has_drafter else 0
        n_max = engine_max if o.draft_max is None else o.draft_max
        n_min = lim.draft_n_min if o.draft_min is None else o.draft_min
        for name, v in (("draft_max", n_max), ("draft_min", n_min)):
            if v == "auto" and name == "draft_max":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        if n_max != "auto":
            if n_max > lim.draft_n_max_limit:
                raise ValueError(f"draft_max {n_max} is above what this engine can draft ({lim.draft_n_max_limit}"
                                 + (": no draft model)" if not has_drafter else ": the draft's block size or the "
                                    "target's rollback depth)"))
            if n_min > n_max:
                raise ValueError(f"draft_min {n_min} is above draft_max {n_max}")
            n_max = int(n_max)
        mode = o.draft_positions or cfg.draft_positions
        if mode not in DRAFT_POSITION_MODES:
            raise ValueError(f"draft_positions must be 'target' or 'sequential', got {mode!r}")
        verify = o.verify or cfg.verify
        if verify not in VERIFY_RULES:
            raise ValueError(f"verify must be one of {VERIFY_RULES}, got {verify!r}")
        tree = cfg.draft_tree if o.draft_tree is None else o.draft_tree
        if isinstance(tree, bool) or not isinstance(tree, (int, np.integer)) or not 0 <= tree <= cfg.draft_tree:
            raise ValueError(f"draft_tree must be an integer from 0 to the engine's draft_tree "
                             f"({cfg.draft_tree}; load with draft_tree=N for trees), got {o.draft_tree!r}")
        return DraftSettings(n_max=n_max, n_min=int(n_min), positions=mode, tree=int(tree), verify=verify)

    def _mixed_prompt(self, prompt, images) -> tuple:
        """llama-server's prompt of token ids, or of ids mixed with strings, checked: a tuple of
        strings and int32 arrays (each run of ids one array)."""
        if as_list(images):
            raise ValueError("a prompt of token ids takes no images: give its text with MEDIA_MARKER")
        items = (prompt,) if isinstance(prompt, np.ndarray) else tuple(prompt)
        n_vocab, out, run = self.limits.n_vocab, [], []
        for x in (*items, ""):  # "" ends the last run of ids
            if isinstance(x, (str, np.ndarray)) and run:
                out.append(np.asarray(run, dtype=np.int64))
                run = []
            if isinstance(x, str):
                out.append(x)
            elif isinstance(x, np.ndarray) and x.ndim == 1 and (x.dtype.kind in "iu" or not len(x)):
                out.append(x.astype(np.int64))
            elif isinstance(x, (int, np.integer)) and not isinstance(x, bool):
                run.append(int(x))
            else:
                raise ValueError(f"a prompt list holds token ids and strings only, got {type(x).__name__}")
        for a in out:
            if isinstance(a, np.ndarray) and len(a) and (a.min() < 0 or a.max() >= n_vocab):
                bad = a[(a < 0) | (a >= n_vocab)][0]
                raise ValueError(f"the prompt holds token id {bad}, outside the vocabulary (0 to {n_vocab - 1})")
        return tuple(a.astype(np.int32) if isinstance(a, np.ndarray) else a for a in out[:-1])
