"""Chat handlers of llama-cpp-python that take pictures, for ``Llama(..., chat_handler=...)``.

``clip_model_path`` is the projector (mmproj) file; the engine loads it with the model. ``MTMDChatHandler``
renders the chat with the model's own template (the GGUF's, as this project renders it for
llama-server's routes); the Llava-style handlers (``Llava15ChatHandler`` and its kin) with their own,
llama-cpp-python's, as there. Each ``image_url`` part goes where the picture goes; it may be a ``data:``
URI (base64), a ``file://`` URL or a local path, or an ``http(s)://`` URL, fetched as llama-cpp-python
fetches it.

llama-cpp-python's Python chat formatters are here too: ``Jinja2ChatFormatter`` and
``hf_tokenizer_config_to_chat_formatter`` (Jinja2, the ``llama-cpp`` extra, as llama-cpp-python renders
them), and the named formats of ``chat_formats`` (``format_chatml``, ``register_chat_format``, ...), which
``Llama(chat_format=...)`` uses.
"""

from __future__ import annotations

import base64
import json
import urllib.parse
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

from pyllama_spec.llama_cpp.chat_formats import (  # noqa: F401 - llama-cpp-python's names, from here too
    CHAT_FORMATS,
    ChatFormatter,
    ChatFormatterResponse,
    format_alpaca,
    format_baichuan,
    format_baichuan2,
    format_chatglm3,
    format_chatml,
    format_gemma,
    format_intel,
    format_llama2,
    format_llama3,
    format_mistral_instruct,
    format_mistrallite,
    format_oasst_llama,
    format_open_orca,
    format_openbuddy,
    format_openchat,
    format_phind,
    format_pygmalion,
    format_qwen,
    format_redpajama_incite,
    format_saiga,
    format_snoozy,
    format_zephyr,
    get_chat_formatter,
    LlamaChatCompletionHandlerNotFoundException,
    register_chat_format,
)
#: The most bytes an image fetched from a URL may have.
MAX_IMAGE_BYTES = 64 * 2**20
FETCH_TIMEOUT_S = 30


class MTMDChatHandler:
    """A chat with pictures through libmtmd: ``clip_model_path`` is the model's projector file."""

    def __init__(self, clip_model_path: str, verbose: bool = True, use_gpu: bool = True) -> None:
        if not Path(clip_model_path).exists():
            raise ValueError(f"Clip model path does not exist: {clip_model_path}")
        self.clip_model_path = str(clip_model_path)
        self.verbose = verbose
        self.use_gpu = use_gpu

    @staticmethod
    def load_image(image_url: str) -> bytes | str:
        """The picture of an ``image_url``: bytes (a data URI, an http(s) URL), or a local path."""
        return load_image(image_url)


def load_image(image_url: str) -> bytes | str:
    if image_url.startswith("data:"):
        head, sep, data = image_url.partition(",")
        if not sep or ";base64" not in head:
            raise ValueError(f"an image data URI must be base64: {image_url[:40]!r}...")
        try:
            return base64.b64decode("".join(data.split()), validate=True)
        except ValueError as e:
            raise ValueError(f"the image data URI is not valid base64: {e}") from e
    scheme = urllib.parse.urlparse(image_url).scheme
    if scheme in ("http", "https"):
        with urllib.request.urlopen(image_url, timeout=FETCH_TIMEOUT_S) as f:
            data = f.read(MAX_IMAGE_BYTES + 1)
        if len(data) > MAX_IMAGE_BYTES:
            raise ValueError(f"the image at {image_url} is over {MAX_IMAGE_BYTES} bytes")
        return data
    if scheme == "file":
        return urllib.request.url2pathname(urllib.parse.urlparse(image_url).path)
    if len(scheme) > 1:  # a one-letter scheme is a Windows drive: a path
        raise ValueError(f"image_url {image_url[:60]!r}: takes a data: URI, an http(s):// or file:// URL, or a path")
    return image_url


