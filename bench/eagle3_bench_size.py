#!/usr/bin/env python3
"""EAGLE3 at a size where Python is not the cost: the trained tiny target and its trained EAGLE3 draft
widened to the 142M f16 bench shapes (``pyllama_spec.devtools.widen``: same function, zero padding, so
the widened draft proposes what the trained one proposes), greedy, one thread, pyllama-spec and
llama-server side by side in one run.

    python bench/eagle3_bench_size.py --repeats 3 --max-tokens 128 --draft-max 3,7,15

Files: ``widen_trained_pair``'s target and mmproj (n_embd 1024, 12 layers, n_ff 2816: 142,135,808
parameters) and ``widen_trained_eagle3``'s draft (n_embd 1024, n_ff 2816: 17,043,456 parameters; it
reads target layers 1, 2, 3 and borrows the target's token embedding and output head).

Engines (all loaded before the first round, one thread each, n_ctx 2048, n_batch = n_ubatch 512,
flash attention off, the same files): pyllama-spec target-only and EAGLE3 at each draft max (in this
process); llama-server -np 1 with no draft and with ``-md EAGLE3 --spec-type draft-eagle3
--spec-draft-n-max N --spec-draft-n-min 0`` (one server per N). Every round sends each prompt to
every engine; the engine order reverses every other round. Prompts: three held-out-style Python
prefixes and (unless --no-image) the demo test card (672x672: 576 image rows over 24 positions)
before the second one (a picture, then text: llama-server's EAGLE3 fails on text *before* a picture,
bench/RESULTS.md).

How the numbers are computed (bench/bench_size.py, as for bench/dflash_bench_size.py):

- decode tok/s and the mean accepted length (MAL) as there (its docstring says how);
- step times (pyllama-spec, pooled per round, median over rounds): one-token decode t1 =
  target-only ``decode_target_seconds / target_steps``; verify tv = EAGLE3's
  ``decode_target_seconds / target_steps``; draft td = ``decode_draft_seconds / target_steps``
  (the encoder over the target's features, the rows' write and the draft chain: one decode of the
  draft per drafted token); Python = the rest of ``decode_seconds`` per step.
- ideal x = MAL x t1 / (tv + td); efficiency = measured x / ideal x (llama-server: its own MAL
  with pyllama-spec's step times).
- same tokens: every engine's tokens, every round, equal pyllama-spec target-only's; fidelity: the
  widened target's tokens against the trained 64-wide target's, and the widened EAGLE3's drafted /
  accepted counts (pyllama-spec, round 0) against the trained 64-wide EAGLE3 pair's on the same
  prompts (f32 files: equal counts mean equal drafts; f16 rounding can part them at a near tie).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import bench_size as bs  # noqa: E402

from pyllama_spec.devtools import widen  # noqa: E402
from pyllama_spec.embedded import MODELS_DIR  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bs.add_options(ap, "EAGLE3", "eagle3_bench_size.json")
    args = ap.parse_args()
    return bs.compare_widened_draft(
        args, spec_type="draft-eagle3", trained_draft=MODELS_DIR / widen.EAGLE3, label="EAGLE3",
        trained_label="the trained 64-wide EAGLE3", key="eagle3",
        widened_draft=lambda folder, dtype: widen.widen_trained_eagle3(folder, dtype=dtype))


if __name__ == "__main__":
    sys.exit(main())
