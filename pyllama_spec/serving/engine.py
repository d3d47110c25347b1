"""The Engine: loads a target, its projector and the speculative method's drafter (chosen from
the drafter registry, drafters/registry.py), checks everything it can before allocating, and
runs generations one at a time (the gate) or in slots (the scheduler).

>>> import pyllama_spec as ps                                       # doctest: +SKIP
>>> em = ps.embedded_models()
>>> with ps.load(model=em.target, mmproj=em.mmproj, draft=em.draft) as engine:
...     result = engine.generate("def fibonacci(n):\n    if n", max_tokens=32)
...     print(result.text, result.stats.acceptance_rate)

One generation, as spec/generation.py's prefill and step read:
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
import os
from concurrent.futures import Future
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from pyllama_spec.bindings.context import Context
from pyllama_spec.bindings.grammar import json_schema_to_grammar
from pyllama_spec.bindings.model import Model
from pyllama_spec.bindings.mtmd import MEDIA_MARKER, Bitmap, Projector
from pyllama_spec.bindings.sampler import Sampler
from pyllama_spec.drafters import Drafter
from pyllama_spec.drafters.registry import (
    METHODS,
    DrafterSetup,
    Pairing,
    canonical_spec_type,
    method,
)
from pyllama_spec.errors import ContextOverflowError, ImageError
from pyllama_spec.serving.config import (
    EngineConfig,
    _check_draft_tree,
    _check_tree_settings,
)
from pyllama_spec.serving.gate import EngineGate
from pyllama_spec.serving.load_plan import plan_drafts, plan_load
from pyllama_spec.serving.lora import EngineAdapters, lora_specs
from pyllama_spec.serving.prompt import ChatOptions, ChatParams, ChatRenderer, ChatSettings, as_list
from pyllama_spec.serving.request import Request
from pyllama_spec.serving.scheduler import Scheduler
from pyllama_spec.spec.draft_length import AdaptiveLength, FixedLength, StepCost
from pyllama_spec.spec.generation import (
    Generation,
    Piece,
    ProgressCallback,
    Result,
    prefill_parts,
    speculative_step,
)
from pyllama_spec.spec.media import check_draft_projector, pair_with_draft
from pyllama_spec.spec.positions import SequencePositions
from pyllama_spec.spec.sampling import MAX_TOP_LOGPROBS, sampling_params
from pyllama_spec.spec import sequence
from pyllama_spec.spec.stats import GenerationStats
from pyllama_spec.spec.verify import VERIFY_RULES, MatchVerifier, RejectionVerifier

__all__ = ["Engine", "EngineConfig", "Piece", "Result", "load", "ProgressCallback"]

# Counting a long prompt's tokens piece by piece before tokenizing it whole (see
# Engine._refuse_a_prompt_that_cannot_fit): above this many bytes per context row, in pieces of
# about this many characters, each piece allowed this many tokens more than the whole would have.
_COUNT_PIECES_ABOVE = 8
_COUNT_PIECE_CHARS = 64 * 1024
_COUNT_SLACK_PER_PIECE = 16


def _pieces_at_line_starts(segments: list[str], size: int) -> Iterator[str]:
    """The text of ``segments`` in pieces of at most ``size`` characters, each cut just before a
    line that starts with a non-space character, else just before any line, else at ``size``."""
    for seg in segments:
        start = 0
        while start < len(seg):
            end = min(start + size, len(seg))
            if end < len(seg):
                cut = _line_start_before(seg, start, end)
                end = cut if cut > start else end
            yield seg[start:end]
            start = end


def _line_start_before(text: str, start: int, end: int) -> int:
    """The last index in (start, end] just after a newline, preferring one at a non-space character
    (a word boundary for BPE pre-tokenizers); -1 when there is no newline."""
    last = at = text.rfind("\n", start, end)
    while at >= start:
        if at + 1 < len(text) and not text[at + 1].isspace():
            return at + 1
        at = text.rfind("\n", start, at)
    return last + 1 if last >= start else -1


def load(model: str | os.PathLike, mmproj: str | os.PathLike | None = None,
         draft: str | os.PathLike | None = None, spec_type: str | None = None, **kwargs: Any) -> "Engine":
    """Load a target (with an optional mmproj and DFlash draft) and return an Engine.

    ``spec_type`` (llama.cpp's names): "draft-dflash" (also "dflash"; the default when a
    draft is given), "draft-simple" (a small model with the target's vocabulary as the
    draft), "ngram-simple" (prompt lookup, no draft model), "draft-mtp" (the target's own
    multi-token-prediction head, Qwen3.5's nextn block: no draft model) or "none" (target only).
    ``mmproj_draft``: the draft model's own projector, for a draft-simple draft that is a small VLM
    (the default spec_type then): the draft sees every picture through it (drafters/draft_model.py).
    Other keywords are EngineConfig's, named as in llama.cpp: n_ctx, n_batch, n_ubatch,
    n_gpu_layers, draft_max, draft_min, draft_p_min, flash_attn, n_threads,
    draft_positions ("target" or "sequential"); where layers go: rpc_servers (["host:port", ...]),
    devices, device_draft, split_mode, tensor_split, main_gpu, draft_n_gpu_layers (also
    n_gpu_layers_draft); LoRA adapters of the target (llama-server's --lora / --lora-scaled):
    lora ([path or (path, scale), ...]) and lora_init_without_apply (serving/lora.py).
    """
    if spec_type is None:  # a draft with a projector of its own is a vision draft model (draft-simple)
        spec_type = ("draft-simple" if kwargs.get("mmproj_draft") else "draft-dflash") if draft is not None else "none"
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


def _single_tokens(model: Model, texts) -> frozenset[int]:
    """The tokens among ``texts`` that are one token each (special tokens parsed): llama-server writes
    these preserved tokens out in the text, where the chat's parser looks for them."""
    out = set()
    for t in texts:
        ids = model.tokenize(t, add_special=False, parse_special=True)
        if len(ids) == 1:
            out.add(int(ids[0]))
    return frozenset(out)


def _chat_settings(c: EngineConfig) -> ChatSettings:
    """The chat settings of an engine's configuration (llama-server's chat flags)."""
    return ChatSettings(template=c.chat_template, jinja=c.jinja, template_kwargs=dict(c.chat_template_kwargs),
                        reasoning=c.reasoning, reasoning_format=c.reasoning_format, reasoning_budget=c.reasoning_budget,
                        reasoning_budget_message=c.reasoning_budget_message, reasoning_effort=c.reasoning_effort,
                        reasoning_preserve=c.reasoning_preserve, prefill_assistant=c.prefill_assistant,
                        skip_chat_parsing=c.skip_chat_parsing)


def _bias_pairs(bias) -> list:
    """A logit_bias given as {token: bias} or pairs, as pairs (None: none)."""
    if bias is None:
        return []
    return list(bias.items()) if isinstance(bias, dict) else list(bias)


class Engine:
    """Target + optional projector + optional drafter.

    With ``n_parallel=1`` (the default) it holds one sequence, and generations run one at a
    time on the caller's thread. Safe to share between threads: a call made while another
    thread's generation runs waits for it to finish. On one thread, starting a generation
    while a ``stream()`` is suspended cancels that stream: resuming it raises
    ``GenerationCancelledError`` instead of continuing on a cache that changed under it.

    With ``n_parallel=N > 1`` it holds N sequences (slots), and a scheduler thread runs up to
    N generations at once, verifying every active slot's draft in one target batch:
    ``submit()`` starts one and returns its handle; ``stream()`` and ``generate()`` go
    through it too, so threads calling them run concurrently.
    """

    def __init__(self, config: EngineConfig) -> None:
        config = dataclasses.replace(config, spec_type=canonical_spec_type(config.spec_type),
                                     lora=lora_specs(config.lora))
        #: The speculative method's registry entry (drafters/registry.py); None for spec_type "none".
        self.method = method(config.spec_type)
        if self.method is not None and self.method.draft_file and config.draft is None:
            raise ValueError(f"spec_type={config.spec_type!r} needs a draft model (draft=...)")
        if config.mmproj_draft is not None and not (self.method and self.method.draft_projector and config.draft):
            takes = " or ".join(repr(m.name) for m in METHODS if m.draft_projector)
            raise ValueError(f"mmproj_draft is a draft model's own projector: it needs a draft model (draft=...) "
                             f"and spec_type {takes}, got spec_type {config.spec_type!r}")
        if config.n_ubatch > config.n_batch:
            raise ValueError(f"n_ubatch ({config.n_ubatch}) cannot exceed n_batch ({config.n_batch})")
        dm = config.draft_max
        if dm != "auto" and (isinstance(dm, bool) or not isinstance(dm, int) or dm < 0):
            raise ValueError(f'draft_max must be an integer >= 0 or "auto", got {dm!r}')
        if isinstance(config.n_parallel, bool) or not isinstance(config.n_parallel, int) or config.n_parallel < 1:
            raise ValueError(f"n_parallel must be an integer >= 1, got {config.n_parallel!r}")
        if config.n_parallel > config.n_batch:
            raise ValueError(f"n_parallel ({config.n_parallel}) cannot exceed n_batch ({config.n_batch}): every "
                             "slot's verify rows go in one target batch")
        _check_draft_tree(config)
        self.config = config
        self._gate = EngineGate()
        self._scheduler = None
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
        #: The chat templates with the chat settings (serving/prompt.py); made once the model is loaded.
        self.chat: ChatRenderer | None = None
        plan = plan_load(config, self.method)
        self.config, self.placement, self.memory_estimate = plan.config, plan.placement, plan.memory_estimate
        self.model = Model(config.model, n_gpu_layers=config.n_gpu_layers, use_mmap=config.use_mmap,
                           use_mlock=config.use_mlock, role="target", placement=self.placement.target,
                           load_mtp=bool(self.method and self.method.loads_target_mtp))
        try:
            self.chat = ChatRenderer(self.model, _chat_settings(config))  # checks the template, as llama-server
            self._open()
            self._check_defaults()
        except BaseException:
            self.close()
            raise
        if config.n_parallel > 1:
            # Made here, once: threads that submit at the same moment must share one scheduler.
            self._scheduler = Scheduler(sequences=self.sequences, ctx=self.ctx, drafter=self.drafter,
                                        projector=self.projector, step_cost=self._step_cost, lora=self.lora,
                                        prepare=lambda request: self._generation(None, request))

    def _check_defaults(self) -> None:
        """The load's sampling defaults and chat template, tried once so that a bad one fails the
        load (with what was wrong) rather than every request."""
        try:
            self._request(prompt="")
        except (ValueError, TypeError) as e:
            raise ValueError(f"the sampling defaults are not valid: {e}") from None

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
        drafts = plan_drafts(c, self.model, pairing)
        draft_max, n_rs_seq, n_seq = drafts.draft_max, drafts.n_rs_seq, c.n_parallel
        # A draft tree gives every leaf a sequence id of its own, sharing the cells of one cache.
        self.ctx = Context(self.model, n_ctx=c.n_ctx, n_batch=c.n_batch, n_ubatch=c.n_ubatch, n_rs_seq=n_rs_seq,
                           n_seq_max=n_seq + c.draft_tree, kv_unified=c.draft_tree > 0,
                           n_threads=c.n_threads, n_threads_batch=c.n_threads_batch, type_k=c.cache_type_k,
                           type_v=c.cache_type_v, flash_attn=c.flash_attn, role="target")
        if c.mmproj:
            offload = c.n_gpu_layers != 0 if c.mmproj_offload is None else c.mmproj_offload
            self.projector = Projector(c.mmproj, self.model, use_gpu=offload, n_threads=c.n_threads,
                                       flash_attn=c.flash_attn)
        if c.mmproj_draft:
            draft_layers = c.n_gpu_layers if c.draft_n_gpu_layers is None else c.draft_n_gpu_layers
            offload = draft_layers != 0 if c.mmproj_offload is None else c.mmproj_offload
            self.draft_projector = Projector(c.mmproj_draft, self.draft_model, use_gpu=offload,
                                             n_threads=c.n_threads, flash_attn=c.flash_attn, role="draft")
            check_draft_projector(self.projector, self.draft_projector)
        if m is not None:
            m.open_target_features(self.ctx, pairing)
            self.drafter = m.make(DrafterSetup(
                target_ctx=self.ctx, draft_model=self.draft_model, pairing=pairing, n_max=draft_max, n_min=c.draft_min,
                p_min=c.draft_p_min, n_seq=n_seq, n_ctx=c.n_ctx, n_batch=c.n_batch, n_ubatch=c.n_ubatch,
                n_threads=c.n_threads, flash_attn=c.flash_attn, swa_full=c.swa_full,
                cache_types=self._draft_cache_types(), draft_projector=self.draft_projector))
        if self.drafter is not None and n_rs_seq:
            self.drafter.n_max_limit = n_rs_seq  # rollback snapshots bound how far a draft can go
        self.sequences = [sequence.Sequence(self.ctx, self.drafter, i, draft_positions=c.draft_positions, n_seq=n_seq)
                          for i in range(n_seq)]

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Free everything native. Waits for a step running on another thread; a suspended stream is cancelled.

        With n_parallel > 1, generations still running are cancelled (their streams end with
        ``GenerationCancelledError``) and the scheduler thread stops first."""
        if self._scheduler is not None:
            self._scheduler.stop()
        self._gate.close()
        for seq in self.sequences:
            seq.close()
        for obj in (self.drafter, self.projector, self.draft_projector, self.ctx, self.lora, self.draft_model,
                    self.chat, self.model):
            if obj is not None:
                obj.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def positions(self) -> SequencePositions:
        """Where the (first) sequence stands."""
        return self.sequences[0].positions

    # ------------------------------------------------------------------ public API
    def generate(self, prompt: str | None = None, **kwargs: Any) -> Result:
        """Generate a completion: ``stream``'s arguments, the pieces joined into one Result."""
        return Result.from_pieces(self.stream(prompt, **kwargs))

    def stream(self, prompt: str | None = None, *, messages: Sequence[dict] | None = None,
               chat: ChatParams | None = None, images=(), max_tokens: int = 128, seed: int | None = None,
               stop: Sequence[str] | str = (), cache_prompt: bool = True,
               progress: ProgressCallback | None = None, draft_max: int | None = None,
               draft_min: int | None = None, draft_positions: str | None = None,
               verify: str | None = None, draft_tree: int | None = None,
               chat_template_kwargs: dict | None = None, chat_options: ChatOptions | None = None,
               logprobs: int | None = None, lora=None,
               n_indent: int = 0, t_max_predict_ms: float = 0, **sampling: Any) -> Iterator[Piece]:
        """Yield pieces of text as the target accepts them; the last piece carries the stats.

        ``prompt`` is used as is, with ``MEDIA_MARKER`` where each image goes (or, as llama-server
        takes it, a list of token ids mixed with strings: the strings tokenized, the first with the
        model's special tokens when the list starts with it; no images then); ``messages``
        go through the chat template as llama-server renders them (``chat_params``;
        ``chat_template_kwargs`` are extra variables for it, e.g. ``{"enable_thinking": False}``,
        and ``chat_options`` the chat's other fields: tools, tool_choice, ...),
        and ``chat`` is a chat ``chat_params`` rendered already (with tools, reasoning, ...): its
        prompt, images, grammar, stop strings and reasoning budget. Images: paths, bytes, PIL
        images or arrays.
        With ``cache_prompt`` (the default) the longest prefix already in the cache (earlier
        turns' text and images) is kept and only the rest is decoded. ``progress(stage, done,
        total)`` is called during prefill: first ("cache", rows reused from the cache, rows of the
        whole prompt), then "encode" per image and "prefill" per decoded batch (rows of the rest).
        ``max_tokens=0`` decodes the prompt (filling the cache) and generates nothing.
        ``draft_max`` / ``draft_min`` / ``draft_positions`` override the engine's speculative
        settings for this call (``draft_max=0`` turns drafting off; ``draft_max="auto"``
        adapts the length step by step, see draft_length.py; a different position mode
        starts from an empty cache).

        Sampling: any field of ``SamplingParams`` (spec/sampling.py) by keyword, llama-server's
        samplers and defaults: ``temperature`` (0, the default, is greedy), ``top_k``, ``top_p``,
        ``min_p``, ``typical_p``, ``top_n_sigma``, ``xtc_probability``/``xtc_threshold``, the
        ``repeat``/``frequency``/``presence_penalty`` over ``penalty_last_n`` tokens (-1: the
        context), ``dry_*``, ``mirostat*``, ``dynatemp_*``, ``logit_bias`` ({token: bias}, -inf
        forbids it), ``samplers`` (their order), ``grammar`` (GBNF: the output follows it) or
        ``json_schema`` (turned into one as llama-server does), ``ignore_eos``, and ``seed``; those
        not given are the engine's ``sampling`` defaults (llama-server's --temp, ...). ``logprobs=N``
        gives each emitted token's log-probability under the target's
        own distribution (its raw logits, as llama-server's ``n_probs``), with the N most
        likely tokens at that position (``Piece.logprobs``), drafted or not.

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

        llama-server's line rules for code completion (spec/line_rules.py; 0: off): ``n_indent``
        ends the generation at a line indented by fewer spaces than that (the answer drops
        that line, ``Piece.ending.retract``), ``t_max_predict_ms`` at a newline once generating
        took longer than that.

        The generation owns the engine from its first step to its end (see ``Engine``);
        with n_parallel > 1 it runs in a slot of the scheduler instead (see ``submit``).
        """
        request = self._request(prompt=prompt, messages=messages, chat=chat, images=images, max_tokens=max_tokens,
                                seed=seed,
                                stop=stop, cache_prompt=cache_prompt, progress=progress, draft_max=draft_max,
                                draft_min=draft_min, draft_positions=draft_positions, verify=verify,
                                draft_tree=draft_tree, chat_template_kwargs=chat_template_kwargs,
                                chat_options=chat_options,
                                logprobs=logprobs, lora=lora, n_indent=n_indent,
                                t_max_predict_ms=t_max_predict_ms, **sampling)
        if self.config.n_parallel > 1:
            return self._scheduled(request)
        return self._owned(self._run(request))

    def submit(self, prompt: str | None = None, *, on_event: Callable[[str, Any], None] | None = None,
               max_waiting: int | None = None, id_slot: int = -1, **kwargs: Any):
        """Start a generation in a free slot (or queue it until one frees) and return its handle
        at once: a ``Submission`` (scheduler.py) to iterate for pieces, ``result()`` for the
        whole Result, or ``cancel()``. ``stream``'s arguments. Needs ``n_parallel > 1``.

        ``on_event(kind, value)``, called on the scheduler's thread, receives the events instead
        of the iteration (a server hands them to its event loop). ``max_waiting`` refuses the
        request with EngineBusyError when that many already wait for a slot. ``id_slot`` runs it
        in that slot (waiting while it is busy); -1, the default, in the best free one."""
        if self.config.n_parallel < 2:
            raise ValueError("submit() runs generations concurrently in slots: load with n_parallel > 1 "
                             "(llama.cpp's -np); with one slot use stream() or generate()")
        return self._scheduler.submit(self._request(prompt=prompt, **kwargs), on_event, max_waiting, id_slot)

    def run_on_slot(self, slot: int, fn: Callable[[sequence.Sequence], Any]) -> Future:
        """Run ``fn(sequence)`` on slot ``slot``'s sequence while no generation uses it, and return
        the Future of its result (a slot's save, restore or erase: see serving/slot_file.py).

        With n_parallel > 1 it runs on the scheduler thread once the slot is free; with one slot
        it runs now, on this thread, after a generation running on another thread ends (as
        ``reset_cache`` does), and the Future is already done."""
        if self._scheduler is not None:
            return self._scheduler.run_on_slot(slot, fn)
        if slot != 0:
            raise ValueError(f"this engine has one slot (0), not {slot}")
        future: Future = Future()
        ticket = self._gate.enter()
        try:
            cut_short = self._gate.dirty  # an earlier step was cut short: start from a clean cache
            with self._gate.run_step(ticket):
                if cut_short:
                    self._reset_sequence()
                future.set_running_or_notify_cancel()
                try:
                    future.set_result(fn(self.sequences[0]))
                except Exception as e:  # noqa: BLE001 - handed to the caller with the Future
                    future.set_exception(e)
        finally:
            self._gate.leave(ticket)
        return future

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
    def scheduler(self):
        """The thread that runs the slots (scheduler.py), when loaded with n_parallel > 1; else None."""
        return self._scheduler

    def _scheduled(self, request: Request) -> Iterator[Piece]:
        """A stream through the scheduler, submitted at its first step like a single-slot stream
        (a stream never iterated takes no slot); leaving it early cancels it."""
        yield from self._scheduler.submit(request)  # refuses once the engine is closed

    def _request(self, *, prompt=None, messages=None, chat=None, images=(), max_tokens: int = 128,
                 seed: int | None = None,
                 stop: Sequence[str] | str = (), cache_prompt: bool = True, progress: ProgressCallback | None = None,
                 draft_max: int | None = None, draft_min: int | None = None, draft_positions: str | None = None,
                 verify: str | None = None, draft_tree: int | None = None, chat_template_kwargs: dict | None = None,
                 chat_options: ChatOptions | None = None, logprobs: int | None = None, lora=None, n_indent: int = 0,
                 t_max_predict_ms: float = 0, **sampling: Any) -> Request:
        """One call's arguments, checked (before anything runs) and normalised."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {max_tokens!r}")
        if (prompt is not None) + (messages is not None) + (chat is not None) != 1:
            raise ValueError("give exactly one of prompt=, messages= or chat=")
        if chat is not None and not isinstance(chat, ChatParams):
            raise ValueError(f"chat must be what chat_params() renders, got {type(chat).__name__}")
        if chat_options is not None and not isinstance(chat_options, ChatOptions):
            raise ValueError(f"chat_options must be a ChatOptions, got {type(chat_options).__name__}")
        if chat_template_kwargs:
            chat_options = dataclasses.replace(chat_options or ChatOptions(), template_kwargs={
                **((chat_options.template_kwargs or {}) if chat_options else {}), **chat_template_kwargs})
        drafting = self._draft_settings(draft_max, draft_min, draft_positions)
        verify = verify or self.config.verify
        if verify not in VERIFY_RULES:
            raise ValueError(f"verify must be one of {VERIFY_RULES}, got {verify!r}")
        defaults = dict(self.config.sampling)  # the engine's (llama-server's --temp, ...), then the call's
        default_seed = defaults.pop("seed", 0)
        seed = default_seed if seed is None else seed
        if sampling.get("grammar") or sampling.get("json_schema"):
            defaults.pop("grammar", None), defaults.pop("json_schema", None)  # the call's constraint replaces it
        sampling = {**defaults, **sampling}
        if sampling.pop("ignore_eos", False):  # llama-server's: every end-of-generation token forbidden
            sampling["logit_bias"] = [*_bias_pairs(sampling.get("logit_bias")),
                                      *((t, False) for t in self.model.eog_tokens)]
        schema = sampling.pop("json_schema", None)
        if schema is not None:  # llama-server: json_schema gives the grammar unless one is given too
            if sampling.get("grammar"):
                raise ValueError("give grammar= or json_schema=, not both")
            sampling["grammar"] = json_schema_to_grammar(schema)
        params = sampling_params(sampling, n_ctx=self.ctx.n_ctx_seq, n_vocab=self.model.n_vocab)
        if verify == "rejection" and not params.greedy and params.rejection_unsupported():
            raise ValueError(f"verify='rejection' applies logit bias, penalties, top-k, top-p, min-p and temperature "
                             f"in llama.cpp's order; this request also sets "
                             f"{', '.join(params.rejection_unsupported())}: use verify='match' (the default)")
        tree = self.config.draft_tree if draft_tree is None else draft_tree
        if isinstance(tree, bool) or not isinstance(tree, (int, np.integer)) or not 0 <= tree <= self.config.draft_tree:
            raise ValueError(f"draft_tree must be an integer from 0 to the engine's draft_tree "
                             f"({self.config.draft_tree}; load with draft_tree=N for trees), got {draft_tree!r}")
        if tree:  # greedy decoding verifies by "match" whatever the rule
            _check_tree_settings(drafting[0], verify if not params.greedy else "match")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, (int, np.integer))
                                     or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS} (the most likely tokens "
                             f"listed at each position), got {logprobs!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        for name, v in (("n_indent", n_indent), ("t_max_predict_ms", t_max_predict_ms)):
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer)) or not v >= 0:
                raise ValueError(f"{name} must be a number >= 0 (0: off), got {v!r}")
        if prompt is not None and not isinstance(prompt, str):
            prompt = self._mixed_prompt(prompt, images)
        return Request(prompt=prompt, messages=messages, chat=chat, images=images, max_tokens=int(max_tokens),
                       drafting=drafting, verify=verify, draft_tree=int(tree), sampling=params, seed=int(seed),
                       stop=[stop] if isinstance(stop, str) else list(stop), cache_prompt=cache_prompt,
                       progress=progress, chat_options=chat_options,
                       logprobs=None if logprobs is None else int(logprobs),
                       lora=None if lora is None else self.lora.resolve(lora),
                       n_indent=int(n_indent), t_max_predict_ms=float(t_max_predict_ms))

    def _draft_settings(self, draft_max, draft_min, draft_positions) -> tuple[int | str, int, str]:
        """(n_max or "auto", n_min, position mode) for one call, checked against what this engine can do."""
        d = self.drafter
        if draft_max == "auto" and d is None:
            raise ValueError('draft_max="auto" needs a drafter (spec_type other than "none")')
        n_max = self.draft_max if draft_max is None else draft_max
        n_min = (d.n_min if d else 0) if draft_min is None else draft_min
        for name, v in (("draft_max", n_max), ("draft_min", n_min)):
            if v == "auto" and name == "draft_max":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        if n_max != "auto":
            limit = d.n_max_limit if d else 0
            if n_max > limit:
                raise ValueError(f"draft_max {n_max} is above what this engine can draft ({limit}"
                                 + (": no draft model)" if d is None else ": the draft's block size or the "
                                    "target's rollback depth)"))
            if n_min > n_max:
                raise ValueError(f"draft_min {n_min} is above draft_max {n_max}")
            n_max = int(n_max)
        mode = draft_positions or self.config.draft_positions
        if mode not in ("target", "sequential"):
            raise ValueError(f"draft_positions must be 'target' or 'sequential', got {mode!r}")
        return n_max, int(n_min), mode

    def _owned(self, steps: Iterator[Piece]) -> Iterator[Piece]:
        """Run a generation's steps while it owns the engine (see gate.py)."""
        ticket = self._gate.enter()
        try:
            if self._gate.dirty:  # an earlier step was cut short and its cleanup did not finish
                with self._gate.run_step(ticket):
                    self._reset_sequence()
            while True:
                with self._gate.run_step(ticket):
                    piece = next(steps, None)
                if piece is None:
                    return
                yield piece
        finally:
            steps.close()  # no native state is touched: the sampler and bitmaps are its own
            self._gate.leave(ticket)

    # ------------------------------------------------------------------ one generation
    def _run(self, request: Request) -> Iterator[Piece]:
        """One generation on the only sequence, step by step on the caller's thread."""
        seq = self.sequences[0]
        scales = self.lora.scales_for(request.lora)
        self.lora.use(seq, scales)  # a prompt cached under other adapters is not reused
        with self._generation(seq, request) as gen:
            try:
                self.lora.apply(self.ctx, scales)
                for _ in gen.prefill(self.ctx.n_batch, self.projector):
                    pass
                piece = gen.start()
                while True:
                    if piece is not None:
                        yield piece
                    if gen.finished:
                        return
                    piece = speculative_step(self.ctx, self.drafter, [gen], self._step_cost)[0]
            except GeneratorExit:
                raise  # the consumer stopped between two steps: the cache is consistent, keep it
            except BaseException:
                seq.reset()  # a step stopped halfway: forget the cache, the next call starts clean
                raise

    def _generation(self, seq: sequence.Sequence | None, request: Request) -> "_PreparedGeneration":
        """A Generation for ``request`` on ``seq`` (tokenized, with its sampler; a scheduler may give it
        its sequence later), as a context manager
        that frees the request's native objects (bitmaps, sampler) when it ends."""
        return _PreparedGeneration(self, seq, request)

    # ------------------------------------------------------------------ prompt
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
        return self.chat.render(messages, options or ChatOptions(**kwargs))

    def _prompt_text(self, prompt, messages, images, chat_options: ChatOptions | None = None,
                     chat: ChatParams | None = None) -> tuple[str, list, ChatParams | None]:
        """The prompt text, its images, and the rendered chat (None for a raw prompt)."""
        image_list = as_list(images)
        if messages is not None:
            chat = self.chat_params(messages, chat_options)
        if chat is not None:
            text = chat.prompt
            image_list = list(chat.images) + image_list
        else:
            text = prompt
        if image_list and self.projector is None:
            raise ImageError("images were given but the engine has no projector: load(..., mmproj=...)")
        if image_list and text.count(MEDIA_MARKER) == 0:
            # Images given without markers go first, as llama.cpp's CLI does.
            text = MEDIA_MARKER * len(image_list) + "\n" + text
        return text, image_list, chat

    def _tokenize(self, text: str | tuple, bitmaps: list[Bitmap]) -> list:
        """The prompt as parts: int32 token arrays (text) and Chunk objects (media); checked against
        a sequence's share of the context. ``text`` may be a mixed prompt (``_mixed_prompt``)."""
        if isinstance(text, tuple):
            parts: list = [self._mixed_tokens(text)]
        else:
            self._refuse_a_prompt_that_cannot_fit(text)
            if self.projector is not None:
                chunks = self.projector.tokenize(text, bitmaps)
                parts = [c.tokens if c.is_text else c for c in chunks]  # media chunks keep `chunks` alive
                if self.draft_projector is not None and bitmaps:  # a vision draft model cuts them with its own
                    pair_with_draft(parts, self.draft_projector.tokenize(text, bitmaps))
            else:
                if MEDIA_MARKER in text:
                    raise ImageError("the prompt has a media marker but the engine has no projector")
                parts = [self.model.tokenize(text, add_special=True)]
        parts = [p for p in parts if not (isinstance(p, np.ndarray) and len(p) == 0)]
        if not parts:
            raise ValueError("the prompt is empty")
        if not isinstance(parts[-1], np.ndarray):
            raise ValueError("the prompt must end with text after the last image")
        rows = sum(len(p) if isinstance(p, np.ndarray) else p.n_tokens for p in parts)
        if rows + 1 > self.ctx.n_ctx_seq:
            raise self._overflow(f"{rows} cache rows")
        return parts

    def _mixed_prompt(self, prompt, images) -> tuple:
        """llama-server's prompt of token ids, or of ids mixed with strings, checked: a tuple of
        strings and int32 arrays (each run of ids one array)."""
        if as_list(images):
            raise ValueError("a prompt of token ids takes no images: give its text with MEDIA_MARKER")
        items = (prompt,) if isinstance(prompt, np.ndarray) else tuple(prompt)
        n_vocab, out, run = self.model.n_vocab, [], []
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

    def _mixed_tokens(self, items: tuple) -> np.ndarray:
        """A mixed prompt's tokens as llama-server's tokenize_mixed makes them: each string tokenized
        (special tokens parsed), the first with the model's BOS when the prompt starts with it."""
        self._refuse_a_prompt_that_cannot_fit("".join(x for x in items if isinstance(x, str)))
        pieces = [self.model.tokenize(x, add_special=i == 0) if isinstance(x, str) else x for i, x in enumerate(items)]
        return np.concatenate(pieces).astype(np.int32) if pieces else np.zeros(0, np.int32)

    def _overflow(self, what: str) -> ContextOverflowError:
        n_ctx = self.ctx.n_ctx_seq
        share = (f"n_ctx is {self.ctx.n_ctx}" if self.config.n_parallel == 1 else
                 f"each of the {self.config.n_parallel} slots has {n_ctx} of n_ctx {self.ctx.n_ctx}")
        return ContextOverflowError(f"the prompt needs {what} (+1 to generate) but {share}; "
                                    "raise n_ctx or shorten the prompt / use smaller images")

    def _refuse_a_prompt_that_cannot_fit(self, text: str) -> None:
        """Refuse, before tokenizing it, a prompt whose text alone cannot fit the context.

        Tokenizing costs many times the text in memory (llama.cpp's tokenizer: about 90 bytes a
        byte) and its time runs inside one native call, so a prompt far over the context is
        refused by what it must cost at least: its bytes over the longest token, or, for a long
        text, the tokens of its first pieces (cut where a line starts, which is a word boundary
        for the BPE pre-tokenizers) once they alone pass the context. Images only add rows.
        """
        n_ctx = self.ctx.n_ctx_seq
        segments = text.split(MEDIA_MARKER)
        n_bytes = sum(len(seg.encode("utf-8", errors="surrogatepass")) for seg in segments)
        if n_bytes < n_ctx:  # fewer bytes than rows: the exact check after tokenizing decides
            return
        at_least = self.model.tokens_at_least(n_bytes)
        if at_least + 1 > n_ctx:
            raise self._overflow(f"at least {at_least} cache rows ({n_bytes} bytes of text)")
        if n_bytes < _COUNT_PIECES_ABOVE * n_ctx:
            return
        counted, pieces = 0, 0
        for piece in _pieces_at_line_starts(segments, _COUNT_PIECE_CHARS):
            counted += len(self.model.tokenize(piece, add_special=False))
            pieces += 1
            if counted > n_ctx + _COUNT_SLACK_PER_PIECE * pieces:
                raise self._overflow(f"more than {counted - _COUNT_SLACK_PER_PIECE * pieces} cache rows "
                                     f"(counted over the first {pieces} pieces of its {n_bytes} bytes of text)")

    # ------------------------------------------------------------------ the cache
    def reset_cache(self) -> None:
        """Forget the cached prompt(s): the next generation decodes everything again."""
        if self._scheduler is not None:
            self._scheduler.reset_all()
            return
        ticket = self._gate.enter()
        try:
            with self._gate.run_step(ticket):
                self._reset_sequence()
        finally:
            self._gate.leave(ticket)

    def _reset_sequence(self) -> None:
        self.sequences[0].reset()

    def _prefill(self, parts: list, stats: GenerationStats, progress: ProgressCallback | None = None) -> None:
        """Decode ``parts`` into the first sequence after what it holds (tests drive the prefill alone)."""
        for _ in prefill_parts(self.sequences[0], parts, stats, self.ctx.n_batch, self.projector, progress):
            pass


class _PreparedGeneration:
    """``with engine._generation(seq, request) as gen``: render and tokenize the prompt, load its
    images, make its sampler and verifier; free the bitmaps and the sampler at the end."""

    def __init__(self, engine: Engine, seq: sequence.Sequence | None, request: Request) -> None:
        self.engine, self.seq, self.request = engine, seq, request
        self._bitmaps: list[Bitmap] = []
        self._sampler: Sampler | None = None

    def __enter__(self) -> Generation:
        e, r = self.engine, self.request
        n_max, n_min, mode = r.drafting
        try:
            text, image_list, chat = e._prompt_text(r.prompt, r.messages, r.images, r.chat_options, r.chat)
            self._bitmaps = [Bitmap.load(im) for im in image_list]
            parts = e._tokenize(text, self._bitmaps)
            stats = GenerationStats(images=len(self._bitmaps), chat_template=chat.renderer if chat else None)
            e.last_stats = stats
            params, stop = r.sampling, r.stop
            if chat is not None:  # the chat's grammar (else the caller's), its stop strings, its budget
                params = dataclasses.replace(params, **chat.sampling())
                stop = [*stop, *chat.additional_stops]
            self._sampler = Sampler(e.model, seed=r.seed, **dataclasses.asdict(params))
            # rejection sampling's numpy chain has no grammar or budget: a chat's constraint verifies by "match"
            rejection = r.verify == "rejection" and not params.greedy and not params.chat_constrained
            verifier = (RejectionVerifier(params, r.seed, e.model.n_vocab) if rejection
                        else MatchVerifier(self._sampler))
            d = e.drafter
            # One cost of a step per engine: its slots share each step, and requests share the hardware.
            if n_max == "auto":
                length = AdaptiveLength(AdaptiveLength.START, d.n_max_limit, cost=e._step_cost)
            else:
                length = FixedLength(n_max)
            return Generation(self.seq, e.model, parts, verifier, stats, max_tokens=r.max_tokens,
                              stop=stop, draft_length=length, draft_min=n_min,
                              cache_prompt=r.cache_prompt, progress=r.progress, draft_positions=mode,
                              draft_tree=r.draft_tree, logprobs=r.logprobs, n_indent=r.n_indent,
                              t_max_predict_ms=r.t_max_predict_ms,
                              special_tokens=_single_tokens(e.model, params.preserved_tokens))
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
