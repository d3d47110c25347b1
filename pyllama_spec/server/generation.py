"""What the generation routes share: a request's body read and parsed (``generation``), its jobs
run and answered whole (``complete_body``) or as server-sent events (``stream_objects``), one or
several choices, with llama-server's timings and OpenAI's usage. The routes are
``chat_completions`` (OpenAI's /v1/chat/completions), ``completions`` (OpenAI's /v1/completions,
llama-server's /completion) and ``infill``; ``anthropic/`` and ``responses/`` translate the chat
answer into their own APIs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from typing import Any, AsyncIterator

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pyllama_spec.server.errors import APIError
from pyllama_spec.server.llama_fields import (
    FinalFields,
    Progress,
    final_body,
    generation_settings,
    prompt_text,
    select_fields,
    wants,
)
from pyllama_spec.server.offload import PARSE_ON_A_THREAD_ABOVE, off_loop, until_disconnected
from pyllama_spec.server.schema import GenerationRequest
from pyllama_spec.server.service import Service, engine_error, read_json
from pyllama_spec.server.worker import Job


async def generation(service: Service, request: Request, parse) -> Response:
    """A generation route's answer to ``request``: its body checked by ``parse(body, limits)``
    (``schema.parse_chat`` or ``parse_completion``), then ``answer``."""
    body, size = await read_json(request, service.settings.max_body_bytes, service.settings.body_timeout)
    # images are decoded (and checked) while parsing: a large body off the event loop, which other
    # requests' streams share (Pillow releases the GIL while it decodes)
    req = await off_loop(size > PARSE_ON_A_THREAD_ABOVE, parse, body, service.limits)
    return await answer(service, request, req)


async def answer(service: Service, request: Request, req: GenerationRequest) -> Response:
    """Run a parsed request (its jobs queued now) and answer it whole or as server-sent events.
    A chat is rendered and its jobs' Requests resolved first (``Service.prepare``: on a thread
    when a template, a schema or a long prompt can make that long)."""
    await service.prepare(req)
    jobs = service.submit(req)
    if req.stream:
        objects = stream_objects(service, req, jobs)
        try:
            opening, pending = await _opening(objects, request)
        except BaseException:
            await objects.aclose()  # cancels the jobs
            raise
        return EventSourceResponse(_stream_events(req, opening, pending, objects), ping=15)
    return JSONResponse(await complete_body(service, req, jobs, request))


#: Seconds a stream is held back for its first token (see ``_opening``).
OPENING_WAIT = 5.0
_ROLE_DELTA = {"role": "assistant", "content": None}


def _is_role_chunk(obj: dict) -> bool:
    """A chat stream's opening chunk: the assistant's role and nothing else."""
    choices = obj.get("choices")
    return bool(choices) and len(choices) == 1 and choices[0].get("delta") == _ROLE_DELTA \
        and choices[0].get("finish_reason") is None \
        and not obj.keys() & {"timings", "usage", "pyllama_spec", "prompt_progress"}


async def _opening(objects: AsyncIterator[dict], request: Request) -> tuple[list[dict], asyncio.Future | None]:
    """The first chunks of a stream, up to the first that is more than a chat's role chunk: an error
    there (a prompt longer than the context) is raised, to be answered with its status, as
    llama-server answers an error that comes before its stream. Held at most OPENING_WAIT seconds:
    then the stream starts with what is held (a request waiting in the queue gets its headers, and
    the pings that keep a proxy from timing out), the chunk being waited for (a Future) handed on
    with it. A 499 when the client leaves meanwhile."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + OPENING_WAIT
    held: list[dict] = []
    gone = asyncio.ensure_future(until_disconnected(request))
    step = None
    try:
        while True:
            step = asyncio.ensure_future(anext(objects, None))
            await asyncio.wait({step, gone}, timeout=max(0.0, deadline - loop.time()),
                               return_when=asyncio.FIRST_COMPLETED)
            if step.done():
                obj = step.result()
                if obj is None:
                    return held, None
                if "error" in obj:
                    raise error_of_chunk(obj)
                held.append(obj)
                if not _is_role_chunk(obj):
                    return held, None
            elif gone.done():
                step.cancel()  # the generator ends (its jobs cancelled) before the error goes up
                await asyncio.wait({step})
                raise APIError(499, "the client disconnected")
            else:
                return held, step  # still waiting for its first token: the stream starts now
    except BaseException:
        if step is not None and not step.done():  # (cancelled meanwhile: the generator must be free to close)
            step.cancel()
            await asyncio.wait({step})
        raise
    finally:
        gone.cancel()


