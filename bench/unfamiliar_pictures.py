#!/usr/bin/env python3
"""Every drafting method after pictures unlike the ones its files were trained with, against its own
acceptance on text: does a picture in the context make drafting worse?

    python bench/unfamiliar_pictures.py --prompts 8 --max-tokens 64 --draft-max default,short

Pictures (``pictures()``, 448 x 448, none of them in a training pool): black; random blocks of colour;
noise (kinds the pools have: other pictures of them); a photograph-like picture (smooth colour
gradients under soft blobs); a screenshot-like page (a title bar and lines of text on white). Each goes before a held-out 400-character code prompt
(``<__media__>\\n`` + prompt); the text condition is the prompt alone. Two worlds:

* the embedded one (``pyllama_spec/models/trained-*``): DFlash, EAGLE3, the draft VLM blind and
  seeing, on the hunyuan_vl target; the qwen35 target's MTP head with the picture's rows in its cache
  and without; n-gram;
* the reading world (``reading-*``): its MTP head and its EAGLE3 draft, each with and without the
  picture's rows; its draft model blind and seeing; its DFlash draft at target and at sequential
  positions; n-gram.

``--draft-max default`` leaves each method at the engine's default draft length (the registry's
``Method.draft_max`` since 2026-12-06: 5 for DFlash and n-gram, 3 for the others; 16 before, in the
older tables of bench/RESULTS.md); ``short`` gives 7, and 3 to MTP (as bench/drafters_after_images.py
does). Greedy; every output is checked against the
target alone's on the same prompt and picture. Printed: acceptance on text, after each picture, and
the lowest ratio of the two.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from measure_trained_pair import held_out_prompts  # noqa: E402

import pyllama_spec as ps  # noqa: E402
from pyllama_spec.devtools import reading  # noqa: E402

MODELS = REPO / "pyllama_spec" / "models"
MARKER = "<__media__>"


def pictures(size: int = 448, seed: int = 7) -> dict[str, np.ndarray]:
    """Five kinds of picture, uint8 [size, size, 3], drawn from ``seed``."""
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng(seed)
    out = {"black": np.zeros((size, size, 3), np.uint8)}
    blocks = np.zeros((size, size, 3), np.uint8)
    for _ in range(24):
        y, x = rng.integers(0, size, 2)
        h, w = rng.integers(size // 16, size // 3, 2)
        blocks[y:y + h, x:x + w] = rng.integers(0, 256, 3)
    out["random blocks"] = blocks
    out["noise"] = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    yy, xx = np.mgrid[:size, :size] / size
    photo = np.stack([90 + 120 * yy, 140 + 60 * np.sin(3 * xx), 200 - 150 * yy * xx], -1)
    img = Image.fromarray(np.clip(photo, 0, 255).astype(np.uint8))
    d = ImageDraw.Draw(img)
    for _ in range(12):
        x, y, r = (int(v) for v in rng.integers(0, size, 3) // (1, 1, 4))
        d.ellipse((x - r, y - r, x + r, y + r), fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    out["photograph-like"] = np.asarray(img.filter(ImageFilter.GaussianBlur(12)))
    page = Image.new("RGB", (size, size), (255, 255, 255))
    d = ImageDraw.Draw(page)
    d.rectangle((0, 0, size, 28), fill=(40, 70, 140))
    d.text((8, 8), "Settings - Account", fill=(255, 255, 255))
    words = ["name", "value", "user", "email", "save", "cancel", "total", "items", "open", "file", "edit"]
    for row in range(40, size - 16, 16):
        line = " ".join(rng.choice(words, size=int(rng.integers(3, 9))))
        d.text((12 + int(rng.integers(0, 3)) * 16, row), line, fill=(30, 30, 30))
    out["screenshot-like page"] = np.asarray(page)
    return out


def methods(world: str, short: bool) -> dict[str, dict]:
    """name -> (target, mmproj, load keywords, drafter writes_media or None) of a world."""
    n = (lambda mtp: dict(draft_max=3 if mtp else 7)) if short else (lambda mtp: {})
    if world == "embedded":
        t, mm = MODELS / "trained-target.gguf", MODELS / "trained-mmproj.gguf"
        q, qmm = MODELS / "trained-qwen35-mtp.gguf", MODELS / "trained-qwen35-mtp-mmproj.gguf"
        vlm = MODELS / "trained-draft-vlm.gguf"
        return {
            "DFlash": (t, mm, dict(spec_type="draft-dflash", draft=MODELS / "trained-draft.gguf", **n(False)), None),
            "EAGLE3": (t, mm, dict(spec_type="draft-eagle3", draft=MODELS / "trained-eagle3.gguf", **n(False)), None),
            "draft model, blind": (t, mm, dict(spec_type="draft-simple", draft=vlm, **n(False)), None),
            "draft model, seeing": (t, mm, dict(spec_type="draft-simple", draft=vlm,
                                                mmproj_draft=MODELS / "trained-draft-vlm-mmproj.gguf", **n(False)), None),
            "MTP, picture rows in its cache": (q, qmm, dict(spec_type="draft-mtp", **n(True)), True),
            "MTP, picture rows left out": (q, qmm, dict(spec_type="draft-mtp", **n(True)), False),
            "n-gram": (t, mm, dict(spec_type="ngram-simple", **n(False)), None),
        }
    f = reading.models()
    t, mm = f["target"], f["mmproj"]
    return {
        "MTP, picture rows in its cache": (t, mm, dict(spec_type="draft-mtp", **n(True)), True),
        "MTP, picture rows left out": (t, mm, dict(spec_type="draft-mtp", **n(True)), False),
        "draft model, blind": (t, mm, dict(spec_type="draft-simple", draft=f["draft_vlm"], **n(False)), None),
        "draft model, seeing": (t, mm, dict(spec_type="draft-simple", draft=f["draft_vlm"],
                                            mmproj_draft=f["draft_vlm_mmproj"], **n(False)), None),
        "EAGLE3, picture rows in its cache": (t, mm, dict(spec_type="draft-eagle3", draft=f["eagle3"], **n(False)),
                                              True),
        "EAGLE3, picture rows left out": (t, mm, dict(spec_type="draft-eagle3", draft=f["eagle3"], **n(False)), False),
        "DFlash, target positions": (t, mm, dict(spec_type="draft-dflash", draft=f["dflash"], **n(False)), None),
        "DFlash, sequential positions": (t, mm, dict(spec_type="draft-dflash", draft=f["dflash"],
                                                     draft_positions="sequential", **n(False)), None),
        "n-gram": (t, mm, dict(spec_type="ngram-simple", **n(False)), None),
    }


def accept(eng, prompts, picture, max_tokens):
    """(acceptance, tokens) over the prompts, with ``picture`` before each (None: text)."""
    drafted = accepted = 0
    toks = []
    for p in prompts:
        kw = dict(images=[picture]) if picture is not None else {}
        r = eng.generate((f"{MARKER}\n{p}" if picture is not None else p), max_tokens=max_tokens,
                         temperature=0.0, cache_prompt=False, **kw)
        drafted += r.stats.drafted
        accepted += r.stats.accepted
        toks.append(r.tokens)
    return (accepted / drafted if drafted else 0.0), toks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--worlds", default="embedded,reading")
    ap.add_argument("--draft-max", default="default,short")
    ap.add_argument("--only", default=None, help="method names separated by ';' (default: all)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    prompts = held_out_prompts(args.prompts)
    pics = pictures()
    refs: dict = {}  # (target, picture kind) -> the target alone's tokens
    rows = []
    for world in args.worlds.split(","):
        for length in args.draft_max.split(","):
            for name, (t, mm, kw, rows_in_cache) in methods(world, length == "short").items():
                if args.only and name not in args.only.split(";"):
                    continue
                if str(t) not in {k[0] for k in refs}:
                    with ps.load(t, mmproj=mm, n_threads=args.threads, flash_attn=False, spec_type="none") as plain:
                        for kind, picture in [("text", None), *pics.items()]:
                            refs[(str(t), kind)] = accept(plain, prompts, picture, args.max_tokens)[1]
                with ps.load(t, mmproj=mm, n_threads=args.threads, flash_attn=False, **kw) as eng:
                    if rows_in_cache is not None:
                        eng.drafter.writes_media = rows_in_cache
                    row = dict(world=world, method=name, draft_max=eng.drafter.n_max, lossless=True)
                    for kind, picture in [("text", None), *pics.items()]:
                        rate, toks = accept(eng, prompts, picture, args.max_tokens)
                        row["lossless"] &= toks == refs[(str(t), kind)]
                        row[kind] = rate
                    row["lowest ratio"] = min(row[k] for k in pics) / row["text"] if row["text"] else 0.0
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    kinds = list(pics)
    print("\n| world | method | draft max | text | " + " | ".join(kinds) + " | lowest / text | equals target only |")
    print("|---" * (6 + len(kinds)) + "|")
    for r in rows:
        print(f"| {r['world']} | {r['method']} | {r['draft_max']} | {r['text']:.3f} | "
              + " | ".join(f"{r[k]:.3f}" for k in kinds)
              + f" | {r['lowest ratio']:.2f} | {'yes' if r['lossless'] else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
