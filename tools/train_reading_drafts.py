#!/usr/bin/env python3
"""Train the reading world's EAGLE3 and DFlash drafts for its committed target
(``pyllama_spec.devtools.reading``; the target itself: tools/train_reading.py).

Not part of the installed package: PyTorch (CPU) is used here for training only.

    pip install torch==2.13.0
    python tools/train_reading_drafts.py --eagle3 --seed 0 --out pyllama_spec/models   # reading-eagle3.gguf
    python tools/train_reading_drafts.py --dflash --seed 0 --out pyllama_spec/models   # reading-dflash.gguf

Both drafts read the target's layer inputs (layers 1, 2 and 3 of the qwen35 target), so what they
learn of a picture they learn from the target's own features of its rows: EAGLE3 holds those rows
in its cache in either ``draft_positions`` mode; DFlash holds them only in "sequential" mode (in
"target" mode a qwen35 picture's rows are pinned to one position and left out: DFlash is blind).

The graphs and the training objectives are train_tiny_pair.py's (``make_eagle3`` and
``eagle3_chain_logits``, EAGLE-3's training-time test; ``make_draft`` and ``draft_block_logits``,
DFlash's blocks of [anchor, mask...]), started from the embedded world's trained drafts. Their
training data here:

* reading sequences: a picture of a string (``reading.render_varied``: ink, ground, glyph height and
  offset drawn at random; the strings drawn as train_reading.draw_string draws them), then
  ``reading.PROMPT``, then the target's greedy continuation (its read-out, a newline, code), decoded
  by llama.cpp with every row's layer inputs (train_tiny_pair.generate_image_continuations /
  generate_image_sequences), one picture a sequence;
* other pictures (train_reading.other_pictures: flat colours, gradients, noise, ...) followed by a
  corpus prompt and the target's greedy continuation, so that the drafts hold after pictures that
  are not for reading;
* corpus windows, the features from the PyTorch target (Q.make_target(..., layer_ids)).

The DFlash draft's window is 64 positions (the embedded draft's is 32): in "sequential" mode the
read-out's last character is about 58 positions past the picture's first row (16 rows, then the
prompt's 26 tokens, then the read-out), so the whole picture stays in view.

tests/test_reading_world.py checks the committed drafts against llama.cpp through a reading picture
(the PyTorch target's layer inputs, EAGLE3's cache rows and drafted chain, a DFlash block, in both
position modes) and measures them through the engine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

TOOLS = Path(__file__).resolve().parent
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

import train_qwen35_mtp as Q  # noqa: E402
import train_reading as RW  # noqa: E402
import train_tiny_pair as T  # noqa: E402

from pyllama_spec.devtools import reading as R  # noqa: E402

MODELS = TOOLS.parent / "pyllama_spec" / "models"
TARGET_LAYERS = (1, 2, 3)
DFLASH_WINDOW = 64


class Mixed:
    """Several sets of sequences after a picture as one (``len`` and ``rows`` over all of them), so
    that train_tiny_pair's DraftData / Eagle3Data draw from reading and other pictures alike."""

    def __init__(self, *sets):
        self.sets = sets
        self.ends = np.cumsum([len(s) for s in sets])

    def __len__(self) -> int:
        return int(self.ends[-1])

    def rows(self, i: int, *args):
        k = int(np.searchsorted(self.ends, i, side="right"))
        return self.sets[k].rows(i - (int(self.ends[k - 1]) if k else 0), *args)


def reading_pictures(n: int, seed: int, lines) -> list[np.ndarray]:
    """n training pictures of strings drawn as the target's training draws them, varied as it varies them."""
    rng = np.random.default_rng(seed + 61)
    return [R.render_varied(RW.draw_string(rng, lines)[0], rng) for _ in range(n)]


def held_out_pictures(n: int) -> list[np.ndarray]:
    """The world's own pictures (``reading.render``) of n held-out strings."""
    return [np.asarray(R.render(s)) for s in RW.held_out_strings(n)]


