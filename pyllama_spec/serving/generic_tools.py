"""Tools on a template that cannot render them: llama.cpp's former generic tool-call format.

A chat template without tool support (``caps["supports_tool_calls"]`` false: the embedded pair's,
many base models') renders no tool definitions, and llama.cpp's chat layer then drops the tools:
the answer is plain text, and a client that forced a call (``tool_choice`` "required" or a named
function) gets none. Here such a chat is rendered the way llama.cpp's generic format did
(``common_chat_params_init_generic``, before its PEG parsers replaced it):

* the tools are described in the system message, with the instruction to answer in JSON, either
  ``{"tool_call": {"name": ..., "arguments": {...}}}`` (``{"tool_calls": [...]}`` with an ``id`` each
  when parallel calls are allowed) or ``{"response": "..."}``;
* the answer is constrained to that JSON by a grammar from its schema (a forced call leaves
  ``response`` out, a named function leaves the other tools out, a ``response_format`` schema
  shapes ``response``);
* earlier tool calls and tool results in the conversation are written in the same JSON;
* the answer is parsed back into ``tool_calls`` or ``content`` (``GenericToolParser``) once it is
  whole: a stream sends it at its end.

/props says which format the server's template gets (``tool_call_format``).
"""

from __future__ import annotations

import json
import secrets
import string
from typing import Any, Mapping, Sequence

from pyllama_spec.bindings.chat import ChatError

INSTRUCTION = ("Respond in JSON format, either with `tool_call` (a request to call tools) or with `response` "
               "reply to the user's request")


def renders_tools(caps: Mapping[str, Any]) -> bool:
    """Whether a template (its llama.cpp caps) renders tool definitions and calls itself."""
    return bool(caps.get("supports_tool_calls"))


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    f = tool.get("function") if isinstance(tool, Mapping) else None
    if not isinstance(f, Mapping) or not isinstance(f.get("name"), str):
        raise ValueError("each tool needs a function with a name")
    return f


def answer_schema(tools: Sequence[Mapping[str, Any]], *, required: bool, parallel: bool,
                  response_schema: Any = None) -> dict:
    """The JSON schema of a generic answer: a call of one of ``tools`` (several with ids when
    ``parallel``), or, unless ``required``, a ``response`` (text, or ``response_schema``)."""
    calls = []
    for tool in tools:
        f = _function(tool)
        call: dict = {"type": "object",
                      "properties": {"name": {"type": "string", "const": f["name"]},
                                     "arguments": f.get("parameters") or {"type": "object"}},
                      "required": ["name", "arguments"]}
        if f.get("description"):
            call["description"] = f["description"]
        if parallel:
            call["properties"]["id"] = {"type": "string", "minLength": 4}
            call["required"].append("id")
        calls.append(call)
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if parallel:
        tool_call = {"type": "object", "properties": {"tool_calls": {"type": "array", "items": one, "minItems": 1}},
                     "required": ["tool_calls"]}
    else:
        tool_call = {"type": "object", "properties": {"tool_call": one}, "required": ["tool_call"]}
    if required:
        return tool_call
    response = {"type": "object",
                "properties": {"response": response_schema if response_schema is not None else {"type": "string"}},
                "required": ["response"]}
    return {"anyOf": [tool_call, response]}


