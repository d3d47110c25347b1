"""Shared fixtures for the pyllama-spec test suite.

Fixtures (reuse them in new test files rather than writing models yourself):

* ``tiny_dir``      session folder that holds every generated tiny GGUF file.
* ``tiny_dense``    ``tiny.TinyModels`` (``.target``, ``.mmproj``, ``.draft`` paths): a dense
                    ``hunyuan_vl`` M-RoPE target (n_embd 64, 4 layers, ``predictable`` 0.5), its
                    ``clip`` mmproj, and a ``dflash`` draft with a 32-token sliding window that
                    reads target layer inputs [1, 3] and uses the ``<|mask|>`` token.
* ``tiny_hybrid``   the same trio around a hybrid ``qwen35`` target (gated delta net + attention;
                    partial rollback needs ``n_rs_seq`` > 0 on its context).
* ``tiny_fim``      ``tiny_dense``'s trio with fill-in-the-middle tokens in the vocabulary
                    (``tiny.FIM_TOKENS``: pre, suf, mid, pad, rep, sep), for /infill.
* ``tiny_server``   one ``serving.LocalServer`` for the session, shared by the modules that only
                    read from it: ``tiny_dense``'s trio, n_ctx 2048, ``N_THREADS``, flash attention
                    off, the other engine settings their defaults; ``ServerSettings(alias="tiny")``.
* ``big_image``     a deterministic, read-only 672x672 RGB uint8 numpy array (576 image tokens
                    over 24 positions through the tiny mmproj).
* ``big_image_png`` the same image written as a PNG file (Pillow), a ``Path``.
* ``ctx_kwargs``    default keyword arguments for ``Context(model, **ctx_kwargs)`` in tests:
                    one thread, flash attention off, n_ctx 1024, n_batch = n_ubatch = 64.

``TINY_ENGINE`` is the tiny models' engine settings (n_batch = n_ubatch = 64, ``N_THREADS``): pass
``**TINY_ENGINE`` to ``ps.load`` or ``Context``; ``load_tiny(models, n_ctx=..., ...)`` loads a trio
(target, mmproj, draft) with them.
* ``run_python``    runs a Python snippet in a fresh interpreter (the package importable; ``cwd=``
                    optional, ``env_extra=`` variables) and returns the ``CompletedProcess``: the way to prove that a case does not abort
                    the process, without killing the test runner when it does.

``sigint_default`` is the ``preexec_fn`` of every child a test sends Ctrl-C (SIGINT) to.

``LLAMA_SERVER``: llama-server's path, looked up once for the run (None where it is not built);
mark a test with ``needs_llama_server``, or skip with the reason ``NO_LLAMA_SERVER``.

``field_report_preset()`` gives the preset at the end of the team's field report (``FIELD_REPORT``).

Constants: ``N_THREADS`` (1: the CI machine has 2 cores and OpenMP spinning makes 2 threads
slow when anything else runs), ``REPO_ROOT``.  Import them with ``from conftest import N_THREADS``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
try:  # run from a source checkout without installing: `python -m pytest tests` from anywhere
    import pyllama_spec  # noqa: F401
except ImportError:
    sys.path.insert(0, str(REPO_ROOT))

from pyllama_spec import native_build  # noqa: E402
from pyllama_spec.devtools import tiny  # noqa: E402

def held_out_prompts(n: int) -> list[str]:
    """tools/measure_trained_pair.py's held-out prompts (the trained pairs' benchmarks use them); an
    empty list where this machine's Python has no such held-out source files."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("measure_trained_pair", REPO_ROOT / "tools" / "measure_trained_pair.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.held_out_prompts(n)


#: The team's field report (shared/reference): its last lines are a real user's llama-server preset.
FIELD_REPORT = REPO_ROOT.parent / "shared" / "reference" / "field-report-dflash-mtmd.txt"


