#!/usr/bin/env python3
"""Acceptance of the embedded trained pair under llama.cpp's exact-match rule and under
rejection sampling, at several temperatures, text and image prompts, one run.

    python bench/verify_rules.py --prompts 16 --max-tokens 128

Held-out prompts as tools/measure_trained_pair.py picks them; prompt i samples with seed i.
"match" is llama.cpp's (and llama-server's) rule; its tokens equal target-only for a seed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from measure_trained_pair import held_out_prompts  # noqa: E402

import pyllama_spec as ps  # noqa: E402
from pyllama_spec.devtools.tiny import draw_demo_image  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-max", type=int, default=7)
    ap.add_argument("--temps", default="0,0.8,1.0")
    args = ap.parse_args()
    m = ps.embedded_models()
    prompts = held_out_prompts(args.prompts)
    image = draw_demo_image(672)
    print("| prompt | temp | rule | acceptance | mean accepted length | target steps / 100 tokens | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    with ps.load(m.target, mmproj=m.mmproj, draft=m.draft, n_ctx=4096, n_batch=64, n_ubatch=64, n_threads=1,
                 draft_max=args.draft_max) as engine:
        for kind in ("text", "image"):
            for temp in [float(t) for t in args.temps.split(",")]:
                for rule in (("match",) if temp == 0 else ("match", "rejection")):
                    drafted = accepted = steps = generated = 0
                    seconds = 0.0
                    for i, p in enumerate(prompts):
                        kw = dict(images=[image]) if kind == "image" else {}
                        text = (ps.MEDIA_MARKER + "\n" + p) if kind == "image" else p
                        s = engine.generate(text, max_tokens=args.max_tokens, temperature=temp, seed=i, verify=rule,
                                            cache_prompt=False, **kw).stats
                        drafted, accepted = drafted + s.drafted, accepted + s.accepted
                        steps, generated = steps + s.target_steps, generated + s.generated_tokens
                        seconds += s.decode_seconds
                    print(f"| {kind} | {temp} | {rule} | {accepted / max(drafted, 1):.3f} | "
                          f"{1 + accepted / max(steps, 1):.2f} | {100 * steps / max(generated, 1):.1f} | "
                          f"{generated / seconds:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
