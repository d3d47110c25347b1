"""The reading world: a small vision-language target whose text depends on the picture.

A picture here is one line of text (an identifier, a number, a short line of code) drawn in a
fixed bitmap font, one character to a 28 x 28 cell (the projector's 2 x 2 merged patches of 14
pixels), on a canvas of ``COLUMNS`` cells. Given :data:`PROMPT`, the trained target reads the line
out, ends it with a newline, and goes on writing code. What it reads cannot be guessed from the
prompt, so a draft that sees the picture can predict the read-out where a blind draft cannot.

    from pyllama_spec.devtools import reading
    picture = reading.render("total_count = 42")        # a PIL image
    files = reading.models()                            # {"target": ..., "mmproj": ..., drafts...}

``render`` draws the world's standard picture (dark text on a light ground, the middle size);
training draws the same glyphs with varied colours, sizes and offsets (:func:`render_varied`).
Greedy, the tiny target's text after the read-out often settles into spaces (as the embedded pair's
does after a while); sampled, it writes code.
The tokenizer of the reading world's files has no merges: one byte, one token, so the k-th token
of a read-out is the k-th cell of the picture.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

#: Pixels a side of one character's cell: 2 x 2 patches of 14 pixels, one projector row.
CELL = 28
#: Characters a picture holds, left to right (the canvas is COLUMNS cells wide, one cell tall).
COLUMNS = 16
#: The characters the font draws (printable ASCII).
CHARSET = "".join(chr(c) for c in range(32, 127))
#: The prompt that asks the target to read the picture (``<__media__>`` is where it goes).
PROMPT = "<__media__>\nRead it out, then go on:\n"

MODELS = Path(__file__).resolve().parent.parent / "models"
#: The committed files of the reading world, by role.
MODEL_FILES = {
    "target": "reading-qwen35-mtp.gguf",   # qwen35 with its MTP head (spec_type="draft-mtp")
    "mmproj": "reading-mmproj.gguf",
}
#: Its drafts by role: a small hunyuan_vl draft model (load it as ``draft=``), blind without its
#: projector and seeing with it (``mmproj_draft=``); an EAGLE3 draft (``spec_type="draft-eagle3"``),
#: which holds the target's features of the picture's rows; a DFlash draft
#: (``spec_type="draft-dflash"``), seeing with ``draft_positions="sequential"``, blind with the default
#: "target" (the picture's rows share one position and are left out).
DRAFT_FILES = {
    "draft_vlm": "reading-draft-vlm.gguf",
    "draft_vlm_mmproj": "reading-draft-vlm-mmproj.gguf",
    "eagle3": "reading-eagle3.gguf",
    "dflash": "reading-dflash.gguf",
}


@lru_cache(maxsize=1)
def _glyphs() -> dict[str, np.ndarray]:
    """Each character's mask (bool [11, 6]) in Pillow's built-in bitmap font, which Pillow
    embeds in its own source: the same pixels on every machine, no font file needed."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default_imagefont()
    out = {}
    for ch in CHARSET:
        img = Image.new("L", (6, 11), 0)
        ImageDraw.Draw(img).text((0, 0), ch, fill=255, font=font)
        out[ch] = np.asarray(img) > 127
    return out


def check_text(text: str) -> str:
    """``text`` if the world can draw it (1..COLUMNS printable ASCII characters), else ValueError."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if not 1 <= len(text) <= COLUMNS:
        raise ValueError(f"a picture holds 1 to {COLUMNS} characters, got {len(text)}")
    bad = sorted({c for c in text if c not in CHARSET})
    if bad:
        raise ValueError(f"only printable ASCII can be drawn; got {''.join(bad)!r}")
    return text


def _draw(text: str, *, ink, ground, height: int, dx: int, dy: int) -> np.ndarray:
    """uint8 [CELL, CELL * COLUMNS, 3]: each character scaled (nearest) to ``height`` pixels
    high, offset (dx, dy) from its cell's centre, ink on ground."""
    glyphs = _glyphs()
    width = max(1, round(height * 6 / 11))
    canvas = np.empty((CELL, CELL * COLUMNS, 3), np.uint8)
    canvas[:] = np.asarray(ground, np.uint8)
    rows = (np.arange(height) * 11 // height)
    cols = (np.arange(width) * 6 // width)
    top = (CELL - height) // 2 + dy
    for i, ch in enumerate(text):
        mask = glyphs[ch][rows][:, cols]
        left = i * CELL + (CELL - width) // 2 + dx
        cell = canvas[top:top + height, left:left + width]
        cell[mask] = np.asarray(ink, np.uint8)
    return canvas


def render(text: str):
    """The world's picture of ``text`` (a PIL RGB image, 448 x 28): dark ink on a light ground,
    one character to a cell, left-aligned; at most COLUMNS printable ASCII characters."""
    from PIL import Image

    return Image.fromarray(_draw(check_text(text), ink=(20, 20, 20), ground=(235, 235, 235),
                                 height=22, dx=0, dy=0))


def render_varied(text: str, rng: np.random.Generator) -> np.ndarray:
    """A training picture of ``text`` (uint8 [28, 448, 3]): ink and ground drawn at random, far
    enough apart in brightness to read; glyph height 16..26 pixels; an offset of up to 1 pixel."""
    check_text(text)
    while True:
        ink, ground = rng.integers(0, 256, size=(2, 3))
        if abs(float(ink.mean()) - float(ground.mean())) >= 90:
            break
    height = int(rng.integers(16, 27))
    dx, dy = (int(v) for v in rng.integers(-1, 2, size=2))
    return _draw(text, ink=ink, ground=ground, height=height, dx=dx, dy=dy)


def models() -> dict[str, Path]:
    """The reading world's committed files by role (target, mmproj, and one entry per draft)."""
    out = {role: MODELS / name for role, name in {**MODEL_FILES, **DRAFT_FILES}.items()}
    missing = [str(p) for p in out.values() if not p.exists()]
    if missing:
        raise FileNotFoundError(f"the reading world's files are missing: {', '.join(missing)}")
    return out
