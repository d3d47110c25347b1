"""Embeddings through ``Engine.embed`` (serving/embeddings.py): an encoder (the tiny BERT with
bge-small's vocabulary), a reranker, and a vision target with pictures; pooled vectors combined
exactly over several decodes; the slot usable for generation afterwards."""

from __future__ import annotations

import io

import numpy as np
import pytest

import pyllama_spec as ps
from conftest import N_THREADS, load_tiny
from pyllama_spec.serving.embeddings import normalize
from pyllama_spec import EmbeddingInput

BERT = dict(n_ctx=512, n_batch=128, n_ubatch=128, n_threads=N_THREADS, embeddings=True)


@pytest.fixture(scope="module")
def bert(tiny_bert):
    with ps.load(tiny_bert, **BERT) as engine:
        yield engine


@pytest.fixture(scope="module")
def png() -> bytes:
    from pyllama_spec.embedded import draw_demo_image

    buf = io.BytesIO()
    draw_demo_image(224).save(buf, format="PNG")
    return buf.getvalue()


def test_an_encoder_embeds_each_prompt_alone_or_in_a_list_the_same(bert):
    prompts = ["Hello World", "A different prompt", ""]
    together = bert.embed(prompts)
    alone = [bert.embed(p)[0] for p in prompts]
    for a, b in zip(together, alone):
        assert a.pooling == "cls" and a.vectors.shape == (1, bert.model.n_embd_out)
        np.testing.assert_array_equal(a.vectors, b.vectors)
        assert abs(float(np.linalg.norm(a.vectors[0])) - 1) < 1e-5  # euclidean, by default
    assert together[2].n_tokens == 2  # "" is [CLS] [SEP]
    assert not np.allclose(together[0].vectors, together[1].vectors)


def test_normalisation_per_call_and_llama_cpp_rules():
    v = np.array([3.0, -4.0, 0.0], np.float32)
    np.testing.assert_allclose(normalize(v, -1), v)
    np.testing.assert_allclose(normalize(v, 0), v * 32760 / 4)
    np.testing.assert_allclose(normalize(v, 1), v / 7)
    np.testing.assert_allclose(normalize(v, 2), v / 5)
    np.testing.assert_allclose(normalize(v, 3), v / np.cbrt(27 + 64), rtol=1e-6)
    np.testing.assert_array_equal(normalize(np.zeros(3, np.float32), 2), np.zeros(3))


def test_normalize_argument_and_pooling_none_gives_a_row_per_token(bert, tiny_bert):
    raw = bert.embed("hello hello hello", normalize=-1)[0].vectors[0]
    unit = bert.embed("hello hello hello")[0].vectors[0]
    np.testing.assert_allclose(unit, raw / np.linalg.norm(raw), rtol=1e-5, atol=1e-6)
    with ps.load(tiny_bert, **BERT, pooling="none") as engine:
        (e,) = engine.embed("hello hello hello")
        width = engine.model.n_embd_out
    assert e.pooling == "none" and e.vectors.shape == (5, width)  # 3 words + [CLS] [SEP]
    assert all(abs(float(np.linalg.norm(row)) - 1) > 1e-3 for row in e.vectors)  # rows are not normalised


def test_a_prompt_over_the_ubatch_of_an_encoder_is_refused_and_the_engine_goes_on(bert, tiny_bert):
    for text in ("This is a test " * 40, "This is a test " * 512):  # over the ubatch; over the whole context
        with pytest.raises(ValueError, match=r"too large to process\. increase the physical batch size "
                                             r"\(current batch size: 128\)"):
            bert.embed(text)
    assert bert.embed("still here")[0].vectors.shape == (1, bert.model.n_embd_out)
    # where the context is smaller than the ubatch, the context is what a prompt does not fit
    with ps.load(tiny_bert, **dict(BERT, n_ctx=256, n_batch=512, n_ubatch=512)) as small:
        with pytest.raises(ps.ContextOverflowError, match="n_ctx is 256") as err:
            small.embed("This is a test " * 80)
    assert "+1 to generate" not in str(err.value)


