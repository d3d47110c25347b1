"""Hostile request bodies are 400s, never 500s: JSON that nests too deeply or holds an integer
too long to convert, and ``chat_template_kwargs`` that name the chat template's own variables.
Also the library side: the chat renderer refuses those names with a ``ValueError``, and a
template that raises on a variable's value is a ValueError (a 400; llama-server answers 500).

One server on 127.0.0.1 (a free port), stopped by its fixture.
"""

from __future__ import annotations

import time

import pytest
from conftest import TINY_ENGINE, load_tiny

import pyllama_spec as ps
from pyllama_spec.bindings.model import Model
from pyllama_spec.devtools import tiny
from pyllama_spec.serving.chat_template import RESERVED_VARIABLES, ChatOptions, ChatRenderer, ChatSettings, check_variables

httpx = pytest.importorskip("httpx", reason="the test extra brings httpx")
uvicorn = pytest.importorskip("uvicorn", reason="the server extra brings uvicorn")
from serving import LocalServer  # noqa: E402

from pyllama_spec.server import ServerSettings  # noqa: E402

OK_MESSAGES = [{"role": "user", "content": "Hi"}]

#: Every name the chat layer sets itself: the template's inputs and its helper functions.
RESERVED = ("add_generation_prompt", "bos_token", "eos_token", "messages", "raise_exception", "strftime_now", "tools")


@pytest.fixture(scope="module")
def served(tiny_dense):
    engine = load_tiny(tiny_dense, n_ctx=512, draft_max=4, flash_attn=False)
    server = LocalServer(engine, ServerSettings(alias="tiny", max_tokens=8, default_max_tokens=4))
    yield server
    server.stop()
    engine.close()


def _post_raw(served, raw: bytes, path="/v1/chat/completions"):
    return httpx.post(served.url + path, content=raw, headers={"content-type": "application/json"}, timeout=60)


def _assert_400(r, *, param=None, match=None):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and "Traceback" not in r.text
    if param is not None:
        assert err["param"] == param, err
    if match is not None:
        assert match in err["message"], err
    return err


