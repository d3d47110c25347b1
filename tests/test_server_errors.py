"""Hostile request bodies are 400s, never 500s: JSON that nests too deeply or holds an integer
too long to convert, and ``chat_template_kwargs`` that name the chat template's own variables.
Also the library side: ``render`` / ``render_messages`` refuse those names with a ``ValueError``,
and a template that raises on a variable's value falls back to llama.cpp's renderer.

One server on 127.0.0.1 (a free port), stopped by its fixture.
"""

from __future__ import annotations

import time

import pytest
from conftest import N_THREADS

import pyllama_spec as ps
from pyllama_spec.bindings.mtmd import MEDIA_MARKER
from pyllama_spec.devtools import tiny
from pyllama_spec.serving import chat_template
from pyllama_spec.serving.chat_template import TemplateRenderError

httpx = pytest.importorskip("httpx", reason="the test extra brings httpx")
uvicorn = pytest.importorskip("uvicorn", reason="the server extra brings uvicorn")
from serving import LocalServer  # noqa: E402

from pyllama_spec.server import ServerSettings  # noqa: E402

OK_MESSAGES = [{"role": "user", "content": "Hi"}]

#: Every name the render path sets itself (render's own parameters, the variables it passes the
#: template, its helper functions) and jinja2's Template.render's ``self``.
RESERVED = ("add_generation_prompt", "bos_token", "eos_token", "media_marker", "messages", "raise_exception", "self",
            "strftime_now", "template", "tools")


@pytest.fixture(scope="module")
def served(tiny_dense):
    engine = ps.load(tiny_dense.target, mmproj=tiny_dense.mmproj, draft=tiny_dense.draft, n_ctx=512, n_batch=64,
                     n_ubatch=64, n_threads=N_THREADS, draft_max=4, flash_attn=False)
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


def test_the_reserved_names_cover_every_keyword_of_the_render_path():
    assert set(RESERVED) <= set(chat_template.RESERVED_VARIABLES)


@pytest.mark.parametrize("value", [None, 0, -1, 2**80, 1.5, "yes", "", [1, [2]], {"a": {"b": None}}, False])
def test_chat_template_kwargs_values_of_any_json_type_are_accepted(served, value):
    r = httpx.post(served.url + "/v1/chat/completions",
                   json={"messages": OK_MESSAGES, "max_tokens": 2,
                         "chat_template_kwargs": {"enable_thinking": value, "": value, "a b\u00e9\x00": value}},
                   timeout=60)
    assert r.status_code == 200, r.text


TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


# render's own keyword parameters are its to take; every other reserved name is refused
@pytest.mark.parametrize("key", [k for k in RESERVED if k not in ("add_generation_prompt", "bos_token", "eos_token",
                                                                  "media_marker")])
def test_render_refuses_its_own_variables_with_a_value_error(key):
    with pytest.raises(ValueError, match="set by the renderer") as info:
        chat_template.render(TEMPLATE, OK_MESSAGES, media_marker=MEDIA_MARKER, **{key: 1})
    assert not isinstance(info.value, TemplateRenderError)  # not a render failure to fall back from
    assert chat_template.render(TEMPLATE, OK_MESSAGES, media_marker=MEDIA_MARKER, enable_thinking=[1]) == "Hi"


def test_render_refuses_a_variable_name_that_is_not_a_string():
    with pytest.raises(ValueError, match="must be strings"):
        chat_template.check_variables({1: 2})


@pytest.mark.parametrize("template", [
    "{{ 10 // enable_thinking }}",  # ZeroDivisionError
    "{{ enable_thinking[5] }}",
    "{{ enable_thinking['x'] }}",
    "{{ enable_thinking.x.y }}",
    "{% if enable_thinking > 1 %}{% endif %}",
])
def test_render_turns_what_a_template_raises_on_a_value_into_a_render_error(template):
    for value in (0, [], {}, "", None, 100):
        try:
            chat_template.render(template, OK_MESSAGES, media_marker=MEDIA_MARKER, enable_thinking=value)
        except TemplateRenderError:
            pass


@pytest.fixture(scope="module")
def strict_template_model(tiny_dir):
    """A tiny target whose template does arithmetic on ``enable_thinking`` (so it raises on some values)."""
    # ChatML (so that llama.cpp's built-in renderer, the fallback, knows it)
    template = ("{%- for m in messages -%}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endfor -%}"
                "{%- if enable_thinking is defined -%}{{ 'think ' * (10 // enable_thinking) }}{%- endif -%}"
                "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")
    return tiny.write_target(tiny_dir / "strict-template-target.gguf", chat_template=template)


@pytest.mark.parametrize("key", RESERVED)
def test_render_messages_refuses_its_own_variables_with_a_value_error(strict_template_model, key):
    from pyllama_spec.bindings.model import Model
    from pyllama_spec.serving.prompt import render_messages

    with Model(strict_template_model) as model:
        with pytest.raises(ValueError, match=repr(key)) as info:
            render_messages(model, OK_MESSAGES, template_kwargs={key: 1})
        assert not isinstance(info.value, TemplateRenderError)


@pytest.mark.parametrize("value,renderer", [
    (5, "jinja"),  # 10 // 5: renders
    ([1], "builtin"),  # 10 // [1]: TypeError in the template
    (0, "builtin"),  # 10 // 0: ZeroDivisionError in the template
    ("x", "builtin"),
    ({"a": 1}, "builtin"),
    (10**30, "jinja"),  # 10 // 10**30 == 0: no "think"
    (1e-300, "builtin"),  # 'think ' * 1e301: a float count
])
def test_a_template_that_raises_on_a_value_falls_back_to_the_builtin_renderer(strict_template_model, value, renderer):
    from pyllama_spec.bindings.model import Model
    from pyllama_spec.serving.prompt import render_messages

    with Model(strict_template_model) as model:
        text, images, used = render_messages(model, OK_MESSAGES, template_kwargs={"enable_thinking": value})
    assert used == renderer and images == []
    assert "Hi" in text


@pytest.mark.parametrize("value,renderer", [(2, "jinja"), (0, "builtin"), ([True], "builtin")])
def test_engine_generate_falls_back_when_the_template_raises_on_a_value(strict_template_model, value, renderer):
    """Through Engine.generate (what the server's worker calls): never an exception the server would answer 500."""
    with ps.load(strict_template_model, n_ctx=256, n_batch=64, n_ubatch=64, n_threads=N_THREADS,
                 flash_attn=False) as engine:
        out = engine.generate(messages=OK_MESSAGES, max_tokens=1, chat_template_kwargs={"enable_thinking": value})
    assert out.stats.chat_template == renderer


def test_a_body_of_millions_of_tiny_arrays_is_refused_before_it_is_parsed():
    """20 million '[]' would take 1.5 GB and seconds of the GIL to parse; brackets inside strings
    (a prompt full of code) do not count."""
    import json

    from pyllama_spec.server.errors import APIError
    from pyllama_spec.server.schema import MAX_JSON_CONTAINERS, parse_json_body

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
