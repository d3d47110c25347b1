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

An answer the parser makes nothing of is the model's text as ``content`` (serving/chat_answer.py
says where that differs from llama-server).
"""

from __future__ import annotations

import dataclasses

from pyllama_spec.server.errors import bad_request
from pyllama_spec.server.offload import off_loop
from pyllama_spec.serving.chat_answer import ChatAnswer
from pyllama_spec.serving.chat_template import ChatError, ChatParams

#: Parse on a thread once a choice's text is longer than this many characters (the parser reads all
#: of it each time): this module's own budget for ``offload.off_loop``.
PARSE_ANSWER_ON_A_THREAD_ABOVE = 8192


class AnswerParser(ChatAnswer):
    """One choice's answer (serving/chat_answer.py), parsed on a thread once it is long."""

    async def feed(self, text: str, *, final: bool = False) -> list[dict]:
        return await off_loop(self.size + len(text) > PARSE_ANSWER_ON_A_THREAD_ABOVE,
                              lambda: ChatAnswer.feed(self, text, final=final))


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
