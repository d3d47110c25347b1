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
    kw = dict(n_ctx=1024, n_batch=64, n_ubatch=64, n_threads=N_THREADS, draft_max=5, flash_attn=False) | kw
    return ps.load(models.target, draft=models.draft, **kw)


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


def test_an_engine_runs_only_the_requests_it_resolved(tiny_dense):
    with _engine(tiny_dense) as engine, _engine(tiny_dense, draft_max=2) as other:
        foreign = other.resolve(RequestOptions.of("Hello", max_tokens=4))
        with pytest.raises(TypeError, match="not resolved by this engine"):
            engine.generate(foreign)
        assert engine.generate(engine.resolve(RequestOptions.of("Hello", max_tokens=4))).tokens


def test_closing_the_engine_from_inside_its_own_step_is_refused_and_it_stays_usable(tiny_dense, big_image):
    with ps.load(tiny_dense.target, mmproj=tiny_dense.mmproj, draft=tiny_dense.draft, n_ctx=2048, n_batch=64,
                 n_ubatch=64, n_threads=N_THREADS, draft_max=5, flash_attn=False) as engine:
        refused = []

        def progress(stage, done, total):
            if not refused:
                with pytest.raises(ps.EngineBusyError, match="close the engine"):
                    engine.close()
                refused.append(stage)

        prompt = f"Look: {ps.MEDIA_MARKER} and say"
        first = engine.generate(prompt, images=[big_image], max_tokens=6, progress=progress).tokens
        assert refused and engine.generate(prompt, images=[big_image], max_tokens=6).tokens == first


def test_a_ctrl_c_in_a_step_run_for_another_threads_stream_reaches_this_thread(tiny_dense, monkeypatch):
    """A thread that runs another thread's suspended stream (to get the one slot) and is interrupted
    there raises the KeyboardInterrupt itself; the other stream ends with GenerationCancelledError."""
    from pyllama_spec.serving import slot_loop

    with _engine(tiny_dense) as engine:
        alone = engine.generate("Tell me about cats", max_tokens=16, cache_prompt=False).tokens
        first_piece, resume, out = threading.Event(), threading.Event(), {}

        def suspended_reader():
            stream = engine.stream("Hello there", max_tokens=200, cache_prompt=False)
            next(stream)
            first_piece.set()
            resume.wait(60)
            try:
                out["other"] = [piece for piece in stream]
            except BaseException as e:  # noqa: BLE001 - what the other reader sees
                out["other"] = type(e).__name__

        reader = threading.Thread(target=suspended_reader)
        reader.start()
        assert first_piece.wait(60)
        real_step, me = slot_loop.speculative_step, threading.get_ident()

        def interrupted_step(*args):  # Ctrl-C landing in the step this thread runs for the other stream
            if threading.get_ident() == me:
                raise KeyboardInterrupt
            return real_step(*args)

        monkeypatch.setattr(slot_loop, "speculative_step", interrupted_step)
        with pytest.raises(KeyboardInterrupt):
            engine.generate("Tell me about cats", max_tokens=16, cache_prompt=False)
        monkeypatch.undo()
        resume.set()
        reader.join(60)
        assert out["other"] == "GenerationCancelledError"
        assert engine.generate("Tell me about cats", max_tokens=16, cache_prompt=False).tokens == alone


def test_a_one_slot_engine_gets_its_lazy_streams_back_when_its_server_stops(tiny_dense):
    from serving import LocalServer

    from pyllama_spec.server.service import ServerSettings

    with _engine(tiny_dense) as engine:
        server = LocalServer(engine, ServerSettings(alias="tiny"))
        try:
            assert engine.slot_loop.threaded  # the server's generations run on the loop's own thread
        finally:
            server.stop()
        assert not engine.slot_loop.threaded
        stream = engine.stream("Hello there", max_tokens=40)
        next(stream)  # advanced by its reader only: a newer stream on this thread supersedes it
        engine.generate("Tell me about cats", max_tokens=4)
        with pytest.raises(ps.GenerationCancelledError, match="superseded"):
            next(stream)
