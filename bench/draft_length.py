#!/usr/bin/env python3
"""Fixed draft lengths against the adaptive schedule (draft_max="auto") on the embedded
trained pair, text prompts, greedy and sampled, side by side in one run.

    python bench/draft_length.py --prompts 16 --max-tokens 128 --repeats 3

tokens/s is reported as min/median/max over the repeats (same prompts and seeds each time).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

import pyllama_spec as ps  # noqa: E402
from measure_trained_pair import held_out_prompts  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temps", default="0,0.8,1.0")
    args = ap.parse_args()
    m = ps.embedded_models()
    prompts = held_out_prompts(args.prompts)
    print("| temp | draft_max | acceptance | mean accepted length | tokens/s min / median / max |")
    print("|---|---|---|---|---|")
    with ps.load(m.target, draft=m.draft, n_ctx=4096, n_batch=64, n_ubatch=64, n_threads=1, draft_max=7) as engine:
        for temp in [float(t) for t in args.temps.split(",")]:
            for n in (1, 3, 7, 11, 15, "auto"):
                rates, drafted, accepted, steps = [], 0, 0, 0
                for _ in range(args.repeats):
                    generated, seconds = 0, 0.0
                    for i, p in enumerate(prompts):
                        s = engine.generate(p, max_tokens=args.max_tokens, temperature=temp, seed=i, draft_max=n,
                                            cache_prompt=False).stats
                        generated, seconds = generated + s.generated_tokens, seconds + s.decode_seconds
                        drafted, accepted, steps = drafted + s.drafted, accepted + s.accepted, steps + s.target_steps
                    rates.append(generated / seconds)
                print(f"| {temp} | {n} | {accepted / max(drafted, 1):.3f} | {1 + accepted / max(steps, 1):.2f} | "
                      f"{min(rates):.0f} / {statistics.median(rates):.0f} / {max(rates):.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
