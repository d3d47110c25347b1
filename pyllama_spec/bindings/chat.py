"""llama.cpp's common chat layer (common/chat.h), reached through the shim with JSON in and out:
a model's chat templates rendered with tools, tool results, reasoning and media markers, together
with the grammar, triggers, stops and parser llama.cpp derives from them (``ChatTemplates``), and
the parser of what the model writes, which splits it into content, reasoning and tool calls and
gives OpenAI's streaming deltas (``ChatParser``). Both are llama-server's own code paths, so a
chat renders and parses here as it does there, template family by template family.

The shim turns llama.cpp's C++ exceptions into ``ChatError`` (a ValueError) with their message.
"""

from __future__ import annotations

import json
from typing import Any

from pyllama_spec._native import ffi, lib
from pyllama_spec.bindings.grammar import _last_error
from pyllama_spec.bindings.handle import NativeHandle
from pyllama_spec.bindings.model import Model


class ChatError(ValueError):
    """A chat template or parser refused the input (llama.cpp's message says why)."""


def _json_result(ptr, what: str) -> Any:
    """The JSON value a shim call returned (malloc'd text, freed here); ChatError for NULL."""
    if ptr == ffi.NULL:
        raise ChatError(f"{what}: {_last_error()}")
    try:
        return json.loads(ffi.string(ptr).decode("utf-8"))
    finally:
        lib.pyllama_string_free(ptr)


def _dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode("utf-8", errors="surrogatepass")


class ChatTemplates(NativeHandle):
    """A model's chat templates as llama-server loads them (common_chat_templates_init): its own
    (and its tool_use variant), or ``override`` (Jinja text; "chatml" is llama.cpp's ChatML).
    Read-only once made: ``apply`` may run on several threads at once, as llama-server's HTTP
    threads do. ChatError when the template does not parse.

    >>> t = ChatTemplates(model)                                          # doctest: +SKIP
    >>> t.apply({"messages": [{"role": "user", "content": "hi"}]})["prompt"]
    '<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n'
    """

    _what = "chat templates"

    def __init__(self, model: Model | None, override: str | None = None) -> None:
        if model is None and not override:
            raise ChatError("chat templates without a model need the template's text")
        # without a model (a template alone, as llama.cpp's own tests read one): no BOS/EOS text
        ptr = lib.pyllama_chat_templates_init(model.ptr if model is not None else ffi.NULL,
                                              override.encode() if override else ffi.NULL)
        if ptr == ffi.NULL:
            raise ChatError(f"the chat template does not parse: {_last_error()}")
        self._ptr = ptr

    def _free(self, ptr) -> None:
        lib.pyllama_chat_templates_free(ptr)

    def info(self, *, use_jinja: bool = True, template_kwargs: dict[str, str] | None = None) -> dict:
        """{"caps", "source", "tool_use_source", "example", "supports_thinking"}: the template's
        capabilities (/props' chat_template_caps), sources, llama-server's example chat rendered
        with it (ChatError when that fails: llama-server refuses to start then) and whether it
        thinks. ``template_kwargs``: name -> JSON text, as llama-server keeps them."""
        kwargs = _dumps(template_kwargs or {})
        return _json_result(lib.pyllama_chat_templates_info(self.ptr, use_jinja, kwargs), "the chat template")

    def apply(self, inputs: dict) -> dict:
        """common_chat_templates_apply of ``inputs`` (OpenAI messages with media parts already as
        ``{"type": "media_marker", "text": marker}``, tools, tool_choice, ...: see the shim's
        header) as a dict of common_chat_params: prompt, grammar, grammar_lazy, grammar_triggers,
        preserved_tokens, additional_stops, generation_prompt, parser, format, thinking tags."""
        return _json_result(lib.pyllama_chat_templates_apply(self.ptr, _dumps(inputs)), "the chat template")


class ChatParser(NativeHandle):
    """One generation's output parser (llama-server's task_result_state): feed it the text as it
    comes; each ``update`` gives the OpenAI message parsed so far (content, reasoning_content,
    tool_calls with their ids) and the deltas since the last update.

    ``params``: format, reasoning_format, reasoning_in_content, generation_prompt, parser (the
    serialized PEG parser ``ChatTemplates.apply`` gave), is_continuation, echo.
    """

    _what = "chat parser"

    def __init__(self, params: dict) -> None:
        ptr = lib.pyllama_chat_parser_init(_dumps(params))
        if ptr == ffi.NULL:
            raise ChatError(f"the chat parser: {_last_error()}")
        self._ptr = ptr

    def _free(self, ptr) -> None:
        lib.pyllama_chat_parser_free(ptr)

    def update(self, text: str, *, partial: bool) -> tuple[dict, list[dict]]:
        """Add ``text`` (the output since the last call) and parse everything so far, as a partial
        output (more to come) or the whole. ChatError when it does not parse (then the text stays
        added: a later call parses it with what follows)."""
        raw = text.encode("utf-8", errors="surrogatepass")
        out = _json_result(lib.pyllama_chat_parser_update(self.ptr, raw, len(raw), partial),
                           "the model's output does not parse")
        return out["message"], out["diffs"]
