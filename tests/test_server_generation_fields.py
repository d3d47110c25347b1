"""llama-server's generation fields on this server: the prompt's shapes (token ids, mixed, several
prompts, multimodal objects), the final /completion body, streaming with return_progress and
timings_per_token, response_fields, n_indent and t_max_predict_ms, post_sampling_probs, /infill's
FIM layout, and the embedding/rerank routes a generation server refuses. Each is compared with the
real llama-server in test_llama_server_parity.py; here the behaviour is specified on this server
alone (so it runs without llama-server).
"""

from __future__ import annotations

import base64
import io
import json
import time

import numpy as np
import pytest
from conftest import N_THREADS, TINY_ENGINE, load_tiny

import pyllama_spec as ps

httpx = pytest.importorskip("httpx", reason="the test extra brings httpx")
pytest.importorskip("uvicorn", reason="the server extra brings uvicorn")
from serving import LocalServer  # noqa: E402

from pyllama_spec.devtools import tiny  # noqa: E402
from pyllama_spec.server import ServerSettings  # noqa: E402
from pyllama_spec.server.images import ImageLimits  # noqa: E402
from pyllama_spec.server.prompts import parse_prompts  # noqa: E402

PROMPT = "def add(a, b):"
MAX_QUEUE = 4


@pytest.fixture(scope="module")
def server(tiny_fim):
    """Two slots over the FIM trio (target, DFlash draft, projector); a queue of MAX_QUEUE."""
    engine = load_tiny(tiny_fim, n_ctx=4096, n_parallel=2, flash_attn=False)
    s = LocalServer(engine, ServerSettings(alias="tiny", max_queue=MAX_QUEUE, default_max_tokens=64))
    yield s
    s.stop()
    engine.close()


@pytest.fixture(scope="module")
def plain(tiny_dense):
    """A target alone: no FIM tokens, no projector, one slot."""
    engine = ps.load(tiny_dense.target, n_ctx=1024, **TINY_ENGINE, flash_attn=False)
    s = LocalServer(engine, ServerSettings(alias="plain"))
    yield s
    s.stop()
    engine.close()


def post(s, path: str, body) -> tuple[int, object]:
    r = httpx.post(s.url + path, json=body, timeout=120)
    return r.status_code, r.json()


def stream(s, path: str, body) -> list[dict]:
    events = []
    with httpx.stream("POST", s.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def greedy(**extra) -> dict:
    return {"n_predict": 8, "temperature": 0, **extra}


def _png() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.random.default_rng(3).random((224, 224, 3)) * 255).astype(np.uint8)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


# --------------------------------------------------------------------------- the prompt


def test_a_prompt_of_token_ids_or_of_ids_mixed_with_text_generates_as_its_text(server):
    ids = server.engine.model.tokenize(PROMPT).tolist()
    _, text = post(server, "/completion", greedy(prompt=PROMPT, return_tokens=True))
    _, by_ids = post(server, "/completion", greedy(prompt=ids, return_tokens=True))
    _, mixed = post(server, "/completion", greedy(prompt=["def", *ids[1:]], return_tokens=True))
    _, in_object = post(server, "/completion", greedy(prompt={"prompt_string": ids}, return_tokens=True))
    assert text["tokens"] == by_ids["tokens"] == mixed["tokens"] == in_object["tokens"] and text["tokens"]
    assert by_ids["prompt"] == PROMPT and by_ids["tokens_evaluated"] == len(ids)


def test_several_prompts_each_get_their_choices_indexed_prompt_by_prompt(server):
    status, out = post(server, "/completion", greedy(prompt=["ab", [99, 100]], n_cmpl=2, n_predict=3))
    assert status == 200 and [(o["index"], o["prompt"]) for o in out] == [(0, "ab"), (1, "ab"), (2, "cd"), (3, "cd")]
    _, alone = post(server, "/completion", greedy(prompt="cd", n_predict=3))
    assert out[2]["content"] == out[3]["content"] == alone["content"]
    status, oai = post(server, "/v1/completions", {"prompt": ["ab", "cd"], "max_tokens": 3, "temperature": 0})
    assert status == 200 and [c["index"] for c in oai["choices"]] == [0, 1]
    assert oai["choices"][1]["text"] == alone["content"]
    assert oai["usage"]["prompt_tokens"] == 4 and oai["usage"]["completion_tokens"] == 6  # each prompt counted


