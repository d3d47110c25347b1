"""Tool calls and reasoning on the chat route, as llama-server does them (llama.cpp's common chat
layer through the shim: serving/chat_template.py renders, server/chat.py parses).

* Every chat template of the pinned source (models/templates/*.jinja) renders a conversation with
  tools, an assistant's tool call with its reasoning, the tool's result and an image, and a chat
  with thinking switched off, byte for byte as llama-server's own /apply-template renders them
  with that template (--chat-template-file) on the tiny target.
* Each template family's parser reads the sample outputs of the pinned source's
  tests/test-chat.cpp (tests/chat_samples.py) into the message llama.cpp's tests expect, streamed
  in pieces (OpenAI deltas that add up to it) and whole; malformed outputs are plain text.
* The real ``openai`` client, streamed and not, against ``pyllama-spec serve`` with a DFlash draft
  on the tiny models: tool_choice "required" and a named function enforced by the grammar
  (Gemma 4's template, whose grammar starts with the call), message.tool_calls and the tool_calls
  deltas, finish_reason "tool_calls", the same message as llama-server's on the same request.
* Reasoning with Qwen3.5's template (thinking opened by the prompt): reasoning_content in the
  message and in deltas, the reasoning budget forcing the end of thinking, reasoning_format none,
  enable_thinking off, as llama-server answers them.
* Speculation stays lossless under the chat's grammar: greedy output with tools (the grammar from
  the start, lazy, and a reasoning budget) equals target-only output, while the draft's proposals
  the grammar forbids are rejected.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from chat_samples import MALFORMED, SAMPLES, TOOLS
from conftest import LLAMA_SERVER, N_THREADS, NO_LLAMA_SERVER, needs_llama_server

import pyllama_spec as ps
from pyllama_spec.serving import generic_tools
from pyllama_spec.bindings.chat import ChatParser
from pyllama_spec.bindings.mtmd import MEDIA_MARKER
from pyllama_spec.serving.chat_template import ChatOptions, ChatRenderer, ChatSettings

pytest.importorskip("starlette", reason="the server needs the 'server' extra")
from serving import LocalServer, free_port, http  # noqa: E402

from pyllama_spec.server import ServerSettings, tokens  # noqa: E402
from pyllama_spec.server.chat import AnswerParser  # noqa: E402
from pyllama_spec.server.images import ImageLimits  # noqa: E402
from pyllama_spec.server.schema import RequestLimits  # noqa: E402


def _templates() -> Path:
    from pyllama_spec.bindings.native_info import build_record

    return Path(build_record().get("source", {}).get("path") or "/nonexistent") / "models" / "templates"


TEMPLATES = _templates()
TEMPLATE_NAMES = sorted(p.name for p in TEMPLATES.glob("*.jinja")) or ["(no templates)"]
NO_SOURCE = "the pinned llama.cpp source tree (its models/templates/) is not on this machine"


def _template(name: str) -> str:
    if not TEMPLATES.exists():
        pytest.skip(NO_SOURCE)
    return (TEMPLATES / name).read_text()


class _LlamaServer:
    """The pinned llama-server on a free port, or ``refused`` when it does not start (as with a
    chat template its renderer cannot use)."""

    def __init__(self, args: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)
        env = {**os.environ, "LLAMA_MEDIA_MARKER": MEDIA_MARKER}  # the marker ours uses, not a random one
        # flash attention off, as this project's default (llama-server's is auto): the same numerics
        self.proc = subprocess.Popen([str(LLAMA_SERVER), "-fa", "off", *args, "--host", "127.0.0.1",
                                      "--port", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=self.log, env=env)
        self.refused = False
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.refused = True
                return
            try:
                if http(self.url, "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError("llama-server did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


def _png(side: int = 32) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.random.default_rng(1).random((side, side, 3)) * 255).astype(np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# --------------------------------------------------------------------------- every template, as llama-server

#: A conversation with everything a template may render: tools, an image part, an assistant's tool
#: call with its reasoning, the tool's result, a follow-up.
AGENT_TURN = {
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": _png()}},
                                     {"type": "text", "text": "what time is it there?"}]},
        {"role": "assistant", "content": "", "reasoning_content": "The picture is of Paris; ask the clock.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_time", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_time", "content": "12:00"},
        {"role": "user", "content": "And the weather?"},
    ],
    "tools": [TOOLS["get_time"], TOOLS["get_weather"]],
}
NO_THINKING = {"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"enable_thinking": False}}
LIMITS = RequestLimits(max_tokens=64, default_max_tokens=16, draft_max=0, images=ImageLimits(max_images=4))

#: Templates whose prompts are not llama-server's byte for byte, and why (none so far).
RENDER_DIFFERENCES: dict[str, str] = {}


def _ours(engine, body) -> tuple[int, dict]:
    from pyllama_spec.server.errors import APIError

    try:
        return 200, {"prompt": tokens.chat_prompt(engine, body, LIMITS)[0]}
    except APIError as e:
        return e.status, e.body()


@needs_llama_server
@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_every_template_renders_tools_results_images_and_reasoning_as_llama_server(name, tiny_dense):
    text = _template(name)
    theirs = _LlamaServer(["-m", str(tiny_dense.target), "--mmproj", str(tiny_dense.mmproj), "-c", "512", "-np", "1",
                           "--no-warmup", "-t", "1", "--chat-template-file", str(TEMPLATES / name)])
    try:
        try:
            engine = ps.load(tiny_dense.target, n_ctx=256, n_threads=N_THREADS, chat_template=text)
        except ValueError as e:  # a template llama-server's renderer cannot use: it does not start either
            assert theirs.refused, f"refused here ({e}), served by llama-server"
            return
        assert not theirs.refused, Path(theirs.log.name).read_text()[-2000:]
        with engine:
            for body in (AGENT_TURN, NO_THINKING):
                sent = body
                if engine.chat.tool_format == "generic" and body.get("tools"):
                    # a template that cannot show tools gets them in the generic format (serving/
                    # generic_tools.py): llama-server renders that conversation, without tools, alike
                    sent = {"messages": generic_tools.messages(body["messages"], body["tools"], parallel=False)}
                (s1, a), (s2, b) = _ours(engine, body), http(theirs.url, "/apply-template", sent)
                if sent is not body and s1 == 200:
                    assert "You can call any of the following tools" in a["prompt"]
                if name in RENDER_DIFFERENCES:
                    continue
                # llama-server answers a template's own refusal (its jinja runtime's exception) with a 500
                assert (s1, s2) in ((200, 200), (400, 400), (400, 500)), (s1, a, s2, b)
                if s1 == 200:
                    assert a == b
                    if body is AGENT_TURN:
                        assert a["prompt"].count(MEDIA_MARKER) == 1
    finally:
        theirs.stop()


def test_every_template_of_the_pinned_source_is_covered():
    if not TEMPLATES.exists():
        pytest.skip(NO_SOURCE)
    assert len(TEMPLATE_NAMES) >= 70
    assert {case[0] for case in SAMPLES} <= set(TEMPLATE_NAMES)


def test_a_hundred_tools_on_every_template_make_a_grammar_the_sampler_can_afford():
    """The grammar a forced call over 100 tools makes, on every template of the pinned source, keeps
    llama.cpp's grammar engine within the bound that refuses costly grammars (Llama 3.1's format is the
    largest: about 1,700 stacks after a character)."""
    from pyllama_spec.bindings.chat import ChatTemplates
    from pyllama_spec.bindings.grammar import MAX_GRAMMAR_STACKS, grammar_cost

    if not TEMPLATES.exists():
        pytest.skip(NO_SOURCE)
    tools = [{"type": "function", "function": {"name": f"tool_number_{i}", "description": "d", "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}, "y": {"type": "integer"}}, "required": ["x"]}}}
        for i in range(100)]
    costs = {}
    for name in TEMPLATE_NAMES:
        with ChatTemplates(None, _template(name)) as templates:
            out = templates.apply({"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                   "tool_choice": "required", "use_jinja": True, "add_generation_prompt": True})
        if out.get("grammar"):
            costs[name] = max(grammar_cost(out["grammar"]))
    assert len(costs) >= 60 and max(costs.values()) <= MAX_GRAMMAR_STACKS / 2, sorted(costs.items(), key=lambda c: c[1])[-3:]


# --------------------------------------------------------------------------- each family's parser

_RENDERERS: dict[str, ChatRenderer] = {}


def _chat(name: str, options: dict):
    """The chat params of test-chat.cpp's case: its one user message, the template alone (no model:
    no BOS/EOS text, as test-chat.cpp reads templates)."""
    if name not in _RENDERERS:
        _RENDERERS[name] = ChatRenderer(None, ChatSettings(template=_template(name)))
    tools = [TOOLS[t] for t in options.get("tools", ())] or None
    return _RENDERERS[name].render(
        [{"role": "user", "content": "Hey there!"}],
        ChatOptions(tools=tools, tool_choice=options.get("choice", "auto"),
                    parallel_tool_calls=options.get("parallel", False), reasoning_format=options.get("rf", "none"),
                    template_kwargs={"enable_thinking": options.get("think", True)}))


def _accumulate(message: dict, delta: dict) -> None:
    """An OpenAI delta added to a message, as a client adds them up."""
    for key in ("content", "reasoning_content"):
        message[key] = message.get(key, "") + delta.get(key, "")
    for call in delta.get("tool_calls", ()):
        calls = message.setdefault("tool_calls", [])
        while len(calls) <= call["index"]:
            calls.append({"id": None, "function": {"name": "", "arguments": ""}})
        if "id" in call:
            calls[call["index"]]["id"] = call["id"]
        fn = call.get("function", {})
        calls[call["index"]]["function"]["name"] += fn.get("name", "")
        calls[call["index"]]["function"]["arguments"] += fn.get("arguments", "")


def _comparable(message: dict) -> tuple:
    """As test-chat.cpp compares messages: text without surrounding whitespace, arguments as JSON."""
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"] or "null"))
             for c in message.get("tool_calls") or ()]
    return (message.get("content") or "").strip(), (message.get("reasoning_content") or "").strip(), calls


@pytest.mark.parametrize("name,text,options,expected", SAMPLES,
                         ids=[f"{c[0][:28]}-{i}" for i, c in enumerate(SAMPLES)])
def test_each_familys_parser_reads_its_sample_outputs(name, text, options, expected):
    chat = _chat(name, options)
    want = _comparable({**expected, "tool_calls": [{"function": {"name": n, "arguments": a}}
                                                   for n, a, _ in expected["tool_calls"]]})
    # streamed in pieces of 3 characters: the deltas add up to the message
    parser, streamed = ChatParser(chat.parser_params(stream=True)), {}
    for at in range(0, len(text), 3):
        for delta in parser.update(text[at:at + 3], partial=True)[1]:
            _accumulate(streamed, delta)
    final, deltas = parser.update("", partial=False)
    for delta in deltas:
        _accumulate(streamed, delta)
    assert _comparable(final) == want and _comparable(streamed) == want
    assert all(c["id"] for c in final.get("tool_calls", ()))  # an id for every call (generated if none)
    # whole: the ids the model wrote are kept (streamed, a call may get its id before the model's)
    whole = ChatParser(chat.parser_params()).update(text, partial=False)[0]
    assert _comparable(whole) == want
    for (_, _, wanted_id), call in zip(expected["tool_calls"], whole.get("tool_calls", ()), strict=True):
        if wanted_id is not None:
            assert call["id"] == wanted_id


@pytest.mark.parametrize("name,text,options", MALFORMED, ids=[f"{c[0][:28]}-{i}" for i, c in enumerate(MALFORMED)])
def test_an_answer_that_does_not_parse_at_its_end_is_plain_text(name, text, options):
    """llama.cpp's parser refuses these (llama-server answers a 500); the answer is the model's text
    as content, whole or streamed (where nothing was sent before its end)."""
    chat = _chat(name, options)

    async def run(stream: bool, pieces: list[str]) -> tuple[dict, list[dict]]:
        parser, deltas = AnswerParser(chat, stream=stream), []
        for k, piece in enumerate(pieces):
            deltas += await parser.feed(piece, final=k == len(pieces) - 1)
        return parser.message, deltas

    message, _ = asyncio.run(run(False, [text]))
    assert message == {"role": "assistant", "content": text}
    message, deltas = asyncio.run(run(True, [text[:-1], text[-1]]))
    streamed: dict = {}
    for d in deltas:
        _accumulate(streamed, d)
    assert _comparable(message) == _comparable(streamed)


# --------------------------------------------------------------------------- the server, with the openai client

openai = pytest.importorskip("openai", reason="the test extra brings the openai client")

GEMMA4 = "google-gemma-4-31B-it.jinja"
QWEN35 = "Qwen3.5-4B.jinja"
ASK_TIME = [{"role": "user", "content": "What time is it in Paris?"}]
TIME_TOOLS = [TOOLS["get_time"], TOOLS["empty_args"]]
#: '}' (the tiny vocabulary's byte 125) made likely: the tiny model then closes the call's arguments
#: at once (the grammar decides the rest). The same bias goes to llama-server.
CLOSE_BRACE = {"125": 20}


def _served(target, draft, template: str, **config):
    engine = ps.load(target, draft=draft, n_ctx=2048, n_threads=N_THREADS, chat_template=template, **config)
    return engine, LocalServer(engine, ServerSettings(alias="tiny"))


@pytest.fixture(scope="module")
def gemma_pair(tiny_dense):
    """This server with Gemma 4's template and the DFlash draft; llama-server with the same template."""
    if LLAMA_SERVER is None:
        pytest.skip(NO_LLAMA_SERVER)
    text = _template(GEMMA4)
    engine, ours = _served(tiny_dense.target, tiny_dense.draft, text)
    theirs = _LlamaServer(["-m", str(tiny_dense.target), "-c", "2048", "-np", "1", "--no-warmup", "-t", "2",
                           "--chat-template-file", str(TEMPLATES / GEMMA4)])
    yield ours.url, theirs.url
    ours.stop()
    engine.close()
    theirs.stop()


