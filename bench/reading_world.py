#!/usr/bin/env python3
"""Drafting that sees the picture, against drafting blind, in the reading world
(``pyllama_spec.devtools.reading``: the target reads a picture of text out, then goes on with code).

    python bench/reading_world.py --strings 24 --max-tokens 96 --temps 0,0.8 --repeats 3

For each held-out string (``train_reading.held_out_strings``: none a training corpus line), the prompt is
``reading.PROMPT`` with ``reading.render(string)``. Each step of a generation counts towards the
read-out (the string and its newline) when it starts inside it, else towards what follows, so
acceptance is given for both. Methods here: target only; the target's MTP head with the picture's rows
in its cache (``draft-mtp``, this project's default) and without them (``writes_media = False``: as
llama.cpp leaves them); n-gram lookup; the world's small draft model without its projector (blind) and
with it (``mmproj_draft``: it reads the picture itself); its EAGLE3 draft with the target's features of the
picture's rows in its cache and without them (``writes_media = False``); its DFlash draft at the target's
positions (the default: a qwen35 picture's rows share one position, so they are left out: blind) and at
sequential positions (the rows injected: seeing). llama-server, built from the same pin, runs target only, its
``draft-mtp`` (blind: its head never sees an image row), ``ngram-simple``, the draft model (blind:
llama-server gives a draft model no picture), ``draft-eagle3`` and ``draft-dflash`` (blind: its drafts skip
every image batch) on the same files and prompts through ``/completion``, one thread and flash attention off on both; its timings give totals only, so its
acceptance on the read-out comes from a second pass that stops there. Above temperature 0,
string i samples with seed i, verified by llama.cpp's rule (``verify="match"``), so every output
equals the target alone's (``equals target only``). Counts must repeat exactly over ``--repeats``;
speeds are min / median / max. The target's read-out accuracy (characters of its greedy read-out
equal to the string's, position by position, over the string's length) is printed first.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "bench"))

import pyllama_spec as ps  # noqa: E402
from pyllama_spec import native_build  # noqa: E402
from pyllama_spec.devtools import reading  # noqa: E402

SPEEDS = ("tokens_per_s", "wall_tokens_per_s")
COUNTS = ("drafted", "accepted", "generated", "read_drafted", "read_accepted", "after_drafted", "after_accepted",
          "read_steps", "after_steps")


def methods(draft_max: int, files: dict) -> dict[str, dict]:
    """name -> keywords here, what to do after loading, and llama-server's flags (None: not there)."""
    n = ["--spec-draft-n-max", str(draft_max), "--spec-draft-n-min", "0"]
    return {
        "target only": dict(kw={"spec_type": "none"}, server=[]),
        "MTP with the picture's rows": dict(kw={"spec_type": "draft-mtp"}, server=None),
        "MTP without the picture's rows": dict(kw={"spec_type": "draft-mtp"}, server=["--spec-type", "draft-mtp", *n],
                                           after_load=lambda eng: setattr(eng.drafter, "writes_media", False)),
        "n-gram": dict(kw={"spec_type": "ngram-simple"}, server=["--spec-type", "ngram-simple", *n]),
        "draft model, blind (text only)": dict(kw={"spec_type": "draft-simple", "draft": files["draft_vlm"]},
                                               server=["-md", files["draft_vlm"], "--spec-type", "draft-simple", *n]),
        "draft model, seeing (its own projector)": dict(
            kw={"spec_type": "draft-simple", "draft": files["draft_vlm"], "mmproj_draft": files["draft_vlm_mmproj"]},
            server=None),
        "EAGLE3 with the picture's rows": dict(kw={"spec_type": "draft-eagle3", "draft": files["eagle3"]}, server=None),
        "EAGLE3 without the picture's rows": dict(
            kw={"spec_type": "draft-eagle3", "draft": files["eagle3"]},
            server=["-md", files["eagle3"], "--spec-type", "draft-eagle3", *n],
            after_load=lambda eng: setattr(eng.drafter, "writes_media", False)),
        "DFlash, target positions (pinned rows left out)": dict(
            kw={"spec_type": "draft-dflash", "draft": files["dflash"]},
            server=["-md", files["dflash"], "--spec-type", "draft-dflash", *n]),
        "DFlash, sequential positions (the picture's rows in)": dict(
            kw={"spec_type": "draft-dflash", "draft": files["dflash"], "draft_positions": "sequential"}, server=None),
    }


