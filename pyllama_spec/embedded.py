"""The trained tiny pair shipped inside the package: what `demo`, `chat`, `generate` and `serve` use
when no model is given.

``pyllama_spec/models/`` holds a ``hunyuan_vl`` M-RoPE target trained on Python standard-library
source, its (untrained) ``qwen2vl_merger`` mmproj and a DFlash draft trained against it (about
2 MB in all; ``models/README.md`` says how they were made and what they accept). Beside them, for
the other methods: an EAGLE3 draft and a small draft VLM with its own projector trained for the same
target, a ``qwen35`` target with its MTP head and projector, and the reading world's files
(``devtools.reading``: a qwen35 that reads a picture of text out, its projector, a draft VLM and its
projector; 8 MB, the folder in all). It writes
Python-like code, so a good prompt is the start of some Python source, with or without an image
before it. The target's training context was 512 tokens (an image adds only its positions: a
672x672 picture is 576 cache rows over 24 positions). ``draw_demo_image`` draws the picture that
``demo`` shows the pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: Where the pair lives inside the installed package.
MODELS_DIR = Path(__file__).resolve().parent / "models"

TARGET, MMPROJ, DRAFT = "trained-target.gguf", "trained-mmproj.gguf", "trained-draft.gguf"

#: A prompt in the style the pair was trained on (a code prefix; the corpus never saw it).
PROMPT = ('class Counter:\n    """Count things."""\n\n    def __init__(self, name):\n        self.name = name\n'
          '        self.count = 0\n\n    def __repr__(self):\n')


@dataclass(frozen=True)
class TinyModels:
    """The three files of a tiny model set: the embedded pair's, or a set ``devtools.tiny`` writes."""

    target: Path
    mmproj: Path
    draft: Path


def embedded_models() -> TinyModels:
    """The three files of the embedded trained pair, as a ``TinyModels`` of paths.

    Raises ``ModelFileError`` (an ``OSError``) naming the missing files when the package was
    installed without its data.

    >>> import pyllama_spec as ps
    >>> m = ps.embedded_models()
    >>> with ps.load(m.target, mmproj=m.mmproj, draft=m.draft, n_threads=1) as engine:   # doctest: +SKIP
    ...     print(engine.generate("def add(a, b):\\n", max_tokens=16).text)
    """
    from pyllama_spec.errors import ModelFileError

    models = TinyModels(target=MODELS_DIR / TARGET, mmproj=MODELS_DIR / MMPROJ, draft=MODELS_DIR / DRAFT)
    missing = [p.name for p in (models.target, models.mmproj, models.draft) if not p.is_file()]
    if missing:
        raise ModelFileError(f"the embedded models are missing from {MODELS_DIR}: {', '.join(missing)} "
                             "(the package was installed without its data files; reinstall it with "
                             "`pip install .`, or pass -m/--mmproj/-md)")
    return models


def draw_demo_image(size: int):
    """A test card drawn with Pillow: large enough to span many ubatches and draft windows
    (``demo``'s picture; tests and benchmarks draw it too, through ``devtools.tiny``)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (30, 60, 110))
    d = ImageDraw.Draw(img)
    step = size // 8
    for i in range(8):
        d.rectangle([i * step, 0, (i + 1) * step, size // 3], fill=(32 * i, 255 - 32 * i, 128))
    d.ellipse([size // 4, size // 3, 3 * size // 4, 5 * size // 6], fill=(240, 200, 40), outline=(0, 0, 0), width=6)
    d.line([0, size - 1, size - 1, size // 2], fill=(255, 255, 255), width=10)
    return img
