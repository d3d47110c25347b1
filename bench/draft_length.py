#!/usr/bin/env python3
"""Draft lengths, fixed and adaptive (draft_max="auto"), against target-only: which length is each
method's fastest, on text and after a picture, side by side in one run.

    python bench/draft_length.py --prompts 16 --max-tokens 128 --repeats 3
    python bench/draft_length.py --methods all --world embedded --temps 0 --picture none,blocks

``--methods`` takes llama.cpp's spec-type names separated by commas (``all``: every method the world
has files for); ``--world`` is the embedded trained pair (``pyllama_spec/models/trained-*``; MTP on
its qwen35 target) or the reading world (``reading-*``). ``--picture blocks`` puts a 448 x 448
picture of random colour blocks (bench/unfamiliar_pictures.py's) before every prompt.

Decode tokens/s is reported as min/median/max over the repeats (same prompts and seeds each time).
For each method the lengths and target-only run interleaved, prompt by prompt (every setting once
per prompt per repeat), so that the machine's drift touches them alike, each on an engine loaded with
it. The summary gives, per
repeat, the engine's default length, "auto" and the best fixed length over target-only and over
the best fixed length (by median). Every greedy output is checked against target-only's.
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

from measure_trained_pair import held_out_prompts  # noqa: E402

import pyllama_spec as ps  # noqa: E402
from pyllama_spec.devtools import reading  # noqa: E402

MODELS = REPO / "pyllama_spec" / "models"
MARKER = "<__media__>"
METHODS = ("draft-dflash", "draft-eagle3", "draft-mtp", "draft-simple", "ngram-simple")


def world_files(world: str, method: str) -> tuple[Path, Path, dict]:
    """(target, mmproj, load keywords) of ``method`` in ``world``."""
    if world == "embedded":
        t, mm = MODELS / "trained-target.gguf", MODELS / "trained-mmproj.gguf"
        drafts = {"draft-dflash": MODELS / "trained-draft.gguf", "draft-eagle3": MODELS / "trained-eagle3.gguf",
                  "draft-simple": MODELS / "trained-draft-vlm.gguf"}
        if method == "draft-mtp":
            t, mm = MODELS / "trained-qwen35-mtp.gguf", MODELS / "trained-qwen35-mtp-mmproj.gguf"
    else:
        f = reading.models()
        t, mm = f["target"], f["mmproj"]
        drafts = {"draft-dflash": f["dflash"], "draft-eagle3": f["eagle3"], "draft-simple": f["draft_vlm"]}
    kw = dict(spec_type=method)
    if method in drafts:
        kw["draft"] = drafts[method]
    return t, mm, kw


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temps", default="0,0.8,1.0")
    ap.add_argument("--methods", default="draft-dflash", help='spec types separated by commas, or "all"')
    ap.add_argument("--world", default="embedded", choices=("embedded", "reading"))
    ap.add_argument("--picture", default="none", help='"none", "blocks" or both separated by a comma')
    ap.add_argument("--lengths", default="1,2,3,5,7,11,15,auto")
    args = ap.parse_args()
    prompts = held_out_prompts(args.prompts)
    lengths = [n if n == "auto" else int(n) for n in args.lengths.split(",")]
    methods = METHODS if args.methods == "all" else tuple(args.methods.split(","))
    from unfamiliar_pictures import pictures

    blocks = pictures()["random blocks"]
    print("| method | picture | temp | draft_max | acceptance | mean accepted length | decode tokens/s min / median / max |")
    print("|---|---|---|---|---|---|---|")
    summary = []
    for method in methods:
        target, mmproj, kw = world_files(args.world, method)
        common = dict(mmproj=mmproj, n_ctx=4096, n_batch=64, n_ubatch=64, n_threads=1, flash_attn=False)
        # Every setting on an engine loaded with it, as a user would load it: a recurrent target keeps as
        # many rollback snapshots as its load's draft_max (which also bounds each call's).
        with contextlib.ExitStack() as stack:
            engines = {"target only": stack.enter_context(ps.load(target, spec_type="none", **common)),
                       "default": stack.enter_context(ps.load(target, **common, **kw))}
            default = engines["default"].draft_max
            # the default length is one of the settings, under its own name
            settings = ["target only", "default", *[n for n in lengths if n != default]]
            for n in settings[2:]:
                engines[n] = stack.enter_context(ps.load(target, **common, **kw, draft_max=n))
            for picture in args.picture.split(","):
                pic = {"none": None, "blocks": blocks}[picture]
                for temp in [float(t) for t in args.temps.split(",")]:
                    rates = {s: [] for s in settings}
                    totals = {s: [0, 0, 0] for s in settings}
                    for _ in range(args.repeats):
                        generated, seconds = dict.fromkeys(settings, 0), dict.fromkeys(settings, 0.0)
                        for i, p in enumerate(prompts):
                            ref = None
                            for s in settings:
                                eng, call = engines[s], {}
                                if pic is not None:
                                    call.update(images=[pic])
                                r = eng.generate(f"{MARKER}\n{p}" if pic is not None else p,
                                                 max_tokens=args.max_tokens, temperature=temp, seed=i,
                                                 cache_prompt=False, **call)
                                if ref is None:
                                    ref = r.tokens
                                elif temp == 0 and r.tokens != ref:
                                    raise SystemExit(f"{method} at {s}: greedy output differs from target-only")
                                st = r.stats
                                generated[s] += st.generated_tokens
                                seconds[s] += st.decode_seconds
                                t = totals[s]
                                t[0], t[1], t[2] = t[0] + st.drafted, t[1] + st.accepted, t[2] + st.target_steps
                        for s in settings:
                            rates[s].append(generated[s] / seconds[s])
                    for s in settings:
                        drafted, accepted, steps = totals[s]
                        r = rates[s]
                        name = f"default ({default})" if s == "default" else s
                        print(f"| {method} | {picture} | {temp} | {name} | {accepted / max(drafted, 1):.3f} | "
                              f"{1 + accepted / max(steps, 1):.2f} | "
                              f"{min(r):.0f} / {statistics.median(r):.0f} / {max(r):.0f} |", flush=True)
                    fixed = [s for s in settings if s not in ("target only", "auto")]
                    best = max(fixed, key=lambda s: statistics.median(rates[s]))

                    def ratio(a, b):
                        v = sorted(x / y for x, y in zip(rates[a], rates[b]))
                        return f"{v[0]:.2f} / {statistics.median(v):.2f} / {v[-1]:.2f}"

                    best_name = f"{default} (default)" if best == "default" else str(best)
                    auto = "auto" if "auto" in rates else None
                    summary.append(
                        f"| {method} | {picture} | {temp} | {default} | {best_name} | {ratio('default', 'target only')} | "
                        f"{ratio('default', best)} | {ratio(best, 'target only')} | "
                        + (f"{ratio(auto, 'target only')} | {ratio(auto, best)} |" if auto else "- | - |"))
    print("\n| method | picture | temp | default | best fixed | default / target only | default / best fixed | "
          "best fixed / target only | auto / target only | auto / best fixed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
