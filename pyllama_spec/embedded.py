"""The trained tiny pair shipped inside the package: what `demo`, `chat`, `generate` and `serve` use
when no model is given.

``pyllama_spec/models/`` holds a ``hunyuan_vl`` M-RoPE target trained on Python standard-library
source, its (untrained) ``qwen2vl_merger`` mmproj and a DFlash draft trained against it (about
2 MB in all; ``models/README.md`` says how they were made and what they accept). Beside them, for
the other methods: an EAGLE3 draft and a small draft VLM with its own projector trained for the same
target, and a ``qwen35`` target with its MTP head and projector (4.7 MB, the folder in all). It writes
Python-like code, so a good prompt is the start of some Python source, with or without an image
before it. The target's training context was 512 tokens (an image adds only its positions: a
672x672 picture is 576 cache rows over 24 positions).
"""

from __future__ import annotations

from pathlib import Path

#: Where the pair lives inside the installed package.
MODELS_DIR = Path(__file__).resolve().parent / "models"

TARGET, MMPROJ, DRAFT = "trained-target.gguf", "trained-mmproj.gguf", "trained-draft.gguf"

#: A prompt in the style the pair was trained on (a code prefix; the corpus never saw it).
PROMPT = ('class Counter:\n    """Count things."""\n\n    def __init__(self, name):\n        self.name = name\n'
          '        self.count = 0\n\n    def __repr__(self):\n')


def embedded_models():
    """The three files of the embedded trained pair, as a ``tiny.TinyModels`` of paths.

    Raises ``ModelFileError`` (an ``OSError``) naming the missing files when the package was
    installed without its data.

    >>> import pyllama_spec as ps
    >>> m = ps.embedded_models()
    >>> with ps.load(m.target, mmproj=m.mmproj, draft=m.draft, n_threads=1) as engine:   # doctest: +SKIP
    ...     print(engine.generate("def add(a, b):\\n", max_tokens=16).text)
    """
    from pyllama_spec.devtools.tiny import TinyModels
    from pyllama_spec.errors import ModelFileError

    models = TinyModels(target=MODELS_DIR / TARGET, mmproj=MODELS_DIR / MMPROJ, draft=MODELS_DIR / DRAFT)
    missing = [p.name for p in (models.target, models.mmproj, models.draft) if not p.is_file()]
    if missing:
        raise ModelFileError(f"the embedded models are missing from {MODELS_DIR}: {', '.join(missing)} "
                             "(the package was installed without its data files; reinstall it with "
                             "`pip install .`, or pass -m/--mmproj/-md)")
    return models
