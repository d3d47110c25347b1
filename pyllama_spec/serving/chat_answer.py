"""One chat answer parsed as it comes (llama-server's task_result_state), for the server's chat
route and the llama-cpp-python facade alike.

The template's parser (or the generic tool format's, serving/generic_tools.py) reads the text as
it grows: content, ``reasoning_content`` and ``tool_calls`` in OpenAI's message, and OpenAI's
deltas since the last update. An answer it makes nothing of is the model's text as ``content``,
as llama-server answers it; where the whole answer does not parse (a call to a function that is
not offered, text after the calls) it is answered the same way (llama-server answers a 500); in
a stream the deltas sent stay, and the text is sent as content when nothing was sent yet.
"""

from __future__ import annotations

from pyllama_spec.serving.chat_template import ChatError, ChatParams


class ChatAnswer:
    def __init__(self, params: ChatParams, *, stream: bool) -> None:
        self.params = params
        self._parser = params.answer_parser(stream=stream)
        self._text: list[str] = []
        self._sent = False
        self.size = 0  # characters so far (the parser reads all of them at each update)
        self.message: dict = {"role": "assistant", "content": ""}

    def feed(self, text: str, *, final: bool = False) -> list[dict]:
        """Add the answer's next text; OpenAI's deltas since the last call (with ``final``, the
        answer is whole: the parse is no longer partial)."""
        self._text.append(text)
        self.size += len(text)
        try:
            message, deltas = self._parser.update(text, partial=not final)
        except ChatError:
            if not final:
                return []  # not parseable yet: the text is kept, the next update reads it again
            return self._plain_text()
        message["role"] = "assistant"
        self.message = message
        deltas = [d for d in deltas if d]
        self._sent = self._sent or bool(deltas)
        parsed = message.get("content") or message.get("reasoning_content") or message.get("tool_calls")
        # nothing parsed: llama-server then answers the text (a generic answer parsed is what it says,
        # an empty response included)
        if final and not parsed and self.params.tool_format != "generic":
            return deltas + self._plain_text()
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
