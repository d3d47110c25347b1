#!/usr/bin/env python3
"""The projector's encode with flash attention off and auto (llama-server's default), side by side.

    python bench/projector_flash_attn.py --repeats 7 --size 672

The embedded pair's projector on the demo's test card (one thread), the two settings interleaved per
repeat; encode milliseconds min / median / max, and how far the embeddings are apart (the target and
its drafts read the same embeddings whichever it is, so speculative output stays target-only's).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pyllama_spec as ps  # noqa: E402
from pyllama_spec.bindings.mtmd import Bitmap, Projector  # noqa: E402
from pyllama_spec import MEDIA_MARKER  # noqa: E402
from pyllama_spec.embedded import draw_demo_image  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--size", type=int, default=672)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    m = ps.embedded_models()
    model = ps.Model(m.target)
    image = np.asarray(draw_demo_image(args.size).convert("RGB"))
    settings = {"off": False, "auto": None}
    projectors = {name: Projector(str(m.mmproj), model, use_gpu=False, n_threads=args.threads, flash_attn=fa)
                  for name, fa in settings.items()}
    times: dict[str, list[float]] = {name: [] for name in settings}
    out = {}
    for _ in range(args.repeats):
        for name, p in projectors.items():
            media = next(c for c in p.tokenize(f"look: {MEDIA_MARKER}", [Bitmap(image)]) if not c.is_text)
            t = time.perf_counter()
            out[name] = p.encode(media)
            times[name].append((time.perf_counter() - t) * 1000)
    print(f"| flash attention | encode ms min / median / max ({media.n_tokens} rows) |\n|---|---|")
    for name, ms in times.items():
        print(f"| {name} | {min(ms):.0f} / {statistics.median(ms):.0f} / {max(ms):.0f} |")
    ratio = sorted(a / b for a, b in zip(times["off"], times["auto"]))
    print(f"\noff / auto per repeat: {ratio[0]:.2f} / {statistics.median(ratio):.2f} / {ratio[-1]:.2f}; "
          f"embeddings apart by at most {np.abs(out['off'] - out['auto']).max():.2e} "
          f"(largest {np.abs(out['off']).max():.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