@pytest.mark.parametrize("prompt,says", [
    ([], "must not be empty"),
    (5, "elements must be a string"),
    ({"x": 1}, "elements must be a string"),
    ([1.5], "elements must be a string"),
    ([[1, 2], [3, [4]]], "prompt[1]"),
    ([97, 10**6], "outside the vocabulary"),
    ([97, -1], "outside the vocabulary"),
    ([97, 2**70], "outside the vocabulary"),
    ("", "is empty"),
    ([[]], "is empty"),
])
def test_a_prompt_of_no_known_shape_or_with_ids_outside_the_vocabulary_is_a_400(server, prompt, says):
    for path in ("/completion", "/v1/completions"):
        status, body = post(server, path, greedy(prompt=prompt))
        assert status == 400 and says in body["error"]["message"] and body["error"]["param"] == "prompt", body


def test_more_prompts_and_choices_than_the_queue_takes_are_refused_before_anything_runs(server):
    for body in (greedy(prompt=["a"] * (MAX_QUEUE + 1)), greedy(prompt=["a", "b", "c"], n_cmpl=2),
                 greedy(prompt=["x"] * 100_000)):
        started = time.monotonic()
        status, out = post(server, "/completion", body)
        assert status == 400 and "at most" in out["error"]["message"], out
        assert time.monotonic() - started < 5
    status, out = post(server, "/completion", greedy(prompt=["a"] * MAX_QUEUE, n_predict=1))
    assert status == 200 and [o["index"] for o in out] == list(range(MAX_QUEUE))


def test_reading_token_ids_costs_time_linear_in_their_number():
    limits = ImageLimits(max_images=0)

    def seconds(n: int) -> float:
        ids = list(range(100)) * (n // 100)
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            (p,) = parse_prompts(ids, n_vocab=1000, images=limits, max_prompts=4)
            best = min(best, time.perf_counter() - t)
            assert len(p["prompt"][0]) == n
        return best

    small, large = seconds(100_000), seconds(800_000)
    assert large < 8 * small * 3, (small, large)  # 8x the ids: about 8x the time, never 64x


def test_a_prompt_of_token_ids_longer_than_the_context_is_refused_quickly(server):
    started = time.monotonic()
    status, out = post(server, "/completion", greedy(prompt=[97] * 300_000))
    assert status == 400 and out["error"]["code"] == "context_length_exceeded", out
    assert time.monotonic() - started < 10
    assert post(server, "/completion", greedy(prompt=PROMPT, n_predict=2))[0] == 200


def test_a_multimodal_prompt_object_generates_as_the_engine_does_with_its_images(server):
    marker = ps.MEDIA_MARKER
    image = _png()
    status, out = post(server, "/completion", greedy(prompt={"prompt_string": f"x{marker}hi", "multimodal_data": [image]},
                                                     return_tokens=True))
    assert status == 200, out
    chat = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + image}}, {"type": "text", "text": "hi"}]}]}
    _, rendered = post(server, "/apply-template", chat)
    _, same = post(server, "/completion", greedy(prompt={"prompt_string": rendered["prompt"],
                                                         "multimodal_data": [image]}, return_tokens=True))
    _, via_chat = post(server, "/v1/chat/completions", {**chat, "max_tokens": 8, "temperature": 0})
    assert same["content"] == via_chat["choices"][0]["message"]["content"]
    assert out["tokens_evaluated"] > 64 and out["prompt"].startswith("x") and out["prompt"].endswith("hi")


