"""The GGUF's own Jinja chat template, rendered as HF renders it; llama.cpp's built-in one as
the fallback, and the engine says which it used.

The templates below are written like the real ones (Qwen2.5-VL, Qwen3-VL with its thinking
switch, Gemma 3 with raise_exception and bos_token, HunyuanVL with strftime_now); each is
stored in a tiny GGUF's tokenizer.chat_template and rendered from there.
"""

from __future__ import annotations

import pytest
from conftest import N_THREADS

import pyllama_spec as ps
from pyllama_spec.devtools import tiny
from pyllama_spec.serving.chat_template import TemplateRenderError, render

pytest.importorskip("jinja2", reason="chat templates are rendered with jinja2")

M = ps.MEDIA_MARKER

QWEN25_VL = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

QWEN3_VL = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}{%- else %}"
    "{%- for content in message.content %}{%- if content.type == 'image' %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}{%- elif content.type == 'text' %}{{- content.text }}"
    "{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

GEMMA3 = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}{%- else -%}"
    "{%- for item in message['content'] -%}{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

HUNYUAN_VL = (
    "{%- set today = strftime_now('%Y-%m-%d') -%}<｜hy_begin▁of▁sentence｜>"
    "{%- for message in messages -%}{%- if message['role'] == 'system' -%}{{ message['content'] }}"
    "<｜hy_place▁holder▁no▁3｜>{%- elif message['role'] == 'user' -%}<｜hy_User｜>"
    "{%- if message['content'] is string -%}{{ message['content'] }}{%- else -%}"
    "{%- for c in message['content'] -%}{{ c['text'] }}{%- endfor -%}{%- endif -%}"
    "{%- else -%}<｜hy_Assistant｜>{{ message['content'] }}<｜hy_place▁holder▁no▁2｜>{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<｜hy_Assistant｜>{%- endif -%}"
)

RAISES = "{{ raise_exception('this template refuses everything') }}"

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "image", "image": "x.png"}, {"type": "text", "text": "What is it?"}]},
    {"role": "assistant", "content": "A cat."},
    {"role": "user", "content": "And the colour?"},
]


def _prepared(messages):
    """The messages as the engine hands them to a template (images as placeholders)."""
    from pyllama_spec.serving.prompt import normalize_content

    return [{"role": m["role"], "content": normalize_content(m["content"])[0]} for m in messages]


@pytest.mark.parametrize("template,expected", [
    (QWEN25_VL, f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{M}What is it?<|im_end|>\n"
                "<|im_start|>assistant\nA cat.<|im_end|>\n<|im_start|>user\nAnd the colour?<|im_end|>\n"
                "<|im_start|>assistant\n"),
    (QWEN3_VL, f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{M}What is it?<|im_end|>\n"
               "<|im_start|>assistant\nA cat.<|im_end|>\n<|im_start|>user\nAnd the colour?<|im_end|>\n"
               "<|im_start|>assistant\n"),
    (GEMMA3, f"<bos><start_of_turn>user\nBe brief.\n\n{M}What is it?<end_of_turn>\n<start_of_turn>model\n"
             "A cat.<end_of_turn>\n<start_of_turn>user\nAnd the colour?<end_of_turn>\n<start_of_turn>model\n"),
])
def test_real_style_templates_render_as_hf_does_with_the_marker_where_the_image_goes(template, expected):
    assert render(template, _prepared(MESSAGES), bos_token="<bos>", media_marker=M) == expected


def test_the_qwen3_thinking_switch_is_a_template_variable():
    msgs = _prepared([{"role": "user", "content": "Hi"}])
    assert render(QWEN3_VL, msgs, media_marker=M).endswith("<|im_start|>assistant\n")
    assert render(QWEN3_VL, msgs, media_marker=M, enable_thinking=False).endswith("<think>\n\n</think>\n\n")


def test_a_template_that_raises_or_does_not_compile_gives_a_render_error():
    with pytest.raises(TemplateRenderError, match="refused these messages: this template refuses everything"):
        render(RAISES, _prepared(MESSAGES), media_marker=M)
    with pytest.raises(TemplateRenderError, match="alternate"):
        render(GEMMA3, _prepared([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]), media_marker=M)
    with pytest.raises(TemplateRenderError, match="compile"):
        render("{% for %}", [], media_marker=M)


def test_the_sandbox_refuses_to_reach_python_internals():
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(TemplateRenderError):
        render(evil, _prepared(MESSAGES), media_marker=M)


@pytest.fixture(scope="module")
def models_with(tiny_dir, tiny_dense):
    def make(name, template):
        path = tiny_dir / f"template-{name}.gguf"
        if not path.exists():
            tiny.write_target(path, seed=0, predictable=0.5, chat_template=template)
        return path

    return make


@pytest.mark.parametrize("name,template", [("qwen25vl", QWEN25_VL), ("qwen3vl", QWEN3_VL), ("gemma3", GEMMA3),
                                           ("hunyuanvl", HUNYUAN_VL)])
def test_the_engine_renders_the_gguf_template_and_says_so(name, template, models_with, tiny_dense, big_image):
    path = models_with(name, template)
    messages = [{"role": "user", "content": [{"type": "image", "image": big_image},
                                             {"type": "text", "text": "What is it?"}]}]
    with ps.load(path, mmproj=tiny_dense.mmproj, n_ctx=2048, n_batch=64, n_ubatch=64, n_threads=N_THREADS) as e:
        r = e.generate(messages=messages, max_tokens=4)
    assert r.stats.chat_template == "jinja" and r.stats.images == 1 and len(r.tokens) == 4


def test_a_template_that_fails_falls_back_to_the_builtin_one_and_says_so(models_with, tiny_dense, caplog):
    path = models_with("raises", RAISES + "<|im_start|>")  # still recognisable as ChatML by llama.cpp
    with ps.load(path, n_ctx=1024, n_threads=N_THREADS) as e, caplog.at_level("WARNING"):
        r = e.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert r.stats.chat_template == "builtin"
    assert "built-in chat template" in caplog.text and "refuses everything" in caplog.text


def test_a_raw_prompt_uses_no_template(tiny_dense):
    with ps.load(tiny_dense.target, n_ctx=1024, n_threads=N_THREADS) as e:
        assert e.generate("Hi", max_tokens=1).stats.chat_template is None


def test_hugging_faces_generation_tag_renders_its_body():
    """{% generation %} (the assistant-mask tag of LFM2.5 and poolside Laguna templates) is not
    jinja2's: the renderer knows it and keeps the body, as llama-server's own renderer does."""
    template = ("{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
                "{% endgeneration %}{% else %}{{ m.content }}{% endif %}</{{ m.role }}>{% endfor %}")
    text = render(template, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                  media_marker="<__media__>")
    assert text == "<user>hi</user><assistant>yo</assistant>"
    with pytest.raises(TemplateRenderError, match="does not compile"):
        render("{% generation %}unclosed", [{"role": "user", "content": "hi"}], media_marker="<__media__>")
