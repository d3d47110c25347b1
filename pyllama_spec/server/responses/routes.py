"""The routes: ``POST /v1/responses`` and ``POST /v1/responses/input_tokens`` (and both without
/v1/); each request is converted to a chat body, parsed and run as the chat route runs it, and its
answer converted back (see the package's doc)."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import AsyncIterator, Callable

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pyllama_spec.server.errors import APIError, bad_request
from pyllama_spec.server.generation import (
    complete_body,
    event_data,
    first_translated,
    stream_objects,
)
from pyllama_spec.server.offload import PARSE_ON_A_THREAD_ABOVE, ThreadRunner, off_loop
from pyllama_spec.server.responses.convert import (
    ResponseHead,
    chat_body,
    finish_status,
    input_items,
    new_id,
    output_items,
    relocate,
    request_echo,
    responses_usage,
)
from pyllama_spec.server.responses.events import EventTranslator
from pyllama_spec.server.responses.store import ResponseStore, Turn, conversation_items, is_assistant_message
from pyllama_spec.server.schema import GenerationRequest, parse_chat
from pyllama_spec.server.service import RouteSpec, Service, read_json
from pyllama_spec.server.tokens import chat_prompt

log = logging.getLogger("pyllama_spec.server")


def routes(service: Service) -> list[RouteSpec]:
    """/v1/responses and its token count, each also without /v1/, as llama-server serves them."""
    store = ResponseStore(service.settings.responses_stored, service.settings.responses_stored_bytes)
    run = ThreadRunner()

    def create(request: Request):
        return _create(service, store, request)

    def count(request: Request):
        return _input_tokens(service, store, run, request)

    return [*((p, ["POST"], create) for p in ("/v1/responses", "/responses")),
            *((p, ["POST"], count) for p in ("/v1/responses/input_tokens", "/responses/input_tokens"))]


async def _request(service: Service, store: ResponseStore, request: Request) -> tuple[dict, int, tuple]:
    """The request's body, its size, and the stored turns of its previous_response_id."""
    body, size = await read_json(request, service.settings.max_body_bytes, service.settings.body_timeout)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    previous = body.get("previous_response_id")
    if previous is None:
        return body, size, ()
    if not isinstance(previous, str):
        raise bad_request("'previous_response_id' must be a string", "previous_response_id")
    turns = store.get(previous)
    if turns is None:  # OpenAI's answer for an id it does not hold
        raise APIError(400, f"Previous response with id '{previous}' not found.", param="previous_response_id",
                       code="previous_response_not_found")
    return body, size, turns


async def _create(service: Service, store: ResponseStore, request: Request) -> Response:
    body, size, history = await _request(service, store, request)
    keep = body.get("store", True)
    if not isinstance(keep, bool):
        raise bad_request("'store' must be a boolean", "store")

    new_items = input_items(body)
    earlier: list = []  # the previous responses' items, read back from the store while parsing
    items: list = new_items

    def parse() -> GenerationRequest:
        nonlocal earlier, items
        earlier = conversation_items(history)
        items = earlier + new_items
        chat = chat_body(body, items, n_earlier=len(earlier), max_tokens_limit=service.limits.max_tokens)
        try:
            return parse_chat(chat, service.limits)
        except APIError as e:
            raise relocate(e, body, items, len(earlier)) from None

    # images are decoded (and checked) while parsing, the earlier turns' too: off the event loop when large
    req = await off_loop(size + sum(t.size for t in history) > PARSE_ON_A_THREAD_ABOVE, parse)
    head = ResponseHead(new_id("resp"), int(time.time()), service.settings.alias, request_echo(body))

    def save(output: list[dict]) -> None:
        if keep:
            # A continued message (a final assistant one: llama-server prefills it) is in a whole answer's
            # output from its start, so the output stands for it; a streamed answer's output holds the new
            # text alone (its deltas), which the conversation's items merge into the message it continued.
            own, continues = list(new_items), req.chat is not None and req.chat.params.is_continuation and not req.stream
            while continues and own and is_assistant_message(own[-1]):
                own.pop()
            # With input items left, the continued message began in this input (its assistant items
            # went above); with none, it is the conversation's, and the output stands for it there.
            turn = Turn.of(own + output, continues=continues and not own)
            if not store.put(head.id, history + (turn,)):
                log.warning("response %s is not kept for previous_response_id: its conversation is over %d bytes",
                            head.id, store.max_bytes)

    try:  # the template renders the tools and reasoning; its errors name the input, not the messages
        await service.prepare(req)
    except APIError as e:
        raise relocate(e, body, items, len(earlier)) from None
    jobs = service.submit(req)
    try:  # the generation's errors (a prompt longer than the context) name the input, not the messages
        if req.stream:
            objects, events = stream_objects(service, req, jobs), EventTranslator(head)
            try:
                # the opening events, then those of the first chunk with something to say
                opening = events.start()
                first = opening + await first_translated(objects, request, events.chunk)
            except BaseException:
                await objects.aclose()  # cancels the job
                raise
            return EventSourceResponse(_stream(first, objects, events, save), ping=15)
        chat = await complete_body(service, req, jobs, request)
    except APIError as e:
        raise relocate(e, body, items, len(earlier)) from None
    choice = chat["choices"][0]
    status, incomplete = finish_status(choice["finish_reason"])
    output = output_items(choice["message"], "incomplete" if incomplete else "completed")
    save(output)
    return JSONResponse(head.body(status, output, responses_usage(chat["usage"]), incomplete, chat.get("timings")))


async def _stream(first: list[dict], objects: AsyncIterator[dict], events: EventTranslator,
                  save: Callable[[list], None]) -> AsyncIterator[dict]:
    """Server-sent events (``event: <type>``, then its data), as llama-server sends them, with no
    [DONE] at the end. An error after the stream started ends it with llama-server's data-only
    ``{"error": ...}`` event (the openai client raises it). The client going away closes this,
    which cancels the job."""

    def sse(event: dict) -> dict:
        return {"event": event["type"], "data": event_data(event)}

    async with contextlib.aclosing(objects):
        for event in first:
            yield sse(event)
        async for chunk in objects:  # nothing more when the first events ended it
            if "error" in chunk:
                yield {"data": event_data(chunk)}
                return
            for event in events.chunk(chunk):
                yield sse(event)
        for event in events.finish():
            yield sse(event)
    save(events.output)


async def _input_tokens(service: Service, store: ResponseStore, run: ThreadRunner, request: Request) -> Response:
    """The prompt's token count as /v1/responses would render it (the chat input_tokens route's
    count of the translated body): ``{"input_tokens": n, "object": "response.input_tokens"}``."""
    body, size, history = await _request(service, store, request)

    def answer() -> Response:
        earlier = conversation_items(history)
        items = earlier + input_items(body)
        chat = chat_body(body, items, n_earlier=len(earlier), max_tokens_limit=service.limits.max_tokens)
        try:
            text, images = chat_prompt(service.engine, chat, service.limits)
        except APIError as e:
            raise relocate(e, body, items, len(earlier)) from None
        return JSONResponse({"input_tokens": service.engine.count_tokens(text, images),
                             "object": "response.input_tokens"})

    return await run(size + sum(t.size for t in history), answer)
