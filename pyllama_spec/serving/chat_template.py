"""A GGUF's own Jinja chat template (``tokenizer.chat_template``), rendered as Hugging Face
renders it, in a sandbox.

llama.cpp's ``llama_chat_apply_template`` recognises a list of well-known templates and
writes its own approximation of them; the real template knows more (Qwen3's thinking
switch, system-prompt defaults, image parts, tools). This renders the real one with
jinja2's immutable sandbox and the helpers HF templates call (``raise_exception``,
``strftime_now``, a ``tojson`` that keeps non-ASCII text), with ``add_generation_prompt``,
``bos_token``/``eos_token`` and any extra variables a template reads (``enable_thinking``).

Image parts reach the template as text parts holding the media marker, as llama-server
passes them, so the marker lands where the template puts the part's text and mtmd wraps
it with the model's own vision tokens.

Pure Python (jinja2): nothing native here.
"""

from __future__ import annotations

import datetime
import json
from typing import Any, Mapping, Sequence


class TemplateRenderError(ValueError):
    """The template could not be rendered (a syntax error, or it raised on these messages)."""


class _RaisedByTemplate(Exception):
    pass


#: The names the render path sets itself, which extra variables cannot: ``render``'s own
#: parameters, the variables it gives every template, the helper functions templates call,
#: and ``self`` (jinja2's ``Template.render(self, ...)``).
RESERVED_VARIABLES = frozenset({"template", "messages", "add_generation_prompt", "bos_token", "eos_token",
                                "media_marker", "tools", "raise_exception", "strftime_now", "self"})


def check_variables(variables: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` (not a ``TemplateRenderError``: there is nothing to fall back from) when
    extra template variables have a name that is not a string or that the renderer sets itself."""
    for key in variables:
        if not isinstance(key, str):
            raise ValueError(f"chat template variable names must be strings, got {key!r}")
        if key in RESERVED_VARIABLES:
            raise ValueError(f"chat template variable {key!r} is set by the renderer; it cannot be passed as an "
                             f"extra variable (reserved: {', '.join(sorted(RESERVED_VARIABLES))})")


def _raise_exception(message: str):
    raise _RaisedByTemplate(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


_ENVIRONMENTS: dict[str, Any] = {}


def _generation_tag():
    """A jinja2 extension for ``{% generation %}...{% endgeneration %}``: Hugging Face's tag that
    marks the assistant's tokens for training masks (LFM2.5, poolside Laguna, ...). A prompt has
    no use for the mask, so the block renders its body unchanged, as transformers' own
    AssistantTracker does when no mask is asked for."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return GenerationTag


def _compiled(template: str):
    """The compiled template (cached: a server renders the same one for every request)."""
    if template not in _ENVIRONMENTS:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols", _generation_tag()])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            _ENVIRONMENTS[template] = env.from_string(template)
        except TemplateError as e:
            raise TemplateRenderError(f"the chat template does not compile: {e}") from e
    return _ENVIRONMENTS[template]


def render(template: str, messages: Sequence[Mapping[str, Any]], /, *, add_generation_prompt: bool = True,
           bos_token: str = "", eos_token: str = "", media_marker: str, **variables: Any) -> str:
    """Render ``messages`` (text content, or lists of text / image parts) through ``template``.

    Image parts (``{"type": "image", ...}``) become ``{"type": "text", "text": media_marker}``.
    Raises ``TemplateRenderError`` when the template fails or raises on these messages (or on
    the values of ``variables``), and ``ValueError`` when ``variables`` names one of the
    ``RESERVED_VARIABLES``.
    """
    from jinja2 import TemplateError

    check_variables(variables)

    prepared = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = [{"type": "text", "text": media_marker} if p.get("type") in ("image", "image_url") else dict(p)
                       for p in content]
        prepared.append({**m, "content": content})
    compiled = _compiled(template)
    # one dict, not keywords: no variable name can collide with a parameter of Template.render
    context = {**variables, "messages": prepared, "add_generation_prompt": add_generation_prompt,
               "bos_token": bos_token, "eos_token": eos_token, "tools": None}
    try:
        return compiled.render(context)
    except _RaisedByTemplate as e:
        raise TemplateRenderError(f"the chat template refused these messages: {e}") from e
    # what a template can raise on values it was not written for (10 // 0, a list compared with
    # an int, a string repeated a huge number of times, a deep recursion)
    except (TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError, RecursionError,
            MemoryError) as e:
        raise TemplateRenderError(f"the chat template failed to render: {type(e).__name__}: {e}") from e
