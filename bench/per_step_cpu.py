#!/usr/bin/env python3
"""The CPU time of one generation on the embedded pair, where each native call costs microseconds
and so the Python around every step shows: target-only and DFlash, greedy, one thread.

    python bench/per_step_cpu.py --tokens 256 --runs 7
    PYTHONPATH=/path/to/other/checkout python bench/per_step_cpu.py   # the same on another tree

CPU time (``time.process_time``) rather than wall time, so that other work on the machine does
not count; the minimum and median of ``--runs`` generations (after one warm-up) and the steps
they took, as JSON. Compare two trees by running this file under each, alternating.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import pyllama_spec as ps

PROMPT = "class Counter:\n    def __init__(self, name):\n        self.name = name\n        self."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    em = ps.embedded_models()
    out = {}
    for name, kw in (("target-only", {}), ("dflash", dict(draft=em.draft, draft_max=7))):
        with ps.load(em.target, n_ctx=4096, n_batch=512, n_ubatch=512, n_threads=1, flash_attn=False, **kw) as e:
            e.generate(PROMPT, max_tokens=16)  # warm-up
            seconds = []
            for _ in range(args.runs):
                t0 = time.process_time()
                result = e.generate(PROMPT, max_tokens=args.tokens, cache_prompt=False)
                seconds.append(time.process_time() - t0)
            out[name] = {"cpu_ms_min": round(1e3 * min(seconds), 2),
                         "cpu_ms_median": round(1e3 * statistics.median(seconds), 2),
                         "tokens": len(result.tokens), "steps": result.stats.target_steps}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
