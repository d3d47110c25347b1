"""The speculative engine: multimodal prefill and the draft / verify / accept loop.

>>> import pyllama_spec as ps                                       # doctest: +SKIP
>>> with ps.load(model="t.gguf", mmproj="m.gguf", draft="d.gguf") as engine:
...     result = engine.generate(f"Describe this: {ps.MEDIA_MARKER}", images=["photo.png"])
...     print(result.text, result.stats.acceptance_rate)

One generation, as the loop below reads:
1. prefill the prompt chunk by chunk (text at consecutive positions from ``pos_next``;
   images encoded, then decoded in ``n_batch`` slices with their M-RoPE positions),
   showing every decoded batch to the drafter;
2. sample the first token; then repeat: draft up to ``draft_max`` tokens at ``pos_next``,
   verify ``[id_last, d1..dk]`` on the target, accept the longest prefix the target's
   sampler agrees with plus the target's own next token, show the verify batch to the
   drafter, remove rejected rows from both memories and advance ``pos_next``.
"""

from __future__ import annotations

import codecs
import dataclasses
import os
import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from .drafters import Drafter, Proposal, TargetRows, canonical_spec_type
from .drafters.dflash import DFlashDrafter, check_dflash_pair
from .drafters.draft_model import DraftModelDrafter, check_draft_model
from .drafters.ngram import NgramDrafter
from .draft_length import AdaptiveLength, FixedLength
from .errors import ContextOverflowError, ImageError, KVMemoryError
from .gate import EngineGate
from .llama import Context, Model, Sampler
from .mtmd import MEDIA_MARKER, Bitmap, Chunk, EmbeddingBatch, Projector
from .positions import SequencePositions, is_pinned
from .prompt import as_list, render_messages
from .sampling import SamplingParams
from .stats import GenerationStats, Stopwatch
from .verify import VERIFY_RULES, MatchVerifier, RejectionVerifier

ProgressCallback = Callable[[str, int, int], None]
TOKEN_DRAFT_LIMIT = 32  # the most tokens an n-gram or draft-model draft proposes in one step


@dataclasses.dataclass(frozen=True)
class Piece:
    """A piece of streamed output: the text and tokens accepted in one step.

    The last piece of a stream has ``finish_reason`` and ``stats`` set.
    """

    text: str
    tokens: tuple[int, ...]
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    #: The text released at each of ``tokens`` (joined, they are ``text``). A token's text can show
    #: at a later token: a partial UTF-8 character or a possible stop string is held back until then.
    token_texts: tuple[str, ...] = ()
    #: The first ``from_draft`` of ``tokens`` are draft tokens the target accepted; the rest are the
    #: target's own (a step always ends with one).
    from_draft: int = 0
    #: Tokens the drafter proposed in the step that produced this piece (0 for the first token).
    drafted: int = 0


@dataclasses.dataclass
class Result:
    text: str
    tokens: list[int]
    finish_reason: str  # "stop" (end of generation or a stop string) or "length"
    stats: GenerationStats


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str
    mmproj: str | None = None
    draft: str | None = None
    spec_type: str = "dflash"
    n_ctx: int = 4096
    n_batch: int = 512
    n_ubatch: int = 512
    n_gpu_layers: int = 0
    draft_n_gpu_layers: int | None = None
    draft_max: int = 16
    draft_min: int = 0
    draft_p_min: float = 0.0
    draft_positions: str = "target"
    # At temperature > 0: llama.cpp's exact "match" (the default until rejection sampling's gain is
    # consistent: see bench/RESULTS.md), or "rejection" sampling.
    verify: str = "match"
    flash_attn: bool | None = False
    n_threads: int | None = None
    n_threads_batch: int | None = None
    swa_full: bool = False
    # llama.cpp's -ctk / -ctv (and -ctkd / -ctvd for the draft; None: as the target's)
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    cache_type_k_draft: str | None = None
    cache_type_v_draft: str | None = None
    use_mmap: bool = True  # --no-mmap
    use_mlock: bool = False  # --mlock
    mmproj_offload: bool | None = None  # --(no-)mmproj-offload; None: on when layers are offloaded
    # Devices (devices.py; llama.cpp's --rpc, -dev, -devd, -sm, -ts, -mg): RPC servers' host:port, the
    # target's devices by name (None: llama.cpp's choice, remote ones first; "none": no offload), the
    # draft's (None: this machine's), the split mode, a proportion per device, the main device.
    rpc_servers: Sequence[str] | str = ()
    devices: Sequence[str] | str | None = None
    device_draft: Sequence[str] | str | None = None
    split_mode: str = "layer"
    tensor_split: Sequence[float] | str = ()
    main_gpu: int = 0


