#!/usr/bin/env python3
"""Draft trees against chains, and against llama-server, on the embedded trained pair, one run.

    python bench/tree_verify.py --prompts 16 --max-tokens 128 --repeats 3

Held-out prompts as tools/measure_trained_pair.py picks them (text, and the same after the
demo's 672x672 test card); prompt i samples with seed i at temperatures 0, 0.8 and 1.0
(top-k 40, top-p 0.95, min-p 0.05 on every engine). Engines, all up at once, same files:

- llama-server --spec-type draft-dflash, draft 7 and 15 (llama.cpp's exact-match chain);
- pyllama-spec target-only, and its chain (llama.cpp's rule) at draft 7 and 15;
- pyllama-spec with draft trees of 16, 32, 64 and 128 drafted tokens (depth up to 15), verified
  by walking the target's samples down the tree (tree.py): same tokens as target-only.

Every engine's mean accepted length is computed the same way from what it returns: a
generation of n tokens with a accepted drafts took n - 1 - a verify steps (the first token
comes from the prefill), so MAL = (n - 1) / (n - 1 - a). Decode tokens/s by each engine's own
timer (prefill excluded), summed over the prompts; min / median / max over the repeats
(the engines take turns prompt by prompt, so drift on this shared machine touches them alike).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tools"))

import httpx  # noqa: E402
from concurrent_chats import ServerProcess, free_port  # noqa: E402
from measure_trained_pair import held_out_prompts  # noqa: E402

import pyllama_spec as ps  # noqa: E402
from pyllama_spec import native_build  # noqa: E402
from pyllama_spec.devtools.tiny import draw_demo_image  # noqa: E402

SAMPLING = dict(top_k=40, top_p=0.95, min_p=0.05)
TREES = (16, 32, 64, 128)


class Local:
    def __init__(self, engine, **per_call) -> None:
        self.engine, self.per_call = engine, per_call

    def run(self, prompt: str, image, max_tokens: int, temperature: float, seed: int) -> dict:
        kw = dict(images=[image]) if image is not None else {}
        r = self.engine.generate(prompt, max_tokens=max_tokens, temperature=temperature, seed=seed,
                                 cache_prompt=False, **SAMPLING, **self.per_call, **kw)
        s = r.stats
        return dict(tokens=r.tokens, drafted=s.drafted, accepted=s.accepted,
                    seconds=s.decode_seconds, n=s.generated_tokens)


class Remote:
    def __init__(self, models, draft_max: int) -> None:
        port = free_port()
        args = [str(native_build.find_llama_server()), "-m", str(models.target), "--mmproj", str(models.mmproj),
                "-md", str(models.draft), "--spec-type", "draft-dflash", "--spec-draft-n-max", str(draft_max),
                "--spec-draft-n-min", "0", "-c", "4096", "-b", "256", "-ub", "256", "-t", "1", "-td", "1",
                "-fa", "off", "--host", "127.0.0.1", "--port", str(port), "-np", "1", "--no-warmup"]
        self.server = ServerProcess(f"llama-server dflash {draft_max}", args, port)
        self.marker = httpx.get(self.server.url + "/props", timeout=10).json().get("media_marker", ps.MEDIA_MARKER)

    def run(self, prompt: str, image, max_tokens: int, temperature: float, seed: int) -> dict:
        body = {"n_predict": max_tokens, "temperature": temperature, "seed": seed, "cache_prompt": False,
                "return_tokens": True, **SAMPLING}
        if image is None:
            body["prompt"] = prompt
        else:
            body["prompt"] = {"prompt_string": prompt.replace(ps.MEDIA_MARKER, self.marker),
                              "multimodal_data": [base64.b64encode(image).decode()]}
        out = httpx.post(self.server.url + "/completion", json=body, timeout=600).json()
        t = out["timings"]
        return dict(tokens=out.get("tokens", []), drafted=int(t.get("draft_n", 0)),
                    accepted=int(t.get("draft_n_accepted", 0)), seconds=t["predicted_ms"] / 1000,
                    n=int(t["predicted_n"]))

    def close(self) -> None:
        self.server.close()


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temps", default="0,0.8,1.0")
    ap.add_argument("--kinds", default="text,image")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    m = ps.embedded_models()
    prompts = held_out_prompts(args.prompts)
    image = draw_demo_image(672)
    image_png = png(image)
    kw = dict(mmproj=m.mmproj, draft=m.draft, n_ctx=4096, n_batch=256, n_ubatch=256, n_threads=1, draft_max=15)
    chain = ps.load(m.target, **kw)
    tree = ps.load(m.target, draft_tree=max(TREES), **kw)
    servers = [Remote(m, 7), Remote(m, 15)]
    engines = {"pyllama-spec target-only": Local(chain, draft_max=0),
               "llama-server chain 7": servers[0], "llama-server chain 15": servers[1],
               "pyllama-spec chain 7": Local(chain, draft_max=7), "pyllama-spec chain 15": Local(chain, draft_max=15)}
    engines.update({f"pyllama-spec tree {n}": Local(tree, draft_tree=n) for n in TREES})
    results = []
    try:
        for kind in args.kinds.split(","):
            for temp in [float(t) for t in args.temps.split(",")]:
                runs = {name: [] for name in engines}  # per repeat: totals over the prompts
                same = {name: True for name in engines}
                for rep in range(args.repeats):
                    totals = {name: dict(drafted=0, accepted=0, seconds=0.0, n=0, steps=0) for name in engines}
                    for i, p in enumerate(prompts):
                        text = (ps.MEDIA_MARKER + "\n" + p) if kind == "image" else p
                        ref = None
                        names = list(engines) if (i + rep) % 2 == 0 else [list(engines)[0], *reversed(list(engines)[1:])]
                        for name in names:
                            e = engines[name]
                            img = (image_png if isinstance(e, Remote) else image) if kind == "image" else None
                            out = e.run(text, img, args.max_tokens, temp, i)
                            if ref is None:
                                ref = out["tokens"]
                            same[name] &= out["tokens"] == ref
                            t = totals[name]
                            for k in ("drafted", "accepted", "seconds", "n"):
                                t[k] += out[k]
                            t["steps"] += max(1, out["n"] - 1 - out["accepted"])
                    for name in engines:
                        runs[name].append(totals[name])
                for name in engines:
                    rs = runs[name]
                    tps = sorted(r["n"] / r["seconds"] for r in rs)
                    r0 = rs[0]
                    results.append(dict(kind=kind, temp=temp, engine=name,
                                        acceptance=r0["accepted"] / max(1, r0["drafted"]),
                                        mal=(r0["n"] - len(prompts)) / r0["steps"],
                                        steps_per_100=100 * r0["steps"] / r0["n"], tps=tps,
                                        same_tokens=same[name]))
                    x = results[-1]
                    print(f"| {kind} | {temp} | {name} | {x['acceptance']:.3f} | {x['mal']:.2f} | "
                          f"{x['steps_per_100']:.1f} | {tps[0]:.0f} / {statistics.median(tps):.0f} / {tps[-1]:.0f} | "
                          f"{x['same_tokens']} |", flush=True)
    finally:
        for s in servers:
            s.close()
        tree.close()
        chain.close()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
