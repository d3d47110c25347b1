"""Text completions: OpenAI's ``POST /v1/completions`` (a text_completion, or its chunks), and
llama-server's own ``/completion`` (also ``/completions``), answered in llama-server's shape (its
fields, its final body: server/llama_fields.py). Both are checked by ``schema.parse_completion``
and answered by generation.py; ``/infill`` (server/infill.py) answers as /completion does.
"""

from __future__ import annotations

from pyllama_spec.server.generation import generation
from pyllama_spec.server.schema import parse_completion
from pyllama_spec.server.service import RouteSpec, Service


def routes(service: Service) -> list[RouteSpec]:
    """OpenAI's /v1/completions, then llama-server's /completion and /completions (its shape)."""

    def llama_completion(body, limits):
        return parse_completion(body, limits, llama_style=True)

    def handler(parse):
        return lambda request: generation(service, request, parse)

    return [
        ("/v1/completions", ["POST"], handler(parse_completion)),
        *((p, ["POST"], handler(llama_completion)) for p in ("/completion", "/completions")),
    ]
