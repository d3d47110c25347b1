#!/usr/bin/env python3
"""EAGLE3 at a size where Python is not the cost: the trained tiny target and its trained EAGLE3 draft
widened to the 142M f16 bench shapes (``pyllama_spec.devtools.widen``: same function, zero padding, so
the widened draft proposes what the trained one proposes), greedy, one thread, pyllama-spec and
llama-server side by side in one run.

    python bench/eagle3_bench_size.py --repeats 3 --max-tokens 128 --draft-max 3,7,15

Files: ``widen_trained_pair``'s target and mmproj (n_embd 1024, 12 layers, n_ff 2816: 142,135,808
parameters) and ``widen_trained_eagle3``'s draft (n_embd 1024, n_ff 2816: 17,043,456 parameters; it
reads target layers 1, 2, 3 and borrows the target's token embedding and output head).

Engines (all loaded before the first round, one thread each, n_ctx 2048, n_batch = n_ubatch 512,
flash attention off, the same files): pyllama-spec target-only and EAGLE3 at each draft max (in this
process); llama-server -np 1 with no draft and with ``-md EAGLE3 --spec-type draft-eagle3
--spec-draft-n-max N --spec-draft-n-min 0`` (one server per N). Every round sends each prompt to
every engine; the engine order reverses every other round. Prompts: three held-out-style Python
prefixes and (unless --no-image) the demo test card (672x672: 576 image rows over 24 positions)
before the second one (a picture, then text: llama-server's EAGLE3 fails on text *before* a picture,
bench/RESULTS.md).

How the numbers are computed (as bench/dflash_bench_size.py computes them):

- decode tok/s: per round and prompt kind (text = the three text prompts pooled), generated
  tokens / decode seconds by each engine's own timer (pyllama-spec: ``stats.decode_seconds``,
  prefill excluded; llama-server: ``timings.predicted_n`` / ``predicted_ms``); min / median / max
  over the rounds. "x target-only" is the ratio of the medians, each engine against its own
  target-only.
- mean accepted length (MAL): tokens per target step = 1 + accepted / steps (pyllama-spec's
  target steps; llama-server: steps = tokens - accepted - generations).
- step times (pyllama-spec, pooled per round, median over rounds): one-token decode t1 =
  target-only ``decode_target_seconds / target_steps``; verify tv = EAGLE3's
  ``decode_target_seconds / target_steps``; draft td = ``decode_draft_seconds / target_steps``
  (the encoder over the target's features, the rows' write and the draft chain: one decode of the
  draft per drafted token); Python = the rest of ``decode_seconds`` per step.
- ideal x = MAL x t1 / (tv + td); efficiency = measured x / ideal x (llama-server: its own MAL
  with pyllama-spec's step times).
- same tokens: every engine's tokens, every round, equal pyllama-spec target-only's; fidelity: the
  widened target's tokens against the trained 64-wide target's, and the widened EAGLE3's drafted /
  accepted counts (pyllama-spec, round 0) against the trained 64-wide EAGLE3 pair's on the same
  prompts (f32 files: equal counts mean equal drafts; f16 rounding can part them at a near tie).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import httpx  # noqa: E402
from concurrent_chats import ServerProcess, free_port  # noqa: E402

import pyllama_spec as ps  # noqa: E402
from pyllama_spec import native_build  # noqa: E402
from pyllama_spec.devtools import widen  # noqa: E402
from pyllama_spec.devtools.benchmark import demo_png  # noqa: E402
from pyllama_spec.embedded import MODELS_DIR, PROMPT  # noqa: E402

# held-out-style code prefixes (as bench/dflash_bench_size.py's)
READ_CONFIG = ('def read_config(path):\n    """Read a configuration file and return a dict."""\n'
               '    result = {}\n    with open(path) as f:\n        for line in f:\n            line = line.strip()\n'
               '            if not line or line.startswith("#"):\n                continue\n')
OPT_STRINGS = ("        # one short option and one long option, either of which\n"
               "        # could be None.\n        opts = [opt for opt in opts if opt]\n        if not opts:\n"
               "            raise TypeError(\"at least one option string must be supplied\")\n        return opts\n\n"
               "    def _set_opt_strings(self, opts):\n        for ")
TEXT_PROMPTS = {"class Counter": PROMPT, "read_config": READ_CONFIG, "optparse": OPT_STRINGS}
IMAGE_PROMPT = ps.MEDIA_MARKER + "\n" + READ_CONFIG
CTX = dict(n_ctx=2048, n_batch=512, n_ubatch=512)


def _name(kind: str, draft_max: int) -> str:
    return f"{kind} " + (f"eagle3 {draft_max}" if draft_max else "target-only")


class Local:
    """pyllama-spec in this process."""

    kind = "pyllama-spec"

    def __init__(self, files, draft_max: int) -> None:
        self.engine = ps.load(files.target, mmproj=files.mmproj, draft=files.draft if draft_max else None,
                              spec_type="draft-eagle3" if draft_max else "none", draft_max=draft_max or 7,
                              n_threads=1, flash_attn=False, **CTX)

    def run(self, prompt: str, image: bytes | None, max_tokens: int) -> dict:
        r = self.engine.generate(prompt, images=[image] if image else [], max_tokens=max_tokens, temperature=0.0,
                                 cache_prompt=False)
        s = r.stats
        return dict(tokens=r.tokens, n=s.generated_tokens, decode_s=s.decode_seconds, prefill_s=s.prefill_seconds,
                    drafted=s.drafted, accepted=s.accepted, steps=s.target_steps,
                    target_s=s.decode_target_seconds, draft_s=s.decode_draft_seconds)

    def close(self) -> None:
        self.engine.close()


class Remote:
    """llama-server -np 1 on the same files."""

    kind = "llama-server"

    def __init__(self, files, draft_max: int) -> None:
        port = free_port()
        args = [str(native_build.find_llama_server()), "-m", str(files.target), "--mmproj", str(files.mmproj),
                "-c", str(CTX["n_ctx"]), "-b", str(CTX["n_batch"]), "-ub", str(CTX["n_ubatch"]), "-t", "1",
                "-fa", "off", "--host", "127.0.0.1", "--port", str(port), "-np", "1", "--no-warmup", "-ngl", "0"]
        if draft_max:
            args += ["-md", str(files.draft), "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(draft_max),
                     "--spec-draft-n-min", "0", "-td", "1", "-ngld", "0"]
        self.server = ServerProcess(_name("llama-server", draft_max), args, port)
        self.marker = httpx.get(self.server.url + "/props", timeout=10).json().get("media_marker", ps.MEDIA_MARKER)

    def run(self, prompt: str, image: bytes | None, max_tokens: int) -> dict:
        import base64

        body = {"n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "samplers": ["top_k"],
                "cache_prompt": False, "return_tokens": True}
        body["prompt"] = prompt if image is None else {
            "prompt_string": prompt.replace(ps.MEDIA_MARKER, self.marker),
            "multimodal_data": [base64.b64encode(image).decode()]}
        resp = httpx.post(self.server.url + "/completion", json=body, timeout=600)
        if resp.status_code != 200:
            raise RuntimeError(f"{self.server.name}: HTTP {resp.status_code}: {resp.text[:300]}")
        out = resp.json()
        t = out["timings"]
        return dict(tokens=out.get("tokens", []), n=int(t["predicted_n"]), decode_s=t["predicted_ms"] / 1e3,
                    prefill_s=t["prompt_ms"] / 1e3, drafted=int(t.get("draft_n", 0)),
                    accepted=int(t.get("draft_n_accepted", 0)), steps=None, target_s=None, draft_s=None)

    def close(self) -> None:
        self.server.close()


def _pool(samples: list[dict]) -> dict:
    """Sums over the samples of one engine, round and prompt kind."""
    keys = ("n", "decode_s", "prefill_s", "drafted", "accepted", "steps", "target_s", "draft_s")
    out = {k: (None if samples[0][k] is None else sum(x[k] for x in samples)) for k in keys}
    out["count"] = len(samples)
    return out


def _mal(p: dict) -> float:
    """Tokens per target step of the generation phase: 1 + accepted / steps."""
    if p["steps"]:
        return 1 + p["accepted"] / p["steps"]
    # llama-server: each generation's first token comes from the prefill, then greedy steps of
    # accepted + 1 tokens, so steps = tokens - accepted - generations
    steps = p["n"] - p["accepted"] - p["count"]
    return 1 + p["accepted"] / steps if steps > 0 else 1.0


def _trained(prompts: dict, image: bytes | None, max_tokens: int, draft_maxes: list[int]) -> dict:
    """The trained (64-wide, f32) pair on the same prompts: target-only tokens, and EAGLE3's tokens
    and drafted / accepted counts at each draft max."""
    m = ps.embedded_models()
    files = SimpleNamespace(target=m.target, mmproj=m.mmproj, draft=MODELS_DIR / widen.EAGLE3)
    out = {}
    for dm in [0, *draft_maxes]:
        engine = Local(files, dm)
        try:
            out[dm] = {name: engine.run(p, image if img else None, max_tokens) for name, (p, img) in prompts.items()}
        finally:
            engine.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-max", default="3,7,15", help="comma-separated EAGLE3 draft lengths")
    ap.add_argument("--no-image", action="store_true", help="text prompts only")
    ap.add_argument("--dtype", default="f16", choices=["f16", "f32"])
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "eagle3_bench_size.json", help="JSON results")
    args = ap.parse_args()
    if native_build.find_llama_server() is None:
        print("llama-server is not built: python build.py --tools", file=sys.stderr)
        return 2
    started = time.monotonic()
    folder = native_build.cache_root() / "tiny-models"
    pair = widen.widen_trained_pair(folder, dtype=args.dtype)
    files = SimpleNamespace(target=pair.target, mmproj=pair.mmproj, draft=widen.widen_trained_eagle3(folder,
                                                                                                      dtype=args.dtype))
    image = None if args.no_image else demo_png(672)
    prompts = {name: (p, False) for name, p in TEXT_PROMPTS.items()}
    if image is not None:
        prompts["image + read_config"] = (IMAGE_PROMPT, True)
    kind_of = {name: "image" if img else "text" for name, (_, img) in prompts.items()}
    draft_maxes = [int(x) for x in args.draft_max.split(",") if x.strip()]
    engines: dict[str, object] = {}
    samples: dict[str, list[dict]] = {}
    try:
        for cls in (Local, Remote):
            for dm in [0, *draft_maxes]:
                engines[_name(cls.kind, dm)] = cls(files, dm)
                samples[_name(cls.kind, dm)] = []
        with ps.Model(files.target) as mt, ps.Model(files.draft, role="draft") as md:
            n_params = {"target": mt.n_params, "eagle3": md.n_params}
        for name, e in engines.items():
            e.run(READ_CONFIG[:40], None, 8)  # warm-up, not measured
        for rnd in range(args.repeats):
            order = list(engines.items()) if rnd % 2 == 0 else list(reversed(list(engines.items())))
            for pname, (p, img) in prompts.items():
                for name, e in order:
                    s = e.run(p, image if img else None, args.max_tokens)
                    samples[name].append(dict(s, round=rnd, prompt=pname, kind=kind_of[pname]))
            print(f"round {rnd + 1}/{args.repeats} done ({time.monotonic() - started:.0f} s)", file=sys.stderr)
    finally:
        for e in engines.values():
            e.close()
    trained = _trained(prompts, image, args.max_tokens, draft_maxes)

    reference = {x["prompt"]: x["tokens"] for x in samples["pyllama-spec target-only"] if x["round"] == 0}
    kinds = list(dict.fromkeys(kind_of.values()))
    pooled = {name: {k: [_pool([x for x in xs if x["kind"] == k and x["round"] == r]) for r in range(args.repeats)]
                     for k in kinds} for name, xs in samples.items()}
    rows: dict[str, dict] = {}
    for name, by_kind in pooled.items():
        for k, rounds in by_kind.items():
            tps = sorted(p["n"] / p["decode_s"] for p in rounds)
            xs = [x for x in samples[name] if x["kind"] == k]
            allp = _pool(xs)
            row = dict(engine=name, kind=k, tps_min=tps[0], tps_median=statistics.median(tps), tps_max=tps[-1],
                       drafted=allp["drafted"], accepted=allp["accepted"],
                       acceptance=allp["accepted"] / allp["drafted"] if allp["drafted"] else 0.0,
                       mal=_mal(allp), tokens=allp["n"],
                       same_tokens=all(x["tokens"] == reference[x["prompt"]] for x in xs),
                       prefill_ms_median=statistics.median(p["prefill_s"] / p["count"] for p in rounds) * 1e3)
            if rounds[0]["steps"]:
                per_step = lambda f: statistics.median(p[f] / p["steps"] for p in rounds)  # noqa: E731
                row.update(t_target_ms=per_step("target_s") * 1e3, t_draft_ms=per_step("draft_s") * 1e3,
                           t_python_ms=statistics.median((p["decode_s"] - p["target_s"] - p["draft_s"]) / p["steps"]
                                                         for p in rounds) * 1e3)
            rows[f"{name} / {k}"] = row
    for k in kinds:
        t1 = rows[f"pyllama-spec target-only / {k}"]["t_target_ms"]
        for side in ("pyllama-spec", "llama-server"):
            base = rows[f"{side} target-only / {k}"]["tps_median"]
            for dm in [0, *draft_maxes]:
                r = rows[f"{_name(side, dm)} / {k}"]
                r["x_target_only"] = r["tps_median"] / base
                if dm:
                    ps_row = rows[f"{_name('pyllama-spec', dm)} / {k}"]
                    r["ideal_x"] = r["mal"] * t1 / (ps_row["t_target_ms"] + ps_row["t_draft_ms"])
                    r["efficiency"] = r["x_target_only"] / r["ideal_x"]
    fidelity = {}
    for pname in prompts:
        a, b = trained[0][pname]["tokens"], reference[pname]
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        fidelity[pname] = dict(equal=a == b, first_difference=None if a == b else first, n=len(b))
    drafts = {}  # per draft max: (drafted, accepted) of the widened and the trained EAGLE3, round 0
    for dm in draft_maxes:
        ours = [x for x in samples[_name("pyllama-spec", dm)] if x["round"] == 0]
        theirs = [trained[dm][x["prompt"]] for x in ours]
        drafts[dm] = dict(widened=[sum(x["drafted"] for x in ours), sum(x["accepted"] for x in ours)],
                          trained=[sum(x["drafted"] for x in theirs), sum(x["accepted"] for x in theirs)],
                          equal_per_prompt=all((x["drafted"], x["accepted"]) == (y["drafted"], y["accepted"])
                                               for x, y in zip(ours, theirs)))

    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    print(f"\nwidened trained target + EAGLE3 ({args.dtype}): target {n_params['target']:,} and EAGLE3 "
          f"{n_params['eagle3']:,} parameters ({files.target.name}, {files.draft.name}); {args.repeats} rounds x "
          f"{len(prompts)} prompts x {args.max_tokens} tokens, greedy, 1 thread\n")
    print("| engine | prompts | decode tok/s min / median / max | x its target-only | acceptance | MAL | "
          "ideal x | efficiency | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows.values():
        print(f"| {r['engine']} | {r['kind']} | {r['tps_min']:.1f} / {r['tps_median']:.1f} / {r['tps_max']:.1f} | "
              f"{r['x_target_only']:.2f} | {r['acceptance']:.3f} | {r['mal']:.2f} | {f(r.get('ideal_x'), '.2f')} | "
              f"{f(r.get('efficiency'), '.2f')} | {r['same_tokens']} |")
    print("\npyllama-spec step times (median over rounds, ms per target step):\n")
    print("| engine | prompts | target (t1 or verify) | draft | Python | prefill ms per prompt |")
    print("|---|---|---|---|---|---|")
    for r in rows.values():
        if "t_target_ms" in r:
            print(f"| {r['engine']} | {r['kind']} | {r['t_target_ms']:.2f} | {r['t_draft_ms']:.2f} | "
                  f"{r['t_python_ms']:.2f} | {r['prefill_ms_median']:.0f} |")
    print("\nfidelity (widened target-only tokens vs the trained 64-wide target's): "
          + "; ".join(f"{k}: {'equal' if v['equal'] else 'first difference at ' + str(v['first_difference'])} "
                      f"({v['n']} tokens)" for k, v in fidelity.items()))
    print("drafted / accepted, widened vs trained 64-wide EAGLE3 (round 0, all prompts): "
          + "; ".join(f"draft max {dm}: {v['widened'][0]} / {v['widened'][1]} vs {v['trained'][0]} / "
                      f"{v['trained'][1]}{'' if v['equal_per_prompt'] else ' (differs)'}" for dm, v in drafts.items()))
    elapsed = time.monotonic() - started
    print(f"\nwall time {elapsed:.0f} s")
    result = dict(settings=dict(vars(args), out=str(args.out), files={k: str(v) for k, v in vars(files).items()},
                                n_params=n_params, ctx=CTX, threads=1),
                  rows=rows, fidelity=fidelity, drafts=drafts, elapsed_s=elapsed,
                  samples={name: [{k: v for k, v in x.items() if k != "tokens"} for x in xs]
                           for name, xs in samples.items()})
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