def _client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _call(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_the_openai_client_gets_the_forced_tool_call_as_llama_server_gives_it(gemma_pair, choice):
    ours, theirs = gemma_pair
    kwargs = dict(model="tiny", messages=ASK_TIME, tools=TIME_TOOLS, tool_choice=choice, parallel_tool_calls=False,
                  max_tokens=64, temperature=0, logit_bias=CLOSE_BRACE)
    a = _client(ours).chat.completions.create(**kwargs)
    choice_a = a.choices[0]
    assert choice_a.finish_reason == "tool_calls"
    assert _call(choice_a.message) == [("get_time", {})]
    assert choice_a.message.tool_calls[0].id and choice_a.message.tool_calls[0].type == "function"
    assert a.model_extra["timings"]["draft_n"] > 0  # the draft proposed; the grammar kept the target's tokens
    if choice == "required":  # llama-server reads a named tool_choice as "auto"
        b = _client(theirs).chat.completions.create(**kwargs)
        assert (b.choices[0].finish_reason, _call(b.choices[0].message), b.choices[0].message.content) == (
            choice_a.finish_reason, _call(choice_a.message), choice_a.message.content)


def _stream(url: str, **kwargs) -> tuple[dict, str | None, list[dict]]:
    """The message a streamed answer adds up to, its finish_reason, and its tool_calls deltas."""
    message: dict = {}
    finish, calls = None, []
    for chunk in _client(url).chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            delta = c.delta.model_dump(exclude_none=True)
            calls += delta.get("tool_calls", [])
            _accumulate(message, delta)
            finish = c.finish_reason or finish
    return message, finish, calls


def test_streamed_tool_calls_come_as_openai_deltas_as_llama_server_sends_them(gemma_pair):
    ours, theirs = gemma_pair
    kwargs = dict(model="tiny", messages=ASK_TIME, tools=TIME_TOOLS, tool_choice="required", parallel_tool_calls=False,
                  max_tokens=64, temperature=0, logit_bias=CLOSE_BRACE)
    a, finish_a, deltas_a = _stream(ours, **kwargs)
    b, finish_b, deltas_b = _stream(theirs, **kwargs)
    assert finish_a == finish_b == "tool_calls"
    assert _comparable(a) == _comparable(b) == ("", "", [("get_time", {})])
    # the first delta of a call names it, with its id and type; the others add to its arguments
    for deltas in (deltas_a, deltas_b):
        first, rest = deltas[0], deltas[1:]
        assert first["index"] == 0 and first["id"] and first["type"] == "function"
        assert first["function"]["name"] == "get_time"
        assert all("id" not in d and "name" not in d.get("function", {}) for d in rest)


def test_tool_choice_none_and_no_tools_answer_text(gemma_pair):
    ours, theirs = gemma_pair
    for extra in ({"tools": TIME_TOOLS, "tool_choice": "none"}, {}):
        body = {"messages": ASK_TIME, "max_tokens": 8, "temperature": 0, **extra}
        (s1, a), (s2, b) = http(ours, "/v1/chat/completions", body), http(theirs, "/v1/chat/completions", body)
        assert s1 == s2 == 200
        assert a["choices"][0]["message"] == b["choices"][0]["message"]
        assert "tool_calls" not in a["choices"][0]["message"] and a["choices"][0]["finish_reason"] == "length"


def test_a_tool_result_turn_is_rendered_and_answered(gemma_pair):
    """The conversation goes on after the tool's result (the model's answer, as llama-server's)."""
    ours, theirs = gemma_pair
    messages = [*ASK_TIME, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    body = {"messages": messages, "tools": TIME_TOOLS, "max_tokens": 8, "temperature": 0}
    (s1, a), (s2, b) = http(ours, "/v1/chat/completions", body), http(theirs, "/v1/chat/completions", body)
    assert s1 == s2 == 200 and a["choices"][0]["message"] == b["choices"][0]["message"]


def test_an_answer_the_parser_makes_nothing_of_is_its_text_as_llama_server_answers_it(gemma_pair):
    """Three tokens of a required call ("<|t"): the parser finds no call, no content; the answer
    is the model's text, as llama-server's; streamed too (where llama-server sends no delta)."""
    ours, theirs = gemma_pair
    body = {"messages": ASK_TIME, "tools": TIME_TOOLS, "tool_choice": "required", "max_tokens": 3, "temperature": 0}
    (s1, a), (s2, b) = http(ours, "/v1/chat/completions", body), http(theirs, "/v1/chat/completions", body)
    assert s1 == s2 == 200 and a["choices"][0]["finish_reason"] == "length"
    assert a["choices"][0]["message"] == b["choices"][0]["message"] == {"role": "assistant", "content": "<|t"}
    message, finish, _ = _stream(ours, model="tiny", **body)
    assert finish == "length" and message.get("content") == "<|t"


@pytest.mark.parametrize("body,param", [
    ({"tools": "x"}, "tools"),
    ({"tools": [{"type": "code"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "maybe"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "grammar": 'root ::= "a"'}, "grammar"),
    ({"reasoning_format": "verbose"}, "reasoning_format"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"reasoning_budget_tokens": -5}, "reasoning_budget_tokens"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f",
                                                                                          "arguments": "{}"}}]},
                   {"role": "assistant", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
      "add_generation_prompt": True, "continue_final_message": True}, "messages"),
], ids=lambda v: json.dumps(v)[:50] if isinstance(v, dict) else v)
def test_malformed_tool_and_reasoning_fields_are_400s(gemma_pair, body, param):
    ours, _ = gemma_pair
    for stream in (False, True):
        s, a = http(ours, "/v1/chat/completions", {"messages": ASK_TIME, "max_tokens": 2, "stream": stream, **body})
        assert s == 400 and a["error"]["param"] == param, a