def test_refusals(tiny_bert, bert):
    with ps.load(tiny_bert, n_ctx=512, n_threads=N_THREADS) as engine:
        with pytest.raises(ValueError, match="embeddings=True"):
            engine.embed("hello")
    with pytest.raises(ValueError, match="pooling must be one of"):
        ps.load(tiny_bert, **BERT, pooling="max")
    with pytest.raises(ValueError, match="embd_normalize"):
        bert.embed("hello", normalize=-2)
    with pytest.raises(ps.ImageError, match="no projector"):
        bert.embed(EmbeddingInput("hello", (b"\x89PNG",)))
    with pytest.raises(ValueError, match="cannot generate text"):  # an encoder: nothing to generate from
        bert.generate("hello", max_tokens=4)
    assert bert.embed("hello")[0].n_tokens == 3


def test_a_reranker_gives_one_score_per_prompt(tiny_reranker, bert):
    from pyllama_spec.serving.embeddings import rerank_tokens

    with ps.load(tiny_reranker, **BERT) as engine:
        a, b = engine.embed(["what is panda?</s><s>a bear", "what is panda?</s><s>hi"])
        assert a.pooling == "rank" and a.vectors.shape == (1, 1)
        assert a.vectors[0, 0] != b.vectors[0, 0]
        ranks = engine.rerank("Machine learning is", ["A machine", "Learning is"])
        with pytest.raises(ValueError, match="too large"):  # refused before its 64 k words are tokenized
            engine.rerank("word " * 65536, ["a", "b"])
        # llama-server's layout without a rerank template: [CLS] query [SEP] document (BERT adds no EOS)
        pair = rerank_tokens(engine.model, "Machine learning is", "A machine")
        assert list(pair) == [101, *engine.model.tokenize("Machine learning is"), 102,
                              *engine.model.tokenize("A machine")]
        assert ranks[0].n_tokens == len(pair) and ranks[0].score != ranks[1].score
        assert ranks[0].score == pytest.approx(engine.embed(ps.EmbeddingInput((pair,)))[0].vectors[0, 0], abs=1e-6)
    with pytest.raises(ValueError, match="pooling 'rank'"):
        bert.rerank("q", ["d"])


@pytest.mark.parametrize("pooling", ["mean", "cls", "last", "none"])
def test_a_vision_target_embeds_pictures_and_slices_pool_exactly(pooling, png):
    from pyllama_spec.embedded import embedded_models

    models = embedded_models()
    text = "What is this: <__media__>\n" + "a line of words to embed " * 6
    vectors = []
    for n_ubatch in (512, 16):  # one decode per part, or slices of 16 rows
        with load_tiny(models, draft=None, spec_type="none", n_batch=512, n_ubatch=n_ubatch,
                       embeddings=True, pooling=pooling) as engine:
            with_picture, again, without = engine.embed([EmbeddingInput(text, (png,)), EmbeddingInput(text, (png,)),
                                                         text.replace("<__media__>", "")])
            vectors.append(with_picture.vectors)
            np.testing.assert_array_equal(with_picture.vectors, again.vectors)
            assert with_picture.n_tokens > without.n_tokens + 32  # the picture's rows
            if pooling in ("mean", "last"):  # (a causal model's first row, "cls", is before the picture)
                assert not np.allclose(with_picture.vectors, without.vectors)
    np.testing.assert_allclose(vectors[0], vectors[1], rtol=0, atol=1e-5)


def test_generation_after_an_embedding_is_what_it_was(png):
    """The slot's cache is forgotten and the context's outputs are logits again."""
    from pyllama_spec.embedded import embedded_models

    models = embedded_models()
    with load_tiny(models, embeddings=True, pooling="mean") as engine:
        before = engine.generate("def fibonacci(n):", max_tokens=24, temperature=0).text
        engine.embed([EmbeddingInput("<__media__>\nwhat is it", (png,)), "def fibonacci(n):"])
        after = engine.generate("def fibonacci(n):", max_tokens=24, temperature=0)
    assert after.text == before and after.stats.prompt_reused == 0