def timings(stats) -> dict:
    """llama-server's ``timings`` object, plus acceptance numbers it lacks. Every value is a number, as
    there (clients total them, llama.cpp's tests check them): the list of acceptance by draft position
    goes beside it (``acceptance_by_position``)."""
    prompt_n = stats.prompt_decoded
    prompt_ms, predicted_ms = stats.prefill_seconds * 1000, stats.decode_seconds * 1000
    steps = max(stats.generated_tokens - 1, 0)
    out = {
        "cache_n": stats.prompt_reused,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": prompt_n / stats.prefill_seconds if stats.prefill_seconds > 0 else 0.0,
        "predicted_n": stats.generated_tokens,
        "predicted_ms": predicted_ms,
        # over the tokens after the first, as llama-server: the first comes from the prompt's last logits
        "predicted_per_token_ms": predicted_ms / steps if steps else 0.0,
        "predicted_per_second": stats.tokens_per_second,
        "draft_n": stats.drafted,
        "draft_n_accepted": stats.accepted,
        "acceptance_rate": stats.acceptance_rate,
        "mean_accepted_length": stats.mean_accepted_length,
        "target_steps": stats.target_steps,
    }
    return out


def acceptance_by_position(stats) -> dict:
    """The fields an OpenAI-shaped final answer carries beside ``timings``: the acceptance at each draft
    position (/completion keeps to llama-server's fields; /slots has it too)."""
    return {"per_position_acceptance": list(stats.per_position_acceptance)}


def speculation(piece) -> dict:
    """The ``pyllama_spec`` extension object of a streamed chunk: each token of the step with the
    text it released and whether it was an accepted draft token, the tokens the drafter proposed
    in the step, and how many of the step's tokens are accepted drafts."""
    tokens = [{"id": int(tok), "text": text, "draft": i < piece.from_draft}
              for i, (tok, text) in enumerate(zip(piece.tokens, piece.token_texts, strict=True))]
    return {"tokens": tokens, "drafted": piece.drafted, "accepted": piece.from_draft}


def usage(stats, n: int = 1) -> dict:
    """OpenAI's usage of one generation's stats, or of a request's choices (a list, ``n`` choices
    per prompt, prompt by prompt): each prompt counted once, the completions summed. (llama-server
    reports the first choice's usage alone.)"""
    every = stats if isinstance(stats, list) else [stats]
    prompts = every[::n]
    prompt, cached = sum(s.prompt_tokens for s in prompts), sum(s.prompt_reused for s in prompts)
    completion = sum(s.generated_tokens for s in every)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _text(c: _Choice) -> str:
    """A choice's whole text: its pieces, less what llama-server's n_indent cut from the last line."""
    text = "".join(c.text)
    retract = c.last.ending.retract if c.last.ending is not None else 0
    return text[:len(text) - retract] if retract else text


def _probabilities(service: Service, req: GenerationRequest, logprobs) -> list[dict]:
    # (with post_sampling_probs the engine gave the probabilities after the chain: "prob", "top_probs")
    return service.logprobs.entries(logprobs)


async def _llama_final(service: Service, req: GenerationRequest, job: Job, index: int, c: _Choice,
                       id_slot) -> dict:
    """llama-server's final /completion body of one choice (``c`` gathered from its job's pieces;
    in a stream the chunks carried the text, tokens and probabilities, and it holds none)."""
    opts, last, model = req.options, c.last, service.engine.model
    paths, ending = opts.response_fields, last.ending
    prompt = ""
    if wants(paths, "prompt"):
        prompt = await off_loop(sum(len(a) for a in ending.prompt) > 4096, prompt_text, model, ending.prompt)
    settings = {}
    if wants(paths, "generation_settings"):
        settings = generation_settings(service, job.request, stream=req.stream, options=opts)
    streamed = req.stream
    fields = FinalFields(index=index, content="" if streamed else _text(c),
                         tokens=c.tokens if opts.return_tokens and not streamed else [], id_slot=id_slot,
                         model=service.settings.alias, prompt=prompt, has_new_line=c.has_new_line,
                         settings=settings)
    body = final_body(fields, last, timings(last.stats))  # llama-server's fields and no other
    if not streamed:
        probs = await _final_logprobs(service, req, c)
        if probs:
            body["completion_probabilities"] = probs
    return select_fields(paths, body)


