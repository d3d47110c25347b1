#!/usr/bin/env python3
"""A draft model (draft-simple) at a size where Python is not the cost: the trained tiny target and the
trained draft model (``trained-draft-vlm.gguf``, a 48-wide 2-layer ``hunyuan_vl``, without its optional
projector) widened by zero padding (``pyllama_spec.devtools.widen``: same function, so the widened draft
proposes what the trained one proposes), greedy, one thread, pyllama-spec and llama-server side by side
in one run.

    python bench/draft_model_bench_size.py --repeats 3 --max-tokens 128 --draft-max 3,7,15

Files: ``widen_trained_pair``'s target and mmproj (n_embd 1024, 12 layers, n_ff 2816: 142,135,808
parameters) and ``widen_trained_draft_model``'s draft (n_embd 768 = 12 heads of 64 with 4 KV heads,
the trained GQA ratio 3; 2 layers, n_ff 2048: 13,000,192 parameters; a model of its own with the
target's vocabulary, reading nothing of the target).

Engines (all loaded before the first round, one thread each, n_ctx 2048, n_batch = n_ubatch 512,
flash attention off, the same files): pyllama-spec target-only and the draft model at each draft max
(in this process, ``spec_type="draft-simple"``); llama-server -np 1 with no draft and with ``-md DRAFT
--spec-type draft-simple --spec-draft-n-max N --spec-draft-n-min 0`` (one server per N). Every round
sends each prompt to every engine; the engine order reverses every other round. Prompts: three
held-out-style Python prefixes and (unless --no-image) the demo test card (672x672: 576 image rows
over 24 positions) before the second one; the draft model reads the text only (it has no projector
here, in either engine).

How the numbers are computed (bench/bench_size.py, as for bench/dflash_bench_size.py):

- decode tok/s and the mean accepted length (MAL) as there (its docstring says how);
- step times (pyllama-spec, pooled per round, median over rounds): one-token decode t1 =
  target-only ``decode_target_seconds / target_steps``; verify tv = the draft-model run's
  ``decode_target_seconds / target_steps``; draft td = ``decode_draft_seconds / target_steps``
  (the draft model's catch-up on the accepted tokens and its chain: one decode per drafted token);
  Python = the rest of ``decode_seconds`` per step.
- ideal x = MAL x t1 / (tv + td); efficiency = measured x / ideal x (llama-server: its own MAL
  with pyllama-spec's step times).
- same tokens: every engine's tokens, every round, equal pyllama-spec target-only's; fidelity: the
  widened target's tokens against the trained 64-wide target's, and the widened draft model's
  drafted / accepted counts (pyllama-spec, round 0) against the trained pair's (trained target +
  trained 48-wide draft model) on the same prompts (f32 files: equal counts mean equal drafts; f16
  rounding can part them at a near tie).
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
    bs.add_options(ap, "draft model", "draft_model_bench_size.json")
    ap.add_argument("--draft-n-embd", type=int, default=768,
                    help="the widened draft model's width: 48 times a power of 4 (192, 768, 3072)")
    ap.add_argument("--draft-n-ff", type=int, default=2048)
    args = ap.parse_args()
    return bs.compare_widened_draft(
        args, spec_type="draft-simple", trained_draft=MODELS_DIR / widen.DRAFT_MODEL, label="draft model",
        trained_label="the trained 48-wide draft model", key="draft_model",
        widened_draft=lambda folder, dtype: widen.widen_trained_draft_model(folder, n_embd=args.draft_n_embd,
                                                                       n_ff=args.draft_n_ff, dtype=dtype))


if __name__ == "__main__":
    sys.exit(main())
