#!/usr/bin/env python3
"""What a hostile client costs `pyllama-spec serve`, measured on loopback.

    python bench/hostile_requests.py [--tree DIR] [--out FILE.json]

Starts `pyllama-spec serve -np 2` on the tiny test models (from ``--tree``: a source checkout
with its native part built; default this one) and measures, one server per item:

- ``newlines``: a 4 MiB prompt of short lines (`"x = 1\\n" * 700000`): seconds to its answer,
  and the latency of a 1-token request sent 0.5 s later to the other slot;
- ``long_stop``: four stop strings of 1,000,000 characters, 4 tokens: seconds, and the other
  slot's latency as above;
- ``client_leaves``: a non-streamed 8000-token completion whose client closes at 0.3 s: seconds
  the server stays busy after the close;
- ``huge_prompt``: a 60 MiB prompt without newlines: seconds to its answer and the server's peak
  resident memory (VmHWM) before and after;
- ``sigterm``: SIGTERM while two 8000-token completions run: seconds to exit;
- ``costly_schema``: a JSON schema of 20,000 optional properties (issue 43, item 1), and
  ``grammar_repetitions``: 11,800 rules of ``"x"{0,2000}`` (item 3), each beside a request on the
  other slot as above, with the server's peak resident memory after;
- ``grammar_optional_run``: ``root ::= (.?){400} "b"``, 400 optional items in a row (80,000 stacks of
  llama.cpp's grammar engine after a character), and ``grammar_ambiguous``: a grammar whose stacks
  double at every token of a run of "a"s (``r ::= "a" r "b" | "a" r "c" | "d"``) with a logit bias
  that makes "a" the pick, 16 tokens (the item after issue 43's review), each beside a request on
  the other slot;
- ``schema_near_limit``: a JSON schema of 285 optional properties, just under the conversion limit
  (item 2), beside a request on the other slot;
- ``responses_store``: 380 stored Responses requests of 300 KB, mostly an unused field of an input
  item (item 4): the server's peak resident memory after;
- ``cross_site``: a ``text/plain`` POST to ``/lora-adapters`` with a foreign ``Origin`` (item 8): its
  status, and whether the scales changed;
- ``numeric_body``: a chat request with 3,000,000 floats (61 MB) in a field no route reads,
  ``nested_numeric_body``: 3,861,000 floats of 3 decimals in 99,000 lists (30 MB; freeing
  it at once held the GIL 60-106 ms), and
  ``tokenize_mixed``: ``/tokenize`` of 3,000,000 token ids and strings, and ``tokenize_31m``: of
  31,000,000 ids (62 MB) (item 5), each beside a request on the other slot, with the server's peak
  resident memory after.

Every item also reports ``health_max_ms``: the longest a ``/health`` request, sent every 20 ms
on a connection of its own (from a process of its own) while the item ran, waited for its answer
(the event loop's stalls).

``--only a,b`` runs the items named; ``--llama-server BIN`` runs them against llama-server (built
from the pin: ``python build.py --tools``) on the same target, for comparison.

Run it on two trees to compare (e.g. ``git worktree add /tmp/old REV`` and copy
``pyllama_spec/_native/`` build outputs into it).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: dict | bytes, timeout: float = 600) -> tuple[int, float]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    start = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
    return status, time.monotonic() - start


def busy(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("pyllama_spec_busy "):
                return int(float(line.split()[1]))
    return 0


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Server:
    def __init__(self, tree: Path, models, *extra: str, llama_server: Path | None = None) -> None:
        self.port = free_port()
        env = dict(os.environ, PYTHONPATH=str(tree))
        common = ["--port", str(self.port), "-t", "1", "-c", "16384", "-np", "2", "-m", str(models.target)]
        command = ([str(llama_server), *common] if llama_server else
                   [sys.executable, "-m", "pyllama_spec.cli", "serve", *common, "--mmproj", str(models.mmproj),
                    "-md", str(models.draft)])
        self.proc = subprocess.Popen([*command, *extra], env=env, cwd=tree, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1).read()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the server did not start")
                time.sleep(0.2)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


#: The /health poller, in a process of its own: in this one, building and sending a 60 MB body holds
#: this interpreter's GIL, and a poll waiting on it would be counted as the server's stall.
_WATCH = r"""
import http.client, sys, threading, time
port, longest, done = int(sys.argv[1]), 0.0, threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
while not done.wait(0.02):
    start = time.monotonic()
    try:
        conn.request("GET", "/health")
        conn.getresponse().read()
    except OSError:  # the server closed the kept-alive connection: the next poll opens another
        conn.close()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    longest = max(longest, time.monotonic() - start)