def field_report_preset() -> str:
    """The field report's preset section, as its user wrote it (read from FIELD_REPORT)."""
    text = FIELD_REPORT.read_text()
    lines = []
    for line in text[text.index("[Qwen3.8-27B Q5]"):].splitlines():
        if not line.strip() or (lines and line.startswith("[")):
            break
        lines.append(line)
    return "\n".join(lines) + "\n"


#: llama-server from the build cache (``build.py --tools`` builds it), or None: looked up once for
#: the whole run, so that a test's skip condition and the path it starts always agree (one built
#: while the tests run is used from the next run on).
LLAMA_SERVER = native_build.find_llama_server()
NO_LLAMA_SERVER = "llama-server is not built here (python build.py --tools builds it; .ci/run does)"
needs_llama_server = pytest.mark.skipif(LLAMA_SERVER is None, reason=NO_LLAMA_SERVER)


#: Threads for every context and projector made in tests.
N_THREADS = 1

#: The tiny models' settings for ``ps.load(..., **TINY_ENGINE)`` and ``Context(..., **TINY_ENGINE)``:
#: batches of 64 rows, N_THREADS threads.
TINY_ENGINE = dict(n_batch=64, n_ubatch=64, n_threads=N_THREADS)

#: Defaults for ``Context(model, **CTX_KWARGS)`` in tests (also the ``ctx_kwargs`` fixture).
CTX_KWARGS = dict(n_ctx=1024, **TINY_ENGINE, flash_attn=False)


def load_tiny(models, **kw):
    """``ps.load`` of a trio (``tiny_dense``, ``tiny_hybrid``, ``embedded_models()``): its target,
    mmproj and draft, with TINY_ENGINE; ``kw`` adds settings or overrides these (``draft=None``:
    no draft)."""
    import pyllama_spec as ps

    return ps.load(models.target, **{"mmproj": models.mmproj, "draft": models.draft, **TINY_ENGINE, **kw})

#: Size of ``big_image`` and what the tiny mmproj makes of it.
BIG_IMAGE_SIZE = 672
BIG_IMAGE_N_TOKENS = 576
BIG_IMAGE_N_POS = 24


@pytest.fixture(scope="session")
def n_threads() -> int:
    """Threads for contexts and projectors in tests (1)."""
    return N_THREADS


@pytest.fixture
def ctx_kwargs() -> dict:
    """A fresh copy of the default Context keyword arguments for tests."""
    return dict(CTX_KWARGS)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """One folder per session for the generated tiny GGUF files."""
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_dense(tiny_dir) -> tiny.TinyModels:
    """Dense hunyuan_vl target + mmproj + dflash draft (window 32, predictable 0.5, seed 0)."""
    return tiny.make_tiny_set(tiny_dir, arch="hunyuan_vl", seed=0, window=32, predictable=0.5)


@pytest.fixture(scope="session")
def tiny_fim(tiny_dir) -> tiny.TinyModels:
    """tiny_dense's trio with the FIM tokens (tiny.FIM_TOKENS) after the others."""
    return tiny.make_tiny_set(tiny_dir, arch="hunyuan_vl", seed=0, window=32, predictable=0.5, fim=True)


@pytest.fixture(scope="session")
def tiny_hybrid(tiny_dir) -> tiny.TinyModels:
    """Hybrid qwen35 target + mmproj + dflash draft (window 32, predictable 0.5, seed 0)."""
    return tiny.make_tiny_set(tiny_dir, arch="qwen35", seed=0, window=32, predictable=0.5)


@pytest.fixture(scope="session")
def tiny_bert(tiny_dir) -> Path:
    """A tiny BERT embedding model with bge-small's vocabulary (devtools/tiny_bert.py; CLS pooling)."""
    from pyllama_spec.devtools.tiny_bert import make_bert

    return make_bert(tiny_dir)


@pytest.fixture(scope="session")
def tiny_reranker(tiny_dir) -> Path:
    """tiny_bert with a classifier head and RANK pooling."""
    from pyllama_spec.devtools.tiny_bert import make_bert

    return make_bert(tiny_dir, rerank=True)


