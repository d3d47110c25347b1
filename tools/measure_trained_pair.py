#!/usr/bin/env python3
"""Acceptance and speed of the trained tiny pair (pyllama_spec/models) on held-out text, and after an image.

    python tools/measure_trained_pair.py --models pyllama_spec/models --max-tokens 128

Held-out prompts: 400 characters from a line start a third of the way into each of the first
``--prompts`` held-out corpus files (see tools/train_tiny_pair.py: sorted index % 10 == 0).
Greedy; every speculative run is checked token for token against the target-only run.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pyllama_spec.devtools.tiny import draw_demo_image  # noqa: E402
from pyllama_spec.serving import engine as engine_mod  # noqa: E402

CORPUS_GLOB = "/root/.pyenv/versions/3.11.7/lib/python3.11/*.py"


def at_rows(eng) -> None:
    """Ask ``eng``'s drafter for every block at the sequence's row count instead of its position."""
    draft = eng.drafter.draft
    eng.drafter.draft = lambda requests: draft([dataclasses.replace(rq, draft_pos=eng.positions.n_rows)
                                                for rq in requests])


def held_out_prompts(n: int, chars: int = 400) -> list[str]:
    files = [f for i, f in enumerate(sorted(glob.glob(CORPUS_GLOB))) if i % 10 == 0]
    out = []
    for f in files:
        text = Path(f).read_text(encoding="utf-8", errors="replace")
        start = text.find("\n", len(text) // 3) + 1
        snippet = text[start:start + chars]
        if len(snippet) == chars:
            out.append(snippet)
        if len(out) == n:
            break
    return out


def run(eng, prompts, max_tokens, image=None, temperature=0.0):
    """Totals over the prompts; above temperature 0, prompt i samples with seed i (same in every run)."""
    agg = dict(drafted=0, accepted=0, target_steps=0, generated=0, decode_s=0.0)
    tokens = []
    for i, p in enumerate(prompts):
        kw = dict(images=[image]) if image is not None else {}
        r = eng.generate(("<__media__>\n" + p) if image is not None else p, max_tokens=max_tokens,
                         cache_prompt=False, temperature=temperature, seed=i, verify="match", **kw)
        s = r.stats
        agg["drafted"] += s.drafted
        agg["accepted"] += s.accepted
        agg["target_steps"] += s.target_steps
        agg["generated"] += s.generated_tokens
        agg["decode_s"] += s.decode_seconds
        tokens.append(r.tokens)
    res = dict(acceptance_rate=agg["accepted"] / agg["drafted"] if agg["drafted"] else 0.0,
               mean_accepted_length=1.0 + agg["accepted"] / agg["target_steps"] if agg["target_steps"] else 0.0,
               tokens_per_s=agg["generated"] / agg["decode_s"] if agg["decode_s"] else 0.0,
               drafted=agg["drafted"], accepted=agg["accepted"], generated=agg["generated"])
    return res, tokens


def run_checked(eng, prompts, max_tokens, refs: dict, key: str, image=None, temperature=0.0):
    """run(), and whether its tokens equal the first run's under the same key (target-only goes first)."""
    res, tokens = run(eng, prompts, max_tokens, image, temperature)
    same = refs.setdefault(key, tokens) == tokens
    return res, same


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=str(REPO / "pyllama_spec" / "models"))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--temp", type=float, default=0.0,
                    help="sampling temperature (0: greedy); a tiny model's greedy text often settles into "
                         "repeating whitespace, which any draft predicts")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--readme", default=None,
                    help="replace the '## Measured' section of this README with a table of the results")
    args = ap.parse_args(argv)
    m = Path(args.models)
    target, draft, mmproj = m / "trained-target.gguf", m / "trained-draft.gguf", m / "trained-mmproj.gguf"
    prompts = held_out_prompts(args.prompts)
    # neither picture is in the training pool (tools/train_tiny_pair.py: image_pool): a flat one
    # (576 identical image rows) and a drawn one (varied rows)
    pictures = {"black": np.zeros((672, 672, 3), np.uint8), "test card": np.asarray(draw_demo_image(672))}
    rows = []

    def report(label, res, same):
        res = dict(case=label, lossless=same, **{k: (round(v, 3) if isinstance(v, float) else v)
                                                  for k, v in res.items()})
        rows.append(res)
        print(json.dumps(res), flush=True)

    refs = {}

    def measure(eng, key, image=None):
        return run_checked(eng, prompts, args.max_tokens, refs, key, image, args.temp)

    with engine_mod.load(target, mmproj=mmproj, n_threads=args.threads) as eng:
        report("text, target only", *measure(eng, "text"))
        for name, image in pictures.items():
            report(f"image ({name}), target only", *measure(eng, name, image))
    for dmax in (3, 7, 15):
        with engine_mod.load(target, mmproj=mmproj, draft=draft, n_threads=args.threads, draft_max=dmax) as eng:
            report(f"text, draft_max {dmax}", *measure(eng, "text"))
    for name, image in pictures.items():
        for mode in ("target", "sequential"):
            for old in (False, True):
                with engine_mod.load(target, mmproj=mmproj, draft=draft, n_threads=args.threads, draft_max=7,
                                     draft_positions=mode) as eng:
                    if old:  # each block asked for at the row count, as upstream's caller placed it
                        at_rows(eng)
                    res = measure(eng, name, image)
                report(f"image ({name}), draft_max 7, draft_positions {mode}"
                       + (", blocks at the row count" if old else ""), *res)
    text7 = next(r for r in rows if r["case"] == "text, draft_max 7")["acceptance_rate"]
    summary = []
    for name in pictures:
        best = max(r["acceptance_rate"] for r in rows
                   if r["case"].startswith(f"image ({name}), draft_max 7") and "blocks at the row count" not in r["case"])
        summary.append(f"After an image ({name}), draft_max 7, better mode: acceptance {best:.3f} = "
                       f"{best / text7 if text7 else 0.0:.2f}x text-only ({text7:.3f}).")
        print(summary[-1], flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    if args.readme:
        # one "## Measured, <decoding>" section per decoding; a rerun replaces its own section
        readme = Path(args.readme)
        decoding = "greedy" if not args.temp else f"temperature {args.temp}"
        title = f"## Measured, {decoding}"
        sections = readme.read_text().rstrip("\n").split("\n\n## ")
        sections = [sections[0]] + ["## " + x for x in sections[1:] if not ("## " + x).startswith(title + "\n")]
        cmd = "python tools/measure_trained_pair.py " + " ".join(sys.argv[1:] if argv is None else argv)
        lines = [title, "",
                 f"`{cmd}` ({len(prompts)} held-out prompts x {args.max_tokens} tokens, "
                 f"{'greedy' if not args.temp else f'temperature {args.temp}, seed = prompt index'}, "
                 f"{args.threads} thread(s), CPU; an image = a 672x672 picture, 576 image rows over 24 positions, "
                 "before the same prompt: black, or the demo's test card (`pyllama_spec.devtools.tiny.draw_demo_image`), "
                 "neither in the training pool; `lossless`: tokens equal the target-only run).", "",
                 "| case | acceptance rate | mean accepted length | tokens/s | lossless |",
                 "|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['case']} | {r['acceptance_rate']:.3f} | {r['mean_accepted_length']:.2f} | "
                         f"{r['tokens_per_s']:.0f} | {r['lossless']} |")
        lines += [""] + summary
        readme.write_text("\n\n".join(sections + ["\n".join(lines)]) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
