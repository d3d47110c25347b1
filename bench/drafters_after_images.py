#!/usr/bin/env python3
"""Every drafting method on the trained files, on text and after a picture, here and on llama-server
built from the same pin: acceptance, mean accepted length, decode tokens/s, and whether the output
equals the target alone.

    python bench/drafters_after_images.py --prompts 16 --max-tokens 128 --temps 0,0.8 --repeats 3

Methods (each skipped, with the reason, when its files are not in pyllama_spec/models): on the
embedded hunyuan_vl target, DFlash (trained-draft.gguf), EAGLE3 (trained-eagle3.gguf), the small
draft VLM as a text-only draft model (trained-draft-vlm.gguf, today's draft-simple) and as a vision
draft model (with its own projector, trained-draft-vlm-mmproj.gguf: ``mmproj_draft``); on the
trained qwen35 target, its own MTP head (trained-qwen35-mtp.gguf, ``draft-mtp``), and the same with
the image rows left out of the head's cache (as llama.cpp leaves them: the A/B of feeding them).

Conditions: ``text`` (a held-out prompt), ``image, then 400`` (a picture, then the 400-character
prompt: generation starts about 400 positions after the picture), ``right after image`` (the prompt,
then the picture: generation starts right after it). The picture is the demo's test card
(``draw_demo_image``), not in any training pool. Above temperature 0, prompt i samples with seed i
(the same in every run), verified by llama.cpp's rule (``verify="match"``), so the output equals the
target alone's there too. llama-server gets the same prompts through ``/completion``
(``multimodal_data``), one server per method, each started with the same files, draft length and
settings (one thread, flash attention off on both: llama-server's default is auto, which on this
CPU encodes the test card 2.6x faster and makes batched and one-token numerics differ at near ties).
Tokens/s is decode time as each engine reports it (``decode_seconds`` here, ``predicted_ms`` there);
wall tokens/s is what the caller waits, prompt and picture included, on the caller's clock (here a
``generate`` call in process, there a ``/completion`` request over loopback HTTP); both min /
median / max over ``--repeats`` runs of the whole set. A request llama-server fails is a row naming
its error, and the run goes on.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from measure_trained_pair import held_out_prompts, run  # noqa: E402

import pyllama_spec as ps  # noqa: E402
from pyllama_spec import native_build  # noqa: E402
from pyllama_spec.devtools.rpc_server import free_port  # noqa: E402
from pyllama_spec.devtools.tiny import draw_demo_image  # noqa: E402

MODELS = REPO / "pyllama_spec" / "models"
MARKER = "<__media__>"


def methods(draft_max: int | None) -> dict[str, dict]:
    """name -> how to load it here (target, mmproj, keywords), its draft length, and how llama-server
    runs it (or None). ``draft_max`` None: 7, but 3 for MTP (one head chained on its own guesses:
    each further token is a guess from a guess, as RESULTS' MTP section measured it)."""
    t, mm = MODELS / "trained-target.gguf", MODELS / "trained-mmproj.gguf"
    q, qmm = MODELS / "trained-qwen35-mtp.gguf", MODELS / "trained-qwen35-mtp-mmproj.gguf"
    vlm, vlm_mm = MODELS / "trained-draft-vlm.gguf", MODELS / "trained-draft-vlm-mmproj.gguf"
    out = {
        "target only": dict(files=[t, mm], target=t, mmproj=mm, kw={"spec_type": "none"}, server=[]),
        "DFlash": dict(files=[t, mm, MODELS / "trained-draft.gguf"], target=t, mmproj=mm,
                       kw={"draft": MODELS / "trained-draft.gguf", "spec_type": "draft-dflash"},
                       server=["-md", MODELS / "trained-draft.gguf", "--spec-type", "draft-dflash"]),
        "EAGLE3": dict(files=[t, mm, MODELS / "trained-eagle3.gguf"], target=t, mmproj=mm,
                       kw={"draft": MODELS / "trained-eagle3.gguf", "spec_type": "draft-eagle3"},
                       server=["-md", MODELS / "trained-eagle3.gguf", "--spec-type", "draft-eagle3"]),
        "text-only draft model": dict(files=[t, mm, vlm], target=t, mmproj=mm,
                                      kw={"draft": vlm, "spec_type": "draft-simple"},
                                      server=["-md", vlm, "--spec-type", "draft-simple"]),
        "vision draft model": dict(files=[t, mm, vlm, vlm_mm], target=t, mmproj=mm,
                                   kw={"draft": vlm, "mmproj_draft": vlm_mm, "spec_type": "draft-simple"},
                                   server=None),  # llama-server has no draft projector
        "qwen35: target only": dict(files=[q, qmm], target=q, mmproj=qmm, kw={"spec_type": "none"}, server=[]),
        "qwen35: MTP": dict(files=[q, qmm], target=q, mmproj=qmm, kw={"spec_type": "draft-mtp"},
                            server=["--spec-type", "draft-mtp"]),
        # the A/B of the head's image rows: left out of its cache, as llama.cpp leaves them (and as a
        # build without patches/0004 does), the pairing after the picture still right
        "qwen35: MTP without image rows": dict(files=[q, qmm], target=q, mmproj=qmm,
                                               kw={"spec_type": "draft-mtp"}, server=None,
                                               after_load=lambda eng: setattr(eng.drafter, "writes_media", False)),
    }
    for name, m in out.items():
        m["draft_max"] = draft_max or (3 if name.startswith("qwen35: MTP") else 7)
        if m["server"]:
            m["server"] = [str(x) for x in m["server"]] + ["--spec-draft-n-max", str(m["draft_max"]),
                                                           "--spec-draft-n-min", "0"]
    return out


def png_b64(image: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def condition_prompts(prompts: list[str]) -> dict[str, list[str]]:
    return {"text": prompts, "image, then 400": [f"{MARKER}\n{p}" for p in prompts],
            "right after image": [f"{p}\n{MARKER}\n" for p in prompts]}


def ours(m: dict, prompts: dict, image, args, refs: dict) -> list[dict]:
    rows = []
    with ps.load(m["target"], mmproj=m["mmproj"], n_threads=args.threads, draft_max=m["draft_max"], flash_attn=False,
                 **m["kw"]) as eng:
        if "after_load" in m:
            m["after_load"](eng)
        for cond, ps_ in prompts.items():
            for temp in args.temps:
                runs = []
                same = True
                for _ in range(args.repeats):
                    res, toks = _run(eng, ps_, args.max_tokens, image if cond != "text" else None, temp)
                    same &= refs.setdefault((str(m["target"]), cond, temp), toks) == toks
                    runs.append(res)
                rows.append(dict(condition=cond, temp=temp, lossless=same, **_repeated(runs)))
    return rows


SPEEDS = ("tokens_per_s", "wall_tokens_per_s")


def _repeated(runs: list[dict]) -> dict:
    """One row from repeats: the counts of the first run (a repeat that drafts differently is an error:
    same prompts, seeds and files) and each speed as min / median / max over the repeats."""
    first = {k: v for k, v in runs[0].items() if k not in SPEEDS}
    for r in runs[1:]:
        if (r["drafted"], r["accepted"], r["generated"]) != (first["drafted"], first["accepted"], first["generated"]):
            raise RuntimeError(f"a repeat drafted differently: {r} vs {runs[0]}")
    for speed in SPEEDS:
        xs = sorted(r[speed] for r in runs)
        first.update({speed: float(np.median(xs)), f"{speed}_min": xs[0], f"{speed}_max": xs[-1]})
    return first


def _run(eng, prompts, max_tokens, image, temp):
    # measure_trained_pair.run puts the marker before the prompt; ours are laid out already
    t0 = time.perf_counter()
    res, toks = run(_Prompted(eng, image), prompts, max_tokens, image=None, temperature=temp)
    res["wall_tokens_per_s"] = res["generated"] / (time.perf_counter() - t0)
    return res, toks


class _Prompted:
    """An engine whose generate() adds the picture to prompts holding the marker."""

    def __init__(self, eng, image):
        self.eng, self.image = eng, image

    def generate(self, prompt, **kw):
        images = [self.image] if MARKER in prompt else []
        return self.eng.generate(prompt, images=images, **kw)


@contextlib.contextmanager
def llama_server(target, mmproj, flags: list, threads: int):
    """llama-server from the pin on these files with ``flags``, one slot, ``threads`` threads, flash
    attention off (as ours): yields (its URL, its media marker); stopped on leaving."""
    server = native_build.find_llama_server()
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen([str(server), "-m", str(target), "--mmproj", str(mmproj), *map(str, flags),
                             "-c", "4096", "-np", "1", "-t", str(threads), "-td", str(threads),
                             "-fa", "off",  # as ours (flash_attn=False, the default; llama-server's is auto)
                             "--no-warmup", "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {Path(log.name).read_text()[-2000:]}")
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("llama-server did not start") from None
                time.sleep(0.3)
        # llama-server draws its media marker per process: /props says which
        yield url, json.load(urllib.request.urlopen(url + "/props", timeout=10)).get("media_marker", MARKER)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        Path(log.name).unlink(missing_ok=True)


def theirs(m: dict, prompts: dict, image_b64: str, args) -> list[dict]:
    rows = []
    with llama_server(m["target"], m["mmproj"], m["server"], args.threads) as (url, marker):
        for cond, ps_ in prompts.items():
            for temp in args.temps:
                try:
                    res = _repeated([_serve_run(url, marker, ps_, image_b64, temp, args)
                                     for _ in range(args.repeats)])
                except urllib.error.HTTPError as e:
                    # a failure of llama-server's is a finding of the run, not the end of it
                    message = json.loads(e.read() or b"{}").get("error", {}).get("message", str(e))
                    res = dict(error=f"HTTP {e.code}: {message}")
                rows.append(dict(condition=cond, temp=temp, lossless=None, **res))
    return rows


def _serve_run(url: str, marker: str, prompts: list[str], image_b64: str, temp: float, args) -> dict:
    """Totals over the prompts through llama-server's /completion, counted as measure_trained_pair.run counts."""
    agg = dict(drafted=0, accepted=0, generated=0, ms=0.0, steps=0, wall=0.0)
    for i, p in enumerate(prompts):
        prompt = ({"prompt_string": p.replace(MARKER, marker), "multimodal_data": [image_b64]}
                  if MARKER in p else p)
        body = {"prompt": prompt, "n_predict": args.max_tokens, "temperature": temp, "seed": i,
                "cache_prompt": False}
        req = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        t = json.load(urllib.request.urlopen(req, timeout=600))["timings"]
        agg["wall"] += time.perf_counter() - t0
        agg["drafted"] += t.get("draft_n", 0)
        agg["accepted"] += t.get("draft_n_accepted", 0)
        agg["generated"] += t["predicted_n"]
        agg["ms"] += t["predicted_ms"]
        # the first token comes with the prompt; each step after it yields its accepted
        # drafts plus one token of the target's (as this project's target_steps counts them)
        agg["steps"] += t["predicted_n"] - 1 - t.get("draft_n_accepted", 0)
    return dict(acceptance_rate=agg["accepted"] / agg["drafted"] if agg["drafted"] else 0.0,
                mean_accepted_length=1 + agg["accepted"] / agg["steps"] if agg["steps"] else 0.0,
                tokens_per_s=agg["generated"] / agg["ms"] * 1000 if agg["ms"] else 0.0,
                wall_tokens_per_s=agg["generated"] / agg["wall"],
                drafted=agg["drafted"], accepted=agg["accepted"], generated=agg["generated"])


def _spread(row: dict, speed: str) -> str:
    return f"{row[speed]:.0f} ({row[speed + '_min']:.0f}-{row[speed + '_max']:.0f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temps", default="0,0.8")
    ap.add_argument("--draft-max", type=int, default=None, help="every method's draft length (default: 7, MTP 3)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1,
                    help="run each set this many times: tokens/s as min / median / max (counts must repeat)")
    ap.add_argument("--only", default=None, help="comma-separated method names to run (default: all)")
    ap.add_argument("--no-llama-server", action="store_true")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    args.temps = [float(t) for t in args.temps.split(",")]
    prompts = condition_prompts(held_out_prompts(args.prompts))
    image = np.asarray(draw_demo_image(672))
    image_b64 = png_b64(image)
    have_server = native_build.find_llama_server() is not None and not args.no_llama_server
    refs: dict = {}
    table = []
    for name, m in methods(args.draft_max).items():
        if args.only and name not in args.only.split(","):  # (no method name holds a comma)
            continue
        missing = [f.name for f in m["files"] if not f.is_file()]
        if missing:
            print(f"# {name}: skipped, no {', '.join(missing)}", flush=True)
            continue
        for row in ours(m, prompts, image, args, refs):
            drafts = m["kw"]["spec_type"] != "none"
            table.append({"method": name, "engine": "pyllama-spec", "draft_max": m["draft_max"] if drafts else None,
                          **row})
            print(json.dumps(table[-1]), flush=True)
        if have_server and m["server"] is not None:  # [] is llama-server target-only
            for row in theirs(m, prompts, image_b64, args):
                table.append({"method": name, "engine": "llama-server", "draft_max": m["draft_max"] if drafts else None,
                              **row})
                print(json.dumps(table[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1) + "\n")
    print("\n| method | engine | draft max | condition | temperature | acceptance | mean accepted length | "
          "decode tokens/s median (min-max) | wall tokens/s median (min-max) | equals target only |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        if "error" in r:
            print(f"| {r['method']} | {r['engine']} | {r['draft_max'] or ''} | {r['condition']} | {r['temp']:g} | "
                  f"failed: {r['error']} | | | | |")
            continue
        same = "" if r["lossless"] is None else ("yes" if r["lossless"] else "NO")
        print(f"| {r['method']} | {r['engine']} | {r['draft_max'] or ''} | {r['condition']} | {r['temp']:g} | "
              f"{r['acceptance_rate']:.3f} | "
              f"{r['mean_accepted_length']:.2f} | {_spread(r, 'tokens_per_s')} | {_spread(r, 'wall_tokens_per_s')} | "
              f"{same} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
