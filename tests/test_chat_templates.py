"""Chat templates rendered by llama.cpp's own chat layer (common/chat.h, through the shim), as
llama-server renders them: a GGUF's template or a --chat-template override, image parts as the
media marker where the template puts the part's text, template variables (Qwen3's thinking
switch), the refusals of a template that raises, and the engine saying which renderer it used.

The templates below are written like the real ones (Qwen2.5-VL, Qwen3-VL with its thinking
switch, Gemma 3 with raise_exception and bos_token, HunyuanVL with strftime_now); the real ones of
the pinned source are rendered with tools, tool results, images and reasoning in
test_chat_tools.py, against llama-server's own /apply-template.
"""

from __future__ import annotations

import pytest
from conftest import N_THREADS, TINY_ENGINE

import pyllama_spec as ps
from pyllama_spec.bindings.model import Model
from pyllama_spec.devtools import tiny
from pyllama_spec.serving.chat_template import ChatOptions, ChatRenderer, ChatSettings

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


@pytest.fixture(scope="module")
def vocab(tiny_dense):
    with Model(tiny_dense.target, vocab_only=True) as model:
        yield model


def _render(vocab, template, messages=MESSAGES, **options) -> str:
    return ChatRenderer(vocab, ChatSettings(template=template)).render(messages, ChatOptions(**options)).prompt


@pytest.mark.parametrize("template,expected", [
    (QWEN25_VL, f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{M}What is it?<|im_end|>\n"
                "<|im_start|>assistant\nA cat.<|im_end|>\n<|im_start|>user\nAnd the colour?<|im_end|>\n"
                "<|im_start|>assistant\n"),
    # llama-server gives a template it does not see thinking in enable_thinking = false
    (QWEN3_VL, f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{M}What is it?<|im_end|>\n"
               "<|im_start|>assistant\nA cat.<|im_end|>\n<|im_start|>user\nAnd the colour?<|im_end|>\n"
               "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    # bos_token is the vocabulary's (the tiny one's BOS is <|endoftext|>, and it adds none itself)
    (GEMMA3, f"<|endoftext|><start_of_turn>user\nBe brief.\n\n{M}What is it?<end_of_turn>\n<start_of_turn>model\n"
             "A cat.<end_of_turn>\n<start_of_turn>user\nAnd the colour?<end_of_turn>\n<start_of_turn>model\n"),
    (HUNYUAN_VL, f"<｜hy_begin▁of▁sentence｜>Be brief.<｜hy_place▁holder▁no▁3｜><｜hy_User｜>{M}What is it?"
                 "<｜hy_Assistant｜>A cat.<｜hy_place▁holder▁no▁2｜><｜hy_User｜>And the colour?<｜hy_Assistant｜>"),
])
def test_real_style_templates_render_with_the_marker_where_the_image_goes(vocab, template, expected):
    assert _render(vocab, template) == expected


def test_the_qwen3_thinking_switch_is_a_template_variable(vocab):
    msgs = [{"role": "user", "content": "Hi"}]
    assert _render(vocab, QWEN3_VL, msgs, template_kwargs={"enable_thinking": True}).endswith("<|im_start|>assistant\n")
    assert _render(vocab, QWEN3_VL, msgs, template_kwargs={"enable_thinking": False}).endswith("<think>\n\n</think>\n\n")
    assert _render(vocab, QWEN3_VL, msgs, reasoning_effort="none").endswith("<think>\n\n</think>\n\n")


def test_a_template_that_raises_is_refused_at_load_or_for_the_chat_it_raises_on(vocab):
    # llama-server renders an example chat when it starts, and does not start when that fails
    with pytest.raises(ps.ChatTemplateError, match="(?s)cannot be used .*this template refuses everything"):
        ChatRenderer(vocab, ChatSettings(template=RAISES))
    with pytest.raises(ValueError, match="alternate"):
        _render(vocab, GEMMA3, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ps.ChatTemplateError, match="cannot be used"):
        ChatRenderer(vocab, ChatSettings(template="{% for %}"))


def test_the_renderer_reaches_no_python_internals(vocab):
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ValueError, match="not a function"):
        ChatRenderer(vocab, ChatSettings(template=evil))


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
    with ps.load(path, mmproj=tiny_dense.mmproj, n_ctx=2048, **TINY_ENGINE) as e:
        r = e.generate(messages=messages, max_tokens=4)
    assert r.stats.chat_template == "jinja" and r.stats.images == 1 and len(r.tokens) == 4


def test_a_gguf_template_that_cannot_be_used_fails_the_load_and_says_why(models_with):
    path = models_with("raises", RAISES + "<|im_start|>")
    with pytest.raises(ValueError, match="refuses everything"):
        ps.load(path, n_ctx=1024, n_threads=N_THREADS)
    # --no-jinja: llama.cpp's built-in renderer recognises ChatML by its tokens
    with ps.load(path, n_ctx=1024, n_threads=N_THREADS, jinja=False) as e:
        assert e.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=2).stats.chat_template == "builtin"


def test_a_raw_prompt_uses_no_template(tiny_dense):
    with ps.load(tiny_dense.target, n_ctx=1024, n_threads=N_THREADS) as e:
        assert e.generate("Hi", max_tokens=1).stats.chat_template is None


def test_hugging_faces_generation_tag_renders_its_body(vocab):
    """{% generation %} (the assistant-mask tag of LFM2.5 and poolside Laguna templates) renders its body."""
    template = ("{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
                "{% endgeneration %}{% else %}{{ m.content }}{% endif %}</{{ m.role }}>{% endfor %}")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "ok"}]
    assert _render(vocab, template, msgs) == "<user>hi</user><assistant>yo</assistant><user>ok</user>"