def load(model: str | os.PathLike, mmproj: str | os.PathLike | None = None,
         draft: str | os.PathLike | None = None, spec_type: str | None = None, **kwargs: Any) -> "Engine":
    """Load a target (with an optional mmproj and DFlash draft) and return an Engine.

    ``spec_type`` (llama.cpp's names): "draft-dflash" (also "dflash"; the default when a
    draft is given), "draft-simple" (a small model with the target's vocabulary as the
    draft), "ngram-simple" (prompt lookup, no draft model) or "none" (target only).
    Other keywords are EngineConfig's, named as in llama.cpp: n_ctx, n_batch, n_ubatch,
    n_gpu_layers, draft_max, draft_min, draft_p_min, flash_attn, n_threads,
    draft_positions ("target" or "sequential"); where layers go: rpc_servers (["host:port", ...]),
    devices, device_draft, split_mode, tensor_split, main_gpu, draft_n_gpu_layers (also
    n_gpu_layers_draft).
    """
    if spec_type is None:
        spec_type = "draft-dflash" if draft is not None else "none"
    if "n_gpu_layers_draft" in kwargs:  # llama.cpp's name (-ngld) for draft_n_gpu_layers
        ngld = kwargs.pop("n_gpu_layers_draft")
        if kwargs.get("draft_n_gpu_layers", ngld) != ngld:
            raise ValueError("n_gpu_layers_draft and draft_n_gpu_layers are one setting: give one of them")
        kwargs["draft_n_gpu_layers"] = ngld
    cfg = EngineConfig(model=os.fspath(model), mmproj=os.fspath(mmproj) if mmproj else None,
                       draft=os.fspath(draft) if draft else None, spec_type=spec_type, **kwargs)
    return Engine(cfg)


