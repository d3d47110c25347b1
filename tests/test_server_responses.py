"""OpenAI's Responses API (server/responses/): POST /v1/responses and /v1/responses/input_tokens.

* The conversion itself, both ways, on hand-written OpenAI shapes: Responses items (messages,
  images, function calls and their outputs, reasoning) into chat messages as llama-server merges
  them; a chat message with tool_calls, and streamed tool_calls / reasoning_content deltas, into
  function_call / reasoning items and their events, read back by the openai client's own stream
  state; the store of conversations and its bounds; random bodies are a 400 or a chat body.
* The real openai client (``responses.create``, streamed and not, ``responses.stream``,
  ``responses.input_tokens.count``) against a LocalServer on the tiny models: the answer is the
  chat route's greedy answer for the same conversation, images included; max_output_tokens ends
  it incomplete; previous_response_id continues a conversation from the cached prefix.
* The pinned llama-server on the same files and requests: the same text, usage, fields, event
  sequence and statuses, each difference asserted and named (``DIFFERENT_STATUS``).
"""

from __future__ import annotations

import base64
import io
import json
import re
import urllib.request

import numpy as np
import pytest
from conftest import LLAMA_SERVER, N_THREADS, NO_LLAMA_SERVER, load_tiny

import pyllama_spec as ps

openai = pytest.importorskip("openai", reason="the test extra brings the openai client")
pytest.importorskip("starlette", reason="the server needs the 'server' extra")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pyllama_spec.server import ServerSettings  # noqa: E402
from pyllama_spec.server.errors import APIError  # noqa: E402
from pyllama_spec.server.images import ImageLimits  # noqa: E402
from pyllama_spec.server.responses.convert import (  # noqa: E402
    ResponseHead,
    chat_body,
    chat_messages,
    input_items,
    output_items,
    request_echo,
)
from pyllama_spec.server.responses.events import EventTranslator  # noqa: E402
from pyllama_spec.server.responses.store import ResponseStore, Turn  # noqa: E402
from pyllama_spec.server.schema import RequestLimits, parse_chat  # noqa: E402

from serving import LocalServer  # noqa: E402
from serving import http as post  # noqa: E402
from test_llama_server_parity import _Process  # noqa: E402


def _png(seed: int = 0, side: int = 64) -> str:
    from PIL import Image

    buf = io.BytesIO()
    pixels = (np.random.default_rng(seed).random((side, side, 3)) * 255).astype(np.uint8)
    Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat_of(body: dict) -> dict:
    return chat_body(body, input_items(body))


# --------------------------------------------------------------------------- request -> chat body


def test_text_input_is_one_user_message_after_the_instructions():
    chat = _chat_of({"input": "hello", "instructions": "be brief", "max_output_tokens": 9, "seed": 3,
                     "store": False, "metadata": {"a": "b"}})
    # llama-server passes the fields it does not translate (seed) on to the chat parser
    assert chat == {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
                    "max_tokens": 9, "seed": 3}


def test_items_become_chat_messages_merged_as_llama_server_merges_them():
    image = _png()
    items = [
        {"type": "message", "role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "input_text", "text": "look"},
                                     {"type": "input_image", "image_url": image, "detail": "auto"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "I will click", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "click", "arguments": '{"x": 1}'},
        {"type": "function_call", "call_id": "call_2", "name": "type", "arguments": '{"t": "a"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "clicked"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "now:"}, {"type": "input_image", "image_url": image}]},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "a summary only"}]},
        {"role": "assistant", "content": "done"},
    ]
    assert chat_messages(items) == [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": image}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "I will click"}], "reasoning_content": "hmm",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "click", "arguments": '{"x": 1}'}},
                        {"id": "call_2", "type": "function", "function": {"name": "type", "arguments": '{"t": "a"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "clicked"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "now:"},
                                                             {"type": "image_url", "image_url": {"url": image}}]},
        # a reasoning item with a summary only adds nothing; the assistant message stands alone
        {"role": "assistant", "content": "done"},
    ]


def test_a_function_call_after_a_user_message_opens_an_assistant_message():
    items = [{"role": "user", "content": "go"},
             {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]
    assert chat_messages(items)[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def test_function_tools_take_the_chat_shape_and_other_tools_are_skipped():
    tools = [{"type": "function", "name": "click", "description": "click at", "parameters": {"type": "object"}},
             {"type": "function", "name": "scroll", "parameters": {}, "strict": False},
             {"type": "web_search"}]
    chat = _chat_of({"input": "x", "tools": tools, "tool_choice": {"type": "function", "name": "click"},
                     "parallel_tool_calls": False})
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "click", "description": "click at",
                                          "parameters": {"type": "object"}, "strict": True}},
        {"type": "function", "function": {"name": "scroll", "parameters": {}, "strict": False}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "click"}}
    assert chat["parallel_tool_calls"] is False
    assert _chat_of({"input": "x", "tool_choice": "required"})["tool_choice"] == "required"


@pytest.mark.parametrize("text,expected", [
    ({"format": {"type": "text"}}, None),
    ({"format": {"type": "json_object"}}, {"type": "json_object"}),
    ({"format": {"type": "json_schema", "name": "n", "schema": {"type": "integer"}, "strict": True}},
     {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}, "strict": True}}),
])
def test_text_format_is_the_chat_routes_response_format(text, expected):
    chat = _chat_of({"input": "x", "text": text, "reasoning": {"effort": "low"}})
    assert chat.get("response_format") == expected
    assert chat["reasoning_effort"] == "low"  # as llama-server passes it on