# --------------------------------------------------------------------------- reasoning


@pytest.fixture(scope="module")
def qwen_pair(tiny_dense):
    """This server with Qwen3.5's template (thinking opened by the prompt) and the draft, and llama-server."""
    if LLAMA_SERVER is None:
        pytest.skip(NO_LLAMA_SERVER)
    engine, ours = _served(tiny_dense.target, tiny_dense.draft, _template(QWEN35))
    theirs = _LlamaServer(["-m", str(tiny_dense.target), "-c", "2048", "-np", "1", "--no-warmup", "-t", "2",
                           "--chat-template-file", str(TEMPLATES / QWEN35)])
    yield ours.url, theirs.url
    ours.stop()
    engine.close()
    theirs.stop()


HI = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("extra", [
    {"reasoning_budget_tokens": 6},  # the budget forces the end of thinking, then the answer
    {"thinking_budget_tokens": 0},
    {},  # no budget: it thinks until max_tokens
    {"reasoning_format": "none", "reasoning_budget_tokens": 6},  # thoughts stay in content
    {"chat_template_kwargs": {"enable_thinking": False}},
    {"reasoning_effort": "none"},
], ids=lambda v: json.dumps(v)[:40])
def test_reasoning_is_answered_as_llama_server_answers_it(qwen_pair, extra):
    ours, theirs = qwen_pair
    body = {"messages": HI, "max_tokens": 24, "temperature": 0, **extra}
    (s1, a), (s2, b) = http(ours, "/v1/chat/completions", body), http(theirs, "/v1/chat/completions", body)
    assert s1 == s2 == 200, (a, b)
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"]
    message = a["choices"][0]["message"]
    if extra.get("reasoning_budget_tokens") == 6 and "reasoning_format" not in extra:
        assert message["reasoning_content"] and message["content"]
    if "chat_template_kwargs" in extra or "reasoning_effort" in extra or "reasoning_format" in extra:
        assert "reasoning_content" not in message
    streamed, _, _ = _stream(ours, model="tiny", messages=HI, max_tokens=24, temperature=0, extra_body=extra)
    assert _comparable(streamed) == _comparable(message)


