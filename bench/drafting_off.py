#!/usr/bin/env python3
"""Steps that draft nothing on an engine that drafts: what they cost against target-only.

    python bench/drafting_off.py --repeats 5
    python bench/drafting_off.py --world reading --methods draft-eagle3,draft-mtp

A drafting engine's step drafts nothing when a request asks for no draft (``draft_max=0`` per call,
the server's ``"speculative.n_max": 0``), when ``draft_max="auto"`` finds that no length pays, and at
the last token of every answer. Each method's engine (loaded at its default) answers the same
prompts with ``draft_max=0`` and a target-only engine answers them too, interleaved prompt by prompt;
decode tokens/s min/median/max over the repeats, and the ratio per repeat. Every output is checked
against target-only's (greedy).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tools"))

from draft_length import METHODS, world_files  # noqa: E402
from measure_trained_pair import held_out_prompts  # noqa: E402

import pyllama_spec as ps  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--methods", default="all", help='spec types separated by commas, or "all"')
    ap.add_argument("--world", default="embedded", choices=("embedded", "reading"))
    args = ap.parse_args()
    prompts = held_out_prompts(args.prompts)
    methods = METHODS if args.methods == "all" else tuple(args.methods.split(","))
    print("| world | method | target only tok/s | drafting off tok/s | off / target only |")
    print("|---|---|---|---|---|")
    for method in methods:
        target, mmproj, kw = world_files(args.world, method)
        common = dict(mmproj=mmproj, n_ctx=4096, n_batch=64, n_ubatch=64, n_threads=1, flash_attn=False)
        with contextlib.ExitStack() as stack:
            plain = stack.enter_context(ps.load(target, spec_type="none", **common))
            drafting = stack.enter_context(ps.load(target, **common, **kw))
            rates: dict[str, list[float]] = {"plain": [], "off": []}
            for _ in range(args.repeats):
                tokens, seconds = {"plain": 0, "off": 0}, {"plain": 0.0, "off": 0.0}
                for i, p in enumerate(prompts):
                    ref = plain.generate(p, max_tokens=args.max_tokens, temperature=0, cache_prompt=False)
                    got = drafting.generate(p, max_tokens=args.max_tokens, temperature=0, cache_prompt=False,
                                            draft_max=0)
                    if got.tokens != ref.tokens:
                        raise SystemExit(f"{method}: output differs from target-only")
                    for name, r in (("plain", ref), ("off", got)):
                        tokens[name] += r.stats.generated_tokens
                        seconds[name] += r.stats.decode_seconds
                for name in rates:
                    rates[name].append(tokens[name] / seconds[name])
        ratio = [o / p for o, p in zip(rates["off"], rates["plain"])]

        def mmm(xs, fmt):
            return " / ".join(format(x, fmt) for x in (min(xs), statistics.median(xs), max(xs)))

        print(f"| {args.world} | {method} | {mmm(rates['plain'], '.0f')} | {mmm(rates['off'], '.0f')} | "
              f"{mmm(ratio, '.2f')} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
