#!/usr/bin/env python3
"""`serve` with one slot against several sharing one pool of cells: one user, and several at once.

    python bench/serve_slots.py --rounds 8
    python bench/serve_slots.py --configs "-np 1;-np 4 -kvu" --streams 1,4

Each configuration (``;``-separated `serve` flags; the embedded pair at its defaults otherwise) is
one `serve` process, all of them up at once. A round sends the held-out prompts to each server in
turn (the order alternating by round), as ``--streams`` concurrent chat streams
(`/v1/chat/completions`, greedy, ``--max-tokens``): with 1 stream, the decode tokens/s the answers'
`timings` report (what one user sees); with more, the answers' tokens over the round's wall time
(what the server gives them together). min / median / max over the rounds, and the ratio to the
first configuration per round. Every answer is checked against the first configuration's.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

from measure_trained_pair import held_out_prompts  # noqa: E402

from pyllama_spec.ports import free_port  # noqa: E402


def _start(flags: list[str], port: int, log: Path) -> subprocess.Popen:
    with log.open("w") as err:  # (the child keeps its own copy of the file)
        proc = subprocess.Popen([sys.executable, "-m", "pyllama_spec", "serve", "--port", str(port), *flags],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"serve {' '.join(flags)} exited: see {log}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except OSError:
            time.sleep(0.2)
    _stop(proc)
    raise SystemExit(f"serve {' '.join(flags)} did not answer /health within 300 s")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _ask(port: int, text: str, max_tokens: int) -> tuple[str, int, float]:
    body = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.load(r)
    t = out["timings"]
    return out["choices"][0]["message"]["content"], t["predicted_n"], t["predicted_ms"] / 1000


def _round(port: int, prompts: list[str], streams: int, max_tokens: int) -> tuple[list[str], float]:
    """The answers, and the round's rate: decode tokens/s (one stream) or tokens over wall time."""
    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        answers = list(pool.map(lambda p: _ask(port, p, max_tokens), prompts))
    wall = time.perf_counter() - start
    tokens = sum(a[1] for a in answers)
    rate = tokens / sum(a[2] for a in answers) if streams == 1 else tokens / wall
    return [a[0] for a in answers], rate


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="-np 1;-np 4 -kvu", help="`serve` flags per server, ';'-separated")
    ap.add_argument("--streams", default="1,4", help="concurrent streams, comma-separated")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--port", type=int, default=None, help="the first server's port, the others' next to it "
                    "(default: free ports)")
    args = ap.parse_args()
    configs = [c.strip() for c in args.configs.split(";")]
    prompts = held_out_prompts(args.prompts)
    logs = Path(tempfile.mkdtemp(prefix="pyllama-spec-serve-slots-"))
    ports = [free_port() if args.port is None else args.port + i for i in range(len(configs))]
    procs = []
    try:
        for i, c in enumerate(configs):
            procs.append(_start(shlex.split(c), ports[i], logs / f"serve-{i}.log"))
        print("| streams | serve flags | tokens/s min / median / max | / first per round |")
        print("|---|---|---|---|")
        for streams in [int(s) for s in args.streams.split(",")]:
            rates = {c: [] for c in configs}
            for k in range(args.rounds):
                order = list(enumerate(configs)) if k % 2 == 0 else list(reversed(list(enumerate(configs))))
                answers = {}
                for i, c in order:
                    answers[c], rate = _round(ports[i], prompts, streams, args.max_tokens)
                    rates[c].append(rate)
                if any(a != answers[configs[0]] for a in answers.values()):
                    raise SystemExit(f"the answers differ between {configs} ({streams} streams)")
            for c in configs:
                r = rates[c]
                ratio = [x / y for x, y in zip(r, rates[configs[0]])]
                print(f"| {streams} | `{c}` | {min(r):.0f} / {statistics.median(r):.0f} / {max(r):.0f} | "
                      f"{min(ratio):.2f} / {statistics.median(ratio):.2f} / {max(ratio):.2f} |", flush=True)
    finally:
        for p in procs:
            _stop(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