PREFILLED = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, "}]
CONTINUATIONS = [
    {"messages": PREFILLED},  # a final assistant message is continued (llama-server's prefill_assistant)
    {"messages": PREFILLED, "continue_final_message": "content", "add_generation_prompt": False},
    {"messages": [HI[0], {"role": "assistant", "content": "", "reasoning_content": "I think"}], "continue_final_message": True,
     "add_generation_prompt": False},  # it continues the reasoning
    {"messages": [HI[0], {"role": "assistant", "content": "", "reasoning_content": "Hmm"}],
     "continue_final_message": "reasoning_content", "add_generation_prompt": False},
]


@pytest.mark.parametrize("body", CONTINUATIONS, ids=lambda v: json.dumps(v)[-60:])
def test_a_final_assistant_message_is_continued_as_llama_server_continues_it(qwen_pair, body):
    ours, theirs = qwen_pair
    (s1, a), (s2, b) = http(ours, "/apply-template", body), http(theirs, "/apply-template", body)
    assert s1 == s2 == 200 and a == b
    answer = {**body, "max_tokens": 12, "temperature": 0, "reasoning_budget_tokens": 4}
    (s1, a), (s2, b) = http(ours, "/v1/chat/completions", answer), http(theirs, "/v1/chat/completions", answer)
    assert s1 == s2 == 200 and a["choices"][0]["message"] == b["choices"][0]["message"]