@pytest.mark.parametrize("prompt,says", [
    ({"prompt_string": "no marker", "multimodal_data": ["IMAGE"]}, "media markers"),
    ({"prompt_string": f"{ps.MEDIA_MARKER}hi", "multimodal_data": ["not base64!"]}, "not valid base64"),
    ({"prompt_string": f"{ps.MEDIA_MARKER}hi", "multimodal_data": ["aGVsbG8="]}, "cannot be read"),
    ({"prompt_string": f"{ps.MEDIA_MARKER}hi", "multimodal_data": "IMAGE"}, "list of base64"),
    ({"prompt_string": [1, 2], "multimodal_data": []}, "must be a string"),
])
def test_a_bad_multimodal_prompt_is_a_400(server, prompt, says):
    prompt = json.loads(json.dumps(prompt).replace("IMAGE", _png()))
    status, out = post(server, "/completion", greedy(prompt=prompt))
    assert status == 400 and says in out["error"]["message"], out


def test_multimodal_data_without_a_projector_is_llama_servers_400(plain):
    status, out = post(plain, "/completion", greedy(prompt={"prompt_string": f"{ps.MEDIA_MARKER}hi",
                                                            "multimodal_data": [_png()]}))
    assert status == 400 and out["error"]["message"] == \
        "Multimodal data provided, but model does not support multimodal requests."


# --------------------------------------------------------------------------- the answer


def test_the_final_body_has_every_field_llama_server_gives(server):
    status, out = post(server, "/completion", greedy(prompt=PROMPT, stop=["zzz"], n_keep=-1))
    assert status == 200
    assert out["tokens"] == [] and out["index"] == 0 and out["prompt"] == PROMPT  # tokens: only when asked
    assert (out["stop_type"], out["stopping_word"], out["truncated"]) == ("limit", "", False)
    assert out["has_new_line"] == ("\n" in out["content"])
    assert out["tokens_cached"] == out["tokens_evaluated"] + out["tokens_predicted"] - 1
    settings = out["generation_settings"]
    assert (settings["n_predict"], settings["temperature"], settings["stop"], settings["n_keep"]) == (8, 0, ["zzz"], -1)
    assert settings["speculative.types"] == "draft-dflash" and settings["samplers"][0] == "penalties"


def test_a_stop_string_ends_with_stop_type_word_and_names_it(server):
    body = greedy(prompt="code:\n", n_predict=20, grammar=_forced("abc = def(ghi)\n"), n_probs=1)
    _, out = post(server, "/completion", {**body, "stop": ["never", "def"]})
    assert (out["stop_type"], out["stopping_word"], out["content"]) == ("word", "def", "abc = ")
    # llama-server drops as many probabilities as the stop string has tokens
    n_word = len(server.engine.model.tokenize("def"))
    assert len(out["completion_probabilities"]) == out["tokens_predicted"] - n_word > 0


def test_a_generation_that_fills_the_context_is_truncated(server):
    n_ctx = server.app.state.service.facts["n_ctx_slot"]
    _, out = post(server, "/completion", greedy(prompt=[97] * (n_ctx - 6), n_predict=50))
    assert (out["truncated"], out["stop_type"]) == (True, "limit") and out["tokens_predicted"] < 50


def test_response_fields_keeps_and_unnests_only_the_fields_named(server):
    fields = ["content", "generation_settings/n_predict", "timings/prompt_n", "nothing", "content/x"]
    _, out = post(server, "/completion", greedy(prompt=PROMPT, response_fields=fields))
    assert set(out) == {"content", "generation_settings/n_predict", "timings/prompt_n"}
    assert out["generation_settings/n_predict"] == 8
    _, whole = post(server, "/completion", greedy(prompt=PROMPT, response_fields="content"))
    assert "generation_settings" in whole  # llama-server reads a value of another type as none given


@pytest.mark.parametrize("field,value", [("return_tokens", "yes"), ("return_progress", 1),
                                         ("timings_per_token", "no"), ("post_sampling_probs", []),
                                         ("n_indent", -1), ("t_max_predict_ms", -2), ("n_keep", -2),
                                         ("n_discard", -1), ("n_indent", 1.5)])
