"""Turning chat messages into prompt text (the model's chat template) and collecting their images."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from .llama import Model
from .mtmd import MEDIA_MARKER

Message = Mapping[str, Any]


def split_message_content(content: Any) -> tuple[str, list[Any]]:
    """A message's text (with a media marker per image) and its images.

    ``content`` is a string, or a list of parts: ``{"type": "text", "text": ...}`` and
    ``{"type": "image", "image": path | bytes | PIL image}`` (also ``image_url`` with a
    local path, and ``media_marker`` parts as llama-server sends them).
    """
    if isinstance(content, str):
        return content, []
    text, images = [], []
    for part in content:
        kind = part.get("type", "text")
        if kind == "text":
            text.append(part.get("text", ""))
        elif kind == "media_marker":
            text.append(MEDIA_MARKER)
        elif kind in ("image", "image_url"):
            ref = part.get("image") if kind == "image" else part.get("image_url")
            if isinstance(ref, Mapping):
                ref = ref.get("url")
            if isinstance(ref, str) and ref.startswith("file://"):
                ref = ref[len("file://"):]
            text.append(MEDIA_MARKER)
            images.append(ref)
        else:
            raise ValueError(f"unsupported message part type {kind!r}")
    return "".join(text), images


def render_messages(model: Model, messages: Sequence[Message], *, add_assistant: bool = True) -> tuple[str, list]:
    """Apply the model's chat template; returns the prompt text and the images in marker order."""
    turns, images = [], []
    for m in messages:
        if "role" not in m or "content" not in m:
            raise ValueError(f"a message needs 'role' and 'content', got keys {sorted(m)}")
        text, imgs = split_message_content(m["content"])
        turns.append((str(m["role"]), text))
        images.extend(imgs)
    return model.apply_chat_template(turns, add_assistant=add_assistant), images


def as_list(images: Iterable[Any] | None) -> list[Any]:
    """One image (a path, bytes, a PIL image or an array) or several, as a list."""
    import numpy as np

    if images is None:
        return []
    if isinstance(images, (str, bytes, np.ndarray)) or not hasattr(images, "__iter__"):
        return [images]
    return list(images)
