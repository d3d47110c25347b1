"""An engine's own defaults, as llama-server's command line gives them: sampling settings
(--temp, --top-k, --seed, --ignore-eos, --grammar, ...) and a chat template (--chat-template,
--no-jinja). A request's own settings override them; a bad default fails the load."""

from __future__ import annotations

import pytest

import pyllama_spec as ps
from pyllama_spec.server.schema import RequestLimits, parse_chat

MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def plain(tiny_dense):
    with ps.load(tiny_dense.target, n_ctx=1024) as engine:
        yield engine


def test_sampling_defaults_apply_to_calls_that_do_not_set_them(tiny_dense, plain):
    defaults = {"temperature": 0.9, "seed": 11, "top_k": 5, "presence_penalty": 0.3}
    with ps.load(tiny_dense.target, n_ctx=1024, sampling=defaults) as engine:
        got = engine.generate(messages=MESSAGES, max_tokens=24)
        assert got.tokens == plain.generate(messages=MESSAGES, max_tokens=24, **defaults).tokens
        # a call's own settings win over the defaults
        assert engine.generate(messages=MESSAGES, max_tokens=24, temperature=0.0).tokens == \
            plain.generate(messages=MESSAGES, max_tokens=24, top_k=5, presence_penalty=0.3).tokens


def test_a_grammar_default_is_replaced_by_a_calls_own_constraint(tiny_dense, plain):
    with ps.load(tiny_dense.target, n_ctx=1024, sampling={"grammar": 'root ::= "a"+'}) as engine:
        assert set(engine.generate(messages=MESSAGES, max_tokens=6).text) <= {"a"}
        own = engine.generate(messages=MESSAGES, max_tokens=6, grammar='root ::= "b"+').text
        assert own and set(own) <= {"b"}
        schema = engine.generate(messages=MESSAGES, max_tokens=6, json_schema={"const": 1}).text
        assert schema == plain.generate(messages=MESSAGES, max_tokens=6, json_schema={"const": 1}).text


def test_bad_defaults_fail_the_load_with_what_was_wrong(tiny_dense):
    with pytest.raises(ValueError, match="sampling defaults are not valid: .*top_k"):
        ps.load(tiny_dense.target, n_ctx=1024, sampling={"top_k": "many"})
    with pytest.raises(ValueError, match="sampling defaults are not valid: .*no_such"):
        ps.load(tiny_dense.target, n_ctx=1024, sampling={"no_such": 1})
    with pytest.raises(ps.ChatTemplateError, match="no built-in chat template 'no-such-template'"):
        ps.load(tiny_dense.target, n_ctx=1024, chat_template="no-such-template", jinja=False)
    # with Jinja, a template llama-server's renderer refuses is refused at load (llama-server does not start)
    with pytest.raises(ps.ChatTemplateError, match="chat template cannot be used"):
        ps.load(tiny_dense.target, n_ctx=1024, chat_template="{% for %}")


def test_ignore_eos_forbids_every_end_of_generation_token(tiny_dense, plain):
    eog = plain.model.eog_tokens
    assert eog and all(plain.model.is_eog(t) for t in eog)
    got = plain.generate(messages=MESSAGES, max_tokens=40, ignore_eos=True)
    assert len(got.tokens) == 40 and not any(plain.model.is_eog(t) for t in got.tokens)
    with ps.load(tiny_dense.target, n_ctx=1024, sampling={"ignore_eos": True}) as engine:
        assert engine.generate(messages=MESSAGES, max_tokens=40).tokens == got.tokens


def _rendered(tiny_dense, **config) -> tuple[str, str]:
    with ps.load(tiny_dense.target, n_ctx=1024, **config) as engine:
        chat = engine.chat_params(MESSAGES)
    return chat.renderer, chat.prompt


def test_a_chat_template_by_name_or_text_replaces_the_models(tiny_dense):
    # a built-in's name (--no-jinja, or any name but chatml): llama.cpp's built-in renderer
    assert _rendered(tiny_dense, chat_template="llama3") == (
        "builtin", "<|start_header_id|>user<|end_header_id|>\n\nhello there<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n")
    # "chatml" is llama.cpp's ChatML template, in Jinja (as llama-server reads it)
    assert _rendered(tiny_dense, chat_template="chatml") == (
        "jinja", "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n")
    jinja = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    assert _rendered(tiny_dense, chat_template=jinja) == ("jinja", "[user] hello there\n>")
    # --no-jinja: llama.cpp's renderer even for Jinja text it recognises (here: the model's own)
    renderer, own = _rendered(tiny_dense, jinja=False)
    assert renderer == "builtin" and "hello there" in own


