"""The embedding routes of ``serve --embeddings`` (server/embeddings.py): the cases of llama.cpp's
own tools/server/tests/unit/test_embedding.py and test_vision_api.py's embedding tests, on the tiny
BERT (bge-small's vocabulary) and the embedded vision pair; the openai client; and, where
llama-server is built, the same vectors as llama-server's on the same file."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from conftest import LLAMA_SERVER, N_THREADS, NO_LLAMA_SERVER

import pyllama_spec as ps

pytest.importorskip("starlette", reason="the server extra is not installed")
from pyllama_spec.server import ServerSettings  # noqa: E402
from serving import LocalServer, http as post  # noqa: E402

EPSILON = 1e-3
BERT = dict(n_ctx=512, n_batch=128, n_ubatch=128, n_parallel=2, n_threads=N_THREADS, embeddings=True)


@pytest.fixture(scope="module")
def bert_servers(tiny_bert):
    """A server per pooling the upstream tests use: "last" (most of them), "mean", "none"."""
    engines, servers = [], {}
    try:
        for pooling in ("last", "mean", "none"):
            engines.append(ps.load(tiny_bert, **BERT, pooling=pooling))
            servers[pooling] = LocalServer(engines[-1], ServerSettings(alias="bert-bge-small"))
        yield {k: s.url for k, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
        for e in engines:
            e.close()


@pytest.fixture(scope="module")
def url(bert_servers):
    return bert_servers["last"]


def _norm(v) -> float:
    return float(np.sqrt(np.sum(np.square(v))))


def test_single_and_multiple_inputs_are_normalised_vectors(url):
    status, body = post(url, "/v1/embeddings", {"input": "I believe the meaning of life is"})
    assert status == 200 and len(body["data"]) == 1 and body["object"] == "list"
    vector = body["data"][0]["embedding"]
    assert len(vector) > 1 and abs(_norm(vector) - 1) < EPSILON
    assert body["model"] == "bert-bge-small" and body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 2
    prompts = ["I believe the meaning of life is", "Write a joke about AI from a very long prompt which will not be "
               "truncated", "This is a test", "This is another test"]
    status, body = post(url, "/v1/embeddings", {"input": prompts, "model": "text-embedding-3-small"})
    assert status == 200 and [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    assert body["model"] == "text-embedding-3-small"  # the request's model is echoed, as llama-server does
    assert all(d["object"] == "embedding" and len(d["embedding"]) == len(vector) for d in body["data"])
    np.testing.assert_allclose(body["data"][0]["embedding"], vector, atol=1e-6)


@pytest.mark.parametrize("value,n", [
    ("", 1),  # not a crash: [CLS] [SEP]
    ("string", 1),
    ([12, 34, 56], 1),
    ([12, 34, "string", 56, 78], 1),
    (["string1", "string2"], 2),
    (["string1", [12, 34, 56]], 2),
    ([[12, 34, 56], [12, 34, 56]], 2),
    ([[12, 34, 56], [12, "string", 34, 56]], 2),
    ({"prompt_string": "string"}, 1),
    ({"content": [{"type": "text", "text": "string"}]}, 1),
    (["string1", {"prompt_string": "string2"}, {"content": [{"type": "text", "text": "string3"}]}], 3),
])
def test_every_prompt_shape_llama_server_takes(url, value, n):
    status, body = post(url, "/v1/embeddings", {"input": value})
    assert status == 200, body
    assert len(body["data"]) == n and all(len(d["embedding"]) > 1 for d in body["data"])


def test_content_parts_are_their_text_joined(url):
    status, body = post(url, "/v1/embeddings", {"input": [
        "hello world", {"content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}]})
    assert status == 200 and body["data"][0]["embedding"] == body["data"][1]["embedding"]


@pytest.mark.parametrize("value", [
    [],
    {"content": "string"},
    {"content": [{"type": "unknown"}]},
    {"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},  # no projector
    {"content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]},
    {"content": [{"type": "input_video", "input_video": {"url": "data:video/mp4;base64,AAAA"}}]},
    [12, 99999999],  # a token id outside the vocabulary
    {"prompt_string": 5},
])
def test_inputs_of_no_known_shape_are_400s(url, value):
    status, body = post(url, "/v1/embeddings", {"input": value})
    assert status == 400 and body["error"]["type"] == "invalid_request_error", body


@pytest.mark.parametrize("body,needle", [
    ({}, '"input" or "content" must be provided'),
    ({"input": "x", "encoding_format": "int8"}, "either float or base64"),
    ({"input": "x", "embd_normalize": "2"}, "embd_normalize"),
])
def test_bad_fields(url, body, needle):
    status, answer = post(url, "/v1/embeddings", body)
    assert status == 400 and needle in answer["error"]["message"]


def test_mean_pooling_and_a_request_normalisation(bert_servers):
    url = bert_servers["mean"]
    status, body = post(url, "/v1/embeddings", {"input": ["I believe the meaning of life is", "Write a joke about AI",
                                                          "This is a test"]})
    assert status == 200 and all(abs(_norm(d["embedding"]) - 1) < EPSILON for d in body["data"])
    _, raw = post(url, "/v1/embeddings", {"input": "I believe the meaning of life is", "embd_normalize": -1})
    vector = np.array(raw["data"][0]["embedding"])
    assert abs(_norm(vector) - 1) > EPSILON
    np.testing.assert_allclose(vector / _norm(vector), body["data"][0]["embedding"], atol=1e-5)


def test_pooling_none_gives_a_row_per_token_on_its_own_route_and_a_400_on_openais(bert_servers):
    url = bert_servers["none"]
    status, body = post(url, "/embeddings", {"input": "hello hello hello"})
    assert status == 200 and len(body[0]["embedding"]) == 5  # 3 words + [CLS] [SEP]
    assert all(abs(_norm(row) - 1) > EPSILON for row in body[0]["embedding"])  # rows are not normalised
    status, body = post(url, "/v1/embeddings", {"input": "hello hello hello"})
    assert status == 400 and "Pooling type 'none' is not OAI compatible" in body["error"]["message"]


def test_llama_servers_own_answer_on_embedding_and_embeddings(url):
    for path in ("/embedding", "/embeddings"):
        status, body = post(url, path, {"content": ["one", "two"]})  # "content": llama-server's own shape
        assert status == 200 and [e["index"] for e in body] == [0, 1]
        assert len(body[0]["embedding"]) == 1 and len(body[0]["embedding"][0]) > 1  # pooled: one row
    _, oai = post(url, "/v1/embeddings", {"content": "one"})  # "content" answers llama-server's shape there too
    assert isinstance(oai, list)


def test_the_openai_client_single_multiple_and_base64(url):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(api_key="dummy", base_url=url + "/v1")
    res = client.embeddings.create(model="text-embedding-3-small", input="I believe the meaning of life is")
    assert len(res.data) == 1 and len(res.data[0].embedding) > 1
    _, plain = post(url, "/v1/embeddings", {"input": "I believe the meaning of life is"})
    np.testing.assert_allclose(res.data[0].embedding, plain["data"][0]["embedding"], atol=1e-6)
    res = client.embeddings.create(model="x", input=["a", "b", "c", "d"])
    assert len(res.data) == 4 and all(len(d.embedding) > 1 for d in res.data)
    status, body = post(url, "/v1/embeddings", {"input": "I believe the meaning of life is", "encoding_format": "base64"})
    decoded = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert body["data"][0]["encoding_format"] == "base64"
    np.testing.assert_allclose(decoded, plain["data"][0]["embedding"], atol=1e-6)


def test_a_prompt_too_long_is_refused_with_llama_servers_words_and_the_server_goes_on(url):
    status, body = post(url, "/v1/embeddings", {"input": "This is a test " * 512})
    assert status == 400 and "too large" in body["error"]["message"]  # (a 500 in llama-server, same words)
    status, body = post(url, "/v1/embeddings", {"input": ["I believe the meaning of life is"] * 5})
    assert status == 200
    first = body["data"][0]["embedding"]
    assert all(np.allclose(d["embedding"], first, atol=EPSILON) for d in body["data"])


def test_a_request_holds_at_most_2048_inputs(url, reranker):
    status, body = post(url, "/v1/embeddings", {"input": ["a"] * 2049})
    assert status == 400 and "at most 2048" in body["error"]["message"]
    status, body = post(reranker, "/rerank", {"query": "q", "documents": ["a"] * 2049})
    assert status == 400 and "at most 2048" in body["error"]["message"]


def test_a_huge_rerank_query_is_refused_before_it_is_tokenized_once_per_document(reranker):
    status, body = post(reranker, "/rerank", {"query": "word " * 200_000, "documents": ["a"] * 2048})
    assert status == 400 and "too large" in body["error"]["message"]


def test_without_embeddings_the_routes_answer_501(tiny_bert):
    with ps.load(tiny_bert, n_ctx=512, n_threads=N_THREADS) as engine, LocalServer(engine, ServerSettings()) as s:
        status, body = post(s.url, "/v1/embeddings", {"input": "x"})
    assert status == 501 and body["error"]["type"] == "not_supported_error"


# --- a vision model (llama-server's test_vision_embeddings*, on the embedded pair)

@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    from pyllama_spec.embedded import draw_demo_image, embedded_models

    models = embedded_models()
    engine = ps.load(models.target, mmproj=models.mmproj, n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=N_THREADS,
                     embeddings=True, pooling="mean")
    server = LocalServer(engine, ServerSettings())
    buf = io.BytesIO()
    draw_demo_image(224).save(buf, format="PNG")
    yield server.url, base64.b64encode(buf.getvalue()).decode()
    server.stop()
    engine.close()


@pytest.mark.parametrize("prompt,image,ok", [
    ("What is this: <__media__>\n", "picture", True),
    ("What is this: <__media__>\n", "malformed", False),  # not image data
    ("What is this:\n", "picture", False),  # an image without its marker
])
def test_vision_embeddings(vision, prompt, image, ok):
    url, b64 = vision
    data = b64 if image == "picture" else "bWFsZm9ybWVk"
    status, body = post(url, "/embeddings", {"content": [
        {"prompt_string": prompt, "multimodal_data": [data]},
        {"prompt_string": prompt, "multimodal_data": [data]},
        {"prompt_string": prompt}]})
    if ok:
        assert status == 200, body
        assert body[0]["embedding"] == body[1]["embedding"]  # the same picture: the same vector
        assert body[0]["embedding"] != body[2]["embedding"]  # the picture counts
    else:
        assert status == 400, body


def test_vision_embeddings_in_openai_content(vision):
    url, b64 = vision
    status, body = post(url, "/v1/embeddings", {"input": [
        {"content": [{"type": "text", "text": "What is this: "},
                     {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64}},
                     {"type": "text", "text": "\n"}]},
        {"prompt_string": "What is this: <__media__>\n", "multimodal_data": [b64]},
        "What is this: \n"]})
    assert status == 200, body
    data = body["data"]
    assert data[0]["embedding"] == data[1]["embedding"] and data[0]["embedding"] != data[2]["embedding"]
    assert data[0]["index"] == 0 and body["usage"]["prompt_tokens"] > 64  # the picture's rows are counted


def test_generation_still_runs_on_an_embeddings_server(vision):
    url, _ = vision
    status, body = post(url, "/v1/completions", {"prompt": "def f(", "max_tokens": 4, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 4


# --- the reference: llama-server on the same file

@pytest.mark.skipif(LLAMA_SERVER is None, reason=NO_LLAMA_SERVER)
@pytest.mark.parametrize("pooling", ["last", "mean", "cls", "none"])
def test_the_same_vectors_as_llama_server(tiny_bert, pooling):
    from test_llama_server_parity import _Process

    theirs = _Process(["-m", str(tiny_bert), "-c", "512", "-b", "128", "-ub", "128", "-np", "2", "--embeddings",
                       "--pooling", pooling, "--no-warmup", "-t", str(N_THREADS)])
    try:
        with ps.load(tiny_bert, **BERT, pooling=pooling) as engine, LocalServer(engine, ServerSettings()) as ours:
            inputs = ["I believe the meaning of life is", "hello hello hello", "", [101, 7592, 102]]
            path = "/embeddings" if pooling == "none" else "/v1/embeddings"
            (s1, a), (s2, b) = (post(u, path, {"input": inputs}) for u in (ours.url, theirs.url))
            assert s1 == s2 == 200, (a, b)
            if pooling == "none":
                for x, y in zip(a, b):
                    np.testing.assert_allclose(x["embedding"], y["embedding"], atol=1e-4)
            else:
                for x, y in zip(a["data"], b["data"]):
                    np.testing.assert_allclose(x["embedding"], y["embedding"], atol=1e-4)
                assert a["usage"] == b["usage"]
            too_long = {"input": "This is a test " * 100}
            (s1, a), (s2, b) = (post(u, path, too_long) for u in (ours.url, theirs.url))
            assert s1 != 200 and s2 != 200
            assert "too large" in a["error"]["message"] and "too large" in b["error"]["message"]
    finally:
        theirs.stop()


# --- reranking (llama-server's test_rerank.py cases, on the tiny reranker)

DOCUMENTS = ["A machine is a physical system that uses power to apply forces.",
             "Learning is the process of acquiring new understanding.",
             "Machine learning is a field of study in artificial intelligence.",
             "Paris, capitale de la France, est une grande ville européenne."]


@pytest.fixture(scope="module")
def reranker(tiny_reranker):
    engine = ps.load(tiny_reranker, n_ctx=512, n_batch=512, n_ubatch=512, n_threads=N_THREADS, embeddings=True,
                     pooling="rank")
    server = LocalServer(engine, ServerSettings(alias="jina-reranker"))
    yield server.url
    server.stop()
    engine.close()


def test_rerank_jina_and_tei_shapes_best_first(reranker):
    status, body = post(reranker, "/rerank", {"query": "Machine learning is", "documents": DOCUMENTS})
    assert status == 200 and body["object"] == "list" and body["model"] == "jina-reranker"
    scores = [r["relevance_score"] for r in body["results"]]
    assert sorted(r["index"] for r in body["results"]) == [0, 1, 2, 3] and scores == sorted(scores, reverse=True)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 4 * 5
    for path in ("/reranking", "/v1/rerank", "/v1/reranking"):
        assert post(reranker, path, {"query": "Machine learning is", "documents": DOCUMENTS})[1] == body
    status, tei = post(reranker, "/rerank", {"query": "Machine learning is", "texts": DOCUMENTS, "return_text": True})
    assert status == 200 and [r["index"] for r in tei] == [r["index"] for r in body["results"]]
    assert all(r["text"] == DOCUMENTS[r["index"]] and r["score"] == s for r, s in zip(tei, scores))


@pytest.mark.parametrize("top_n,n", [(None, 4), (2, 2), (4, 4), (99, 4), (0, 0)])
def test_rerank_top_n(reranker, top_n, n):
    body = {"query": "Machine learning is", "documents": DOCUMENTS, **({} if top_n is None else {"top_n": top_n})}
    status, answer = post(reranker, "/rerank", body)
    assert status == 200 and len(answer["results"]) == n


@pytest.mark.parametrize("body", [
    {"query": "q", "documents": []}, {"query": "q", "documents": None}, {"query": "q", "documents": 123},
    {"query": "q", "documents": [1, 2, 3]}, {"documents": ["a"]}, {"query": 5, "documents": ["a"]},
    {"query": "q", "documents": ["a"], "top_n": -1}])
def test_invalid_rerank_requests_are_400s(reranker, body):
    status, answer = post(reranker, "/rerank", body)
    assert status == 400 and "error" in answer


def test_rerank_needs_reranking(url):
    status, body = post(url, "/rerank", {"query": "q", "documents": ["a"]})  # an embeddings server, pooling last
    assert status == 501 and "Start it with `--reranking`" in body["error"]["message"]


@pytest.mark.skipif(LLAMA_SERVER is None, reason=NO_LLAMA_SERVER)
def test_the_same_ranking_as_llama_server(tiny_reranker, reranker):
    from test_llama_server_parity import _Process

    theirs = _Process(["-m", str(tiny_reranker), "-c", "512", "-b", "512", "-ub", "512", "--reranking",
                       "--no-warmup", "-t", str(N_THREADS)])
    try:
        for query, docs in (("Machine learning is", DOCUMENTS), ("Which city?", ["Machine learning is ", "Paris"])):
            (s1, a), (s2, b) = (post(u, "/rerank", {"query": query, "documents": docs}) for u in (reranker, theirs.url))
            assert s1 == s2 == 200
            assert [r["index"] for r in a["results"]] == [r["index"] for r in b["results"]]
            np.testing.assert_allclose([r["relevance_score"] for r in a["results"]],
                                       [r["relevance_score"] for r in b["results"]], atol=1e-4)
            assert a["usage"] == b["usage"]  # the pairs' tokens laid out alike
    finally:
        theirs.stop()