class Llava15ChatHandler(MTMDChatHandler):
    """A Llava-style handler: the chat rendered with the handler's own template (``CHAT_FORMAT``, Jinja2:
    the ``llama-cpp`` extra), after ``DEFAULT_SYSTEM_MESSAGE`` where the chat has no system message, each
    picture's URL where it goes, then answered as a completion of that prompt and its pictures, as
    llama-cpp-python 0.3.36's handlers do (their templates and messages are copied: MIT)."""

    DEFAULT_SYSTEM_MESSAGE: str | None = (
        'A chat between a curious human and an artificial intelligence assistant. '
        "The assistant gives helpful, detailed, and polite answers to the human's questions."
    )
    CHAT_FORMAT = (
        '{% for message in messages %}'
        "{% if message.role == 'system' %}{{ message.content }}"
        '{% endif %}'
        "{% if message.role == 'user' %}"
        '{% if message.content is string %}\nUSER: {{ message.content }}'
        '{% endif %}'
        '{% if message.content is iterable %}\nUSER: '
        '{% for content in message.content %}'
        "{% if content.type == 'image_url' and content.image_url is string %}{{ content.image_url }}"
        '{% endif %}'
        "{% if content.type == 'image_url' and content.image_url is mapping %}{{ content.image_url.url }}"
        '{% endif %}'
        '{% endfor %}'
        '{% for content in message.content %}'
        "{% if content.type == 'text' %}{{ content.text }}"
        '{% endif %}'
        '{% endfor %}'
        '{% endif %}'
        '{% endif %}'
        "{% if message.role == 'assistant' and message.content is not none %}\nASSISTANT: {{ message.content }}"
        '{% endif %}'
        '{% endfor %}'
        '{% if add_generation_prompt %}\nASSISTANT: '
        '{% endif %}'
    )

    def render(self, messages: list, bos_token: str, eos_token: str) -> tuple[str, list[str]]:
        """The prompt this handler makes of ``messages`` (each picture's URL replaced by the media marker),
        and the pictures' URLs in their order."""
        from pyllama_spec.serving.chat_template import MEDIA_MARKER

        first_system = next((m.get("content") or "" for m in messages if m.get("role") == "system"), "")
        if first_system == "" and self.DEFAULT_SYSTEM_MESSAGE is not None:
            messages = [{"role": "system", "content": self.DEFAULT_SYSTEM_MESSAGE}, *messages]
        urls = self.get_image_urls(messages)
        text = _jinja_environment().from_string(self.CHAT_FORMAT).render(
            messages=messages, add_generation_prompt=True, eos_token=eos_token, bos_token=bos_token)
        for url in urls:
            text = text.replace(url, MEDIA_MARKER)
        return text, urls

    @staticmethod
    def get_image_urls(messages: list) -> list[str]:
        """The URLs of the user messages' ``image_url`` parts, in order."""
        urls = []
        for message in messages:
            if message["role"] == "user" and message["content"] is not None:
                for part in message["content"]:
                    if isinstance(part, dict) and part.get("type") == "image_url":
                        image = part["image_url"]
                        urls.append(image["url"] if isinstance(image, dict) and "url" in image else image)
        return urls


class Llava16ChatHandler(Llava15ChatHandler):
    DEFAULT_SYSTEM_MESSAGE = (
        'A chat between a curious human and an artificial intelligence assistant. '
        "The assistant gives helpful, detailed, and polite answers to the human's questions. "
    )
    CHAT_FORMAT = (
        '{% for message in messages %}'
        "{% if message.role == 'system' %}{{ message.content }}"
        '{% endif %}'
        "{% if message.role == 'user' %}"
        '{% if message.content is iterable %}'
        '{% for content in message.content %}'
        "{% if content.type == 'image_url' %}"
        '{% if content.image_url is string %}{{ content.image_url }}\n'
        '{% endif %}'
        '{% if content.image_url is mapping %}{{ content.image_url.url }}\n'
        '{% endif %}'
        '{% endif %}'
        '{% endfor %}'
        '{% for content in message.content %}'
        "{% if content.type == 'text' %}{{ content.text }}"
        '{% endif %}'
        '{% endfor %}'
        '{% endif %}'
        '{% if message.content is string %}{{ message.content }}'
        '{% endif %}'
        '{% endif %}'
        "{% if message.role == 'assistant' %}{{ message.content }}"
        '{% endif %}'
        '{% endfor %}'
        '{% if add_generation_prompt %}Answer:'
        '{% endif %}'
    )


class ObsidianChatHandler(Llava15ChatHandler):
    CHAT_FORMAT = (
        '{% for message in messages %}'
        "{% if message.role == 'system' %}<|im_start|>system\n{{ message.content }}\n###\n"
        '{% endif %}'
        "{% if message.role == 'user' %}<|im_start|>user\n"
        '{% if message.content is string %}{{ message.content }}'
        '{% endif %}'
        '{% if message.content is iterable %}'
        '{% for content in message.content %}'
        "{% if content.type == 'image_url' and content.image_url is string %}{{ content.image_url }}"
        '{% endif %}'
        "{% if content.type == 'image_url' and content.image_url is mapping %}{{ content.image_url.url }}"
        '{% endif %}'
        '{% endfor %}'
        '{% for content in message.content %}'
        "{% if content.type == 'text' %}{{ content.text }}"
        '{% endif %}'
        '{% endfor %}'
        '{% endif %}###\n'
        '{% endif %}'
        "{% if message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}###\n"
        '{% endif %}'
        '{% endfor %}'
        '{% if add_generation_prompt %}<|im_start|>assistant\n'
        '{% endif %}'
    )


