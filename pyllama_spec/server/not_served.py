"""llama-server's embedding and reranking routes, which a generation server does not serve: each
answers what llama-server answers when started without --embeddings / --reranking (a 501
``not_supported_error`` with its message, before the body is read), so a client sees the same error.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from pyllama_spec.server.errors import APIError
from pyllama_spec.server.service import RouteSpec, Service

EMBEDDING_PATHS = ("/embedding", "/embeddings", "/v1/embeddings")
RERANK_PATHS = ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking")


def routes(service: Service) -> list[RouteSpec]:
    def refuse(message: str):
        async def handler(request: Request) -> Response:
            raise APIError(501, message, type="not_supported_error", code="not_supported")

        return handler

    embeddings = refuse("This server does not support embeddings. Start it with `--embeddings`")
    rerank = refuse("This server does not support reranking. Start it with `--reranking`")
    return [*((p, ["POST"], embeddings) for p in EMBEDDING_PATHS), *((p, ["POST"], rerank) for p in RERANK_PATHS)]
