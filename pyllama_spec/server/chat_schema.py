"""The chat route's fields for tools and reasoning, read as llama-server reads them
(tools/server/server-common.cpp's oaicompat_chat_params_parse, common/chat.cpp's
common_chat_msgs_parse_oaicompat and common_chat_tools_parse_oaicompat): a message's tool_calls,
tool_call_id, name and reasoning_content; tools, tool_choice, parallel_tool_calls,
add_generation_prompt, continue_final_message, reasoning_format, reasoning_effort,
chat_template_kwargs and the reasoning budget's fields. Each becomes part of a
``serving.chat_template.ChatOptions`` or of a message; anything of the wrong shape is a 400 naming it.

Pure Python: nothing is rendered here (``server/chat.py`` renders, on a thread).

Where this differs from llama-server: a value of the wrong type is a 400 here where llama-server
answers 500 (its JSON library's exception) or reads past it (a tool_choice object is "auto"
there; here it names the function the answer must call).
"""

from __future__ import annotations

import reprlib
from typing import Any

from pyllama_spec.server.errors import bad_request
from pyllama_spec.serving.chat_template import REASONING_FORMATS, RESERVED_VARIABLES, TOOL_CHOICES, ChatOptions

_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = 80
_SHOW.maxlevel = 3


def _show(value: Any) -> str:
    return _SHOW.repr(value)


def message_extras(m: dict, where: str) -> dict:
    """A message's fields beside role and content, checked: tool_calls (an assistant's),
    tool_call_id and name (a tool result's), reasoning_content."""
    out: dict = {}
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise bad_request(f"{where}.tool_calls must be a list of tool calls", "messages")
        checked = []
        for k, call in enumerate(calls):
            at = f"{where}.tool_calls[{k}]"
            if not isinstance(call, dict):
                raise bad_request(f"{at} must be an object", "messages")
            if call.get("type") != "function":
                raise bad_request(f"{at}.type must be 'function' (Unsupported tool call type), got "
                                  f"{_show(call.get('type'))}", "messages")
            fn = call.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise bad_request(f"{at}.function must be an object with a 'name' string", "messages")
            args = fn.get("arguments")
            if not isinstance(args, (str, dict, list)):
                raise bad_request(f"{at}.function.arguments must be a JSON string (or a JSON value), got "
                                  f"{_show(args)}", "messages")
            entry = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
            if "id" in call and call["id"] is not None:
                if not isinstance(call["id"], str):
                    raise bad_request(f"{at}.id must be a string", "messages")
                entry["id"] = call["id"]
            checked.append(entry)
        out["tool_calls"] = checked
    for name in ("tool_call_id", "name", "reasoning_content"):
        value = m.get(name)
        if value is None:
            continue
        if not isinstance(value, str):
            raise bad_request(f"{where}.{name} must be a string, got {_show(value)}", "messages")
        out[name] = value
    return out


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request(f"'tools' must be a list of tools, got {_show(tools)}", "tools")
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f"tools[{k}] must be {{\"type\": \"function\", \"function\": {{...}}}} "
                              f"(Unsupported tool type), got {_show(tool)}", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{k}].function must be an object with a 'name' string", "tools")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad_request(f"tools[{k}].function.description must be a string", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{k}].function.parameters must be a JSON schema (an object)", "tools")
    return tools


def _tool_choice(body: dict, tools: list | None) -> str | dict:
    choice = body.get("tool_choice")
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise bad_request(f"Invalid tool_choice: {choice}", "tool_choice")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad_request("'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}", "tool_choice")
    if not any(t["function"]["name"] == name for t in tools or ()):
        raise bad_request(f"'tool_choice' names the function {_show(name)}, which is not among the tools",
                          "tool_choice")
    return {"type": "function", "function": {"name": name}}


def _optional(body: dict, name: str, kind: type, what: str):
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise bad_request(f"'{name}' must be {what}, got {_show(value)}", name)
    return value


def template_kwargs(body: dict) -> dict | None:
    """chat_template_kwargs: an object whose names are not the renderer's own."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return None
    if not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    for key in kwargs:
        if not isinstance(key, str):  # never from JSON; from a caller of parse_chat
            raise bad_request(f"'chat_template_kwargs' names must be strings, got {_show(key)}", "chat_template_kwargs")
        if key in RESERVED_VARIABLES:
            raise bad_request(f"'chat_template_kwargs' cannot set {_show(key)}: it is set by the server "
                              f"(reserved: {', '.join(sorted(RESERVED_VARIABLES))})", "chat_template_kwargs")
    if isinstance(kwargs.get("enable_thinking"), str):
        raise bad_request('invalid type for "enable_thinking" (expected boolean, got string)', "chat_template_kwargs")
    return kwargs


def chat_options(body: dict, *, json_schema: Any = None, grammar: str | None = None) -> ChatOptions:
    """The ChatOptions of a chat body (its response format's schema and grammar given by the
    caller, who read them)."""
    tools = _tools(body)
    choice = _tool_choice(body, tools)
    if tools and choice != "none" and grammar:
        raise bad_request("Cannot use custom grammar constraints with tools.", "grammar")
    reasoning_format = _optional(body, "reasoning_format", str, "a string")
    if reasoning_format is not None and reasoning_format not in REASONING_FORMATS:
        raise bad_request(f"Unknown reasoning format: {reasoning_format}", "reasoning_format")
    continuation = body.get("continue_final_message")
    if continuation is not None and not isinstance(continuation, (bool, str)):
        raise bad_request("'continue_final_message' must be a boolean, 'content' or 'reasoning_content'",
                          "continue_final_message")
    budget = None
    for name in ("reasoning_budget_tokens", "thinking_budget_tokens"):
        if budget is None:
            budget = _optional(body, name, int, "an integer >= -1")
            if budget is not None and budget < -1:
                raise bad_request(f"'{name}' must be an integer >= -1 (-1: the server's budget), got {budget}", name)
    add = body.get("add_generation_prompt")
    if add is not None and not isinstance(add, bool):
        raise bad_request(f"'add_generation_prompt' must be a boolean, got {_show(add)}", "add_generation_prompt")
    return ChatOptions(
        tools=tools, tool_choice=choice, parallel_tool_calls=_optional(body, "parallel_tool_calls", bool, "a boolean"),
        add_generation_prompt=True if add is None else add, continue_final_message=continuation,
        reasoning_format=reasoning_format, reasoning_effort=_optional(body, "reasoning_effort", str, "a string"),
        template_kwargs=template_kwargs(body), json_schema=json_schema, grammar=grammar, reasoning_budget=budget,
        reasoning_budget_message=_optional(body, "reasoning_budget_message", str, "a string"),
        echo=bool(_optional(body, "echo", bool, "a boolean")))
