#!/usr/bin/env python3
"""MTP (draft-mtp) at a size where Python is not the cost: the trained tiny qwen35 target with its own
multi-token-prediction head (``trained-qwen35-mtp.gguf``) and its projector widened by zero padding
(``pyllama_spec.devtools.widen``: same function, so the widened head proposes what the trained one
proposes), greedy, one thread, pyllama-spec and llama-server side by side in one run.

    python bench/mtp_bench_size.py --repeats 3 --max-tokens 128 --draft-max 1,3

Files: ``widen_trained_qwen35_mtp``'s target and mmproj (n_embd 1024; 12 trunk layers, 7 gated delta
nets and 5 gated-attention layers; n_ff 2240: 141,828,720 trunk parameters; its MTP block, the nextn
layer after the trunk, 13,176,960 more: 155,005,680 in the file). There is no draft file: the head is a
block of the target, run in a second context of the same model.

Engines (all loaded before the first round, one thread each, n_ctx 2048, n_batch = n_ubatch 512,
flash attention off, the same files): pyllama-spec target-only and draft-mtp at each draft max (in
this process); llama-server -np 1 with no drafting and with ``--spec-type draft-mtp --spec-draft-n-max N
--spec-draft-n-min 0`` (one server per N). Every round sends each prompt to every engine; the engine
order reverses every other round. Prompts: three held-out-style Python prefixes and (unless --no-image)
the demo test card (672x672) before the second one; the trained qwen35 answers bench_size's second one
(read_config) with indentation only, every draft accepted, so ``class Stack`` (a prompt of
tests/test_trained_qwen35_mtp.py) takes its place. After a picture the two engines' heads see different
rows (llama.cpp's leaves the picture's rows out of the head's cache, ours writes them: the module
docstring of pyllama_spec/drafters/mtp.py), so their acceptance there may differ; the tokens may not.

How the numbers are computed (bench/bench_size.py, as for bench/dflash_bench_size.py):

- decode tok/s and the mean accepted length (MAL) as there (its docstring says how);
- step times (pyllama-spec, pooled per round, median over rounds): one-token decode t1 =
  target-only ``decode_target_seconds / target_steps``; verify tv = the draft-mtp run's
  ``decode_target_seconds / target_steps``; draft td = ``decode_draft_seconds / target_steps`` (the
  head's rows for the target's accepted tokens and its chain: one decode of the head per drafted
  token); Python = the rest of ``decode_seconds`` per step.
- ideal x = MAL x t1 / (tv + td); efficiency = measured x / ideal x (llama-server: its own MAL
  with pyllama-spec's step times).
- same tokens: every engine's tokens, every round, equal pyllama-spec target-only's; fidelity: the
  widened target's tokens against the trained 64-wide qwen35's, and the widened head's drafted /
  accepted counts (pyllama-spec, round 0) against the trained target's head on the same prompts (f32
  files: equal counts mean equal drafts; f16 rounding can part them at a near tie).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import bench_size as bs  # noqa: E402

from pyllama_spec.devtools import widen  # noqa: E402
from pyllama_spec.embedded import MODELS_DIR  # noqa: E402


STACK = ('class Stack:\n    """A last-in, first-out container."""\n\n    def __init__(self):\n'
         '        self._items = []\n\n    def push(self, item):\n        self._items.append(item)\n\n'
         '    def pop(self):\n        ')
TEXTS = {"class Counter": bs.TEXT_PROMPTS["class Counter"], "class Stack": STACK,
         "optparse": bs.TEXT_PROMPTS["optparse"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bs.add_options(ap, "MTP", "mtp_bench_size.json")
    ap.set_defaults(draft_max="1,3")  # the head's settings in pyllama_spec/models/README.md
    args = ap.parse_args()
    trained = SimpleNamespace(target=MODELS_DIR / widen.QWEN35_MTP, mmproj=MODELS_DIR / widen.QWEN35_MTP_MMPROJ)
    return bs.compare_widened_draft(
        args, spec_type="draft-mtp", widened_draft=None, trained_draft=None, label="MTP head",
        trained_label="the trained 64-wide qwen35's MTP head", key="mtp_head",
        widened_target=lambda folder, dtype: widen.widen_trained_qwen35_mtp(folder, dtype=dtype),
        trained_target=trained, target_label="the trained 64-wide qwen35's", texts=TEXTS)


if __name__ == "__main__":
    sys.exit(main())
