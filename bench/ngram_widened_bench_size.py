#!/usr/bin/env python3
"""n-gram lookup (``ngram-simple``) on the trained tiny target widened to the 142M f16 bench shapes
(``widen.widen_trained_pair``: the trained function, so the trained pair's text), greedy, one thread,
pyllama-spec and llama-server side by side in one run: the draft lengths of a default's table.

    python bench/ngram_widened_bench_size.py --repeats 3 --max-tokens 96 --draft-max 3,5,7

``bench/ngram_bench_size.py`` measures the random bench target, which falls into a short loop; this one
the held-out-style code prompts of the other bench-size scripts (bench/bench_size.py), text that repeats
only as code does. Both engines run their own n-gram defaults besides the draft max (pyllama-spec: keys
of 4 down to 2 tokens, the copy going on past the history's end; llama-server: its ``--spec-ngram-simple-*``
defaults), so the llama-server rows are its n-gram, not the same drafter.

How the numbers are computed: as bench/eagle3_bench_size.py says (bench/bench_size.py); the fidelity lines
compare the widened target's tokens and drafts with the trained 64-wide target's (an n-gram drafter's
drafts follow from the tokens: equal tokens give equal counts).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import bench_size as bs  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bs.add_options(ap, "n-gram", "ngram_widened_bench_size.json")
    args = ap.parse_args()
    return bs.compare_widened_draft(
        args, spec_type="ngram-simple", widened_draft=None, trained_draft=None, label="n-gram lookup",
        trained_label="n-gram lookup on the trained 64-wide target", key="ngram")


if __name__ == "__main__":
    sys.exit(main())