async def _final_logprobs(service: Service, req: GenerationRequest, c: _Choice) -> list[dict]:
    """A whole answer's probabilities, as llama-server gives them: after a stop string, less as
    many of the last as the stop string has tokens."""
    logprobs, ending = c.logprobs, c.last.ending
    if logprobs and ending is not None and ending.stop_type == "word":
        word = ending.stopping_word
        n = len(await off_loop(len(word) > 4096, service.engine.model.tokenize, word))
        logprobs = logprobs[:max(0, len(logprobs) - n)]
    return _probabilities(service, req, logprobs)


def _ids(req: GenerationRequest) -> tuple[str, str]:
    prefix = {"chat": "chatcmpl", "completion": "cmpl", "llama": "cmpl"}[req.kind]
    return f"{prefix}-{uuid.uuid4().hex[:24]}", {"chat": "chat.completion", "completion": "text_completion",
                                                 "llama": "completion"}[req.kind]


async def first_translated(objects: AsyncIterator[dict], request: Request, translate) -> list:
    """What ``translate`` makes of the first chunks of ``stream_objects`` up to the first one it has
    something to say about ([] when the stream ends first). For the APIs that translate the chat
    stream (Messages, Responses; the chat and completion routes hold theirs with ``_opening``): an error before their stream starts is raised, so that it is
    answered with its status, as llama-server answers one that comes before its stream (a prompt
    longer than the context); a 499 when the client leaves meanwhile."""
    gone = asyncio.ensure_future(until_disconnected(request))
    try:
        while True:
            step = asyncio.ensure_future(anext(objects, None))
            await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()  # the generator ends (its job cancelled) before the error goes up
                await asyncio.wait({step})
                raise APIError(499, "the client disconnected")
            chunk = step.result()
            if chunk is None:
                return []
            if "error" in chunk:
                raise error_of_chunk(chunk)
            translated = translate(chunk)
            if translated:
                return translated
    finally:
        gone.cancel()


def error_of_chunk(chunk: dict) -> APIError:
    """The APIError behind an error chunk of ``stream_objects`` (made by ``engine_error``: a 400
    for the request's fault, 503 when cancelled, else 500)."""
    e = dict(chunk["error"])
    fault = e.get("type") in ("invalid_request_error", "exceed_context_size_error")
    status = 400 if fault else 503 if e.get("code") == "cancelled" else 500
    return APIError(status, e.pop("message", ""), type=e.pop("type", "server_error"), code=e.pop("code", None),
                    param=e.pop("param", None), extra=e)


@dataclasses.dataclass
class _Choice:
    """One choice's generation, gathered: its text, tokens, logprobs and last piece."""

    text: list = dataclasses.field(default_factory=list)
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    last: Any = None
    has_new_line: bool = False  # llama-server's: a newline was streamed


def _retrieve(future: asyncio.Future) -> None:
    """Mark a finished future's outcome as seen (nobody waits for it any more)."""
    if not future.cancelled():
        future.exception()


async def _gather(job: Job) -> _Choice:
    out = _Choice()
    while True:
        kind, value = await job.events.get()
        if kind == "piece":
            out.text.append(value.text)
            out.tokens.extend(value.tokens)
            out.logprobs.extend(value.logprobs)
            out.has_new_line = out.has_new_line or "\n" in value.text
            out.last = value
        elif kind == "error":
            raise engine_error(value)
        elif kind != "progress":
            break
    if out.last is None or out.last.stats is None:  # ended without its last piece: stopped under it
        raise APIError(503, "the generation was stopped before it finished (the server is stopping)",
                       type="server_error", code="cancelled")
    return out