print(round(longest * 1000, 1))
"""


class HealthWatch:
    """Asks ``/health`` every 20 ms, on a kept-alive connection, from a process of its own, until
    stopped: the longest wait for an answer, in milliseconds."""

    def __init__(self, port: int) -> None:
        self._proc = subprocess.Popen([sys.executable, "-c", _WATCH, str(port)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)

    def stop(self) -> float:
        out, _ = self._proc.communicate("")
        return float(out.strip())


def beside(port: int, body: dict | bytes, path: str = "/v1/completions") -> dict:
    """``body`` on one slot; 0.5 s later a 1-token request on the other: both timed."""
    out = {}

    def hostile():
        out["status"], out["seconds"] = post(port, path, body)

    t = threading.Thread(target=hostile)
    t.start()
    time.sleep(0.5)
    _, out["other_slot_seconds"] = post(port, "/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 1})
    t.join()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, default=ROOT)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--only", default=None, help="items to run, separated by commas (default: all)")
    ap.add_argument("--llama-server", type=Path, default=None,
                    help="run the items against this llama-server binary instead (the target model only)")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else None
    sys.path.insert(0, str(ROOT))
    from pyllama_spec.devtools import tiny

    models = tiny.make_tiny_set(Path(tempfile.mkdtemp()), arch="hunyuan_vl", seed=0, window=32, predictable=0.5)
    results: dict = {"tree": str(args.tree)}

    def item(name, fn):
        if only is not None and name not in only:
            return
        server = Server(args.tree, models, llama_server=args.llama_server)
        try:
            watch = HealthWatch(server.port)
            results[name] = fn(server)
            results[name]["health_max_ms"] = watch.stop()
        finally:
            server.close()
        print(name, json.dumps(results[name]), flush=True)

    item("newlines", lambda s: beside(s.port, {"prompt": "x = 1\n" * 700_000, "max_tokens": 4}))
    item("long_stop", lambda s: beside(s.port, {"prompt": "def f(", "max_tokens": 4,
                                                "stop": [c * 1_000_000 for c in "qzwv"]}))

    def client_leaves(s):
        body = json.dumps({"prompt": "def main(", "max_tokens": 8000}).encode()
        sock = socket.create_connection(("127.0.0.1", s.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(0.3)
        sock.close()
        closed = time.monotonic()
        while busy(s.port):
            time.sleep(0.05)
        return {"busy_seconds_after_close": round(time.monotonic() - closed, 2)}

    item("client_leaves", client_leaves)

    def huge_prompt(s):
        before = peak_rss_mib(s.proc.pid)
        status, seconds = post(s.port, "/v1/completions", {"prompt": "y" * (60 * 2**20), "max_tokens": 4})
        return {"status": status, "seconds": round(seconds, 2), "peak_rss_mib_before": round(before),
                "peak_rss_mib_after": round(peak_rss_mib(s.proc.pid))}

    item("huge_prompt", huge_prompt)

    def sigterm(s):
        body = json.dumps({"prompt": "def main(", "max_tokens": 8000}).encode()
        socks = []
        for _ in range(2):
            sock = socket.create_connection(("127.0.0.1", s.port))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            socks.append(sock)
        time.sleep(1.0)
        start = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        try:
            s.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pass
        for sock in socks:
            sock.close()
        return {"exit_seconds": round(time.monotonic() - start, 2), "exited": s.proc.poll() is not None}

    item("sigterm", sigterm)

    def costly(body: dict | bytes, path: str = "/completion"):
        def run(s):
            out = beside(s.port, body, path)
            return {**out, "alive": s.proc.poll() is None, "peak_rss_mib": round(peak_rss_mib(s.proc.pid))}
        return run

    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20000)}}
    item("costly_schema", costly({"prompt": "hi", "n_predict": 4, "json_schema": schema}))
    near = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(285)}}
    item("schema_near_limit", costly({"prompt": "hi", "n_predict": 4, "json_schema": near}))

    def responses_store(s):
        item_ = {"type": "message", "role": "user", "content": "hi", "unused": "u" * 300_000}
        start, statuses = time.monotonic(), set()
        for _ in range(380):
            statuses.add(post(s.port, "/v1/responses", {"input": [item_], "max_output_tokens": 1, "store": True})[0])
        return {"statuses": sorted(statuses), "seconds": round(time.monotonic() - start, 1),
                "peak_rss_mib": round(peak_rss_mib(s.proc.pid))}

    item("responses_store", responses_store)
    grammar = "root ::= r0\n" + "".join(f'r{i} ::= "x"{{0,2000}}\n' for i in range(11800))
    item("grammar_repetitions", costly({"prompt": "hi", "n_predict": 4, "grammar": grammar}))
    item("grammar_optional_run", costly({"prompt": "hi", "n_predict": 4, "grammar": 'root ::= (.?){400} "b"'}))

    def grammar_ambiguous(s):
        req = urllib.request.Request(f"http://127.0.0.1:{s.port}/tokenize", data=json.dumps({"content": "a"}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            a = json.loads(r.read())["tokens"][0]
        return costly({"prompt": "hi", "n_predict": 16, "logit_bias": [[a, 100.0]],
                       "grammar": 'root ::= r "x"\nr ::= "a" r "b" | "a" r "c" | "d"'})(s)

    item("grammar_ambiguous", grammar_ambiguous)

    def cross_site(s):
        def scales():
            with urllib.request.urlopen(f"http://127.0.0.1:{s.port}/lora-adapters", timeout=60) as r:
                return r.read()
        before = scales()
        req = urllib.request.Request(f"http://127.0.0.1:{s.port}/completion", method="POST",
                                     data=json.dumps({"prompt": "hi", "n_predict": 2}).encode(),
                                     headers={"Content-Type": "text/plain", "Origin": "http://evil.example"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                status = r.status
        except urllib.error.HTTPError as e:
            status = e.code
        return {"status": status, "scales_unchanged": scales() == before}

    item("cross_site", cross_site)
    rng = random.Random(0)
    floats = [rng.random() for _ in range(3_000_000)]
    item("numeric_body", costly({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                 "cached_embeddings": floats}, "/v1/chat/completions"))
    nested = [[round(rng.random(), 3) for _ in range(39)] for _ in range(99_000)]
    item("nested_numeric_body", costly({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                        "cached_embeddings": nested}, "/v1/chat/completions"))
    mixed = [rng.randrange(1000) if i % 3 else "ab" for i in range(3_000_000)]
    item("tokenize_mixed", costly({"content": mixed}, "/tokenize"))
    item("tokenize_31m", costly(b'{"content": [' + b"1," * 31_000_000 + b'1]}', "/tokenize"))
    for name in ("newlines", "long_stop", "costly_schema", "grammar_repetitions", "grammar_optional_run",
                 "grammar_ambiguous", "numeric_body", "nested_numeric_body",
                 "tokenize_mixed", "tokenize_31m"):
        if name in results:
            results[name] = {k: round(v, 2) if isinstance(v, float) else v for k, v in results[name].items()}
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