def pictures_of_at_least(pictures, rows: int) -> list[np.ndarray]:
    """The pictures whose projector rows are at least ``rows`` (one row a cell of 2 x 2 merged patches:
    other_pictures cuts them to whole cells, which the projector takes without a resize)."""
    return [p for p in pictures if (p.shape[0] // R.CELL) * (p.shape[1] // R.CELL) >= rows]


def held_out_sets(data_class, held, reading, others) -> dict:
    """The evaluation sets of a draft (``data_class``: Eagle3Data or DraftData): held-out corpus text,
    and held-out reading sequences and other pictures in each ``draft_positions`` mode."""
    sets = {"text": data_class(held)}
    for mode in ("target", "sequential"):
        sets[f"reading_{mode}"] = data_class(held, images=reading, image_share=1.0, image_modes=(mode,))
        sets[f"other_pictures_{mode}"] = data_class(held, images=others, image_share=1.0, image_modes=(mode,))
    return sets


def eagle3_main(args, target, corpus, held, lines, log) -> dict:
    target_path, mmproj_path = Path(args.out) / R.MODEL_FILES["target"], Path(args.out) / R.MODEL_FILES["mmproj"]
    torch = T._torch()
    t0 = time.time()

    def continuations(pictures, toks, prompt_len, gen_len, seed, prompt=None):
        return T.generate_image_continuations(target_path, mmproj_path, toks, pictures, len(pictures), prompt_len,
                                              gen_len, TARGET_LAYERS, seed, log, prompt=prompt, one_each=True)

    reads = continuations(reading_pictures(args.reading_seqs, args.seed, lines), corpus, 0, args.gen_len, args.seed,
                          R.PROMPT)
    others = continuations(RW.other_pictures(args.picture_seqs, args.seed), corpus, args.prompt_len, args.gen_len,
                           args.seed)
    held_reads = continuations(held_out_pictures(32), held, 0, args.gen_len, args.seed + 1, R.PROMPT)
    held_others = continuations(RW.other_pictures(16, args.seed + 1000), held, args.prompt_len, args.gen_len,
                                args.seed + 1)
    data_s = time.time() - t0
    log(f"eagle3 data: {len(reads)} reading, {len(others)} other pictures ({data_s:.0f}s)")
    data = T.Eagle3Data(corpus, images=Mixed(reads, others), image_share=args.image_share)
    held_sets = held_out_sets(T.Eagle3Data, held, held_reads, held_others)
    start, ecfg = T.load_eagle3(MODELS / "trained-eagle3.gguf")  # the embedded world's: its shapes, its start
    if tuple(ecfg.target_layers) != TARGET_LAYERS:
        raise SystemExit(f"trained-eagle3.gguf reads layers {ecfg.target_layers}, expected {TARGET_LAYERS}")
    ecfg.merges = False  # the reading target's tokenizer: one byte, one token
    torch.manual_seed(args.seed + 2)
    draft = T.make_eagle3(ecfg)
    draft.load_state_dict(start.state_dict())
    draft.train()
    info = T.train_eagle3(draft, target, data, held_sets, ecfg, steps=args.steps, seconds=args.minutes * 60,
                          batch=args.batch, seq=args.seq, n_anchors=args.anchors, seed=args.seed, log=log)
    draft.eval()
    path = T.write_eagle3_gguf(Path(args.out) / R.DRAFT_FILES["eagle3"], {k: T._np(v) for k, v in draft.state_dict().items()},
                               ecfg, name="reading-eagle3")
    info.update(data_seconds=round(data_s), config=asdict(ecfg), all_steps=info["steps"] == args.steps,
                wrote=str(path))
    return info


def dflash_main(args, target, corpus, held, lines, log) -> dict:
    target_path, mmproj_path = Path(args.out) / R.MODEL_FILES["target"], Path(args.out) / R.MODEL_FILES["mmproj"]
    torch = T._torch()
    cfg = T.PairConfig(merges=False)  # the reading target's tokenizer: one byte, one token
    start = T.load_draft(MODELS / "trained-draft.gguf", cfg)  # the embedded world's: its shapes, its start
    if tuple(cfg.target_layers) != TARGET_LAYERS:
        raise SystemExit(f"trained-draft.gguf reads layers {cfg.target_layers}, expected {TARGET_LAYERS}")
    cfg.sliding_window = DFLASH_WINDOW
    t0 = time.time()

    def sequences(pictures, toks, prompt_len, gen_len, seed, prompt=None):
        return T.generate_image_sequences(target_path, mmproj_path, toks, pictures, len(pictures), prompt_len,
                                          gen_len, cfg, seed, log, prompt=prompt, one_each=True)

    big = DFLASH_WINDOW  # other pictures whose last W rows fill the window (see generate_image_sequences)
    reads = sequences(reading_pictures(args.reading_seqs, args.seed, lines), corpus, 0, args.gen_len, args.seed,
                      R.PROMPT)
    others = sequences(pictures_of_at_least(RW.other_pictures(args.picture_seqs, args.seed), big), corpus,
                       args.prompt_len, args.gen_len, args.seed)
    held_reads = sequences(held_out_pictures(32), held, 0, args.gen_len, args.seed + 1, R.PROMPT)
    held_others = sequences(pictures_of_at_least(RW.other_pictures(32, args.seed + 1000), big), held,
                            args.prompt_len, args.gen_len, args.seed + 1)
    data_s = time.time() - t0
    log(f"dflash data: {len(reads)} reading, {len(others)} other pictures ({data_s:.0f}s)")
    data = T.DraftData(corpus, images=Mixed(reads, others), image_share=args.image_share)
    held_sets = held_out_sets(T.DraftData, held, held_reads, held_others)
    torch.manual_seed(args.seed + 3)
    draft = T.make_draft(cfg)
    draft.load_state_dict(start.state_dict())
    draft.train()
    info = T.train_draft(draft, target, data, held_sets, cfg, steps=args.steps, seconds=args.minutes * 60,
                         batch=args.batch, seq=args.seq, n_blocks=args.blocks, seed=args.seed, log=log)
    draft.eval()
    path = T.write_draft_gguf(Path(args.out) / R.DRAFT_FILES["dflash"], {k: T._np(v) for k, v in draft.state_dict().items()},
                              cfg, name="reading-dflash")
    info.update(data_seconds=round(data_s), config=asdict(cfg), all_steps=info["steps"] == args.steps,
                wrote=str(path))
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--eagle3", action="store_true", help="train reading-eagle3.gguf")
    which.add_argument("--dflash", action="store_true", help="train reading-dflash.gguf")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=60.0,
                    help="wall-clock cap for the training (a run stopped by it is not reproducible by --seed alone)")
    ap.add_argument("--out", default=str(MODELS), help="where the reading target is and the draft goes")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: EAGLE3 3000, DFlash 2000)")
    ap.add_argument("--batch", type=int, default=8, help="sequences a batch")
    ap.add_argument("--seq", type=int, default=112, help="rows of a corpus window (and the most of a sequence)")
    ap.add_argument("--reading-seqs", type=int, default=1200, help="reading sequences, each its own picture")
    ap.add_argument("--picture-seqs", type=int, default=240, help="other pictures (then corpus text), one a sequence")
    ap.add_argument("--image-share", type=float, default=0.75, help="share of a batch's sequences after a picture")
    ap.add_argument("--gen-len", type=int, default=96, help="the target's greedy tokens after each prompt")
    ap.add_argument("--prompt-len", type=int, default=48, help="corpus tokens after another picture")
    ap.add_argument("--anchors", type=int, default=48, help="EAGLE3: chains trained per sequence")
    ap.add_argument("--blocks", type=int, default=16, help="DFlash: blocks trained per sequence")
    args = ap.parse_args(argv)
    if args.steps is None:
        args.steps = 3000 if args.eagle3 else 2000

    import torch

    torch.set_num_threads(max(1, args.threads))
    t_all = time.time()

    def log(msg):
        print(f"[{time.time() - t_all:6.0f}s] {msg}", flush=True)

    train_files, held_files = T.corpus_files()
    corpus, held = RW.corpus_bytes(train_files), RW.corpus_bytes(held_files)
    lines = RW.code_lines(corpus)
    target, _, _ = Q.load(Path(args.out) / R.MODEL_FILES["target"])
    for p in target.parameters():
        p.requires_grad_(False)
    info = (eagle3_main if args.eagle3 else dflash_main)(args, target, corpus, held, lines, log)
    log(json.dumps(dict(info, seed=args.seed, args=vars(args), torch=torch.__version__,
                        threads=torch.get_num_threads(), total_s=round(time.time() - t_all))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
