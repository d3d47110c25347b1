"""llama-server's embedding routes: ``POST /embedding`` and ``/embeddings`` (its own answer, a list
of ``{"index", "embedding": [[...]]}``) and ``/v1/embeddings`` (OpenAI's), served when the server
was started with ``--embeddings``; and its reranking routes, ``POST /rerank``, ``/reranking``,
``/v1/rerank``, ``/v1/reranking``, served when it was started with ``--reranking`` (a reranker:
pooling "rank"). Without them each answers llama-server's 501, before reading the body.

The request is read as llama-server's ``handle_embeddings_impl`` reads it
(tools/server/server-context.cpp): ``input`` (or ``content``, which makes the answer llama-server's
own shape) holds one prompt or a list of them, each a string, token ids, ids mixed with strings, a
``{"prompt_string", "multimodal_data"}`` object, or an OpenAI content object ``{"content": [{"type":
"text"}, {"type": "image_url"}, ...]}`` (its texts joined, a media marker where each image was);
``encoding_format`` "float" or "base64" (little-endian float32, as llama-server and OpenAI send it);
``embd_normalize`` overrides ``--embd-normalize``. ``/v1/embeddings`` refuses a server whose pooling
is "none" (a vector per token is not OpenAI's shape), as llama-server does.

A rerank request holds a ``query`` and its ``documents`` (Jina's shape: ``{"results": [{"index",
"relevance_score"}]}`` with ``usage``) or ``texts`` (TEI's: a bare list of ``{"index", "score"}``,
with ``"text"`` given ``return_text``), best first, ``top_n`` of them; each (query, document) pair is
laid out as llama-server lays it out (serving/embeddings.py ``rerank_tokens``).

Every prompt is tokenized, and its images decoded, on a thread; the prompts then run one after the
other, each on an idle slot (serving/embeddings.py), with the other slots' generations going on
between two. A request holds at most ``MAX_INPUTS`` prompts or documents. A request whose client
goes away stops before its next prompt; the prompt running ends (a native decode cannot be
stopped), and its images are freed after that.

Where this differs from llama-server: a prompt over what the model can take is a 400 here (a 500
there), with llama-server's words; a mean over a picture pools every row of the prompt (llama-server
pools the last decode alone).
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pyllama_spec.errors import ContextOverflowError, ImageError, ProjectorError
from pyllama_spec.server.errors import APIError, bad_request, context_overflow
from pyllama_spec.server.images import ImageBudget, decode_image_url
from pyllama_spec.server.offload import ThreadRunner
from pyllama_spec.server.prompts import parse_prompt
from pyllama_spec.server.schema import RequestLimits
from pyllama_spec.server.service import RouteSpec, Service, read_json
from pyllama_spec.serving.chat_template import MEDIA_MARKER
from pyllama_spec.serving.embeddings import Embedding, EmbeddingInput, EmbeddingJob

EMBEDDING_PATHS = ("/embedding", "/embeddings", "/v1/embeddings")
#: The most prompts (or documents) one request may hold: OpenAI's limit of embedding inputs.
MAX_INPUTS = 2048
RERANK_PATHS = ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking")


def routes(service: Service) -> list[RouteSpec]:
    config = service.engine.config
    run = ThreadRunner()
    waiting = _Queue(service.settings.max_queue)
    pooling = service.engine.pooling  # read once: the event loop makes no native call while slots run
    if config.embeddings:
        embed = [(p, ["POST"], lambda request, oai=p.startswith("/v1/"): _route(service, request, run, waiting, oai,
                                                                               pooling))
                 for p in EMBEDDING_PATHS]
    else:
        embed = [(p, ["POST"], _refuse("embeddings", "--embeddings")) for p in EMBEDDING_PATHS]
    if config.embeddings and pooling == "rank":
        rerank = [(p, ["POST"], lambda request: _rerank_route(service, request, run, waiting)) for p in RERANK_PATHS]
    else:
        rerank = [(p, ["POST"], _refuse("reranking", "--reranking")) for p in RERANK_PATHS]
    return [*embed, *rerank]


def _refuse(what: str, flag: str):
    async def refuse(request: Request) -> Response:  # llama-server's answer, before the body is read
        raise APIError(501, f"This server does not support {what}. Start it with `{flag}`",
                       type="not_supported_error", code="not_supported")

    return refuse


class _Queue:
    """Embedding requests waiting or running: at most ``limit``, as the generation queue (503 past it)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.n = limit, 0

    def __enter__(self) -> None:
        if self.n >= self.limit:
            raise APIError(503, f"the server is busy ({self.limit} embedding requests queued); retry shortly",
                           type="server_error", code="queue_full", headers={"Retry-After": "1"})
        self.n += 1

    def __exit__(self, *exc: Any) -> None:
        self.n -= 1


