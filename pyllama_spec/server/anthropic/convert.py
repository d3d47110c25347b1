"""Anthropic's Messages API as OpenAI chat, and back: pure functions over JSON values.

The /v1/messages route (``routes.py``) runs a request through the chat route: ``chat_body``
turns the Anthropic request into an OpenAI chat body the way llama-server's
``server_chat_convert_anthropic_to_oai`` does (tools/server/server-chat.cpp), ``message``
turns the chat.completion answer into Anthropic's message object, and ``MessageStream``
turns the chat.completion.chunk objects of a streamed answer into Anthropic's events, as
llama-server's ``to_json_anthropic`` / ``to_json_anthropic_stream`` (server-task.cpp) do.

Where this differs from the pinned llama-server, on purpose:

- A request llama-server reads past or guesses at is a 400 here: a missing ``max_tokens``
  (4096 there; Anthropic's API requires it), ``messages`` missing or not a list (a 500, or no
  messages), a content block of a type this server cannot show the model (dropped there: a
  ``document`` block the model never sees), a block or field of the wrong JSON type (read as
  its default there), ``system`` that is neither text nor text blocks.
- ``tool_choice``: ``{"type": "tool", "name": ...}`` names that function (llama-server asks for
  any tool), ``{"type": "none"}`` is ``"none"`` (dropped there, so tools stay in play), and
  ``disable_parallel_tool_use`` is OpenAI's ``parallel_tool_calls: false`` (ignored there).
- A stop sequence that ended the answer gives ``stop_reason: "stop_sequence"``, as Anthropic's
  API does (llama-server says ``"end_turn"``; both set ``stop_sequence``).
- The message id is ``msg_...``, Anthropic's form (llama-server reuses its ``chatcmpl-...`` id).
- A streamed ``tool_use`` block starts with ``"input": {}``, as Anthropic's does (llama-server
  leaves ``input`` out); block indices follow the order blocks first appear (llama-server
  computes them from the kinds seen so far, which repeats an index if reasoning comes after text).
- Extensions, which clients ignore: ``pyllama_spec.timings`` (the chat route's timings, speculative
  counts included) on the message and on the stream's ``message_delta`` (not a top-level ``timings``:
  llama-server leaves it out of Anthropic's shapes, and its tests check that); each step's ``pyllama_spec`` object
  (its tokens, which were accepted drafts) on the last event that step produced. A step whose
  text is held back (half a character, a possible stop sequence) produces no event, so its
  ``pyllama_spec`` is not sent (the chat route sends an empty chunk for it).

Like llama-server: a tool_result's ``is_error`` is not shown to the model (OpenAI's tool
message has no such flag); ``metadata`` and every other field are read past; the message's
text, tool calls and reasoning come before the tool results of the same message.
"""

from __future__ import annotations

import json
import re
import reprlib
import uuid
from typing import Any

from pyllama_spec.server.errors import APIError, bad_request

#: Request fields passed to the chat route unchanged (llama-server's list).
_PASSED = ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs")
#: Block types a message's content may hold; redacted_thinking (Anthropic's encrypted
#: reasoning, which no local model can read) is dropped, as llama-server drops it.
_BLOCKS = ("text", "image", "thinking", "redacted_thinking", "tool_use", "tool_result")
#: The most stop sequences a request may give: the chat route's limit for ``stop``.
MAX_STOP_SEQUENCES = 4
#: llama-server's thinking budget when ``thinking.budget_tokens`` is not given.
DEFAULT_THINKING_BUDGET = 10000

_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = 60


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _param(where: str) -> str:
    """The request field a path is in: "messages" for "messages[2].content[0]"."""
    return re.match(r"[a-z_]*", where).group(0)


# --------------------------------------------------------------------------- request: Anthropic -> OpenAI chat