class Engine:
    """Target + optional projector + optional drafter, for one sequence at a time.

    Safe to share between threads: generations run one at a time, and a call made while
    another thread's generation runs waits for it to finish. On one thread, starting a
    generation while a ``stream()`` is suspended cancels that stream: resuming it raises
    ``GenerationCancelledError`` instead of continuing on a cache that changed under it.
    """

    def __init__(self, config: EngineConfig) -> None:
        config = dataclasses.replace(config, spec_type=canonical_spec_type(config.spec_type))
        if config.spec_type.startswith("draft-") and config.draft is None:
            raise ValueError(f"spec_type={config.spec_type!r} needs a draft model (draft=...)")
        if config.n_ubatch > config.n_batch:
            raise ValueError(f"n_ubatch ({config.n_ubatch}) cannot exceed n_batch ({config.n_batch})")
        self.config = config
        self._gate = EngineGate()
        #: The stats of the latest generation, also while it runs and after it was interrupted.
        self.last_stats: GenerationStats | None = None
        self.positions = SequencePositions(config.draft_positions)
        self._draft_length = FixedLength(0)  # how many tokens the generation in progress drafts per step
        self._draft_min = 0
        self._cached: list = []  # what the cache holds: int32 token arrays (text) and _CachedMedia, in order
        self.projector: Projector | None = None
        self.drafter: Drafter | None = None
        self.draft_model: Model | None = None
        self.ctx: Context | None = None
        self._check_before_load()
        self.model = Model(config.model, n_gpu_layers=config.n_gpu_layers, use_mmap=config.use_mmap,
                           use_mlock=config.use_mlock, role="target", placement=self.placement.target)
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _check_before_load(self) -> None:
        """Refuse, before allocating anything: a bad file, a context past the training length, device
        options that do not fit (devices.py; RPC servers are reached here) and a configuration the
        devices cannot hold (memory.py). Resolves n_ctx=0 to the training length."""
        from . import devices, memory
        from .errors import InsufficientMemoryError
        from .gguf_check import read_gguf_shared
        from .llama import check_gguf_file

        c = self.config
        for path, what in ((c.model, "target model"), (c.draft, "draft model"), (c.mmproj, "mmproj")):
            if path is not None:
                check_gguf_file(path, what)  # a clear error for a bad file comes first
        info = read_gguf_shared(c.model)
        n_ctx_train = int(info.metadata.get(f"{info.arch}.context_length", 0) or 0)
        if c.n_ctx == 0 and n_ctx_train:  # llama.cpp's -c 0: the model's training length
            c = self.config = dataclasses.replace(c, n_ctx=n_ctx_train)
        if n_ctx_train and c.n_ctx > n_ctx_train:
            raise ValueError(f"n_ctx {c.n_ctx} is above the target's training length ({n_ctx_train} tokens, "
                             f"{info.arch}.context_length): positions past it were never trained; use -c "
                             f"{n_ctx_train} or less (or -c 0 for exactly that)")
        self.placement = devices.plan(c)
        draft = c.draft if c.spec_type == "draft-dflash" else None
        est = memory.estimate(c.model, mmproj=c.mmproj, draft=draft, n_ctx=c.n_ctx, n_ubatch=c.n_ubatch,
                              cache_type_k=c.cache_type_k, cache_type_v=c.cache_type_v,
                              cache_type_k_draft=c.cache_type_k_draft, cache_type_v_draft=c.cache_type_v_draft)
        budget = self.placement.memory_budget(c.n_gpu_layers)  # (device(s), free bytes)
        if budget is not None and budget[1] and not est.fits(budget[1]):
            raise InsufficientMemoryError(
                f"this configuration needs about {est.total / memory.MiB:.0f} MiB but {budget[0]} has "
                f"{budget[1] / memory.MiB:.0f} MiB free: {est.describe()}. Lower -c (n_ctx), use a quantized "
                "KV cache (-ctk/-ctv q8_0 with -fa on), or a smaller -ub")
        self.memory_estimate = est

    def _load_draft_model(self) -> Model:
        c = self.config
        return Model(c.draft, role="draft", n_gpu_layers=c.n_gpu_layers if c.draft_n_gpu_layers is None
                     else c.draft_n_gpu_layers, use_mmap=c.use_mmap, use_mlock=c.use_mlock,
                     placement=self.placement.draft)

    def _draft_cache_types(self) -> dict:
        c = self.config
        return dict(type_k=c.cache_type_k_draft or c.cache_type_k, type_v=c.cache_type_v_draft or c.cache_type_v)

    def _open(self) -> None:
        c = self.config
        dflash = None
        if c.spec_type == "draft-dflash":
            from ._native import build_record

            self.draft_model = self._load_draft_model()
            dflash = check_dflash_pair(self.model, self.draft_model,
                                       build_record().get("dflash_target_archs"))
        elif c.spec_type == "draft-simple":
            self.draft_model = self._load_draft_model()
            check_draft_model(self.model, self.draft_model)
        # A recurrent/hybrid target rolls back rejected drafts through state snapshots: one per
        # position that may be rolled back (llama.cpp also needs n_ubatch > n_rs_seq + 1).
        limit = dflash.block_size - 1 if dflash else TOKEN_DRAFT_LIMIT
        draft_max = min(c.draft_max, limit) if c.spec_type != "none" else 0
        n_rs_seq = 0
        if draft_max and self.model.is_recurrent:
            n_rs_seq = min(draft_max, c.n_ubatch - 2)
            if n_rs_seq < 1:
                raise ValueError(f"a recurrent target needs n_ubatch >= 3 to roll back drafts, got {c.n_ubatch}")
            draft_max = n_rs_seq
        self.ctx = Context(self.model, n_ctx=c.n_ctx, n_batch=c.n_batch, n_ubatch=c.n_ubatch, n_rs_seq=n_rs_seq,
                           n_threads=c.n_threads, n_threads_batch=c.n_threads_batch, type_k=c.cache_type_k,
                           type_v=c.cache_type_v, flash_attn=c.flash_attn, role="target")
        if c.mmproj:
            offload = c.n_gpu_layers != 0 if c.mmproj_offload is None else c.mmproj_offload
            self.projector = Projector(c.mmproj, self.model, use_gpu=offload, n_threads=c.n_threads,
                                       flash_attn=c.flash_attn)
        if dflash is not None:
            self.drafter = DFlashDrafter(self.ctx, self.draft_model, dflash, self.positions, n_max=draft_max,
                                         n_min=c.draft_min, p_min=c.draft_p_min, n_ubatch=c.n_ubatch,
                                         n_threads=c.n_threads, flash_attn=c.flash_attn, swa_full=c.swa_full,
                                         **self._draft_cache_types())
        elif c.spec_type == "ngram-simple":
            self.drafter = NgramDrafter(n_max=draft_max, n_min=c.draft_min, n_max_limit=limit)
        elif c.spec_type == "draft-simple":
            self.drafter = DraftModelDrafter(self.draft_model, self.positions, n_ctx=c.n_ctx, n_max=draft_max,
                                             n_min=c.draft_min, n_max_limit=limit, n_batch=c.n_batch,
                                             n_threads=c.n_threads, flash_attn=c.flash_attn,
                                             **self._draft_cache_types())
        if self.drafter is not None and n_rs_seq:
            self.drafter.n_max_limit = n_rs_seq  # rollback snapshots bound how far a draft can go

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Free everything native. Waits for a step running on another thread; a suspended stream is cancelled."""
        self._gate.close()
        for obj in (self.drafter, self.projector, self.ctx, self.draft_model, self.model):
            if obj is not None:
                obj.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ public API
    def generate(self, prompt: str | None = None, **kwargs: Any) -> Result:
        """Generate a completion: ``stream``'s arguments, the pieces joined into one Result."""
        text, tokens, last = [], [], None
        for piece in self.stream(prompt, **kwargs):
            text.append(piece.text)
            tokens.extend(piece.tokens)
            last = piece
        assert last is not None and last.stats is not None
        return Result("".join(text), tokens, last.finish_reason or "stop", last.stats)

    def stream(self, prompt: str | None = None, *, messages: Sequence[dict] | None = None, images=(),
               max_tokens: int = 128, temperature: float = 0.0, top_k: int = 40, top_p: float = 0.95,
               min_p: float = 0.05, presence_penalty: float = 0.0, seed: int = 0,
               stop: Sequence[str] | str = (), cache_prompt: bool = True,
               progress: ProgressCallback | None = None, draft_max: int | None = None,
               draft_min: int | None = None, draft_positions: str | None = None,
               verify: str | None = None, chat_template_kwargs: dict | None = None) -> Iterator[Piece]:
        """Yield pieces of text as the target accepts them; the last piece carries the stats.

        ``prompt`` is used as is, with ``MEDIA_MARKER`` where each image goes; ``messages``
        go through the model's own Jinja chat template (``chat_template_kwargs`` are extra
        variables for it, e.g. ``{"enable_thinking": False}``), or llama.cpp's built-in one
        when it cannot be rendered (``stats.chat_template`` says which). Images: paths, bytes, PIL images or arrays.
        With ``cache_prompt`` (the default) the longest prefix already in the cache (earlier
        turns' text and images) is kept and only the rest is decoded. ``progress(stage, done,
        total)`` is called during prefill ("encode" per image, "prefill" per decoded batch).
        ``max_tokens=0`` decodes the prompt (filling the cache) and generates nothing.
        ``draft_max`` / ``draft_min`` / ``draft_positions`` override the engine's speculative
        settings for this call (``draft_max=0`` turns drafting off; ``draft_max="auto"``
        adapts the length step by step, see draft_length.py; a different position mode
        starts from an empty cache).

        ``verify`` (default: the engine's, "match") decides acceptance at temperature > 0:
        "rejection" sampling follows the target's distribution exactly and accepts more;
        "match" is llama.cpp's rule, with the same tokens as a target-only run for a seed.
        Greedy decoding is the same under both.

        The generation owns the engine from its first step to its end (see ``Engine``).
        """
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {max_tokens!r}")
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt= or messages=")
        drafting = self._draft_settings(draft_max, draft_min, draft_positions)
        verify = verify or self.config.verify
        if verify not in VERIFY_RULES:
            raise ValueError(f"verify must be one of {VERIFY_RULES}, got {verify!r}")
        request = dict(prompt=prompt, messages=messages, images=images, max_tokens=int(max_tokens),
                       drafting=drafting, verify=verify,
                       sampling=dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                     presence_penalty=presence_penalty, seed=seed),
                       stop=[stop] if isinstance(stop, str) else list(stop), cache_prompt=cache_prompt,
                       progress=progress, template_kwargs=chat_template_kwargs)
        return self._owned(self._run(**request))

    def _draft_settings(self, draft_max, draft_min, draft_positions) -> tuple[int | str, int, str]:
        """(n_max or "auto", n_min, position mode) for one call, checked against what this engine can do."""
        d = self.drafter
        if draft_max == "auto" and d is None:
            raise ValueError('draft_max="auto" needs a drafter (spec_type other than "none")')
        n_max = (d.n_max if d else 0) if draft_max is None else draft_max
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
        mode = draft_positions or self.positions.draft_positions
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

    def _run(self, prompt, messages, images, max_tokens, drafting, verify, sampling, stop, cache_prompt,
             progress, template_kwargs) -> Iterator[Piece]:
        n_max, n_min, mode = drafting
        if mode != self.positions.draft_positions:  # the draft's cache is laid out by the mode
            self._reset_sequence()
            self.positions.draft_positions = mode
        d = self.drafter
        self._draft_length = (AdaptiveLength(d.n_max, d.n_max_limit) if n_max == "auto" else FixedLength(n_max))
        self._draft_min = n_min
        text, image_list, renderer = self._prompt_text(prompt, messages, images, template_kwargs)
        bitmaps = [Bitmap.load(im) for im in image_list]
        try:
            parts = self._tokenize(text, bitmaps)
            stats = self.last_stats = GenerationStats(images=len(bitmaps), chat_template=renderer)
            with Sampler(self.model, **sampling) as sampler:
                params = SamplingParams(**{k: v for k, v in sampling.items() if k != "seed"})
                verifier = (RejectionVerifier(params, sampling["seed"], self.model.n_vocab)
                            if verify == "rejection" and not params.greedy else MatchVerifier(sampler))
                yield from self._generate(parts, verifier, stats, max_tokens, stop, cache_prompt, progress)
        finally:
            for b in bitmaps:
                b.close()

    # ------------------------------------------------------------------ prompt
    def _prompt_text(self, prompt, messages, images, template_kwargs=None) -> tuple[str, list, str | None]:
        """The prompt text, its images, and the chat template renderer used (None for a raw prompt)."""
        image_list = as_list(images)
        renderer = None
        if messages is not None:
            text, message_images, renderer = render_messages(self.model, messages, template_kwargs=template_kwargs)
            image_list = message_images + image_list
        else:
            text = prompt
        if image_list and self.projector is None:
            raise ImageError("images were given but the engine has no projector: load(..., mmproj=...)")
        if image_list and text.count(MEDIA_MARKER) == 0:
            # Images given without markers go first, as llama.cpp's CLI does.
            text = MEDIA_MARKER * len(image_list) + "\n" + text
        return text, image_list, renderer

    def _tokenize(self, text: str, bitmaps: list[Bitmap]) -> list:
        """The prompt as parts: int32 token arrays (text) and Chunk objects (media); checked against n_ctx."""
        if self.projector is not None:
            chunks = self.projector.tokenize(text, bitmaps)
            parts: list = [c.tokens if c.is_text else c for c in chunks]  # media chunks keep `chunks` alive
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
        if rows + 1 > self.ctx.n_ctx:
            raise ContextOverflowError(f"the prompt needs {rows} cache rows (+1 to generate) but n_ctx is "
                                       f"{self.ctx.n_ctx}; raise n_ctx or shorten the prompt / use smaller images")
        return parts

    # ------------------------------------------------------------------ the algorithm
    def _generate(self, parts: list, verifier, stats: GenerationStats, max_tokens: int,
                  stop: list[str], cache_prompt: bool, progress: ProgressCallback | None) -> Iterator[Piece]:
        t0 = time.perf_counter()
        try:
            yield from self._generate_steps(parts, verifier, stats, max_tokens, stop, cache_prompt, progress, t0)
        except GeneratorExit:
            raise  # the consumer stopped between two steps: the cache is consistent, keep it
        except BaseException:
            self._reset_sequence()  # a step stopped halfway: forget the cache, the next call starts clean
            raise

    def _generate_steps(self, parts, verifier, stats, max_tokens, stop, cache_prompt, progress, t0):
        todo = self._reuse_cached_prefix(parts) if cache_prompt else self._start_over(parts)
        stats.prompt_reused = self.positions.n_rows
        self._prefill(todo, stats, progress)
        stats.prompt_tokens, stats.prompt_positions = self.positions.n_rows, self.positions.pos_next
        if max_tokens == 0:
            stats.prefill_seconds = time.perf_counter() - t0
            yield Piece("", (), "length", stats)
            return
        with Stopwatch(stats, "target_seconds"):
            id_last = verifier.first(self.ctx)
        t1 = time.perf_counter()
        stats.prefill_seconds = t1 - t0
        prefill_target, prefill_draft = stats.target_seconds, stats.draft_seconds

        out = _TextAssembler(self.model, stop)
        generated, new_tokens, drafted = 0, [id_last], 0
        while True:
            # Show what the last step produced, then decide whether to go on.
            emit, finish = self._emittable(new_tokens, generated, max_tokens)
            generated += len(emit)
            stats.generated_tokens = generated  # kept current: an interrupted stream's stats stay true
            stats.decode_seconds = time.perf_counter() - t1
            texts, hit_stop = out.push_each(emit)
            if hit_stop:
                finish = "stop"
            if finish is None and self.positions.n_rows + 1 > self.ctx.n_ctx:
                finish = "length"  # no cache row left for the next token
            # All but the last of a step's tokens are accepted drafts (the first token has no draft).
            origin = dict(token_texts=texts, from_draft=min(len(emit), len(new_tokens) - 1), drafted=drafted)
            if finish is not None:
                break
            if emit:
                yield Piece("".join(texts), tuple(emit), **origin)
            new_tokens, drafted = self._speculative_step(new_tokens[-1], verifier, stats, max_tokens - generated)

        stats.decode_seconds = time.perf_counter() - t1
        stats.decode_target_seconds = stats.target_seconds - prefill_target
        stats.decode_draft_seconds = stats.draft_seconds - prefill_draft
        rest = out.flush()
        if rest:
            texts = (*texts[:-1], texts[-1] + rest) if texts else texts
        yield Piece("".join(texts) + ("" if emit else rest), tuple(emit), finish, stats, **origin)

    def _emittable(self, tokens: list[int], generated: int, max_tokens: int) -> tuple[list[int], str | None]:
        """The tokens to show from one step, cut at end-of-generation or the token limit."""
        emit = []
        for tok in tokens:
            if self.model.is_eog(tok):
                return emit, "stop"
            emit.append(tok)
            if generated + len(emit) >= max_tokens:
                return emit, "length"
        return emit, None

    # ------------------------------------------------------------------ the prompt cache
    def _start_over(self, parts: list) -> list:
        self._reset_sequence()
        return parts

    def _reuse_cached_prefix(self, parts: list) -> list:
        """Keep the longest prefix of ``parts`` already in both caches; return what is left to decode."""
        i, j = _common_prefix(self._cached, parts)
        if i == len(parts) or (i == len(parts) - 1 and j == len(parts[-1])):
            # All of it is cached: decode the last token again for fresh logits.
            i, j = len(parts) - 1, len(parts[-1]) - 1
        if i == 0 and j == 0:
            return self._start_over(parts)
        keep = self._cached[:i] + ([self._cached[i][:j]] if j else [])
        pos = sum(len(c) if isinstance(c, np.ndarray) else c.n_pos for c in keep)
        try:
            self.ctx.memory.remove(0, pos, -1)
            if self.drafter is not None:
                self.drafter.truncate(pos)
        except KVMemoryError:
            return self._start_over(parts)  # e.g. a recurrent target cannot roll back that far
        self.positions.truncate(pos)
        self._cached = keep
        rest = list(parts[i:])
        if j:
            rest[0] = rest[0][j:]
        return rest

    def _remember_text(self, tokens: np.ndarray) -> None:
        if self._cached and isinstance(self._cached[-1], np.ndarray):
            self._cached[-1] = np.concatenate([self._cached[-1], tokens])
        else:
            self._cached.append(np.asarray(tokens, dtype=np.int32).copy())

    def reset_cache(self) -> None:
        """Forget the cached prompt: the next generation decodes everything again."""
        ticket = self._gate.enter()
        try:
            with self._gate.run_step(ticket):
                self._reset_sequence()
        finally:
            self._gate.leave(ticket)

    def _reset_sequence(self) -> None:
        self._cached = []
        self.ctx.memory.clear()
        self.positions.reset()
        if self.drafter is not None:
            self.drafter.reset()

    def _prefill(self, parts: list, stats: GenerationStats, progress: ProgressCallback | None = None) -> None:
        n_batch = self.ctx.n_batch
        total = sum(len(p) if isinstance(p, np.ndarray) else p.n_tokens for p in parts)
        done = 0
        for i, part in enumerate(parts):
            if isinstance(part, np.ndarray):
                last_part = i == len(parts) - 1
                for s in range(0, len(part), n_batch):
                    tokens = part[s:s + n_batch]
                    outputs = np.zeros(len(tokens), dtype=np.int8)
                    if last_part and s + n_batch >= len(part):
                        outputs[-1] = 1
                    self._decode_text(tokens, outputs, stats)
                    self.positions.advance_text(len(tokens))
                    self._remember_text(tokens)
                    done += len(tokens)
                    if progress:
                        progress("prefill", done, total)
            else:
                if progress:
                    progress("encode", done, total)
                report = (lambda rows, at=done: progress("prefill", at + rows, total)) if progress else None
                self._prefill_media(part, stats, report)
                self._cached.append(_CachedMedia(part.id, part.n_tokens, part.n_pos))
                done += part.n_tokens

    def _decode_text(self, tokens: np.ndarray, outputs, stats: GenerationStats) -> None:
        """Decode token rows at pos_next.. into the target, then show them to the drafter.

        The caller advances the positions once it knows how many rows stay.
        """
        p = self.positions
        pos = np.arange(p.pos_next, p.pos_next + len(tokens), dtype=np.int32)
        with Stopwatch(stats, "target_seconds"):
            self.ctx.decode_tokens(tokens, pos, outputs=outputs)
        if self.drafter is not None:
            with Stopwatch(stats, "draft_seconds"):
                self.drafter.process(TargetRows(pos[None, :], False, p.draft_pos_next, tokens=tokens))

    def _prefill_media(self, chunk: Chunk, stats: GenerationStats,
                       report: Callable[[int], None] | None = None) -> None:
        """Encode a media chunk and decode its rows in n_batch slices; ``report(rows decoded so far)``."""
        p = self.positions
        with Stopwatch(stats, "target_seconds"):
            embd = self.projector.encode(chunk)
        decoded = [0]  # rows of this chunk decoded so far
        pinned = is_pinned(chunk.n_tokens, chunk.n_pos)  # for the whole chunk, whatever its slices

        def on_batch(b: EmbeddingBatch) -> None:
            if self.drafter is not None:
                # (first_draft_pos matters in "sequential" mode only, where every row takes a draft position)
                rows = TargetRows(b.positions, True, p.draft_pos_next + decoded[0], pinned=pinned)
                with Stopwatch(stats, "draft_seconds"):
                    self.drafter.process(rows)
            decoded[0] += b.n_rows
            if report is not None:
                report(decoded[0])

        draft_before = stats.draft_seconds
        with Stopwatch(stats, "target_seconds"):
            new_pos = self.projector.decode_media(self.ctx, chunk, embd, p.pos_next, n_batch=self.ctx.n_batch,
                                                  on_batch=on_batch)
        stats.target_seconds -= stats.draft_seconds - draft_before  # the drafter ran inside that call
        p.advance_media(chunk.n_tokens, chunk.n_pos)
        assert new_pos == p.pos_next, (new_pos, p)

    def _speculative_step(self, id_last: int, verifier, stats: GenerationStats, budget: int) -> tuple[list[int], int]:
        """One draft/verify/accept step: (the tokens the target accepted, the last being the new id_last;
        how many tokens were drafted)."""
        p = self.positions
        step_start = time.perf_counter()
        proposal = Proposal([])
        room = self.ctx.n_ctx - p.n_rows - 1
        want, n_min = self._draft_length.next(), self._draft_min
        n_max = min(want, budget - 1, room, self.ctx.n_batch - 1)
        if self.drafter is not None and n_max > 0:
            with Stopwatch(stats, "draft_seconds"):
                proposal = self.drafter.draft(id_last, n_max, n_min)
        draft = verifier.proposal_tokens(proposal)  # rejection sampling draws x ~ q here
        tokens = np.array([id_last, *draft], dtype=np.int32)
        self._decode_text(tokens, True, stats)  # verify: logits on every row
        with Stopwatch(stats, "target_seconds"):
            accepted = verifier.accept(self.ctx, draft, proposal)
        n_kept = len(accepted)  # id_last + the accepted drafts
        if n_kept < len(tokens):
            self.ctx.memory.remove(0, p.pos_next + n_kept, -1)
        if self.drafter is not None:
            with Stopwatch(stats, "draft_seconds"):
                self.drafter.accept(n_kept)
        p.advance_text(n_kept)
        self._remember_text(tokens[:n_kept])
        stats.record_step(len(draft), n_kept - 1)
        self._draft_length.update(len(draft), n_kept - 1, time.perf_counter() - step_start)
        stats.target_steps += 1
        return accepted, len(draft)


