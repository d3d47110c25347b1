"""The generation routes: OpenAI's chat and completions, llama-server's /completion, each under
llama-server's paths; whole answers and server-sent events, one or several choices.
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
from pyllama_spec.server.schema import GenerationRequest, parse_chat, parse_completion
from pyllama_spec.server.service import (
    PARSE_ON_A_THREAD_ABOVE,
    RouteSpec,
    Service,
    engine_error,
    read_json,
)
from pyllama_spec.server.worker import Job


def routes(service: Service) -> list[RouteSpec]:
    """Each route under its un-prefixed and /v1/ names, as llama-server serves them;
    /completion and /completions answer in llama-server's own shape."""

    def llama_completion(body, limits):
        return parse_completion(body, limits, llama_style=True)

    def handler(parse):
        return lambda request: generation(service, request, parse)

    return [
        *((p, ["POST"], handler(parse_chat)) for p in ("/v1/chat/completions", "/chat/completions")),
        ("/v1/completions", ["POST"], handler(parse_completion)),
        *((p, ["POST"], handler(llama_completion)) for p in ("/completion", "/completions")),
    ]


async def generation(service: Service, request: Request, parse) -> Response:
    body, size = await read_json(request, service.settings.max_body_bytes, service.settings.body_timeout)
    if size > PARSE_ON_A_THREAD_ABOVE:
        # images are decoded (and checked) while parsing: off the event loop, which other
        # requests' streams share (Pillow releases the GIL while it decodes)
        req = await asyncio.get_running_loop().run_in_executor(None, parse, body, service.limits)
    else:
        req = parse(body, service.limits)
    jobs = service.submit(req)
    if req.stream:
        return EventSourceResponse(_stream_events(service, req, jobs), ping=15)
    return await _complete(service, req, jobs, request)


def timings(stats) -> dict:
    """llama-server's ``timings`` object, plus what it lacks (acceptance by draft position)."""
    prompt_n = stats.prompt_decoded
    prompt_ms, predicted_ms = stats.prefill_seconds * 1000, stats.decode_seconds * 1000
    out = {
        "cache_n": stats.prompt_reused,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": prompt_n / stats.prefill_seconds if stats.prefill_seconds > 0 else 0.0,
        "predicted_n": stats.generated_tokens,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / stats.generated_tokens if stats.generated_tokens else 0.0,
        "predicted_per_second": stats.tokens_per_second,
        "draft_n": stats.drafted,
        "draft_n_accepted": stats.accepted,
        "acceptance_rate": stats.acceptance_rate,
        "mean_accepted_length": stats.mean_accepted_length,
        "per_position_acceptance": stats.per_position_acceptance,
        "target_steps": stats.target_steps,
    }
    return out


def speculation(piece) -> dict:
    """The ``pyllama_spec`` extension object of a streamed chunk: each token of the step with the
    text it released and whether it was an accepted draft token, the tokens the drafter proposed
    in the step, and how many of the step's tokens are accepted drafts."""
    tokens = [{"id": int(tok), "text": text, "draft": i < piece.from_draft}
              for i, (tok, text) in enumerate(zip(piece.tokens, piece.token_texts, strict=True))]
    return {"tokens": tokens, "drafted": piece.drafted, "accepted": piece.from_draft}


def usage(stats) -> dict:
    """OpenAI's usage of one generation's stats, or of a request's choices (a list): the prompt
    counted once, the completions summed."""
    every = stats if isinstance(stats, list) else [stats]
    first, completion = every[0], sum(s.generated_tokens for s in every)
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
            "total_tokens": first.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": first.prompt_reused}}


def _ids(req: GenerationRequest) -> tuple[str, str]:
    prefix = {"chat": "chatcmpl", "completion": "cmpl", "llama": "cmpl"}[req.kind]
    return f"{prefix}-{uuid.uuid4().hex[:24]}", {"chat": "chat.completion", "completion": "text_completion",
                                                 "llama": "completion"}[req.kind]


async def _until_disconnected(request: Request) -> None:
    """Returns when the client has gone (ASGI's http.disconnect; the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclasses.dataclass
class _Choice:
    """One choice's generation, gathered: its text, tokens, logprobs and last piece."""

    text: list = dataclasses.field(default_factory=list)
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    last: Any = None


async def _gather(job: Job) -> _Choice:
    out = _Choice()
    while True:
        kind, value = await job.events.get()
        if kind == "piece":
            out.text.append(value.text)
            out.tokens.extend(value.tokens)
            out.logprobs.extend(value.logprobs)
            out.last = value
        elif kind == "error":
            raise engine_error(value)
        else:
            break
    if out.last is None or out.last.stats is None:  # ended without its last piece: stopped under it
        raise APIError(503, "the generation was stopped before it finished (the server is stopping)",
                       type="server_error", code="cancelled")
    return out


def _stop_type(finish_reason: str | None) -> str:
    return "limit" if finish_reason == "length" else "eos"


