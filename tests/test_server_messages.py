"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) on `pyllama-spec serve`.

Three parts: the pure conversion both ways on hand-written shapes (tool calls and reasoning
included, ready for when the chat route gives them); the real `anthropic` client against the
server on the tiny models (its answers are the chat route's greedy answers, both lossless with
the DFlash draft); and the same requests sent to the real llama-server (built from the pin; those
tests skip without it), each difference asserted and named.
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from conftest import N_THREADS, needs_llama_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyllama_spec as ps
from pyllama_spec.server.errors import APIError
from pyllama_spec.server.images import ImageLimits
from pyllama_spec.server.anthropic.convert import MessageStream, anthropic_message, chat_body
from pyllama_spec.server.schema import RequestLimits, parse_chat

anthropic = pytest.importorskip("anthropic", reason="the test extra brings the anthropic client")
httpx = pytest.importorskip("httpx", reason="the test extra brings httpx")
from serving import LocalServer, http  # noqa: E402

from pyllama_spec.server import ServerSettings  # noqa: E402

try:  # the HTTP library the anthropic client is built on (anthropic 2.x renamed its httpx)
    import httpx2 as client_http
except ImportError:
    client_http = httpx


def _png(seed: int, side: int = 224) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.random.default_rng(seed).random((side, side, 3)) * 255).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _image_block(png: bytes) -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _b64(png)}}


# --------------------------------------------------------------------------- the request, as an OpenAI chat body


def test_system_text_blocks_and_message_strings_become_chat_messages():
    body = {"max_tokens": 16, "system": [{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}],
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                         {"role": "user", "content": [{"type": "text", "text": "more",
                                                       "cache_control": {"type": "ephemeral"}}]}],
            "temperature": 0.5, "top_p": 0.9, "top_k": 40, "stream": True, "stop_sequences": ["\n\n"],
            "metadata": {"user_id": "u1"}, "model": "claude-whatever", "service_tier": "auto"}
    assert chat_body(body).body == {
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "hello"},
                     {"role": "user", "content": [{"type": "text", "text": "more"}]}],
        "stop": ["\n\n"], "max_tokens": 16, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "stream": True}


def test_image_blocks_become_image_url_parts():
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}},
        {"type": "image", "source": {"type": "base64", "data": "/9j/"}},  # llama-server's default: JPEG
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}},
        {"type": "text", "text": "what is this?"}]}]}
    parts = chat_body(body).body["messages"][0]["content"]
    assert [p.get("image_url", {}).get("url") for p in parts] == [
        "data:image/png;base64,iVBO", "data:image/jpeg;base64,/9j/", "https://example.com/cat.png", None]


def test_tool_use_and_tool_result_blocks_become_tool_calls_and_tool_messages():
    body = {"max_tokens": 64, "messages": [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should look it up.", "signature": "sig"},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"unit": "C", "city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "time", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18"},
                                                                          {"type": "text", "text": " C"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "noon", "is_error": True},
            {"type": "text", "text": "and tomorrow?"}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_3", "content": [
                {"type": "text", "text": "screenshot:"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}]},
            {"type": "tool_result", "tool_use_id": "toolu_4"}]}]}
    assert chat_body(body).body["messages"] == [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me check."}],
         "tool_calls": [
             # the input as llama-server writes it (nlohmann's dump: keys sorted, no spaces)
             {"id": "toolu_1", "type": "function", "function": {"name": "weather",
                                                                "arguments": '{"city":"Paris","unit":"C"}'}},
             {"id": "toolu_2", "type": "function", "function": {"name": "time", "arguments": "{}"}}],
         "reasoning_content": "I should look it up."},
        # as in llama-server: the message's own text first, then its tool results; text-only
        # results joined into a string; is_error is not shown to the model
        {"role": "user", "content": [{"type": "text", "text": "and tomorrow?"}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "noon"},
        {"role": "tool", "tool_call_id": "toolu_3", "content": [
            {"type": "text", "text": "screenshot:"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}}]},
        {"role": "tool", "tool_call_id": "toolu_4", "content": ""}]


