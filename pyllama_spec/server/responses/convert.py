"""A Responses request as a chat completions body (``chat_body``), and a chat.completion's answer
as the response object's output items and usage (``output_items``, ``responses_usage``,
``ResponseHead``), as llama-server converts them (see the package's doc for where this differs)."""

from __future__ import annotations

import dataclasses
import logging
import re
import time
import uuid
from typing import Any

from pyllama_spec.server.errors import APIError, bad_request

log = logging.getLogger("pyllama_spec.server")


# --------------------------------------------------------------------------- request -> chat body


#: Responses fields that are translated here, or that have no chat completions counterpart: not
#: passed on to the chat parser (every other field is, as llama-server passes them).
_NOT_PASSED = frozenset({
    "input", "instructions", "previous_response_id", "store", "max_output_tokens", "reasoning", "text", "tools",
    "tool_choice", "metadata", "include", "truncation", "background", "user", "safety_identifier",
    "prompt_cache_key", "prompt_cache_retention", "service_tier", "top_logprobs", "max_tool_calls",
    "stream_options", "conversation", "prompt", "context_management", "messages"})
_TOOL_CHOICES = ("auto", "none", "required")


def input_items(body: dict) -> list[dict]:
    """The request's ``input`` as a list of items (a string is one user message)."""
    if "input" not in body:
        raise bad_request("'input' is required", "input")
    value = body["input"]
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad_request("'input' must be a string or array of objects", "input")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise bad_request(f"'input[{i}]' must be an object (a message or an item)", "input")
    return value


def chat_body(body: dict, items: list[dict], *, n_earlier: int = 0, max_tokens_limit: int | None = None) -> dict:
    """The chat completions body for Responses request ``body`` whose conversation is ``items``
    (the ``n_earlier`` items of its previous response's conversation, then its own input items)."""
    for name in ("n", "n_cmpl"):
        if body.get(name) not in (None, 1):
            raise bad_request(f"'{name}' must be 1: a response has one output", name)
    if body.get("background"):
        raise bad_request("background responses are not supported by this server", "background")
    if body.get("conversation") is not None:
        raise bad_request("'conversation' is not supported by this server: continue a conversation with "
                          "previous_response_id, or send its items in 'input'", "conversation")
    chat = {k: v for k, v in body.items() if k not in _NOT_PASSED}
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    chat["messages"] = messages + chat_messages(items, n_earlier)
    tools = chat_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = chat_tool_choice(body["tool_choice"])
    if body.get("max_output_tokens") is not None:
        n = body["max_output_tokens"]
        top = max_tokens_limit if max_tokens_limit is not None else 2**31 - 1
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= top:
            raise bad_request(f"'max_output_tokens' must be an integer between 0 and {top}", "max_output_tokens")
        chat["max_tokens"] = n
        chat.pop("max_completion_tokens", None)  # it would win in the chat parser
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise bad_request("'reasoning' must be an object ({\"effort\": ...})", "reasoning")
        if reasoning.get("effort") is not None:  # only the effort is passed on, as in llama-server
            chat["reasoning_effort"] = reasoning["effort"]
    fmt = response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    if body.get("stream") is True:
        chat["stream_options"] = {"include_usage": True}  # the usage of response.completed
    return chat


def chat_messages(items: list[dict], n_earlier: int = 0) -> list[dict]:
    """Responses items as chat messages, as llama-server converts them: an assistant message,
    a function_call or a reasoning item right after an assistant message is merged into it (its
    content, tool_calls or reasoning_content). The first ``n_earlier`` items are the previous
    response's conversation (an error names the others by their place in ``input``)."""
    return _convert(items, n_earlier)[0]


def _convert(items: list[dict], n_earlier: int = 0) -> tuple[list[dict], list[int]]:
    """``chat_messages``, and the index of the item each message began with."""
    out: list[dict] = []
    origins: list[int] = []
    for i, item in enumerate(items):
        _add_item(out, item, f"input[{i - n_earlier}]")
        origins += [i] * (len(out) - len(origins))
    return out, origins


