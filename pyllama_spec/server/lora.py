"""llama-server's LoRA routes: ``GET /lora-adapters`` lists the adapters loaded with ``--lora`` /
``--lora-scaled`` (id, path as given, global scale, the file's task_name and prompt_prefix);
``POST /lora-adapters`` sets the global scales (``[{"id": 0, "scale": 0.5}]``; an adapter not
listed gets 0) and answers ``{"success": true}``. A request's own ``lora`` field overrides
the global scales for that request (schema.py; the engine's side is serving/lora.py).

Both routes read and replace Python values only (the engine reads the global scales when a
generation starts), so they run on the event loop, beside a running generation.

Where this differs from llama-server (tools/server/server-context.cpp): an entry that is not
an object with an integer ``id`` of a loaded adapter and a finite ``scale`` is a 400 here
(llama-server skips an unknown id and reads a bad scale as 0); a body that is not JSON is a
400 (a 500 there).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pyllama_spec.server.errors import bad_request
from pyllama_spec.server.schema import parse_lora
from pyllama_spec.server.service import RouteSpec, Service, read_json


def routes(service: Service) -> list[RouteSpec]:
    """GET and POST /lora-adapters, as llama-server serves them."""
    return [
        ("/lora-adapters", ["GET"], lambda r: _list(service)),
        ("/lora-adapters", ["POST"], lambda r: _set(service, r)),
    ]


async def _list(service: Service) -> Response:
    return JSONResponse(service.engine.lora.info())


async def _set(service: Service, request: Request) -> Response:
    body, _ = await read_json(request, service.settings.max_body_bytes, service.settings.body_timeout)
    if not isinstance(body, list):
        raise bad_request("Request body must be an array")  # llama-server's words
    service.engine.lora.set_scales(parse_lora(body, len(service.engine.lora), "body"))
    return JSONResponse({"success": True})
