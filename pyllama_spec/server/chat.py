"""Tool calls and reasoning on the chat route, as llama-server does them.

``render_chat`` renders a chat request (``Engine.chat_params``: the template with the tools,
tool results and reasoning, and llama.cpp's analysis of it, take milliseconds; ``Service.prepare``
runs it on a thread) before its jobs are queued; a chat the template refuses is a 400 there. The rendered chat goes to the engine
(its prompt, images, grammar with its triggers, stop strings, reasoning budget) and its parser
reads each choice's answer (``AnswerParser``): content, ``reasoning_content`` and ``tool_calls``
in OpenAI's message, and OpenAI's deltas while streaming, with ``finish_reason: "tool_calls"``
when the answer ended on its own with tool calls. These go into the chat.completion and
chat.completion.chunk objects of ``generation.complete_body`` / ``stream_objects``, so the routes
that translate those (Messages, Responses) get them too.

An answer the parser makes nothing of is the model's text as ``content``, as llama-server answers
it. Where this differs from llama-server: an answer that does not parse as the template's format
at its end (a tool call to a function that is not offered, text after the tool calls) is answered
the same way, as plain text (llama-server answers a 500); in a stream, the deltas sent stay, and
the text is sent as content when nothing was sent yet (llama-server sends nothing).
"""

from __future__ import annotations

import dataclasses

from pyllama_spec.server.errors import bad_request
from pyllama_spec.server.offload import off_loop
from pyllama_spec.serving.chat_template import ChatError, ChatParams, ChatParser

#: Parse on a thread once a choice's text is longer than this many characters (the parser reads all
#: of it each time): this module's own budget for ``offload.off_loop``.
PARSE_ANSWER_ON_A_THREAD_ABOVE = 8192


class AnswerParser:
    """One choice's answer, parsed as it comes (llama-server's task_result_state)."""

    def __init__(self, params: ChatParams, *, stream: bool) -> None:
        self.params = params
        self._parser = ChatParser(params.parser_params(stream=stream))
        self._size = 0
        self._text: list[str] = []
        self._sent = False
        self.message: dict = {"role": "assistant", "content": ""}

    async def feed(self, text: str, *, final: bool = False) -> list[dict]:
        """Add the answer's next text; OpenAI's deltas since the last call (with ``final``, the
        answer is whole: the parse is no longer partial)."""
        self._text.append(text)
        self._size += len(text)
        try:
            message, deltas = await off_loop(self._size > PARSE_ANSWER_ON_A_THREAD_ABOVE,
                                             lambda: self._parser.update(text, partial=not final))
        except ChatError:
            if not final:
                return []  # not parseable yet: the text is kept, the next update reads it again
            return self._plain_text()
        message["role"] = "assistant"
        self.message = message
        deltas = [d for d in deltas if d]
        self._sent = self._sent or bool(deltas)
        if final and not _has_parts(message):
            return deltas + self._plain_text()  # nothing parsed (llama-server then answers the text)
        return deltas

    def _plain_text(self) -> list[dict]:
        """The answer as the model's text, in content: whole, or as a delta when none went out."""
        whole = "".join(self._text)
        if self._sent:  # what went out stands
            return []
        self.message = {"role": "assistant", "content": whole}
        self._sent = bool(whole)
        return [{"content": whole}] if whole else []

    def finish_reason(self, ended: str | None) -> str | None:
        """llama-server's: "tool_calls" for an answer that ended by itself (an end-of-generation
        token or a stop string) with tool calls."""
        if ended == "stop" and self.message.get("tool_calls"):
            return "tool_calls"
        return ended


def _has_parts(message: dict) -> bool:
    return bool(message.get("content") or message.get("reasoning_content") or message.get("tool_calls"))


@dataclasses.dataclass
class RenderedChat:
    """A chat request's rendered chat and a parser of each choice's answer."""

    params: ChatParams
    parsers: list[AnswerParser]


def render_chat(engine, req) -> None:
    """Render a chat request's messages and options (a 400 for a chat the template refuses), put
    the rendered chat in its settings and keep it, with a parser per choice, as ``req.chat``. A
    request that is not a chat, or is rendered already, is left alone. Takes milliseconds with
    tools: ``Service.prepare`` runs it on a thread."""
    params = req.params
    if req.kind != "chat" or req.chat is not None or params.messages is None:
        return
    try:
        chat = engine.chat_params(params.messages, params.chat_options)
        parsers = [AnswerParser(chat, stream=req.stream) for _ in range(req.n)]
    except ChatError as e:
        raise bad_request(f"the chat's parser: {e}", "messages") from None
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    req.chat = RenderedChat(chat, parsers)
    req.params = params.replace(messages=None, chat_options=None, chat=chat)
