"""``draft_model=`` for ``Llama``: llama-cpp-python's ``LlamaDraftModel`` and
``LlamaPromptLookupDecoding``, and this project's drafters as draft models of the same kind.

Every draft model here runs inside the engine (its slot loop drafts and verifies); the output is the
target's own under greedy decoding, with or without one:

* ``LlamaPromptLookupDecoding(num_pred_tokens=10)``: prompt lookup, drafted by the engine's n-gram
  drafter (``ngram-simple``, up to ``num_pred_tokens`` a step). ``find_candidate_pred_tokens`` and
  calling it keep llama-cpp-python's own lookup (for code that calls it directly);
* ``DFlashDraft(path)``, ``Eagle3Draft(path)``: a DFlash (or DFlash2) / EAGLE3 draft file for the
  target; ``MTPDraft()``: the target's own multi-token-prediction head; ``DraftModel(path,
  clip_model_path=None)``: a small model of the target's vocabulary, which sees pictures through its own
  projector when given one. Each takes ``num_pred_tokens`` (an int, or ``"auto"``) and
  ``draft_positions`` where it applies.

A ``LlamaDraftModel`` subclass of your own (``__call__(input_ids) -> token ids``) is called by the
engine at every step (drafters/python_callable.py), as llama-cpp-python calls it: ``input_ids`` are
the tokens so far and the last sampled one (a picture's rows left out); what it proposes is cut to
the step's draft length (32 at most) and verified by the target.
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np


class LlamaDraftModel(abc.ABC):
    """llama-cpp-python's draft model interface: ``__call__(input_ids) -> proposed token ids``."""

    @abc.abstractmethod
    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        raise NotImplementedError()


class EngineDraft(LlamaDraftModel):
    """A draft model the engine runs: ``engine_settings()`` are its ``pyllama_spec.load`` keywords."""

    def __init__(self, spec_type: str, *, num_pred_tokens: int | str | None = None, **settings: Any) -> None:
        if num_pred_tokens is not None and num_pred_tokens != "auto" and (
                not isinstance(num_pred_tokens, int) or num_pred_tokens < 1):
            raise ValueError(f'num_pred_tokens must be an integer >= 1 or "auto", got {num_pred_tokens!r}')
        self.spec_type = spec_type
        self.num_pred_tokens = num_pred_tokens
        self._settings = {k: v for k, v in settings.items() if v is not None}

    def engine_settings(self) -> dict[str, Any]:
        out = dict(self._settings, spec_type=self.spec_type)
        if self.num_pred_tokens is not None:
            out["draft_max"] = self.num_pred_tokens
        return out

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        raise TypeError(f"{type(self).__name__} drafts inside the engine: pass it as Llama(..., draft_model=...)")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.engine_settings().items())})"


class LlamaPromptLookupDecoding(EngineDraft):
    """Prompt lookup decoding (https://github.com/apoorvumang/prompt-lookup-decoding): the engine's
    n-gram drafter proposes up to ``num_pred_tokens`` tokens that followed an earlier occurrence of the
    last tokens. ``max_ngram_size`` is kept for ``find_candidate_pred_tokens``; the engine's drafter
    tries keys of 4 down to 2 tokens (llama.cpp's ngram-simple)."""

    def __init__(self, max_ngram_size: int = 2, num_pred_tokens: int = 10) -> None:
        super().__init__("ngram-simple", num_pred_tokens=num_pred_tokens)
        self.max_ngram_size = max_ngram_size

    @staticmethod
    def find_candidate_pred_tokens(input_ids: np.ndarray, max_ngram_size: int, num_pred_tokens: int) -> np.ndarray:
        """llama-cpp-python's lookup, as it has it: the first earlier match of the longest key (of up to
        ``max_ngram_size`` tokens) with a continuation; an empty array where none has one."""
        input_length = input_ids.shape[0]
        for ngram_size in range(min(max_ngram_size, input_length - 1), 0, -1):
            windows = np.lib.stride_tricks.sliding_window_view(input_ids, (ngram_size,))
            matches = np.all(windows == input_ids[-ngram_size:], axis=1)
            for idx in np.nonzero(matches)[0]:
                start = idx + ngram_size
                end = min(start + num_pred_tokens, input_length)
                if start < end:
                    return input_ids[start:end]
        return np.array([], dtype=np.intc)

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        return self.find_candidate_pred_tokens(input_ids, self.max_ngram_size, self.num_pred_tokens)


class DFlashDraft(EngineDraft):
    """A DFlash or DFlash2 draft file for the target (``draft_positions="sequential"`` lets a draft trained
    with pictures see their rows; the default "target" leaves a Qwen-VL picture's rows out)."""

    def __init__(self, path: str, *, num_pred_tokens: int | str | None = None,
                 draft_positions: str | None = None) -> None:
        super().__init__("draft-dflash", num_pred_tokens=num_pred_tokens, draft=str(path),
                         draft_positions=draft_positions)


class Eagle3Draft(EngineDraft):
    """An EAGLE3 draft file for the target; it sees a picture through the target's features of its rows."""

    def __init__(self, path: str, *, num_pred_tokens: int | str | None = None,
                 draft_positions: str | None = None) -> None:
        super().__init__("draft-eagle3", num_pred_tokens=num_pred_tokens, draft=str(path),
                         draft_positions=draft_positions)


class MTPDraft(EngineDraft):
    """The target's own multi-token-prediction head (Qwen3.5/3.6 GGUFs carry one); it sees a picture's
    rows in its own cache. Keep ``num_pred_tokens`` at 2-3: each further token is a guess from a guess."""

    def __init__(self, *, num_pred_tokens: int | str | None = 3) -> None:
        super().__init__("draft-mtp", num_pred_tokens=num_pred_tokens)


class DraftModel(EngineDraft):
    """A small model of the target's vocabulary; with ``clip_model_path`` (its own projector, a small
    VLM of the family) it sees the picture too."""

    def __init__(self, path: str, *, clip_model_path: str | None = None,
                 num_pred_tokens: int | str | None = None) -> None:
        super().__init__("draft-simple", num_pred_tokens=num_pred_tokens, draft=str(path),
                         mmproj_draft=None if clip_model_path is None else str(clip_model_path))