async def _complete(service: Service, req: GenerationRequest, jobs: list[Job], request: Request) -> Response:
    gone = asyncio.ensure_future(_until_disconnected(request))
    work = asyncio.ensure_future(asyncio.gather(*(_gather(job) for job in jobs)))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            raise APIError(499, "the client disconnected")
        choices = work.result()  # the first error, if one failed
    finally:
        gone.cancel()
        for job in jobs:
            job.cancel()  # no-op once finished; stops the others when one failed or the client left
    rid, obj = _ids(req)
    model = service.settings.alias
    asked = req.engine_args.get("logprobs") is not None
    if req.kind == "llama":
        bodies = []
        for i, c in enumerate(choices):
            stats = c.last.stats
            body = {"index": i, "content": "".join(c.text), "tokens": c.tokens, "model": model,
                    "stop": True, "stop_type": _stop_type(c.last.finish_reason),
                    "tokens_predicted": stats.generated_tokens, "tokens_evaluated": stats.prompt_tokens,
                    "tokens_cached": stats.prompt_reused, "timings": timings(stats)}
            if asked:
                body["completion_probabilities"] = service.logprobs.entries(c.logprobs)
            bodies.append(body)
        return JSONResponse(bodies[0] if len(bodies) == 1 else bodies)  # llama-server: a list for n_cmpl > 1
    out = []
    for i, c in enumerate(choices):
        # llama-server answers OpenAI's chat shape {"content": [...]} on both routes
        choice: dict = {"index": i, "finish_reason": c.last.finish_reason,
                        "logprobs": {"content": service.logprobs.entries(c.logprobs)} if asked else None}
        if req.kind == "chat":
            choice["message"] = {"role": "assistant", "content": "".join(c.text)}
        else:
            choice["text"] = "".join(c.text)
        out.append(choice)
    stats = [c.last.stats for c in choices]
    return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": out,
                         "usage": usage(stats), "timings": timings(stats[0])})


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
                if kind == "piece":
                    waiting[asyncio.ensure_future(jobs[i].events.get())] = i
    finally:
        for future in waiting:
            future.cancel()


async def _stream_events(service: Service, req: GenerationRequest, jobs: list[Job]) -> AsyncIterator[dict]:
    """Server-sent events: OpenAI chunks ending with [DONE] (llama-server's chunks for /completion),
    each naming its choice by ``index``."""
    rid, _ = _ids(req)
    created, model = int(time.time()), service.settings.alias
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    asked = req.engine_args.get("logprobs") is not None

    def chunk(i: int, delta_text: str | None, finish: str | None, role: bool = False, piece=None) -> dict:
        lp = {"content": service.logprobs.entries(piece.logprobs)} if asked and piece is not None else None
        if req.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({} if delta_text is None else
                                                                      {"content": delta_text})
            c = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            c = {"index": i, "text": delta_text or "", "logprobs": lp, "finish_reason": finish}
        out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [c]}
        if piece is not None:
            out["pyllama_spec"] = speculation(piece)  # an extension: clients ignore unknown fields
        return out

    def data(obj_: dict) -> dict:
        return {"data": json.dumps(obj_, ensure_ascii=False)}

    final_stats = {}
    try:
        if req.kind == "chat":
            for i in range(len(jobs)):
                yield data(chunk(i, None, None, role=True))
        async with contextlib.aclosing(_merged(jobs)) as events:  # the client going away cancels this
            async for i, kind, piece in events:
                if kind == "error":
                    yield data(engine_error(piece).body())
                    return
                if kind == "done":
                    continue
                if req.kind == "llama":
                    event = {"index": i, "content": piece.text, "tokens": list(piece.tokens),
                             "stop": piece.stats is not None, "pyllama_spec": speculation(piece)}
                    if asked:
                        event["completion_probabilities"] = service.logprobs.entries(piece.logprobs)
                    if piece.stats is not None:
                        event.update(model=model, stop_type=_stop_type(piece.finish_reason),
                                     tokens_predicted=piece.stats.generated_tokens,
                                     tokens_evaluated=piece.stats.prompt_tokens, timings=timings(piece.stats))
                    yield data(event)
                    continue
                # A step whose text is held back (a partial character, a possible stop string) still
                # gets its chunk, with empty content, so that every token's origin is reported.
                if piece.text or piece.tokens:
                    yield data(chunk(i, piece.text, None, piece=piece))
                if piece.stats is not None:
                    final_stats[i] = piece.stats
                    final = chunk(i, None, piece.finish_reason)
                    final["timings"] = timings(piece.stats)
                    yield data(final)
        if req.kind != "llama":
            if req.include_usage and len(final_stats) == len(jobs):
                yield data({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                            "usage": usage([final_stats[i] for i in sorted(final_stats)])})
            yield {"data": "[DONE]"}
    finally:
        for job in jobs:
            job.cancel()  # the client went away (or the stream ended): stop generating within one step