def test_an_embedding_runs_between_another_slots_generation(tiny_bert):
    from pyllama_spec.embedded import embedded_models

    models = embedded_models()
    with load_tiny(models, n_parallel=2, embeddings=True, pooling="last") as engine:
        alone = engine.generate("class Stack:", max_tokens=48, temperature=0).text
        first = engine.embed("class Stack:")[0].vectors
        stream = engine.stream("class Stack:", max_tokens=48, temperature=0)
        text = next(stream).text
        during = engine.embed("class Stack:")[0].vectors  # while the stream holds a slot
        text += "".join(p.text for p in stream)
    assert text == alone
    np.testing.assert_allclose(during, first, rtol=0, atol=1e-5)


def test_embeddings_use_the_global_lora_scales_not_the_last_generations(tiny_dense, tiny_dir):
    from pyllama_spec.devtools import tiny_lora

    adapter = tiny_lora.write_lora(tiny_dir / "embed-lora.gguf", tiny_dense.target, seed=0)
    with ps.load(tiny_dense.target, lora=[adapter], n_ctx=512, n_threads=N_THREADS, embeddings=True,
                 pooling="mean") as engine:
        first = engine.embed("def f(x):")[0].vectors
        engine.generate("def f(x):", max_tokens=2, lora=[{"id": 0, "scale": 0}])  # the adapter off for it
        np.testing.assert_array_equal(engine.embed("def f(x):")[0].vectors, first)
    with ps.load(tiny_dense.target, n_ctx=512, n_threads=N_THREADS, embeddings=True, pooling="mean") as plain:
        assert not np.allclose(plain.embed("def f(x):")[0].vectors, first)  # the adapter counts


def test_an_embedding_takes_the_idle_slot_with_the_shortest_cache():
    from pyllama_spec.embedded import embedded_models

    with load_tiny(embedded_models(), n_parallel=2, embeddings=True, pooling="last") as engine:
        engine.generate("class Stack:\n    def push(self, x):", max_tokens=4, temperature=0)  # cached in a slot
        cached = [s.n_cached_rows for s in engine.sequences]
        assert sorted(cached)[0] == 0 and max(cached) > 0
        engine.embed("hello")
        assert [s.n_cached_rows for s in engine.sequences] == cached  # the chat's cache is still there
        again = engine.generate("class Stack:\n    def push(self, x):", max_tokens=4, temperature=0)
    assert again.stats.prompt_reused > 0


def test_a_picture_embedded_while_a_generation_encodes_one(run_python):
    """The slot loop's encoder thread encodes a generation's picture while an embedding (on the loop's
    thread) encodes another on the same projector: one encode at a time (two at once abort in clip.cpp)."""
    from conftest import explain_child

    res = run_python("""
        import io, threading
        import numpy as np
        import pyllama_spec as ps
        from pyllama_spec.embedded import embedded_models, draw_demo_image
        m = embedded_models()
        noise = np.random.default_rng(0).integers(0, 255, (448, 448, 3), dtype=np.uint8)
        buf = io.BytesIO(); draw_demo_image(224).save(buf, format="PNG")
        item = ps.EmbeddingInput("what: <__media__>\\n", (buf.getvalue(),))
        with ps.load(m.target, mmproj=m.mmproj, spec_type="none", n_ctx=4096, n_threads=1, n_parallel=2,
                     embeddings=True, pooling="mean") as engine:
            base = engine.embed(item)[0].vectors
            engine.slot_loop.start_thread()
            stop = threading.Event()
            def generate():
                while not stop.is_set():
                    engine.generate("look: <__media__>\\nsay", images=[noise], max_tokens=1, cache_prompt=False)
            t = threading.Thread(target=generate)
            t.start()
            try:
                same = [np.allclose(engine.embed(item)[0].vectors, base, atol=1e-4) for _ in range(40)]
            finally:
                stop.set()
                t.join()
            print("same", sum(same), "encodes", engine.projector.n_encode_calls)
    """, timeout=300)
    assert res.returncode == 0, explain_child(res)
    same, encodes = res.stdout.split()[1], int(res.stdout.split()[3])
    assert same == "40" and encodes > 41, res.stdout  # the generations' pictures were encoded meanwhile
