#!/usr/bin/env python3
"""Does a slot keep decoding while another slot's image is encoded? (the slot loop's encoder thread, serving/slot_loop.py)

    python bench/encode_overlap.py --repeats 3

Two slots on the tiny dense pair, one thread each: a 3000-token text chat is streaming when a
1344x1344 image request arrives. Prints the encode window (from the image's "encode" progress
to its first decoded slice), the text tokens streamed inside it, and when both were done.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import pyllama_spec as ps  # noqa: E402
from pyllama_spec import native_build  # noqa: E402
from pyllama_spec.devtools import tiny


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--side", type=int, default=1344)
    args = ap.parse_args()
    m = tiny.make_tiny_set(native_build.cache_root() / "tiny-models", arch="hunyuan_vl", seed=0, window=32,
                           predictable=0.5)
    img = (np.random.default_rng(0).random((args.side, args.side, 3)) * 255).astype(np.uint8)
    with ps.load(m.target, mmproj=m.mmproj, draft=m.draft, n_ctx=2 * 8192, n_batch=64, n_ubatch=64, n_threads=1,
                 draft_max=7, n_parallel=2) as engine:
        for _ in range(args.repeats):
            engine.reset_cache()
            arrivals, phases = [], []
            t0 = time.perf_counter()
            text = engine.submit("Tell me", max_tokens=3000, on_event=lambda kind, v: arrivals.append(
                (time.perf_counter(), len(v.tokens))) if kind == "piece" else None)
            while not arrivals:
                time.sleep(0.001)
            image = engine.submit(f"Look: {ps.MEDIA_MARKER} and say", images=[img], max_tokens=8,
                                  progress=lambda stage, d, t: phases.append((stage, time.perf_counter())))
            image.result()
            text.finished.wait(300)
            wall = time.perf_counter() - t0
            start = next(t for stage, t in phases if stage == "encode")
            end = next(t for stage, t in phases if stage == "prefill" and t > start)
            during = sum(n for t, n in arrivals if start < t < end)
            print(f"encode window {end - start:.2f} s, text tokens streamed during it {during}, "
                  f"both done in {wall:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
