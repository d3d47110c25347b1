"""Corrupt GGUF files never kill the process: seeded mutations of the trained target, mmproj
and draft shipped in the package (``pyllama_spec/models``), each loaded with
``pyllama_spec.load`` and run for two tokens in a child worker; the only outcomes allowed are
success or a ``PyllamaError``. A death by a signal or a hang fails the test, naming the file
kind, the mutation's index and what it changed.

Mutations (``mutate``): bit flips, runs of random bytes, a 64-bit count / length / dimension /
offset overwritten with a huge or off-by-a-little value, a type field or an integer
hyperparameter overwritten, truncation. Most land in the header (key/values and tensor
infos), where llama.cpp trusts the file; some in the tensor data.

One long-lived worker (this file run as a script: ``python tests/test_gguf_fuzz.py --worker``)
takes jobs on stdin and answers one JSON line each; it is restarted when it dies. Where glibc's
malloc checker is installed the worker runs under it, so that a file which overflows a native
buffer fails at its own job; a job that dies is run again alone, to tell a file that kills the
process from one whose predecessor damaged it. More mutations, another seed, or a run without
the Python validator (to see what it prevents)::

    python tests/test_gguf_fuzz.py --explore 2000 [--seed 7] [--no-validate]
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import N_THREADS, REPO_ROOT, TINY_ENGINE  # noqa: E402

from pyllama_spec.embedded import embedded_models  # noqa: E402

_TRAINED = embedded_models()  # the trained pair shipped in the package
FILES = {"target": _TRAINED.target, "mmproj": _TRAINED.mmproj, "draft": _TRAINED.draft}
FUZZ_SEED = 20261203
N_PER_FILE = 200          # 600 mutations in all
JOB_TIMEOUT_S = 30.0      # one load + 2 tokens takes ~50 ms; a job this slow is a hang
BUDGET_S = 240.0          # the whole run (normally ~10 s on 2 cores)
MALLOC_DEBUG = "/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"  # glibc's MALLOC_CHECK_ support


# ----------------------------------------------------------------------------- mutations


@dataclass(frozen=True)
class Field:
    offset: int
    size: int          # 4 or 8 bytes
    kind: str          # "count" (length, count, dim, offset), "type", "value" (an integer key/value)
    value: int


def header_fields(data: bytes) -> tuple[list[Field], int]:
    """The integer fields of a well-formed GGUF header, and where the tensor data starts.

    The test's own walk of the format (independent of ``gguf_check``), to aim mutations."""
    fields: list[Field] = []
    pos = 0

    def u(size: int, kind: str) -> int:
        nonlocal pos
        v = int.from_bytes(data[pos:pos + size], "little")
        fields.append(Field(pos, size, kind, v))
        pos += size
        return v

    def string() -> None:
        nonlocal pos
        n = u(8, "count")
        pos += n

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    pos = 8
    n_tensors, n_kv = u(8, "count"), u(8, "count")
    alignment = 32
    for _ in range(n_kv):
        key_at = pos + 8
        string()
        key = data[key_at:pos]
        vtype = u(4, "type")
        if vtype == 9:
            elem, n = u(4, "type"), u(8, "count")
            for _ in range(n):
                if elem == 8:
                    string()
                else:
                    pos += sizes[elem]
        elif vtype == 8:
            string()
        else:
            if vtype in (4, 5, 10, 11):
                v = u(sizes[vtype], "value")
                if key == b"general.alignment":
                    alignment = v
            else:
                pos += sizes[vtype]
    for _ in range(n_tensors):
        string()
        n_dims = u(4, "count")
        for _ in range(n_dims):
            u(8, "count")
        u(4, "type")
        u(8, "count")
    return fields, -(-pos // alignment) * alignment


HUGE = [2**64 - 1, 2**63 - 1, 2**63, 2**62, 2**60, 2**48, 2**40, 2**32 + 1, 2**32, 2**31]


def mutate(data: bytes, fields: list[Field], data_start: int, rng: np.random.Generator) -> tuple[bytes, str]:
    """One seeded mutation of ``data``: (mutated bytes, a description to reproduce it by)."""
    buf = bytearray(data)
    size = len(buf)

    def where() -> int:  # mostly the header, where llama.cpp reads what the file claims
        return int(rng.integers(0, data_start)) if rng.random() < 0.85 else int(rng.integers(data_start, size))

    kind = rng.choice(["bitflip", "bytes", "count", "field", "truncate"], p=[0.3, 0.2, 0.2, 0.15, 0.15])
    if kind == "bitflip":
        bits = [(where(), int(rng.integers(0, 8))) for _ in range(int(rng.integers(1, 4)))]
        for at, bit in bits:
            buf[at] ^= 1 << bit
        return bytes(buf), f"bitflip {bits}"
    if kind == "bytes":
        at, n = where(), int(rng.integers(1, 17))
        buf[at:at + n] = rng.integers(0, 256, size=min(n, size - at), dtype=np.uint8).tobytes()
        return bytes(buf), f"random bytes at {at} (+{n})"
    if kind == "count":
        f = [f for f in fields if f.kind == "count"][int(rng.integers(0, sum(f.kind == "count" for f in fields)))]
        choice = HUGE + [f.value + 1, f.value - 1, f.value * 2, f.value + 2**31, 0]
        v = int(choice[int(rng.integers(0, len(choice)))]) % 2 ** (8 * f.size)
        buf[f.offset:f.offset + f.size] = v.to_bytes(f.size, "little")
        return bytes(buf), f"count at {f.offset}: {f.value} -> {v}"
    if kind == "field":
        pool = [f for f in fields if f.kind in ("type", "value")]
        f = pool[int(rng.integers(0, len(pool)))]
        if f.kind == "type":
            choice = list(range(14)) + [-1 % 2**32, 43, 1000]
        else:
            choice = [0, 1, 2, 3, 7, 255, -1 % 2**32, 2**31, f.value + 1, f.value * 2, f.value // 2]
        v = int(choice[int(rng.integers(0, len(choice)))]) % 2 ** (8 * f.size)
        buf[f.offset:f.offset + f.size] = v.to_bytes(f.size, "little")
        return bytes(buf), f"{f.kind} at {f.offset}: {f.value} -> {v}"
    at = int(rng.integers(0, data_start)) if rng.random() < 0.7 else int(rng.integers(data_start, size))
    return bytes(buf[:at]), f"truncate at {at} of {size}"


def mutations(kind: str, n: int, seed: int = FUZZ_SEED):
    """``n`` reproducible mutations of FILES[kind]: (index, description, bytes)."""
    data = FILES[kind].read_bytes()
    fields, data_start = header_fields(data)
    for i in range(n):
        rng = np.random.default_rng([seed, list(FILES).index(kind), i])
        out, desc = mutate(data, fields, data_start, rng)
        yield i, desc, out


# ----------------------------------------------------------------------------- worker (child)


def _worker_main() -> None:
    """Jobs on stdin ({"kind", "path"}), one JSON answer each on the protocol pipe."""
    import faulthandler

    faulthandler.enable()  # a native crash names the Python frame that made it
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything native prints goes to stderr, never into the protocol

    import pyllama_spec as ps
    from pyllama_spec.errors import PyllamaError

    if os.environ.get("PYLLAMA_FUZZ_NO_VALIDATE"):
        import pyllama_spec.bindings.model

        pyllama_spec.bindings.model.validate_gguf = lambda path, what: None
    load = ps.load
    image = np.zeros((56, 56, 3), np.uint8)
    image[::2, ::3] = (200, 30, 90)
    common = dict(n_ctx=256, **TINY_ENGINE)
    proto.write("READY\n")
    for line in sys.stdin:
        job = json.loads(line)
        print(f"### job {job['id']}", file=sys.stderr, flush=True)
        try:
            if job["kind"] == "target":
                with load(job["path"], **common) as e:
                    e.generate("def f(x):", max_tokens=2)
            elif job["kind"] == "mmproj":
                with load(FILES["target"], mmproj=job["path"], **common) as e:
                    e.generate(f"{ps.MEDIA_MARKER}\nA picture of", images=[image], max_tokens=2)
            else:
                with load(FILES["target"], draft=job["path"], draft_max=3, **common) as e:
                    e.generate("def f(x):", max_tokens=2)
            answer = {"outcome": "ok"}
        except PyllamaError as e:
            answer = {"outcome": "refused", "error": type(e).__name__, "message": str(e)[:300]}
        except Exception as e:  # noqa: BLE001 - any other exception is a finding, reported by the parent
            answer = {"outcome": "other exception", "error": type(e).__name__, "message": str(e)[:300]}
        proto.write(json.dumps(answer) + "\n")


# ----------------------------------------------------------------------------- parent


class Worker:
    """One child worker: ``run(job)`` returns its answer, or a death / hang record."""

    def __init__(self, log_path: Path, env: dict):
        self.log_path, self.env, self.proc = log_path, env, None

    def start(self) -> None:
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker"], cwd=REPO_ROOT, env=self.env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines), daemon=True).start()
        ready = self.lines.get(timeout=120)
        if ready != "READY\n":
            raise RuntimeError(f"fuzz worker did not start: {ready!r}; see {self.log_path}")

    @staticmethod
    def _pump(stream, lines: queue.Queue) -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)  # EOF: the worker died

    def run(self, job: dict) -> dict:
        if self.proc is None:
            self.start()
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        try:
            line = self.lines.get(timeout=JOB_TIMEOUT_S)
        except queue.Empty:
            line = "HANG"
        if line not in (None, "HANG"):
            return json.loads(line)
        if line == "HANG":
            self.proc.kill()
        rc = self.proc.wait()
        self.log.flush()
        tail = self._log_after(job["id"])
        self.stop()
        if line == "HANG":
            return {"outcome": "hang", "message": f"no answer in {JOB_TIMEOUT_S:.0f} s"}
        return {"outcome": f"died (rc {rc})", "message": tail}

    def _log_after(self, job_id: int) -> str:
        text = self.log_path.read_text(errors="replace")
        text = text[text.rfind(f"### job {job_id}\n"):]
        words = ("GGML_ASSERT", "GGML_ABORT", "error", "Fatal", "free()", "corrupted", "malloc")
        key = [ln for ln in text.splitlines() if any(w in ln for w in words)]
        return " | ".join(key[:4]) or " | ".join(text.splitlines()[1:4])

    def stop(self) -> int | None:
        """End the worker; its exit status (None if none was running)."""
        rc = None
        if self.proc is not None:
            try:
                self.proc.stdin.close()  # end of jobs: the worker leaves its loop
            except BrokenPipeError:
                pass
            try:
                rc = self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                rc = self.proc.wait()
            self.proc = None
            self.log.close()
        return rc


ALLOWED = ("ok", "refused")


def run_fuzz(work: Path, n_per_file: int, *, seed: int = FUZZ_SEED, validate: bool = True,
             budget_s: float = BUDGET_S, verbose: bool = False) -> tuple[Counter, list[str], int]:
    """Run the mutations; (outcome counts, failure lines, mutations run)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", str(N_THREADS))
    if Path(MALLOC_DEBUG).is_file():
        # glibc checks the heap on every free: a file that overflows a native buffer fails at its
        # own job instead of corrupting memory silently
        env["LD_PRELOAD"] = " ".join(filter(None, [env.get("LD_PRELOAD"), MALLOC_DEBUG]))
        env["MALLOC_CHECK_"] = "3"
    if not validate:
        env["PYLLAMA_FUZZ_NO_VALIDATE"] = "1"
    worker = Worker(work / "worker.log", env)
    outcomes: Counter = Counter()
    failures: list[str] = []
    t0, done, previous = time.monotonic(), 0, None  # previous: the last file the live worker ran
    try:
        for kind in FILES:
            for i, desc, data in mutations(kind, n_per_file, seed):
                if time.monotonic() - t0 > budget_s:
                    failures.append(f"time budget of {budget_s:.0f} s spent after {done} mutations")
                    return outcomes, failures, done
                name = f"{kind} #{i} ({desc})"
                path = work / f"{kind}-{i:04d}.gguf"
                path.write_bytes(data)
                job, n_failures = {"id": done, "kind": kind, "path": str(path)}, len(failures)
                answer = worker.run(job)
                done += 1
                if answer["outcome"].startswith("died") and previous is not None:
                    # damage done by an earlier file can kill a later job: run this one again alone
                    again = worker.run(job)
                    if again["outcome"] in ALLOWED:
                        failures.append(f"{previous}: the worker died on the next file ({name}), which is "
                                        f"{again['outcome']} alone: {answer['outcome']}: {answer.get('message', '')}")
                        answer = again
                label = answer["outcome"] + (f": {answer['error']}" if "error" in answer else "")
                outcomes[f"{kind} {label}"] += 1
                if answer["outcome"] not in ALLOWED:
                    failures.append(f"{name}: {answer['outcome']}: {answer.get('message', '')}")
                previous = name if worker.proc is not None else None
                for line in failures[n_failures:] if verbose else ():
                    print(line, flush=True)
                path.unlink()
        rc = worker.stop()
        if rc is not None and rc < 0:  # damage that surfaces only at interpreter exit
            failures.append(f"the worker died at exit (rc {rc}) after {previous}: see {worker.log_path}")
    finally:
        worker.stop()
    return outcomes, failures, done


def test_corrupt_model_files_raise_errors_never_kill_the_process(tmp_path):
    t0 = time.monotonic()
    outcomes, failures, n = run_fuzz(tmp_path, N_PER_FILE)
    took = time.monotonic() - t0
    print(f"\n{n} mutations in {took:.1f} s:")
    for label, count in sorted(outcomes.items()):
        print(f"  {count:4d}  {label}")
    assert n == N_PER_FILE * len(FILES)
    assert not failures, f"{len(failures)} of {n} mutated files were not refused cleanly:\n" + "\n".join(failures)


def test_mutations_are_reproducible_and_mostly_in_the_header():
    a = [desc for _, desc, _ in mutations("mmproj", 20)]
    b = [desc for _, desc, _ in mutations("mmproj", 20)]
    assert a == b
    data = FILES["target"].read_bytes()
    fields, data_start = header_fields(data)
    assert 0 < data_start < len(data) and any(f.kind == "type" for f in fields)
    first_changed = [_first_difference(m, data) for _, _, m in mutations("target", 200)]
    assert sum(at < data_start for at in first_changed) > 0.7 * len(first_changed)


def _first_difference(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.frombuffer(a, np.uint8, n) != np.frombuffer(b, np.uint8, n))
    return int(diff[0]) if len(diff) else n


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _worker_main()
    else:
        import argparse
        import tempfile

        ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        ap.add_argument("--explore", type=int, default=N_PER_FILE, help="mutations per file")
        ap.add_argument("--seed", type=int, default=FUZZ_SEED)
        ap.add_argument("--no-validate", action="store_true", help="skip the Python validator (see what it prevents)")
        args = ap.parse_args()
        with tempfile.TemporaryDirectory() as d:
            out, fails, n = run_fuzz(Path(d), args.explore, seed=args.seed, validate=not args.no_validate,
                                     budget_s=1e9, verbose=True)
        print(f"{n} mutations")
        for label, count in sorted(out.items()):
            print(f"  {count:5d}  {label}")
        print(f"{len(fails)} failures")