def test_an_assistant_turn_of_tool_calls_only_has_empty_content_and_one_without_content_is_skipped():
    body = {"max_tokens": 4, "messages": [
        {"role": "user", "content": "go"}, {"role": "assistant"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {"x": [1, 2]}}]},
        {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "..."}]}]}
    assert chat_body(body).body["messages"][1:] == [
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x":[1,2]}'}}]}]


def test_tools_and_each_tool_choice_map_to_openais():
    tools = [{"name": "weather", "description": "Weather now", "input_schema": {"type": "object"}},
             {"name": "noop"}]
    out = chat_body({"max_tokens": 4, "messages": [], "tools": tools})
    assert out.body["tools"] == [
        {"type": "function", "function": {"name": "weather", "description": "Weather now",
                                          "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "noop", "description": "", "parameters": {}}}]
    expected = [({"type": "auto"}, {"tool_choice": "auto"}), ({"type": "any"}, {"tool_choice": "required"}),
                ({"type": "none"}, {"tool_choice": "none"}),
                ({"type": "tool", "name": "weather"}, {"tool_choice": {"type": "function",
                                                                       "function": {"name": "weather"}}}),
                ({"type": "auto", "disable_parallel_tool_use": True},
                 {"tool_choice": "auto", "parallel_tool_calls": False})]
    for choice, fields in expected:
        body = chat_body({"max_tokens": 4, "messages": [], "tools": tools, "tool_choice": choice}).body
        assert {k: body[k] for k in ("tool_choice", "parallel_tool_calls") if k in body} == fields, choice


def test_thinking_asks_for_llama_servers_thinking_budget():
    def budget(thinking):
        return chat_body({"max_tokens": 4, "messages": [], "thinking": thinking}).body.get("thinking_budget_tokens")

    assert budget({"type": "enabled", "budget_tokens": 2048}) == 2048
    assert budget({"type": "enabled"}) == 10000
    assert budget({"type": "disabled"}) is None


def test_claude_codes_billing_stamp_is_blanked_so_the_prompt_cache_gets_past_it():
    system = "x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=a5145;You are Claude Code."
    out = chat_body({"max_tokens": 4, "system": system, "messages": []}).body["messages"][0]["content"]
    assert out == system.replace("cch=a5145;", "cch=fffff;")
    assert chat_body({"max_tokens": 4, "system": "cch=a5145;", "messages": []}).body["messages"][0]["content"] \
        == "cch=a5145;"


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": None, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 4}, "messages"),
    ({"max_tokens": 4, "messages": "hi"}, "messages"),
    ({"max_tokens": 4, "messages": ["hi"]}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "user"}]}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": ["hi"]}]}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": "a.png"}]}]}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "data": 7}}]}]}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "a", "name": "f", "input": "x=1"}]}]}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "a", "content": [{"type": "document"}]}]}]}, "messages"),
    ({"max_tokens": 4, "messages": [], "system": 5}, "system"),
    ({"max_tokens": 4, "messages": [], "system": [{"type": "image"}]}, "system"),
    ({"max_tokens": 4, "messages": [], "tools": {"name": "f"}}, "tools"),
    ({"max_tokens": 4, "messages": [], "tools": [{"description": "no name"}]}, "tools"),
    ({"max_tokens": 4, "messages": [], "tool_choice": "auto"}, "tool_choice"),
    ({"max_tokens": 4, "messages": [], "tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"max_tokens": 4, "messages": [], "stop_sequences": "\n"}, "stop_sequences"),
    ({"max_tokens": 4, "messages": [], "stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({"max_tokens": 4, "messages": [], "thinking": {"type": "enabled", "budget_tokens": "many"}}, "thinking"),
    ({"max_tokens": 4, "messages": [], "metadata": "user"}, "metadata"),
    ([{"max_tokens": 4}], None),
])
def test_a_request_of_the_wrong_shape_is_a_400_naming_the_field(body, param):
    with pytest.raises(APIError) as e:
        chat_body(body)
    assert e.value.status == 400 and e.value.param == param and e.value.message


_ANY = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
                    max_leaves=6)
_BLOCK = st.fixed_dictionaries({"type": st.sampled_from(["text", "image", "thinking", "tool_use", "tool_result",
                                                         "redacted_thinking", "document"]) | _ANY},
                               optional={"text": _ANY, "source": _ANY | st.fixed_dictionaries(
                                   {"type": st.sampled_from(["base64", "url"]) | _ANY},
                                   optional={"media_type": _ANY, "data": _ANY, "url": _ANY}),
                                   "thinking": _ANY, "id": _ANY, "name": _ANY, "input": _ANY, "tool_use_id": _ANY,
                                   "content": _ANY | st.lists(st.deferred(lambda: _BLOCK), max_size=2),
                                   "is_error": _ANY})
_MESSAGE = st.fixed_dictionaries({}, optional={"role": st.sampled_from(["user", "assistant", "system"]) | _ANY,
                                               "content": _ANY | st.lists(_BLOCK, max_size=3)})
_BODY = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(-1, 100) | _ANY, "messages": st.lists(_MESSAGE, max_size=3) | _ANY,
    "system": _ANY | st.lists(_BLOCK, max_size=2), "tools": _ANY, "tool_choice": _ANY, "stop_sequences": _ANY,
    "thinking": _ANY, "metadata": _ANY, "temperature": _ANY, "stream": _ANY})


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=_BODY | _ANY)
def test_any_request_is_read_or_refused_with_a_400_never_an_other_error(body):
    """Whatever JSON a client sends, the conversion and the chat route's parser answer it or refuse
    it with a 400 naming what is wrong; nothing else escapes (a 500 is never the client's fault)."""
    limits = RequestLimits(max_tokens=64, default_max_tokens=8, draft_max=4, images=ImageLimits())
    try:
        request = chat_body(body)
        try:
            parse_chat(request.body, limits)
        except APIError as e:
            request.relocate(e)
            raise
    except APIError as e:
        assert e.status == 400 and e.message