def _add_item(out: list[dict], item: Any, where: str) -> None:
    """Item ``item`` as a new chat message at the end of ``out``, or merged into the last one."""
    if not isinstance(item, dict):
        raise bad_request(f"'{where}' must be an object (a message or an item)", "input")
    prev = out[-1] if out and out[-1].get("role") == "assistant" else None
    kind, role, content = item.get("type"), item.get("role"), item.get("content")
    if role in ("user", "system", "developer") and isinstance(content, (str, list)):
        parts = content if isinstance(content, str) else [_input_part(p, f"{where}.content[{k}]")
                                                            for k, p in enumerate(content)]
        out.append({"role": role, "content": parts})
    elif role == "assistant" and kind in ("message", None):
        parts = _output_parts(content, where)
        if prev is not None:
            prev["content"] = _as_parts(prev.get("content")) + _as_parts(parts)
        else:
            out.append({"role": "assistant", "content": parts})
    elif kind == "function_call":
        for name in ("arguments", "call_id", "name"):
            if not isinstance(item.get(name), str):
                raise bad_request(f"'{where}.{name}' must be a string (a function_call item)", "input")
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        if prev is not None:
            prev["tool_calls"] = [*(prev.get("tool_calls") or []), call]
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise bad_request(f"'{where}.call_id' must be a string (a function_call_output item)", "input")
        output = item.get("output")
        if isinstance(output, list):
            output = [_tool_output_part(p, f"{where}.output[{k}]") for k, p in enumerate(output)]
        elif not isinstance(output, str):
            raise bad_request(f"'{where}.output' must be a string or a list of input_text / input_image parts",
                              "input")
        out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
    elif kind == "reasoning":
        text = _reasoning_text(item, where)
        if text is None:
            return  # a summary only (OpenAI's own items): nothing for the template to render
        if prev is not None:
            prev["reasoning_content"] = text
        else:
            out.append({"role": "assistant", "content": [], "reasoning_content": text})
    else:
        raise bad_request(f"cannot determine the type of '{where}' (type {kind!r}, role {role!r}): this server "
                          "reads messages (role user, system, developer or assistant), function_call, "
                          "function_call_output and reasoning items", "input")


def relocate(e: APIError, body: dict, items: list[dict], n_earlier: int) -> APIError:
    """An error the chat parser raised about ``messages[k]``, naming what the client sent instead:
    ``instructions``, ``input[i]``, or an item of the previous response's conversation (the first
    ``n_earlier`` of ``items``)."""
    if not (e.param or "").startswith("messages"):
        return e
    labels = ["instructions"] if body.get("instructions") is not None else []
    labels += [f"input[{o - n_earlier}]" if o >= n_earlier else f"item {o} of the previous response's conversation"
               for o in _convert(items, n_earlier)[1]]

    def label(m: re.Match) -> str:
        k = int(m.group(1))
        return labels[k] if k < len(labels) else m.group(0)

    message = re.sub(r"messages\[(\d+)\]", label, e.message).replace("'messages'", "'input'")
    param = "instructions" if re.sub(r"messages\[(\d+)\]", label, e.param).startswith("instructions") else "input"
    return APIError(e.status, message, type=e.type, code=e.code, param=param, headers=e.headers, extra=e.extra)


def _as_parts(content: Any) -> list:
    if content is None:
        return []
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def _text_of(part: dict, key: str, where: str) -> str:
    if not isinstance(part.get(key), str):
        raise bad_request(f"'{where}.{key}' must be a string", "input")
    return part[key]


def _input_part(part: Any, where: str) -> dict:
    if not isinstance(part, dict):
        raise bad_request(f"'{where}' must be an object", "input")
    kind = part.get("type")
    if kind == "input_text":
        return {"type": "text", "text": _text_of(part, "text", where)}
    if kind == "input_image":
        return _image_part(part, where)
    if kind == "input_file":
        raise bad_request(f"'{where}': 'input_file' is not supported by this server", "input")
    raise bad_request(f"'{where}.type' must be one of 'input_text', 'input_image', or 'input_file', got {kind!r}",
                      "input")


def _image_part(part: dict, where: str) -> dict:
    url = part.get("image_url")
    if url is None and part.get("file_id") is not None:
        raise bad_request(f"'{where}': images by file_id are not supported by this server (there is no files "
                          "API); send the image as a data URL in 'image_url'", "input")
    if not isinstance(url, str):
        raise bad_request(f"'{where}.image_url' must be a string (a data URL)", "input")
    return {"type": "image_url", "image_url": {"url": url}}  # 'detail' has no counterpart here


def _output_parts(content: Any, where: str) -> Any:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{where}.content' must be a string or a list of output_text parts", "input")
    parts = []
    for k, part in enumerate(content):
        at = f"{where}.content[{k}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("output_text", "input_text"):
            parts.append({"type": "text", "text": _text_of(part, "text", at)})
        elif kind == "refusal":  # the chat parser has no refusal parts: what the assistant said
            parts.append({"type": "text", "text": _text_of(part, "refusal", at)})
        else:
            raise bad_request(f"'{at}.type' must be one of 'output_text' or 'refusal', got {kind!r}", "input")
    return parts


