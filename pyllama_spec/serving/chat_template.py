"""A chat turned into prompt text, its images, and what the chat asks of the sampler and of the
parser of the answer: llama.cpp's common chat layer (bindings/chat.py), applied the way
llama-server's ``oaicompat_chat_params_parse`` applies it (tools/server/server-common.cpp).

One renderer for every chat, with tools or without: the template renders the messages, tool
definitions, assistant tool calls, ``tool`` results and reasoning, and image parts become the
media marker where the template puts the part's text (as llama-server passes them), so a
conversation's prompt, and the prefix the cache keeps, are llama-server's. With the template
comes what llama-server derives from it: a grammar (lazy, with its triggers, for ``tool_choice``
auto; from the start for ``required``, a named function, or a response format), the tokens the
text must show (preserved), extra stop strings, the reasoning tags (for the budget) and a parser
(``ChatParams.parser_params``, for ``bindings.chat.ChatParser``).

Where this differs from llama-server: a named ``tool_choice`` (``{"type": "function", "function":
{"name": ...}}``) forces that function through the grammar (llama-server reads it as "auto"); the
prompt still shows every tool. A ``--chat-template`` that names one of llama.cpp's built-in
templates ("llama3", ...) is rendered by that built-in (llama-server renders the name as Jinja
text unless --no-jinja); ``chat_template_kwargs`` may not set the template's own inputs
(``RESERVED_VARIABLES``: llama-server lets them replace the messages or tools).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable, Mapping, Sequence

# The server takes ChatParser, ChatError and MEDIA_MARKER from here: the import contract keeps it out
# of bindings/ (ChatParser is re-exported for it; the schema converter is serving/grammars.py's).
from pyllama_spec.bindings.chat import ChatError, ChatParser, ChatTemplates  # noqa: F401
from pyllama_spec.bindings.model import Model
from pyllama_spec.bindings.mtmd import MEDIA_MARKER
from pyllama_spec.errors import ChatTemplateError
from pyllama_spec.serving import generic_tools
from pyllama_spec.serving.grammars import check_schema_cost
from pyllama_spec.speculative.sampling import check_grammar_size

#: Template variables the renderer sets itself, which chat_template_kwargs may not set.
RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                "raise_exception", "strftime_now"})
REASONING_FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")
TOOL_CHOICES = ("auto", "none", "required")


@dataclasses.dataclass(frozen=True)
class ChatOptions:
    """What a chat asks of the template besides its messages (llama-server's chat fields)."""

    tools: Sequence[Mapping[str, Any]] | None = None  # OpenAI function tools
    tool_choice: str | Mapping[str, Any] = "auto"  # "auto", "none", "required", or a named function
    parallel_tool_calls: bool | None = None  # None: what the template supports
    add_generation_prompt: bool = True
    continue_final_message: Any = None  # true, "content" or "reasoning_content": continue the last message
    reasoning_format: str | None = None  # None: the engine's (--reasoning-format)
    reasoning_effort: str | None = None  # OpenAI's; "none" turns thinking off
    template_kwargs: Mapping[str, Any] | None = None  # chat_template_kwargs: name -> JSON value
    json_schema: Any = None  # response_format / json_schema: the chat's grammar follows it
    grammar: str | None = None  # a GBNF grammar of the caller's (not with tools)
    reasoning_budget: int | None = None  # reasoning_budget_tokens; None or -1: the engine's (--reasoning-budget)
    reasoning_budget_message: str | None = None
    echo: bool = False  # llama-server's: the answer repeats a continued message


@dataclasses.dataclass(frozen=True)
class ChatParams:
    """A rendered chat: the prompt and its images, and what the chat asks of the generation
    (``sampling()``: grammar, triggers, preserved tokens, reasoning budget; ``additional_stops``)
    and of the parser of its answer (``parser_params``)."""

    prompt: str
    images: tuple
    renderer: str  # "jinja" (the template, with tools and reasoning) or "builtin" (llama.cpp's, --no-jinja)
    format: int  # common_chat_format
    format_name: str
    grammar: str
    grammar_lazy: bool
    grammar_triggers: tuple[tuple[int, str], ...]
    preserved_tokens: tuple[str, ...]
    additional_stops: tuple[str, ...]
    generation_prompt: str
    parser: str  # llama.cpp's serialized PEG parser ("": plain content)
    reasoning_format: str
    thinking_start_tag: str
    thinking_end_tags: tuple[str, ...]
    reasoning_budget: int
    reasoning_budget_message: str
    is_continuation: bool
    echo: bool
    tools: bool  # tools are in play (tool_choice not "none")
    # "template": the template renders the tools and its parser reads the calls; "generic": it cannot,
    # and the chat is llama.cpp's former generic JSON format (serving/generic_tools.py)
    tool_format: str = "template"

    def sampling(self) -> dict:
        """SamplingParams fields for the chat's constraint: its grammar (a chat's, which starts after
        the generation prompt), lazy with its triggers or not, the preserved tokens, the budget."""
        out: dict = {"preserved_tokens": self.preserved_tokens, "generation_prompt": self.generation_prompt}
        if self.grammar:
            out.update(grammar=self.grammar, grammar_type="tool_calls", grammar_lazy=self.grammar_lazy,
                       grammar_triggers=self.grammar_triggers)
        if self.thinking_end_tags:
            out.update(reasoning_budget_tokens=self.reasoning_budget, reasoning_budget_start=self.thinking_start_tag,
                       reasoning_budget_end=self.thinking_end_tags,
                       reasoning_budget_message=self.reasoning_budget_message)
        return out

    def answer_parser(self, *, stream: bool = False):
        """A parser of this chat's answer: ``bindings.chat.ChatParser`` with ``parser_params``, or the
        generic format's (``generic_tools.GenericToolParser``); ``update(text, partial=)`` on either."""
        if self.tool_format == "generic":
            return generic_tools.GenericToolParser()
        return ChatParser(self.parser_params(stream=stream))

    def parser_params(self, *, stream: bool = False) -> dict:
        """The parameters of ``bindings.chat.ChatParser`` for this chat's answer."""
        return {"format": self.format, "reasoning_format": self.reasoning_format,
                "reasoning_in_content": stream and self.reasoning_format == "deepseek-legacy",
                "generation_prompt": self.generation_prompt, "parser": self.parser,
                "is_continuation": self.is_continuation, "echo": self.echo}


@dataclasses.dataclass(frozen=True)
class ChatSettings:
    """An engine's chat defaults: llama-server's chat flags."""

    template: str | None = None  # --chat-template(-file): Jinja text or a built-in's name; None: the model's
    jinja: bool = True  # --no-jinja: llama.cpp's built-in renderer
    template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # --chat-template-kwargs
    reasoning: str = "auto"  # --reasoning on|off|auto
    reasoning_format: str = "deepseek"  # --reasoning-format (llama-server's default value)
    reasoning_budget: int = -1  # --reasoning-budget
    reasoning_budget_message: str = ""  # --reasoning-budget-message
    reasoning_effort: str | None = None  # --reasoning-effort (None: the template's default)
    reasoning_preserve: bool | None = None  # --(no-)reasoning-preserve (None: on, as llama-server)
    prefill_assistant: bool = True  # --no-prefill-assistant: a final assistant message is a whole one
    skip_chat_parsing: bool = False  # --skip-chat-parsing: everything the model writes is content


def is_jinja(template: str) -> bool:
    """Jinja text rather than the name of a built-in template (llama-server tells them apart so)."""
    return "{%" in template or "{{" in template


class ChatRenderer:
    """A model's chat templates with an engine's chat settings; ``render`` is thread-safe.

    Loading checks the template as llama-server does when it starts (it renders its example chat):
    a template that cannot be used raises ValueError with llama.cpp's reason.
    """

    def __init__(self, model: Model | None, settings: ChatSettings) -> None:
        s = self.settings = settings
        if s.reasoning not in ("on", "off", "auto"):
            raise ValueError(f"reasoning must be 'on', 'off' or 'auto', got {s.reasoning!r}")
        if s.reasoning_format not in REASONING_FORMATS:
            raise ValueError(f"reasoning_format must be one of {REASONING_FORMATS}, got {s.reasoning_format!r}")
        override = s.template
        # Jinja for the model's template and for Jinja text ("chatml" is llama.cpp's ChatML in Jinja);
        # a built-in's name goes to llama.cpp's own renderer
        self.use_jinja = s.jinja and (override is None or is_jinja(override) or override == "chatml")
        self.renderer = "jinja" if self.use_jinja else "builtin"
        check_variables(s.template_kwargs)
        kwargs = {k: _dump(v) for k, v in s.template_kwargs.items()}
        if s.reasoning != "auto":
            kwargs["enable_thinking"] = "true" if s.reasoning == "on" else "false"
        if s.reasoning_effort is not None:
            kwargs["reasoning_effort"] = _dump(s.reasoning_effort)
        if s.reasoning_preserve is not None or "preserve_reasoning" not in kwargs:
            kwargs["preserve_reasoning"] = "false" if s.reasoning_preserve is False else "true"
        self.template_kwargs = kwargs  # name -> JSON text, as llama-server's default_template_kwargs
        try:
            self.templates = ChatTemplates(model, override)
            info = self.templates.info(use_jinja=self.use_jinja, template_kwargs=kwargs)
        except ChatError as e:
            reason = str(e).removeprefix("the chat template: ")
            if override is not None and not is_jinja(override) and not self.use_jinja:
                raise ChatTemplateError(f"llama.cpp has no built-in chat template {override[:80]!r} ({reason})") from None
            raise ChatTemplateError(f"the chat template cannot be used (llama-server refuses to start with it): {reason}; "
                             "load with jinja=False (--no-jinja) or another chat_template") from None
        self.caps: dict = info["caps"]
        self.supports_thinking: bool = info["supports_thinking"]
        self.source: str = info["source"]
        self.tool_use_source: str = info["tool_use_source"]
        #: How a chat with tools is rendered: "template" (its own tool format) or "generic" (generic_tools.py).
        self.tool_format = "template" if generic_tools.renders_tools(self.caps) or not self.use_jinja else "generic"
        # llama-server's default: thinking on where the template can think, unless --reasoning off
        self.enable_thinking = s.reasoning != "off" and self.supports_thinking

    def close(self) -> None:
        self.templates.close()

    def render(self, messages: Sequence[Mapping[str, Any]], options: ChatOptions | None = None) -> ChatParams:
        """The chat ``messages`` (OpenAI's: roles system/developer/user/assistant/tool, content text
        or parts, tool_calls, tool_call_id, name, reasoning_content; image parts ``{"type": "image",
        "image": ...}`` or ``image_url``) rendered with ``options``. ValueError for a chat the
        template or llama-server refuses (the message says why)."""
        o = options or ChatOptions()
        s = self.settings
        native, images = chat_messages(messages)
        tools = list(o.tools or [])
        named = None
        tool_choice = o.tool_choice
        if isinstance(tool_choice, Mapping):
            named = _named_tool(tool_choice, tools)
            tool_choice = "required"
        elif tool_choice not in TOOL_CHOICES:
            raise ValueError(f"Invalid tool_choice: {tool_choice}")
        if not self.use_jinja:
            if tools:
                raise ValueError("tools param requires --jinja flag")
            if tool_choice != "auto":
                raise ValueError("tool_choice param requires --jinja flag")
        if o.json_schema is not None and o.grammar:
            raise ValueError("Cannot use both json_schema and grammar")
        schema = o.json_schema
        # llama.cpp converts these schemas natively: bounded first (serving/grammars.py)
        if schema is not None:
            check_schema_cost(schema, "response_format")
        for tool in tools or ():
            function = tool.get("function") if isinstance(tool, Mapping) else None
            if isinstance(function, Mapping) and function.get("parameters") is not None:
                check_schema_cost(function["parameters"], f"the parameters of tool {function.get('name')!r}")
        if isinstance(schema, dict) and not schema:
            schema = {"type": "object"}  # an empty schema means any object
        add_generation_prompt = o.add_generation_prompt
        continuation = o.continue_final_message
        continuing = _continues(continuation)
        if not continuing and s.prefill_assistant and native and native[-1].get("role") == "assistant":
            if len(native) >= 2 and native[-2].get("role") == "assistant":
                raise ValueError("Cannot have 2 or more assistant messages at the end of the list.")
            continuation, continuing, add_generation_prompt = True, True, False
        if continuing and add_generation_prompt:
            raise ValueError("Cannot set both add_generation_prompt and continue_final_message to true.")
        if continuing and native and native[-1].get("role") == "assistant" and native[-1].get("tool_calls"):
            raise ValueError("Cannot continue an assistant message that contains tool calls.")
        reasoning_format = o.reasoning_format or s.reasoning_format
        if reasoning_format not in REASONING_FORMATS:
            raise ValueError(f"Unknown reasoning format: {reasoning_format}")
        if tools and tool_choice != "none" and o.grammar:
            raise ValueError("Cannot use custom grammar constraints with tools.")
        kwargs = dict(self.template_kwargs)
        check_variables(o.template_kwargs or {})
        kwargs.update({k: _dump(v) for k, v in (o.template_kwargs or {}).items()})
        enable_thinking = self.enable_thinking
        given = kwargs.get("enable_thinking", "")
        if given == "true":
            enable_thinking = True
        elif given == "false":
            enable_thinking = False
        elif given.startswith('"'):
            raise ValueError('invalid type for "enable_thinking" (expected boolean, got string)')
        if o.reasoning_effort is not None:
            if o.reasoning_effort == "none":
                enable_thinking = False
                kwargs.pop("reasoning_effort", None)
            elif o.reasoning_effort:
                kwargs["reasoning_effort"] = _dump(o.reasoning_effort)
        parallel = o.parallel_tool_calls
        if parallel is None:
            parallel = bool(self.caps.get("supports_parallel_tool_calls", False))
        inputs = {"messages": native, "tools": tools or None, "tool_choice": tool_choice, "json_schema": schema,
                  "grammar": o.grammar or "", "use_jinja": self.use_jinja, "parallel_tool_calls": parallel,
                  "add_generation_prompt": add_generation_prompt, "reasoning_format": reasoning_format,
                  "enable_thinking": enable_thinking, "force_pure_content": s.skip_chat_parsing,
                  "chat_template_kwargs": kwargs}
        if continuing:
            inputs["continue_final_message"] = continuation
        generic = bool(tools) and tool_choice != "none" and self.tool_format == "generic"
        if generic:  # the template cannot show tools: llama.cpp's former generic JSON format
            offered = [named] if named is not None else tools
            inputs.update(messages=generic_tools.messages(native, tools, parallel), tools=None, tool_choice="auto",
                          json_schema=generic_tools.answer_schema(offered, required=tool_choice == "required",
                                                                  parallel=parallel, response_schema=schema))
            check_schema_cost(inputs["json_schema"], "the tools' call format")
            named = None
        out = self._apply(inputs)
        if named is not None:
            # the prompt shows every tool; the grammar and parser know the named one, required
            forced = self._apply({**inputs, "tools": [named], "tool_choice": "required"})
            out = {**forced, "prompt": out["prompt"]}
        budget = o.reasoning_budget if o.reasoning_budget is not None and o.reasoning_budget != -1 \
            else s.reasoning_budget
        message = o.reasoning_budget_message if o.reasoning_budget_message is not None else s.reasoning_budget_message
        return ChatParams(
            prompt=out["prompt"], images=tuple(images), renderer=self.renderer, format=out["format"],
            format_name=out["format_name"], grammar=out["grammar"],
            grammar_lazy=out["grammar_lazy"],
            grammar_triggers=tuple((t["type"], t["value"]) for t in out["grammar_triggers"]),
            preserved_tokens=tuple(out["preserved_tokens"]), additional_stops=tuple(out["additional_stops"]),
            generation_prompt=out["generation_prompt"], parser=out["parser"], reasoning_format=reasoning_format,
            thinking_start_tag=out["thinking_start_tag"], thinking_end_tags=tuple(out["thinking_end_tags"]),
            reasoning_budget=budget, reasoning_budget_message=message, is_continuation=continuing, echo=o.echo,
            tools=bool(tools) and tool_choice != "none", tool_format="generic" if generic else "template")

    def _apply(self, inputs: dict) -> dict:
        try:
            out = self.templates.apply(inputs)
        except ChatError as e:
            raise ValueError(str(e).removeprefix("the chat template: ")) from None
        if out.get("grammar"):
            # the grammar llama.cpp made of a response format or tools' schemas (minItems over maxItems
            # makes x{m,n} with n < m, on which its grammar parser never ends): estimated before it is parsed
            check_grammar_size(out["grammar"])
        return out


def _continues(value: Any) -> bool:
    """common_chat_continuation_parse: true, "content" or "reasoning_content" continue."""
    return value is True or value in ("content", "reasoning_content")


def _named_tool(choice: Mapping[str, Any], tools: list) -> dict:
    fn = choice.get("function") if choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        raise ValueError('tool_choice must be "auto", "none", "required" or {"type": "function", "function": '
                         '{"name": ...}}')
    for tool in tools:
        f = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(f, Mapping) and f.get("name") == name:
            return dict(tool)
    raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def check_variables(variables: Mapping[str, Any]) -> None:
    """ValueError when chat template variables have a name that is not a string or that the
    renderer sets itself (``RESERVED_VARIABLES``)."""
    for key in variables:
        if not isinstance(key, str):
            raise ValueError(f"chat template variable names must be strings, got {key!r}")
        if key in RESERVED_VARIABLES:
            raise ValueError(f"chat template variable {key!r} is set by the renderer; it cannot be passed as an "
                             f"extra variable (reserved: {', '.join(sorted(RESERVED_VARIABLES))})")


def chat_messages(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict], list[Any]]:
    """The messages as llama.cpp's chat layer reads them, and their images in order: every image
    part (``{"type": "image", "image": path | bytes | PIL image}``, an ``image_url`` with a local
    path or ``file://`` URL, or llama-server's ``media_marker`` part) becomes the text part
    ``{"type": "media_marker", "text": MEDIA_MARKER}``; other fields are passed as they are."""
    out, images = [], []
    for m in messages:
        if not isinstance(m, Mapping) or "role" not in m:
            raise ValueError(f"a message needs a 'role', got {m!r:.80}")
        msg = dict(m)
        content = msg.get("content")
        if isinstance(content, (list, tuple)):
            parts = []
            for part in content:
                kind = part.get("type", "text")
                if kind == "text":
                    parts.append({"type": "text", "text": part.get("text", "")})
                elif kind == "media_marker":
                    parts.append({"type": "media_marker", "text": MEDIA_MARKER})
                elif kind in ("image", "image_url"):
                    ref = part.get("image") if kind == "image" else part.get("image_url")
                    if isinstance(ref, Mapping):
                        ref = ref.get("url")
                    if isinstance(ref, str) and ref.startswith("file://"):
                        ref = ref[len("file://"):]
                    parts.append({"type": "media_marker", "text": MEDIA_MARKER})
                    images.append(ref)
                else:
                    raise ValueError(f"unsupported message part type {kind!r}")
            msg["content"] = parts
        out.append(msg)
    return out, images


def as_list(images: Iterable[Any] | None) -> list[Any]:
    """One image (a path, bytes, a PIL image or an array) or several, as a list."""
    import numpy as np

    if images is None:
        return []
    if isinstance(images, (str, bytes, np.ndarray)) or not hasattr(images, "__iter__"):
        return [images]
    return list(images)