class ChatRequest:
    """An Anthropic request as an OpenAI chat ``body``, with where each chat message and content
    part came from (``origin``), so that an error the chat route's parser finds (a bad image)
    names the Anthropic block at fault."""

    def __init__(self) -> None:
        self.body: dict = {}
        self.messages: list[dict] = []
        #: "messages[j]" / "messages[j].content[k]" of the chat body -> the Anthropic path
        self.origin: dict[str, str] = {}

    def add(self, message: dict, where: str, parts: list[str] | None = None) -> None:
        j = len(self.messages)
        self.messages.append(message)
        self.origin[f"messages[{j}]"] = where
        for k, part_where in enumerate(parts or ()):
            self.origin[f"messages[{j}].content[{k}]"] = part_where

    def relocate(self, error: APIError) -> APIError:
        """``error`` from the chat route's parser, its chat-body paths replaced by the request's."""
        def anthropic_path(m: re.Match) -> str:
            return self.origin.get(m.group(0)) or self.origin.get(m.group(1)) or m.group(0)

        pattern = re.compile(r"(messages\[\d+\])(?:\.content\[\d+\])?")
        error.message = pattern.sub(anthropic_path, error.message)
        if error.param:
            error.param = pattern.sub(anthropic_path, error.param)
        return error


def chat_body(body: Any, *, need_max_tokens: bool = True) -> ChatRequest:
    """The OpenAI chat body for Anthropic Messages request ``body`` (llama-server's conversion,
    checked: every block and field of the wrong shape is a 400 naming it). ``need_max_tokens``:
    /v1/messages requires ``max_tokens``, /v1/messages/count_tokens takes none.

    >>> chat_body({"max_tokens": 8, "system": "Be brief.", "messages": [{"role": "user", "content": "hi"}]}).body
    {'messages': [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'hi'}], 'max_tokens': 8}
    """
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    out = ChatRequest()
    system = body.get("system")
    if system is not None:
        out.add({"role": "system", "content": _system_text(system)}, "system")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad_request(f"'messages' must be a list of messages, got {_type_name(messages)}", "messages")
    for i, message in enumerate(messages):
        _add_message(out, message, f"messages[{i}]")
    chat: dict = {"messages": out.messages}
    if "tools" in body and body["tools"] is not None:
        chat["tools"] = _tools(body["tools"])
    chat.update(_tool_choice(body.get("tool_choice")))
    if body.get("stop_sequences") is not None:
        chat["stop"] = _stop_sequences(body["stop_sequences"])
    if body.get("max_tokens") is not None:
        chat["max_tokens"] = body["max_tokens"]  # its type and range: the chat route's parser
    elif need_max_tokens:
        raise bad_request("'max_tokens' is required", "max_tokens")
    for key in _PASSED:
        if key in body:
            chat[key] = body[key]
    chat.update(_thinking(body.get("thinking")))
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise bad_request(f"'metadata' must be an object, got {_type_name(body['metadata'])}", "metadata")
    out.body = chat
    return out


def _system_text(system: Any) -> str:
    """``system`` as one string: a string, or its text blocks joined (llama-server's)."""
    if isinstance(system, str):
        return normalize_billing_header(system)
    if not isinstance(system, list):
        raise bad_request(f"'system' must be a string or a list of text blocks, got {_type_name(system)}", "system")
    texts = []
    for k, block in enumerate(system):
        where = f"system[{k}]"
        if not isinstance(block, dict) or block.get("type") != "text":
            raise bad_request(f"{where} must be a text block ({{\"type\": \"text\", \"text\": ...}}), got "
                              f"{_SHOW.repr(block)}", "system")
        texts.append(normalize_billing_header(_string(block, "text", where)))
    return "".join(texts)


def normalize_billing_header(text: str) -> str:
    """llama-server's fix for Claude Code's system prompt: an ``x-anthropic-billing-header:`` line's
    ``cch=xxxxx;`` stamp changes on every request, so that no prompt cache could get past it; its
    five characters become ``fffff`` (any other text is returned as it is).

    >>> normalize_billing_header("x-anthropic-billing-header: cc_version=2.1; cch=a5145;You are Claude Code")
    'x-anthropic-billing-header: cc_version=2.1; cch=fffff;You are Claude Code'
    """
    prefix = "x-anthropic-billing-header:"
    if not text.startswith(prefix):
        return text
    at = text.find("cch=", len(prefix))
    if at < 0:
        return text
    start = at + 4
    if start + 5 < len(text) and text[start + 5] == ";":
        return text[:start] + "fffff" + text[start + 5:]
    return text


