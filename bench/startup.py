#!/usr/bin/env python3
"""Seconds from starting a server to its first 200 on /health: `pyllama-spec serve` and llama-server
(built from the same pin: `python build.py --tools`) on the same file, started in turn (the order
alternating by round), min / median / max over --repeats rounds: llama-server as it starts by
default (a warm-up decode) and with --no-warmup, serve as it starts by default (no warm-up).

    python bench/startup.py --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time


def _time_to_health(cmd: list[str]) -> float:
    from pyllama_spec.devtools.servers import stop, wait_healthy
    from pyllama_spec.ports import free_port

    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="startup-", suffix=".log", delete=False)
    start = time.perf_counter()
    proc = subprocess.Popen([*cmd, "--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=log)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, log.name, poll=0.01)  # polled often: this is the figure
        return time.perf_counter() - start
    finally:
        stop(proc)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    from pyllama_spec import native_build
    from pyllama_spec.embedded import embedded_models

    llama_server = native_build.find_llama_server()
    if llama_server is None:
        print("llama-server is not built: python build.py --tools", file=sys.stderr)
        return 2
    m = embedded_models()
    files = ["-m", str(m.target), "--mmproj", str(m.mmproj), "-md", str(m.draft), "--spec-type", "draft-dflash",
             "-c", "4096", "-np", "1", "-t", "1", "-fa", "off"]
    servers = [("llama-server", [str(llama_server), *files]),  # its default: a warm-up decode
               ("llama-server --no-warmup", [str(llama_server), *files, "--no-warmup"]),
               ("serve", [sys.executable, "-m", "pyllama_spec", "serve", *files])]
    times = {name: [] for name, _ in servers}
    for r in range(args.repeats):
        for name, cmd in (servers if r % 2 == 0 else servers[::-1]):
            times[name].append(_time_to_health(cmd))
    for name, t in times.items():
        t.sort()
        print(f"{name}: {t[0]:.2f} / {statistics.median(t):.2f} / {t[-1]:.2f} s (min / median / max)")
    for name in ("llama-server", "llama-server --no-warmup"):
        ratio = statistics.median(times["serve"]) / statistics.median(times[name])
        print(f"serve / {name} (medians): {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
