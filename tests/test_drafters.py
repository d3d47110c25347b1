"""Every drafter behind the one protocol passes the same lossless suite; the n-gram drafter's
own rules (lookup, media separators, rollback) are tested directly."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import N_THREADS, TINY_ENGINE

import pyllama_spec as ps
from pyllama_spec.drafters import Drafter, DraftRequest, TargetDecode, TargetRows
from pyllama_spec.drafters.ngram import NgramDrafter
from pyllama_spec.drafters.registry import canonical_spec_type

PROMPT = f"Describe this: {ps.MEDIA_MARKER} in a few words."
COPY_PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n" * 3


@pytest.fixture(scope="module")
def small_draft_model(tiny_dir):
    """A 2-layer model with the tiny targets' vocabulary (another seed): a draft-simple draft."""
    from pyllama_spec.devtools import tiny

    return tiny.make_tiny_set(tiny_dir, arch="hunyuan_vl", seed=1, n_layer=2, target_layers=(1,),
                              predictable=0.5).target


def _engine(models, spec_type, draft_model=None, **kw):
    draft = {"draft-dflash": models.draft, "draft-simple": draft_model}.get(spec_type.split(",")[-1])
    return ps.load(models.target, mmproj=models.mmproj, draft=draft, spec_type=spec_type, n_ctx=4096, **TINY_ENGINE,
                   flash_attn=False, **kw)


@pytest.mark.parametrize("spec_type", ["draft-dflash", "draft-simple", "ngram-simple", "ngram-map-k", "ngram-map-k4v",
                                       "ngram-mod", "ngram-cache", "ngram-mod,draft-dflash"])