@pytest.fixture(scope="session")
def tiny_server(tiny_dense):
    """``tiny_dense``'s trio served for the whole session (n_ctx 2048, N_THREADS threads, flash
    attention off, ``ServerSettings(alias="tiny")``): a ``serving.LocalServer``, its engine at
    ``.engine``. Several modules send it requests, in whatever order they run: use it only where a
    test's answers do not depend on what was sent before (no slot save/restore or /slots
    contents, no LoRA scales, no full queue, no /metrics counted from zero, no cold cache, no
    stop). A test that needs any of these starts its own server."""
    import pyllama_spec as ps
    from serving import LocalServer

    from pyllama_spec.server import ServerSettings

    engine = ps.load(tiny_dense.target, mmproj=tiny_dense.mmproj, draft=tiny_dense.draft, n_ctx=2048,
                     n_threads=N_THREADS, flash_attn=False)
    served = LocalServer(engine, ServerSettings(alias="tiny"))
    yield served
    served.stop()
    engine.close()


def _make_big_image() -> np.ndarray:
    n = BIG_IMAGE_SIZE
    y, x = np.mgrid[0:n, 0:n]
    rng = np.random.default_rng(1234)
    img = np.stack([(x * 255) // (n - 1), (y * 255) // (n - 1), ((x + y) * 255) // (2 * n - 2)], axis=-1)
    img = img + rng.integers(-20, 21, size=img.shape)  # texture, so patches differ
    return np.clip(img, 0, 255).astype(np.uint8)


@pytest.fixture(scope="session")
def big_image() -> np.ndarray:
    """A deterministic 672x672x3 uint8 RGB array (read-only: copy it before changing it)."""
    img = _make_big_image()
    img.setflags(write=False)
    return img


@pytest.fixture(scope="session")
def big_image_png(tiny_dir, big_image) -> Path:
    """``big_image`` as a lossless PNG file."""
    from PIL import Image

    path = tiny_dir / "big_image.png"
    Image.fromarray(np.array(big_image)).save(path)
    return path


def sigint_default() -> None:
    """Give SIGINT its default disposition (``preexec_fn`` of a child that a test sends Ctrl-C to).

    A child inherits an ignored SIGINT from its parent, as under ``nohup pytest ... &`` (a shell
    ignores SIGINT for a background job), and Python then installs no KeyboardInterrupt handler:
    the test's Ctrl-C would do nothing. An exec keeps SIG_DFL, and the child's Python installs it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="session")
def run_python():
    """Run ``code`` in a fresh interpreter that can import pyllama_spec; returns CompletedProcess.

    A child killed by SIGABRT has ``returncode`` -6 (an abort in native code). The child takes
    Ctrl-C as Python's default whatever the test runner's parent ignores (``sigint_default``).
    """

    def run(code: str, *args: str, timeout: float = 60, cwd: Path | None = None,
            env_extra: dict | None = None) -> subprocess.CompletedProcess:
        env = dict(os.environ, **(env_extra or {}))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        env.setdefault("OMP_NUM_THREADS", str(N_THREADS))
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=cwd or REPO_ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout, preexec_fn=sigint_default)

    return run


def explain_child(res: subprocess.CompletedProcess) -> str:
    """A short account of a child run for assertion messages: rc, stdout, and the native
    assertion / Python error lines of stderr (not the whole gdb backtrace ggml prints)."""
    key = [ln for ln in res.stderr.splitlines()
           if "GGML_ASSERT" in ln or "GGML_ABORT" in ln or "Error" in ln or "error:" in ln]
    return (f"child rc={res.returncode}" + (" (SIGABRT: native abort)" if res.returncode == -6 else "")
            + ("" if res.returncode < 0 else f"\nstdout: {res.stdout[-800:]}")  # a crash prints a gdb backtrace
            + "\nstderr: " + "\n".join(key[-10:] or [res.stderr[-800:]]))