def test_count_tokens_needs_no_max_tokens():
    assert "max_tokens" not in chat_body({"messages": [{"role": "user", "content": "hi"}]},
                                         need_max_tokens=False).body


def test_a_chat_parse_error_names_the_anthropic_block():
    out = chat_body({"max_tokens": 4, "system": "s", "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"},
                                     {"type": "text", "text": "a"}, _image_block(b"not an image")]}]})
    # chat messages: system, the user's text and image, then the tool result
    error = out.relocate(APIError(400, "messages[1].content[1]: the image cannot be read",
                                  param="messages[1].content[1]"))
    assert (error.message, error.param) == ("messages[0].content[2]: the image cannot be read",
                                            "messages[0].content[2]")
    assert out.relocate(APIError(400, "messages[2]: bad")).message == "messages[0].content[0]: bad"


# --------------------------------------------------------------------------- the answer, as Anthropic's message


def _completion(msg: dict, finish: str, prompt=30, cached=20, completion=7) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "tiny",
            "choices": [{"index": 0, "message": {"role": "assistant", **msg}, "finish_reason": finish}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": cached}},
            "timings": {"draft_n": 9, "draft_n_accepted": 4}}


def test_a_chat_answer_with_reasoning_and_tool_calls_becomes_thinking_text_and_tool_use_blocks():
    chat = _completion({"content": "Checking.", "reasoning_content": "Need the weather.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "broken", "arguments": '{"city": '}}]},
        "tool_calls")
    assert anthropic_message(chat, msg_id="msg_1") == {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "tiny",
        "content": [{"type": "thinking", "thinking": "Need the weather.", "signature": ""},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "call_2", "name": "broken", "input": {}}],  # unparsable: {}
        "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"cache_read_input_tokens": 20, "input_tokens": 10, "output_tokens": 7},
        "pyllama_spec": {"timings": {"draft_n": 9, "draft_n_accepted": 4}}}


@pytest.mark.parametrize("finish,stop_sequence,tool_calls,reason", [
    ("stop", None, None, "end_turn"),
    ("stop", "END", None, "stop_sequence"),
    ("length", None, None, "max_tokens"),
    ("stop", None, [{"id": "c", "function": {"name": "f", "arguments": "{}"}}], "tool_use"),
    ("length", None, [{"id": "c", "function": {"name": "f", "arguments": "{}"}}], "max_tokens"),
])
def test_finish_reason_becomes_stop_reason(finish, stop_sequence, tool_calls, reason):
    chat = _completion({"content": None if tool_calls else "x", "tool_calls": tool_calls}, finish)
    out = anthropic_message(chat, msg_id="msg_1", stop_sequence=stop_sequence)
    assert (out["stop_reason"], out["stop_sequence"]) == (reason, stop_sequence)
    assert [b["type"] for b in out["content"]] == (["tool_use"] if tool_calls else ["text"])


