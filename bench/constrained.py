#!/usr/bin/env python3
"""DFlash under constrained output: a GBNF grammar and a JSON schema, against free text, on the
embedded trained pair, greedy; and llama-server (built from the same pin) on the same files and
requests when it is built.

    python bench/constrained.py --prompts 16 --max-tokens 128 --repeats 3

For each condition: whether DFlash's tokens equal target-only tokens on every prompt, whether
every finished JSON answer parses and follows the schema's shape, acceptance, mean accepted
length (tokens per target step), and decode tokens/s of DFlash over target-only (min / median /
max over the repeats, each repeat running both side by side). A drafted token the grammar
forbids is rejected like any other mismatch: the draft is not told about the grammar.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from measure_trained_pair import held_out_prompts  # noqa: E402

import pyllama_spec as ps  # noqa: E402
from pyllama_spec import native_build  # noqa: E402
from pyllama_spec.devtools.rpc_server import free_port  # noqa: E402

#: Indented Python-like lines: what the pair writes anyway, with a narrower alphabet.
GRAMMAR = r'''root ::= line+
line ::= "    " [a-zA-Z_.()=, 0-9:'"\[\]]+ "\n"
'''
#: A small function description; bounded strings and arrays, so answers end well inside the budget.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "args": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "returns": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "args", "returns"],
    "additionalProperties": False,
}
CONDITIONS = {"free": {}, "grammar": {"grammar": GRAMMAR}, "json_schema": {"json_schema": SCHEMA}}


def _follows_schema(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == {"name", "args", "returns"}
            and isinstance(value["name"], str) and isinstance(value["returns"], str)
            and isinstance(value["args"], list) and all(isinstance(a, str) for a in value["args"]))


def run_ours(engine, prompts, constraint, draft_max, max_tokens):
    out = {"tokens": [], "texts": [], "finish": [], "drafted": 0, "accepted": 0, "steps": 0, "generated": 0,
           "seconds": 0.0}
    for p in prompts:
        r = engine.generate(p, max_tokens=max_tokens, temperature=0.0, draft_max=draft_max, cache_prompt=False,
                            **constraint)
        s = r.stats
        out["tokens"].append(list(r.tokens))
        out["texts"].append(r.text)
        out["finish"].append(r.finish_reason)
        for k, v in (("drafted", s.drafted), ("accepted", s.accepted), ("steps", s.target_steps),
                     ("generated", s.generated_tokens), ("seconds", s.decode_seconds)):
            out[k] += v
    return out


class LlamaServer:
    def __init__(self, binary, m, draft_max, threads):
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [str(binary), "-m", str(m.target), "-md", str(m.draft), "--spec-type", "draft-dflash",
             "--spec-draft-n-max", str(draft_max), "--spec-draft-n-min", "0", "-c", "4096", "-b", "64", "-ub", "64",
             "-t", str(threads), "-td", str(threads), "-fa", "off", "-np", "1", "--no-warmup",
             "--host", "127.0.0.1", "--port", str(self.port)], stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(Path(self.log.name).read_text()[-2000:]) from None
                time.sleep(0.2)

    def complete(self, prompt, constraint, max_tokens):
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "cache_prompt": False,
                "return_tokens": True, **constraint}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-max", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    m = ps.embedded_models()
    prompts = held_out_prompts(args.prompts)
    rows = {}
    with ps.load(m.target, draft=m.draft, n_ctx=4096, n_batch=64, n_ubatch=64, n_threads=args.threads,
                 draft_max=args.draft_max) as engine:
        engine.generate(prompts[0], max_tokens=8)  # warm-up
        for name, constraint in CONDITIONS.items():
            ratios = []
            for _ in range(args.repeats):
                plain = run_ours(engine, prompts, constraint, 0, args.max_tokens)
                spec = run_ours(engine, prompts, constraint, args.draft_max, args.max_tokens)
                ratios.append((spec["generated"] / spec["seconds"]) / (plain["generated"] / plain["seconds"]))
            finished = [t for t, f in zip(spec["texts"], spec["finish"]) if f == "stop"]
            rows[name] = dict(
                equal=spec["tokens"] == plain["tokens"],
                acceptance=spec["accepted"] / max(spec["drafted"], 1),
                mean_accepted_length=spec["generated"] / max(spec["steps"], 1),
                speedup=(min(ratios), statistics.median(ratios), max(ratios)),
                tokens_per_s=spec["generated"] / spec["seconds"],
                finished=len(finished),
                parsed=sum(_follows_schema(t) for t in finished) if name == "json_schema" else None,
                tokens=spec["tokens"],
            )
            print(name, {k: v for k, v in rows[name].items() if k != "tokens"}, flush=True)

        stop_ids = {t for t in range(engine.model.n_vocab) if engine.model.is_eog(t)}
    binary = native_build.find_llama_server()
    theirs = {}
    if binary is not None:
        server = LlamaServer(binary, m, args.draft_max, args.threads)
        try:
            for name, constraint in CONDITIONS.items():
                drafted = accepted = 0
                tokens = []
                for p in prompts:
                    out = server.complete(p, constraint, args.max_tokens)
                    # llama-server's tokens end with the end-of-generation token when it stopped on
                    # one; a Result's tokens hold what was generated before it
                    eog = out["stop_type"] == "eos" and out["tokens"] and out["tokens"][-1] in stop_ids
                    tokens.append(out["tokens"][:-1] if eog else out["tokens"])
                    drafted += out["timings"].get("draft_n", 0)
                    accepted += out["timings"].get("draft_n_accepted", 0)
                theirs[name] = dict(acceptance=accepted / max(drafted, 1), same_tokens=tokens == rows[name]["tokens"])
                print("llama-server", name, theirs[name], flush=True)
        finally:
            server.close()

    print(f"\n{args.prompts} held-out prompts x {args.max_tokens} tokens, greedy, draft_max {args.draft_max}, "
          f"{args.repeats} repeats\n")
    print("| output | DFlash tokens = target-only | acceptance | mean accepted length | DFlash / target-only "
          "decode (min / median / max) | finished answers that parse | llama-server acceptance | "
          "llama-server same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        lo, med, hi = r["speedup"]
        parse = f"{r['parsed']}/{r['finished']}" if r["parsed"] is not None else "n/a"
        t = theirs.get(name)
        their_acceptance = f"{t['acceptance']:.3f}" if t else "not built"
        print(f"| {name} | {'yes' if r['equal'] else 'NO'} | {r['acceptance']:.3f} | {r['mean_accepted_length']:.2f} | "
              f"{lo:.2f} / {med:.2f} / {hi:.2f} | {parse} | {their_acceptance} | "
              f"{('yes' if t['same_tokens'] else 'NO') if t else '-'} |")
    return 0 if all(r["equal"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
