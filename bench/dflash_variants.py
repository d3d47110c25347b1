#!/usr/bin/env python3
"""DSpark and DFlash2 on the embedded pair, each built from the trained DFlash draft, against the same
draft as DFlash and against llama-server on the same files.

No DSpark or DFlash2 draft is trained for the embedded target (training one end to end did not fit),
so this builds them from the trained DFlash draft's weights, unchanged:

- **DSpark**: plus ``markov_w1`` / ``markov_w2`` of rank ``--rank`` from the SVD of ``alpha`` x the
  pointwise mutual information of token bigrams in the pair's training corpus (the Python standard
  library files that tools/measure_trained_pair.py does not hold out), and
  ``dflash.sample_from_anchor`` false (the anchor's row is a bonus, as the DFlash draft was trained:
  its masks predict). Each drafted position's logits then get ``alpha`` x PMI(previous token, next
  token), the chain run in the draft's graph (llama.cpp's DSpark). It measures the mechanism on real
  weights, not what a Markov head trained with the draft would reach.
- **DFlash2**: plus its convolutions (kernel 4, groups of 16) set to the identity (tap 0 of each base 1,
  the others and the dynamic projections 0) and a selector (top 4 candidates, rank 8) whose gate is 0,
  so each position's pick is the best of its 4 candidates by the draft's own logits: the drafts are
  DFlash's, drafted through DFlash2's graph (the convolutions, the candidates and the lattice in the
  graph, the walk here). It measures what DFlash2's path costs, not what a trained selector gains.

Per setting: held-out prompts (those tools/measure_trained_pair.py holds out), greedy, --max-tokens
each, target-only / DFlash / DFlash2 / DSpark at each alpha, interleaved for --repeats rounds;
acceptance and decode tok/s min / median / max. Then `serve` against llama-server on the DFlash,
DFlash2 and DSpark files, tok/s side by side, with both servers' drafted / accepted counts and whether
their texts are the same (DSpark's drafts are compared with llama-server's in tests/test_dspark.py).

    python bench/dflash_variants.py --repeats 3
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import shutil
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

import numpy as np

import pyllama_spec as ps
from pyllama_spec.devtools.servers import running_server
from pyllama_spec.embedded import MODELS_DIR
from pyllama_spec.gguf.reader import read_gguf, read_tensor
from pyllama_spec.gguf.writer import GGUFWriter

REPO = Path(__file__).resolve().parent.parent


def _corpus_tools():
    spec = importlib.util.spec_from_file_location("measure_trained_pair", REPO / "tools" / "measure_trained_pair.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def pmi(model, files: list[str], n_vocab: int) -> np.ndarray:
    """PMI(prev, next) of the token bigrams in ``files``, add-one smoothed: float32 [n_vocab, n_vocab]."""
    pairs = np.zeros((n_vocab, n_vocab), dtype=np.float64)
    for f in files:
        ids = np.asarray(model.tokenize(Path(f).read_text(encoding="utf-8", errors="replace"), add_special=False))
        np.add.at(pairs, (ids[:-1], ids[1:]), 1.0)
    pairs += 1.0
    p_next_given_prev = pairs / pairs.sum(axis=1, keepdims=True)
    p_next = pairs.sum(axis=0) / pairs.sum()
    return np.log(p_next_given_prev / p_next[None, :]).astype(np.float32)


def _copy(draft: Path) -> tuple[GGUFWriter, dict]:
    """A writer holding ``draft``'s keys and tensors, and its metadata."""
    info = read_gguf(draft)
    w = GGUFWriter()
    for key, value in info.metadata.items():
        vtype, elem = info.types[key]
        if elem is not None:
            w.add_array(key, elem, list(value))
        else:
            w.add_value(key, vtype, value)
    for name in info.tensors:
        w.add_tensor(name, read_tensor(info, name))
    return w, info.metadata