async def _route(service: Service, request: Request, run: ThreadRunner, waiting: _Queue, oai: bool,
                 pooling: str) -> Response:
    engine = service.engine
    if oai and pooling == "none":
        raise bad_request("Pooling type 'none' is not OAI compatible. Please use a different pooling type")
    body, size = await read_json(request, service.settings.max_body_bytes, service.settings.body_timeout)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if "input" in body:
        value = body["input"]
    elif "content" in body:
        value, oai = body["content"], False  # "content" is llama-server's own field: its own answer
    else:
        raise bad_request('"input" or "content" must be provided', "input")
    base64_out = _encoding_format(body)
    normalize = _normalize(body)
    with waiting:
        job = await run(size, _prepare, lambda: EmbeddingJob(engine, parse_inputs(value, service.limits),
                                                             normalize=normalize))
        results = await _on_slots(service, request, job)
        return await run(size, _answer, results, oai, base64_out, _model(body, service))


def _model(body: dict, service: Service) -> str:
    return body["model"] if isinstance(body.get("model"), str) else service.settings.alias


async def _on_slots(service: Service, request: Request, job: EmbeddingJob) -> list[Embedding]:
    """Each of the job's prompts run on an idle slot, one slot operation a prompt (the other slots'
    generations go on between two); stops between two when the client has gone. The job is closed
    once the slot's work on it ended."""
    results, done = [], None
    try:
        for i in range(len(job.prompts)):
            if i and await request.is_disconnected():
                raise APIError(499, "the client went away", code="client_closed_request")
            done = service.worker.on_slot(service.engine.idle_slot(), job.prompt(i))
            # shielded: a client that goes away leaves the slot's work to end (it reads the job's images)
            results.append(await asyncio.shield(done))
            service.metrics.add_embeddings(results[-1].n_tokens, results[-1].n_decodes)
        return results
    finally:
        if done is None or done.done():
            job.close()
        else:  # the client went away while the slot works: the job is closed when that work ends
            done.add_done_callback(lambda f: (job.close(), f.cancelled() or f.exception()))


