"""llama-server's reranking routes, which this server does not serve: each answers what
llama-server answers when started without --reranking (a 501 ``not_supported_error`` with its
message, before the body is read), so a client sees the same error. (The embedding routes are
server/embeddings.py's.)
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from pyllama_spec.server.errors import APIError
from pyllama_spec.server.service import RouteSpec, Service

RERANK_PATHS = ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking")


def routes(service: Service) -> list[RouteSpec]:
    async def rerank(request: Request) -> Response:
        raise APIError(501, "This server does not support reranking. Start it with `--reranking`",
                       type="not_supported_error", code="not_supported")

    return [(p, ["POST"], rerank) for p in RERANK_PATHS]