class MoondreamChatHandler(Llava15ChatHandler):
    CHAT_FORMAT = (
        '{% for message in messages %}'
        "{% if message.role == 'user' %}"
        '{% if message.content is iterable %}'
        '{% for content in message.content %}'
        "{% if content.type == 'image_url' %}"
        '{% if content.image_url is string %}{{ content.image_url }}\n\n'
        '{% endif %}'
        '{% if content.image_url is mapping %}{{ content.image_url.url }}\n\n'
        '{% endif %}'
        '{% endif %}'
        '{% endfor %}'
        '{% for content in message.content %}'
        "{% if content.type == 'text' %}Question: {{ content.text }}\n\n"
        '{% endif %}'
        '{% endfor %}'
        '{% endif %}'
        '{% if message.content is string %}Question: {{ message.content }}\n\n'
        '{% endif %}'
        '{% endif %}'
        "{% if message.role == 'assistant' %}Answer:{{ message.content }}\n\n"
        '{% endif %}'
        '{% endfor %}'
        '{% if add_generation_prompt %}Answer:'
        '{% endif %}'
    )


class NanoLlavaChatHandler(Llava15ChatHandler):
    DEFAULT_SYSTEM_MESSAGE = 'Answer the question'
    CHAT_FORMAT = (
        '{% for message in messages %}'
        "{% if message.role == 'system' %}<|im_start|>system\n{{ message.content }}<|im_end|>"
        '{% endif %}'
        "{% if message.role == 'user' %}<|im_start|>user\n"
        '{% if message.content is string %}{{ message.content }}'
        '{% endif %}'
        '{% if message.content is iterable %}'
        '{% for content in message.content %}'
        "{% if content.type == 'image_url' and content.image_url is string %}{{ content.image_url }}"
        '{% endif %}'
        "{% if content.type == 'image_url' and content.image_url is mapping %}{{ content.image_url.url }}"
        '{% endif %}'
        '{% endfor %}'
        '{% for content in message.content %}'
        "{% if content.type == 'text' %}{{ content.text }}"
        '{% endif %}'
        '{% endfor %}'
        '{% endif %}<|im_end|>'
        '{% endif %}'
        "{% if message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}<|im_end|>"
        '{% endif %}'
        '{% endfor %}'
        '{% if add_generation_prompt %}<|im_start|>assistant\n'
        '{% endif %}'
    )


class Llama3VisionAlphaChatHandler(Llava15ChatHandler):
    DEFAULT_SYSTEM_MESSAGE = None
    CHAT_FORMAT = (
        '{% for message in messages %}<|start_header_id|>'
        "{% if message.role == 'user' %}user<|end_header_id|>\n\n"
        '{% if message.content is iterable %}'
        '{% for content in message.content %}'
        "{% if content.type == 'image_url' %}"
        '{% if content.image_url is string %}{{ content.image_url }}'
        '{% endif %}'
        '{% if content.image_url is mapping %}{{ content.image_url.url }}'
        '{% endif %}'
        '{% endif %}'
        '{% endfor %}'
        '{% for content in message.content %}'
        "{% if content.type == 'text' %}{{ content.text }}"
        '{% endif %}'
        '{% endfor %}'
        '{% endif %}'
        '{% if message.content is string %}{{ message.content }}'
        '{% endif %}'
        '{% endif %}'
        "{% if message.role == 'assistant' %}assistant<|end_header_id|>\n\n{{ message.content }}"
        '{% endif %}<|eot_id|>'
        '{% endfor %}'
        '{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n'
        '{% endif %}'
    )


class MiniCPMv26ChatHandler(Llava15ChatHandler):
    DEFAULT_SYSTEM_MESSAGE = 'You are a helpful assistant.'
    CHAT_FORMAT = (
        '{% for message in messages %}'
        "{% if loop.first and messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "{% endif %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is iterable %}"
        "{% for content in message['content'] %}"
        "{% if content.type == 'image_url' %}"
        '{% if content.image_url is string %}{{ content.image_url }}'
        '{% endif %}'
        '{% if content.image_url is mapping %}{{ content.image_url.url }}'
        '{% endif %}'
        '{% endif %}'
        '{% endfor %}'
        "{% for content in message['content'] %}"
        "{% if content.type == 'text' %}{{ content.text }}"
        '{% endif %}'
        '{% endfor %}'
        '{% endif %}'
        "{% if message['content'] is string %}{{ message['content'] }}"
        '{% endif %}<|im_end|>\n'
        '{% endfor %}'
        '{% if add_generation_prompt %}<|im_start|>assistant\n'
        '{% endif %}'
    )


