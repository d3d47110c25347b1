"""llama-cpp-python's per-token Python hooks: lists of ``(input_ids, logits)`` callables, called as
llama-cpp-python calls them. A completion given them runs token by token (``Llama.generate``); a chat
formatter's stop-token rule is one (``Jinja2ChatFormatter(stop_token_ids=...)``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

#: ``(tokens so far, logits) -> logits``
LogitsProcessor = Callable[[np.ndarray, np.ndarray], np.ndarray]
#: ``(tokens so far, logits) -> stop now?``
StoppingCriteria = Callable[[np.ndarray, np.ndarray], bool]


class LogitsProcessorList(list):
    """llama-cpp-python's list of logits processors, applied in order."""

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        for processor in self:
            scores = processor(input_ids, scores)
        return scores


class StoppingCriteriaList(list):
    """llama-cpp-python's list of stopping criteria: stop when any says so."""

    def __call__(self, input_ids: np.ndarray, logits: np.ndarray) -> bool:
        return any([criteria(input_ids, logits) for criteria in self])


class MinTokensLogitsProcessor:
    """No end of sequence before ``min_tokens`` tokens were generated (counted from the first call)."""

    def __init__(self, min_tokens: int, token_eos: int) -> None:
        self.min_tokens, self.token_eos = min_tokens, token_eos
        self.prompt_tokens: int | None = None

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        if self.prompt_tokens is None:
            self.prompt_tokens = len(input_ids)
        if len(input_ids) - self.prompt_tokens < self.min_tokens:
            scores[self.token_eos] = -np.inf
        return scores