def _string(block: dict, key: str, where: str, default: str | None = None) -> str:
    value = block.get(key, default)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string, got {_type_name(value)}", _param(where))
    return value


def _image_url(block: dict, where: str) -> dict:
    """An image block as an OpenAI image_url part: a base64 source as a data: URI (its media type,
    image/jpeg when not given, as llama-server), a url source as that URL (which the chat route
    reads as it reads any image_url: data: URIs, and local files under --allowed-image-dir)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    param = _param(where)
    if kind == "base64":
        media_type = _string(source, "media_type", f"{where}.source", "image/jpeg")
        data = _string(source, "data", f"{where}.source")
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}
    if kind == "url":
        return {"type": "image_url", "image_url": {"url": _string(source, "url", f"{where}.source")}}
    raise bad_request(f"{where}.source must be {{\"type\": \"base64\", \"media_type\": ..., \"data\": ...}} or "
                      f"{{\"type\": \"url\", \"url\": ...}}, got {_SHOW.repr(source)}", param)


def _block(block: Any, where: str) -> str:
    """A content block's type, checked."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in _BLOCKS:
        raise bad_request(f"{where} must be a content block of type {', '.join(_BLOCKS)}; got {_SHOW.repr(block)}",
                          _param(where))
    return kind


def _add_message(out: ChatRequest, message: Any, where: str) -> None:
    """One Anthropic message as chat messages: its text, images, tool calls and reasoning as one
    message (when it has any), then one ``tool`` message per tool_result block."""
    if not isinstance(message, dict):
        raise bad_request(f"{where} must be an object with 'role' and 'content', got {_SHOW.repr(message)}",
                          "messages")
    role, content = message.get("role"), message.get("content", ...)
    if content is ...:  # llama-server: an assistant turn without content is skipped
        if role != "assistant":
            raise bad_request(f"{where} has no 'content'", "messages")
        return
    if not isinstance(content, list):  # a string (or what the chat route's parser will refuse)
        out.add({"role": role, "content": content}, where)
        return
    parts, part_origins, tool_calls, tool_results, reasoning = [], [], [], [], []
    for k, block in enumerate(content):
        at = f"{where}.content[{k}]"
        kind = _block(block, at)
        if kind == "text":
            parts.append({"type": "text", "text": _string(block, "text", at)})
            part_origins.append(at)
        elif kind == "image":
            parts.append(_image_url(block, at))
            part_origins.append(at)
        elif kind == "thinking":
            reasoning.append(_string(block, "thinking", at, ""))
        elif kind == "tool_use":
            tool_calls.append(_tool_call(block, at))
        elif kind == "tool_result":
            tool_results.append(_tool_message(block, at))
    thinking = "".join(reasoning)
    if parts or tool_calls or thinking:
        chat: dict = {"role": role, "content": parts if parts else ""}
        if tool_calls:
            chat["tool_calls"] = tool_calls
        if thinking:
            chat["reasoning_content"] = thinking
        out.add(chat, where, part_origins)
    for tool_message, tool_where, result_origins in tool_results:
        out.add(tool_message, tool_where, result_origins)