class Qwen25VLChatHandler(Llava15ChatHandler):
    DEFAULT_SYSTEM_MESSAGE = 'You are a helpful assistant.'
    CHAT_FORMAT = (
        '{% for message in messages %}'
        "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n{{ self.DEFAULT_SYSTEM_MESSAGE }}<|im_end|>\n"
        "{% endif %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
        '{% else %}'
        "{% for content in message['content'] %}"
        "{% if content['type'] == 'image_url' %}"
        '{% if content.image_url is string %}{{ content.image_url }}'
        '{% else %}{{ content.image_url.url }}'
        '{% endif %}'
        "{% elif content['type'] == 'text' %}{{ content['text'] }}"
        '{% endif %}'
        '{% endfor %}<|im_end|>\n'
        '{% endif %}'
        '{% endfor %}<|im_start|>assistant\n'
    )


class Gemma4ChatHandler(MTMDChatHandler):
    pass


# ---------------------------------------------------------------------- llama-cpp-python's chat formatters
# (its llama_chat_format.py, MIT: the same renderings, so prompts built by hand come out the same)

def _jinja_environment(**kwargs: Any):
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ImportError("llama-cpp-python's chat formatters render with Jinja2: "
                          "pip install 'pyllama-spec[llama-cpp]'") from e
    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, **kwargs)


class Jinja2ChatFormatter:
    """A Hugging Face chat template rendered as llama-cpp-python renders it."""

    def __init__(self, template: str, eos_token: str, bos_token: str, add_generation_prompt: bool = True,
                 stop_token_ids: list[int] | None = None) -> None:
        import jinja2.ext
        from jinja2.ext import Extension

        class IgnoreGenerationTags(Extension):  # Hugging Face's {% generation %} tag, passed through
            tags = {"generation"}

            def parse(self, parser):
                parser.stream.skip(1)
                return parser.parse_statements(("name:endgeneration",), drop_needle=True)

        self.template, self.eos_token, self.bos_token = template, eos_token, bos_token
        self.add_generation_prompt = add_generation_prompt
        self.stop_token_ids = set(stop_token_ids) if stop_token_ids is not None else None
        environment = _jinja_environment(extensions=[IgnoreGenerationTags, jinja2.ext.loopcontrols])
        environment.filters["tojson"] = self.tojson
        self._environment = environment.from_string(template)

    @staticmethod
    def strftime_now(f: str) -> str:
        return datetime.now().strftime(f)

    @staticmethod
    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def __call__(self, *, messages: list, functions=None, function_call=None, tools=None, tool_choice=None,
                 **kwargs: Any) -> ChatFormatterResponse:
        def raise_exception(message: str):
            raise ValueError(message)

        prompt = self._environment.render(messages=messages, eos_token=self.eos_token, bos_token=self.bos_token,
                                          raise_exception=raise_exception,
                                          add_generation_prompt=self.add_generation_prompt, functions=functions,
                                          function_call=function_call, tools=tools, tool_choice=tool_choice,
                                          strftime_now=self.strftime_now, **kwargs)
        stopping_criteria = None
        if self.stop_token_ids is not None:
            from pyllama_spec.llama_cpp.llama_hooks import StoppingCriteriaList

            stop_ids = self.stop_token_ids
            stopping_criteria = StoppingCriteriaList([lambda tokens, logits: tokens[-1] in stop_ids])
        return ChatFormatterResponse(prompt=prompt, stop=[self.eos_token], stopping_criteria=stopping_criteria,
                                     added_special=True)


def hf_tokenizer_config_to_chat_formatter(tokenizer_config: dict[str, Any], add_generation_prompt: bool = True):
    """A formatter of a Hugging Face ``tokenizer_config.json``'s chat template, as llama-cpp-python makes it."""
    for key in ("chat_template", "bos_token", "eos_token"):
        if not isinstance(tokenizer_config.get(key), str):
            raise ValueError(f"the tokenizer config needs a string {key!r}")
    env = _jinja_environment().from_string(tokenizer_config["chat_template"])
    bos, eos = tokenizer_config["bos_token"], tokenizer_config["eos_token"]

    def format_tokenizer_config(messages: list, **kwargs: Any) -> ChatFormatterResponse:
        if add_generation_prompt:  # llama-cpp-python's way: a blank assistant message at the end
            messages = [*messages, {"role": "assistant", "content": ""}]
        prompt = env.render(messages=messages, bos_token=bos, eos_token=eos, **kwargs)
        return ChatFormatterResponse(prompt=prompt, stop=[eos, bos], added_special=True)

    return format_tokenizer_config
