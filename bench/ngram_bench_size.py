#!/usr/bin/env python3
"""n-gram drafting at a size where Python is not the cost: the 142M f16 bench target, greedy,
pyllama-spec and llama-server side by side in one run (rounds alternate the engines).

    python bench/ngram_bench_size.py --repeats 5 --max-tokens 128

The random bench target falls into a short loop after a few tokens (tiny.py's `predictable`
walk), text a prompt-lookup drafter can predict. Engines:

- target-only (pyllama-spec in-process; llama-server with no draft);
- pyllama-spec ngram-simple (keys of 4..2 tokens, draft_max 15): past the end of the history
  the draft keeps copying the repetition (drafters/ngram.py);
- the same drafter with the draft stopping at the end of the history, as llama.cpp's does;
- llama-server --spec-type ngram-simple, key 1, draft 15: its rule also wants at least `key`
  tokens to copy after the match, so on a period-2 loop its default key (12) and key 2 never
  draft (measured: 62 calls, 0 drafts); key 1 drafts one token a step.

Decode tokens/s from each engine's own timer (prefill excluded), min / median / max.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import httpx  # noqa: E402
from concurrent_chats import ServerProcess, free_port  # noqa: E402

import pyllama_spec as ps  # noqa: E402
from pyllama_spec import native_build  # noqa: E402
from pyllama_spec.devtools import tiny

PROMPT = "Write a long story about the sea."


class Local:
    def __init__(self, files, spec: str, copy_past_end: bool = True) -> None:
        self.engine = ps.load(files.target, n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=1, spec_type=spec,
                              draft_max=15, flash_attn=False)
        if self.engine.drafter is not None:
            self.engine.drafter.copy_past_end = copy_past_end

    def run(self, max_tokens: int) -> dict:
        r = self.engine.generate(PROMPT, max_tokens=max_tokens, cache_prompt=False)
        s = r.stats
        return dict(tokens=r.tokens, tps=s.tokens_per_second, drafted=s.drafted, accepted=s.accepted,
                    steps=s.target_steps)

    def close(self) -> None:
        self.engine.close()


class Remote:
    def __init__(self, files, spec: bool) -> None:
        port = free_port()
        args = [str(native_build.find_llama_server()), "-m", str(files.target), "-c", "2048", "-b", "512",
                "-ub", "512", "-t", "1", "-fa", "off", "--host", "127.0.0.1", "--port", str(port), "-np", "1",
                "--no-warmup"]
        if spec:
            args += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "1",
                     "--spec-ngram-simple-size-m", "15"]
        self.server = ServerProcess("llama-server" + (" ngram" if spec else ""), args, port)

    def run(self, max_tokens: int) -> dict:
        body = {"prompt": PROMPT, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "samplers": ["top_k"],
                "cache_prompt": False, "return_tokens": True}
        out = httpx.post(self.server.url + "/completion", json=body, timeout=600).json()
        t = out["timings"]
        return dict(tokens=out.get("tokens", []), tps=t["predicted_per_second"], drafted=int(t.get("draft_n", 0)),
                    accepted=int(t.get("draft_n_accepted", 0)), steps=None)

    def close(self) -> None:
        self.server.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    files = tiny.make_bench_set(native_build.cache_root() / "tiny-models")
    engines = {
        "pyllama-spec target-only": Local(files, "none"),
        "pyllama-spec ngram-simple": Local(files, "ngram-simple"),
        "pyllama-spec ngram-simple, stopping at the history's end": Local(files, "ngram-simple", copy_past_end=False),
        "llama-server target-only": Remote(files, False),
        "llama-server ngram-simple": Remote(files, True),
    }
    samples: dict[str, list[dict]] = {name: [] for name in engines}
    try:
        for name, e in engines.items():
            e.run(8)  # warm-up, not measured
        for rnd in range(args.repeats):
            order = list(engines.items()) if rnd % 2 == 0 else list(reversed(list(engines.items())))
            for name, e in order:
                samples[name].append(e.run(args.max_tokens))
    finally:
        for e in engines.values():
            e.close()
    reference = samples["pyllama-spec target-only"][0]["tokens"]
    base = {"pyllama-spec": statistics.median(x["tps"] for x in samples["pyllama-spec target-only"]),
            "llama-server": statistics.median(x["tps"] for x in samples["llama-server target-only"])}
    print("| engine | decode tok/s min / median / max | × its target-only | drafted | accepted | "
          "tokens per step | same tokens as target-only |")
    print("|---|---|---|---|---|---|---|")
    for name, xs in samples.items():
        tps = sorted(x["tps"] for x in xs)
        last = xs[-1]
        per_step = f"{len(last['tokens']) / last['steps']:.2f}" if last["steps"] else \
            (f"{1 + last['accepted'] / max(1, len(last['tokens']) - last['accepted']):.2f}" if last["drafted"] else "1")
        same = all(x["tokens"][:len(reference)] == reference for x in xs) if xs[0]["tokens"] else "n/a"
        kind = name.split()[0]
        print(f"| {name} | {tps[0]:.1f} / {statistics.median(tps):.1f} / {tps[-1]:.1f} | "
              f"{statistics.median(tps) / base[kind]:.2f} | {last['drafted']} | {last['accepted']} | {per_step} | "
              f"{same} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