def _chunk(delta: dict | None = None, finish: str | None = None, **extra) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "tiny",
            "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}], **extra}


_TIMINGS = {"cache_n": 5, "prompt_n": 12, "predicted_n": 9, "draft_n": 6}

#: A streamed chat answer with reasoning, text and two tool calls, as OpenAI chunks.
TOOL_CHUNKS = [
    _chunk({"role": "assistant", "content": ""}),
    _chunk({"reasoning_content": "Need "}, timings=_TIMINGS, pyllama_spec={"accepted": 1}),
    _chunk({"reasoning_content": "weather."}, timings=_TIMINGS),
    _chunk({"content": "Checking."}, timings=_TIMINGS),
    _chunk({"content": ""}, timings=_TIMINGS, pyllama_spec={"accepted": 0}),  # text held back: no event
    _chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                            "function": {"name": "weather", "arguments": ""}}]}, timings=_TIMINGS),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}, timings=_TIMINGS),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}, timings=_TIMINGS),
    _chunk({"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                            "function": {"name": "time", "arguments": "{}"}}]}, timings=_TIMINGS),
    _chunk(None, "tool_calls", timings=_TIMINGS),
]


def _events(chunks: list[dict]) -> list[tuple[str, dict]]:
    stream = MessageStream("msg_1", "tiny")
    return [e for c in chunks for e in stream.events(c)]


def test_streamed_reasoning_text_and_tool_call_deltas_become_anthropics_events():
    events = _events(TOOL_CHUNKS)
    shown = [(name, data.get("index"), (data.get("delta") or data.get("content_block") or {}).get("type"))
             for name, data in events]
    assert shown == [
        ("message_start", None, None),
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
        ("content_block_start", 2, "tool_use"),
        ("content_block_delta", 2, "input_json_delta"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_start", 3, "tool_use"), ("content_block_delta", 3, "input_json_delta"),
        # llama-server closes every block at the end, a thinking block after an empty signature
        ("content_block_delta", 0, "signature_delta"), ("content_block_stop", 0, None),
        ("content_block_stop", 1, None), ("content_block_stop", 2, None), ("content_block_stop", 3, None),
        ("message_delta", None, None), ("message_stop", None, None)]
    start = events[0][1]["message"]
    assert start["usage"] == {"cache_read_input_tokens": 5, "input_tokens": 12, "output_tokens": 0}
    assert (start["id"], start["content"], start["stop_reason"]) == ("msg_1", [], None)
    assert events[6][1]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "weather", "input": {}}
    assert events[7][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"city": '}
    assert events[2][1]["pyllama_spec"] == {"accepted": 1}  # a step's speculation rides on its last event
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert end["usage"] == {"output_tokens": 9} and end["pyllama_spec"]["timings"] == _TIMINGS


def test_a_stream_ended_by_a_stop_sequence_says_which():
    chunks = [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "ab"}, timings=_TIMINGS),
              _chunk(None, "stop", timings=_TIMINGS)]
    stream = MessageStream("msg_1", "tiny")
    events = [e for c in chunks[:-1] for e in stream.events(c)] + stream.events(chunks[-1], stop_sequence="END")
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


def test_an_answer_with_no_text_still_starts_and_ends_the_message():
    events = _events([_chunk({"role": "assistant", "content": ""}), _chunk({"content": ""}, timings=_TIMINGS),
                      _chunk(None, "stop", timings=_TIMINGS)])
    assert [name for name, _ in events] == ["message_start", "message_delta", "message_stop"]
    assert events[1][1]["delta"]["stop_reason"] == "end_turn"


def _sse(events: list[tuple[str, dict]]) -> bytes:
    return "".join(f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events).encode()


