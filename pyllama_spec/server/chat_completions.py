"""OpenAI's chat completions: ``POST /v1/chat/completions``, and ``/chat/completions`` as
llama-server serves it too. The body is checked by ``schema.parse_chat``, the chat rendered
through the model's template (server/chat.py: tools, reasoning), and the answer is OpenAI's
chat.completion, or chat.completion.chunk server-sent events (generation.py).
"""

from __future__ import annotations

from pyllama_spec.server.generation import generation
from pyllama_spec.server.schema import parse_chat
from pyllama_spec.server.service import RouteSpec, Service


def routes(service: Service) -> list[RouteSpec]:
    """The route under its /v1/ and un-prefixed names, as llama-server serves it."""

    def handler(request):
        return generation(service, request, parse_chat)

    return [(p, ["POST"], handler) for p in ("/v1/chat/completions", "/chat/completions")]