def _tool_call(block: dict, where: str) -> dict:
    """A tool_use block as an OpenAI tool call; its input as JSON text written as llama-server
    writes it (nlohmann's dump: keys sorted, no spaces, UTF-8 kept), so that both render it alike."""
    tool_input = block.get("input", {})
    if tool_input is None:
        tool_input = {}
    if not isinstance(tool_input, dict):
        raise bad_request(f"{where}.input must be an object, got {_type_name(tool_input)}", "messages")
    arguments = json.dumps(tool_input, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    return {"id": _string(block, "id", where, ""), "type": "function",
            "function": {"name": _string(block, "name", where, ""), "arguments": arguments}}


def _tool_message(block: dict, where: str) -> tuple[dict, str, list[str]]:
    """A tool_result block as an OpenAI ``tool`` message: a string stays one, text blocks are
    joined into one, blocks with an image stay parts (llama-server's), no content is ""."""
    call_id = _string(block, "tool_use_id", where, "")
    if not isinstance(block.get("is_error", False), (bool, type(None))):
        raise bad_request(f"{where}.is_error must be a boolean", "messages")
    content = block.get("content")
    if content is None or isinstance(content, str):
        return {"role": "tool", "tool_call_id": call_id, "content": content or ""}, where, []
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of text and image blocks, got "
                          f"{_type_name(content)}", "messages")
    parts, origins = [], []
    for c, inner in enumerate(content):
        at = f"{where}.content[{c}]"
        kind = inner.get("type") if isinstance(inner, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": _string(inner, "text", at)})
        elif kind == "image":
            parts.append(_image_url(inner, at))
        else:
            raise bad_request(f"{at} must be a text or image block, got {_SHOW.repr(inner)}", "messages")
        origins.append(at)
    if any(p["type"] == "image_url" for p in parts):
        return {"role": "tool", "tool_call_id": call_id, "content": parts}, where, origins
    return {"role": "tool", "tool_call_id": call_id, "content": "".join(p["text"] for p in parts)}, where, []


def _tools(tools: Any) -> list[dict]:
    """Anthropic tools (name, description, input_schema) as OpenAI function tools."""
    if not isinstance(tools, list):
        raise bad_request(f"'tools' must be a list of tools, got {_type_name(tools)}", "tools")
    out = []
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{where} must be an object with 'name' and 'input_schema', got {_SHOW.repr(tool)}",
                              "tools")
        schema = tool.get("input_schema", {})
        if not isinstance(schema, dict):
            raise bad_request(f"{where}.input_schema must be a JSON schema (an object)", "tools")
        out.append({"type": "function", "function": {"name": _string(tool, "name", where),
                                                     "description": _string(tool, "description", where, ""),
                                                     "parameters": schema}})
    return out


def _tool_choice(choice: Any) -> dict:
    """Anthropic's tool_choice as OpenAI's tool_choice (and parallel_tool_calls)."""
    if choice is None:
        return {}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise bad_request("'tool_choice' must be {'type': 'auto'}, {'type': 'any'}, {'type': 'tool', 'name': ...} "
                          f"or {{'type': 'none'}}, got {_SHOW.repr(choice)}", "tool_choice")
    if kind == "tool":
        name = _string(choice, "name", "tool_choice")
        out: dict = {"tool_choice": {"type": "function", "function": {"name": name}}}
    else:
        out = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}[kind]}
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("'tool_choice.disable_parallel_tool_use' must be a boolean", "tool_choice")
    if parallel:
        out["parallel_tool_calls"] = False
    return out


def _stop_sequences(stops: Any) -> list[str]:
    if not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise bad_request(f"'stop_sequences' must be a list of strings, got {_SHOW.repr(stops)}", "stop_sequences")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise bad_request(f"'stop_sequences' may hold at most {MAX_STOP_SEQUENCES} strings here, got {len(stops)}",
                          "stop_sequences")
    return list(stops)


def _thinking(thinking: Any) -> dict:
    """``thinking: {"type": "enabled", "budget_tokens": N}`` as llama-server's
    ``thinking_budget_tokens`` (10000 when not given); any other type asks for nothing."""
    if thinking is None:
        return {}
    if not isinstance(thinking, dict) or not isinstance(thinking.get("type"), str):
        raise bad_request(f"'thinking' must be an object with a 'type', got {_SHOW.repr(thinking)}", "thinking")
    if thinking["type"] != "enabled":
        return {}
    budget = thinking.get("budget_tokens", DEFAULT_THINKING_BUDGET)
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise bad_request(f"'thinking.budget_tokens' must be a non-negative integer, got {_SHOW.repr(budget)}",
                          "thinking")
    return {"thinking_budget_tokens": budget}