def test_the_anthropic_clients_stream_helper_assembles_the_translated_tool_calls():
    """The events above, served to the real client: its stream helper builds the thinking, text and
    tool_use blocks (input parsed from the input_json_delta pieces) and the stop reason."""
    body = _sse(_events(TOOL_CHUNKS))

    def handler(request):
        return client_http.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    client = anthropic.Anthropic(api_key="unused", base_url="http://anthropic.test", max_retries=0,
                                 http_client=client_http.Client(transport=client_http.MockTransport(handler)))
    with client.messages.stream(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}]) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert (final.content[0].thinking, final.content[1].text) == ("Need weather.", "Checking.")
    assert [(b.id, b.name, b.input) for b in final.content[2:]] == [("call_1", "weather", {"city": "Paris"}),
                                                                   ("call_2", "time", {})]
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == ("tool_use", 12, 9)


# --------------------------------------------------------------------------- the real client against the server


@pytest.fixture(scope="module")
def server(tiny_server):
    """The session's shared server (conftest's ``tiny_server``): no test here changes its state in a
    way another depends on (the cache test sends its conversation twice in a row)."""
    return tiny_server


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


GREEDY = {"temperature": 0}  # the client has no temperature argument in every version; llama-server's default is 0.8


def _chat(server, messages: list[dict], **fields) -> dict:
    status, answer = http(server.url, "/v1/chat/completions", {"messages": messages, "temperature": 0, **fields})
    assert status == 200, answer
    return answer


def test_a_message_answers_the_chat_routes_greedy_text(server, client):
    m = client.messages.create(model="tiny", max_tokens=12, messages=[{"role": "user", "content": "Hello there"}],
                               extra_body=GREEDY)
    chat = _chat(server, [{"role": "user", "content": "Hello there"}], max_tokens=12)
    assert m.content[0].text == chat["choices"][0]["message"]["content"] and len(m.content) == 1
    assert (m.type, m.role, m.model, m.stop_reason, m.stop_sequence) == ("message", "assistant", "tiny",
                                                                         "max_tokens", None)
    assert m.id.startswith("msg_")
    assert m.usage.output_tokens == chat["usage"]["completion_tokens"] == 12
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
    timings = m.model_extra["pyllama_spec"]["timings"]  # the chat route's timings, speculative counts included
    assert timings["draft_n"] > 0 and 0 <= timings["draft_n_accepted"] <= timings["draft_n"]
    assert timings["predicted_n"] == 12


def test_a_repeated_conversation_reads_its_prompt_from_the_cache(client):
    messages = [{"role": "user", "content": "Once upon a time"}]
    first, again = (client.messages.create(model="tiny", max_tokens=4, messages=messages, extra_body=GREEDY)
                    for _ in range(2))
    assert again.usage.cache_read_input_tokens > 0 and again.usage.input_tokens < first.usage.input_tokens
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == \
        first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert again.content == first.content


def test_the_clients_x_api_key_opens_a_server_with_a_key(tiny_dense):
    engine = ps.load(tiny_dense.target, n_ctx=512, n_threads=N_THREADS, flash_attn=False)
    keyed = LocalServer(engine, ServerSettings(alias="tiny", api_key="sekrit"))
    try:
        body = dict(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        ok = anthropic.Anthropic(base_url=keyed.url, api_key="sekrit", max_retries=0).messages.create(**body)
        assert ok.type == "message"
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0).messages.create(**body)
    finally:
        keyed.stop()
        engine.close()


@pytest.mark.parametrize("system", ["Answer in French.", [{"type": "text", "text": "Answer in "},
                                                           {"type": "text", "text": "French."}]])
def test_system_as_text_or_blocks_is_the_chat_system_message(server, client, system):
    m = client.messages.create(model="tiny", max_tokens=10, system=system, extra_body=GREEDY,
                               messages=[{"role": "user", "content": "Hi"}])
    chat = _chat(server, [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}],
                 max_tokens=10)
    assert m.content[0].text == chat["choices"][0]["message"]["content"]