async def complete_body(service: Service, req: GenerationRequest, jobs: list[Job], request: Request) -> Any:
    """The whole answer to a request whose ``jobs`` were submitted, as the JSON value its route
    answers (OpenAI's chat.completion / text_completion, or llama-server's /completion body or
    list); the other APIs (Messages, Responses) translate the chat one. Raises APIError (499
    when the client left)."""
    gone = asyncio.ensure_future(until_disconnected(request))
    work = asyncio.ensure_future(asyncio.gather(*(_gather(job) for job in jobs)))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            # The gather ends with the cancelled job's error once that job sees the cancel: retrieve
            # it then, or asyncio logs "_GatheringFuture exception was never retrieved" per client.
            work.add_done_callback(_retrieve)
            raise APIError(499, "the client disconnected")
        choices = work.result()  # the first error, if one failed
    finally:
        gone.cancel()
        for job in jobs:
            job.cancel()  # no-op once finished; stops the others when one failed or the client left
    rid, obj = _ids(req)
    model = service.settings.alias
    asked = req.params.logprobs is not None
    if req.kind == "llama":
        bodies = [await _llama_final(service, req, jobs[i], i, c, id_slot=jobs[i].slot) for i, c in enumerate(choices)]
        # llama-server: a list for several prompts or n_cmpl > 1, indexed prompt by prompt
        return bodies[0] if len(bodies) == 1 else bodies
    out = []
    for i, c in enumerate(choices):
        # llama-server answers OpenAI's chat shape {"content": [...]} on both routes
        probs = await _final_logprobs(service, req, c) if asked else []
        choice: dict = {"index": i, "finish_reason": c.last.finish_reason,
                        "logprobs": {"content": probs} if probs else None}  # llama-server: null when none
        if req.kind == "chat" and req.chat is not None:  # content, reasoning_content, tool_calls
            parser = req.chat.parsers[i]
            await parser.feed(_text(c), final=True)
            choice["message"] = parser.message
            choice["finish_reason"] = parser.finish_reason(c.last.finish_reason)
        elif req.kind == "chat":
            choice["message"] = {"role": "assistant", "content": _text(c)}
        else:
            choice["text"] = _text(c)
        out.append(choice)
    stats = [c.last.stats for c in choices]
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": out,
            "usage": usage(stats, req.n), "timings": timings(stats[0]), **acceptance_by_position(stats[0])}
    if req.options.verbose:  # llama-server's debugging aid: the first choice as /completion answers it
        body["__verbose"] = await _llama_final(service, req, jobs[0], 0, choices[0], id_slot=jobs[0].slot)
    return body


async def _merged(jobs: list[Job]) -> AsyncIterator[tuple[int, str, Any]]:
    """Every job's events as (choice index, kind, value), in the order they arrive."""
    waiting = {asyncio.ensure_future(job.events.get()): i for i, job in enumerate(jobs)}
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=waiting.get):
                i = waiting.pop(future)
                kind, value = future.result()
                yield i, kind, value
                if kind in ("piece", "progress"):
                    waiting[asyncio.ensure_future(jobs[i].events.get())] = i
    finally:
        for future in waiting:
            future.cancel()


