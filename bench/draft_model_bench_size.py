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

- decode tok/s: per round and prompt kind (text = the three text prompts pooled), generated
  tokens / decode seconds by each engine's own timer (pyllama-spec: ``stats.decode_seconds``,
  prefill excluded; llama-server: ``timings.predicted_n`` / ``predicted_ms``); min / median / max
  over the rounds. "x target-only" is the ratio of the medians, each engine against its own
  target-only.
- mean accepted length (MAL): tokens per target step = 1 + accepted / steps (pyllama-spec's
  target steps; llama-server: steps = tokens - accepted - generations).
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
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import bench_size as bs  # noqa: E402

import pyllama_spec as ps  # noqa: E402
from pyllama_spec import native_build  # noqa: E402
from pyllama_spec.devtools import widen  # noqa: E402
from pyllama_spec.devtools.benchmark import demo_png  # noqa: E402
from pyllama_spec.embedded import MODELS_DIR  # noqa: E402

SPEC_TYPE = "draft-simple"


def _trained(prompts: dict, image: bytes | None, max_tokens: int, draft_maxes: list[int]) -> dict:
    """The trained (64-wide target, 48-wide draft model, f32) pair on the same prompts: target-only
    tokens, and the draft-model run's tokens and drafted / accepted counts at each draft max."""
    m = ps.embedded_models()
    files = SimpleNamespace(target=m.target, mmproj=m.mmproj, draft=MODELS_DIR / widen.DRAFT_MODEL)
    out = {}
    for dm in [0, *draft_maxes]:
        engine = bs.Local(files, dm, SPEC_TYPE)
        try:
            out[dm] = {name: engine.run(p, image if img else None, max_tokens) for name, (p, img) in prompts.items()}
        finally:
            engine.close()
    return out


def _drafts(samples: dict, trained: dict, draft_maxes: list[int]) -> dict:
    """Per draft max: (drafted, accepted) of the widened and the trained draft model, round 0, all
    prompts, and whether they are equal prompt by prompt."""
    drafts = {}
    for dm in draft_maxes:
        ours = [x for x in samples[bs.engine_name("pyllama-spec", SPEC_TYPE, dm)] if x["round"] == 0]
        theirs = [trained[dm][x["prompt"]] for x in ours]
        drafts[dm] = dict(widened=[sum(x["drafted"] for x in ours), sum(x["accepted"] for x in ours)],
                          trained=[sum(x["drafted"] for x in theirs), sum(x["accepted"] for x in theirs)],
                          equal_per_prompt=all((x["drafted"], x["accepted"]) == (y["drafted"], y["accepted"])
                                               for x, y in zip(ours, theirs)))
    return drafts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-max", default="3,7,15", help="comma-separated draft lengths")
    ap.add_argument("--no-image", action="store_true", help="text prompts only")
    ap.add_argument("--dtype", default="f16", choices=["f16", "f32"])
    ap.add_argument("--draft-n-embd", type=int, default=768,
                    help="the widened draft model's width: 48 times a power of 4 (192, 768, 3072)")
    ap.add_argument("--draft-n-ff", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "draft_model_bench_size.json", help="JSON results")
    args = ap.parse_args()
    if native_build.find_llama_server() is None:
        print("llama-server is not built: python build.py --tools", file=sys.stderr)
        return 2
    started = time.monotonic()
    folder = native_build.cache_root() / "tiny-models"
    pair = widen.widen_trained_pair(folder, dtype=args.dtype)
    draft = widen.widen_trained_draft_model(folder, n_embd=args.draft_n_embd, n_ff=args.draft_n_ff, dtype=args.dtype)
    files = SimpleNamespace(target=pair.target, mmproj=pair.mmproj, draft=draft)
    image = None if args.no_image else demo_png(672)
    prompts = bs.prompt_set(image)
    draft_maxes = [int(x) for x in args.draft_max.split(",") if x.strip()]
    n_params = bs.param_counts(files, "draft_model")
    samples = bs.measure(files, SPEC_TYPE, draft_maxes, prompts, image, args.repeats, args.max_tokens, started)
    trained = _trained(prompts, image, args.max_tokens, draft_maxes)
    rows = bs.pool_rows(samples, SPEC_TYPE, draft_maxes, args.repeats)
    fidelity = bs.fidelity({name: r["tokens"] for name, r in trained[0].items()}, samples)
    drafts = _drafts(samples, trained, draft_maxes)

    print(f"\nwidened trained target + draft model ({args.dtype}): target {n_params['target']:,} and draft model "
          f"{n_params['draft_model']:,} parameters ({files.target.name}, {files.draft.name}); {args.repeats} rounds "
          f"x {len(prompts)} prompts x {args.max_tokens} tokens, greedy, 1 thread\n")
    bs.print_tables(rows)
    bs.print_fidelity(fidelity, "the trained 64-wide target's")
    print("drafted / accepted, widened vs trained 48-wide draft model (round 0, all prompts): "
          + "; ".join(f"draft max {dm}: {v['widened'][0]} / {v['widened'][1]} vs {v['trained'][0]} / "
                      f"{v['trained'][1]}{'' if v['equal_per_prompt'] else ' (differs)'}" for dm, v in drafts.items()))
    bs.write_results(args, files, n_params, rows, fidelity, samples, started, drafts=drafts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