def generate_one(eng, text: str, picture, max_tokens: int, temp: float, seed: int):
    """Tokens and per-region counts of one generation, from the stream's pieces."""
    read_len = len(text) + 1  # one byte, one token; the newline ends the read-out
    out: list[int] = []
    c = dict.fromkeys(COUNTS, 0)
    t0 = time.perf_counter()
    stats = None
    for piece in eng.stream(reading.PROMPT, images=[picture], max_tokens=max_tokens, temperature=temp, seed=seed,
                            verify="match", cache_prompt=False):
        # a step counts where it starts; counted from the pieces (the stats would also count drafts
        # accepted past max_tokens, which no piece carries)
        region = "read" if len(out) < read_len else "after"
        c[f"{region}_drafted"] += piece.drafted
        c[f"{region}_accepted"] += piece.from_draft
        if out:  # the first token comes with the prompt, not a step
            c[f"{region}_steps"] += 1
        out.extend(piece.tokens)
        stats = piece.stats or stats
    wall = time.perf_counter() - t0
    c.update(drafted=c["read_drafted"] + c["after_drafted"], accepted=c["read_accepted"] + c["after_accepted"],
             generated=len(out))
    return out, c, stats.decode_seconds, wall


def run_set(eng, strings, pictures, args, temp):
    totals = dict.fromkeys(COUNTS, 0)
    decode = wall = 0.0
    tokens = []
    for i, (s, pic) in enumerate(zip(strings, pictures)):
        toks, c, d, w = generate_one(eng, s, pic, args.max_tokens, temp, i)
        for k in COUNTS:
            totals[k] += c[k]
        decode += d
        wall += w
        tokens.append(toks)
    return summarize(totals, decode, wall), tokens


def summarize(t: dict, decode: float, wall: float) -> dict:
    """Rates from counts (None where nothing was drafted: no rate to give)."""
    return dict(
        read_acceptance=t["read_accepted"] / t["read_drafted"] if t["read_drafted"] else None,
        read_accepted_length=1 + t["read_accepted"] / t["read_steps"] if t["read_steps"] else None,
        after_acceptance=t["after_accepted"] / t["after_drafted"] if t["after_drafted"] else None,
        after_accepted_length=1 + t["after_accepted"] / t["after_steps"] if t["after_steps"] else None,
        tokens_per_s=t["generated"] / decode if decode else 0.0, wall_tokens_per_s=t["generated"] / wall,
        **{k: t[k] for k in COUNTS})


def repeated(runs: list[dict]) -> dict:
    first = {k: v for k, v in runs[0].items() if k not in SPEEDS}
    for r in runs[1:]:
        if any(r[k] != first[k] for k in COUNTS):
            raise RuntimeError(f"a repeat drafted differently: {r} vs {runs[0]}")
    for speed in SPEEDS:
        xs = sorted(r[speed] for r in runs)
        first.update({speed: float(np.median(xs)), f"{speed}_min": xs[0], f"{speed}_max": xs[-1]})
    return first


def target_only_tokens(target, mmproj, strings, pictures, args) -> dict:
    """temperature -> the target alone's tokens for every string (what every method must give)."""
    with ps.load(target, mmproj=mmproj, n_threads=args.threads, flash_attn=False, spec_type="none") as eng:
        return {temp: run_set(eng, strings, pictures, args, temp)[1] for temp in args.temps}


def ours(name, m, target, mmproj, strings, pictures, args, refs):
    rows = []
    with ps.load(target, mmproj=mmproj, n_threads=args.threads, draft_max=args.draft_max, flash_attn=False,
                 **m["kw"]) as eng:
        if "after_load" in m:
            m["after_load"](eng)
        for temp in args.temps:
            runs, same = [], True
            for _ in range(args.repeats):
                res, toks = run_set(eng, strings, pictures, args, temp)
                same &= refs[temp] == toks
                runs.append(res)
            rows.append(dict(method=name, engine="pyllama-spec", temp=temp, lossless=same, **repeated(runs)))
    return rows


def theirs(name, m, target, mmproj, strings, pictures, args):
    """llama-server's same method. Its timings give totals only, so the read-out's acceptance comes from
    a second pass that stops at the read-out (``n_predict`` = its length; a step's drafts there are the
    same as in the full answer, but for the last step, whose drafts may run past the read-out)."""
    from drafters_after_images import llama_server, png_b64

    rows = []
    with llama_server(target, mmproj, m["server"], args.threads) as (url, marker):
        for temp in args.temps:
            runs = [_serve_set(url, marker, strings, pictures, temp, args, png_b64) for _ in range(args.repeats)]
            row = dict(method=name, engine="llama-server", temp=temp, lossless=None, **repeated(runs))
            read = _serve_set(url, marker, strings, pictures, temp, args, png_b64, read_out_only=True)
            row.update(read_drafted=read["drafted"], read_accepted=read["accepted"],
                       read_acceptance=read["accepted"] / read["drafted"] if read["drafted"] else None)
            rows.append(row)
    return rows


