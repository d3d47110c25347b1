"""A resolved ``Request`` made ready to run: its prompt rendered and tokenized, its images loaded,
its sampler and verifier made — a ``Generation`` (speculative/generation.py) — and, when it ends, its
native objects (bitmaps, sampler) freed.

    with PreparedGeneration(engine, request) as gen:   # the slot loop gives gen its sequence
        ...
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from pyllama_spec.bindings.mtmd import Bitmap
from pyllama_spec.bindings.sampler import Sampler
from pyllama_spec.serving.request import Request
from pyllama_spec.speculative.draft_length import AdaptiveLength, FixedLength
from pyllama_spec.speculative.generation import Generation
from pyllama_spec.speculative.logprobs import check_post_sampling
from pyllama_spec.speculative.stats import GenerationStats
from pyllama_spec.speculative.synthetic import SyntheticVerifier
from pyllama_spec.speculative.verify import MatchVerifier, RejectionVerifier


class EngineParts(Protocol):
    """What a generation is made from: the Engine's prompt parts, model, drafter and step cost."""

    prompts: Any  # serving.prompt_parts.PromptParts
    model: Any
    drafter: Any
    step_cost: Any
    last_stats: GenerationStats | None

    def single_tokens(self, texts) -> frozenset[int]: ...


class PreparedGeneration:
    """``with PreparedGeneration(engine, request) as gen``: see the module."""

    def __init__(self, engine: EngineParts, request: Request) -> None:
        self.engine, self.request = engine, request
        self._bitmaps: list[Bitmap] = []
        self._sampler: Sampler | None = None

    def __enter__(self) -> Generation:
        e, r = self.engine, self.request
        if not e.prompts.ctx.has_memory:  # llama-server refuses it too ("does not support logits computation")
            raise ValueError(f"{e.model.path.name} cannot generate text: it keeps no memory of a prompt (an "
                             "encoder such as BERT; load it with embeddings=True for Engine.embed)")
        try:
            text, image_list, chat = e.prompts.text_and_images(r.prompt)
            self._bitmaps = [Bitmap.load(im) for im in image_list]
            parts = e.prompts.tokenize(text, self._bitmaps)
            stats = GenerationStats(images=len(self._bitmaps), chat_template=chat.renderer if chat else None)
            e.last_stats = stats
            params, stop = r.sampling, list(r.output.stop)
            if r.ignore_eos:  # kept apart from the request's own bias, as llama-server's logit_bias_eog
                params = dataclasses.replace(params, logit_bias=(
                    *params.logit_bias, *((t, float("-inf")) for t in e.model.eog_tokens)))
            if chat is not None:  # the chat's grammar (else the caller's), its stop strings, its budget
                params = dataclasses.replace(params, **chat.sampling())
                stop = [*stop, *chat.additional_stops]
            o = r.output
            if o.post_sampling_probs and o.logprobs is not None:
                check_post_sampling(params)  # with a chat's constraint, rendered only now (messages=)
            self._sampler = Sampler(e.model, seed=r.seed, **dataclasses.asdict(params))
            # rejection sampling's numpy chain has no grammar or budget: a chat's constraint verifies by "match"
            rejection = r.draft.verify == "rejection" and not params.greedy and not params.chat_constrained
            if e.synthetic_probs:  # the benchmark mode: drafts kept at random (speculative/synthetic.py)
                verifier = SyntheticVerifier(self._sampler, e.synthetic_probs, r.seed, frozenset(e.model.eog_tokens))
            elif rejection:
                verifier = RejectionVerifier(params, r.seed, e.model.n_vocab)
            else:
                verifier = MatchVerifier(self._sampler)
            # One cost of a step per engine: its slots share each step, and requests share the hardware.
            if r.draft.n_max == "auto":
                length = AdaptiveLength(AdaptiveLength.START, e.drafter.n_max_limit, cost=e.step_cost)
            else:
                length = FixedLength(r.draft.n_max)
            return Generation(None, e.model, parts, verifier, stats, max_tokens=o.max_tokens,
                              stop=stop, draft_length=length, draft_min=r.draft.n_min,
                              cache_prompt=r.cache_prompt, progress=r.progress, draft_positions=r.draft.positions,
                              draft_tree=r.draft.tree, logprobs=o.logprobs, n_indent=o.n_indent,
                              t_max_predict_ms=o.t_max_predict_ms,
                              special_tokens=e.single_tokens(params.preserved_tokens),
                              post_sampling=params if o.post_sampling_probs else None)
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc) -> None:
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None
        for b in self._bitmaps:
            b.close()
        self._bitmaps = []