@pytest.mark.parametrize("which", ["dense", "hybrid"])
@pytest.mark.parametrize("prompt_kind", ["image", "copy"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_drafter_is_lossless(spec_type, which, prompt_kind, temperature, tiny_dense, tiny_hybrid, big_image,
                                   small_draft_model):
    models = tiny_dense if which == "dense" else tiny_hybrid
    prompt, images = (PROMPT, [big_image]) if prompt_kind == "image" else (COPY_PROMPT, [])
    with _engine(models, "none") as plain:
        expected = plain.generate(prompt, images=images, max_tokens=32, temperature=temperature, seed=5,
                                  verify="match")
    with _engine(models, spec_type, small_draft_model, draft_max=7) as spec:
        assert isinstance(spec.drafter, Drafter)
        got = spec.generate(prompt, images=images, max_tokens=32, temperature=temperature, seed=5, verify="match")
        # A second turn reuses the cache, the drafter truncated with it (a recurrent target
        # cannot roll back that far and decodes everything again).
        again = spec.generate(prompt, images=images, max_tokens=32, temperature=temperature, seed=5,
                              verify="match")
        assert (again.stats.prompt_reused > 0) == (which == "dense")
    assert got.tokens == expected.tokens and again.tokens == expected.tokens
    if spec_type.startswith("draft-") or (prompt_kind == "copy" and spec_type == "ngram-simple"):
        assert got.stats.drafted > 0  # (the other n-gram types' drafting: tests/test_ngram_types.py)


def test_a_draft_model_that_is_the_target_accepts_everything_also_after_an_image(tiny_dense, big_image):
    # The strongest check of the draft's positions: the same weights must agree on every token,
    # which they do only if the draft reads the text around the image at the target's positions.
    with _engine(tiny_dense, "draft-simple", tiny_dense.target, draft_max=7) as spec:
        s = spec.generate(PROMPT, images=[big_image], max_tokens=40).stats
    assert s.drafted > 0 and s.accepted == s.drafted


def test_a_recurrent_draft_model_is_refused_at_load(tiny_dense, tiny_hybrid):
    with pytest.raises(ps.IncompatibleModelsError, match="recurrent"):
        _engine(tiny_dense, "draft-simple", tiny_hybrid.target, draft_max=3)


def test_spec_type_names_follow_llama_cpp():
    assert canonical_spec_type("dflash") == "draft-dflash"
    assert canonical_spec_type("ngram-simple") == "ngram-simple"
    with pytest.raises(ValueError, match="spec_type"):
        canonical_spec_type("eagle")


def test_ngram_needs_no_draft_model_and_accepts_on_a_copy_heavy_prompt():
    from pyllama_spec.embedded import embedded_models

    with ps.load(embedded_models().target, spec_type="ngram-simple", n_ctx=2048, n_threads=N_THREADS,
                 draft_max=7) as engine:
        r = engine.generate(COPY_PROMPT, max_tokens=64)
    # The tiny trained target copies only some of the prompt; its drafts are still taken.
    assert r.stats.drafted > 0 and r.stats.accepted > 0


# --------------------------------------------------------------------------- the n-gram rules


def _text(tokens, pos0, seq_id=0):
    t = np.asarray(tokens, dtype=np.int32)
    return [TargetRows(np.arange(pos0, pos0 + len(t), dtype=np.int32)[None, :], False, pos0, tokens=t,
                       seq_id=seq_id)]


def _media(pos, n_rows):
    return [TargetRows(np.full((4, n_rows), pos, dtype=np.int32), True, pos, pinned=True)]


def _draft(d, id_last, seq_id=0, n_max=4):
    return d.draft([DraftRequest(seq_id, id_last, 0, 0, n_max)])[0].tokens


def test_ngram_proposes_what_followed_the_latest_match():
    d = NgramDrafter(n_max=4)
    d.process(TargetDecode(_text([1, 2, 3, 4, 5, 9, 9, 1, 2, 3, 7, 8, 1], 0)))
    assert _draft(d, 2) == [3, 7, 8, 1]  # the key [1, 2] (history + id_last) last occurred at 7
    assert _draft(d, 42) == []  # nothing ends like this


def test_ngram_keeps_copying_a_repetition_past_the_end_of_the_history():
    """A loop of period 2 (and 3): the continuation of the latest match reaches the end of the
    history after one period, and the draft goes on copying its own tokens up to n_max."""
    d = NgramDrafter(n_max=8)
    d.process(TargetDecode(_text([5, 6, 97, 31, 97, 31, 97], 0)))
    assert _draft(d, 31, n_max=8) == [97, 31, 97, 31, 97, 31, 97, 31]
    d3 = NgramDrafter(n_max=7)
    d3.process(TargetDecode(_text([9, 1, 2, 3, 1, 2, 3, 1], 0)))
    assert _draft(d3, 2, n_max=7) == [3, 1, 2, 3, 1, 2, 3]
    # The copy still stops at an image: a period that holds one is not repeated across it.
    d4 = NgramDrafter(n_max=6)
    d4.process(TargetDecode(_text([7, 1, 2], 0)))
    d4.process(TargetDecode(_media(3, 10)))
    d4.process(TargetDecode(_text([1], 4)))
    assert _draft(d4, 2, n_max=6) == []  # [1, 2] was followed by the image
    stops = NgramDrafter(n_max=8, copy_past_end=False)  # llama.cpp's rule: only what the history holds
    stops.process(TargetDecode(_text([5, 6, 97, 31, 97, 31, 97], 0)))
    assert _draft(stops, 31, n_max=8) == [97, 31]  # the history after the latest [97, 31, 97, 31]


def test_ngram_does_not_match_across_an_image():
    d = NgramDrafter(n_max=4)
    d.process(TargetDecode(_text([7, 1, 2], 0)))
    d.process(TargetDecode(_media(3, 64)))
    d.process(TargetDecode(_media(3, 64)))  # a second slice of the same image adds no second separator
    d.process(TargetDecode(_text([9, 1], 4)))
    # The key [1, 2] last occurred right before the image: what followed it was the image.
    assert _draft(d, 2) == []
    d.process(TargetDecode(_text([2, 8, 6, 1], 6)))
    assert _draft(d, 2) == [8, 6, 1, 2]


def test_ngram_rolls_back_rejected_rows_and_truncates_by_position():
    d = NgramDrafter(n_max=4)
    d.process(TargetDecode(_text([1, 2, 3, 1, 2], 0)))
    d.process(TargetDecode(_text([3, 4, 5], 5)))  # a verify batch: id_last + two drafts
    d.forget(0, 6, 6)  # only its first row stays: [1, 2, 3, 1, 2, 3]
    assert _draft(d, 1) == [2, 3, 1, 2]  # after [3, 1]: [2, 3, 1] to the end, then copied on
    d.forget(0, 3, 3)
    assert _draft(d, 1) == []  # the history is [1, 2, 3] + the key [3, 1]: no earlier "3 1"
    d.forget(0, 0, 0)
    assert _draft(d, 1) == []


def test_ngram_keeps_one_history_per_sequence():
    d = NgramDrafter(n_max=4)
    d.process(TargetDecode(_text([1, 2, 3, 4, 1], 0, seq_id=0) + _text([1, 2, 8, 9, 1], 0, seq_id=1)))
    assert _draft(d, 2, seq_id=0) == [3, 4, 1, 2]
    assert _draft(d, 2, seq_id=1) == [8, 9, 1, 2]
    d.forget(1, 0, 0)
    assert _draft(d, 2, seq_id=1) == [] and _draft(d, 2, seq_id=0) == [3, 4, 1, 2]


def test_a_draft_model_with_another_vocabulary_is_refused():
    from pathlib import Path

    from pyllama_spec.drafters.draft_model import check_draft_model

    class Facts:
        def __init__(self, n_vocab, spell):
            self.n_vocab, self.path, self.is_recurrent, self._spell = n_vocab, Path("m.gguf"), False, spell
            self.arch = "llama"

        def token_text(self, t):
            return self._spell(t)

    target = Facts(1000, str)
    with pytest.raises(ps.IncompatibleModelsError, match="1200 tokens"):
        check_draft_model(target, Facts(1200, str))
    with pytest.raises(ps.IncompatibleModelsError, match="spells token"):
        check_draft_model(target, Facts(1000, lambda t: f"<{t}>"))
    check_draft_model(target, Facts(1000, str))  # the same vocabulary passes


# --- the registry: a method is one module and one entry; the engine does not change

class RepeatLastDrafter:
    """A toy method for the registry test: proposes the last token again, n_max times."""

    name = "repeat-last"

    def __init__(self, n_max: int, n_max_limit: int) -> None:
        self.n_max, self.n_min, self.n_max_limit = n_max, 0, n_max_limit
        self.processed = 0

    def process(self, decode) -> None:
        self.processed += sum(r.n_rows for r in decode.rows)

    def draft(self, requests):
        from pyllama_spec.drafters import Proposal

        return [Proposal([rq.id_last] * rq.n_max) for rq in requests]

    def forget(self, seq_id, pos, draft_pos) -> None:  # (no begin or accept: both are optional)
        pass

    def close(self) -> None:
        pass


def memory_parts(settings):
    return []  # a token or two per sequence: nothing worth counting


def check_pair(target, draft, build_record):
    from pyllama_spec.drafters.registry import Pairing

    assert draft is None  # the entry says it needs no file
    return Pairing(limit=5, per_position_logits=False)


def make(setup):
    return RepeatLastDrafter(setup.n_max, setup.pairing.limit)


def test_a_method_added_to_the_registry_runs_through_the_unchanged_engine(monkeypatch, tiny_dense):
    from pyllama_spec.drafters import registry

    entry = registry.Method("repeat-last", __name__, draft_file=False)
    monkeypatch.setitem(registry._BY_NAME, "repeat-last", entry)
    with ps.load(tiny_dense.target, spec_type="repeat-last", n_ctx=1024, **TINY_ENGINE, draft_max=16,
                 flash_attn=False) as engine, \
            ps.load(tiny_dense.target, spec_type="none", n_ctx=1024, **TINY_ENGINE, flash_attn=False) as plain:
        assert isinstance(engine.drafter, RepeatLastDrafter) and engine.draft_max == 5  # its pairing's limit
        got = engine.generate("def main(", max_tokens=24)
        assert got.tokens == plain.generate("def main(", max_tokens=24).tokens
        assert got.stats.drafted > 0 and engine.drafter.processed > 0
        with pytest.raises(ValueError, match="draft_tree needs"):
            ps.load(tiny_dense.target, spec_type="repeat-last", draft_tree=4, n_threads=N_THREADS)


def test_an_engine_config_picks_the_method_as_load_does():
    from pyllama_spec.serving.config import EngineConfig

    assert EngineConfig(model="t.gguf").spec_type == "none"
    assert EngineConfig(model="t.gguf", draft="d.gguf").spec_type == "draft-dflash"
    assert EngineConfig(model="t.gguf", draft="d.gguf", mmproj_draft="p.gguf").spec_type == "draft-simple"
    assert EngineConfig(model="t.gguf", draft="d.gguf", spec_type="eagle3").checked().spec_type == "draft-eagle3"


@pytest.mark.parametrize("settings,message", [
    (dict(spec_type="draft-eagle3"), "spec_type='draft-eagle3' needs a draft model"),
    (dict(mmproj_draft="p.gguf"), "mmproj_draft is a draft model's own projector"),
    (dict(spec_type="medusa"), "spec_type must be one of"),
    (dict(n_ubatch=1024), "cannot exceed n_batch"),
    (dict(draft_max=-1), "draft_max must be"),
    (dict(n_parallel=0), "n_parallel must be"),
    (dict(draft="d.gguf", draft_tree=4, verify="rejection"), "draft_tree verifies"),
    (dict(draft="d.gguf", spec_type="draft-simple", draft_tree=4), "draft_tree needs a DFlash draft"),
])
def test_an_engine_config_checks_itself_before_any_file_is_read(settings, message):
    from pyllama_spec.serving.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(model="no-such-file.gguf", **settings).checked()


def test_every_registry_entry_names_a_module_with_memory_parts_check_pair_and_make():
    import importlib

    from pyllama_spec.drafters import registry

    for entry in registry.METHODS:
        module = importlib.import_module(entry.module)
        assert callable(module.memory_parts) and callable(module.check_pair) and callable(module.make), entry.name
        assert registry.method(entry.name) is entry
        for alias in entry.aliases:
            assert registry.canonical_spec_type(alias) == entry.name
    assert registry.method("none") is None