def test_an_engine_with_a_template_renders_requests_with_it(tiny_dense):
    with ps.load(tiny_dense.target, n_ctx=1024, chat_template="chatml", jinja=False) as engine:
        result = engine.generate(messages=MESSAGES, max_tokens=2)
        assert result.stats.chat_template == "builtin"
        assert result.stats.prompt_tokens == len(engine.model.tokenize(
            "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n", add_special=True))


def test_a_request_without_temperature_or_seed_leaves_them_to_the_server_defaults():
    from pyllama_spec.server.images import ImageLimits

    limits = RequestLimits(max_tokens=64, default_max_tokens=16, draft_max=0,
                           images=ImageLimits(max_images=0, max_pixels=1, allowed_dir=None))
    params = parse_chat({"messages": MESSAGES}, limits).params  # what the request gave, not yet resolved
    assert "temperature" not in params.sampling and params.seed is None
    params = parse_chat({"messages": MESSAGES, "temperature": -1, "seed": -1}, limits).params
    assert params.sampling["temperature"] == 0.0 and params.seed == 0xFFFFFFFF


def test_the_draft_length_defaults_to_the_methods_measured_one(tiny_dense):
    """No draft_max: the registry's length for the method (bench/RESULTS.md "Default draft lengths"),
    in the engine, per call, in /props' terms and in the CLI; a given one is kept."""
    from pyllama_spec.drafters.registry import method

    assert (method("draft-dflash").draft_max, method("draft-mtp").draft_max, method("draft-eagle3").draft_max,
            method("draft-simple").draft_max, method("ngram-simple").draft_max) == (5, 5, 5, 5, 5)
    m = ps.embedded_models()
    for kw, expected in [(dict(draft=m.draft), 5), (dict(spec_type="ngram-simple"), 5),
                         (dict(draft=m.draft, draft_tree=8), 15),  # a tree: as deep as the draft goes
                         (dict(draft=m.draft, draft_max=9), 9), (dict(draft=m.draft, draft_max="auto"), "auto"),
                         ({}, 0)]:
        with ps.load(m.target, n_ctx=1024, n_threads=1, **kw) as engine:
            assert engine.draft_max == expected, kw
            if not kw.get("draft_tree"):  # a tree's depth is set as the draft's cap, which caps it to 15
                assert engine.config.draft_max == expected
            if expected == 5:  # a call without draft_max drafts at most that many
                r = engine.generate("def add(a, b):\n", max_tokens=24)
                assert r.stats.drafted <= 5 * r.stats.target_steps and r.stats.drafted > 0


def test_load_shows_every_setting_and_takes_verbose(run_python):
    """help(load) and editors that read signatures list every EngineConfig setting with its default
    (it took **kwargs only); verbose=True prints llama.cpp's log to stderr as llama-cpp-python does."""
    import dataclasses
    import inspect

    params = inspect.signature(ps.load).parameters
    fields = {f.name: f for f in dataclasses.fields(ps.EngineConfig)}
    assert set(fields) - {"model", "mmproj", "draft", "spec_type"} <= set(params)
    assert params["n_ctx"].default == 4096 and params["draft_max"].default is None
    assert params["verbose"].default is False and list(params)[:4] == ["model", "mmproj", "draft", "spec_type"]
    code = """
        import pyllama_spec as ps
        m = ps.embedded_models()
        with ps.load(m.target, n_ctx=512, n_threads=1, verbose={}) as e:
            e.generate("def f(", max_tokens=2)
    """
    # editors that read annotations (not the signature) see the same keywords: load's **kwargs is
    # Unpack[LoadOptions], a TypedDict that must name every setting, with the same annotations
    from pyllama_spec.serving.config import LoadOptions

    typed = {name: getattr(t, "__forward_arg__", t) for name, t in LoadOptions.__annotations__.items()}
    assert set(typed) == set(params) - {"model", "mmproj", "draft", "spec_type"}
    differ = [(n, typed[n], fields[n].type) for n in typed if n in fields and typed[n] != fields[n].type]
    assert not differ, differ
    assert ps.load.__annotations__["kwargs"] == "Unpack[LoadOptions]"
    quiet, loud = (run_python(code.format(v)) for v in (False, True))
    assert quiet.returncode == loud.returncode == 0, loud.stderr[-2000:]
    assert "llama_context" not in quiet.stderr and "llama_context" in loud.stderr, loud.stderr[-2000:]
