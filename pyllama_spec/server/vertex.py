"""Vertex AI's custom-container protocol, as llama-server serves it (its Google Cloud compatibility).

With ``AIP_MODE=PREDICTION`` in the environment (Vertex AI sets it in a custom container):

* ``POST $AIP_PREDICT_ROUTE`` (default ``/predict``) takes ``{"instances": [...]}``, at most 128, each
  a route's JSON body plus ``"@requestFormat"``: the route as a path (``/v1/chat/completions``) or its
  camelCase alias (``chatCompletions``: the path without ``/v1``, each ``/``, ``-`` or ``_`` starting
  a capital). The instances run at once, each as its route answers it (``stream`` forced off), and
  the answer is ``{"predictions": [...]}``: each route's JSON body in the instances' order, an error
  object for an instance that failed (llama-server's per-instance errors; the request itself is 200);
* ``GET $AIP_HEALTH_ROUTE``, when set, answers as ``/health``;
* ``$AIP_HTTP_PORT`` (default 8080) is the port, over ``--port`` (the CLI warns when they differ).

Every instance passes the predict request's headers and query string on (its API key among them) and
ends when the client of the predict request goes away. An instance names a route that answers JSON
(not the page, not a route with a path parameter); each is its own request to its route, with that
route's limits (the images of each, say), handed its part of the parsed prediction (never encoded and
parsed again); a long answer is read back off the event loop. A router serves no prediction route: its models do not
inherit these variables.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Any, Callable, Mapping

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pyllama_spec.server import large_bodies
from pyllama_spec.server.errors import APIError, bad_request
from pyllama_spec.server.json_body import parse_json_body, takes_steps
from pyllama_spec.server.offload import off_loop

#: The most instances one prediction request may hold (llama-server's limit).
MAX_INSTANCES = 128

RouteSpec = tuple[str, list[str], Callable]
#: Where an instance's request carries its body, parsed, and a bound of its size (the prediction's):
#: service.read_json returns it, so an instance is neither encoded again nor parsed again.
INSTANCE_BODY = "pyllama_spec.vertex.instance_body"


@dataclasses.dataclass(frozen=True)
class VertexSettings:
    predict_route: str = "/predict"
    health_route: str = ""  # "" : /health only
    port: int = 8080

    @classmethod
    def from_environ(cls, env: Mapping[str, str] = os.environ) -> "VertexSettings | None":
        """The settings Vertex AI gives a container, or None outside its prediction mode. ValueError
        for a port that is not a number."""
        if env.get("AIP_MODE", "") != "PREDICTION":
            return None
        port = env.get("AIP_HTTP_PORT") or "8080"
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"AIP_HTTP_PORT must be a port number, got {port!r}")
        return cls(predict_route=_route(env.get("AIP_PREDICT_ROUTE")) or "/predict",
                   health_route=_route(env.get("AIP_HEALTH_ROUTE")), port=int(port))


def _route(value: str | None) -> str:
    """An AIP_*_ROUTE value with its leading slash ("" when unset or empty)."""
    if not value:
        return ""
    return value if value.startswith("/") else "/" + value


def request_format(path: str) -> str:
    """The camelCase name of a route: "/v1/chat/completions" -> "chatCompletions",
    "/apply-template" -> "applyTemplate" (llama-server's path_to_gcp_format)."""
    path = path.removeprefix("/v1") if len(path) > 3 else path
    out, capital = [], False
    for c in path.removeprefix("/"):
        if c == ":" or c == "{":  # a path parameter ends it
            break
        if c in "/-_":
            capital = True
        else:
            out.append(c.upper() if capital else c)
            capital = False
    return "".join(out)


def routes(settings: VertexSettings, served: list[RouteSpec], read_body: Callable,
           as_error: Callable[[Exception], APIError]) -> list[RouteSpec]:
    """The prediction route (and the health alias) over the routes ``served``; ``read_body(request)``
    reads a request's JSON body and its size within the server's limits, ``as_error(e)`` is what the app answers
    for an exception of a route. ValueError when AIP_PREDICT_ROUTE is a route already served
    (llama-server refuses to start too)."""
    served_paths = {path for path, _, _ in served}
    if settings.predict_route in served_paths:
        raise ValueError(f"AIP_PREDICT_ROUTE={settings.predict_route} is a route this server already serves")
    health = settings.health_route if settings.health_route not in ("/health", "/v1/health") else ""
    if health in (*served_paths, settings.predict_route):
        raise ValueError(f"AIP_HEALTH_ROUTE={health} is a route this server already serves")
    # What an instance may name: the routes answering JSON, without path parameters (the page at / and
    # /slots/{id} are not), by path and by camelCase name; the first route of a path or name, as
    # llama-server (a path's GET comes before its POST: "props" reads the properties)
    handlers: dict[str, Callable] = {}
    for path, _, handler in served:
        if path != "/" and "{" not in path:
            handlers.setdefault(path, handler)
    by_format: dict[str, Callable] = {}
    for path, handler in handlers.items():
        by_format.setdefault(request_format(path), handler)

    async def predict(request: Request) -> Response:
        body, size = await read_body(request)
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        instances = body.get("instances")
        if not isinstance(instances, list):
            raise bad_request("request body must include an array field named instances", "instances")
        if len(instances) > MAX_INSTANCES:
            raise bad_request(f"instances array exceeds maximum size of {MAX_INSTANCES}", "instances")
        predictions = await asyncio.gather(*(_predict_one(request, i, size, handlers, by_format, as_error)
                                             for i in instances))
        return JSONResponse({"predictions": predictions})

    out: list[RouteSpec] = [(settings.predict_route, ["POST"], predict)]
    if health:  # (/health itself needs no alias)
        out.append((health, ["GET"], handlers["/health"]))
    return out


async def _predict_one(outer: Request, instance: Any, size: int, handlers: dict, by_format: dict,
                       as_error: Callable) -> Any:
    """One instance's answer: its route's JSON body, or an error object. ``size``: the prediction's body
    size, which bounds the instance's (the route decides from it what to do off the event loop)."""
    if not isinstance(instance, dict):
        return _error(bad_request("each instance must be a JSON object"))
    name = instance.get("@requestFormat")
    if not isinstance(name, str):
        return _error(bad_request("each instance must include a string @requestFormat"))
    handler = by_format.get(name) or handlers.get(name)
    if handler is None:
        return _error(bad_request(f"no handler registered for @requestFormat: {name}"))
    payload = {k: v for k, v in instance.items() if k != "@requestFormat"}
    if "stream" in payload:
        payload["stream"] = False  # a prediction is one JSON value
    try:
        response = await handler(_inner_request(outer, payload, size))
    except Exception as e:  # noqa: BLE001 - as the app answers it on the route itself
        return _error(as_error(e))
    raw = getattr(response, "body", None)
    if isinstance(response, StreamingResponse) or not isinstance(raw, (bytes, bytearray)):
        return _error(bad_request("predict route does not support streaming responses"))
    if not raw:
        return None
    try:  # a long answer (a million token ids) is read in steps, on a thread
        return await off_loop(takes_steps(raw), parse_json_body, raw)
    except APIError:
        return raw.decode("utf-8", errors="replace")


def _error(e: APIError) -> dict:
    return e.body()


def _inner_request(outer: Request, payload: dict, size: int) -> Request:
    """A POST carrying ``payload`` parsed (``INSTANCE_BODY``) with the outer request's headers: it
    hears what the outer request hears, the client's going away. The payload is part of the outer
    body, whose large-body bookkeeping stays the outer request's (the app frees it after this route)."""
    scope = {k: v for k, v in outer.scope.items() if k != large_bodies.SCOPE_KEY}
    scope["method"] = "POST"  # (the query string passed on, as llama-server)
    scope[INSTANCE_BODY] = (payload, size)
    return Request(scope, outer.receive)