def _still_serving(served):
    r = httpx.post(served.url + "/v1/chat/completions", json={"messages": OK_MESSAGES, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


# --------------------------------------------------------------------------- item 1: hostile JSON


@pytest.mark.parametrize("raw", [
    b"[" * 100_000 + b"]" * 100_000,  # json.loads: RecursionError
    b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    b"[" * 100_000,  # unclosed: still too deep before it is found unfinished
    b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    # parses (under Python's recursion limit) but nests deeper than any request needs
    b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": '
    + b"[" * 900 + b"]" * 900 + b"}}",
    b'{"messages": [{"role": ' + b"[" * 900 + b"]" * 900 + b', "content": "x"}]}',  # repr() of it in the error
], ids=["array", "object", "unclosed", "in-messages", "parsable-900", "role-900"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/completion"])
def test_json_that_nests_too_deeply_is_a_400(served, raw, path):
    _assert_400(_post_raw(served, raw, path), match="nests too deeply")
    _still_serving(served)


def test_moderate_nesting_is_still_read(served):
    deep = {"x": [[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]}  # 22 levels: a tool schema can nest like this
    r = httpx.post(served.url + "/v1/chat/completions",
                   json={"messages": OK_MESSAGES, "max_tokens": 2, "chat_template_kwargs": deep}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("raw", [
    b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1' + b"0" * 5000 + b"}",
    b'{"messages": [{"role": "user", "content": "x"}], "seed": -' + b"9" * 100_000 + b"}",
    b"1" * 4301,
], ids=["max_tokens", "seed", "bare"])
def test_an_integer_too_long_to_convert_is_a_400(served, raw):
    _assert_400(_post_raw(served, raw), match="digits")
    _still_serving(served)


@pytest.mark.parametrize("raw,param", [
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e999}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "x"}], "top_p": -Infinity}', "top_p"),
    (b'{"messages": [{"role": "user", "content": "x"}], "seed": 1e400}', "seed"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1' + b"0" * 4000 + b"}", "max_tokens"),
], ids=["inf", "nan", "-inf", "float-seed", "int-4001-digits"])
def test_non_finite_and_huge_numbers_are_refused_by_their_field(served, raw, param):
    _assert_400(_post_raw(served, raw), param=param)


def test_an_invalid_utf8_or_utf16_body_is_a_400(served):
    for raw in (b'{"a": "\xff\xfe"}', b"\xff\xfe{\x00", b"\x00\x00\x00{"):
        _assert_400(_post_raw(served, raw))


# --------------------------------------------------------------------------- item 2: template variables


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("key", RESERVED)
def test_chat_template_kwargs_that_name_the_servers_own_variables_are_a_400(served, key, stream):
    r = httpx.post(served.url + "/v1/chat/completions",
                   json={"messages": OK_MESSAGES, "max_tokens": 2, "chat_template_kwargs": {key: True},
                         "stream": stream},
                   timeout=60)  # refused before the stream starts: a 400, not an error event after a 200
    err = _assert_400(r, param="chat_template_kwargs", match=repr(key))
    assert "set by the server" in err["message"]
    _still_serving(served)


def test_the_reserved_names_are_the_ones_the_renderer_sets(tiny_dense):
    """Each reserved name is defined for every template (tools: when a chat has tools, for a template
    that renders them; one that does not gets them in the system message: serving/generic_tools.py)."""
    assert set(RESERVED) == set(RESERVED_VARIABLES)
    renders_tools = ("{% for m in messages %}{{ m.content }}{% for c in m.tool_calls or [] %}{{ c.function.name }}"
                     "{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}"
                     "{% for t in tools or [] %}{{ t.function.name }}{% endfor %}")
    with Model(tiny_dense.target, vocab_only=True) as model:
        for name in RESERVED:
            template = f"{{{{ '{name}:' ~ ({name} is defined) }}}}"
            options = ChatOptions(tools=[{"type": "function", "function": {"name": "f"}}] if name == "tools" else None)
            if name == "tools":
                template += renders_tools
            out = ChatRenderer(model, ChatSettings(template=template)).render(OK_MESSAGES, options).prompt
            assert out.lower().startswith(f"{name}:true"), (name, out)


@pytest.mark.parametrize("value", [None, 0, -1, 2**80, 1.5, [1, [2]], {"a": {"b": None}}, False])
def test_chat_template_kwargs_values_of_any_json_type_are_accepted(served, value):
    r = httpx.post(served.url + "/v1/chat/completions",
                   json={"messages": OK_MESSAGES, "max_tokens": 2,
                         "chat_template_kwargs": {"enable_thinking": value, "": value, "a b\u00e9\x00": value}},
                   timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("value", ["yes", ""])
def test_enable_thinking_as_a_string_is_a_400_as_in_llama_server(served, value):
    r = httpx.post(served.url + "/v1/chat/completions",
                   json={"messages": OK_MESSAGES, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": value}},
                   timeout=60)
    _assert_400(r, param="chat_template_kwargs", match="expected boolean, got string")


TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.mark.parametrize("key", RESERVED)
def test_the_renderer_refuses_its_own_variables_with_a_value_error(tiny_dense, key):
    with Model(tiny_dense.target, vocab_only=True) as model:
        renderer = ChatRenderer(model, ChatSettings(template=TEMPLATE))
        with pytest.raises(ValueError, match="set by the renderer"):
            renderer.render(OK_MESSAGES, ChatOptions(template_kwargs={key: 1}))
        with pytest.raises(ValueError, match="set by the renderer"):  # nor as the engine's defaults
            ChatRenderer(model, ChatSettings(template=TEMPLATE, template_kwargs={key: 1}))
        assert renderer.render(OK_MESSAGES, ChatOptions(template_kwargs={"enable_thinking": [1]})).prompt == "Hi"


def test_the_renderer_refuses_a_variable_name_that_is_not_a_string():
    with pytest.raises(ValueError, match="must be strings"):
        check_variables({1: 2})


@pytest.fixture(scope="module")
def strict_template_model(tiny_dir):
    """A tiny target whose template does arithmetic on ``enable_thinking`` (so it raises on some values)."""
    template = ("{%- for m in messages -%}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endfor -%}"
                "{%- if enable_thinking is not boolean -%}{{ 'think ' * (10 - enable_thinking) }}{%- endif -%}"
                "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")
    return tiny.write_target(tiny_dir / "strict-template-target.gguf", chat_template=template)


#: (enable_thinking, whether the template renders with it): llama-server's renderer raises on the
#: others, which is a ValueError here (a 400 from the server).
STRICT_VALUES = [(5, True), ([1], False), (0, True), ({"a": 1}, False), (None, False), (1.5, False), ([True], False)]


@pytest.mark.parametrize("value,renders", STRICT_VALUES)
def test_a_template_that_raises_on_a_value_is_a_value_error(strict_template_model, value, renders):
    with Model(strict_template_model, vocab_only=True) as model:
        renderer = ChatRenderer(model, ChatSettings())
        if renders:
            options = ChatOptions(template_kwargs={"enable_thinking": value})
            assert "think" in renderer.render(OK_MESSAGES, options).prompt
        else:
            with pytest.raises(ValueError):
                renderer.render(OK_MESSAGES, ChatOptions(template_kwargs={"enable_thinking": value}))


@pytest.mark.parametrize("value,renders", STRICT_VALUES)
def test_a_template_that_raises_on_a_value_is_a_400_never_a_500(strict_template_model, value, renders):
    engine = ps.load(strict_template_model, n_ctx=256, **TINY_ENGINE, flash_attn=False)
    server = LocalServer(engine, ServerSettings(alias="strict", max_tokens=4, default_max_tokens=1))
    try:
        for stream in (False, True):
            r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                           json={"messages": OK_MESSAGES, "chat_template_kwargs": {"enable_thinking": value},
                                 "stream": stream})
            if renders:
                assert r.status_code == 200, r.text
            else:  # refused before the stream starts
                _assert_400(r, param="messages")
    finally:
        server.stop()
        engine.close()


def test_a_body_of_millions_of_tiny_arrays_is_refused_before_it_is_parsed():
    """20 million '[]' would take 1.5 GB and seconds of the GIL to parse; brackets inside strings
    (a prompt full of code) do not count."""
    import json

    from pyllama_spec.server.errors import APIError
    from pyllama_spec.server.json_body import MAX_JSON_CONTAINERS, parse_json_body

    start = time.perf_counter()
    with pytest.raises(APIError, match="more than .* arrays and objects") as e:
        parse_json_body(b"[" + b"[]," * 20_000_000 + b"[]]")
    assert e.value.status == 400 and time.perf_counter() - start < 2
    code = '{"a": [x[i] for i in range(3)], "b": "\\\\"} ' * 200_000  # brackets and quotes in a string
    body = json.dumps({"prompt": code, "stop": ["]"]}).encode()
    assert body.count(b"[") > MAX_JSON_CONTAINERS
    assert parse_json_body(body)["prompt"] == code
    many = json.dumps([[] for _ in range(MAX_JSON_CONTAINERS - 1)]).encode()
    assert len(parse_json_body(many)) == MAX_JSON_CONTAINERS - 1
    with pytest.raises(APIError):
        parse_json_body(json.dumps([[] for _ in range(MAX_JSON_CONTAINERS)]).encode())
