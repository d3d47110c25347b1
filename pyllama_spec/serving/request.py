"""One generation's arguments, checked and normalised: what ``Engine.stream``/``submit`` hand to
a generation (directly, or through the scheduler, which keeps it without reading it)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from pyllama_spec.spec.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: str | tuple[int | str, ...] | None  # a raw prompt (MEDIA_MARKER where each image goes), or
    # token ids mixed with strings (llama-server's mixed prompt), or
    messages: Sequence[Any] | None  # chat messages through the model's template, or
    chat: Any  # a chat rendered already (serving.prompt.ChatParams), or None
    images: Any  # paths, bytes, PIL images or RGB arrays, in marker order
    max_tokens: int
    drafting: tuple[int | str, int, str]  # (draft_max or "auto", draft_min, draft position mode)
    verify: str  # "match" or "rejection"
    draft_tree: int  # > 0: verify a tree of this many drafted tokens
    sampling: SamplingParams  # checked: llama-server's samplers and their settings
    seed: int
    stop: list[str]
    cache_prompt: bool
    progress: Callable[[str, int, int], None] | None
    chat_options: Any  # serving.prompt.ChatOptions of ``messages`` (tools, template variables, ...), or None
    logprobs: int | None = None  # per emitted token: its log-probability and this many top alternatives
    n_indent: int = 0  # llama-server's line rules (spec/line_rules.py); 0: off
    t_max_predict_ms: float = 0
    lora: tuple[float, ...] | None = None  # a scale per LoRA adapter (serving/lora.py); None: the global ones