def test_an_image_block_is_seen_as_the_chat_routes_image(server, client):
    png = _png(3)
    m = client.messages.create(model="tiny", max_tokens=10, extra_body=GREEDY, messages=[
        {"role": "user", "content": [_image_block(png), {"type": "text", "text": "What is this?"}]}])
    chat_messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + _b64(png)}},
        {"type": "text", "text": "What is this?"}]}]
    chat = _chat(server, chat_messages, max_tokens=10)
    assert m.content[0].text == chat["choices"][0]["message"]["content"]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
    # the image's rows are counted: as the chat route counts them, and as the generation used them
    count = client.messages.count_tokens(model="tiny", messages=[
        {"role": "user", "content": [_image_block(png), {"type": "text", "text": "What is this?"}]}])
    status, chat_count = http(server.url, "/v1/chat/completions/input_tokens", {"messages": chat_messages})
    assert status == 200 and count.input_tokens == chat_count["input_tokens"] == chat["usage"]["prompt_tokens"]
    text_only = client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "What is this?"}])
    assert count.input_tokens >= text_only.input_tokens + 64  # a 224x224 image is 64 rows of the tiny projector


def test_count_tokens_counts_the_rendered_prompt_with_its_system(server, client):
    count = client.messages.count_tokens(model="tiny", system="Be brief.",
                                         messages=[{"role": "user", "content": "Hello there"}])
    chat = _chat(server, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
                 max_tokens=1)
    assert count.input_tokens == chat["usage"]["prompt_tokens"]


def test_the_clients_stream_helper_gives_the_whole_answers_text(server, client):
    messages = [{"role": "user", "content": "Tell me a story"}]
    whole = client.messages.create(model="tiny", max_tokens=16, messages=messages, extra_body=GREEDY)
    with client.messages.stream(model="tiny", max_tokens=16, messages=messages, extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", 16)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def _raw_stream(base: str, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed answer, read off the wire."""
    events, name = [], None
    with httpx.stream("POST", base + "/v1/messages", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.read()
        for line in r.iter_lines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                events.append((name, json.loads(line[5:])))
    return events


def _shape(events: list[tuple[str, dict]]) -> list[str]:
    """The event names, each run of content_block_delta as one (llama-server sends a delta per
    token, this server one per speculative step)."""
    out = []
    for name, data in events:
        assert data["type"] == name
        if not (out and name == out[-1] == "content_block_delta"):
            out.append(name)
    return out


def test_the_raw_stream_is_anthropics_event_sequence_with_the_speculation_of_each_step(server):
    events = _raw_stream(server.url, {"max_tokens": 16, "temperature": 0,
                                      "messages": [{"role": "user", "content": "Count to ten"}]})
    assert _shape(events) == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                              "message_delta", "message_stop"]
    deltas = [d for name, d in events if name == "content_block_delta"]
    steps = [d["pyllama_spec"] for d in deltas]
    assert sum(len(s["tokens"]) for s in steps) <= 16 and any(s["accepted"] for s in steps)
    assert all("".join(t["text"] for t in s["tokens"]) == d["delta"]["text"] for s, d in zip(steps, deltas))
    assert events[-2][1]["pyllama_spec"]["timings"]["predicted_n"] == events[-2][1]["usage"]["output_tokens"] == 16


def _stop_word(text: str) -> str:
    """A character the greedy answer writes, not first and not before: ASCII, so that both servers
    match it alike (the tiny models write bytes that are not UTF-8, shown as U+FFFD)."""
    return next(c for i, c in enumerate(text) if i > 0 and c.isascii() and c.isalnum() and c not in text[:i])


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_sequence_ends_the_answer_and_is_named(server, client, stream):
    messages = [{"role": "user", "content": "Hello there"}]
    text = _chat(server, messages, max_tokens=12)["choices"][0]["message"]["content"]
    word = _stop_word(text)
    chat = _chat(server, messages, max_tokens=12, stop=[word])
    kwargs = dict(model="tiny", max_tokens=12, messages=messages, stop_sequences=["never written", word],
                  extra_body=GREEDY)
    if stream:
        with client.messages.stream(**kwargs) as s:
            m = s.get_final_message()
    else:
        m = client.messages.create(**kwargs)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", word)
    assert m.content[0].text == chat["choices"][0]["message"]["content"] == text[:text.index(word)]


def test_a_tool_conversation_is_answered_as_the_chat_route_answers_its_openai_form(server, client):
    m = client.messages.create(model="tiny", max_tokens=8, extra_body=GREEDY, messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "weather", "input": {"c": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}])
    chat = _chat(server, [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "weather", "arguments": '{"c":1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"}], max_tokens=8)
    assert m.content[0].text == chat["choices"][0]["message"]["content"]


def _error(status: int, body) -> None:
    """Anthropic's error shape (which also carries OpenAI's error fields, as llama-server answers)."""
    assert isinstance(body, dict) and body["type"] == "error", body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"], body
    assert status == 400


BAD_REQUESTS = {
    "no max_tokens": {"messages": [{"role": "user", "content": "hi"}]},
    "no messages": {"max_tokens": 4},
    "messages not a list": {"max_tokens": 4, "messages": "hi"},
    "an unknown block": {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "bogus"}]}]},
    "a text block without text": {"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": 5}]}]},
    "an image that is not one": {"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
    "an image of a type not read": {"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/gif", "data": "R0lGODlh"}}]}]},
    "a remote image": {"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://example.com/a.png"}}]}]},
    "max_tokens a string": {"max_tokens": "4", "messages": [{"role": "user", "content": "x"}]},
    "temperature a string": {"max_tokens": 4, "temperature": "hot", "messages": [{"role": "user", "content": "x"}]},
    "system a number": {"max_tokens": 4, "system": 5, "messages": [{"role": "user", "content": "x"}]},
    "content a number": {"max_tokens": 4, "messages": [{"role": "user", "content": 5}]},
    "a role no one has": {"max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]},
    "no messages at all": {"max_tokens": 4, "messages": []},
    "stop_sequences a string": {"max_tokens": 4, "stop_sequences": "ab",
                                "messages": [{"role": "user", "content": "x"}]},
    "a body that is a list": [1],
}


