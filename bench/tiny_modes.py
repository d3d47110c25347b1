"""Side-by-side numbers on the tiny models: target-only vs DFlash in both draft_positions modes.

    python bench/tiny_modes.py [--repeats 5] [--threads 1]

Random tiny weights: acceptance shows the mechanics (accept + rollback paths), not a real
draft's quality. Reports medians over alternating runs (A B C A B C ...).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import numpy as np

import pyllama_spec as ps
from pyllama_spec.devtools import tiny
from pyllama_spec.serving.engine import load


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    folder = tempfile.mkdtemp()
    image = np.random.default_rng(0).integers(0, 255, (672, 672, 3), dtype=np.uint8)
    prompts = {"text": ("The quick brown fox jumps over the lazy dog", []),
               "image": (f"Describe this: {ps.MEDIA_MARKER} in a few words.", [image])}
    print("| target | prompt | engine | acceptance | mean accepted length | prefill ms | decode ms | tokens/s |")
    print("|---|---|---|---|---|---|---|---|")
    for arch in ("hunyuan_vl", "qwen35"):
        models = tiny.make_tiny_set(folder, arch=arch, predictable=0.5)
        engines = {
            "target-only": load(models.target, mmproj=models.mmproj, spec_type="none", n_batch=64, n_ubatch=64,
                                n_threads=args.threads),
            "dflash target": load(models.target, mmproj=models.mmproj, draft=models.draft, n_batch=64, n_ubatch=64,
                                  n_threads=args.threads, draft_max=7, draft_positions="target"),
            "dflash sequential": load(models.target, mmproj=models.mmproj, draft=models.draft, n_batch=64,
                                      n_ubatch=64, n_threads=args.threads, draft_max=7,
                                      draft_positions="sequential"),
        }
        for pname, (prompt, imgs) in prompts.items():
            runs: dict[str, list] = {k: [] for k in engines}
            for _ in range(args.repeats):
                for name, engine in engines.items():
                    runs[name].append(engine.generate(prompt, images=imgs, max_tokens=args.max_tokens,
                                                       cache_prompt=False).stats)
            for name, stats in runs.items():
                med = lambda f: statistics.median(f(s) for s in stats)  # noqa: E731
                print(f"| {arch} | {pname} | {name} | {stats[0].acceptance_rate:.3f} | "
                      f"{stats[0].mean_accepted_length:.2f} | {med(lambda s: s.prefill_seconds) * 1e3:.1f} | "
                      f"{med(lambda s: s.decode_seconds) * 1e3:.1f} | {med(lambda s: s.tokens_per_second):.0f} |")
        for e in engines.values():
            e.close()


if __name__ == "__main__":
    main()
