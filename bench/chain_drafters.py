#!/usr/bin/env python3
"""The drafters that draft token by token (EAGLE3, the draft model, MTP) against llama-server from
the same pin on the same files, in alternating rounds so that the machine's drift falls on both.

    python bench/chain_drafters.py --rounds 7 --prompts 16 --max-tokens 128

Each round runs, for every method in turn (the order reversed every other round), the held-out text
prompts here (``generate``, greedy) and on llama-server (``/completion``), each server and engine
started once and kept for every round (which of the two goes first alternates too); decode tokens/s as
each engine reports it (``decode_seconds`` here, ``predicted_ms`` there). Printed per method: both
speeds and the ratio here / llama-server per round, min / median / max; target-only is the control
(the same ratio without a drafter). Counts (drafted, accepted, generated) must repeat from round to
round, and greedy output must equal target-only's here (checked where target-only runs too, as by
default). Files: pyllama_spec/models (trained-target + trained-eagle3, trained-draft-vlm,
trained-qwen35-mtp).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from drafters_after_images import _run, _serve_run, llama_server, methods  # noqa: E402
from measure_trained_pair import held_out_prompts  # noqa: E402

import pyllama_spec as ps  # noqa: E402
from pyllama_spec import native_build  # noqa: E402

METHODS = ("target only", "EAGLE3", "text-only draft model", "qwen35: target only", "qwen35: MTP")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-max", type=int, default=None, help="every method's draft length (default: 7, MTP 3)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default=None, help="comma-separated method names (default: all of METHODS)")
    args = ap.parse_args()
    if native_build.find_llama_server() is None:
        print("llama-server is not built: python build.py --tools", file=sys.stderr)
        return 2
    prompts = held_out_prompts(args.prompts)
    chosen = {name: m for name, m in methods(args.draft_max).items()
              if name in METHODS and (not args.only or name in args.only.split(","))}
    speeds = {name: {"here": [], "llama-server": []} for name in chosen}
    counts: dict = {}
    reference: dict = {}
    with contextlib.ExitStack() as stack:
        engines, servers = {}, {}
        for name, m in chosen.items():
            engines[name] = stack.enter_context(ps.load(m["target"], mmproj=m["mmproj"], n_threads=args.threads,
                                                        draft_max=m["draft_max"], flash_attn=False, **m["kw"]))
            servers[name] = stack.enter_context(llama_server(m["target"], m["mmproj"], m["server"], args.threads))
        for r in range(args.rounds):
            order = list(chosen) if r % 2 == 0 else list(chosen)[::-1]
            for name in order:
                m = chosen[name]
                url, marker = servers[name]
                if r % 2:  # which engine goes first alternates too
                    there = _serve_run(url, marker, prompts, "", 0.0, args)
                here, tokens = _run(engines[name], prompts, args.max_tokens, None, 0.0)
                if not r % 2:
                    there = _serve_run(url, marker, prompts, "", 0.0, args)
                seen = {k: (here[k], there[k]) for k in ("drafted", "accepted", "generated")}
                if counts.setdefault(name, seen) != seen:
                    raise RuntimeError(f"{name}: round {r} counted {seen}, round 0 {counts[name]}")
                if m["kw"]["spec_type"] == "none":
                    reference[str(m["target"])] = tokens
                elif str(m["target"]) in reference and reference[str(m["target"])] != tokens:
                    raise RuntimeError(f"{name}: the output differs from target-only's")
                speeds[name]["here"].append(here["tokens_per_s"])
                speeds[name]["llama-server"].append(there["tokens_per_s"])
                print(json.dumps({"round": r, "method": name, "here": round(here["tokens_per_s"]),
                                  "llama-server": round(there["tokens_per_s"]), **seen}), flush=True)
    print("\n| method | draft max | drafted / accepted (here, llama-server) | here tok/s | llama-server tok/s | "
          "here / llama-server, per round |")
    print("|---|---|---|---|---|---|")
    for name, s in speeds.items():
        ratios = sorted(a / b for a, b in zip(s["here"], s["llama-server"]))
        c = counts[name]
        drafts = f"{c['drafted'][0]} / {c['accepted'][0]}, {c['drafted'][1]} / {c['accepted'][1]}"
        print(f"| {name} | {chosen[name]['draft_max'] if chosen[name]['kw']['spec_type'] != 'none' else ''} | "
              f"{drafts} | {_mmm(s['here'])} | {_mmm(s['llama-server'])} | "
              f"{ratios[0]:.2f} / {statistics.median(ratios):.2f} / {ratios[-1]:.2f} |")
    return 0


def _mmm(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"{xs[0]:.0f} / {statistics.median(xs):.0f} / {xs[-1]:.0f}"


if __name__ == "__main__":
    sys.exit(main())
