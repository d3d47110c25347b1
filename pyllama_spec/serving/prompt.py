"""Turning chat messages into prompt text (the model's chat template) and collecting their images."""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping, Sequence

from pyllama_spec.bindings.model import Model
from pyllama_spec.bindings.mtmd import MEDIA_MARKER
from pyllama_spec.serving import chat_template
from pyllama_spec.serving.chat_template import TemplateRenderError

log = logging.getLogger("pyllama_spec")

Message = Mapping[str, Any]


def normalize_content(content: Any) -> tuple[Any, list[Any]]:
    """A message's content as parts (``text`` parts and ``{"type": "image"}`` placeholders, in
    order) and its images; a string stays a string.

    ``content`` is a string, or a list of parts: ``{"type": "text", "text": ...}`` and
    ``{"type": "image", "image": path | bytes | PIL image}`` (also ``image_url`` with a
    local path, and ``media_marker`` parts as llama-server sends them).
    """
    if isinstance(content, str):
        return content, []
    parts, images = [], []
    for part in content:
        kind = part.get("type", "text")
        if kind == "text":
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == "media_marker":
            parts.append({"type": "text", "text": MEDIA_MARKER})
        elif kind in ("image", "image_url"):
            ref = part.get("image") if kind == "image" else part.get("image_url")
            if isinstance(ref, Mapping):
                ref = ref.get("url")
            if isinstance(ref, str) and ref.startswith("file://"):
                ref = ref[len("file://"):]
            parts.append({"type": "image"})
            images.append(ref)
        else:
            raise ValueError(f"unsupported message part type {kind!r}")
    return parts, images


def _flat_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(MEDIA_MARKER if p["type"] == "image" else p["text"] for p in content)


def render_messages(model: Model, messages: Sequence[Message], *, add_assistant: bool = True,
                    template_kwargs: Mapping[str, Any] | None = None,
                    template: str | None = None, jinja: bool = True) -> tuple[str, list, str]:
    """The prompt text, the images in marker order, and which renderer made the text.

    The model's own Jinja template is rendered first ("jinja"); when the model has none that
    jinja2 can render, or it fails on these messages, llama.cpp's built-in renderer is used
    ("builtin") and a warning says why. ``template_kwargs`` are extra variables the template
    may read (for example ``enable_thinking=False`` for Qwen3); one that names a variable the
    renderer sets itself (``chat_template.RESERVED_VARIABLES``) raises ``ValueError``.

    ``template`` replaces the model's (llama-server's --chat-template): Jinja text, rendered as
    the model's would be, or the name of a llama.cpp built-in template ("chatml", "llama3", ...),
    which llama.cpp renders ("builtin"); a name llama.cpp does not know raises ``ValueError``.
    ``jinja=False`` (llama-server's --no-jinja): llama.cpp's renderer, whatever the template.
    """
    chat_template.check_variables(template_kwargs or {})  # a ValueError: no fallback for a wrong call
    turns, images = [], []
    for m in messages:
        if "role" not in m or "content" not in m:
            raise ValueError(f"a message needs 'role' and 'content', got keys {sorted(m)}")
        content, imgs = normalize_content(m["content"])
        turns.append({"role": str(m["role"]), "content": content})
        images.extend(imgs)
    builtin = None  # what llama.cpp's renderer gets: a built-in's name, template text, or the model's
    if template is not None and (not jinja or not is_jinja(template)):
        builtin, template = template, None
    elif template is None:
        template = model.chat_template if jinja else None
    else:
        builtin = template  # an override that jinja2 cannot render: llama.cpp reads the same text
    if template is not None:
        try:
            text = _render_jinja(model, template, turns, add_assistant, dict(template_kwargs or {}))
            if text.count(MEDIA_MARKER) == len(images):
                return text, images, "jinja"
            reason = f"it placed {text.count(MEDIA_MARKER)} of {len(images)} images"
        except (ImportError, TemplateRenderError) as e:
            reason = str(e)
        whose = "the --chat-template template" if builtin is not None else "the model's own template"
        log.warning("using llama.cpp's built-in chat template for %s: %s %s", model.path.name, whose,
                    reason if reason.startswith("it ") else f"did not render ({reason})")
    text = model.apply_chat_template([(t["role"], _flat_text(t["content"])) for t in turns],
                                     add_assistant=add_assistant, template=builtin)
    return text, images, "builtin"


def is_jinja(template: str) -> bool:
    """Jinja text rather than the name of a built-in template (llama-server tells them apart so)."""
    return "{%" in template or "{{" in template


def _render_jinja(model: Model, template: str, turns: list, add_assistant: bool, variables: dict) -> str:
    bos = model.token_text(model.bos) if model.bos >= 0 else ""
    eos = model.token_text(model.eos) if model.eos >= 0 else ""
    text = chat_template.render(template, turns, add_generation_prompt=add_assistant, bos_token=bos, eos_token=eos,
                                media_marker=MEDIA_MARKER, **variables)
    if bos and model.add_bos and text.startswith(bos):
        text = text[len(bos):]  # the tokenizer adds BOS itself: do not start with two
    return text


def as_list(images: Iterable[Any] | None) -> list[Any]:
    """One image (a path, bytes, a PIL image or an array) or several, as a list."""
    import numpy as np

    if images is None:
        return []
    if isinstance(images, (str, bytes, np.ndarray)) or not hasattr(images, "__iter__"):
        return [images]
    return list(images)
