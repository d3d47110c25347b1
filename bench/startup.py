#!/usr/bin/env python3
"""Seconds from starting a server to its first 200 on /health: `pyllama-spec serve` and llama-server
(built from the same pin: `python build.py --tools`) on the same file, started in turn (the order
alternating by round), min / median / max over --repeats rounds: llama-server as it starts by
default (a warm-up decode) and with --no-warmup, serve as it starts by default (no warm-up).
Beside them, the floor of any server written as serve is: a Python process that imports what serve
computes, prints and serves with (numpy, click, rich, uvicorn, Starlette) and answers /health, with
no model and none of this package.

    python bench/startup.py --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

#: The floor: what serve imports before any of its own modules, answering /health at once.
FLOOR = """
import sys
import numpy, click, rich.console  # what serve computes and prints with
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

async def health(request):
    return JSONResponse({"status": "ok"})

port = int(sys.argv[sys.argv.index("--port") + 1])
uvicorn.run(Starlette(routes=[Route("/health", health)]), host="127.0.0.1", port=port, log_level="warning")
"""


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
               ("serve", [sys.executable, "-m", "pyllama_spec", "serve", *files]),
               ("python floor (numpy, click, rich, uvicorn, Starlette; no model)", [sys.executable, "-c", FLOOR])]
    times = {name: [] for name, _ in servers}
    for r in range(args.repeats):
        for name, cmd in (servers if r % 2 == 0 else servers[::-1]):
            times[name].append(_time_to_health(cmd))
    for name, t in times.items():
        t.sort()
        print(f"{name}: {t[0]:.2f} / {statistics.median(t):.2f} / {t[-1]:.2f} s (min / median / max)")
    floor = "python floor (numpy, click, rich, uvicorn, Starlette; no model)"
    for name in ("llama-server", "llama-server --no-warmup"):
        for ours in ("serve", floor):
            ratio = statistics.median(times[ours]) / statistics.median(times[name])
            print(f"{ours.split(' (')[0]} / {name} (medians): {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