def _tool_output_part(part: Any, where: str) -> dict:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "input_text":
        return {"type": "text", "text": _text_of(part, "text", where)}
    if kind == "input_image":
        return _image_part(part, where)
    raise bad_request(f"'{where}': the output of a tool call holds 'input_text' or 'input_image' parts, got {kind!r}",
                      "input")


def _reasoning_text(item: dict, where: str) -> str | None:
    content = item.get("content")
    if content is None or content == []:
        return None
    if not isinstance(content, list) or not isinstance(content[0], dict) \
            or not isinstance(content[0].get("text"), str):
        raise bad_request(f"'{where}.content' must be a list of reasoning_text parts", "input")
    return content[0]["text"]  # the first part, as llama-server reads it


def chat_tools(tools: Any) -> list[dict] | None:
    """Responses function tools (name, description, parameters, strict at the top level) as chat
    tools; other tool types (web search, file search, ...) have no counterpart and are skipped, as
    llama-server skips them. ``strict`` defaults to true, as in llama-server."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be an array of objects", "tools")
    out = []
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise bad_request(f"'tools[{k}]' must be an object", "tools")
        if tool.get("type") != "function":
            log.warning("unsupported Responses tool type %r skipped", tool.get("type"))
            continue
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"'tools[{k}].name' must be a non-empty string", "tools")
        function = {key: value for key, value in tool.items() if key != "type"}
        function.setdefault("strict", True)
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """Responses' tool_choice in the chat shape: a string as it is, a named function
    ``{"type": "function", "name": f}`` as ``{"type": "function", "function": {"name": f}}``."""
    if isinstance(choice, str) and choice in _TOOL_CHOICES:
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}",
                      "tool_choice")


def response_format(text: Any) -> dict | None:
    """``text.format`` as the chat route's response_format (None: plain text)."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or (fmt is not None and not isinstance(fmt, dict)):
        raise bad_request("'text' must be an object with a 'format' object", "text")
    kind = fmt.get("type") if fmt else "text"
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), (dict, bool)):
            raise bad_request("'text.format.schema' must be a JSON schema (an object)", "text")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise bad_request(f"'text.format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}", "text")


# --------------------------------------------------------------------------- chat answer -> response


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def call_ids(chat_id: str | None) -> tuple[str, str]:
    """(item id, call_id) of a chat tool call's id, as llama-server names them (fc_<id>, call_<id>);
    an id that already starts with call_ is not prefixed twice, and a call without one gets one."""
    base = (chat_id or uuid.uuid4().hex).removeprefix("call_")
    return f"fc_{base}", f"call_{base}"


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "annotations": [], "logprobs": [], "text": text}]}


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": ""}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "status": status, "arguments": arguments, "call_id": call_id,
            "name": name}


def output_items(message: dict, last_status: str = "completed") -> list[dict]:
    """The output items of a chat.completion message: reasoning, then the text (none when it is
    empty, as in llama-server), then a function_call per tool call; the last item has
    ``last_status`` (``incomplete`` when max_output_tokens cut it)."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"], "completed"))
    if message.get("content"):
        items.append(message_item(new_id("msg"), message["content"], "completed"))
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        items.append(function_call_item(*call_ids(call.get("id")), function.get("name", ""),
                                        function.get("arguments", ""), "completed"))
    if items:
        items[-1]["status"] = last_status
    return items


def responses_usage(chat_usage: dict | None) -> dict | None:
    """OpenAI chat usage as the Responses usage."""
    if chat_usage is None:
        return None
    prompt, completion = chat_usage["prompt_tokens"], chat_usage["completion_tokens"]
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    # the chat route counts no reasoning tokens apart (0) unless its usage says how many
    reasoning = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion}


def finish_status(finish_reason: str | None) -> tuple[str, dict | None]:
    """The response's status and incomplete_details for the chat finish_reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def request_echo(body: dict) -> dict:
    """The request's settings that OpenAI's response object repeats."""
    return {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {}, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
            "store": body.get("store", True), "temperature": body.get("temperature"),
            "text": body.get("text") or {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [], "top_p": body.get("top_p"), "truncation": "disabled"}


@dataclasses.dataclass
class ResponseHead:
    """What a response object says before its output: its id, times, model and the request's echo."""

    id: str
    created_at: int
    model: str
    echo: dict

    def body(self, status: str, output: list, usage: dict | None = None, incomplete: dict | None = None,
             timings: dict | None = None) -> dict:
        done = status == "completed"
        out = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
               "completed_at": int(time.time()) if done else None, "error": None, "incomplete_details": incomplete,
               "model": self.model, "output": output, **self.echo, "usage": usage}
        if timings is not None:
            out["timings"] = timings  # llama-server's timings plus this project's speculative stats
        return out