def system_text(tools: Sequence[Mapping[str, Any]], parallel: bool) -> str:
    example_call = {"name": _function(tools[0])["name"], "arguments": {}}
    example = ({"tool_calls": [{**example_call, "id": "call_1"}]} if parallel else {"tool_call": example_call})
    return ("You can call any of the following tools to satisfy the user's requests: "
            + json.dumps(list(tools), indent=2, ensure_ascii=False)
            + "\n\nExample tool call syntax:\n\n" + json.dumps(example, ensure_ascii=False) + "\n\n" + INSTRUCTION)


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def messages(native: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]], parallel: bool) -> list[dict]:
    """The conversation for a template without tools: the tools in the system message, assistant
    tool calls as the JSON the model is asked to write, tool results as user messages."""
    out: list[dict] = []
    for m in native:
        msg = dict(m)
        if msg.get("role") == "assistant" and msg.get("tool_calls"):
            raw = msg.pop("tool_calls")
            calls = [{"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments")),
                      **({"id": c["id"]} if parallel and c.get("id") else {})}
                     for c in (raw if isinstance(raw, (list, tuple)) else ())
                     if isinstance(c, Mapping) and isinstance(c.get("function"), Mapping)
                     and isinstance(c["function"].get("name"), str)]  # a malformed call is left out
            shown = {"tool_calls": calls} if parallel else {"tool_call": calls[0]} if calls else {"response": ""}
            msg["content"] = json.dumps(shown, ensure_ascii=False)
        elif msg.get("role") == "tool":
            result = {"content": msg.get("content")}
            for key in ("name", "tool_call_id"):
                if msg.get(key):
                    result[key] = msg[key]
            msg = {"role": "user", "content": json.dumps({"tool_response": result}, ensure_ascii=False),
                   _RESULT: True}
        if out and msg.get("role") == "user" and out[-1].get("role") == "user" and (msg.get(_RESULT) or
                                                                                    out[-1].get(_RESULT)):
            out[-1] = _joined(out[-1], msg)  # templates that want turns to alternate get one user turn
            continue
        out.append(msg)
    out = [{k: v for k, v in m.items() if k != _RESULT} for m in out]
    text = system_text(tools, parallel)
    if out and out[0].get("role") == "system":
        first = dict(out[0])
        content = first.get("content")
        if isinstance(content, list):
            first["content"] = [*content, {"type": "text", "text": "\n\n" + text}]
        else:
            first["content"] = f"{content or ''}\n\n{text}".lstrip("\n")
        out[0] = first
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


_RESULT = "\0tool result"  # marks a tool result's user message while the conversation is rebuilt


def _parts(content: Any) -> list:
    return list(content) if isinstance(content, list) else [{"type": "text", "text": content or ""}]


def _joined(first: dict, second: dict) -> dict:
    """Two user messages as one: text joined by a blank line (parts lists concatenated)."""
    a, b = first.get("content"), second.get("content")
    if isinstance(a, str) and isinstance(b, str):
        content: Any = f"{a}\n\n{b}"
    else:
        content = [*_parts(a), {"type": "text", "text": "\n\n"}, *_parts(b)]
    return {**first, "content": content, _RESULT: True}


def _call_id() -> str:
    """llama-server's gen_tool_call_id: 32 random letters and digits."""
    chars = string.ascii_letters + string.digits
    return "".join(secrets.choice(chars) for _ in range(32))


class GenericToolParser:
    """``bindings.chat.ChatParser``'s interface for a generic answer: nothing until the answer is
    whole, then its tool calls or its response as one set of OpenAI deltas. ChatError for a whole
    answer that is not the JSON asked for (cut by max_tokens): the caller answers the text."""

    def __init__(self) -> None:
        self._text: list[str] = []

    def update(self, text: str, *, partial: bool) -> tuple[dict, list[dict]]:
        self._text.append(text)
        if partial:
            return {"role": "assistant", "content": ""}, []
        try:
            answer = json.loads("".join(self._text))
        except (ValueError, RecursionError):  # RecursionError: nested past the interpreter's depth
            raise ChatError("the answer is not the generic tool-call JSON") from None
        if not isinstance(answer, dict):
            raise ChatError("the answer is not the generic tool-call JSON")
        if "tool_calls" in answer or "tool_call" in answer:
            raw = answer.get("tool_calls") if "tool_calls" in answer else [answer.get("tool_call")]
            if not isinstance(raw, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                                    for c in raw):
                raise ChatError("the answer's tool calls have no names")
            calls = [{"type": "function", "id": str(c.get("id") or _call_id()),
                      "function": {"name": c["name"],
                                   "arguments": json.dumps(c.get("arguments", {}), ensure_ascii=False)}}
                     for c in raw]
            deltas = [{"tool_calls": [{"index": i, **c}]} for i, c in enumerate(calls)]
            return {"role": "assistant", "content": "", "tool_calls": calls}, deltas
        response = answer.get("response")
        content = "" if response is None else response if isinstance(response, str) else \
            json.dumps(response, ensure_ascii=False)
        return {"role": "assistant", "content": content}, ([{"content": content}] if content else [])