# --------------------------------------------------------------------------- answer: OpenAI chat -> Anthropic


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def stop_reason(finish_reason: str | None, *, tool_calls: bool, stop_sequence: str | None) -> str:
    """Anthropic's stop_reason of a chat answer: a tool call ended it (``tool_use``), a stop
    sequence did (``stop_sequence``), the end of the model's turn did (``end_turn``), or a limit
    did (``max_tokens``: max_tokens, the context, a line rule)."""
    if finish_reason == "length":
        return "max_tokens"
    if finish_reason == "tool_calls" or tool_calls:
        return "tool_use"
    return "stop_sequence" if stop_sequence else "end_turn"


def _tool_input(arguments: Any) -> dict:
    """A tool call's arguments (JSON text) as a tool_use input; {} when they are not a JSON object
    (llama-server's fallback for arguments it cannot parse)."""
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def usage(chat_usage: dict) -> dict:
    """llama-server's Anthropic usage: the prompt tokens read from the cache, the others, the output."""
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"cache_read_input_tokens": cached, "input_tokens": chat_usage["prompt_tokens"] - cached,
            "output_tokens": chat_usage["completion_tokens"]}


def anthropic_message(completion: dict, *, msg_id: str, stop_sequence: str | None = None) -> dict:
    """Anthropic's message object for OpenAI chat.completion ``completion`` (its first choice):
    a thinking block (reasoning_content), a text block, a tool_use block per tool call, in that
    order; ``stop_sequence`` is the stop string that ended it, if one did. The chat answer's
    ``timings`` come along, as ``pyllama_spec.timings`` (an extension)."""
    choice = completion["choices"][0]
    chat = choice["message"]
    content: list[dict] = []
    if chat.get("reasoning_content"):
        # no signature: a local model's thinking is not signed (llama-server's "")
        content.append({"type": "thinking", "thinking": chat["reasoning_content"], "signature": ""})
    if chat.get("content"):
        content.append({"type": "text", "text": chat["content"]})
    calls = chat.get("tool_calls") or []
    for call in calls:
        function = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id", ""), "name": function.get("name", ""),
                        "input": _tool_input(function.get("arguments"))})
    out = {"id": msg_id, "type": "message", "role": "assistant", "content": content,
           "model": completion["model"],
           "stop_reason": stop_reason(choice["finish_reason"], tool_calls=bool(calls), stop_sequence=stop_sequence),
           "stop_sequence": stop_sequence or None, "usage": usage(completion["usage"])}
    if "timings" in completion:
        out["pyllama_spec"] = {"timings": completion["timings"]}
    return out


