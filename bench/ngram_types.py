#!/usr/bin/env python3
"""llama.cpp's n-gram speculative types side by side: `pyllama-spec serve` and llama-server (built from
the same pin: `python build.py --tools`) on the embedded trained target, each type and target-only.

Both servers run one slot, one thread, -c 4096, flash attention off; each type starts both anew.
Per round, every prompt of tests/test_ngram_types.py (code the target continues with long
repetitions) is sent to each server in turn (the order alternating by round), greedy, 400 tokens,
cache_prompt off. Reported per server and type: decode tok/s (the three prompts' tokens over their
decode time, timings.predicted_ms) min / median / max over rounds, and the acceptance (accepted /
drafted, identical across rounds: greedy). The ratio columns divide by the same server's
target-only median.

    python bench/ngram_types.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import urllib.request

PROMPTS = ("class Stack:\n    def __init__(self):\n        self.items = []\n", "def main():\n",
           "import os\nimport sys\n\ndef f(x):\n    return x\n\ndef g(x):\n    return x\n\n")
TYPES = ("none", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", "ngram-mod,ngram-map-k")


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def _round(url: str) -> tuple[float, int, int]:
    tokens = ms = drafted = accepted = 0
    for prompt in PROMPTS:
        t = _post(url, {"prompt": prompt, "n_predict": 400, "temperature": 0, "cache_prompt": False})["timings"]
        tokens += t["predicted_n"]
        ms += t["predicted_ms"]
        drafted += t.get("draft_n", 0)
        accepted += t.get("draft_n_accepted", 0)
    return tokens / ms * 1000, drafted, accepted


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from pyllama_spec import native_build
    from pyllama_spec.devtools.servers import running_server
    from pyllama_spec.embedded import embedded_models

    llama_server = native_build.find_llama_server()
    if llama_server is None:
        print("llama-server is not built: python build.py --tools", file=sys.stderr)
        return 2
    target = str(embedded_models().target)
    common = ["-m", target, "-c", "4096", "-np", "1", "-t", "1", "-fa", "off"]
    rows = []
    for spec_type in TYPES:
        spec = [] if spec_type == "none" else ["--spec-type", spec_type]
        with running_server([str(llama_server), *common, *spec, "--no-warmup"]) as theirs, \
                running_server([sys.executable, "-m", "pyllama_spec", "serve", *common, *spec]) as ours:
            servers = [("llama-server", theirs), ("serve", ours)]
            speeds = {name: [] for name, _ in servers}
            counts = {}
            for r in range(args.repeats):
                for name, url in (servers if r % 2 == 0 else servers[::-1]):
                    tps, drafted, accepted = _round(url)
                    speeds[name].append(tps)
                    counts[name] = (drafted, accepted)
        for name in speeds:
            rows.append((spec_type, name, sorted(speeds[name]), counts[name]))
    base = {name: statistics.median(s) for t, name, s, _ in rows if t == "none"}
    print("| type | server | decode tok/s min / median / max | × its target-only | drafted | accepted | acceptance |")
    print("|---|---|---|---|---|---|---|")
    for spec_type, name, s, (drafted, accepted) in rows:
        med = statistics.median(s)
        acc = f"{accepted / drafted:.2f}" if drafted else "-"
        print(f"| {spec_type} | {name} | {s[0]:.0f} / {med:.0f} / {s[-1]:.0f} | {med / base[name]:.2f} | "
              f"{drafted} | {accepted} | {acc} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
