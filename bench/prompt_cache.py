#!/usr/bin/env python3
"""Conversations taking turns on one slot, with and without the host-memory prompt cache
(``--cache-ram``; serving/prompt_cache.py), side by side in one run.

    python bench/prompt_cache.py --conversations 3 --turns 4 --repeats 5

An agent harness (or several users) on a server with fewer slots than conversations: each
conversation grows by a user turn and an answer per turn, and the conversations take turns on the
engine's one slot (A, B, C, A, B, C, ...). Without the cache a conversation's prompt is decoded
again whole at each of its turns (its slot held another conversation meanwhile); with it, the
slot's cache is copied out and the returning conversation's put back, so only the new turn is
decoded.

Engines: the embedded trained pair (target, projector, DFlash draft), one slot, one thread,
``cache_ram_mib`` 0 and 256, loaded once each; every repeat runs the whole schedule on each, the
order reversed every other repeat, each engine's cache emptied first. The first conversation
opens with the demo test card (224x224), so its restored rows include an image's. Reported per
engine, min / median / max over the repeats: prompt rows decoded and prefill seconds (summed
over the schedule's requests, each engine's own ``stats``), whole-schedule wall seconds, and the
drafts' acceptance (pooled: a restored slot's drafter starts afresh, so it may draft worse);
"same text": every answer equals the engine without the cache's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import pyllama_spec as ps
from pyllama_spec.devtools import tiny

OPENINGS = [
    "def parse(lines):\n    out = []\n    for line in lines:\n        if line.startswith('#'):\n            continue\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n    for name in sorted(os.listdir(argv[1])):\n",
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n",
]
TURN = "\n# next, the same again with a docstring and a test:\n"


def schedule(engine, n_conv: int, turns: int, max_tokens: int, image) -> tuple[int, float, float, float, list]:
    """Run the turns; (rows decoded, prefill seconds, wall seconds, acceptance, every answer's tokens)."""
    chats = [OPENINGS[i % len(OPENINGS)] * 3 for i in range(n_conv)]
    decoded, prefill, answers, drafted, accepted = 0, 0.0, [], 0, 0
    t0 = time.perf_counter()
    for _ in range(turns):
        for i in range(n_conv):
            r = engine.generate(chats[i], images=[image] if i == 0 else [], max_tokens=max_tokens)
            decoded += r.stats.prompt_decoded
            prefill += r.stats.prefill_seconds
            answers.append(r.tokens)
            drafted, accepted = drafted + r.stats.drafted, accepted + r.stats.accepted
            chats[i] += r.text + TURN
    return decoded, prefill, time.perf_counter() - t0, accepted / max(drafted, 1), answers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    pair = ps.embedded_models()
    image = tiny.draw_demo_image(224)
    engines = {mib: ps.load(pair.target, mmproj=pair.mmproj, draft=pair.draft, n_threads=a.threads,
                            n_ctx=4096, cache_ram_mib=mib) for mib in (0, 256)}
    runs: dict[int, list] = {mib: [] for mib in engines}
    same = True
    try:
        for rep in range(a.repeats):
            order = list(engines) if rep % 2 == 0 else list(engines)[::-1]
            answers = {}
            for mib in order:
                engines[mib].reset_cache()
                *figures, answers[mib] = schedule(engines[mib], a.conversations, a.turns, a.max_tokens, image)
                runs[mib].append(figures)
            same &= answers[0] == answers[256]
    finally:
        for e in engines.values():
            e.close()

    def mmm(values, fmt):
        return "/".join(fmt.format(v) for v in (min(values), statistics.median(values), max(values)))

    n_req = a.conversations * a.turns
    print(f"{a.conversations} conversations x {a.turns} turns on one slot ({n_req} requests, {a.max_tokens} tokens "
          f"each), {a.repeats} repeats, min/median/max")
    print("| --cache-ram | prompt rows decoded | prefill s | schedule wall s | acceptance |")
    print("|---|---|---|---|---|")
    for mib, figs in runs.items():
        rows, pre, wall, acc = zip(*figs)
        print(f"| {mib} MiB | {mmm(rows, '{:.0f}')} | {mmm(pre, '{:.3f}')} | {mmm(wall, '{:.3f}')} | "
              f"{mmm(acc, '{:.2f}')} |")
    med = {mib: [statistics.median(col) for col in zip(*figs)] for mib, figs in runs.items()}
    print(f"with the cache: {med[256][0] / med[0][0]:.2f}x the rows decoded, prefill {med[0][1] / med[256][1]:.2f}x "
          f"faster, schedule {med[0][2] / med[256][2]:.2f}x faster (medians); same text: {same}")


if __name__ == "__main__":
    main()
