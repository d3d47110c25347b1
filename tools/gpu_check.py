#!/usr/bin/env python3
"""The GPU check in one call: build for the local GPU, run the tests on it, benchmark against
llama-server built the same way, and write the results under OUTDIR.

    python tools/gpu_check.py OUTDIR            # on a machine with an NVIDIA GPU and nvcc
    python tools/gpu_check.py OUTDIR --dry-run  # every step but the GPU ones, on the CPU (CI)

Steps: find the GPU and its compute capability (nvidia-smi); `build.py --cuda --cuda-arch N
--tools` (cached, this architecture only); check that the build sees the GPU and that a model
loads with every layer offloaded (fail loudly otherwise: never a silent CPU run); the test
suite; `pyllama-spec bench --widened -ngl 99` against llama-server. Writes gpu_check.json,
gpu_check.md, tests.log, bench.json and bench.md. Exits non-zero when a step fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class CheckFailed(Exception):
    pass


def run(cmd: list[str], log: Path | None = None, timeout: float = 600, env: dict | None = None) -> str:
    """Run a step; its output goes to log (and is returned). A non-zero exit fails the check."""
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))
    out = proc.stdout + proc.stderr
    if log is not None:
        log.write_text(out)
    if proc.returncode != 0:
        raise CheckFailed(f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-3000:]}")
    return out


def find_gpu() -> dict:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CheckFailed(f"nvidia-smi cannot be run ({e}): no NVIDIA GPU here (use --dry-run on a CPU machine)")
    if not out:
        raise CheckFailed("nvidia-smi lists no GPU")
    name, cap, memory = [x.strip() for x in out.splitlines()[0].split(",")]
    return {"name": name, "compute_cap": cap, "cuda_arch": cap.replace(".", ""), "memory": memory}


def offload_check(n_gpu_layers: int) -> dict:
    """Load a tiny model with every layer offloaded, in a child, and read llama.cpp's own report."""
    code = (
        "import logging, json, sys\n"
        "import pyllama_spec as ps\n"
        "from pyllama_spec.bindings import native_info\n"
        "from pyllama_spec.devtools import tiny\n"
        "lines = []\n"
        "h = logging.Handler(); h.emit = lambda r: lines.append(r.getMessage())\n"
        "log = logging.getLogger('pyllama_spec.native'); log.addHandler(h); log.setLevel(logging.INFO)\n"
        "m = tiny.make_tiny_set(sys.argv[1])\n"
        f"e = ps.load(m.target, spec_type='none', n_ctx=512, n_gpu_layers={n_gpu_layers})\n"
        "print(json.dumps({'devices': native_info.devices(), 'backends': native_info.backend_names(),\n"
        "                  'offload': [l for l in lines if 'offloaded' in l]}))\n"
    )
    out = run([sys.executable, "-c", code, str(REPO / ".gpu-check-models")])
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--dry-run", action="store_true", help="CPU only: every step but the GPU ones")
    ap.add_argument("--tests", default="tests", help="what pytest runs (default: the whole suite)")
    ap.add_argument("--bench-tokens", type=int, default=64)
    ap.add_argument("--bench-repeats", type=int, default=3)
    args = ap.parse_args()
    out = args.outdir
    out.mkdir(parents=True, exist_ok=True)
    report = {"dry_run": args.dry_run, "machine": platform.node(), "cpus": os.cpu_count(), "steps": []}
    # One thread on the CPU dry run: OpenMP spinning makes two slow on a busy 2-core machine.
    threads = "1" if args.dry_run else str(max(1, min(16, os.cpu_count() or 1)))
    ngl = 0 if args.dry_run else 99

    def step(name, fn):
        t0 = time.perf_counter()
        entry = {"step": name}
        report["steps"].append(entry)
        try:
            entry["result"] = fn()
            entry["ok"] = True
        except (CheckFailed, subprocess.TimeoutExpired, OSError, ValueError) as e:
            entry["ok"], entry["error"] = False, str(e)[-4000:]
            raise
        finally:
            entry["seconds"] = round(time.perf_counter() - t0, 1)

    try:
        gpu = step("find the GPU", lambda: {"skipped": "dry run"} if args.dry_run else find_gpu())
        build = [sys.executable, "build.py", "--tools"]
        if not args.dry_run:
            build += ["--cuda", "--cuda-arch", gpu["cuda_arch"]]
        step("build (cached)", lambda: run(build, out / "build.log", timeout=1800)[-300:])
        step("install", lambda: run([sys.executable, "-m", "pip", "install", "-q", "-e", ".[test]"],
                                    out / "install.log", timeout=900)[-300:])

        def check_offload():
            facts = offload_check(ngl)
            if not args.dry_run:
                if not any(d["name"].upper().startswith(("CUDA", "ROCM", "VULKAN")) for d in facts["devices"]):
                    raise CheckFailed(f"the build sees no GPU device: {facts['devices']}")
                if not facts["offload"] or any(
                        m.split("offloaded")[1].split("/")[0].strip() != m.split("/")[1].split()[0]
                        for m in facts["offload"]):
                    raise CheckFailed(f"not every layer went to the GPU: {facts['offload']}")
            return facts

        step("the GPU is used", check_offload)
        step("tests", lambda: run([sys.executable, "-m", "pytest", "-q", *args.tests.split()], out / "tests.log",
                                  timeout=1200).strip().splitlines()[-1])
        # the interpreter running this script, not whatever "pyllama-spec" PATH finds (a venv not
        # activated, a pyenv without its shims rehashed)
        bench = [sys.executable, "-m", "pyllama_spec", "bench", "-t", threads, "-n", str(args.bench_tokens), "--repeats",
                 str(args.bench_repeats), "-ngl", str(ngl), "--json-out", str(out / "bench.json")]
        if not args.dry_run:
            bench.append("--widened")  # the trained pair's acceptance at the cost of a 142M model
        step("bench vs llama-server", lambda: (out / "bench.md").write_text(run(bench, timeout=1200)) and "bench.md")
        ok = True
    except CheckFailed:
        ok = False
    report["ok"] = ok
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    lines = [f"# GPU check ({'dry run, CPU only' if args.dry_run else 'GPU'})", "",
             "| step | ok | seconds | result |", "|---|---|---|---|"]
    for s in report["steps"]:
        result = s.get("error") or s.get("result")
        lines.append(f"| {s['step']} | {'yes' if s['ok'] else '**NO**'} | {s['seconds']} | "
                     f"{str(result)[:200].replace('|', '/').replace(chr(10), ' ')} |")
    if (out / "bench.md").exists():
        lines += ["", (out / "bench.md").read_text()]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