def test_a_bad_llama_server_field_is_a_400_naming_it(server, field, value):
    for path, body in (("/completion", greedy(prompt=PROMPT)),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        status, out = post(server, path, {**body, field: value})
        assert status == 400 and out["error"]["param"] == field, out


# --------------------------------------------------------------------------- streaming


def test_a_streamed_completion_is_its_steps_then_the_final_body(server):
    body = greedy(prompt=PROMPT, n_predict=12, return_tokens=True)
    _, whole = post(server, "/completion", body)
    events = stream(server, "/completion", body)
    steps, final = events[:-1], events[-1]
    assert all(e["stop"] is False and e["tokens"] for e in steps)
    assert "".join(e["content"] for e in steps) == whole["content"]
    assert [t for e in steps for t in e["tokens"]] == whole["tokens"]
    assert [e["tokens_predicted"] for e in steps] == list(np.cumsum([len(e["tokens"]) for e in steps]))
    assert final["stop"] is True and (final["content"], final["tokens"]) == ("", [])
    assert set(final) == set(whole) and final["generation_settings"]["stream"] is True


@pytest.mark.parametrize("path", ["/completion", "/v1/completions", "/v1/chat/completions"])
def test_return_progress_reports_the_prompt_as_it_is_decoded(server, path):
    prompt = "x = 1\n" * 40  # 240 tokens: several batches of 64
    body = {"max_tokens": 2, "temperature": 0, "return_progress": True}
    body.update({"messages": [{"role": "user", "content": prompt}]} if "chat" in path else {"prompt": prompt})
    progress = [e["prompt_progress"] for e in stream(server, path, {**body, "cache_prompt": False})
                if "prompt_progress" in e]
    assert len(progress) >= 4 and progress[0]["processed"] == progress[0]["cache"] == 0
    assert [p["processed"] for p in progress] == sorted(p["processed"] for p in progress)
    assert progress[-1]["processed"] == progress[-1]["total"] and progress[-1]["total"] > 200
    assert all(isinstance(p["time_ms"], int) for p in progress)
    again = [e["prompt_progress"] for e in stream(server, path, body) if "prompt_progress" in e]
    assert again[0]["cache"] > 0 and again[0]["processed"] == again[0]["cache"]  # the cached prefix, reused
    assert not [e for e in stream(server, path, {**body, "return_progress": False}) if "prompt_progress" in e]


@pytest.mark.parametrize("path", ["/completion", "/v1/completions"])
def test_timings_per_token_puts_the_timings_so_far_in_every_chunk(server, path):
    events = stream(server, path, {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "timings_per_token": True})
    with_text = [e for e in events if e.get("content") or (e.get("choices") and e["choices"][0].get("text"))]
    counts = [e["timings"]["predicted_n"] for e in with_text]
    assert counts and counts == sorted(counts) and counts[-1] == 10
    plain = stream(server, path, {"prompt": PROMPT, "max_tokens": 10, "temperature": 0})
    assert len([e for e in plain if "timings" in e]) == 1  # without it: the last only


# --------------------------------------------------------------------------- line rules, probabilities


def _forced(text: str) -> str:
    return "root ::= " + json.dumps(text) + " [a-z]*"


def test_n_indent_ends_at_a_line_indented_less_and_drops_it_from_the_answer(server):
    body = greedy(prompt="code:\n", n_predict=30, grammar=_forced("x\n    y = 1\n  z\nw\n"), n_indent=3)
    _, out = post(server, "/completion", body)
    assert (out["content"], out["stop_type"]) == ("x\n    y = 1\n  ", "limit")
    streamed = "".join(e["content"] for e in stream(server, "/completion", body))
    assert streamed.startswith(out["content"]) and len(streamed) > len(out["content"])  # as llama-server streams
    _, chat = post(server, "/v1/completions", {**body, "max_tokens": 30})
    assert chat["choices"][0]["text"] == out["content"]


def test_t_max_predict_ms_ends_at_a_newline_once_the_time_is_up(server):
    body = greedy(prompt="code:\n", n_predict=120, grammar=_forced("ab\n" * 60))
    _, free = post(server, "/completion", body)
    _, timed = post(server, "/completion", {**body, "t_max_predict_ms": 1})
    assert free["tokens_predicted"] == 120
    assert timed["stop_type"] == "limit" and timed["content"].endswith("\n") and timed["tokens_predicted"] < 120


def test_post_sampling_probs_of_greedy_sampling_give_the_pick_probability_one(server):
    _, out = post(server, "/completion", greedy(prompt=PROMPT, n_probs=3, post_sampling_probs=True))
    probs = out["completion_probabilities"]
    assert len(probs) == 8 and all(p["prob"] == 1.0 and p["top_probs"] == [
        {k: p[k] for k in ("id", "token", "bytes", "prob")}] for p in probs)


def _check_post_sampling_entry(e: dict, n_probs: int) -> None:
    """llama.cpp's test_n_probs_post_sampling's checks, and the pick's own entry among the top."""
    assert set(e) == {"id", "token", "bytes", "prob", "top_probs"} and 0 < e["prob"] <= 1
    top = e["top_probs"]
    assert all(set(t) == {"id", "token", "bytes", "prob"} and 0 < t["prob"] <= 1 for t in top)
    assert 0 < len(top) <= n_probs and [t["prob"] for t in top] == sorted((t["prob"] for t in top), reverse=True)
    assert len(top) == n_probs or sum(t["prob"] for t in top) == pytest.approx(1.0)
    if e["id"] in [t["id"] for t in top]:
        assert e["prob"] == next(t["prob"] for t in top if t["id"] == e["id"])
    else:
        assert len(top) == n_probs and e["prob"] <= top[-1]["prob"]


def test_post_sampling_probs_at_temperature_are_given_for_every_token_drafted_or_not(server):
    body = dict(prompt=PROMPT, n_predict=24, temperature=1.0, top_k=4, n_probs=6, post_sampling_probs=True, seed=5)
    status, out = post(server, "/completion", body)
    assert status == 200
    probs = out["completion_probabilities"]
    assert len(probs) == out["tokens_predicted"] == 24
    for e in probs:
        _check_post_sampling_entry(e, 6)
        assert len(e["top_probs"]) <= 4  # top-k 4: the whole of what the chain keeps, summing to 1
    # streamed: each step's chunk carries its tokens' entries, the accepted drafts' too
    events = stream(server, "/completion", body)
    steps = [ev for ev in events if ev.get("completion_probabilities")]
    assert all(len(ev["completion_probabilities"]) == len(ev["pyllama_spec"]["tokens"]) for ev in steps)
    assert any(t["draft"] for ev in steps for t in ev["pyllama_spec"]["tokens"])
    streamed = [e for ev in steps for e in ev["completion_probabilities"]]
    assert [e["id"] for e in streamed] == [e["id"] for e in probs]  # the seed's tokens again
    for a, b in zip(streamed, probs):
        _check_post_sampling_entry(a, 6)
        assert a["prob"] == pytest.approx(b["prob"], abs=1e-3)
        assert [t["prob"] for t in a["top_probs"]] == pytest.approx([t["prob"] for t in b["top_probs"]], abs=1e-3)
    # the OpenAI routes write them in the same shape under logprobs.content
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0.9, "logprobs": True,
            "top_logprobs": 3, "post_sampling_probs": True}
    status, out = post(server, "/v1/chat/completions", chat)
    assert status == 200
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"] > 0
    for e in content:
        _check_post_sampling_entry(e, 3)


