#!/usr/bin/env python3
"""Draft trees against a chain at bench size: the widened trained pair (pyllama_spec.devtools.widen, 142M
f16 target), pyllama-spec only, one thread, three held-out prompts x 128 tokens, greedy and at
temperature 0.8 (prompt i with seed i), 2 rounds with the order reversed in the second.

    python bench/tree_bench_size.py

Prints | temp | method | mean accepted length (first round) | decode tok/s min / max |.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))


from measure_trained_pair import held_out_prompts  # noqa: E402

import pyllama_spec as ps  # noqa: E402
from pyllama_spec import native_build  # noqa: E402
from pyllama_spec.devtools import widen

CONFIGS = [("target-only", dict(draft_max=0, draft_tree=0)), ("chain 7", dict(draft_max=7, draft_tree=0)),
           ("tree 8", dict(draft_tree=8)), ("tree 16", dict(draft_tree=16)), ("tree 32", dict(draft_tree=32))]


def main() -> int:
    files = widen.widen_trained_pair(native_build.cache_root() / "tiny-models")
    prompts = held_out_prompts(3)
    print("| temp | method | mean accepted length | tok/s min / max |\n|---|---|---|---|")
    with ps.load(files.target, draft=files.draft, n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=1,
                 draft_max=15, draft_tree=32) as e:
        for temp in (0.0, 0.8):
            res = {n: [] for n, _ in CONFIGS}
            for rnd in range(2):
                for name, c in (CONFIGS if rnd == 0 else CONFIGS[::-1]):
                    n = a = st = 0
                    sec = 0.0
                    for i, p in enumerate(prompts):
                        s = e.generate(p, max_tokens=128, temperature=temp, seed=i, cache_prompt=False, **c).stats
                        n, a, st, sec = n + s.generated_tokens, a + s.accepted, st + s.target_steps, sec + s.decode_seconds
                    res[name].append((n / sec, 1 + a / st))
            for name, xs in res.items():
                t = sorted(x[0] for x in xs)
                print(f"| {temp} | {name} | {xs[0][1]:.2f} | {t[0]:.1f} / {t[-1]:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
