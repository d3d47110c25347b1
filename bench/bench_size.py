"""What bench/dflash_bench_size.py, bench/eagle3_bench_size.py, bench/draft_model_bench_size.py,
bench/mtp_bench_size.py and bench/ngram_widened_bench_size.py share:
the prompts, the engines (pyllama-spec in this process and llama-server -np 1, target-only or with a draft
of one spec type), the warm-up and the interleaved rounds, the rows pooled per engine and prompt kind
(x target-only, ideal x, efficiency), the fidelity against the trained 64-wide target, the two tables and
the JSON.
How the numbers are computed is told in bench/dflash_bench_size.py's docstring.
"""

from __future__ import annotations

import base64
import json
import math
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
from pyllama_spec.embedded import PROMPT  # noqa: E402

# held-out-style code prefixes (tests/test_trained_pair.py's and the embedded demo prompt)
READ_CONFIG = ('def read_config(path):\n    """Read a configuration file and return a dict."""\n'
               '    result = {}\n    with open(path) as f:\n        for line in f:\n            line = line.strip()\n'
               '            if not line or line.startswith("#"):\n                continue\n')
OPT_STRINGS = ("        # one short option and one long option, either of which\n"
               "        # could be None.\n        opts = [opt for opt in opts if opt]\n        if not opts:\n"
               "            raise TypeError(\"at least one option string must be supplied\")\n        return opts\n\n"
               "    def _set_opt_strings(self, opts):\n        for ")
TEXT_PROMPTS = {"class Counter": PROMPT, "read_config": READ_CONFIG, "optparse": OPT_STRINGS}
CTX = dict(n_ctx=2048, n_batch=512, n_ubatch=512)
SIDES = ("pyllama-spec", "llama-server")


def engine_name(kind: str, spec_type: str, draft_max: int) -> str:
    """An engine's row name: "pyllama-spec target-only", "llama-server eagle3 5" (spec_type
    "draft-eagle3", draft max 5)."""
    return f"{kind} " + (f"{spec_type.removeprefix('draft-')} {draft_max}" if draft_max else "target-only")