@pytest.mark.parametrize("name", BAD_REQUESTS)
@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_request_is_a_400_in_anthropics_error_shape(server, name, stream):
    body = BAD_REQUESTS[name]
    if stream and isinstance(body, dict):
        body = {**body, "stream": True}
    _error(*http(server.url, "/v1/messages", body))


def test_the_client_raises_its_bad_request_error_with_the_servers_message(client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _b64(b"no png")}}]}])
    assert "messages[0].content[0]" in str(e.value) and "image" in str(e.value)


def test_a_streamed_request_longer_than_the_context_is_refused_before_the_stream(server):
    body = {"max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "hello " * 3000}]}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=120) as r:
        status, answer = r.status_code, json.loads(r.read())
    assert status == 400 and answer["type"] == "error" and answer["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("body", [{"messages": [{"role": "user", "content": [{"type": "bogus"}]}]},
                                  {"messages": "x"}, {"system": 5, "messages": []}, [2]])
def test_count_tokens_refuses_what_messages_refuses(server, body):
    _error(*http(server.url, "/v1/messages/count_tokens", body))


# --------------------------------------------------------------------------- the same requests to llama-server


@pytest.fixture(scope="module")
def both(tiny_dense, server):
    """(this server, llama-server) on the same target and projector; llama-server without the draft.
    Its -n 256 bounds the answer to a request without max_tokens (llama-server's 200), which otherwise
    runs to the end of the context: minutes on a loaded machine."""
    from test_llama_server_parity import _Process

    theirs = _Process(["-m", str(tiny_dense.target), "--mmproj", str(tiny_dense.mmproj), "-c", "2048", "-np", "1",
                       "--no-warmup", "-t", "2", "-n", "256"])
    yield server.url, theirs.url
    theirs.stop()


def _same_message(a: dict, b: dict) -> None:
    assert set(a) - set(b) == {"pyllama_spec"} and set(b) <= set(a)  # timings: this server's extension
    assert [(c["type"], c.get("text")) for c in a["content"]] == [(c["type"], c.get("text")) for c in b["content"]]
    assert (a["type"], a["role"], a["stop_reason"], a["stop_sequence"]) == \
        (b["type"], b["role"], b["stop_reason"], b["stop_sequence"])
    # one id form each: Anthropic's msg_... here, llama-server's chatcmpl-...
    assert a["id"].startswith("msg_") and b["id"].startswith("chatcmpl-")
    assert set(a["usage"]) == set(b["usage"]) and a["usage"]["output_tokens"] == b["usage"]["output_tokens"]
    total = [u["usage"]["input_tokens"] + u["usage"]["cache_read_input_tokens"] for u in (a, b)]
    assert total[0] == total[1]