@pytest.mark.parametrize("path, extra, name", [
    ("/completion", {"grammar": 'root ::= "a"+'}, "grammar"),
    ("/completion", {"json_schema": {"type": "object"}}, "grammar"),
    ("/completion", {"mirostat": 2}, "mirostat"),
    ("/completion", {"typical_p": 0.5}, "typical_p"),
    # a chat's response format: the template's grammar, known once the chat is rendered
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "grammar"),
])
def test_post_sampling_probs_at_temperature_refuse_what_the_chain_cannot_reproduce(server, path, extra, name):
    body = {"prompt": PROMPT, "n_predict": 4, "temperature": 0.7, "n_probs": 3, "post_sampling_probs": True, **extra}
    if path != "/completion":
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0.7, "logprobs": True,
                "top_logprobs": 3, "post_sampling_probs": True, **extra}
    status, err = post(server, path, body)
    assert status == 400, err
    message = err["error"]["message"]
    assert "post_sampling_probs" in message and f"sets {name}" in message
    status, _ = post(server, path, {**body, "post_sampling_probs": False})  # the probabilities before sampling
    assert status == 200


# --------------------------------------------------------------------------- other routes


@pytest.mark.parametrize("path", ["/embedding", "/embeddings", "/v1/embeddings", "/rerank", "/reranking",
                                  "/v1/rerank", "/v1/reranking"])