class MessageStream:
    """Turns the chunks of one streamed chat answer into Anthropic's stream events, as llama-server
    sends them: ``message_start`` with the first generated token, a ``content_block_start`` when a
    block (thinking, text, each tool call) first gets something, its ``content_block_delta`` events
    (``thinking_delta``, ``text_delta``, ``input_json_delta``), and at the end every block's
    ``content_block_stop`` (a thinking block's empty ``signature_delta`` first), ``message_delta``
    (stop_reason, stop_sequence, output_tokens) and ``message_stop``.

    Each event is ``(name, data)``; feed every chunk to ``events``. The chunks must carry
    ``timings`` (the chat route's timings_per_token): message_start's usage is read from them.
    """

    def __init__(self, msg_id: str, model: str) -> None:
        self.msg_id, self.model = msg_id, model
        self.started = False
        self.blocks: dict[Any, int] = {}  # "thinking", "text" or ("tool", i) -> its block index
        self.tool_calls = False

    def events(self, chunk: dict, *, stop_sequence: str | None = None) -> list[tuple[str, dict]]:
        """The events for one chat chunk (none for the role chunk, the usage chunk or a step whose
        text is held back); ``stop_sequence``: the stop string that ended the answer, given with
        the chunk that has its finish_reason."""
        if not chunk.get("choices"):
            return []
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        if "role" in delta:  # the role chunk, sent before the prompt is decoded
            return []
        out = [] if self.started else [self._start(chunk)]
        if delta.get("reasoning_content"):
            out += self._delta("thinking", {"type": "thinking", "thinking": ""},
                               {"type": "thinking_delta", "thinking": delta["reasoning_content"]})
        if delta.get("content"):
            out += self._delta("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls") or []:
            out += self._tool_delta(call)
        if "pyllama_spec" in chunk and out:
            out[-1][1]["pyllama_spec"] = chunk["pyllama_spec"]
        if choice.get("finish_reason") is not None:
            out += self._finish(chunk, choice["finish_reason"], stop_sequence)
        return out

    def _start(self, chunk: dict) -> tuple[str, dict]:
        self.started = True
        timings = chunk.get("timings") or {}
        usage = {"cache_read_input_tokens": timings.get("cache_n", 0), "input_tokens": timings.get("prompt_n", 0),
                 "output_tokens": 0}
        return "message_start", {"type": "message_start", "message": {
            "id": self.msg_id, "type": "message", "role": "assistant", "content": [], "model": self.model,
            "stop_reason": None, "stop_sequence": None, "usage": usage}}

    def _open(self, key: Any, block: dict) -> list[tuple[str, dict]]:
        if key in self.blocks:
            return []
        self.blocks[key] = len(self.blocks)
        return [("content_block_start", {"type": "content_block_start", "index": self.blocks[key],
                                         "content_block": block})]

    def _delta(self, key: Any, block: dict, delta: dict) -> list[tuple[str, dict]]:
        opened = self._open(key, block)
        return opened + [("content_block_delta", {"type": "content_block_delta", "index": self.blocks[key],
                                                  "delta": delta})]

    def _tool_delta(self, call: dict) -> list[tuple[str, dict]]:
        """One OpenAI tool_calls delta: its first (with id and name) opens a tool_use block, its
        arguments text is an input_json_delta."""
        self.tool_calls = True
        key = ("tool", call.get("index", 0))
        function = call.get("function") or {}
        out = self._open(key, {"type": "tool_use", "id": call.get("id", ""), "name": function.get("name", ""),
                               "input": {}})
        if function.get("arguments"):
            out.append(("content_block_delta", {"type": "content_block_delta", "index": self.blocks[key],
                                                "delta": {"type": "input_json_delta",
                                                          "partial_json": function["arguments"]}}))
        return out

    def _finish(self, chunk: dict, finish_reason: str, stop_sequence: str | None) -> list[tuple[str, dict]]:
        out = []
        for key, index in sorted(self.blocks.items(), key=lambda kv: kv[1]):
            if key == "thinking":  # Anthropic's clients expect a signature before the block ends
                out.append(("content_block_delta", {"type": "content_block_delta", "index": index,
                                                    "delta": {"type": "signature_delta", "signature": ""}}))
            out.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        timings = chunk.get("timings") or {}
        end = {"type": "message_delta",
               "delta": {"stop_reason": stop_reason(finish_reason, tool_calls=self.tool_calls,
                                                    stop_sequence=stop_sequence),
                         "stop_sequence": stop_sequence or None},
               "usage": {"output_tokens": timings.get("predicted_n", 0)}}
        if timings:
            end["pyllama_spec"] = {"timings": timings}
        return out + [("message_delta", end), ("message_stop", {"type": "message_stop"})]


# --------------------------------------------------------------------------- errors


def error_body(error: APIError) -> dict:
    """An error in Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``, that is also
    the OpenAI shape llama-server answers (``error.message``, ``error.type``, plus ``code`` and
    ``param``): a client of either reads it."""
    return {"type": "error", **error.body()}
