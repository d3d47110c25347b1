"""The Engine: loads a target, its projector and the speculative method's drafter (chosen from
the drafter registry, drafters/registry.py), checks everything it can before allocating, and
runs generations in its slots (serving/slot_loop.py), one or many.

>>> import pyllama_spec as ps                                       # doctest: +SKIP
>>> em = ps.embedded_models()
>>> with ps.load(model=em.target, mmproj=em.mmproj, draft=em.draft) as engine:
...     result = engine.generate("def fibonacci(n):\n    if n", max_tokens=32)
...     print(result.text, result.stats.acceptance_rate)

A request's way through it: its keywords (or a server's fields) as ``RequestOptions``, resolved
once against the engine's defaults into a ``Request`` (serving/resolver.py); made ready to run
(serving/prepared.py: the prompt rendered and tokenized with the fit check, serving/prompt_parts.py;
its sampler); then run by the slot loop, step by step, as speculative/generation.py's prefill and step read:
1. prefill the prompt chunk by chunk (text at consecutive positions from ``pos_next``;
   images encoded, then decoded in ``n_batch`` slices with their M-RoPE positions),
   showing every decoded batch to the drafter;
2. sample the first token; then repeat: draft up to ``draft_max`` tokens at ``pos_next``,
   verify ``[id_last, d1..dk]`` on the target, accept the longest prefix the target's
   sampler agrees with plus the target's own next token, show the verify batch to the
   drafter, remove rejected rows from both memories and advance ``pos_next``.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import warnings
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from pyllama_spec.bindings.context import Context
from pyllama_spec.bindings.heap import give_back_freed_pages
from pyllama_spec.bindings.model import Model
from pyllama_spec.bindings.mtmd import Projector
from pyllama_spec.drafters import Drafter
from pyllama_spec.drafters.chain import ChainDrafter
from pyllama_spec.drafters.registry import DrafterSetup, Pairing, method, methods, ngram_limit
from pyllama_spec.serving.config import EngineConfig, LoadOptions
from pyllama_spec.serving.embeddings import Embedding, EmbeddingInput, EmbeddingJob, Rank
from pyllama_spec.serving.grammars import json_schema_to_grammar
from pyllama_spec.serving.load_plan import plan_drafts, plan_load
from pyllama_spec.serving.lora import EngineAdapters, lora_specs
from pyllama_spec.serving.prepared import PreparedGeneration
from pyllama_spec.serving.chat_template import ChatOptions, ChatParams, ChatRenderer, ChatSettings
from pyllama_spec.serving.prompt_cache import PromptCache
from pyllama_spec.serving.prompt_parts import PromptParts
from pyllama_spec.serving.request import Request, RequestOptions
from pyllama_spec.serving.resolver import EngineLimits, RequestResolver
from pyllama_spec.serving.slot_loop import SlotLoop, Submission
from pyllama_spec.speculative.draft_length import StepCost
from pyllama_spec.speculative.generation import Piece, ProgressCallback, Result
from pyllama_spec.speculative.media import check_draft_projector
from pyllama_spec.speculative.positions import SequencePositions
from pyllama_spec.speculative import sequence
from pyllama_spec.speculative.stats import GenerationStats
from pyllama_spec.speculative.synthetic import conditional_probabilities, synthetic_rates

if TYPE_CHECKING:  # (typing.Unpack from Python 3.11; the annotations are strings at run time)
    from typing_extensions import Unpack

__all__ = ["Engine", "EngineConfig", "Piece", "Result", "load", "ProgressCallback"]


def load(model: str | os.PathLike, mmproj: str | os.PathLike | None = None,
         draft: str | os.PathLike | None = None, spec_type: str | None = None,
         **kwargs: Unpack[LoadOptions]) -> "Engine":
    """Load a target (with an optional mmproj and DFlash draft) and return an Engine.

    ``spec_type`` (llama.cpp's names): "draft-dflash" (also "dflash"; the default when a
    draft is given), "draft-dspark" (a DFlash draft with a Markov head), "draft-eagle3",
    "draft-simple" (a small model with the target's vocabulary as the draft), "draft-mtp" (the
    target's own multi-token-prediction head, Qwen3.5's nextn block: no draft model), the n-gram
    types "ngram-simple" (prompt lookup), "ngram-map-k", "ngram-map-k4v", "ngram-mod" and
    "ngram-cache" (llama.cpp's, their settings in ``ngram={...}``), "draft-python" (a function of
    yours, ``draft_callable=``), "none" (target only), or a comma list (llama-server's
    "ngram-mod,draft-mtp": the n-gram types tried first).
    ``mmproj_draft``: the draft model's own projector, for a draft-simple draft that is a small VLM
    (the default spec_type then): the draft sees every picture through it (drafters/draft_model.py).
    Other keywords are EngineConfig's, named as in llama.cpp: n_ctx, n_batch, n_ubatch,
    n_gpu_layers, draft_max, draft_min, draft_p_min, flash_attn, n_threads,
    draft_positions ("target" or "sequential"); where layers go: rpc_servers (["host:port", ...]),
    devices, device_draft, split_mode, tensor_split, main_gpu, draft_n_gpu_layers (also
    n_gpu_layers_draft); LoRA adapters of the target (llama-server's --lora / --lora-scaled):
    lora ([path or (path, scale), ...]) and lora_init_without_apply (serving/lora.py).
    Without ``spec_type``, the files given choose it (drafters/registry.py ``default_spec_type``).
    ``verbose=True`` prints llama.cpp's log to standard error, as llama-cpp-python's does.
    ``help(load)`` and ``inspect.signature(load)`` list every keyword with its default.
    """
    if kwargs.pop("verbose", False):
        from pyllama_spec.bindings.native_info import echo_log_to_stderr

        echo_log_to_stderr()
    if kwargs.get("mmproj_draft"):
        kwargs["mmproj_draft"] = os.fspath(kwargs["mmproj_draft"])
    if "n_gpu_layers_draft" in kwargs:  # llama.cpp's name (-ngld) for draft_n_gpu_layers
        ngld = kwargs.pop("n_gpu_layers_draft")
        if kwargs.get("draft_n_gpu_layers", ngld) != ngld:
            raise ValueError("n_gpu_layers_draft and draft_n_gpu_layers are one setting: give one of them")
        kwargs["draft_n_gpu_layers"] = ngld
    cfg = EngineConfig(model=os.fspath(model), mmproj=os.fspath(mmproj) if mmproj else None,
                       draft=os.fspath(draft) if draft else None, spec_type=spec_type, **kwargs)
    return Engine(cfg)


def _load_signature() -> inspect.Signature:
    """load()'s signature as help() and editors that read it show it: its four arguments, then every
    EngineConfig setting as a keyword with its default, then ``verbose``."""
    head = list(inspect.signature(load).parameters.values())[:4]
    settings = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=f.type,
                                  default=f.default if f.default is not dataclasses.MISSING else f.default_factory())
                for f in dataclasses.fields(EngineConfig) if f.name not in ("model", "mmproj", "draft", "spec_type")]
    extra = [inspect.Parameter("n_gpu_layers_draft", inspect.Parameter.KEYWORD_ONLY, default=None,
                               annotation="int | None"),
             inspect.Parameter("verbose", inspect.Parameter.KEYWORD_ONLY, default=False, annotation="bool")]
    return inspect.Signature([*head, *settings, *extra], return_annotation="Engine")


load.__signature__ = _load_signature()


def _chat_settings(c: EngineConfig) -> ChatSettings:
    """The chat settings of an engine's configuration (llama-server's chat flags)."""
    return ChatSettings(template=c.chat_template, jinja=c.jinja, template_kwargs=dict(c.chat_template_kwargs),
                        reasoning=c.reasoning, reasoning_format=c.reasoning_format, reasoning_budget=c.reasoning_budget,
                        reasoning_budget_message=c.reasoning_budget_message, reasoning_effort=c.reasoning_effort,
                        reasoning_preserve=c.reasoning_preserve, prefill_assistant=c.prefill_assistant,
                        skip_chat_parsing=c.skip_chat_parsing)



class Engine:
    """Target + optional projector + optional drafter, and the slots that run its generations.

    With ``n_parallel=1`` (the default) it holds one sequence, and a generation runs on the
    thread that reads its stream, step by step as the stream is read. Safe to share between
    threads: a call made while another thread's generation holds the slot waits for it to
    finish. On one thread, starting a generation while a ``stream()`` is suspended cancels that
    stream: resuming it raises ``GenerationCancelledError`` instead of continuing on a cache that
    changed under it.

    With ``n_parallel=N > 1`` it holds N sequences (slots), and the slot loop's thread runs up to
    N generations at once, verifying every active slot's draft in one target batch:
    ``submit()`` starts one and returns its handle; ``stream()`` and ``generate()`` go
    through it too, so threads calling them run concurrently.
    """

    def __init__(self, config: EngineConfig) -> None:
        # EngineConfig's own checks (serving/config.py), once; spec_type in llama.cpp's name
        config = dataclasses.replace(config.checked(), lora=lora_specs(config.lora))
        #: The speculative method's registry entry (drafters/registry.py); None for spec_type "none".
        self.method = method(config.spec_type)
        self.config = config
        self._loop: SlotLoop | None = None
        self._step_cost = StepCost()  # what a speculative step costs here (draft_length.py)
        #: The stats of the latest generation, also while it runs and after it was interrupted.
        self.last_stats: GenerationStats | None = None
        self.sequences: list[sequence.Sequence] = []
        self.projector: Projector | None = None
        #: The draft model's own projector (a vision draft model: mmproj_draft), or None.
        self.draft_projector: Projector | None = None
        self.drafter: Drafter | None = None
        self.draft_model: Model | None = None
        self.ctx: Context | None = None
        #: The target's LoRA adapters and their scales (serving/lora.py); loaded in _open.
        self.lora = EngineAdapters()
        #: The chat templates with the chat settings (serving/chat_template.py); made once the model is loaded.
        self.chat: ChatRenderer | None = None
        #: Synthetic acceptance's chance of keeping each drafted position (speculative/synthetic.py: the
        #: benchmark mode of --spec-synth-rates / --spec-synth-len), or () where drafts are verified.
        self.synthetic_probs: tuple[float, ...] = ()
        plan = plan_load(config, self.method)
        self.config, self.placement, self.memory_estimate = plan.config, plan.placement, plan.memory_estimate
        self.model = Model(config.model, n_gpu_layers=config.n_gpu_layers, use_mmap=config.use_mmap,
                           use_mlock=config.use_mlock, role="target", placement=self.placement.target,
                           load_mtp=bool(self.method and self.method.loads_target_mtp))
        try:
            self.chat = ChatRenderer(self.model, _chat_settings(config))  # checks the template, as llama-server
            self._open()
            self.synthetic_probs = self._synthetic_probs()
            #: The prompt's text, images and parts, with the fit check (serving/prompt_parts.py).
            self.prompts = PromptParts(self.model, self.projector, self.draft_projector, self.chat, self.ctx,
                                       config.n_parallel)
            d = self.drafter
            self._resolver = RequestResolver(config, EngineLimits(
                n_vocab=self.model.n_vocab, n_ctx_seq=self.ctx.n_ctx_seq,
                has_drafter=d is not None, draft_n_max=d.n_max if d else 0, draft_n_min=d.n_min if d else 0,
                draft_n_max_limit=d.n_max_limit if d else 0),
                lora_scales=self.lora.resolve, grammar_of_schema=json_schema_to_grammar)
            self._check_defaults()
        except BaseException:
            self.close()
            raise
        # Made here, once: threads that submit at the same moment must share one loop. With one
        # slot its readers turn it (on their own threads) until something asks for its thread.
        self._loop = SlotLoop(sequences=self.sequences, ctx=self.ctx, drafter=self.drafter, projector=self.projector,
                              step_cost=self._step_cost, lora=self.lora,
                              prepare=lambda request: PreparedGeneration(self, request),
                              threaded=config.n_parallel > 1,
                              prompt_cache=PromptCache(config.cache_ram_mib, self.ctx.n_ctx) if config.cache_ram_mib
                              else None, cache_idle_slots=config.cache_idle_slots)

    def _check_defaults(self) -> None:
        """The load's sampling defaults and chat template, tried once so that a bad one fails the
        load (with what was wrong) rather than every request."""
        try:
            self.resolve(RequestOptions(prompt=""))
        except (ValueError, TypeError) as e:
            raise ValueError(f"the sampling defaults are not valid: {e}") from None

    def _synthetic_probs(self) -> tuple[float, ...]:
        c = self.config
        if not c.synth_rates and c.synth_len is None:
            return ()
        rates = synthetic_rates(c.synth_rates, c.synth_len, n_max=self.drafter.n_max if self.drafter else 0)
        rates_text = ", ".join(f"{r:.6g}" for r in rates)
        warnings.warn(f"synthetic speculative acceptance is on, for benchmarking: drafts are kept at random "
                      f"(rates {rates_text}), so the generated text is not the model's", stacklevel=2)
        return conditional_probabilities(rates)

    def _load_draft_model(self) -> Model:
        c = self.config
        return Model(c.draft, role="draft", n_gpu_layers=c.n_gpu_layers if c.draft_n_gpu_layers is None
                     else c.draft_n_gpu_layers, use_mmap=c.use_mmap, use_mlock=c.use_mlock,
                     placement=self.placement.draft)

    def _draft_cache_types(self) -> dict:
        c = self.config
        return dict(type_k=c.cache_type_k_draft or c.cache_type_k, type_v=c.cache_type_v_draft or c.cache_type_v)

    def _open(self) -> None:
        c, m = self.config, self.method
        self.lora = EngineAdapters(self.model, c.lora, c.lora_init_without_apply)  # the target's only
        pairing: Pairing | None = None
        if m is not None:
            from pyllama_spec.bindings.native_info import build_record

            if m.draft_file:
                self.draft_model = self._load_draft_model()
            pairing = m.check_pair(self.model, self.draft_model, build_record())
            own = ngram_limit(m.name, c.ngram)
            if own is not None:  # an n-gram type drafts up to its own setting: plan with it
                pairing = dataclasses.replace(pairing, limit=min(pairing.limit, own))
        drafts = plan_drafts(c, self.model, pairing)
        draft_max, n_rs_seq, n_seq = drafts.draft_max, drafts.n_rs_seq, c.n_parallel
        # A draft tree gives every leaf a sequence id of its own, sharing the cells of one cache.
        self.ctx = Context(self.model, n_ctx=c.n_ctx, n_batch=c.n_batch, n_ubatch=c.n_ubatch, n_rs_seq=n_rs_seq,
                           n_seq_max=n_seq + c.draft_tree, kv_unified=c.kv_unified or c.draft_tree > 0,
                           n_threads=c.n_threads, n_threads_batch=c.n_threads_batch, type_k=c.cache_type_k,
                           type_v=c.cache_type_v, flash_attn=c.flash_attn, pooling=c.pooling, role="target")
        if c.mmproj:
            offload = c.n_gpu_layers != 0 if c.mmproj_offload is None else c.mmproj_offload
            self.projector = Projector(c.mmproj, self.model, use_gpu=offload, n_threads=c.n_threads,
                                       flash_attn=c.mmproj_flash_attn)
        if c.mmproj_draft:
            draft_layers = c.n_gpu_layers if c.draft_n_gpu_layers is None else c.draft_n_gpu_layers
            offload = draft_layers != 0 if c.mmproj_offload is None else c.mmproj_offload
            self.draft_projector = Projector(c.mmproj_draft, self.draft_model, use_gpu=offload,
                                             n_threads=c.n_threads, flash_attn=c.mmproj_flash_attn, role="draft")
            check_draft_projector(self.projector, self.draft_projector)
        if m is not None:
            from pyllama_spec.bindings.native_info import build_record

            m.open_target_features(self.ctx, pairing)
            made = []
            for each in methods(c.spec_type):  # a list's n-gram types first, in llama.cpp's order
                own = pairing if each is m else each.check_pair(self.model, None, build_record())
                made.append(each.make(DrafterSetup(
                    target_ctx=self.ctx, draft_model=self.draft_model, pairing=own,
                    n_max=draft_max if each is m else own.limit, n_min=c.draft_min, p_min=c.draft_p_min, n_seq=n_seq,
                    n_ctx=c.n_ctx, n_batch=c.n_batch, n_ubatch=c.n_ubatch, n_threads=c.n_threads,
                    flash_attn=c.flash_attn, swa_full=c.swa_full, cache_types=self._draft_cache_types(),
                    draft_projector=self.draft_projector, ngram=c.ngram, method_name=each.name,
                    draft_callable=c.draft_callable)))
            self.drafter = made[0] if len(made) == 1 else ChainDrafter(made)
        if self.drafter is not None and n_rs_seq:
            self.drafter.n_max_limit = n_rs_seq  # rollback snapshots bound how far a draft can go
        self.sequences = [sequence.Sequence(self.ctx, self.drafter, i, draft_positions=c.draft_positions, n_seq=n_seq)
                          for i in range(n_seq)]

    # ------------------------------------------------------------------ lifecycle
    def close(self, *, give_back_memory: bool = False) -> None:
        """Free everything native. Waits for a step running on another thread; generations still
        running or suspended end (their streams raise ``ClosedError``), and the slot loop's thread
        stops first. ``give_back_memory``: then return the freed heap pages to the OS (a process that
        goes on without a model, as a sleeping server: bindings/heap.py), also when a close failed."""
        try:
            if self._loop is not None:
                self._loop.stop()
            for seq in self.sequences:
                seq.close()
            for obj in (self.drafter, self.projector, self.draft_projector, self.ctx, self.lora, self.draft_model,
                        self.chat, self.model):
                if obj is not None:
                    obj.close()
        finally:
            if give_back_memory:
                give_back_freed_pages()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def positions(self) -> SequencePositions:
        """Where the (first) sequence stands."""
        return self.sequences[0].positions

    # ------------------------------------------------------------------ requests
    def resolve(self, options: RequestOptions) -> Request:
        """``options`` checked and completed with this engine's defaults (serving/resolver.py): the
        ``Request`` that ``stream``, ``generate`` and ``submit`` run. Safe on any thread; a
        ``json_schema`` is turned into its grammar here (its cost grows with the schema)."""
        return self._resolver.resolve(options)

    def generate(self, prompt: str | Request | None = None, **kwargs: Any) -> Result:
        """Generate a completion: ``stream``'s arguments, the pieces joined into one Result."""
        return Result.from_pieces(self.stream(prompt, **kwargs))

    def stream(self, prompt: str | Request | None = None, **options: Any) -> Iterator[Piece]:
        """Yield pieces of text as the target accepts them; the last piece carries the stats.

        The options (``RequestOptions``' fields, serving/request.py): ``messages``, ``chat``,
        ``images``, ``max_tokens`` (128), ``seed``, ``stop``, ``cache_prompt`` (True), ``progress``,
        ``draft_max``, ``draft_min``, ``draft_positions``, ``verify``, ``draft_tree``,
        ``chat_template_kwargs``, ``chat_options``, ``logprobs``, ``post_sampling_probs``, ``lora``, ``n_indent``,
        ``t_max_predict_ms``, and any sampler setting by name; each is described below.

        ``prompt`` is used as is, with ``MEDIA_MARKER`` where each image goes (or, as llama-server
        takes it, a list of token ids mixed with strings: the strings tokenized, the first with the
        model's special tokens when the list starts with it; no images then); ``messages``
        go through the chat template as llama-server renders them (``chat_params``;
        ``chat_template_kwargs`` are extra variables for it, e.g. ``{"enable_thinking": False}``,
        and ``chat_options`` the chat's other fields: tools, tool_choice, ...),
        and ``chat`` is a chat ``chat_params`` rendered already (with tools, reasoning, ...): its
        prompt, images, grammar, stop strings and reasoning budget. Images: paths, bytes, PIL
        images or arrays. ``prompt`` may also be a ``Request`` resolved already (``resolve``),
        with no other argument.
        With ``cache_prompt`` (the default) the longest prefix already in the cache (earlier
        turns' text and images) is kept and only the rest is decoded. ``progress(stage, done,
        total)`` is called during prefill: first ("cache", rows reused from the cache, rows of the
        whole prompt), then "encode" per image and "prefill" per decoded batch (rows of the rest).
        ``max_tokens=0`` decodes the prompt (filling the cache) and generates nothing.
        ``draft_max`` / ``draft_min`` / ``draft_positions`` override the engine's speculative
        settings for this call (``draft_max=0`` turns drafting off; ``draft_max="auto"``
        adapts the length step by step, see draft_length.py; a different position mode
        starts from an empty cache).

        Sampling: any field of ``SamplingParams`` (speculative/sampling.py) by keyword, llama-server's
        samplers and defaults: ``temperature`` (0, the default, is greedy), ``top_k``, ``top_p``,
        ``min_p``, ``typical_p``, ``top_n_sigma``, ``xtc_probability``/``xtc_threshold``, the
        ``repeat``/``frequency``/``presence_penalty`` over ``penalty_last_n`` tokens (-1: the
        context), ``dry_*``, ``mirostat*``, ``dynatemp_*``, ``logit_bias`` ({token: bias}, -inf
        forbids it), ``samplers`` (their order), ``grammar`` (GBNF: the output follows it) or
        ``json_schema`` (turned into one as llama-server does), ``ignore_eos``, and ``seed``; those
        not given are the engine's ``sampling`` defaults (llama-server's --temp, ...). ``logprobs=N``
        gives each emitted token's log-probability under the target's
        own distribution (its raw logits, as llama-server's ``n_probs``), with the N most
        likely tokens at that position (``Piece.logprobs``), drafted or not; with
        ``post_sampling_probs=True`` its probability after the sampler chain instead, with the
        chain's N most likely tokens (llama-server's ``post_sampling_probs``; ``TokenProb``, see
        speculative/logprobs.py: a ValueError for settings it cannot reproduce, such as a grammar).

        ``verify`` (default: the engine's, "match") decides acceptance at temperature > 0:
        "rejection" sampling follows the target's distribution exactly and accepts more;
        "match" is llama.cpp's rule, with the same tokens as a target-only run for a seed.
        Greedy decoding is the same under both. ``draft_tree`` (up to the engine's, loaded
        with ``draft_tree=N``; 0: one chain) verifies a tree of that many drafted tokens per
        step under the "match" rule: the same tokens, more of them accepted (tree.py).

        ``lora`` (llama-server's per-request field): a scale for each LoRA adapter loaded with
        ``load(..., lora=...)``, as ``[{"id": 0, "scale": 0.5}]`` (adapters not named: 0);
        without it, the engine's global scales (``engine.lora``, serving/lora.py). A cached
        prompt is reused only under the scales that decoded it.

        llama-server's line rules for code completion (speculative/line_rules.py; 0: off): ``n_indent``
        ends the generation at a line indented by fewer spaces than that (the answer drops
        that line, ``Piece.ending.retract``), ``t_max_predict_ms`` at a newline once generating
        took longer than that.

        The arguments are checked now (``resolve``); the generation takes a slot at the stream's
        first step and runs in the slot loop (see ``Engine`` and serving/slot_loop.py).
        """
        return self._stream(self._request_of(prompt, options))

    def _stream(self, request: Request) -> Iterator[Piece]:
        """Submitted at its first step (a stream never iterated takes no slot); leaving it early
        cancels it."""
        yield from self._loop.submit(request)  # refuses once the engine is closed

    def submit(self, prompt: str | Request | None = None, *, on_event: Callable[[str, Any], None] | None = None,
               max_waiting: int | None = None, id_slot: int = -1, **kwargs: Any) -> Submission:
        """Start a generation in a free slot (or queue it until one frees) and return its handle
        at once: a ``Submission`` (slot_loop.py) to iterate for pieces, ``result()`` for the
        whole Result, or ``cancel()``. ``stream``'s arguments (or a ``Request``). Needs
        ``n_parallel > 1``.

        ``on_event(kind, value)``, called on the slot loop's thread, receives the events instead
        of the iteration (a server hands them to its event loop). ``max_waiting`` refuses the
        request with EngineBusyError when that many already wait for a slot. ``id_slot`` runs it
        in that slot (waiting while it is busy); -1, the default, in the best free one."""
        if self.config.n_parallel < 2:
            raise ValueError("submit() runs generations concurrently in slots: load with n_parallel > 1 "
                             "(llama.cpp's -np); with one slot use stream() or generate()")
        return self._loop.submit(self._request_of(prompt, kwargs), on_event, max_waiting, id_slot)

    def _request_of(self, prompt, options: dict) -> Request:
        """The Request a call runs: ``prompt`` itself when it is one this engine resolved (and no
        other option is given), else ``prompt`` and ``options`` resolved now."""
        if isinstance(prompt, Request):
            if options:
                raise TypeError("a resolved Request takes no other argument: give its options to resolve()")
            return self._own(prompt)
        return self.resolve(RequestOptions.of(prompt, **options))

    def _own(self, request: Request) -> Request:
        """``request`` if this engine resolved it (its limits were checked here), else TypeError."""
        if request.resolved_by is not self._resolver:
            raise TypeError("this Request was not resolved by this engine (Engine.resolve): its settings were "
                            "checked against another engine's limits, or none")
        return request

    def run_on_slot(self, slot: int, fn: Callable[[sequence.Sequence], Any]) -> Future:
        """Run ``fn(sequence)`` on slot ``slot``'s sequence while no generation uses it, and return
        the Future of its result (a slot's save, restore or erase: see serving/slot_file.py).

        It runs in the slot loop once the slot is free; with one slot and no loop thread, on this
        thread (after a generation running on another thread ends), and the Future is done."""
        return self._loop.run_on_slot(slot, fn)

    def embed(self, prompts: "str | EmbeddingInput | Sequence[str | EmbeddingInput]", *,
              normalize: int | None = None) -> list[Embedding]:
        """The embedding of each prompt (serving/embeddings.py): a string, or an ``EmbeddingInput``
        (text with images, or token ids), or a list of them; pooled as the engine was loaded
        (``pooling=``) and normalised by ``normalize`` (None: the engine's ``embd_normalize``,
        euclidean by default). Needs an engine loaded with ``embeddings=True``. Each prompt runs on
        an idle slot (its cached prompt is forgotten), between other slots' generations.

        >>> engine = load("bge-small.gguf", embeddings=True)  # doctest: +SKIP
        >>> engine.embed("hello")[0].vectors[0]                # doctest: +SKIP
        """
        items = [prompts] if isinstance(prompts, (str, EmbeddingInput)) else list(prompts)
        inputs = [p if isinstance(p, EmbeddingInput) else EmbeddingInput(p) for p in items]
        with EmbeddingJob(self, inputs, normalize=normalize) as job:
            return self._run_embeddings(job)

    def rerank(self, query: str, documents: Sequence[str]) -> list[Rank]:
        """Each document's relevance to ``query`` by a reranker loaded with ``embeddings=True`` and
        pooling "rank" (``pooling="rank"``, llama-server's --reranking, or as the GGUF declares), in
        the documents' order; each pair's tokens as llama-server lays them out
        (serving/embeddings.py ``RerankPairs``)."""
        with EmbeddingJob.rerank(self, query, documents) as job:
            return [Rank(float(e.vectors[0, 0]), e.n_tokens) for e in self._run_embeddings(job)]

    def _run_embeddings(self, job: EmbeddingJob) -> list[Embedding]:
        return [self.run_on_slot(self.idle_slot(), job.prompt(i)).result() for i in range(len(job.prompts))]

    @property
    def pooling(self) -> str:
        """How embeddings pool a prompt's rows here: "none", "mean", "cls", "last" or "rank"."""
        return self.ctx.pooling

    def idle_slot(self) -> int:
        """Where slot work (an embedding) waits least and costs least: an idle slot, the one whose
        cached prompt is shortest (an empty one first); slot 0 when every slot runs a generation."""
        idle = [i for i in range(len(self.sequences)) if self._loop.running(i) is None]
        return min(idle, key=lambda i: self.sequences[i].n_cached_rows, default=0)

    def reset_cache(self) -> None:
        """Forget the cached prompt(s) of the idle slots, and the prompt cache in host memory (``cache_ram_mib``):
        the next generation decodes everything again."""
        self._loop.reset_all()

    # ------------------------------------------------------------------ the prompt
    def chat_params(self, messages: Sequence[dict], options: ChatOptions | None = None, **kwargs: Any) -> ChatParams:
        """``messages`` rendered by the chat template as llama-server renders a chat request, with
        ``options`` (or ChatOptions' fields as keywords: tools, tool_choice, parallel_tool_calls,
        add_generation_prompt, continue_final_message, reasoning_format, reasoning_effort,
        template_kwargs, json_schema, grammar, reasoning_budget, ...): the prompt, its images and
        what the chat asks of the generation (``stream(chat=...)``) and of the parser of its
        answer (``bindings.chat.ChatParser(params.parser_params())``). ValueError for a chat the
        template refuses. Safe on any thread, beside running generations (the templates are
        read-only).

        >>> params = engine.chat_params(messages, tools=tools, tool_choice="required")  # doctest: +SKIP
        >>> text = engine.generate(chat=params).text
        """
        if options is not None and kwargs:
            raise ValueError("give options= or ChatOptions' fields as keywords, not both")
        return self.prompts.render(messages, options or ChatOptions(**kwargs))

    def count_tokens(self, text: str, images: Sequence = ()) -> int:
        """The cache rows a prompt of ``text`` (MEDIA_MARKER where each image goes) and ``images``
        takes, as a generation tokenizes it, without decoding anything. Safe on any thread."""
        return self.prompts.count(text, list(images))

    def single_tokens(self, texts) -> frozenset[int]:
        """The tokens among ``texts`` that are one token each (special tokens parsed): llama-server writes
        these preserved tokens out in the text, where the chat's parser looks for them."""
        out = set()
        for t in texts:
            ids = self.model.tokenize(t, add_special=False, parse_special=True)
            if len(ids) == 1:
                out.add(int(ids[0]))
        return frozenset(out)

    # ------------------------------------------------------------------ settings and state
    @property
    def draft_max(self) -> int | str:
        """The engine's draft length: "auto", the drafter's n_max, or 0 without a drafter."""
        if self.drafter is None:
            return 0
        return "auto" if self.config.draft_max == "auto" else self.drafter.n_max

    @property
    def step_cost(self) -> StepCost:
        """What a speculative step costs on this engine's hardware, fitted to every drafting step
        (draft_length.py); adaptive draft lengths plan with it."""
        return self._step_cost

    @property
    def slot_loop(self) -> SlotLoop:
        """The slot loop that runs this engine's generations (slot_loop.py)."""
        return self._loop

    scheduler = slot_loop  # its name before the one loop served one slot too
