"""The memory estimate before load, against what llama.cpp allocates (its own log lines)."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest
from conftest import N_THREADS, TINY_ENGINE

import pyllama_spec as ps
from pyllama_spec.bindings.devices import EnginePlacement
from pyllama_spec.devtools import tiny
from pyllama_spec.drafters.registry import method
from pyllama_spec.embedded import MODELS_DIR
from pyllama_spec.gguf import memory
from pyllama_spec.gguf.reader import read_gguf_shared
from pyllama_spec.serving.config import EngineConfig
from pyllama_spec.serving.load_plan import estimate_memory

_SIZE = re.compile(r"(model buffer size|KV buffer size|compute buffer size) =\s+([0-9.]+) MiB")


def _allocated(models, **kw) -> list[float]:
    """MiB per context in load order (target, draft): model + KV + compute, from llama.cpp's log."""
    seen: list[tuple[str, float]] = []

    class Grab(logging.Handler):
        def emit(self, record):
            m = _SIZE.search(record.getMessage())
            if m and "sched_reserve" in record.getMessage() or (m and "sched" not in record.getMessage()):
                seen.append((m.group(1), float(m.group(2))))

    log = logging.getLogger("pyllama_spec.native")
    handler, level = Grab(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with ps.load(models.target, draft=models.draft, n_threads=N_THREADS, draft_max=7, **kw):
            pass
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    weights = [v for k, v in seen if k == "model buffer size"]
    kv = [v for k, v in seen if k == "KV buffer size"]
    compute = [v for k, v in seen if k == "compute buffer size"][:2]
    # the target's context comes first, then the draft's (an SWA draft logs one KV buffer)
    return [weights[0] + kv[0] + compute[0], weights[1] + sum(kv[1:]) + compute[1]]


@pytest.mark.parametrize("which", ["tiny", "bench"])
@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_the_estimate_is_within_10_percent_of_what_llama_cpp_allocates(which, kv, tiny_dir):
    models = tiny.make_tiny_set(tiny_dir) if which == "tiny" else tiny.make_bench_set(tiny_dir)
    if kv == "q8_0" and which == "tiny":
        pytest.skip("the tiny models' 16-wide heads take no q8_0 cache (refused at load, tested elsewhere)")
    settings = dict(n_ctx=4096, n_batch=512, n_ubatch=512, flash_attn=kv != "f16", cache_type_k=kv,
                    cache_type_v=kv)
    got = _allocated(models, **settings)
    est = _estimate(models.target, draft=models.draft, **{k: v for k, v in settings.items() if k != "flash_attn"})
    for part, actual in zip(est.parts, got):
        mib = part.total / memory.MiB
        if settings["flash_attn"]:
            assert actual <= mib * 1.10  # with flash attention the estimate is an upper bound
        else:
            assert abs(mib - actual) <= 0.10 * actual, (part, actual)


@pytest.mark.parametrize("which", ["tiny qwen35", "trained qwen35"])
def test_the_mtp_heads_context_is_counted_within_10_percent(which, tiny_dir):
    """draft-mtp opens a second context on the target (its nextn layers' cache and a compute
    buffer as large as the target's): the estimate has a part for it, checked like the others."""
    path = (tiny.make_tiny_set(tiny_dir, arch="qwen35", seed=0, window=32, predictable=0.5, mtp=True).target
            if which == "tiny qwen35" else MODELS_DIR / "trained-qwen35-mtp.gguf")
    seen: list[tuple[str, float]] = []

    class Grab(logging.Handler):
        def emit(self, record):
            m = _SIZE.search(record.getMessage())
            if m:
                seen.append((m.group(1), float(m.group(2))))

    log = logging.getLogger("pyllama_spec.native")
    handler, level = Grab(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with ps.load(path, spec_type="draft-mtp", n_ctx=4096, n_ubatch=512, n_threads=N_THREADS):
            pass
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    # in load order: the weights (once), the target's KV and compute, then the head's KV and compute
    kv = [v for k, v in seen if k == "KV buffer size"]
    compute = [v for k, v in seen if k == "compute buffer size"]
    assert len(kv) == 2 and len(compute) == 2, seen
    est = _estimate(path, spec_type="draft-mtp", n_ctx=4096, n_ubatch=512)
    assert [p.name for p in est.parts] == ["target", "MTP head"]
    head = est.parts[1]
    assert head.weights == 0  # the head's weights are the target file's, counted once
    actual = kv[1] + compute[1]
    assert abs(head.total / memory.MiB - actual) <= 0.10 * actual, (head, actual)
    assert _estimate(path, n_ctx=4096).total < est.total  # without the head, less


def _estimate(model, **config) -> memory.Estimate:
    """The estimate load() checks for this configuration (EngineConfig's keywords)."""
    files = ("mmproj", "draft", "mmproj_draft")
    c = EngineConfig(model=str(model), **{k: str(v) if k in files and v is not None else v
                                          for k, v in config.items()}).checked()
    return estimate_memory(c, method(c.spec_type))


TRAINED = MODELS_DIR / "trained-target.gguf"
#: Each drafting method with a draft file, on the committed trained files: (spec_type, draft, mmproj_draft).
TRAINED_DRAFTS = {
    "draft-dflash": (MODELS_DIR / "trained-draft.gguf", None),
    "draft-eagle3": (MODELS_DIR / "trained-eagle3.gguf", None),
    "draft-simple": (MODELS_DIR / "trained-draft-vlm.gguf", None),
    "draft-simple + mmproj_draft": (MODELS_DIR / "trained-draft-vlm.gguf", MODELS_DIR / "trained-draft-vlm-mmproj.gguf"),
}


@pytest.mark.parametrize("spec_type", ["draft-eagle3", "draft-simple"])
@pytest.mark.parametrize("n_batch,n_ubatch", [(512, 512), (256, 64)])
def test_every_methods_draft_is_counted_within_10_percent(spec_type, n_batch, n_ubatch):
    """A draft-simple draft (one ubatch per batch) and an EAGLE3 draft (the target's vocabulary out)
    have their own shapes of context: each is checked against what llama.cpp allocates, like DFlash's."""
    draft, _ = TRAINED_DRAFTS[spec_type]
    settings = dict(n_ctx=4096, n_batch=n_batch, n_ubatch=n_ubatch, flash_attn=False)
    got = _allocated(SimpleNamespace(target=TRAINED, draft=draft), spec_type=spec_type, **settings)
    est = _estimate(TRAINED, draft=draft, spec_type=spec_type, n_ctx=4096, n_batch=n_batch, n_ubatch=n_ubatch)
    assert [p.name for p in est.parts] == ["target", "draft"]
    for part, actual in zip(est.parts, got):
        assert abs(part.total / memory.MiB - actual) <= 0.10 * actual, (part, actual)


@pytest.mark.parametrize("spec_type", list(TRAINED_DRAFTS))
def test_every_draft_file_and_draft_projector_enters_the_estimate(spec_type):
    """What each method adds to the target's estimate: its draft's weights (their exact bytes), cache and
    compute buffer, and a vision draft's own projector (mmproj_draft) by its weights."""
    draft, mmproj_draft = TRAINED_DRAFTS[spec_type]
    alone = _estimate(TRAINED, mmproj=MODELS_DIR / "trained-mmproj.gguf")
    est = _estimate(TRAINED, mmproj=MODELS_DIR / "trained-mmproj.gguf", draft=draft, mmproj_draft=mmproj_draft,
                    spec_type=spec_type.split()[0])
    added = [p for p in est.parts if p.name not in ("target", "mmproj")]
    assert [p.name for p in added] == ["draft"] + (["draft mmproj"] if mmproj_draft else [])
    assert est.total - alone.total == sum(p.total for p in added)
    weights = sum(t.nbytes for t in read_gguf_shared(draft).tensors.values())
    assert added[0].weights == weights and added[0].kv > 0 and added[0].compute > 0
    if mmproj_draft:
        assert added[1].total == sum(t.nbytes for t in read_gguf_shared(mmproj_draft).tensors.values())


@pytest.mark.parametrize("spec_type", list(TRAINED_DRAFTS))
def test_a_draft_that_does_not_fit_is_refused_naming_its_method(spec_type, monkeypatch):
    """A budget that holds the target alone but not its draft (or a vision draft but not its own
    projector): load() refuses before allocating, and the message names the method in use."""
    draft, mmproj_draft = TRAINED_DRAFTS[spec_type]
    spec = spec_type.split()[0]
    settings = dict(n_ctx=4096, n_batch=512, n_ubatch=512)
    with_draft = _estimate(TRAINED, draft=draft, mmproj_draft=mmproj_draft, spec_type=spec, **settings).total
    budget = with_draft - 1 if mmproj_draft else _estimate(TRAINED, **settings).total + 1
    monkeypatch.setattr(EnginePlacement, "memory_budget", lambda self, n_gpu_layers: ("CPU", budget))
    with pytest.raises(ps.InsufficientMemoryError, match=r"needs about \d+ MiB but CPU has \d+ MiB free") as info:
        ps.load(TRAINED, draft=draft, mmproj_draft=mmproj_draft, spec_type=spec, n_threads=N_THREADS, **settings)
    assert f"spec_type {spec}" in str(info.value) and method(spec).title in str(info.value)
    assert "draft" in str(info.value).split("free:")[1]  # the parts, the draft's among them


def test_the_estimate_counts_every_part_and_refuses_unknown_types(tiny_dense):
    est = _estimate(tiny_dense.target, mmproj=tiny_dense.mmproj, draft=tiny_dense.draft, n_ctx=2048)
    assert [p.name for p in est.parts] == ["target", "draft", "mmproj"]
    assert est.total == sum(p.total for p in est.parts) and est.table()[-1][0] == "all"
    with pytest.raises(ValueError, match="not a KV cache type"):
        memory.estimate(tiny_dense.target, cache_type_k="q2_k")
    with pytest.raises(ValueError, match="not a KV cache type"):  # a draft's own cache type too
        _estimate(tiny_dense.target, draft=tiny_dense.draft, cache_type_k_draft="q2_k")


def test_a_configuration_that_cannot_fit_is_refused_before_anything_is_allocated(tiny_dir):
    bench = tiny.make_bench_set(tiny_dir)  # 4096-row ubatches over 131072 cells: about 35 GiB of scores
    with pytest.raises(ps.InsufficientMemoryError, match=r"needs about \d+ MiB but CPU has \d+ MiB free") as info:
        ps.load(bench.target, draft=bench.draft, n_ctx=131072, n_batch=4096, n_ubatch=4096, n_threads=N_THREADS)
    assert isinstance(info.value, MemoryError) and "KV" in str(info.value)


def test_a_context_over_the_training_length_warns_and_loads_as_in_llama_server(tiny_dense):
    from pyllama_spec import TrainingLengthWarning

    with ps.load(tiny_dense.target, n_ctx=0, **TINY_ENGINE) as engine:
        assert engine.ctx.n_ctx == tiny.TINY_CONTEXT_LENGTH  # -c 0: the training length
    with pytest.warns(TrainingLengthWarning, match=r"above the target's training length \(4096 tokens.* "
                                                   r"n_ctx=4096 \(-c 4096\)"):
        engine = ps.load(ps.embedded_models().target, n_ctx=8192, n_threads=N_THREADS)
    with engine:
        assert engine.ctx.n_ctx == 8192
        assert engine.generate("def f(x):", max_tokens=4, temperature=0).stats.generated_tokens == 4


def test_a_context_over_a_learned_position_table_is_cut_to_it(tiny_bert):
    """BERT's positions are a table of its training length (a row past it would abort in ggml): the
    context is cut to the table, with a warning (serve's default -c 4096 on a 512-row BERT loads)."""
    with pytest.warns(ps.TrainingLengthWarning, match=r"learned table of that many rows: n_ctx is 512"):
        engine = ps.load(tiny_bert, n_ctx=4096, n_threads=N_THREADS, embeddings=True)
    with engine:
        assert engine.ctx.n_ctx == 512 and engine.embed("hello")[0].n_tokens == 3


def test_doctor_prints_the_estimate_for_a_configuration(tiny_dense):
    from click.testing import CliRunner

    from pyllama_spec.cli import main

    result = CliRunner().invoke(main, ["doctor", "-m", str(tiny_dense.target), "--mmproj", str(tiny_dense.mmproj),
                                       "-md", str(tiny_dense.draft), "-c", "2048", "-ub", "64"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "memory estimate" in result.output and "target" in result.output and "draft" in result.output


def test_doctor_counts_the_mtp_head_when_asked_for_draft_mtp():
    from click.testing import CliRunner

    from pyllama_spec.cli import main

    path = str(MODELS_DIR / "trained-qwen35-mtp.gguf")
    result = CliRunner().invoke(main, ["doctor", "-m", path, "--spec-type", "draft-mtp"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "MTP head" in result.output
    result = CliRunner().invoke(main, ["doctor", "-m", path, "--spec-type", "medusa"], terminal_width=200)
    assert result.exit_code == 1 and "cannot estimate" in result.output and "draft-mtp" in result.output


@pytest.mark.parametrize("spec_type", ["draft-eagle3", "draft-simple + mmproj_draft"])
def test_doctor_counts_every_methods_draft_and_draft_projector(spec_type):
    from click.testing import CliRunner

    from pyllama_spec.cli import main

    draft, mmproj_draft = TRAINED_DRAFTS[spec_type]
    args = ["doctor", "-m", str(TRAINED), "-md", str(draft), "-c", "2048", "-ub", "64"]
    args += ["--mmproj-draft", str(mmproj_draft)] if mmproj_draft else ["--spec-type", spec_type]
    result = CliRunner().invoke(main, args, terminal_width=200)
    assert result.exit_code == 0, result.output
    spec = spec_type.split()[0]  # with --mmproj-draft and no --spec-type: draft-simple, as load() picks
    assert f"spec_type {spec}" in result.output and "draft" in result.output.split("memory estimate")[1]
    est = _estimate(TRAINED, draft=draft, mmproj_draft=mmproj_draft, spec_type=spec, n_ctx=2048, n_ubatch=64)
    assert f"{est.total / memory.MiB:.1f} MiB" in result.output  # the estimate load() checks
    assert ("draft mmproj" in result.output) == bool(mmproj_draft)


def test_doctor_says_how_a_method_drafts_through_pictures():
    """With a projector, doctor says whether the method's drafts see the picture and through what
    (the registry's ``sees_picture``); a draft model sees only with its own projector."""
    from click.testing import CliRunner

    from pyllama_spec.cli import main
    from pyllama_spec.devtools import reading

    f = reading.models()
    base = ["doctor", "-m", str(f["target"]), "--mmproj", str(f["mmproj"]), "-c", "2048"]
    cases = [(["--spec-type", "draft-mtp"], "draft-mtp drafts seeing them through the picture's rows in the head's own cache"),
             (["-md", str(f["draft_vlm"]), "--spec-type", "draft-simple"], "draft-simple drafts blind to them (its own projector"),
             (["-md", str(f["draft_vlm"]), "--mmproj-draft", str(f["draft_vlm_mmproj"])],
              "draft-simple drafts seeing them through its own projector"),
             (["--spec-type", "ngram-simple"], "ngram-simple drafts blind to them")]
    for args, said in cases:
        result = CliRunner().invoke(main, base + args, terminal_width=400)
        assert result.exit_code == 0, result.output
        assert said in " ".join(result.output.split()), result.output