def test_embedding_and_rerank_routes_answer_as_llama_server_without_them(plain, path):
    r = httpx.post(plain.url + path, content=b"not even json", timeout=30)
    what = "reranking. Start it with `--reranking`" if "rerank" in path else "embeddings. Start it with `--embeddings`"
    assert r.status_code == 501
    assert r.json()["error"]["message"] == f"This server does not support {what}"
    assert r.json()["error"]["type"] == "not_supported_error"


def test_infill_lays_out_the_fim_prompt_as_llama_server(server):
    body = greedy(input_prefix="def f(", input_suffix="):\n", prompt="x", return_tokens=True,
                  input_extra=[{"filename": "a.py", "text": "import os\n"}, {"text": "b"}])
    status, out = post(server, "/infill", body)
    assert status == 200, out
    assert out["prompt"] == ("<|repo_name|>myproject\n<|file_sep|>a.py\nimport os\n<|file_sep|>tmp\nb"
                             "<|file_sep|>filename\n<|fim_prefix|>def f(x<|fim_suffix|>):\n<|fim_middle|>")
    _, same = post(server, "/completion", greedy(prompt=out["prompt"], return_tokens=True))
    assert same["tokens"] == out["tokens"]  # the same prompt as text, its special tokens parsed


def test_infill_keeps_the_end_of_a_long_prefix_and_the_start_of_a_long_suffix(server):
    n_batch = server.engine.config.n_batch  # 64: the prefix keeps 48 tokens, the suffix 16 - 2
    _, out = post(server, "/infill", greedy(input_prefix="p" * 100 + "END", input_suffix="START" + "s" * 100))
    prefix = out["prompt"].split("<|fim_prefix|>")[1].split("<|fim_suffix|>")[0]
    suffix = out["prompt"].split("<|fim_suffix|>")[1].split("<|fim_middle|>")[0]
    assert prefix.endswith("END") and len(prefix) == 3 * n_batch // 4
    assert suffix.startswith("START") and len(suffix) == n_batch // 4 - 2


@pytest.mark.parametrize("body,param", [
    ({"input_suffix": "x"}, "input_prefix"),
    ({"input_prefix": "x"}, "input_suffix"),
    ({"input_prefix": 5, "input_suffix": "x"}, "input_prefix"),
    ({"input_prefix": [1, 10**6], "input_suffix": "x"}, "input_prefix"),
    ({"input_prefix": "x", "input_suffix": "y", "input_extra": {}}, "input_extra"),
    ({"input_prefix": "x", "input_suffix": "y", "input_extra": [{"filename": "a"}]}, "input_extra"),
    ({"input_prefix": "x", "input_suffix": "y", "input_extra": [{"text": "a", "filename": 3}]}, "input_extra"),
    ({"input_prefix": "x", "input_suffix": "y", "prompt": 5}, "prompt"),
])
def test_a_bad_infill_request_is_a_400_naming_the_field(server, body, param):
    status, out = post(server, "/infill", body)
    assert status == 400 and out["error"]["param"] == param, out


def test_infill_on_a_model_without_fim_tokens_is_llama_servers_501(plain):
    status, out = post(plain, "/infill", {"input_prefix": "a", "input_suffix": "b"})
    assert status == 501 and out["error"]["message"] == ("Infill is not supported by this model: prefix token is "
                                                         "missing. suffix token is missing. middle token is missing. ")


