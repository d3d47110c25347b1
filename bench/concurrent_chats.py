#!/usr/bin/env python3
"""N concurrent greedy chats (half with an image) against `pyllama-spec serve -np N` and
`llama-server -np N`: the same files, flags, draft and requests, side by side in one run.

    python bench/concurrent_chats.py --models trained --concurrency 1,2,4,8 --repeats 5 --max-tokens 96
    python bench/concurrent_chats.py --models large --concurrency 1,2,4,8 --repeats 3 --max-tokens 48
    python bench/concurrent_chats.py --models qwen35-mtp --concurrency 1,2,4,8 --repeats 24 --max-tokens 128
    python bench/concurrent_chats.py --models large-mtp --concurrency 1,4 --repeats 4 --max-tokens 48
    python bench/concurrent_chats.py --models widened --concurrency 4 --repeats 6 --max-tokens 96 --draft-max 5

``trained`` and ``large`` draft with DFlash (``-md``); ``qwen35-mtp`` is the trained qwen35 target
drafting with its own MTP head (``--spec-type draft-mtp``, no draft file); ``large-mtp`` a random
qwen35 target of the large set's shapes (n_embd 1024, 12 layers, f16, ``predictable=0.5``) with
its MTP head: where each step's native work, not the server around it, is the cost. ``widened`` is
the trained pair widened to those shapes (``widen.widen_trained_pair``: the trained function, so the
trained prompts' acceptance, at a dense 142M f16 model's cost per decode) with its DFlash draft.

For each N both servers run at once (idle while the other is measured); each round sends one
batch of N streamed chat requests to one server, then the same batch to the other (which goes
first alternates). Per server and N:

- aggregate tokens/s: completion tokens of the batch / its wall time (first request sent to
  last answer received, prefills included): what the hardware serves;
- per-request tokens/s: a request's completion tokens / (its end - its first token);
- p95 time per token: each arrival's gap since the previous one, spread over the tokens it
  brings (llama-server streams a step's tokens one chunk each, back to back: chunks within a
  millisecond are one arrival; pyllama-spec streams a step per chunk, its
  ``pyllama_spec.tokens`` say how many), 95th percentile over every token after the first;
- acceptance: drafted tokens accepted, summed over the batch (timings.draft_n*).

Losslessness: before the batches, every request is answered alone on the N=1 server of the
same kind (one at a time); every batched answer is compared with it, its text and its drafted /
accepted counts (a slot accepts what the same request accepts alone).
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

import httpx  # noqa: E402

from pyllama_spec import native_build  # noqa: E402
from pyllama_spec.devtools import tiny  # noqa: E402
from pyllama_spec.devtools.benchmark import demo_png, free_port, peak_rss_mib  # noqa: E402

CODE_PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n", "def parse_args():", "for i in range(",
                "def merge_sort(xs):", "with open(", "def main():"]


@dataclasses.dataclass
class Answer:
    text: str
    tokens: int
    start: float
    first: float  # first content chunk
    end: float
    gaps: list[float]  # seconds per token, for every token after the first chunk
    drafted: int
    accepted: int


class ServerProcess:
    """A server on 127.0.0.1 in its own process, its log in a file."""

    def __init__(self, name: str, args: list[str], port: int, env: dict | None = None) -> None:
        self.name = name
        self.port = port
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"{name.split()[0]}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env)
        deadline = time.monotonic() + 180
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited: {Path(self.log.name).read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not come up")
            time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> float:
        rss = peak_rss_mib(self.proc.pid)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)
        return rss


def start_servers(kind: str, n: int, files, flags: dict, llama_server: Path) -> dict[str, ServerProcess]:
    spec = (["--spec-type", "draft-mtp"] if kind.endswith("-mtp")
            else ["-md", str(files.draft), "--spec-type", "draft-dflash"])
    common = ["-c", str(flags["ctx_per_slot"] * n), "-b", str(flags["n_batch"]), "-ub", str(flags["n_batch"]),
              "-t", str(flags["threads"]), "-np", str(n), "--host", "127.0.0.1", "-fa", "off",
              "-m", str(files.target), "--mmproj", str(files.mmproj), *spec,
              "--spec-draft-n-max", str(flags["draft_max"])]
    servers = {}
    port = free_port()
    servers["llama-server"] = ServerProcess(
        f"llama-server -np {n}", [str(llama_server), *common, "--port", str(port), "--spec-draft-n-min", "0",
                                  "-td", str(flags["threads"]), "--no-warmup", "--jinja"], port)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    servers["pyllama-spec"] = ServerProcess(
        f"pyllama-spec -np {n}", [sys.executable, "-m", "pyllama_spec", "serve", *common, "--port", str(port),
                                  "--queue", "64"], port, env)
    if not kind.endswith("-mtp"):  # the planned draft length is DFlash's
        servers["pyllama-spec auto"] = servers["pyllama-spec"]  # the same server, requests with n_max "auto"
    warm_up(servers)
    return servers


def warm_up(servers: dict[str, ServerProcess]) -> None:
    """One text and one image request per server, not measured: a server's first request pays
    one-time costs (pyllama-spec: imports, compiling the chat template; llama-server: its graphs)."""
    uri = "data:image/png;base64," + base64.b64encode(demo_png(64)).decode()
    for engine, server in servers.items():
        for content in ("Hello", [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": "Hi"}]):
            chat(server.url, content, 4, engine)


def chat(url: str, content, max_tokens: int, engine: str) -> Answer:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "top_k": 1, "stream": True, "cache_prompt": False, "stream_options": {"include_usage": True}}
    if engine.endswith("auto"):
        body["speculative.n_max"] = "auto"  # pyllama-spec's planned draft length, per request
    text, arrivals, timings, usage = [], [], {}, {}  # arrivals: [time, tokens]
    start = time.perf_counter()
    with httpx.Client(timeout=600) as c, c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{engine}: HTTP {r.status_code}: {r.read()[:500]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            event = json.loads(line[6:])
            timings = event.get("timings", timings)
            usage = event.get("usage") or usage
            if not event.get("choices"):
                continue
            piece = event["choices"][0].get("delta", {}).get("content") or ""
            k = len(event["pyllama_spec"]["tokens"]) if "pyllama_spec" in event else (1 if piece else 0)
            if k == 0:
                continue
            text.append(piece)
            # Chunks within a millisecond are one arrival (llama-server sends a step's tokens one
            # chunk each, back to back; pyllama-spec sends them in one chunk).
            if arrivals and now - arrivals[-1][0] < 1e-3:
                arrivals[-1][1] += k
            else:
                arrivals.append([now, k])
    end = time.perf_counter()
    gaps = []  # each arrival's gap since the one before, spread over the tokens it brought
    for (t0, _), (t1, k) in zip(arrivals, arrivals[1:]):
        gaps.extend([(t1 - t0) / k] * k)
    n_tokens = usage.get("completion_tokens", sum(k for _, k in arrivals))
    first = arrivals[0][0] if arrivals else None
    return Answer("".join(text), n_tokens, start, first or end, end, gaps, int(timings.get("draft_n", 0)),
                  int(timings.get("draft_n_accepted", 0)))


def contents(kind: str, n_chats: int, round_: int, png: bytes) -> list:
    """Chat i of a round has an image when (i + round) is even: half the chats, every chat
    both ways over the rounds."""
    if kind in ("trained", "qwen35-mtp", "widened"):
        from measure_trained_pair import held_out_prompts

        texts = held_out_prompts(8, chars=200)
    else:
        texts = [f"Write a long story about the sea, part {i}." for i in range(8)]
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    out = []
    for i in range(n_chats):
        text = texts[i % len(texts)]
        if (i + round_) % 2 == 0:
            out.append([{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": text}])
        else:
            out.append(text)
    return out


def run_batch(server: ServerProcess, engine: str, batch: list, max_tokens: int) -> tuple[list[Answer], float]:
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
        answers = list(pool.map(lambda c: chat(server.url, c, max_tokens, engine), batch))
    return answers, time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", choices=["trained", "large", "qwen35-mtp", "large-mtp", "widened"], default="trained")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--draft-max", type=int, default=None,
                    help="default: 16 (trained), 7 (large), 5 (widened: DFlash's default), 3 (the MTP head's, as in "
                         "RESULTS' MTP section)")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    llama_server = native_build.find_llama_server()
    if llama_server is None:
        sys.exit("no llama-server: python build.py --tools")
    if args.models == "trained":
        from pyllama_spec.embedded import embedded_models

        files = embedded_models()
    elif args.models == "widened":
        from pyllama_spec.devtools import widen

        files = widen.widen_trained_pair(native_build.cache_root() / "tiny-models", dtype="f16")
    elif args.models == "qwen35-mtp":
        models = REPO / "pyllama_spec" / "models"
        files = SimpleNamespace(target=models / "trained-qwen35-mtp.gguf",
                                mmproj=models / "trained-qwen35-mtp-mmproj.gguf", draft=None)
    else:
        files = tiny.make_bench_set(native_build.cache_root() / "tiny-models",
                                    **(dict(arch="qwen35", mtp=True) if args.models == "large-mtp" else {}))
    flags = dict(ctx_per_slot=2048, n_batch=args.n_batch, threads=args.threads,
                 draft_max=args.draft_max or {"trained": 16, "large": 7, "widened": 5}.get(args.models, 3))
    png = demo_png(args.image_size)
    levels = [int(x) for x in args.concurrency.split(",")]
    rounds_needed = max(args.repeats, 2)
    results: dict = {"settings": {**vars(args), **flags}, "levels": {}}

    # The sequential answers: every request alone, on one-slot servers.
    servers = start_servers(args.models, 1, files, flags, llama_server)
    reference: dict[str, dict] = {engine: {} for engine in servers}
    try:
        for content in contents(args.models, max(levels), 0, png) + contents(args.models, max(levels), 1, png):
            key = json.dumps(content)
            for engine, server in servers.items():
                if key not in reference[engine]:
                    reference[engine][key] = chat(server.url, content, args.max_tokens, engine)
    finally:
        for s in set(servers.values()):
            s.close()
    print(f"sequential answers: {len(reference['pyllama-spec'])} requests; pyllama-spec and llama-server "
          f"equal on {sum(reference['pyllama-spec'][k].text == reference['llama-server'][k].text for k in reference['pyllama-spec'])}",
          flush=True)

    for n in levels:
        servers = start_servers(args.models, n, files, flags, llama_server)
        per = {e: dict(agg=[], per_request=[], gaps=[], drafted=0, accepted=0, lossless=0, same_drafts=0, total=0,
                       ttft=[])
               for e in servers}
        try:
            for rnd in range(args.repeats if n > 1 else rounds_needed):
                batch = contents(args.models, n, rnd, png)
                order = list(servers.items()) if rnd % 2 == 0 else list(reversed(list(servers.items())))
                for engine, server in order:
                    answers, wall = run_batch(server, engine, batch, args.max_tokens)
                    p = per[engine]
                    p["agg"].append(sum(a.tokens for a in answers) / wall)
                    for a, content in zip(answers, batch):
                        if a.tokens > 1:
                            p["per_request"].append((a.tokens - 1) / max(a.end - a.first, 1e-9))
                        p["gaps"].extend(a.gaps)
                        p["ttft"].append(a.first - a.start)
                        p["drafted"] += a.drafted
                        p["accepted"] += a.accepted
                        p["total"] += 1
                        alone = reference[engine][json.dumps(content)]
                        p["lossless"] += a.text == alone.text
                        # a slot drafts and accepts what the same request does alone (per-slot acceptance)
                        p["same_drafts"] += (a.drafted, a.accepted) == (alone.drafted, alone.accepted)
            rss = {id(s): s.close() for s in set(servers.values())}
            for engine, s in servers.items():
                per[engine]["rss_mib"] = rss[id(s)]
        except BaseException:
            for s in set(servers.values()):
                s.close()
            raise
        results["levels"][n] = per
        for engine, p in per.items():
            agg = sorted(p["agg"])
            print(f"N={n} {engine:13s} aggregate tok/s {agg[0]:.0f} / {statistics.median(agg):.0f} / {agg[-1]:.0f}  "
                  f"per-request {statistics.median(p['per_request']):.0f}  p95 ms/token "
                  f"{pct(p['gaps'], 0.95) * 1e3:.1f}  TTFT p50 {statistics.median(p['ttft']) * 1e3:.0f} ms  "
                  f"acceptance {p['accepted'] / max(p['drafted'], 1):.3f}  equal to sequential "
                  f"{p['lossless']}/{p['total']}  drafts as alone {p['same_drafts']}/{p['total']}", flush=True)

    print()
    print(markdown(results))
    if args.json_out:
        for per in results["levels"].values():
            for p in per.values():
                p["gaps"] = [pct(p["gaps"], q) for q in (0.5, 0.9, 0.95, 0.99)]
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    return 0


def markdown(results: dict) -> str:
    lines = ["| N | server | aggregate tok/s min / median / max | × its N=1 | per-request tok/s (median) | "
             "p95 ms/token | TTFT p50 ms | acceptance | equal to sequential | drafted/accepted as alone | "
             "peak RSS MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    levels = results["levels"]
    base = {e: statistics.median(p["agg"]) for e, p in levels[min(levels)].items()}
    for n, per in levels.items():
        for engine, p in per.items():
            agg = sorted(p["agg"])
            lines.append(
                f"| {n} | {engine} | {agg[0]:.0f} / {statistics.median(agg):.0f} / {agg[-1]:.0f} | "
                f"{statistics.median(agg) / base[engine]:.2f} | {statistics.median(p['per_request']):.0f} | "
                f"{pct(p['gaps'], 0.95) * 1e3:.1f} | {statistics.median(p['ttft']) * 1e3:.0f} | "
                f"{p['accepted'] / max(p['drafted'], 1):.3f} | {p['lossless']}/{p['total']} | "
                f"{p['same_drafts']}/{p['total']} | {p['rss_mib']:.0f} |")
        ls_ = per.get("llama-server")
        for name in ("pyllama-spec", "pyllama-spec auto"):
            if per.get(name) and ls_:
                ratios = sorted(a / b for a, b in zip(per[name]["agg"], ls_["agg"]))
                lines.append(f"| {n} | ratio {name} / llama-server (per round) | {ratios[0]:.2f} / "
                             f"{statistics.median(ratios):.2f} / {ratios[-1]:.2f} | | | | | | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
