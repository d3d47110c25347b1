"""One generation's request, in two forms, after llama.cpp's ``task_params``:

* ``RequestOptions``: what a caller gave (the Python API's keywords, a server request's fields),
  every setting ``None`` where it was not given;
* ``Request``: the same request resolved once by ``serving.resolver.RequestResolver`` against an
  engine, its defaults applied and every value checked, in typed parts (what to feed the model,
  sampling, drafting, output). The slot loop runs a ``Request``; ``/slots`` and
  ``generation_settings`` print one.

Every front door (``Engine.stream``/``generate``/``submit``, the HTTP server) builds a
``RequestOptions`` and has the engine resolve it; no dict of keyword arguments crosses a layer.
Pure Python: nothing native here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from pyllama_spec.speculative.sampling import SamplingParams

#: A progress callback: (stage, rows done, rows in all); see speculative/generation.py.
Progress = Callable[[str, int, int], None]


@dataclasses.dataclass(frozen=True)
class RequestOptions:
    """A request as given. A setting left ``None`` takes the engine's default (its load's
    ``sampling``, ``draft_max``, ``verify``, ...); the others have the defaults written here (as
    ``Engine.stream`` documents them). ``sampling`` holds the sampler settings given, by name
    (``SamplingParams``' fields, and ``grammar``, ``json_schema``, ``ignore_eos``): build it with
    ``RequestOptions.of(prompt, temperature=0.7, ...)``, which sorts keywords into both."""

    prompt: Any = None  # a raw prompt (MEDIA_MARKER where each image goes), or token ids mixed with strings
    messages: Sequence[Any] | None = None  # chat messages through the model's template, or
    chat: Any = None  # a chat rendered already (serving.chat_template.ChatParams)
    images: Any = ()  # paths, bytes, PIL images or RGB arrays, in marker order
    chat_options: Any = None  # ChatOptions of ``messages`` (tools, template variables, ...)
    chat_template_kwargs: Mapping[str, Any] | None = None  # more template variables
    max_tokens: int = 128
    seed: int | None = None
    stop: Sequence[str] | str = ()
    cache_prompt: bool = True
    progress: Progress | None = None
    draft_max: int | str | None = None
    draft_min: int | None = None
    draft_positions: str | None = None
    verify: str | None = None
    draft_tree: int | None = None
    logprobs: int | None = None
    post_sampling_probs: bool = False  # logprobs as probabilities after the sampler chain (llama-server's)
    lora: Any = None  # [{"id": i, "scale": s}, ...]; None: the engine's global scales
    n_indent: int = 0
    t_max_predict_ms: float = 0
    #: the sampler settings given (SamplingParams' fields, plus grammar/json_schema/ignore_eos)
    sampling: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, prompt: Any = None, **kwargs: Any) -> "RequestOptions":
        """The options of ``Engine.stream``'s keywords: its named ones, the rest sampler settings."""
        sampling = {k: kwargs.pop(k) for k in list(kwargs) if k not in _OPTION_NAMES}
        return cls(prompt=prompt, sampling=sampling, **kwargs)

    def replace(self, **changes: Any) -> "RequestOptions":
        return dataclasses.replace(self, **changes)


_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(RequestOptions)) - {"sampling"}


@dataclasses.dataclass(frozen=True)
class PromptInput:
    """What the model reads: exactly one of ``text`` (a raw or mixed prompt), ``messages`` (to be
    rendered by the chat template with ``chat_options``) or ``chat`` (rendered already)."""

    text: str | tuple | None  # a raw prompt, or a mixed prompt: strings and int32 arrays of token ids
    messages: Sequence[Any] | None
    chat: Any
    images: tuple
    chat_options: Any


@dataclasses.dataclass(frozen=True)
class DraftSettings:
    """How this request drafts and verifies (checked against what the engine can draft)."""

    n_max: int | str  # tokens drafted per step at most, or "auto" (speculative/draft_length.py); 0: none
    n_min: int
    positions: str  # "target" or "sequential" (speculative/positions.py)
    tree: int  # > 0: verify a tree of this many drafted tokens (speculative/tree.py)
    verify: str  # "match" (llama.cpp's rule) or "rejection"


@dataclasses.dataclass(frozen=True)
class OutputOptions:
    """How much to generate and what each piece carries."""

    max_tokens: int
    stop: tuple[str, ...]
    logprobs: int | None  # per emitted token: its log-probability and this many top alternatives
    n_indent: int  # llama-server's line rules (speculative/line_rules.py); 0: off
    t_max_predict_ms: float
    #: with logprobs: each token's probability after the sampler chain instead (speculative/logprobs.py)
    post_sampling_probs: bool = False


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation, resolved: the engine's defaults applied, every value checked."""

    prompt: PromptInput
    sampling: SamplingParams  # llama-server's samplers and their settings (a json_schema as its grammar)
    seed: int
    draft: DraftSettings
    output: OutputOptions
    cache_prompt: bool
    lora: tuple[float, ...] | None = None  # a scale per LoRA adapter (serving/lora.py); None: the global ones
    progress: Progress | None = None
    ignore_eos: bool = False  # llama-server's: every end-of-generation token forbidden (serving/prepared.py)
    #: the resolver that checked it against its engine's limits (an engine runs only its own)
    resolved_by: Any = dataclasses.field(default=None, repr=False, compare=False)

    def with_progress(self, progress: Progress | None) -> "Request":
        """The same request reporting its prefill to ``progress`` (nothing else may change:
        other settings are the resolver's to check)."""
        return dataclasses.replace(self, progress=progress)