def write_dflash2(draft: Path, out: Path, *, kernel: int = 4, group: int = 16, top_k: int = 4,
                  rank: int = 8) -> Path:
    """``draft`` as a DFlash2 draft whose convolutions are the identity and whose selector gate is 0
    (see the module): its picks are ``draft``'s."""
    w, meta = _copy(draft)
    n_embd, n_layer = int(meta["dflash.embedding_length"]), int(meta["dflash.block_count"])
    n_vocab = len(meta["tokenizer.ggml.tokens"])  # the codebooks' rows: the draft's (the target's) tokens
    for key, value in (("conv_kernel_size", kernel), ("conv_group_size", group), ("selector_rank", rank),
                       ("selector_top_k", top_k)):
        w.add_uint32(f"dflash.{key}", value)
    base = np.zeros((2, kernel, n_embd), dtype=np.float32)  # ggml [n_embd, kernel, 2]
    base[:, 0, :] = 1.0  # the current position's value, unchanged; the earlier taps add nothing
    for i in range(n_layer):
        for side in ("attn", "ffn"):
            w.add_tensor(f"blk.{i}.{side}_conv_base", base)
            w.add_tensor(f"blk.{i}.{side}_conv_proj.weight",  # no dynamic taps: ggml [n_embd, 2 * kernel * groups]
                         np.zeros((2 * kernel * (n_embd // group), n_embd), dtype=np.float32))
    w.add_tensor("selector_predecessor.weight", np.zeros((n_vocab, rank), dtype=np.float32))
    w.add_tensor("selector_successor.weight", np.zeros((n_vocab, rank), dtype=np.float32))
    w.add_tensor("selector_hidden.weight", np.zeros((rank, n_embd), dtype=np.float32))  # the gate: 0
    w.write(out)
    return out


def write_dspark(draft: Path, out: Path, bias: np.ndarray, rank: int) -> Path:
    """``draft``'s keys and tensors, plus the Markov head of rank ``rank`` whose product is about ``bias``."""
    w, _ = _copy(draft)
    w.add_bool("dflash.sample_from_anchor", False)  # the masks predict, as the DFlash draft was trained
    u, s, vt = np.linalg.svd(bias.astype(np.float64))
    root = np.sqrt(s[:rank])
    w.add_tensor("markov_w1.weight", (u[:, :rank] * root).astype(np.float32))  # a row per previous token
    w.add_tensor("markov_w2.weight", (vt[:rank].T * root).astype(np.float32))  # a row per next token
    w.write(out)
    return out


def _measure(engine, prompts: list[str], max_tokens: int) -> tuple[float, float]:
    tokens = seconds = drafted = accepted = 0
    for p in prompts:
        s = engine.generate(p, max_tokens=max_tokens, temperature=0, cache_prompt=False).stats
        tokens += s.generated_tokens - 1
        seconds += s.decode_seconds
        drafted += s.drafted
        accepted += s.accepted
    return tokens / seconds, (accepted / drafted if drafted else 0.0)


def _served(cmd: list[str], prompts: list[str], max_tokens: int) -> tuple[float, int, int, int]:
    """A server started with ``cmd``, over the prompts: decode tok/s (its timings, tokens after the first),
    tokens drafted and accepted, and a hash of the texts (equal texts, equal hashes)."""
    with running_server(cmd) as url:
        tokens = ms = 0.0
        drafted = accepted = 0
        texts = []
        for p in prompts:
            body = json.dumps({"prompt": p, "n_predict": max_tokens, "temperature": 0, "cache_prompt": False})
            req = urllib.request.Request(url + "/completion", body.encode(), {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                answer = json.load(r)
            t = answer["timings"]
            tokens += t["predicted_n"] - 1
            ms += t["predicted_ms"]
            drafted += t.get("draft_n", 0)
            accepted += t.get("draft_n_accepted", 0)
            texts.append(answer["content"])
        return tokens / ms * 1000, drafted, accepted, hash(tuple(texts))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--alphas", default="0.25,0.5,1.0")
    ap.add_argument("--draft-max", type=int, default=5)
    args = ap.parse_args()
    tools = _corpus_tools()
    prompts = tools.held_out_prompts(args.prompts)
    train = [f for i, f in enumerate(sorted(glob.glob(tools.CORPUS_GLOB))) if i % 10 != 0]
    target, draft = MODELS_DIR / "trained-target.gguf", MODELS_DIR / "trained-draft.gguf"
    folder = Path(tempfile.mkdtemp(prefix="dflash-variants-"))
    common = dict(n_ctx=4096, n_threads=1, flash_attn=False, draft_max=args.draft_max)
    with ps.load(target, spec_type="none", n_ctx=4096, n_threads=1) as plain:
        bias = pmi(plain.model, train, plain.model.n_vocab)
    files = {a: write_dspark(draft, folder / f"dspark-{a}.gguf", float(a) * bias, args.rank)
             for a in args.alphas.split(",")}
    dflash2 = write_dflash2(draft, folder / "dflash2.gguf")
    engines = {"target only": ps.load(target, spec_type="none", n_ctx=4096, n_threads=1),
               "DFlash": ps.load(target, draft=draft, spec_type="draft-dflash", **common),
               "DFlash2": ps.load(target, draft=dflash2, spec_type="draft-dflash", **common),
               **{f"DSpark alpha {a}": ps.load(target, draft=f, spec_type="draft-dspark", **common)
                  for a, f in files.items()}}
    rates: dict[str, list[float]] = {name: [] for name in engines}
    acceptance: dict[str, float] = {}
    try:
        for r in range(args.repeats):
            order = list(engines) if r % 2 == 0 else list(engines)[::-1]
            for name in order:
                rate, acc = _measure(engines[name], prompts, args.max_tokens)
                rates[name].append(rate)
                acceptance[name] = acc
    finally:
        for e in engines.values():
            e.close()
    base = statistics.median(rates["target only"])
    print(f"{len(prompts)} held-out prompts x {args.max_tokens} tokens, greedy, draft max {args.draft_max}, "
          f"rank {args.rank}, {args.repeats} rounds; decode tok/s min / median / max")
    print("| drafter | acceptance | tok/s | x target only (median) |")
    print("|---|---|---|---|")
    for name, xs in rates.items():
        xs = sorted(xs)
        print(f"| {name} | {acceptance[name]:.3f} | {xs[0]:.0f} / {statistics.median(xs):.0f} / {xs[-1]:.0f} | "
              f"{statistics.median(xs) / base:.2f} |")
    from pyllama_spec import native_build

    server = native_build.find_llama_server()
    if server is not None:
        best = max(files, key=lambda a: acceptance[f"DSpark alpha {a}"])
        for name, file, spec_type in (("DFlash", draft, "draft-dflash"), ("DFlash2", dflash2, "draft-dflash"),
                                      (f"DSpark alpha {best}", files[best], "draft-dspark")):
            argv = ["-m", str(target), "-md", str(file), "--spec-type", spec_type, "--spec-draft-n-max",
                    str(args.draft_max), "-c", "4096", "-np", "1", "-t", "1", "-fa", "off"]
            theirs, ours, drafts = [], [], {}
            for r in range(args.repeats):
                runs = [("llama-server", theirs, [str(server), *argv, "--no-warmup"]),
                        ("serve", ours, [sys.executable, "-m", "pyllama_spec", "serve", *argv])]
                for who, out, cmd in (runs if r % 2 == 0 else runs[::-1]):
                    rate, drafted, accepted, texts = _served(cmd, prompts, args.max_tokens)
                    out.append(rate)
                    drafts[who] = (drafted, accepted, texts)
            theirs.sort()
            ours.sort()
            same = "the same texts" if drafts["serve"][2] == drafts["llama-server"][2] else "DIFFERENT texts"
            print(f"\n{name} served, /completion, tok/s min / median / max: llama-server "
                  f"{theirs[0]:.0f} / {statistics.median(theirs):.0f} / {theirs[-1]:.0f}, serve {ours[0]:.0f} / "
                  f"{statistics.median(ours):.0f} / {ours[-1]:.0f} "
                  f"({statistics.median(ours) / statistics.median(theirs):.2f}x); drafted / accepted: llama-server "
                  f"{drafts['llama-server'][0]} / {drafts['llama-server'][1]}, serve {drafts['serve'][0]} / "
                  f"{drafts['serve'][1]}; {same}")
    shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
