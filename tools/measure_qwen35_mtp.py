#!/usr/bin/env python3
"""Acceptance of the trained qwen35 target's own MTP head (pyllama_spec/models/trained-qwen35-mtp.gguf,
made by tools/train_qwen35_mtp.py) on held-out text, and after an image; greedy by default.

    python tools/measure_qwen35_mtp.py --prompts 16 --max-tokens 128

Held-out prompts and pictures as tools/measure_trained_pair.py draws them; every ``draft-mtp`` run is
checked token for token against the target-only run (``lossless``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))
sys.path.insert(0, str(TOOLS.parent))

from measure_trained_pair import held_out_prompts, run_checked  # noqa: E402

from pyllama_spec.devtools.tiny import draw_demo_image  # noqa: E402
from pyllama_spec.serving import engine as engine_mod  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=str(TOOLS.parent / "pyllama_spec" / "models"))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--draft-max", type=int, nargs="+", default=[1, 3])
    args = ap.parse_args(argv)
    m = Path(args.models)
    target, mmproj = m / "trained-qwen35-mtp.gguf", m / "trained-qwen35-mtp-mmproj.gguf"
    prompts = held_out_prompts(args.prompts)
    pictures = {"black": np.zeros((672, 672, 3), np.uint8), "test card": np.asarray(draw_demo_image(672))}
    refs: dict = {}
    kw = dict(mmproj=mmproj, n_threads=args.threads, n_ctx=4096)

    def report(label, res, same):
        print(json.dumps(dict(case=label, lossless=same, **{k: (round(v, 3) if isinstance(v, float) else v)
                                                            for k, v in res.items()})), flush=True)

    with engine_mod.load(target, spec_type="none", **kw) as eng:
        report("text, target only", *run_checked(eng, prompts, args.max_tokens, refs, "text", None, args.temp))
        for name, image in pictures.items():
            report(f"image ({name}), target only",
                   *run_checked(eng, prompts, args.max_tokens, refs, name, image, args.temp))
    for dmax in args.draft_max:
        with engine_mod.load(target, spec_type="draft-mtp", draft_max=dmax, **kw) as eng:
            report(f"text, draft-mtp, draft_max {dmax}",
                   *run_checked(eng, prompts, args.max_tokens, refs, "text", None, args.temp))
            for name, image in pictures.items():
                report(f"image ({name}), draft-mtp, draft_max {dmax}",
                       *run_checked(eng, prompts, args.max_tokens, refs, name, image, args.temp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
