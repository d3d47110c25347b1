#!/usr/bin/env python3
"""DFlash at a size where Python is not the cost: the trained tiny pair widened to the 142M f16
bench shapes (``pyllama_spec.devtools.widen``: same function, zero padding, so it accepts what the trained
pair accepts), greedy, one thread, pyllama-spec and llama-server side by side in one run.

    python bench/dflash_bench_size.py --repeats 3 --max-tokens 128 --draft-max 3,7,15

Engines (all loaded before the first round, one thread each, n_ctx 2048, n_batch = n_ubatch 512,
flash attention off, the same three files): pyllama-spec target-only and DFlash at each draft
max (in this process); llama-server -np 1 with no draft and with ``--spec-type draft-dflash
--spec-draft-n-max N --spec-draft-n-min 0`` (one server per N, as bench/benchmark.py starts them).
Every round sends each prompt to every engine; the engine order reverses every other round.
Prompts: three held-out-style Python prefixes and (unless --no-image) the demo test card
(672x672: 576 image rows over 24 positions) before the second one.

How the numbers are computed (bench/bench_size.py, shared with bench/eagle3_bench_size.py and
bench/draft_model_bench_size.py):

- decode tok/s: per round and prompt kind (text = the three text prompts pooled), generated
  tokens / decode seconds by each engine's own timer (pyllama-spec: ``stats.decode_seconds``,
  prefill excluded; llama-server: ``timings.predicted_n`` / ``predicted_ms``); min / median / max
  over the rounds. "x target-only" is the ratio of the medians, each engine against its own
  target-only.
- mean accepted length (MAL): tokens per target step = 1 + accepted / steps (pyllama-spec's
  ``stats.mean_accepted_length``, pooled; llama-server: steps = tokens - accepted - generations,
  as its first token of a generation comes from the prefill and each greedy step gives accepted + 1).
- step times (pyllama-spec, pooled per round, median over rounds): one-token decode t1 =
  target-only ``decode_target_seconds / target_steps`` (native time of a 1-row decode); verify
  tv = DFlash ``decode_target_seconds / target_steps`` (native time of a verify decode of 1 +
  drafted rows); draft td = ``decode_draft_seconds / target_steps`` (feature injection + draft block);
  Python = the rest of ``decode_seconds`` per step. Steps count the generation phase only (each
  generation's first token comes from the prefill).
- ideal x = MAL x t1 / (tv + td): the speed-up the acceptance gives at these native step costs
  with no overhead; efficiency = measured x / ideal x. For llama-server the same ideal with its
  own MAL and pyllama-spec's step times (both run the same llama.cpp graphs; llama-server reports
  no step times). MAL alone is the bound where a verify step costs what a one-token decode does.
- same tokens: every engine's tokens, every round, equal pyllama-spec target-only's; fidelity:
  the widened target's tokens against the trained 64-wide pair's (the same prompts, f32 files).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import bench_size as bs  # noqa: E402

from pyllama_spec import native_build  # noqa: E402
from pyllama_spec.devtools import widen  # noqa: E402
from pyllama_spec.devtools.benchmark import demo_png  # noqa: E402

SPEC_TYPE = "draft-dflash"  # "dflash" is its alias


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bs.add_options(ap, "DFlash", "dflash_bench_size.json")
    args = ap.parse_args()
    started = time.monotonic()
    files = widen.widen_trained_pair(native_build.cache_root() / "tiny-models", dtype=args.dtype)
    image = None if args.no_image else demo_png(672)
    prompts = bs.prompt_set(image)
    draft_maxes = [int(x) for x in args.draft_max.split(",") if x.strip()]
    n_params = bs.param_counts(files, "draft")
    samples = bs.measure(files, SPEC_TYPE, draft_maxes, prompts, image, args.repeats, args.max_tokens, started)
    trained = {name: r["tokens"] for name, r in bs.trained_runs(None, SPEC_TYPE, prompts, image, args.max_tokens, [])[0].items()}
    rows = bs.pool_rows(samples, SPEC_TYPE, draft_maxes, args.repeats)
    fidelity = bs.fidelity(trained, samples)

    print(f"\nwidened trained pair ({args.dtype}): target {n_params['target']:,} and draft {n_params['draft']:,} "
          f"parameters ({files.target.name}); {args.repeats} rounds x {len(prompts)} prompts x {args.max_tokens} tokens, greedy, 1 thread\n")
    bs.print_tables(rows)
    bs.print_fidelity(fidelity, "the trained 64-wide pair's")
    bs.write_results(args, files, n_params, rows, fidelity, samples, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
