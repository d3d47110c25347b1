"""A streamed chat completion's chunks as the Responses stream's events (``EventTranslator``)."""

from __future__ import annotations

import dataclasses

from pyllama_spec.server.responses.convert import (
    ResponseHead,
    call_ids,
    finish_status,
    function_call_item,
    message_item,
    new_id,
    reasoning_item,
    responses_usage,
)


@dataclasses.dataclass
class _OpenItem:
    kind: str  # "message", "reasoning" or "function_call"
    index: int  # its output_index
    id: str
    text: list = dataclasses.field(default_factory=list)  # its text or arguments, piece by piece
    call_id: str = ""  # a function call's call_id
    name: str = ""


class EventTranslator:
    """A streamed chat completion's chunks in, the Responses stream's events out (each a dict with
    its ``type`` and ``sequence_number``): ``start()``, then ``chunk(c)`` for each chunk (text,
    reasoning_content and tool_calls deltas, prompt_progress, the finish reason, usage and
    timings), then ``finish()``; ``output`` holds the finished output items."""

    def __init__(self, head: ResponseHead) -> None:
        self.head = head
        self.output: list[dict] = []
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.timings: dict | None = None
        self._seq = 0
        self._open: _OpenItem | None = None
        self._calls: dict[int, _OpenItem] = {}  # chat tool call index -> its item

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, **fields, "sequence_number": self._seq}
        self._seq += 1
        return event

    def start(self) -> list[dict]:
        progress = self.head.body("in_progress", [])
        return [self._event("response.created", response=progress),
                self._event("response.in_progress", response=progress)]

    def chunk(self, chunk: dict) -> list[dict]:
        events = []
        if "prompt_progress" in chunk:  # llama-server: an in_progress event with the progress
            events.append(self._event("response.in_progress", response=self.head.body("in_progress", []),
                                      prompt_progress=chunk["prompt_progress"]))
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._delta("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._delta("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._tool_call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if chunk.get("timings") is not None:
            self.timings = chunk["timings"]
        if events:  # the step's extension and timings (timings_per_token) on its last event, as llama-server
            for key in ("pyllama_spec", "timings"):
                if key in chunk:
                    events[-1][key] = chunk[key]
        return events

    def finish(self) -> list[dict]:
        """The closing events of the open item, then response.completed (or response.incomplete
        when max_output_tokens cut the answer), with the usage and the timings."""
        status, incomplete = finish_status(self.finish_reason)
        events = self._close("incomplete" if incomplete else "completed")
        body = self.head.body(status, self.output, responses_usage(self.usage), incomplete, self.timings)
        final = self._event(f"response.{status}", response=body)
        if self.timings is not None:
            final["timings"] = self.timings  # where llama-server puts them
        return events + [final]

    def _delta(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open.kind != kind:
            events += self._begin(_OpenItem(kind, len(self.output), new_id("msg" if kind == "message" else "rs")))
        item = self._open
        item.text.append(text)
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(name, item_id=item.id, output_index=item.index, content_index=0, delta=text,
                                  **extra))
        return events

    def _tool_call(self, call: dict) -> list[dict]:
        """A chat tool_calls delta: a new index opens a function_call item (its id and name come
        with it), arguments are its arguments' deltas. Calls stream one after another."""
        index = call.get("index", 0)
        function = call.get("function") or {}
        events = []
        item = self._calls.get(index)
        if item is None:
            item_id, call_id = call_ids(call.get("id"))
            item = _OpenItem("function_call", len(self.output), item_id, call_id=call_id,
                             name=function.get("name") or "")
            self._calls[index] = item
            events += self._begin(item)
        elif function.get("name") and not item.name:  # a name that came after the call's id
            item.name = function["name"]
        if function.get("arguments"):
            item.text.append(function["arguments"])
            events.append(self._event("response.function_call_arguments.delta", item_id=item.id,
                                      output_index=item.index, delta=function["arguments"]))
        return events

    def _begin(self, item: _OpenItem) -> list[dict]:
        events = self._close("completed")
        self._open = item
        if item.kind == "message":
            added = {"id": item.id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        elif item.kind == "reasoning":
            added = {"id": item.id, "type": "reasoning", "summary": [], "status": "in_progress", "content": [],
                     "encrypted_content": ""}
        else:
            added = {"id": item.id, "type": "function_call", "status": "in_progress", "arguments": "",
                     "call_id": item.call_id, "name": item.name}
        self.output.append(added)  # replaced by the finished item when it closes
        events.append(self._event("response.output_item.added", output_index=item.index, item=dict(added)))
        if item.kind == "message":
            events.append(self._event("response.content_part.added", item_id=item.id, output_index=item.index,
                                      content_index=0, part={"type": "output_text", "annotations": [],
                                                             "logprobs": [], "text": ""}))
        return events

    def _close(self, status: str) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        text, at = "".join(item.text), {"item_id": item.id, "output_index": item.index}
        events = []
        if item.kind == "message":
            done = message_item(item.id, text, status)
            events.append(self._event("response.output_text.done", **at, content_index=0, text=text, logprobs=[]))
            events.append(self._event("response.content_part.done", **at, content_index=0,
                                      part=done["content"][0]))
        elif item.kind == "reasoning":
            done = reasoning_item(item.id, text, status)
            events.append(self._event("response.reasoning_text.done", **at, content_index=0, text=text))
        else:
            done = function_call_item(item.id, item.call_id, item.name, text, status)
            events.append(self._event("response.function_call_arguments.done", **at, arguments=text))
        self.output[item.index] = done
        events.append(self._event("response.output_item.done", output_index=item.index, item=done))
        return events
