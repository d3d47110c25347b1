"""An OpenAI-compatible HTTP server over one Engine (the optional extra ``server``).

>>> from pyllama_spec.server import create_app, ServerSettings        # doctest: +SKIP
>>> app = create_app(ps.load("t.gguf", mmproj="m.gguf", draft="d.gguf"), ServerSettings(alias="vlm"))

``pyllama-spec serve`` runs it with uvicorn. Routes (each under llama-server's paths too): ``POST /v1/chat/completions``,
``POST /v1/completions``, ``POST /completion`` (llama-server's), ``GET /v1/models``,
``GET /health``, ``GET /props``, ``GET /metrics``, and the chat page at ``GET /``
(``static/``).
"""

from __future__ import annotations

try:
    import sse_starlette  # noqa: F401
    import starlette  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("the server needs the 'server' extra: pip install 'pyllama-spec[server]'") from e

from pyllama_spec.server.app import ServerSettings, create_app

__all__ = ["ServerSettings", "create_app"]