def _serve_set(url, marker, strings, pictures, temp, args, png_b64, read_out_only=False):
    import urllib.request

    t = dict.fromkeys(COUNTS, 0)
    decode = wall = 0.0
    for i, (s, pic) in enumerate(zip(strings, pictures)):
        body = {"prompt": {"prompt_string": reading.PROMPT.replace("<__media__>", marker),
                           "multimodal_data": [png_b64(np.asarray(pic))]},
                "n_predict": len(s) + 1 if read_out_only else args.max_tokens, "temperature": temp, "seed": i,
                "cache_prompt": False}
        req = urllib.request.Request(url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        timings = json.load(urllib.request.urlopen(req, timeout=600))["timings"]
        wall += time.perf_counter() - t0
        t["drafted"] += timings.get("draft_n", 0)
        t["accepted"] += timings.get("draft_n_accepted", 0)
        t["generated"] += timings["predicted_n"]
        decode += timings["predicted_ms"] / 1000
    res = summarize(t, decode, wall)
    for k in ("read_acceptance", "read_accepted_length", "after_acceptance", "after_accepted_length"):
        res.pop(k)
    return res


def readout_accuracy(target, mmproj, strings, pictures, threads) -> float:
    """Characters of the target's greedy read-out equal to the string's, over all strings' characters."""
    right = total = 0
    with ps.load(target, mmproj=mmproj, n_threads=threads, spec_type="none", flash_attn=False) as eng:
        for s, pic in zip(strings, pictures):
            got = eng.generate(reading.PROMPT, images=[pic], max_tokens=len(s) + 1, temperature=0.0,
                               cache_prompt=False).text
            right += sum(a == b for a, b in zip(got, s))
            total += len(s)
    return right / total


def print_table(table: list[dict]) -> None:
    """The rows as a markdown table (``--table-from`` prints a saved ``--json``'s)."""
    print("\n| method | engine | temperature | acceptance on the read-out | accepted length on the read-out | "
          "acceptance after it | accepted length after it | acceptance overall (drafted) | decode tokens/s median (min-max) | "
          "wall tokens/s median (min-max) | equals target only |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    def rate(v, digits=3):
        return "-" if v is None else f"{v:.{digits}f}"

    for r in table:
        overall = rate(r["accepted"] / r["drafted"] if r["drafted"] else None)
        same = "" if r["lossless"] is None else ("yes" if r["lossless"] else "NO")
        if "read_accepted_length" in r:
            region = (f"{rate(r['read_acceptance'])} | {rate(r['read_accepted_length'], 2)} | "
                      f"{rate(r['after_acceptance'])} | {rate(r['after_accepted_length'], 2)}")
        elif r["engine"] == "llama-server" and r["method"] != "target only":  # read-out pass only
            region = f"{rate(r['read_acceptance'])} (a pass stopped at it) | | |"
        else:
            region = "- | | - |"
        print(f"| {r['method']} | {r['engine']} | {r['temp']:g} | {region} | {overall} ({r['drafted']} drafted) | "
              f"{r['tokens_per_s']:.0f} ({r['tokens_per_s_min']:.0f}-{r['tokens_per_s_max']:.0f}) | "
              f"{r['wall_tokens_per_s']:.0f} ({r['wall_tokens_per_s_min']:.0f}-{r['wall_tokens_per_s_max']:.0f}) | "
              f"{same} |")


def main() -> int:
    import train_reading

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--strings", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temps", default="0,0.8")
    ap.add_argument("--draft-max", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--only", default=None, help="method names separated by ';' (default: all)")
    ap.add_argument("--no-llama-server", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--table-from", default=None, help="print the table of a saved --json and stop")
    args = ap.parse_args()
    if args.table_from:
        print_table(json.loads(Path(args.table_from).read_text())["rows"])
        return 0
    args.temps = [float(t) for t in args.temps.split(",")]
    files = reading.models()
    target, mmproj = files["target"], files["mmproj"]
    strings = train_reading.held_out_strings(args.strings)
    pictures = [reading.render(s) for s in strings]
    acc = readout_accuracy(target, mmproj, strings, pictures, args.threads)
    print(f"# read-out accuracy (greedy, {len(strings)} held-out strings): {acc:.3f}", flush=True)
    have_server = native_build.find_llama_server() is not None and not args.no_llama_server
    refs = target_only_tokens(target, mmproj, strings, pictures, args)
    table = []
    for name, m in methods(args.draft_max, files).items():
        if args.only and name not in args.only.split(";"):
            continue
        for row in ours(name, m, target, mmproj, strings, pictures, args, refs):
            table.append(row)
            print(json.dumps(row), flush=True)
        if have_server and m["server"] is not None:
            for row in theirs(name, m, target, mmproj, strings, pictures, args):
                table.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(readout_accuracy=acc, rows=table), indent=1) + "\n")
    print_table(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
