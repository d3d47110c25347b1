"""One request, parsed once: what a caller gives (``RequestOptions``) is resolved by the engine into
a typed ``Request`` (its defaults applied, every value checked before anything runs), and that
``Request`` is what runs — from Python as from the server. And one slot loop, turned by its
readers on a one-slot engine: a reader never waits for another thread's suspended stream."""

from __future__ import annotations

import threading

import pytest
from conftest import N_THREADS

import pyllama_spec as ps
from pyllama_spec.serving.request import Request, RequestOptions


def _engine(models, **kw):
    return ps.load(models.target, draft=models.draft, n_ctx=1024, n_batch=64, n_ubatch=64, n_threads=N_THREADS,
                   draft_max=5, flash_attn=False, **kw)


def test_a_request_takes_the_engines_defaults_where_it_gives_nothing(tiny_dense):
    with _engine(tiny_dense, sampling={"temperature": 0.7, "top_k": 12, "seed": 9}) as engine:
        r = engine.resolve(RequestOptions(prompt="Hello"))
        assert isinstance(r, Request)
        assert (r.sampling.temperature, r.sampling.top_k, r.seed) == (0.7, 12, 9)
        assert (r.draft.n_max, r.draft.verify, r.draft.positions) == (5, "match", "target")
        assert (r.output.max_tokens, r.output.stop) == (128, ())
        given = engine.resolve(RequestOptions.of("Hello", temperature=0.0, seed=3, draft_max=2, stop="\n"))
        assert (given.sampling.temperature, given.sampling.top_k, given.seed) == (0.0, 12, 3)
        assert (given.draft.n_max, given.output.stop) == (2, ("\n",))


@pytest.mark.parametrize("options,message", [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(draft_max=99), "draft_max 99 is above"),
    (dict(draft_positions="sideways"), "draft_positions"),
    (dict(verify="maybe"), "verify"),
    (dict(logprobs=1000), "logprobs"),
    (dict(top_k="many"), "top_k"),
])
def test_a_bad_request_is_refused_when_resolved_before_anything_runs(tiny_dense, options, message):
    with _engine(tiny_dense) as engine:
        with pytest.raises(ValueError, match=message):
            engine.resolve(RequestOptions.of("Hello", **options))
        assert engine.scheduler.n_active == 0 and engine.positions.n_rows == 0  # nothing ran
    with _engine(tiny_dense) as engine:
        with pytest.raises(TypeError, match="unknown sampling setting"):
            engine.resolve(RequestOptions.of("Hello", temprature=0.5))


def test_a_resolved_request_runs_as_its_keywords_do(tiny_dense):
    with _engine(tiny_dense) as engine:
        by_keywords = engine.generate("Tell me about cats", max_tokens=16, cache_prompt=False).tokens
        request = engine.resolve(RequestOptions.of("Tell me about cats", max_tokens=16, cache_prompt=False))
        assert engine.generate(request).tokens == by_keywords
        assert [t for piece in engine.stream(request) for t in piece.tokens] == by_keywords
        with pytest.raises(TypeError, match="resolved Request"):
            engine.generate(request, max_tokens=3)


def test_a_reader_on_one_slot_runs_another_threads_suspended_stream_to_its_end_then_its_own(tiny_dense):
    with _engine(tiny_dense) as engine:
        alone = {p: engine.generate(p, max_tokens=24, cache_prompt=False).tokens
                 for p in ("Hello there", "Tell me about cats")}
        first_piece, resume, out = threading.Event(), threading.Event(), {}

        def suspended_reader():
            stream = engine.stream("Hello there", max_tokens=24, cache_prompt=False)
            tokens = list(next(stream).tokens)
            first_piece.set()
            resume.wait(60)  # suspended, holding the one slot, while the other thread generates
            out["first"] = tokens + [t for piece in stream for t in piece.tokens]

        reader = threading.Thread(target=suspended_reader)
        reader.start()
        assert first_piece.wait(60)
        # not a deadlock: this thread turns the loop, finishing the suspended stream's generation
        out["second"] = engine.generate("Tell me about cats", max_tokens=24, cache_prompt=False).tokens
        resume.set()
        reader.join(60)
        assert not reader.is_alive()
        assert out == {"first": alone["Hello there"], "second": alone["Tell me about cats"]}
