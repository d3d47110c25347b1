#!/usr/bin/env python3
"""Fixed draft lengths against the adaptive schedule (draft_max="auto") on the embedded
trained pair, text prompts, greedy and sampled, side by side in one run.

    python bench/draft_length.py --prompts 16 --max-tokens 128 --repeats 3

tokens/s is reported as min/median/max over the repeats (same prompts and seeds each time).
The lengths run interleaved, prompt by prompt (every length once per prompt per repeat), so
that the machine's drift touches them alike; "auto / best fixed" is auto's tokens/s over the
best fixed length's (by median), per repeat.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from measure_trained_pair import held_out_prompts  # noqa: E402

import pyllama_spec as ps  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temps", default="0,0.8,1.0")
    args = ap.parse_args()
    m = ps.embedded_models()
    prompts = held_out_prompts(args.prompts)
    lengths = (1, 3, 7, 11, 15, "auto")
    print("| temp | draft_max | acceptance | mean accepted length | tokens/s min / median / max |")
    print("|---|---|---|---|---|")
    summary = []
    with ps.load(m.target, draft=m.draft, n_ctx=4096, n_batch=64, n_ubatch=64, n_threads=1, draft_max=7) as engine:
        for temp in [float(t) for t in args.temps.split(",")]:
            # per length: tokens and seconds per repeat, drafted / accepted / steps in all
            rates = {n: [] for n in lengths}
            totals = {n: [0, 0, 0] for n in lengths}
            for _ in range(args.repeats):
                generated, seconds = dict.fromkeys(lengths, 0), dict.fromkeys(lengths, 0.0)
                for i, p in enumerate(prompts):
                    for n in lengths:
                        st = engine.generate(p, max_tokens=args.max_tokens, temperature=temp, seed=i, draft_max=n,
                                             cache_prompt=False).stats
                        generated[n] += st.generated_tokens
                        seconds[n] += st.decode_seconds
                        t = totals[n]
                        t[0], t[1], t[2] = t[0] + st.drafted, t[1] + st.accepted, t[2] + st.target_steps
                for n in lengths:
                    rates[n].append(generated[n] / seconds[n])
            for n in lengths:
                drafted, accepted, steps = totals[n]
                r = rates[n]
                print(f"| {temp} | {n} | {accepted / max(drafted, 1):.3f} | {1 + accepted / max(steps, 1):.2f} | "
                      f"{min(r):.0f} / {statistics.median(r):.0f} / {max(r):.0f} |", flush=True)
            best = max((n for n in lengths if n != "auto"), key=lambda n: statistics.median(rates[n]))
            ratios = sorted(a / b for a, b in zip(rates["auto"], rates[best]))
            summary.append(f"| {temp} | {best} | {ratios[0]:.2f} / {statistics.median(ratios):.2f} / {ratios[-1]:.2f} |")
    print("\n| temp | best fixed | auto / best fixed, per repeat: min / median / max |\n|---|---|---|")
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