@pytest.fixture(scope="module")
def plain_pair(tiny_dense):
    """Qwen3.5's template with --skip-chat-parsing and --no-prefill-assistant, here and in llama-server."""
    if LLAMA_SERVER is None:
        pytest.skip(NO_LLAMA_SERVER)
    engine, ours = _served(tiny_dense.target, None, _template(QWEN35), skip_chat_parsing=True, prefill_assistant=False)
    theirs = _LlamaServer(["-m", str(tiny_dense.target), "-c", "2048", "-np", "1", "--no-warmup", "-t", "2",
                           "--chat-template-file", str(TEMPLATES / QWEN35), "--skip-chat-parsing",
                           "--no-prefill-assistant"])
    yield ours.url, theirs.url
    ours.stop()
    engine.close()
    theirs.stop()


@pytest.mark.parametrize("body", [{"messages": HI}, {"messages": PREFILLED},
                                  {"messages": HI, "tools": TIME_TOOLS, "reasoning_budget_tokens": 3}],
                         ids=["thinking", "final-assistant", "tools"])
def test_skip_chat_parsing_and_no_prefill_assistant_as_llama_server(plain_pair, body):
    """--skip-chat-parsing: what the model writes is content (no reasoning, no tool calls);
    --no-prefill-assistant: a final assistant message is a whole turn, and a new one starts."""
    ours, theirs = plain_pair
    (s1, a), (s2, b) = http(ours, "/apply-template", body), http(theirs, "/apply-template", body)
    assert s1 == s2 == 200 and a == b
    answer = {**body, "max_tokens": 12, "temperature": 0}
    (s1, a), (s2, b) = http(ours, "/v1/chat/completions", answer), http(theirs, "/v1/chat/completions", answer)
    assert s1 == s2 == 200 and a["choices"][0]["message"] == b["choices"][0]["message"]
    assert set(a["choices"][0]["message"]) == {"role", "content"}