class Local:
    """pyllama-spec in this process: target-only with draft_max 0, else with ``files.draft`` as
    ``spec_type`` (llama.cpp's name: "draft-dflash", "draft-eagle3", "draft-simple")."""

    kind = "pyllama-spec"

    def __init__(self, files, draft_max: int, spec_type: str) -> None:
        self.engine = ps.load(files.target, mmproj=files.mmproj, draft=files.draft if draft_max else None,
                              spec_type=spec_type if draft_max else "none", draft_max=draft_max or 7,
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
    """llama-server -np 1 on the same files: no draft with draft_max 0, else ``-md files.draft
    --spec-type spec_type --spec-draft-n-max draft_max --spec-draft-n-min 0`` (no ``-md`` where
    ``files.draft`` is None: draft-mtp, the target's own head)."""

    kind = "llama-server"

    def __init__(self, files, draft_max: int, spec_type: str) -> None:
        port = free_port()
        args = [str(native_build.find_llama_server()), "-m", str(files.target), "--mmproj", str(files.mmproj),
                "-c", str(CTX["n_ctx"]), "-b", str(CTX["n_batch"]), "-ub", str(CTX["n_ubatch"]), "-t", "1",
                "-fa", "off", "--host", "127.0.0.1", "--port", str(port), "-np", "1", "--no-warmup", "-ngl", "0"]
        if draft_max:
            args += (["-md", str(files.draft)] if files.draft else []) + [
                "--spec-type", spec_type, "--spec-draft-n-max", str(draft_max), "--spec-draft-n-min", "0",
                "-td", "1", "-ngld", "0"]
        self.server = ServerProcess(engine_name(self.kind, spec_type, draft_max), args, port)
        self.marker = httpx.get(self.server.url + "/props", timeout=10).json().get("media_marker", ps.MEDIA_MARKER)

    def run(self, prompt: str, image: bytes | None, max_tokens: int) -> dict:
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


def prompt_set(image: bytes | None, texts: dict[str, str] | None = None) -> dict[str, tuple[str, bool]]:
    """The prompts by name, each with whether it takes the picture: the text prompts (``texts``, default
    TEXT_PROMPTS), then the picture before the second of them ("image + read_config") unless image is None."""
    texts = texts or TEXT_PROMPTS
    prompts = {name: (p, False) for name, p in texts.items()}
    if image is not None:
        second = list(texts)[1]
        prompts[f"image + {second}"] = (ps.MEDIA_MARKER + "\n" + texts[second], True)
    return prompts


def param_counts(files, draft_key: str) -> dict[str, int]:
    """The parameter counts of the target and the draft file, the draft's under draft_key; without a draft
    file (draft-mtp), the target's nextn (MTP) blocks under draft_key (the target's count holds them too; 0 for
    a drafter with no weights, n-gram lookup)."""
    if files.draft is None:
        from pyllama_spec.gguf.reader import read_gguf

        info = read_gguf(files.target)
        n_all = int(info.metadata[f"{info.arch}.block_count"])
        n_heads = int(info.metadata.get(f"{info.arch}.nextn_predict_layers", 0))  # 0: a drafter with no weights
        heads = tuple(f"blk.{i}." for i in range(n_all - n_heads, n_all))
        with ps.Model(files.target) as mt:
            return {"target": mt.n_params,
                    draft_key: sum(math.prod(t.dims) for n, t in info.tensors.items() if n.startswith(heads))}
    with ps.Model(files.target) as mt, ps.Model(files.draft, role="draft") as md:
        return {"target": mt.n_params, draft_key: md.n_params}


def measure(files, spec_type: str, draft_maxes: list[int], prompts: dict, image: bytes | None, repeats: int,
            max_tokens: int, started: float) -> dict[str, list[dict]]:
    """Loads every engine (Local, then Remote; target-only, then each draft max), warms each up, then
    runs ``repeats`` rounds, each sending every prompt to every engine, the engine order reversed every
    other round; closes them all. Returns each engine's samples: its ``run`` dict with round, prompt
    and kind ("text" or "image")."""
    kind_of = {name: "image" if img else "text" for name, (_, img) in prompts.items()}
    engines: dict[str, Local | Remote] = {}
    samples: dict[str, list[dict]] = {}
    try:
        for cls in (Local, Remote):
            for dm in [0, *draft_maxes]:
                name = engine_name(cls.kind, spec_type, dm)
                engines[name], samples[name] = cls(files, dm, spec_type), []
        for e in engines.values():
            e.run(READ_CONFIG[:40], None, 8)  # warm-up, not measured
        for rnd in range(repeats):
            order = list(engines.items()) if rnd % 2 == 0 else list(reversed(list(engines.items())))
            for pname, (p, img) in prompts.items():
                for name, e in order:
                    s = e.run(p, image if img else None, max_tokens)
                    samples[name].append(dict(s, round=rnd, prompt=pname, kind=kind_of[pname]))
            print(f"round {rnd + 1}/{repeats} done ({time.monotonic() - started:.0f} s)", file=sys.stderr)
    finally:
        for e in engines.values():
            e.close()
    return samples


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


def reference_tokens(samples: dict[str, list[dict]]) -> dict[str, list[int]]:
    """pyllama-spec target-only's tokens of round 0, by prompt."""
    return {x["prompt"]: x["tokens"] for x in samples["pyllama-spec target-only"] if x["round"] == 0}


def pool_rows(samples: dict[str, list[dict]], spec_type: str, draft_maxes: list[int], repeats: int) -> dict[str, dict]:
    """One row per engine and prompt kind ("<engine> / <kind>"): decode tok/s min / median / max over
    the rounds, drafted, accepted, acceptance, MAL, same tokens, median prefill ms per prompt, the
    pyllama-spec step times (t_target_ms, t_draft_ms, t_python_ms), x_target_only against the same
    side's target-only, and for the drafting engines ideal_x and efficiency."""
    reference = reference_tokens(samples)
    kinds = list(dict.fromkeys(x["kind"] for xs in samples.values() for x in xs))
    # per engine and kind: one pooled record per round
    pooled = {name: {k: [_pool([x for x in xs if x["kind"] == k and x["round"] == r]) for r in range(repeats)]
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
        for side in SIDES:
            base = rows[f"{side} target-only / {k}"]["tps_median"]
            for dm in [0, *draft_maxes]:
                r = rows[f"{engine_name(side, spec_type, dm)} / {k}"]
                r["x_target_only"] = r["tps_median"] / base
                if dm:
                    ps_row = rows[f"{engine_name('pyllama-spec', spec_type, dm)} / {k}"]
                    r["ideal_x"] = r["mal"] * t1 / (ps_row["t_target_ms"] + ps_row["t_draft_ms"])
                    r["efficiency"] = r["x_target_only"] / r["ideal_x"]
    return rows


def fidelity(trained: dict[str, list[int]], samples: dict[str, list[dict]]) -> dict[str, dict]:
    """Per prompt: whether the trained target's tokens (trained, by prompt) equal the widened
    target-only's, the first position where they differ, and the widened token count."""
    reference = reference_tokens(samples)
    out = {}
    for pname, b in reference.items():
        a = trained[pname]
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        out[pname] = dict(equal=a == b, first_difference=None if a == b else first, n=len(b))
    return out


def print_tables(rows: dict[str, dict]) -> None:
    """Prints the rows as two markdown tables: speeds and acceptance; pyllama-spec's step times."""
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
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


def print_fidelity(fid: dict[str, dict], trained: str) -> None:
    """Prints the fidelity line; trained names what the widened tokens were held against."""
    print(f"\nfidelity (widened target-only tokens vs {trained}): "
          + "; ".join(f"{k}: {'equal' if v['equal'] else 'first difference at ' + str(v['first_difference'])} "
                      f"({v['n']} tokens)" for k, v in fid.items()))


def trained_runs(draft: Path | None, spec_type: str, prompts: dict, image: bytes | None, max_tokens: int,
                 draft_maxes: list[int], target=None) -> dict:
    """The trained files (the embedded 64-wide target with ``draft``, f32; ``target``: another trained
    target and mmproj) on the same prompts, per draft max (0: target-only): each prompt's tokens and
    drafted / accepted counts."""
    m = target or ps.embedded_models()
    files = SimpleNamespace(target=m.target, mmproj=m.mmproj, draft=draft)
    out = {}
    for dm in [0, *draft_maxes]:
        engine = Local(files, dm, spec_type)
        try:
            out[dm] = {name: engine.run(p, image if img else None, max_tokens) for name, (p, img) in prompts.items()}
        finally:
            engine.close()
    return out


def compare_drafts(samples: dict, trained: dict, spec_type: str, draft_maxes: list[int]) -> dict:
    """Per draft max: (drafted, accepted) of the widened and the trained draft, round 0, all prompts,
    and whether they are equal prompt by prompt."""
    drafts = {}
    for dm in draft_maxes:
        ours = [x for x in samples[engine_name("pyllama-spec", spec_type, dm)] if x["round"] == 0]
        theirs = [trained[dm][x["prompt"]] for x in ours]
        drafts[dm] = dict(widened=[sum(x["drafted"] for x in ours), sum(x["accepted"] for x in ours)],
                          trained=[sum(x["drafted"] for x in theirs), sum(x["accepted"] for x in theirs)],
                          equal_per_prompt=all((x["drafted"], x["accepted"]) == (y["drafted"], y["accepted"])
                                               for x, y in zip(ours, theirs)))
    return drafts


def print_drafts(drafts: dict, trained: str) -> None:
    print(f"drafted / accepted, widened vs {trained} (round 0, all prompts): "
          + "; ".join(f"draft max {dm}: {v['widened'][0]} / {v['widened'][1]} vs {v['trained'][0]} / "
                      f"{v['trained'][1]}{'' if v['equal_per_prompt'] else ' (differs)'}" for dm, v in drafts.items()))


def write_results(args, files, n_params: dict, rows: dict, fid: dict, samples: dict, started: float,
                  **extra) -> None:
    """Prints the wall time and writes the JSON to args.out: settings, rows, fidelity, extra (in order),
    elapsed_s and the samples without their tokens."""
    elapsed = time.monotonic() - started
    print(f"\nwall time {elapsed:.0f} s")
    result = dict(settings=dict(vars(args), out=str(args.out), files={k: str(v) for k, v in vars(files).items()},
                                n_params=n_params, ctx=CTX, threads=1),
                  rows=rows, fidelity=fid, **extra, elapsed_s=elapsed,
                  samples={name: [{k: v for k, v in x.items() if k != "tokens"} for x in xs]
                           for name, xs in samples.items()})
    args.out.write_text(json.dumps(result, indent=1))


def add_options(ap, what: str, out: str) -> None:
    """The options every bench-size script takes (``what``: the drafts' name in the help)."""
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-max", default="3,7,15", help=f"comma-separated {what} draft lengths")
    ap.add_argument("--no-image", action="store_true", help="text prompts only")
    ap.add_argument("--dtype", default="f16", choices=["f16", "f32"])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / out, help="JSON results")


def compare_widened_draft(args, *, spec_type: str, widened_draft, trained_draft: Path | None, label: str,
                          trained_label: str, key: str, widened_target=None, trained_target=None,
                          target_label: str = "the trained 64-wide target's", texts: dict | None = None) -> int:
    """The widened 142M target with a widened draft (``widened_draft(folder, dtype)`` writes or finds it)
    against target-only, here and on llama-server, then the trained pair (``trained_draft``) on the same
    prompts: the tables, the widened target's fidelity, and the drafts compared; the JSON written.
    ``widened_target(folder, dtype)``: another widened target and mmproj than ``widen_trained_pair``'s,
    ``trained_target`` the trained one it is held against (``target_label`` in the fidelity line);
    ``widened_draft`` and ``trained_draft`` None: no draft file (draft-mtp: the target's own head, whose
    parameters ``key`` counts). ``texts``: other text prompts than TEXT_PROMPTS (``prompt_set``)."""
    from pyllama_spec.devtools import widen
    from pyllama_spec.devtools.benchmark import demo_png

    if native_build.find_llama_server() is None:
        print("llama-server is not built: python build.py --tools", file=sys.stderr)
        return 2
    started = time.monotonic()
    folder = native_build.cache_root() / "tiny-models"
    pair = (widened_target or (lambda f, dtype: widen.widen_trained_pair(f, dtype=dtype)))(folder, args.dtype)
    files = SimpleNamespace(target=pair.target, mmproj=pair.mmproj,
                            draft=widened_draft(folder, args.dtype) if widened_draft else None)
    image = None if args.no_image else demo_png(672)
    prompts = prompt_set(image, texts)
    draft_maxes = [int(x) for x in args.draft_max.split(",") if x.strip()]
    n_params = param_counts(files, key)
    samples = measure(files, spec_type, draft_maxes, prompts, image, args.repeats, args.max_tokens, started)
    trained = trained_runs(trained_draft, spec_type, prompts, image, args.max_tokens, draft_maxes, trained_target)
    rows = pool_rows(samples, spec_type, draft_maxes, args.repeats)
    fid = fidelity({name: r["tokens"] for name, r in trained[0].items()}, samples)
    drafts = compare_drafts(samples, trained, spec_type, draft_maxes)
    sizes = (f"target {n_params['target']:,} and {label} {n_params[key]:,} parameters ({files.target.name}, "
             f"{files.draft.name})" if files.draft else
             f"target {n_params['target']:,} parameters, {label} {n_params[key]:,} of them ({files.target.name})")
    print(f"\nwidened trained target + {label} ({args.dtype}): {sizes}; {args.repeats} rounds "
          f"x {len(prompts)} prompts x {args.max_tokens} tokens, greedy, 1 thread\n")
    print_tables(rows)
    print_fidelity(fid, target_label)
    print_drafts(drafts, trained_label)
    write_results(args, files, n_params, rows, fid, samples, started, drafts=drafts)
    return 0