@needs_llama_server
@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "Hello there"}]},
    {"system": [{"type": "text", "text": "Be brief."}], "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "Tell me more"}]}]},
    {"messages": [{"role": "user", "content": [_image_block(_png(4)), {"type": "text", "text": "What is it?"}]}]},
], ids=["text", "system and turns", "image"])
def test_a_message_matches_llama_servers(both, body):
    body = {**body, "max_tokens": 10, "temperature": 0}
    (s1, a), (s2, b) = (http(url, "/v1/messages", body) for url in both)
    assert s1 == s2 == 200, (a, b)
    _same_message(a, b)
    (s1, a), (s2, b) = (http(url, "/v1/messages/count_tokens", body) for url in both)
    assert s1 == s2 == 200 and a == b


@needs_llama_server
def test_a_stream_matches_llama_servers_events(both):
    body = {"max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": "Count to ten"}]}
    ours, theirs = (_raw_stream(url, body) for url in both)
    assert _shape(ours) == _shape(theirs)
    text = ["".join(d["delta"]["text"] for name, d in events if name == "content_block_delta") for events in (ours,
                                                                                                             theirs)]
    assert text[0] == text[1]
    assert set(ours[0][1]["message"]) == set(theirs[0][1]["message"])
    assert set(ours[0][1]["message"]["usage"]) == set(theirs[0][1]["message"]["usage"])
    for k in (1, -3, -1):  # the block's start and stop, and message_stop
        assert ours[k] == theirs[k]
    end = dict(ours[-2][1])
    assert (end.pop("pyllama_spec")["timings"]["predicted_n"], end) == (12, theirs[-2][1])  # the extension


@needs_llama_server
def test_a_stop_sequence_ends_both_at_the_same_text_and_only_the_stop_reason_differs(both):
    """Where this server follows Anthropic's API rather than llama-server: a stop sequence gives
    stop_reason "stop_sequence" here, "end_turn" there (both name the sequence)."""
    ours, theirs = both
    first = http(ours, "/v1/messages", {"max_tokens": 12, "temperature": 0,
                                        "messages": [{"role": "user", "content": "Hello there"}]})[1]
    word = _stop_word(first["content"][0]["text"])
    body = {"max_tokens": 12, "temperature": 0, "stop_sequences": [word],
            "messages": [{"role": "user", "content": "Hello there"}]}
    (s1, a), (s2, b) = http(ours, "/v1/messages", body), http(theirs, "/v1/messages", body)
    assert s1 == s2 == 200
    assert a["content"] == b["content"] and a["stop_sequence"] == b["stop_sequence"] == word
    assert (a["stop_reason"], b["stop_reason"]) == ("stop_sequence", "end_turn")
    events = [_raw_stream(url, body) for url in both]
    assert [e[-2][1]["delta"] for e in events] == [{"stop_reason": "stop_sequence", "stop_sequence": word},
                                                   {"stop_reason": "end_turn", "stop_sequence": word}]


#: Where the statuses differ, on purpose: llama-server answers these 200 (it reads past or guesses:
#: 4096 tokens for a missing max_tokens, the block or the field dropped or read as its default)
#: or 500 (an exception of its parser, or a failed fetch of the remote image); they are 400 here.
_THEIRS = {"no max_tokens": 200, "no messages": 500, "messages not a list": 200, "an unknown block": 200,
           "a text block without text": 500, "a remote image": 500, "system a number": 200, "a role no one has": 200,
           "no messages at all": 200, "stop_sequences a string": 200, "a body that is a list": 500}


@needs_llama_server
@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_bad_requests_against_llama_servers_statuses(both, name):
    body = BAD_REQUESTS[name]
    (s1, a), (s2, b) = (http(url, "/v1/messages", body) for url in both)
    _error(s1, a)
    assert s2 == _THEIRS.get(name, 400), b
    if s2 == 400:  # the same error type, under the same key (llama-server's body has no "type": "error")
        assert a["error"]["type"] == b["error"]["type"]