def test_the_reasoning_budget_ends_thinking_with_its_tag_and_message(tiny_dense):
    """--reasoning-budget N and --reasoning-budget-message: after N thinking tokens the message and
    the end tag are forced; the answer follows. A request's own budget wins."""
    with ps.load(tiny_dense.target, n_ctx=1024, n_threads=N_THREADS, chat_template=_template(QWEN35),
                 reasoning_budget=4, reasoning_budget_message=" Enough.") as engine:
        chat = engine.chat_params(HI)
        text = engine.generate(chat=chat, max_tokens=40).text
        parsed = ChatParser(chat.parser_params()).update(text, partial=False)[0]
        assert parsed["reasoning_content"].strip().endswith("Enough.") and parsed["content"]
        own = engine.chat_params(HI, reasoning_budget=10)
        longer = ChatParser(own.parser_params()).update(engine.generate(chat=own, max_tokens=40).text,
                                                        partial=False)[0]
        assert len(longer["reasoning_content"]) > len(parsed["reasoning_content"]) - len(" Enough.")


# --------------------------------------------------------------------------- lossless speculation under the chat's grammar


@pytest.mark.parametrize("template,options", [
    (GEMMA4, {"tools": TIME_TOOLS, "tool_choice": "required"}),  # a grammar from the start
    (GEMMA4, {"tools": TIME_TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}),
    ("Qwen-Qwen2.5-7B-Instruct.jinja", {"tools": TIME_TOOLS}),  # lazy: waits for its trigger
    (QWEN35, {"reasoning_budget": 5}),  # the budget's forced end of thinking
    (QWEN35, {"tools": TIME_TOOLS, "tool_choice": "required", "reasoning_budget": 5}),
], ids=["required", "named", "lazy", "budget", "required+budget"])
def test_greedy_output_with_a_chats_grammar_equals_target_only(tiny_dense, template, options):
    """The DFlash draft proposes what the grammar forbids; the target's sampler rejects it, the
    grammar follows only accepted tokens, and the tokens are those of a target-only run."""
    text = _template(template)
    runs = []
    for draft in (None, tiny_dense.draft):
        with ps.load(tiny_dense.target, draft=draft, n_ctx=2048, n_threads=N_THREADS, chat_template=text) as engine:
            chat = engine.chat_params(ASK_TIME, **options)
            runs.append(engine.generate(chat=chat, max_tokens=48, logit_bias={125: 20}))
    target_only, speculative = runs
    assert speculative.tokens == target_only.tokens
    assert speculative.stats.drafted > 0 and speculative.stats.accepted < speculative.stats.drafted