def test_a_stream_asks_the_chat_route_for_its_usage():
    assert _chat_of({"input": "x", "stream": True})["stream_options"] == {"include_usage": True}


# --------------------------------------------------------------------------- chat answer -> response


def test_a_chat_message_with_tool_calls_becomes_function_call_items_that_read_back_as_the_same_calls():
    message = {"role": "assistant", "content": "Clicking.", "reasoning_content": "the button is at 3",
               "tool_calls": [{"id": "abc", "type": "function", "function": {"name": "click", "arguments": '{"x":3}'}},
                              {"id": "call_def", "type": "function",
                               "function": {"name": "wait", "arguments": "{}"}}]}
    items = output_items(message)
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "the button is at 3"}]
    assert items[1]["content"][0]["text"] == "Clicking."
    # llama-server's names: fc_<id> and call_<id> (an id that is already call_... is not prefixed twice)
    assert [(i["id"], i["call_id"], i["name"], i["arguments"]) for i in items[2:]] == [
        ("fc_abc", "call_abc", "click", '{"x":3}'), ("fc_def", "call_def", "wait", "{}")]
    assert all(i["status"] == "completed" for i in items)
    # the next turn sends them back: the same assistant message, its calls under their call_ids
    back = chat_messages(items + [{"type": "function_call_output", "call_id": "call_abc", "output": "ok"}])
    assert back == [
        {"role": "assistant", "content": [{"type": "text", "text": "Clicking."}],
         "reasoning_content": "the button is at 3",
         "tool_calls": [{"id": "call_abc", "type": "function", "function": {"name": "click", "arguments": '{"x":3}'}},
                        {"id": "call_def", "type": "function", "function": {"name": "wait", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "ok"}]


def test_an_empty_answer_has_no_message_item_and_a_cut_one_is_incomplete():
    assert output_items({"role": "assistant", "content": ""}) == []
    assert output_items({"role": "assistant", "content": "ab"}, "incomplete")[0]["status"] == "incomplete"


def _chunk(delta: dict | None = None, finish: str | None = None, **extra) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": choices, **extra}


#: A streamed chat answer with reasoning, text and two tool calls, as OpenAI's chat chunks carry them.
TOOL_CHUNKS = [
    _chunk({"role": "assistant", "content": ""}),
    _chunk({"reasoning_content": "need "}),
    _chunk({"reasoning_content": "a click"}),
    _chunk({"content": "Click"}, pyllama_spec={"tokens": [], "drafted": 2, "accepted": 1}),
    _chunk({"content": "ing."}),
    _chunk({"tool_calls": [{"index": 0, "id": "t1", "type": "function",
                            "function": {"name": "click", "arguments": ""}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"x":'}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "3}"}}]}),
    _chunk({"tool_calls": [{"index": 1, "id": "t2", "type": "function",
                            "function": {"name": "wait", "arguments": "{}"}}]}),
    _chunk({}, "tool_calls", timings={"draft_n": 4, "draft_n_accepted": 3}),
    _chunk(usage={"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17,
                  "prompt_tokens_details": {"cached_tokens": 4}}),
]


def _translate(chunks: list[dict]) -> tuple[EventTranslator, list[dict]]:
    events = EventTranslator(ResponseHead("resp_1", 100, "tiny", request_echo({"input": "x"})))
    out = events.start()
    for c in chunks:
        out += events.chunk(c)
    return events, out + events.finish()


def test_streamed_tool_calls_and_reasoning_become_items_and_their_events():
    events, out = _translate(TOOL_CHUNKS)
    assert [(e["type"], e.get("output_index")) for e in out] == [
        ("response.created", None), ("response.in_progress", None),
        ("response.output_item.added", 0), ("response.reasoning_text.delta", 0), ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.content_part.added", 1), ("response.output_text.delta", 1),
        ("response.output_text.delta", 1), ("response.output_text.done", 1), ("response.content_part.done", 1),
        ("response.output_item.done", 1),
        ("response.output_item.added", 2), ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.delta", 2), ("response.function_call_arguments.done", 2),
        ("response.output_item.done", 2),
        ("response.output_item.added", 3), ("response.function_call_arguments.delta", 3),
        ("response.function_call_arguments.done", 3), ("response.output_item.done", 3),
        ("response.completed", None)]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert out[9]["pyllama_spec"] == {"tokens": [], "drafted": 2, "accepted": 1}  # the step's extension
    final = out[-1]["response"]
    assert final["status"] == "completed" and out[-1]["timings"] == final["timings"] == {"draft_n": 4,
                                                                                         "draft_n_accepted": 3}
    assert final["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 7,
                              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 17}
    assert final["output"] == events.output
    assert [(i["type"], i.get("call_id"), i.get("arguments")) for i in final["output"]] == [
        ("reasoning", None, None), ("message", None, None), ("function_call", "call_t1", '{"x":3}'),
        ("function_call", "call_t2", "{}")]
    assert final["output"][0]["content"][0]["text"] == "need a click"
    assert final["output"][1]["content"][0]["text"] == "Clicking."
    # the same items a whole answer gives (ids aside)
    whole = output_items({"role": "assistant", "content": "Clicking.", "reasoning_content": "need a click",
                          "tool_calls": [{"id": "t1", "function": {"name": "click", "arguments": '{"x":3}'}},
                                         {"id": "t2", "function": {"name": "wait", "arguments": "{}"}}]})
    strip = [{k: v for k, v in i.items() if k != "id" or i["type"] == "function_call"} for i in whole]
    assert strip == [{k: v for k, v in i.items() if k != "id" or i["type"] == "function_call"}
                     for i in final["output"]]


def test_the_openai_clients_stream_state_reads_the_events_into_the_same_response():
    from openai._models import construct_type
    from openai.lib.streaming.responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    _, out = _translate(TOOL_CHUNKS)
    state = ResponseStreamState(input_tools=[], text_format=openai.omit)
    seen = []
    for event in out:
        seen += state.handle_event(construct_type(type_=ResponseStreamEvent, value=event))
    final = state._completed_response
    assert final is not None and final.status == "completed"
    assert final.output_text == "Clicking."
    assert [(c.name, c.arguments) for c in final.output if c.type == "function_call"] == [("click", '{"x":3}'),
                                                                                      ("wait", "{}")]
    snapshots = [e.snapshot for e in seen if e.type == "response.function_call_arguments.delta"]
    assert snapshots == ['{"x":', '{"x":3}', "{}"]


def test_an_answer_cut_by_max_output_tokens_ends_with_response_incomplete():
    _, out = _translate([_chunk({"content": "abc"}), _chunk({}, "length")])
    assert out[-1]["type"] == "response.incomplete"
    final = out[-1]["response"]
    assert (final["status"], final["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert final["output"][0]["status"] == "incomplete" and final["completed_at"] is None


# --------------------------------------------------------------------------- the store


def _turn(size: int) -> Turn:
    return Turn(b"[" + b" " * (size - 2) + b"]")  # an empty list of items, `size` bytes of JSON


def test_a_stored_turn_holds_in_memory_about_the_bytes_it_counts():
    """Issue 43, item 4: a turn kept its request's items as Python objects, about 24 times the bytes
    counted for them (380 stored 300 KB requests, counted 109 MiB, took 2.7 GB); it now keeps them as
    JSON, and reads them back the same."""
    import tracemalloc

    items = [{"role": "user", "content": [{"type": "input_text", "text": "look"}],
              "unused": [{"k": i, "v": i + 0.5} for i in range(20_000)]}]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        turns = [Turn.of(items) for _ in range(5)]
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    counted = sum(t.size for t in turns)
    assert counted > 5 * 300_000 and held < 1.2 * counted, (held, counted)
    assert turns[0].items == items


def test_the_store_evicts_the_least_recently_used_conversation():
    store = ResponseStore(max_responses=2, max_bytes=10**6)
    a, b, c = (_turn(10),), (_turn(10),), (_turn(10),)
    assert store.put("a", a) and store.put("b", b)
    assert store.get("a") == a  # a is now the most recently used
    store.put("c", c)
    assert (store.get("a"), store.get("b"), store.get("c")) == (a, None, c)
    assert len(store) == 2 and store.bytes == 20
    store.put("c", c)  # the same id again replaces it, counted once
    assert len(store) == 2 and store.bytes == 20


def test_the_store_counts_a_shared_turn_once_and_frees_it_with_its_last_holder():
    store = ResponseStore(max_responses=10, max_bytes=100)
    first = (_turn(40),)
    second = first + (_turn(30),)
    store.put("r1", first)
    store.put("r2", second)
    assert store.bytes == 70  # the first turn is held by both, counted once
    # 120 bytes: r1 goes first, but r2 still holds its turn, so r2 goes too
    store.put("other", (_turn(50),))
    assert (store.get("r1"), store.get("r2"), store.bytes, len(store)) == (None, None, 50, 1)
    assert not store.put("huge", (_turn(101),))  # over the limit alone: not kept, nothing evicted
    assert store.get("other") is not None and store.get("huge") is None


# --------------------------------------------------------------------------- random bodies

_LIMITS = RequestLimits(max_tokens=64, default_max_tokens=8, draft_max=4, images=ImageLimits(max_images=2))
_KEYS = ["input", "instructions", "tools", "tool_choice", "text", "reasoning", "max_output_tokens", "type", "role",
         "content", "image_url", "file_id", "call_id", "name", "arguments", "output", "summary", "format",
         "schema", "effort", "n", "stream", "background", "conversation", "previous_response_id"]
_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 70) | st.sampled_from(
        ["", "x", "user", "assistant", "system", "developer", "message", "input_text", "input_image", "output_text",
         "function_call", "function_call_output", "reasoning", "refusal", "json_schema", "json_object", "text",
         "function", "auto", "required", "data:image/png;base64,AAAA", "input_file"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(_KEYS), inner, max_size=5),
    max_leaves=30)


@settings(max_examples=400, deadline=None)
@given(body=st.dictionaries(st.sampled_from(_KEYS), _VALUES, max_size=6))
def test_random_bodies_are_a_chat_request_or_a_400(body):
    try:
        parse_chat(_chat_of(body), _LIMITS)
    except APIError as e:
        assert e.status == 400 and e.message


# --------------------------------------------------------------------------- over HTTP, with the openai client


def _engine(models, **kw):
    return load_tiny(models, n_ctx=4096, draft_max=7, flash_attn=False, **kw)


@pytest.fixture(scope="module")
def served(tiny_dense):
    engine = _engine(tiny_dense)
    server = LocalServer(engine, ServerSettings(alias="tiny", max_image_pixels=1024 * 1024))
    yield server
    server.stop()
    engine.close()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


def _chat(url: str, messages: list, max_tokens: int) -> dict:
    status, answer = post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens,
                                                        "temperature": 0})
    assert status == 200, answer
    return answer


def test_text_and_instructions_give_the_chat_routes_greedy_answer(served, client):
    r = client.responses.create(model="tiny", instructions="You write Python.", input="def add(a, b):",
                                max_output_tokens=16, temperature=0)
    chat = _chat(served.url, [{"role": "system", "content": "You write Python."},
                              {"role": "user", "content": "def add(a, b):"}], 16)
    assert r.output_text == chat["choices"][0]["message"]["content"] and r.output_text
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat["usage"]["prompt_tokens"],
                                                             chat["usage"]["completion_tokens"])
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "You write Python." and r.max_output_tokens == 16
    timings = r.model_extra["timings"]  # the speculative stats, as on the chat route
    assert timings["predicted_n"] == r.usage.output_tokens and timings["draft_n"] > 0
    assert 0 <= timings["draft_n_accepted"] <= timings["draft_n"]


def test_max_output_tokens_ends_the_answer_incomplete(client):
    r = client.responses.create(model="tiny", input="write a story", max_output_tokens=5, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output[0].status == "incomplete"


def test_an_input_image_is_read_as_the_chat_route_reads_it(served, client):
    image = _png(1)
    r = client.responses.create(model="tiny", max_output_tokens=12, temperature=0, input=[{
        "role": "user", "content": [{"type": "input_image", "image_url": image},
                                    {"type": "input_text", "text": "What is this?"}]}])
    chat = _chat(served.url, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                           {"type": "text", "text": "What is this?"}]}], 12)
    assert r.output_text == chat["choices"][0]["message"]["content"]
    text_only = post(served.url, "/v1/responses/input_tokens", {"input": "What is this?"})[1]["input_tokens"]
    assert r.usage.input_tokens == chat["usage"]["prompt_tokens"] > text_only  # the image's rows are in it


def _events(url: str, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed /v1/responses."""
    req = urllib.request.Request(url + "/v1/responses", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        blocks = r.read().decode().replace("\r\n", "\n").split("\n\n")
    out = []
    for block in filter(None, (b.strip("\n") for b in blocks)):
        lines = dict(line.split(": ", 1) for line in re.split(r"\r\n|\r|\n", block) if ": " in line)
        if "data" in lines:  # not a keep-alive comment
            out.append((lines.get("event"), json.loads(lines["data"])))
    return out


def _collapsed(names: list[str]) -> list[str]:
    """Event names with each run of deltas as one (a speculative step streams several tokens at once)."""
    return [n for k, n in enumerate(names) if not (n.endswith(".delta") and k and names[k - 1] == n)]


TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]


def test_a_stream_sends_the_answer_in_openais_event_sequence(served, client):
    body = {"input": "def add(a, b):", "max_output_tokens": 16, "temperature": 0}
    events = _events(served.url, body)
    names = [name for name, _ in events]
    assert _collapsed(names) == TEXT_EVENTS + ["response.incomplete"]
    assert all(data["type"] == name for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    whole = client.responses.create(model="tiny", **body)
    assert text == whole.output_text == events[-1][1]["response"]["output"][0]["content"][0]["text"]
    assert all("pyllama_spec" in d for n, d in events if n == "response.output_text.delta")
    final = events[-1][1]
    assert final["timings"]["predicted_n"] == final["response"]["usage"]["output_tokens"] == 16
    # the openai client reads the same stream
    streamed = list(client.responses.create(model="tiny", stream=True, **body))
    assert _collapsed([e.type for e in streamed]) == _collapsed(names)


def test_the_stream_helper_gives_the_final_response_of_a_completed_answer(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    text = {"format": {"type": "json_schema", "name": "n", "schema": schema}}
    with client.responses.stream(model="tiny", input="a number", max_output_tokens=60, temperature=0,
                                 text=text) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(deltas)
    assert isinstance(json.loads(final.output_text)["n"], int)  # text.format constrained it
    whole = client.responses.create(model="tiny", input="a number", max_output_tokens=60, temperature=0, text=text)
    assert whole.output_text == final.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_a_chain_with_empty_input_continues_the_answer_once_not_twice(served, client, stream):
    """Issue 43, item 9: with no new input the answer continues the last assistant message (llama-server
    prefills it); a whole answer repeats that message, and storing it beside the message doubled the
    conversation at every hop (24, 28, 36, 52 tokens). Each hop's prompt is now the chat of the user's
    message and one assistant message: the answers so far, once."""
    first = client.responses.create(model="tiny", input="def add(a, b):", max_output_tokens=6, temperature=0)
    said = [first.output_text]  # the assistant message's parts, as the conversation holds them
    prev = first.id
    for _ in range(3):
        body = {"input": [], "previous_response_id": prev, "max_output_tokens": 4, "temperature": 0}
        if stream:
            response = [data["response"] for name, data in _events(served.url, body)
                        if name in ("response.completed", "response.incomplete")][0]
        else:
            status, response = post(served.url, "/v1/responses", body)
            assert status == 200, response
        chat = _chat(served.url, [{"role": "user", "content": "def add(a, b):"}, {
            "role": "assistant", "content": [{"type": "text", "text": t} for t in said]}], 1)
        assert response["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"], (said, response["usage"])
        text = "".join(p["text"] for item in response["output"] if item["type"] == "message" for p in item["content"])
        assert text
        # a whole answer holds the message it continued, from its start; a stream sends the new text
        said = said + [text] if stream else [text]
        prev = response["id"]
    count = client.responses.input_tokens.count(model="tiny", input=[], previous_response_id=prev)
    chat = _chat(served.url, [{"role": "user", "content": "def add(a, b):"}, {
        "role": "assistant", "content": [{"type": "text", "text": t} for t in said]}], 1)
    assert count.input_tokens == chat["usage"]["prompt_tokens"]


def test_input_of_assistant_text_alone_continues_the_stored_answer_once(served, client):
    """The new input is an assistant message only: the template merges it into the stored answer
    before it, and the whole answer repeats both; the stored conversation holds that answer once."""
    first = client.responses.create(model="tiny", input="def add(a, b):", max_output_tokens=6, temperature=0)
    status, second = post(served.url, "/v1/responses", {
        "input": [{"role": "assistant", "content": "    return"}], "previous_response_id": first.id,
        "max_output_tokens": 4, "temperature": 0})
    assert status == 200, second
    text = "".join(p["text"] for item in second["output"] if item["type"] == "message" for p in item["content"])
    count = client.responses.input_tokens.count(model="tiny", input=[], previous_response_id=second["id"])
    chat = _chat(served.url, [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": text}], 1)
    assert count.input_tokens == chat["usage"]["prompt_tokens"]


def test_previous_response_id_continues_the_conversation_from_the_cached_prefix(served, client):
    system = "You complete Python code."
    first = client.responses.create(model="tiny", instructions=system, input="def mul(a, b):",
                                    max_output_tokens=8, temperature=0)
    second = client.responses.create(model="tiny", instructions=system, input="now divide",
                                     previous_response_id=first.id, max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id
    # the second prompt starts with the first turn: its prefix came from the cache
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 2 > 0
    chat = _chat(served.url, [{"role": "system", "content": system}, {"role": "user", "content": "def mul(a, b):"},
                              {"role": "assistant", "content": first.output_text},
                              {"role": "user", "content": "now divide"}], 8)
    assert second.output_text == chat["choices"][0]["message"]["content"]
    assert second.usage.input_tokens == chat["usage"]["prompt_tokens"]
    # a third turn carries both earlier ones; input_tokens counts the same prompt
    count = client.responses.input_tokens.count(model="tiny", instructions=system, input="and add",
                                                previous_response_id=second.id)
    third = client.responses.create(model="tiny", instructions=system, input="and add",
                                    previous_response_id=second.id, max_output_tokens=2, temperature=0)
    assert count.input_tokens == third.usage.input_tokens > second.usage.input_tokens


def test_an_unknown_or_unstored_previous_response_id_is_openais_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="x", previous_response_id="resp_nothing")
    assert e.value.code == "previous_response_not_found" and e.value.param == "previous_response_id"
    unstored = client.responses.create(model="tiny", input="x", max_output_tokens=1, store=False)
    assert unstored.store is False
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input="y", previous_response_id=unstored.id)


def test_the_store_keeps_the_most_recently_used_responses(tiny_dense):
    engine = ps.load(tiny_dense.target, n_ctx=1024, n_threads=N_THREADS)
    server = LocalServer(engine, ServerSettings(alias="tiny", responses_stored=2))
    try:
        ids = []
        for text in ("a", "b", "c"):
            status, r = post(server.url, "/v1/responses", {"input": text, "max_output_tokens": 1})
            assert status == 200, r
            ids.append(r["id"])
        def status(rid: str) -> int:
            return post(server.url, "/v1/responses", {"input": "d", "max_output_tokens": 1,
                                                      "previous_response_id": rid})[0]

        # a went when c came; continuing b uses it and stores one more, so c (used least lately) goes
        assert [status(ids[0]), status(ids[1]), status(ids[2]), status(ids[1])] == [400, 200, 400, 200]
    finally:
        server.stop()
        engine.close()


def test_input_tokens_counts_the_prompt_the_route_renders(served, client):
    image = _png(2)
    for body in ({"input": "hi"}, {"input": "hi", "instructions": "be brief"},
                 {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": image},
                                                         {"type": "input_text", "text": "?"}]}]}):
        for path in ("/v1/responses/input_tokens", "/responses/input_tokens"):
            status, counted = post(served.url, path, body)
            assert status == 200 and counted["object"] == "response.input_tokens", counted
            created = client.responses.create(model="tiny", max_output_tokens=1, **body)
            assert counted["input_tokens"] == created.usage.input_tokens


BAD_BODIES = [
    ([1, 2], None),
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": [5]}, "input"),
    ({"input": [{"type": "function_call", "call_id": 1}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
     "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "input"),
    ({"input": [{"type": "reasoning", "content": [{"text": 5}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": "x", "tools": {}}, "tools"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools"),
    ({"input": "x", "tool_choice": "bogus"}, "tool_choice"),
    ({"input": "x", "max_output_tokens": "x"}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10**9}, "max_output_tokens"),
    ({"input": "x", "instructions": 3}, "instructions"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text"),
    ({"input": "x", "reasoning": "high"}, "reasoning"),
    ({"input": "x", "previous_response_id": 7}, "previous_response_id"),
    ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "n": 2}, "n"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": []}, "input"),
]


def test_an_image_error_names_the_input_item_not_the_chat_message(served):
    bad = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    status, answer = post(served.url, "/v1/responses", {"instructions": "x", "input": [
        {"role": "user", "content": "a"}, {"type": "reasoning", "summary": []},
        {"role": "user", "content": [{"type": "input_text", "text": "b"}, bad]}]})
    assert status == 400 and answer["error"]["param"] == "input"
    assert answer["error"]["message"].startswith("input[2].content[1]: "), answer


@pytest.mark.parametrize("body,param", BAD_BODIES, ids=[json.dumps(b)[:60] for b, _ in BAD_BODIES])
@pytest.mark.parametrize("path", ["/v1/responses", "/v1/responses/input_tokens"])
def test_bad_requests_are_400s_naming_the_field(served, path, body, param):
    status, answer = post(served.url, path, body)
    if path.endswith("input_tokens") and param == "store":
        assert status == 200, answer  # nothing is stored by a count: the field is not read
        return
    assert status == 400, answer
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["message"]
    assert answer["error"]["param"] == param
    assert post(served.url, "/health")[0] == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_longer_than_the_context_is_a_400_before_any_event(served, stream):
    """As llama-server answers an error that comes before its stream starts: with its status."""
    body = {"input": "hello " * 5000, "max_output_tokens": 2, "stream": stream}
    status, answer = post(served.url, "/v1/responses", body)
    assert status == 400, answer
    assert (answer["error"]["code"], answer["error"]["param"]) == ("context_length_exceeded", "input")


# --------------------------------------------------------------------------- beside llama-server


@pytest.fixture(scope="module")
def theirs(tiny_dense):
    if LLAMA_SERVER is None:
        pytest.skip(NO_LLAMA_SERVER)
    proc = _Process(["-m", str(tiny_dense.target), "--mmproj", str(tiny_dense.mmproj), "-c", "4096", "-np", "1",
                     "--no-warmup", "-t", "2", "-a", "tiny"])
    yield proc.url
    proc.stop()


#: A request that ends on a stop string (llama-server's field, passed through on both servers),
#: so that both answers end the same way.
STOPPED = {"input": "def add(a, b):", "instructions": "You write Python.", "max_output_tokens": 40,
           "temperature": 0, "stop": ["a"]}


def test_the_same_response_as_llama_server(served, theirs):
    (s1, a), (s2, b) = post(served.url, "/v1/responses", STOPPED), post(theirs, "/v1/responses", STOPPED)
    assert s1 == s2 == 200, (a, b)
    assert set(b) <= set(a), set(b) - set(a)  # every field llama-server gives, and OpenAI's beside them
    assert (a["object"], a["status"], a["model"]) == (b["object"], b["status"], b["model"]) == ("response",
                                                                                            "completed", "tiny")
    assert [set(i) for i in a["output"]] == [set(i) for i in b["output"]]
    assert a["output"][0]["content"] == b["output"][0]["content"]  # the text, annotations and logprobs
    assert a["usage"]["input_tokens"] == b["usage"]["input_tokens"]
    assert set(b["usage"]) <= set(a["usage"]) and set(b["usage"]["input_tokens_details"]) == {"cached_tokens"}
    # the output tokens are each server's chat route's count (which differ after a stop string: the
    # chat route's difference, bench/RESULTS.md), carried over unchanged
    chat = {k: v for k, v in STOPPED.items() if k not in ("input", "instructions", "max_output_tokens")}
    chat.update(messages=[{"role": "system", "content": STOPPED["instructions"]},
                          {"role": "user", "content": STOPPED["input"]}], max_tokens=STOPPED["max_output_tokens"])
    for url, answer in ((served.url, a), (theirs, b)):
        usage = post(url, "/v1/chat/completions", chat)[1]["usage"]
        assert (answer["usage"]["output_tokens"], answer["usage"]["total_tokens"]) == \
            (usage["completion_tokens"], usage["total_tokens"])


def test_a_cut_answer_is_incomplete_here_and_completed_there(served, theirs):
    """A difference, on purpose: OpenAI's status for an answer max_output_tokens cut; the pinned
    llama-server says completed, without incomplete_details."""
    body = {"input": "write a story", "max_output_tokens": 5, "temperature": 0}
    (s1, a), (s2, b) = post(served.url, "/v1/responses", body), post(theirs, "/v1/responses", body)
    assert s1 == s2 == 200
    assert a["output"][0]["content"][0]["text"] == b["output"][0]["content"][0]["text"]
    assert (a["status"], a["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert b["status"] == "completed" and "incomplete_details" not in b


def test_the_same_event_sequence_as_llama_server(served, theirs):
    ours, other = _events(served.url, STOPPED), _events(theirs, STOPPED)
    assert _collapsed([n for n, _ in ours]) == _collapsed([n for n, _ in other]) == \
        TEXT_EVENTS + ["response.completed"]
    assert "".join(d["delta"] for n, d in ours if n == "response.output_text.delta") == \
        "".join(d["delta"] for n, d in other if n == "response.output_text.delta")
    for (name, a), (_, b) in zip([e for e in ours if "delta" not in e[0]], [e for e in other if "delta" not in e[0]],
                                 strict=True):
        # the differences, named: OpenAI's sequence_number, output_index and content_index on every
        # event here (the openai client's stream helpers need them), and the whole response object in
        # created / in_progress (llama-server sends its id, object and status)
        assert set(b) <= set(a) and set(a) - set(b) <= {"sequence_number", "output_index", "content_index",
                                                        "logprobs"}, name
    assert other[-1][1]["timings"] and ours[-1][1]["timings"]  # llama-server's timings on response.completed
    assert ours[-1][1]["response"]["output"][0]["content"] == other[-1][1]["response"]["output"][0]["content"]


@pytest.mark.parametrize("body", [
    {"input": "hi"},
    {"input": "hi", "instructions": "be brief"},
    {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": _png(3)},
                                            {"type": "input_text", "text": "?"}]}]},
    {"input": [{"role": "user", "content": "go"}, {"type": "message", "role": "assistant",
                                                    "content": [{"type": "output_text", "text": "ok"}]},
               {"role": "user", "content": "again"}]},
], ids=["text", "instructions", "image", "turns"])
def test_input_tokens_count_as_llama_server_counts(served, theirs, body):
    (s1, a), (s2, b) = post(served.url, "/v1/responses/input_tokens", body), \
        post(theirs, "/v1/responses/input_tokens", body)
    assert s1 == s2 == 200 and a == b


#: (body, this server's status, llama-server's): where they differ, and why.
DIFFERENT_STATUS = [
    # OpenAI's: a stored response continues; llama-server refuses the field whatever the id
    ({"input": "x", "previous_response_id": "resp_nothing"}, 400, 400),
    # OpenAI's easy message form for the assistant (no "type"); llama-server: "Cannot determine type"
    ({"input": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}], "max_output_tokens": 2}, 200, 400),
    # OpenAI's reasoning items carry a summary only: nothing to render here; llama-server refuses them
    ({"input": [{"role": "user", "content": "a"}, {"type": "reasoning", "summary": []}], "max_output_tokens": 2},
     200, 400),
    # a named tool choice must name one of the request's tools here (there are none);
    # llama-server reads only string choices and runs on
    ({"input": "x", "tool_choice": {"type": "function", "name": "f"}, "max_output_tokens": 2}, 400, 200),
    # more choices than a response can hold: llama-server would answer a list of responses
    ({"input": "x", "n": 2, "max_output_tokens": 2}, 400, 400),
    # a function tool without a name: llama-server's tool parser throws (a 500)
    ({"input": "x", "tools": [{"type": "function"}]}, 400, 500),
]
#: Bad requests both servers refuse with a 400.
SAME_STATUS = [{}, {"input": 5}, {"input": [5]}, {"input": [{"type": "function_call", "call_id": 1}]},
               {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
               {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
               {"input": [{"role": "user", "content": [{"type": "input_audio"}]}]},
               {"input": [{"type": "item_reference", "id": "x"}]},
               {"input": "x", "tools": {}}, {"input": "x", "tool_choice": "bogus"},
               {"input": "x", "max_output_tokens": "x"}, {"input": "x", "temperature": "hot"}]


@pytest.mark.parametrize("body", SAME_STATUS, ids=[json.dumps(b)[:60] for b in SAME_STATUS])
def test_bad_requests_are_refused_as_llama_server_refuses_them(served, theirs, body):
    (s1, a), (s2, b) = post(served.url, "/v1/responses", body), post(theirs, "/v1/responses", body)
    assert s1 == s2 == 400, (a, b)
    assert a["error"]["type"] == b["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_longer_than_the_context_is_a_400_there_too(served, theirs, stream):
    """The same status, before any event, and llama-server's error type and fields (with OpenAI's code
    context_length_exceeded here too)."""
    body = {"input": "hello " * 5000, "max_output_tokens": 2, "stream": stream}
    (s1, a), (s2, b) = post(served.url, "/v1/responses", body), post(theirs, "/v1/responses", body)
    assert s1 == s2 == 400, (a, b)
    assert a["error"]["type"] == b["error"]["type"] == "exceed_context_size_error"
    assert a["error"]["n_ctx"] == b["error"]["n_ctx"] and a["error"]["n_prompt_tokens"] > 0


@pytest.mark.parametrize("body,ours,llama", DIFFERENT_STATUS, ids=[json.dumps(b)[:60] for b, _, _ in DIFFERENT_STATUS])
def test_statuses_where_the_two_differ_are_the_named_ones(served, theirs, body, ours, llama):
    assert post(served.url, "/v1/responses", body)[0] == ours
    assert post(theirs, "/v1/responses", body)[0] == llama