def event_data(obj: Any) -> str:
    """An event's JSON, UTF-8 as llama-server sends it; where a text holds a lone surrogate (a client's
    ``"\\ud800"`` echoed back in metadata, a stop string, a tool name), which UTF-8 cannot carry, with
    every non-ASCII character escaped instead: still the same JSON, and the stream goes on."""
    text = json.dumps(obj, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(obj)
    return text


async def _stream_events(req: GenerationRequest, opening: list[dict], pending: asyncio.Future | None,
                         objects: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """Server-sent events: ``stream_objects``' chunks (``opening`` and the ``pending`` next one, taken
    from it already, first), each a ``data:`` event, then ``[DONE]`` on OpenAI's routes (unless the
    stream ended with an error)."""
    failed = False
    async with contextlib.aclosing(objects):
        try:
            for obj in opening:
                failed = "error" in obj
                yield {"data": event_data(obj)}
            obj = None if pending is None else await pending
            pending = None
            if obj is not None:
                failed = "error" in obj
                yield {"data": event_data(obj)}
        finally:
            if pending is not None:  # the client left while it waited
                pending.cancel()
                await asyncio.wait({pending})
        async for obj in objects:
            failed = "error" in obj
            yield {"data": event_data(obj)}
    if req.kind != "llama" and not failed:
        yield {"data": "[DONE]"}


async def stream_objects(service: Service, req: GenerationRequest, jobs: list[Job]) -> AsyncIterator[dict]:
    """The chunks of a streamed answer as JSON objects: OpenAI chunks (llama-server's chunks for
    /completion, each step's, then the final body), each naming its choice by ``index``; with
    return_progress, a chunk with ``prompt_progress`` after each prompt batch; with
    timings_per_token, ``timings`` in every chunk; an error ends it with ``{"error": ...}``.
    Closing it (the client left) cancels the jobs. The other APIs (Messages, Responses)
    translate the chat chunks into their own events."""
    rid, _ = _ids(req)
    created, model = int(time.time()), service.settings.alias
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    asked = req.params.logprobs is not None
    per_token = req.options.timings_per_token
    progress = [Progress() for _ in jobs]

    def chunk(i: int, delta_text: str | None, finish: str | None, role: bool = False, piece=None,
              delta: dict | None = None) -> dict:
        """A chunk of choice i: ``delta_text`` as its content, or a parsed chat's ``delta``."""
        lp = {"content": _probabilities(service, req, piece.logprobs)} if asked and piece is not None else None
        if req.kind == "chat":
            if delta is None:
                delta = {"role": "assistant", "content": None} if role else ({} if delta_text is None else
                                                                          {"content": delta_text})
            c = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            c = {"index": i, "text": delta_text or "", "logprobs": lp, "finish_reason": finish}
        out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [c]}
        if piece is not None:
            if per_token:
                out["timings"] = timings(piece.so_far or piece.stats)
            out["pyllama_spec"] = speculation(piece)  # an extension: clients ignore unknown fields
        return out

    def progress_chunk(i: int, value) -> dict:
        at = progress[i].event(value)
        if req.kind == "llama":
            return {"index": i, "content": "", "tokens": [], "stop": False, "id_slot": jobs[i].slot,
                    "tokens_predicted": 0, "tokens_evaluated": at["total"], "prompt_progress": at}
        if req.kind == "chat":  # llama-server: the role's delta, with content null
            c = {"index": i, "delta": {"role": "assistant", "content": None}, "finish_reason": None}
        else:
            c = {"index": i, "text": "", "logprobs": None, "finish_reason": None}
        return {"id": rid, "object": obj, "created": created, "model": model, "choices": [c], "prompt_progress": at}

    def llama_chunk(i: int, piece) -> dict:
        now = piece.so_far or piece.stats
        event = {"index": i, "content": piece.text, "tokens": list(piece.tokens), "stop": False,
                 "id_slot": jobs[i].slot, "tokens_predicted": now.generated_tokens,
                 "tokens_evaluated": now.prompt_tokens}
        if per_token:
            event["timings"] = timings(now)
        if asked and piece.logprobs:
            event["completion_probabilities"] = _probabilities(service, req, piece.logprobs)
        event["pyllama_spec"] = speculation(piece)
        return event

    final_stats = {}
    streamed_new_line = [False] * len(jobs)
    try:
        if req.kind == "chat":
            for i in range(len(jobs)):
                yield chunk(i, None, None, role=True)
        async with contextlib.aclosing(_merged(jobs)) as events:  # the client going away cancels this
            async for i, kind, piece in events:
                if kind == "error":
                    yield engine_error(piece).body()
                    return
                if kind == "done":
                    continue
                if kind == "progress":
                    yield progress_chunk(i, piece)
                    continue
                if req.kind == "llama":
                    # each step's tokens, then (as llama-server) the final body with empty content
                    if piece.text or piece.tokens:
                        yield llama_chunk(i, piece)
                    if piece.stats is not None:
                        last = _Choice(last=piece, has_new_line=streamed_new_line[i] or "\n" in piece.text)
                        yield await _llama_final(service, req, jobs[i], i, last, id_slot=jobs[i].slot)
                    streamed_new_line[i] = streamed_new_line[i] or "\n" in piece.text
                    continue
                # A step whose text is held back (a partial character, a possible stop string) still
                # gets its chunk, with empty content, so that every token's origin is reported.
                finish = piece.finish_reason
                if req.kind == "chat" and req.chat is not None:
                    # the parsed answer's deltas (content, reasoning_content, tool_calls), a chunk each;
                    # the step's extension and logprobs ride on its last one
                    parser = req.chat.parsers[i]
                    deltas = await parser.feed(piece.text, final=piece.stats is not None)
                    if piece.text or piece.tokens or deltas:
                        for d in deltas[:-1]:
                            yield chunk(i, None, None, delta=d)
                        yield chunk(i, None, None, piece=piece, delta=deltas[-1] if deltas else {})
                    finish = parser.finish_reason(finish)
                elif piece.text or piece.tokens:
                    yield chunk(i, piece.text, None, piece=piece)
                if piece.stats is not None:
                    final_stats[i] = piece.stats
                    final = chunk(i, None, finish)
                    final["timings"] = timings(piece.stats)
                    final.update(acceptance_by_position(piece.stats))
                    if req.options.verbose:  # llama-server's, on each choice's last chunk (content streamed)
                        final["__verbose"] = await _llama_final(service, req, jobs[i], i, _Choice(last=piece),
                                                                id_slot=jobs[i].slot)
                    yield final
        if req.kind != "llama" and req.include_usage and len(final_stats) == len(jobs):
            # the usage chunk carries the timings too, as llama-server's (the first choice's)
            yield {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                   "usage": usage([final_stats[i] for i in sorted(final_stats)], req.n),
                   "timings": timings(final_stats[min(final_stats)]),
                   **acceptance_by_position(final_stats[min(final_stats)])}
    finally:
        for job in jobs:
            job.cancel()  # the client went away (or the stream ended): stop generating within one step