def test_the_tiny_fim_set_names_its_fim_tokens(tiny_fim):
    with ps.load(tiny_fim.target, n_ctx=256, n_threads=N_THREADS) as engine:
        assert engine.model.fim_tokens == tiny.FIM_TOKEN_ID
        assert [engine.model.token_text(t) for t in tiny.FIM_TOKEN_ID.values()] == list(tiny.FIM_TOKENS.values())


def test_logit_bias_by_text_biases_each_of_its_tokens_as_llama_server(plain, tiny_dense):
    """llama-server's logit_bias takes a text where a token id goes ([[" the ", -100]], {" the ": -100}):
    each token of the text gets the bias (llama.cpp's tokenizer, no special tokens)."""
    base = post(plain, "/completion", greedy(prompt=PROMPT, n_predict=6))[1]
    first_token = post(plain, "/tokenize", {"content": base["content"]})[1]["tokens"][:1]
    text = post(plain, "/detokenize", {"tokens": first_token})[1]["content"]  # the answer's first token, as text
    ids = post(plain, "/tokenize", {"content": text})[1]["tokens"]
    by_id = post(plain, "/completion", greedy(prompt=PROMPT, n_predict=6, logit_bias=[[t, False] for t in ids]))[1]
    for bias in ([[text, False]], {text: -1e9}):
        status, by_text = post(plain, "/completion", greedy(prompt=PROMPT, n_predict=6, logit_bias=bias))
        assert status == 200 and by_text["content"] == by_id["content"] != base["content"], by_text
    status, answer = post(plain, "/completion", greedy(prompt=PROMPT, logit_bias=[["x" * 5000, -1]]))
    assert status == 400 and "at most 4096 tokens" in answer["error"]["message"]
    # bounded before anything is tokenized: texts of 64 KiB in all, 4096 entries (empty texts count too)
    status, answer = post(plain, "/completion", greedy(prompt=PROMPT, logit_bias=[["x" * 70_000, -1]]))
    assert status == 400 and "at most 65536 bytes" in answer["error"]["message"]
    assert post(plain, "/completion", greedy(prompt=PROMPT, logit_bias=[["", 0]] * 4000))[0] == 200  # biases nothing
    status, answer = post(plain, "/completion", greedy(prompt=PROMPT, logit_bias=[["", 0]] * 5000))
    assert status == 400 and "at most 4096" in answer["error"]["message"]
    # strtol's reading of an object's key: " 7" and "+7" are ids; in the list form any string is a text
    ids = post(plain, "/completion", greedy(prompt=PROMPT, n_predict=2, logit_bias={" 7": -1, "+8": -1}))[1]
    assert ids["generation_settings"]["logit_bias"] == [{"bias": -1.0, "token": 7}, {"bias": -1.0, "token": 8}]
    as_text = post(plain, "/completion", greedy(prompt=PROMPT, n_predict=2, logit_bias=[["7", -1]]))[1]
    seven = post(plain, "/tokenize", {"content": "7"})[1]["tokens"]
    assert [e["token"] for e in as_text["generation_settings"]["logit_bias"]] == seven


def test_verbose_adds_the_first_choices_completion_body_to_openai_answers(plain):
    messages = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
    for path, body in (("/v1/chat/completions", {"messages": messages}), ("/v1/completions", {"prompt": "Book:"})):
        status, out = post(plain, path, {**body, "max_tokens": 2, "verbose": True})
        assert status == 200 and "Book" in out["__verbose"]["prompt"]  # llama-server's debugging aid
        assert out["__verbose"]["content"] == (out["choices"][0].get("text") or out["choices"][0]["message"]["content"])
        assert "__verbose" not in post(plain, path, {**body, "max_tokens": 2, "verbose": False})[1]
        chunks = stream(plain, path, {**body, "max_tokens": 2, "verbose": True, "stream": True})
        last = [c for c in chunks if c.get("choices") and c["choices"][0].get("finish_reason")][-1]
        assert "Book" in last["__verbose"]["prompt"] and "__verbose" not in chunks[0]  # on the last chunk only
