"""Anthropic's Messages API, as llama-server serves it: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``.

A request is turned into an OpenAI chat body (``convert.chat_body``), read by the chat
route's own parser (``schema.parse_chat``: images, limits and sampling fields are checked the
same way) and run as a chat request; its answer (``generation.complete_body``) or its chunks
(``generation.stream_objects``) are turned back into Anthropic's message object or stream
events. count_tokens counts the prompt the chat route would feed the model, images included
(``tokens.chat_prompt``). Errors are answered in Anthropic's shape (``convert.error_body``,
which is also the OpenAI shape llama-server answers with). The differences from llama-server are
listed in ``convert``; one more here: a streamed request that fails before its first
token (a prompt longer than the context) is answered with its error status, as llama-server
does, but after the prompt is decoded rather than before (this server learns of it then).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, AsyncIterator

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pyllama_spec.server.anthropic import convert
from pyllama_spec.server.errors import APIError
from pyllama_spec.server.generation import (
    complete_body,
    error_of_chunk,
    event_data,
    first_translated,
    stream_objects,
)
from pyllama_spec.server.offload import PARSE_ON_A_THREAD_ABOVE, ThreadRunner, off_loop
from pyllama_spec.server.schema import GenerationRequest, RequestLimits, parse_chat
from pyllama_spec.server.service import (
    RouteSpec,
    Service,
    engine_error,
    read_json,
)
from pyllama_spec.server.tokens import chat_prompt
from pyllama_spec.server.worker import Job


def routes(service: Service) -> list[RouteSpec]:
    """The two routes, under llama-server's paths (it serves them under /v1/ only)."""
    run = ThreadRunner()
    return [
        ("/v1/messages", ["POST"], lambda request: _answered(_messages(service, request))),
        ("/v1/messages/count_tokens", ["POST"], lambda request: _answered(_count_tokens(service, request, run))),
    ]


async def _answered(work) -> Response:
    """The route's response, or its error in Anthropic's shape."""
    try:
        return await work
    except Exception as e:  # noqa: BLE001 - an APIError, or what engine_error makes of another
        error = engine_error(e)
        return JSONResponse(convert.error_body(error), status_code=error.status, headers=error.headers)


def parse_messages(body: Any, limits: RequestLimits) -> GenerationRequest:
    """An Anthropic Messages body as the chat route's request (a 400 for anything wrong in it,
    naming the Anthropic field or block at fault)."""
    chat = convert.chat_body(body)
    try:
        req = parse_chat(chat.body, limits)
    except APIError as e:
        raise chat.relocate(e) from None
    # message_start's usage needs the prompt counts, which chunks carry with timings_per_token
    return dataclasses.replace(req, options=dataclasses.replace(req.options, timings_per_token=True))


async def _messages(service: Service, request: Request) -> Response:
    body, size = await read_json(request, service.settings.max_body_bytes, service.settings.body_timeout)
    # images are decoded while parsing: off the event loop when large
    req = await off_loop(size > PARSE_ON_A_THREAD_ABOVE, parse_messages, body, service.limits)
    await service.prepare(req)  # the template renders the tools, tool results and reasoning
    jobs = service.submit(req)
    msg_id = convert.message_id()
    if not req.stream:
        completion = await complete_body(service, req, jobs, request)
        answer = convert.anthropic_message(completion, msg_id=msg_id, stop_sequence=_stop_sequence(jobs[0]))
        return JSONResponse(answer)
    stream = convert.MessageStream(msg_id, service.settings.alias)
    objects = stream_objects(service, req, jobs)
    try:
        first = await first_translated(objects, request,
                                       lambda chunk: stream.events(chunk, stop_sequence=_stop_sequence(jobs[0])))
    except BaseException:
        await objects.aclose()  # cancels the job
        raise
    return EventSourceResponse(_events(first, objects, stream, jobs[0]), ping=15)


def _stop_sequence(job: Job) -> str | None:
    """The stop string that ended the job's answer, if one did."""
    ending = job.ending
    return ending.stopping_word if ending is not None and ending.stop_type == "word" else None


async def _events(first: list, objects: AsyncIterator[dict], stream: convert.MessageStream,
                  job: Job) -> AsyncIterator[dict]:
    """Server-sent events ``event: <name>`` / ``data: <json>``; an error after the stream started
    is an ``error`` event (llama-server's), and ends it."""
    async with contextlib.aclosing(objects):  # the client going away closes this, and cancels the job
        for name, data in first:
            yield _sse(name, data)
        async for chunk in objects:
            if "error" in chunk:
                yield _sse("error", convert.error_body(error_of_chunk(chunk)))
                return
            for name, data in stream.events(chunk, stop_sequence=_stop_sequence(job)):
                yield _sse(name, data)


def _sse(name: str, data: dict) -> dict:
    return {"event": name, "data": event_data(data)}


async def _count_tokens(service: Service, request: Request, run: ThreadRunner) -> Response:
    """llama-server's count: ``{"input_tokens": n}``, the rows of the prompt the chat route would
    decode for this request (its chat template applied, each image its projector's rows)."""
    body, size = await read_json(request, service.settings.max_body_bytes, service.settings.body_timeout)

    def count() -> Response:
        chat = convert.chat_body(body, need_max_tokens=False)
        try:
            text, images = chat_prompt(service.engine, chat.body, service.limits)
        except APIError as e:
            raise chat.relocate(e) from None
        return JSONResponse({"input_tokens": service.engine.count_tokens(text, images)})

    return await run(size, count)
