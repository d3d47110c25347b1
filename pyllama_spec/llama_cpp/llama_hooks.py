"""llama-cpp-python's per-token Python hooks: lists of ``(input_ids, logits)`` callables. Code builds them
as it does for llama-cpp-python; the engine refuses to run them (``Llama`` says why), and a chat
formatter's stop-token rule is one (``Jinja2ChatFormatter(stop_token_ids=...)``)."""

from __future__ import annotations


class LogitsProcessorList(list):
    """llama-cpp-python's list of ``(input_ids, logits) -> logits`` callables."""


class StoppingCriteriaList(list):
    """llama-cpp-python's list of ``(input_ids, logits) -> bool`` callables."""
