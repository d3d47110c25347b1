"""An agent's loop against `pyllama-spec serve`, as GUI agents run it: a screenshot, a tool call,
the tool's result, then the next screenshot, ten times over one growing conversation.

Each turn sends the whole conversation (system prompt, tools, every earlier screenshot and call)
through the chat route with the DFlash draft. What must hold, on one slot and with two agents on
two slots at once:

- every turn after the first decodes only its new rows: the slot's cache holds the previous
  turn's prompt (``usage.prompt_tokens_details.cached_tokens``);
- a screenshot is encoded once, when its turn first shows it (the projector's encode count);
- the answers (the forced tool calls, token for token) are the target-only greedy answers.

The tiny model cannot decide to call a tool: ``tool_choice: "required"`` makes the grammar open a
call, and a bias on ``}`` closes its arguments (test_chat_tools.py's ``CLOSE_BRACE``); which of the
two tools it calls is the model's choice.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io

import numpy as np
import pytest
from conftest import N_THREADS

import pyllama_spec as ps

pytest.importorskip("starlette", reason="the server needs the 'server' extra")
from serving import LocalServer, http  # noqa: E402

from pyllama_spec.server import ServerSettings  # noqa: E402

TURNS = 10
TEMPLATE = "google-gemma-4-31B-it.jinja"  # a template that renders tools, tool results and images
TOOLS = [
    {"type": "function", "function": {"name": "click", "description": "Click at a point of the screen",
                                      "parameters": {"type": "object", "properties": {
                                          "x": {"type": "integer"}, "y": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "type_text", "description": "Type text into the focused field",
                                      "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}},
]
CLOSE_BRACE = {"125": 20}


def _screenshot(agent: int, turn: int) -> str:
    """A distinct small picture per agent and turn, as a data URI."""
    from PIL import Image

    pixels = np.random.default_rng(1000 * agent + turn).integers(0, 256, (40, 56, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _user_turn(agent: int, turn: int) -> dict:
    text = "Open the settings." if turn == 0 else "Here is the screen now."
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _screenshot(agent, turn)}},
                                        {"type": "text", "text": text}]}


def run_agent(url: str, agent: int) -> list[dict]:
    """Ten turns; each turn's answer (the parsed message and its finish_reason), usage and timings."""
    messages = [{"role": "system", "content": "You operate a computer through tools."}, _user_turn(agent, 0)]
    turns = []
    for turn in range(TURNS):
        status, answer = http(url, "/v1/chat/completions", {
            "messages": messages, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": 64, "temperature": 0, "logit_bias": CLOSE_BRACE})
        assert status == 200, answer
        choice = answer["choices"][0]
        turns.append({"message": choice["message"], "finish": choice["finish_reason"], "usage": answer["usage"],
                      "timings": answer["timings"]})
        calls = choice["message"].get("tool_calls") or []
        assert choice["finish_reason"] == "tool_calls" and len(calls) == 1, choice
        call_id = f"call_{agent}_{turn}"  # ids are random per answer: the conversation gets fixed ones
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": calls[0]["function"]}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": f"done ({turn})"})
        if turn + 1 < TURNS:
            messages.append(_user_turn(agent, turn + 1))
    return turns


def _answers(turns: list[dict]) -> list[tuple]:
    return [(t["finish"], [(c["function"]["name"], c["function"]["arguments"]) for c in t["message"]["tool_calls"]],
             t["message"].get("content"), t["usage"]["completion_tokens"]) for t in turns]


def _served(models, template: str, *, draft: bool, n_parallel: int):
    engine = ps.load(models.target, mmproj=models.mmproj, draft=models.draft if draft else None,
                     n_ctx=8192 * n_parallel, n_parallel=n_parallel, n_threads=N_THREADS, n_batch=256, n_ubatch=256,
                     chat_template=template)
    return engine, LocalServer(engine, ServerSettings(alias="tiny"))


@pytest.fixture(scope="module")
def template() -> str:
    from test_chat_tools import NO_SOURCE, TEMPLATES

    if not (TEMPLATES / TEMPLATE).exists():
        pytest.skip(NO_SOURCE)
    return (TEMPLATES / TEMPLATE).read_text()


@pytest.fixture(scope="module")
def target_only(tiny_dense, template):
    """Each agent's answers from the target alone, one agent at a time."""
    engine, server = _served(tiny_dense, template, draft=False, n_parallel=1)
    try:
        return {agent: _answers(run_agent(server.url, agent)) for agent in (0, 1)}
    finally:
        server.stop()
        engine.close()


def _check_turns(turns: list[dict]) -> None:
    """Each turn after the first decodes only what is new since the previous turn's prompt."""
    assert turns[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for before, now in zip(turns, turns[1:]):
        prompt, cached = now["usage"]["prompt_tokens"], now["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= before["usage"]["prompt_tokens"], (before["usage"], now["usage"])
        assert now["timings"]["prompt_n"] == prompt - cached
        assert prompt - cached <= prompt - before["usage"]["prompt_tokens"]
    assert sum(t["timings"]["draft_n"] for t in turns) > 0  # the draft drafted on every slot's turns


@pytest.mark.parametrize("n_agents", [1, 2], ids=["one slot", "two slots at once"])
def test_an_agents_ten_turns_decode_only_new_rows_encode_each_screenshot_once_and_answer_as_the_target(
        tiny_dense, template, target_only, n_agents):
    engine, server = _served(tiny_dense, template, draft=True, n_parallel=n_agents)
    try:
        with concurrent.futures.ThreadPoolExecutor(n_agents) as pool:
            runs = list(pool.map(lambda agent: run_agent(server.url, agent), range(n_agents)))
        encodes = engine.projector.n_encode_calls
    finally:
        server.stop()
        engine.close()
    for agent, turns in enumerate(runs):
        _check_turns(turns)
        assert _answers(turns) == target_only[agent]
    assert encodes == TURNS * n_agents  # each screenshot once, when its turn first shows it