async def _rerank_route(service: Service, request: Request, run: ThreadRunner, waiting: _Queue) -> Response:
    body, size = await read_json(request, service.settings.max_body_bytes, service.settings.body_timeout)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    query = body.get("query")
    if "query" not in body:
        raise bad_request('"query" must be provided', "query")
    if not isinstance(query, str):
        raise bad_request('"query" must be a string', "query")
    tei = "texts" in body  # TEI's shape; else Jina's
    documents = body.get("documents", body.get("texts"))
    if not isinstance(documents, list) or not documents or not all(isinstance(d, str) for d in documents):
        raise bad_request('"documents" must be a non-empty string array', "documents")
    top_n = body.get("top_n", len(documents))
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0:
        raise bad_request("'top_n' must be an integer >= 0", "top_n")
    return_text = tei and body.get("return_text") is True
    _check_count(len(documents), "documents")
    with waiting:
        job = await run(size, _prepare, lambda: EmbeddingJob.rerank(service.engine, query, documents))
        results = await _on_slots(service, request, job)
    ranked = sorted(range(len(results)), key=lambda i: -float(results[i].vectors[0, 0]))[:top_n]
    label = "score" if tei else "relevance_score"
    out = []
    for i in ranked:
        item = {"index": i, label: float(results[i].vectors[0, 0])}
        if return_text:
            item["text"] = documents[i]
        out.append(item)
    if tei:
        return JSONResponse(out)
    n_tokens = sum(e.n_tokens for e in results)
    return JSONResponse({"model": _model(body, service), "object": "list",
                         "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}, "results": out})


def _check_count(n: int, field: str) -> None:
    if n > MAX_INPUTS:
        raise bad_request(f"'{field}' holds {n} entries; at most {MAX_INPUTS} per request", field)


def _encoding_format(body: dict) -> bool:
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise bad_request("The format to return the embeddings in. Can be either float or base64", "encoding_format")
    return fmt == "base64"


def _normalize(body: dict) -> int | None:
    if "embd_normalize" not in body:
        return None
    n = body["embd_normalize"]
    if isinstance(n, bool) or not isinstance(n, int) or n < -1:
        raise bad_request("'embd_normalize' must be an integer >= -1 (-1 none, 0 max-abs, 1 taxicab, 2 euclidean, "
                          ">2 p-norm)", "embd_normalize")
    return n


def _prepare(make_job) -> EmbeddingJob:
    """On a thread: the job made (its prompts parsed, tokenized, their images decoded and loaded);
    what it refuses is a 400."""
    try:
        return make_job()
    except ContextOverflowError as e:
        raise context_overflow(e, "input") from None
    except (ImageError, ProjectorError) as e:
        raise bad_request(str(e), "input", code="invalid_image") from None
    except ValueError as e:
        raise bad_request(str(e), "input") from None


def parse_inputs(value: Any, limits: RequestLimits) -> list[EmbeddingInput]:
    """The prompts of ``input`` (see the module); a 400 for one of no known shape."""
    budget = ImageBudget(limits.images)  # over all the request's prompts
    # a list holding no token id at its top level is a list of prompts (llama-server's rule)
    if isinstance(value, list) and not any(isinstance(v, int) and not isinstance(v, bool) for v in value):
        if not value:
            raise bad_request('"input" must not be empty', "input")
        _check_count(len(value), "input")
        return [_entry(p, f"input[{i}]", limits, budget) for i, p in enumerate(value)]
    return [_entry(value, "input", limits, budget)]


def _entry(p: Any, where: str, limits: RequestLimits, budget: ImageBudget) -> EmbeddingInput:
    if isinstance(p, dict) and "content" in p:
        return _content(p["content"], where, limits, budget)
    prompt = parse_prompt(p, where, limits.n_vocab, limits.images, budget, field="input", to_generate=False)
    return EmbeddingInput(prompt["prompt"], tuple(prompt.get("images", ())))


def _content(parts: Any, where: str, limits: RequestLimits, budget: ImageBudget) -> EmbeddingInput:
    """An OpenAI content array: its texts joined, a media marker where each image was."""
    if not isinstance(parts, list):
        raise bad_request(f'{where}: "content" must be an array of parts', "input")
    text, images = [], []
    for k, part in enumerate(parts):
        at = f"{where}.content[{k}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{at}.text must be a string", "input")
            text.append(part["text"])
        elif kind == "image_url":
            if limits.images.max_images == 0:  # llama-server's words: the server has no projector (--mmproj)
                raise bad_request("Multimodal data provided, but model does not support multimodal requests.",
                                  "input", code="invalid_image")
            ref = part.get("image_url")
            url = ref.get("url") if isinstance(ref, dict) else ref
            if not isinstance(url, str):
                raise bad_request(f"{at}.image_url.url must be a string", "input")
            budget.take(1, "input")
            images.append(decode_image_url(url, limits.images, at, budget))
            text.append(MEDIA_MARKER)
        else:
            shown = repr(kind)[:40] if kind is not None else "no type"
            raise bad_request(f"{at} has unsupported type {shown} (use 'text' or 'image_url')", "input")
    return EmbeddingInput("".join(text), tuple(images))


def _answer(results: list[Embedding], oai: bool, base64_out: bool, model: str) -> Response:
    """On a thread: the JSON of the vectors (a vector per token can be large)."""
    if not oai:
        return JSONResponse([{"index": i, "embedding": e.vectors.tolist()} for i, e in enumerate(results)])
    data = []
    for i, e in enumerate(results):
        vector = e.vectors[0]
        if base64_out:
            encoded = base64.b64encode(np.ascontiguousarray(vector, dtype="<f4").tobytes()).decode()
            data.append({"embedding": encoded, "index": i, "object": "embedding", "encoding_format": "base64"})
        else:
            data.append({"embedding": vector.tolist(), "index": i, "object": "embedding"})
    n_tokens = sum(e.n_tokens for e in results)
    return JSONResponse({"model": model, "object": "list", "usage": {"prompt_tokens": n_tokens,
                                                                       "total_tokens": n_tokens}, "data": data})