@dataclasses.dataclass(frozen=True)
class _CachedMedia:
    id: str | None
    n_tokens: int
    n_pos: int


def _common_prefix(cached: list, parts: list) -> tuple[int, int]:
    """(i, j): the first i parts match whole, and the first j tokens of part i (text) too."""
    for i, (c, p) in enumerate(zip(cached, parts)):
        if isinstance(c, np.ndarray) and isinstance(p, np.ndarray):
            m = min(len(c), len(p))
            same = c[:m] == p[:m]
            j = m if same.all() else int(np.argmin(same))
            if j == len(c) == len(p):
                continue
            return i, j
        if isinstance(c, _CachedMedia) and not isinstance(p, np.ndarray) and c.id and c.id == p.id \
                and (c.n_tokens, c.n_pos) == (p.n_tokens, p.n_pos):
            continue
        return i, 0
    return min(len(cached), len(parts)), 0


class _TextAssembler:
    """Token bytes -> text, holding back partial UTF-8 and any tail that may start a stop string."""

    def __init__(self, model: Model, stop: list[str]) -> None:
        self.model = model
        self.stop = [s for s in stop if s]
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.held = ""
        self.stopped = False

    def push_each(self, tokens: list[int]) -> tuple[tuple[str, ...], bool]:
        """``push`` token by token: the text released at each token, and whether a stop string was hit."""
        texts = [self.push([tok])[0] for tok in tokens]  # after a stop string, each releases ""
        return tuple(texts), self.stopped

    def push(self, tokens: list[int]) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        text = self.held + "".join(self.decoder.decode(self.model.token_to_bytes(t)) for t in tokens)
        for s in self.stop:
            at = text.find(s)
            if at >= 0:
                self.stopped = True
                self.held = ""
                return text[:at], True
        keep = max((k for s in self.stop for k in range(len(s) - 1, 0, -1) if text.endswith(s[:k])), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        if self.stopped:
            return ""
        rest, self.held = self.held + self.decoder.decode(b"", final=True), ""
        return rest
