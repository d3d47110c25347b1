#!/usr/bin/env python3
"""Acceptance and speed of the trained tiny pair (tests/models) on held-out text, and after an image.

    python tools/measure_trained_pair.py --models tests/models --max-tokens 128

Held-out prompts: 400 characters from a line start a third of the way into each of the first
``--prompts`` held-out corpus files (see tools/train_tiny_pair.py: sorted index % 10 == 0).
Greedy; every speculative run is checked token for token against the target-only run.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pyllama_spec import engine as engine_mod  # noqa: E402

CORPUS_GLOB = "/root/.pyenv/versions/3.11.7/lib/python3.11/*.py"


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


def run(eng, prompts, max_tokens, image=None):
    agg = dict(drafted=0, accepted=0, target_steps=0, generated=0, decode_s=0.0)
    tokens = []
    for p in prompts:
        kw = dict(images=[image]) if image is not None else {}
        r = eng.generate(("<__media__>\n" + p) if image is not None else p, max_tokens=max_tokens,
                         cache_prompt=False, **kw)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=str(REPO / "tests" / "models"))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--readme", default=None,
                    help="replace the '## Measured' section of this README with a table of the results")
    args = ap.parse_args(argv)
    m = Path(args.models)
    target, draft, mmproj = m / "trained-target.gguf", m / "trained-draft.gguf", m / "trained-mmproj.gguf"
    prompts = held_out_prompts(args.prompts)
    image = np.zeros((672, 672, 3), np.uint8)
    rows = []

    def report(label, res, same):
        res = dict(case=label, lossless=same, **{k: (round(v, 3) if isinstance(v, float) else v)
                                                  for k, v in res.items()})
        rows.append(res)
        print(json.dumps(res), flush=True)

    with engine_mod.load(target, mmproj=mmproj, n_threads=args.threads) as eng:
        base_text, ref_text = run(eng, prompts, args.max_tokens)
        base_img, ref_img = run(eng, prompts, args.max_tokens, image)
    report("text, target only", base_text, True)
    report("image, target only", base_img, True)
    for dmax in (3, 7, 15):
        with engine_mod.load(target, mmproj=mmproj, draft=draft, n_threads=args.threads, draft_max=dmax) as eng:
            res, toks = run(eng, prompts, args.max_tokens)
        report(f"text, draft_max {dmax}", res, toks == ref_text)
    for mode in ("target", "sequential"):
        for old in (False, True):
            with engine_mod.load(target, mmproj=mmproj, draft=draft, n_threads=args.threads, draft_max=7,
                                 draft_positions=mode) as eng:
                eng.drafter._block_at_row_count = old
                res, toks = run(eng, prompts, args.max_tokens, image)
            report(f"image, draft_max 7, draft_positions {mode}" + (", _block_at_row_count" if old else ""),
                   res, toks == ref_img)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    if args.readme:
        readme = Path(args.readme)
        head = readme.read_text().split("\n## Measured")[0].rstrip("\n")
        cmd = "python tools/measure_trained_pair.py " + " ".join(sys.argv[1:] if argv is None else argv)
        lines = ["", "", "## Measured", "",
                 f"`{cmd}` ({len(prompts)} held-out prompts x {args.max_tokens} greedy tokens, "
                 f"{args.threads} thread(s), CPU; an image = a black 672x672 picture, 576 image tokens, "
                 "before the same prompt; `lossless`: tokens equal the target-only run).", "",
                 "| case | acceptance rate | mean accepted length | tokens/s | lossless |",
                 "|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['case']} | {r['acceptance_rate']:.3f} | {r['mean_accepted_length']:.2f} | "
                         f"{r['tokens_per_s']:.0f} | {r['lossless']} |")
        readme.write_text(head + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
