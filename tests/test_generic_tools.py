"""Tools on a template that cannot render them (serving/generic_tools.py): the embedded pair's
template has no tool support, yet the openai client's forced call comes back as ``tool_calls``,
streamed or not, named or "required", through the server and the llama-cpp-python facade."""

from __future__ import annotations

import json

import pytest

import pyllama_spec as ps
from pyllama_spec.bindings.chat import ChatError
from pyllama_spec.embedded import embedded_models
from pyllama_spec.serving import generic_tools

pytest.importorskip("openai", reason="the openai client is in the 'test' extra")
pytest.importorskip("starlette", reason="the server needs the 'server' extra")

# (the city is an enum: the tiny model, asked for free text, writes a string that never ends)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                  "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# --------------------------------------------------------------------------- the format itself

def test_the_answer_schema_offers_a_call_or_a_response_and_only_a_call_when_forced():
    free = generic_tools.answer_schema(TOOLS, required=False, parallel=False)
    call, response = free["anyOf"]
    assert response["required"] == ["response"] and call["required"] == ["tool_call"]
    assert [c["properties"]["name"]["const"] for c in call["properties"]["tool_call"]["anyOf"]] == ["get_weather", "add"]
    forced = generic_tools.answer_schema([ADD], required=True, parallel=True)
    item = forced["properties"]["tool_calls"]["items"]
    assert forced["required"] == ["tool_calls"] and item["properties"]["name"]["const"] == "add"
    assert "id" in item["required"] and forced["properties"]["tool_calls"]["minItems"] == 1
    shaped = generic_tools.answer_schema(TOOLS, required=False, parallel=False, response_schema={"type": "integer"})
    assert shaped["anyOf"][1]["properties"]["response"] == {"type": "integer"}


def test_the_conversation_shows_the_tools_and_earlier_calls_and_results_as_json_in_alternating_turns():
    convo = [{"role": "system", "content": "Be terse."}, *ASK,
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
             {"role": "user", "content": "And in Rome?"}]
    out = generic_tools.messages(convo, TOOLS, parallel=False)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be terse.\n\nYou can call any of the following tools") \
        and '"get_weather"' in out[0]["content"] and generic_tools.INSTRUCTION in out[0]["content"]
    assert json.loads(out[2]["content"]) == {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert "tool_calls" not in out[2]
    result, question = out[3]["content"].split("\n\n")
    assert json.loads(result) == {"tool_response": {"content": "sunny", "tool_call_id": "c1"}}
    assert question == "And in Rome?"
    assert generic_tools.messages(ASK, TOOLS, parallel=False)[0]["role"] == "system"  # one is added


def test_the_parser_gives_the_calls_or_the_response_once_the_answer_is_whole():
    p = generic_tools.GenericToolParser()
    assert p.update('{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}, "id": "abcd"}', partial=True) \
        == ({"role": "assistant", "content": ""}, [])
    message, deltas = p.update("]}", partial=False)
    assert message["tool_calls"] == [{"type": "function", "id": "abcd",
                                      "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]
    assert deltas == [{"tool_calls": [{"index": 0, **message["tool_calls"][0]}]}]
    message, deltas = generic_tools.GenericToolParser().update('{"tool_call": {"name": "add", "arguments": {}}}',
                                                               partial=False)
    assert len(message["tool_calls"][0]["id"]) == 32  # llama-server's generated id
    assert generic_tools.GenericToolParser().update('{"response": "hi"}', partial=False) \
        == ({"role": "assistant", "content": "hi"}, [{"content": "hi"}])
    with pytest.raises(ChatError):  # cut by max_tokens: the caller answers the text
        generic_tools.GenericToolParser().update('{"tool_call": {"na', partial=False)
    with pytest.raises(ChatError):  # nested past Python's recursion limit
        generic_tools.GenericToolParser().update("[" * 100_000 + "]" * 100_000, partial=False)
    assert generic_tools.GenericToolParser().update('{"response": null}', partial=False)[0]["content"] == ""
    # malformed earlier calls are left out of the conversation rather than failing it
    odd = [{"role": "assistant", "tool_calls": 5}, {"role": "assistant", "tool_calls": [{"function": {}}]}]
    assert [json.loads(m["content"]) for m in generic_tools.messages(odd, TOOLS, parallel=False)[1:]] == \
        [{"response": ""}, {"response": ""}]


# --------------------------------------------------------------------------- as clients see it

@pytest.fixture(scope="module")
def server():
    from serving import LocalServer

    from pyllama_spec.server import ServerSettings

    pair = embedded_models()
    with ps.load(pair.target, n_ctx=4096, n_threads=2, spec_type="none") as engine, \
            LocalServer(engine, ServerSettings()) as srv:
        yield srv


def _client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_the_openai_clients_forced_call_on_a_template_without_tools_comes_back_as_tool_calls(server, choice):
    r = _client(server).chat.completions.create(model="x", messages=ASK, tools=TOOLS, tool_choice=choice,
                                                max_tokens=300)
    calls = r.choices[0].message.tool_calls
    assert calls and len(calls) == 1
    want = "add" if isinstance(choice, dict) else calls[0].function.name
    assert calls[0].function.name == want in ("get_weather", "add")
    assert isinstance(json.loads(calls[0].function.arguments), dict)  # the grammar kept it JSON


def test_a_streamed_forced_call_arrives_as_a_tool_call_delta_with_finish_reason_tool_calls(server):
    chunks = list(_client(server).chat.completions.create(model="x", messages=ASK, tools=TOOLS,
                                                          tool_choice="required", max_tokens=300, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].function.name in ("get_weather", "add") and deltas[0].id
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_auto_answers_text_or_a_call_and_props_says_the_format(server):
    import httpx

    r = _client(server).chat.completions.create(model="x", messages=ASK, tools=TOOLS, max_tokens=300)
    message = r.choices[0].message
    assert message.tool_calls or '"response"' not in message.content  # the JSON never shows as text
    assert httpx.get(server.url + "/props").json()["tool_call_format"] == "generic"


def test_the_llama_cpp_python_facade_gets_the_forced_call_too():
    from pyllama_spec.llama_cpp import Llama

    llm = Llama(model_path=str(embedded_models().target), n_ctx=2048, verbose=False)
    try:
        r = llm.create_chat_completion(messages=ASK, tools=TOOLS, max_tokens=300,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    finally:
        llm.close()
    message = r["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert r["choices"][0]["finish_reason"] in ("tool_calls", "length")