def test_two_slots_answer_forced_tool_calls_at_once_as_one_slot_does(tiny_dense):
    """-np 2: each slot's sampler has its own grammar; both answers are the single slot's."""
    import concurrent.futures

    body = {"messages": ASK_TIME, "tools": TIME_TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": 64, "temperature": 0, "logit_bias": CLOSE_BRACE}
    answers = []
    for n_parallel in (1, 2):
        engine, server = _served(tiny_dense.target, tiny_dense.draft, _template(GEMMA4), n_parallel=n_parallel)
        try:
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                got = list(pool.map(lambda _: http(server.url, "/v1/chat/completions", body), range(2)))
        finally:
            server.stop()
            engine.close()
        assert all(s == 200 and a["choices"][0]["finish_reason"] == "tool_calls" for s, a in got)
        answers.append([_comparable(a["choices"][0]["message"]) for _, a in got])
    assert answers[0] == answers[1] == [("", "", [("get_time", {})])] * 2


# --------------------------------------------------------------------------- the other APIs' tool calls


@pytest.fixture(scope="module")
def gemma_ours(tiny_dense):
    """This server alone, with Gemma 4's template and the DFlash draft."""
    engine, ours = _served(tiny_dense.target, tiny_dense.draft, _template(GEMMA4))
    yield ours.url
    ours.stop()
    engine.close()


#: The tools in the Anthropic and Responses shapes.
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TIME_TOOLS]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TIME_TOOLS]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_anthropic_client_gets_a_forced_tool_use_block_and_goes_on_after_its_result(gemma_ours, stream):
    """The Messages API has no logit_bias (llama-server passes only temperature, top_p, top_k):
    the tiny model opens the forced call and never closes its arguments, so the answer ends on
    max_tokens with the tool_use block as far as it got (the chat route's tests close the call)."""
    anthropic = pytest.importorskip("anthropic", reason="the test extra brings the anthropic client")
    client = anthropic.Anthropic(base_url=gemma_ours, api_key="none", max_retries=0)
    kwargs = dict(model="tiny", max_tokens=40, messages=ASK_TIME, tools=ANTHROPIC_TOOLS,
                  tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
                  extra_body={"temperature": 0})  # this client has no temperature argument
    if stream:
        with client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    assert message.stop_reason == "max_tokens"
    uses = [b for b in message.content if b.type == "tool_use"]
    assert [u.name for u in uses] == ["get_time"] and uses[0].id and isinstance(uses[0].input, dict)
    if not stream:  # streamed, the timings come on message_delta, which the client's message drops
        assert message.model_extra["pyllama_spec"]["timings"]["draft_n"] > 0
    # the tool's result goes back as a tool_result block; the model answers in text
    follow = client.messages.create(model="tiny", max_tokens=8, extra_body={"temperature": 0}, tools=ANTHROPIC_TOOLS,
                                    messages=[*ASK_TIME, {"role": "assistant", "content": [
                                        {"type": "tool_use", "id": uses[0].id, "name": "get_time", "input": {}}]},
                                              {"role": "user", "content": [{"type": "tool_result",
                                                                            "tool_use_id": uses[0].id,
                                                                            "content": "12:00"}]}])
    assert follow.stop_reason == "max_tokens" and follow.content[0].type == "text"
    assert follow.usage.cache_read_input_tokens > 0  # the shared start of the conversation was kept


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_openai_responses_client_gets_a_forced_function_call_and_goes_on_after_its_output(gemma_ours, stream):
    client = _client(gemma_ours)
    kwargs = dict(model="tiny", input="What time is it in Paris?", tools=RESPONSES_TOOLS, tool_choice="required",
                  parallel_tool_calls=False, max_output_tokens=64, temperature=0,
                  extra_body={"logit_bias": CLOSE_BRACE})
    if stream:
        with client.responses.stream(**kwargs) as events:
            response = events.get_final_response()
    else:
        response = client.responses.create(**kwargs)
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {})] and calls[0].call_id
    # the function's output continues the stored conversation
    follow = client.responses.create(model="tiny", previous_response_id=response.id, tools=RESPONSES_TOOLS,
                                     max_output_tokens=8, temperature=0,
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "12:00"}])
    assert follow.status == "incomplete" and follow.output_text
    assert follow.usage.input_tokens_details.cached_tokens > 0  # the earlier turn is in the slot's cache
