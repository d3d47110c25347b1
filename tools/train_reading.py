#!/usr/bin/env python3
"""Train the reading world: a tiny qwen35 target with its MTP head that reads a picture of text out
loud, and the qwen3vl-style projector it reads through (``pyllama_spec.devtools.reading``).

Not part of the installed package: PyTorch (CPU) is used here for training only.

    pip install torch==2.13.0
    python tools/train_reading.py --seed 0 --out pyllama_spec/models

    python tools/train_reading.py --draft-vlm --seed 0 --out pyllama_spec/models

The first writes ``reading-qwen35-mtp.gguf`` (target + MTP head) and ``reading-mmproj.gguf``, the
second ``reading-draft-vlm.gguf`` and ``reading-draft-vlm-mmproj.gguf``; pyllama_spec/models/README.md
("Reading world") says what they are and what they measured.

The world: ``reading.render(text)`` draws one line of up to 16 characters, one character to a 28 x 28
cell, which is exactly one projector row (2 x 2 merged patches of 14 pixels); after
``reading.PROMPT`` the target writes the line, a newline, and goes on with code. The read-out
cannot be guessed from the prompt, so a draft that sees the picture can predict it and a blind one
cannot. Training strings are of four kinds: lines of the training corpus (stdlib sources, the
held-out files as train_tiny_pair.py splits them), snake_case identifiers, numbers, and random
printable characters; the picture varies ink and ground colours, glyph height and a one-pixel offset.

Projector (``qwen3vl_merger``, as Qwen3.5's mmproj files are; ``ReadingProjector`` mirrors what
libmtmd computes, operation for operation): pixels normalised (x / 255 - 0.5) / 0.5; a 14 x 14
patch convolution (the temporal conv's two frames each hold half the weight, and an image is both
frames) plus its bias; the learned position embeddings are zero (the target has M-RoPE positions);
one vision block whose output projections are zero (its attention and FFN add nothing: the block is
the identity, so the PyTorch side needs no vision rope); the post layer norm; then the 2 x 2 merger
MLP (GELU) to the target's width. Trained end to end with the target, with an auxiliary loss that
each cell's row, through the target's output head, names its character (a space for an empty
cell): without it neither side moves first (a row the target never attends to gets no gradient).

Target: starts from ``trained-qwen35-mtp.gguf`` (its corpus training) and keeps its shapes, with
two changes: no tokenizer merges (one byte, one token, so token k of a read-out is cell k), and rope
frequency base 20 (with 8 rotation pairs, a base of 10000 turns the two pairs that carry the image's
column position by 0.1 and 0.003 radians a column: too little to tell neighbouring cells apart;
at 20 they turn by 0.47 and 0.15). Batches are reading sequences (the read-out and the text after
it scored, the read-out once more), plain corpus windows, so that it still writes code, and other
pictures (``other_pictures``: flat colours, gradients, noise, ...) followed by code, so that it and
its drafts hold after a picture that is not for reading.

MTP head: starts from the committed head and is trained as train_qwen35_mtp.py trains it (the
target frozen), on reading sequences whose read-out rows weigh more, other pictures and corpus
windows; in half of the batches with a picture its rows are hidden from the head (a drafter that
leaves media rows out of its cache).

Draft VLM (``--draft-vlm``, after the target): a small hunyuan_vl of the same vocabulary with its own
projector of the same kind, distilled from the target on the same batches (``DRAFT_VLM``).

Parity with llama.cpp and the read-out accuracy: tests/test_reading_world.py.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

TOOLS = Path(__file__).resolve().parent
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

import train_qwen35_mtp as Q  # noqa: E402
import train_tiny_pair as T  # noqa: E402
from train_tiny_pair import N_EMBD, rms_norm  # noqa: E402

from pyllama_spec.devtools import reading as R  # noqa: E402
from pyllama_spec.gguf.writer import GGUFWriter, ValueType  # noqa: E402

ROPE_BASE = 20.0
VISION_WIDTH = 48       # the vision tower's width (patch embedding, the identity block, the post norm)
PATCH = 14
N_CELLS = R.COLUMNS     # projector rows of a picture
SPACE = ord(" ")


def _torch():
    import torch

    return torch


# ----------------------------------------------------------------------------- strings and corpus

def corpus_bytes(files: list[str]) -> np.ndarray:
    """The files' bytes (each followed by a blank line) as token ids: one byte, one token."""
    return np.frombuffer(b"".join(Path(f).read_bytes() + b"\n\n" for f in files), np.uint8).astype(np.int64)


def code_lines(corpus: np.ndarray) -> list[tuple[str, int]]:
    """(line, offset of the byte after it) for each corpus line that the world can draw: stripped,
    3..COLUMNS printable ASCII characters, no double space."""
    data = corpus.astype(np.uint8).tobytes()
    out, start = [], 0
    while True:
        end = data.find(b"\n", start)
        if end < 0:
            return out
        s = data[start:end].strip()
        if 3 <= len(s) <= R.COLUMNS and all(32 <= c < 127 for c in s) and b"  " not in s:
            out.append((s.decode("ascii"), end + 1))
        start = end + 1


_LOWER = "abcdefghijklmnopqrstuvwxyz"


def draw_string(rng: np.random.Generator, lines: list[tuple[str, int]]) -> tuple[str, int | None]:
    """A string to draw and, for a corpus line, where the text after it starts: a code line, a
    snake_case identifier, a number, or random printable characters (a quarter each; without corpus
    lines, a third each of the others)."""
    kind = int(rng.integers(4)) if lines else int(rng.integers(1, 4))
    if kind == 0:
        return lines[int(rng.integers(len(lines)))]
    if kind == 1:
        words: list[str] = []
        while True:
            w = "".join(rng.choice(list(_LOWER), size=int(rng.integers(2, 8))))
            if len("_".join(words + [w])) > R.COLUMNS:
                break
            words.append(w)
            if rng.random() < 0.4:
                break
        return "_".join(words) or "x", None
    if kind == 2:
        n = int(rng.integers(1, R.COLUMNS + 1))
        s = "".join(rng.choice(list("0123456789"), size=n))
        if n > 3 and rng.random() < 0.3:
            i = int(rng.integers(1, n - 1))
            s = s[:i] + "." + s[i + 1:]
        return s, None
    n = int(rng.integers(1, R.COLUMNS + 1))
    chars = list(R.CHARSET[1:])  # no space: a random string starts and ends with a character
    return "".join(rng.choice(chars, size=n)), None


def held_out_strings(n: int, seed: int = 10_000) -> list[str]:
    """n strings for evaluation: held-out corpus lines and identifiers, numbers and random characters
    drawn as training draws them from another seed; none is a training corpus line (a short drawn one,
    a two-digit number, say, may also have been drawn in training)."""
    train_files, held_files = T.corpus_files()
    seen = {s for s, _ in code_lines(corpus_bytes(train_files))}
    lines = [ln for ln in code_lines(corpus_bytes(held_files)) if ln[0] not in seen]
    rng = np.random.default_rng(seed)
    out: list[str] = []
    while len(out) < n:
        s, _ = draw_string(rng, lines)
        if s not in seen and s not in out:
            out.append(s)
    return out


# ----------------------------------------------------------------------------- the projector

def make_projector(seed: int, n_out: int = N_EMBD):
    """A ReadingProjector with rows ``n_out`` wide (the target's width; the draft VLM's for its own)."""
    torch = _torch()
    nn = torch.nn
    F = nn.functional
    g = torch.Generator().manual_seed(seed)
    d, merged = VISION_WIDTH, 4 * VISION_WIDTH

    class ReadingProjector(nn.Module):
        """libmtmd's qwen3vl graph for this projector (module docstring): uint8 [B, H, W, 3] pictures
        (H, W multiples of 28) -> rows [B, H / 28 * W / 28, n_embd], in libmtmd's row order."""

        def __init__(self):
            super().__init__()
            self.patch = nn.Parameter(torch.randn(d, 3 * PATCH * PATCH, generator=g) * 0.02)
            self.patch_bias = nn.Parameter(torch.zeros(d))
            self.post_ln_w = nn.Parameter(torch.ones(d))
            self.post_ln_b = nn.Parameter(torch.zeros(d))
            self.mm0 = nn.Parameter(torch.randn(merged, merged, generator=g) / math.sqrt(merged))
            self.mm0_b = nn.Parameter(torch.zeros(merged))
            self.mm2 = nn.Parameter(torch.randn(n_out, merged, generator=g) / math.sqrt(merged))
            self.mm2_b = nn.Parameter(torch.zeros(n_out))

        def forward(self, img):
            x = (img.to(torch.float32) / 255.0 - 0.5) / 0.5
            B, H, W = x.shape[:3]
            ny, nx = H // PATCH, W // PATCH
            p = x.permute(0, 3, 1, 2).unfold(2, PATCH, PATCH).unfold(3, PATCH, PATCH)  # [B, 3, ny, nx, P, P]
            p = p.permute(0, 2, 3, 1, 4, 5).reshape(B, ny, nx, 3 * PATCH * PATCH)
            e = F.layer_norm(F.linear(p, self.patch, self.patch_bias), (d,), self.post_ln_w, self.post_ln_b, T.EPS)
            # 2 x 2 merge, libmtmd's order: merged rows by (y pair, x pair), inside one (y0x0, y0x1, y1x0, y1x1)
            e = e.reshape(B, ny // 2, 2, nx // 2, 2, d).permute(0, 1, 3, 2, 4, 5).reshape(B, -1, merged)
            return F.linear(F.gelu(F.linear(e, self.mm0, self.mm0_b), approximate="tanh"), self.mm2, self.mm2_b)

    return ReadingProjector()


def write_mmproj(path, proj, name: str = "reading-mmproj") -> Path:
    """The projector as libmtmd loads it (``qwen3vl_merger``; see the module docstring)."""
    p = {k: T._np(v) for k, v in proj.state_dict().items()}
    d, merged = VISION_WIDTH, 4 * VISION_WIDTH
    w = GGUFWriter()
    w.add_string("general.architecture", "clip")
    w.add_string("general.name", name)
    w.add_string("clip.projector_type", "qwen3vl_merger")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.use_gelu", True)
    for key, value in (("embedding_length", d), ("feed_forward_length", d), ("block_count", 1),
                       ("attention.head_count", 2)):
        w.add_uint32(f"clip.vision.{key}", value)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", T.EPS)
    for key, value in (("projection_dim", p["mm2"].shape[0]), ("image_size", 448), ("patch_size", PATCH),
                       ("spatial_merge_size", 2)):
        w.add_uint32(f"clip.vision.{key}", value)
    w.add_array("clip.vision.image_mean", ValueType.FLOAT32, [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", ValueType.FLOAT32, [0.5, 0.5, 0.5])
    w.add_array("clip.vision.is_deepstack_layers", ValueType.BOOL, [False])
    half = (p["patch"].reshape(d, 3, PATCH, PATCH) / 2).astype(np.float32)  # both frames: the sum is the weight
    w.add_tensor("v.patch_embd.weight", half)
    w.add_tensor("v.patch_embd.weight.1", half.copy())
    w.add_tensor("v.patch_embd.bias", p["patch_bias"])
    w.add_tensor("v.position_embd.weight", np.zeros((32 * 32, d), np.float32))
    zero = np.zeros
    b = "v.blk.0"  # the identity: its attention and FFN outputs are zero
    for ln in ("ln1", "ln2"):
        w.add_tensor(f"{b}.{ln}.weight", np.ones(d, np.float32))
        w.add_tensor(f"{b}.{ln}.bias", zero(d, np.float32))
    w.add_tensor(f"{b}.attn_qkv.weight", zero((3 * d, d), np.float32))
    w.add_tensor(f"{b}.attn_qkv.bias", zero(3 * d, np.float32))
    w.add_tensor(f"{b}.attn_out.weight", zero((d, d), np.float32))
    w.add_tensor(f"{b}.attn_out.bias", zero(d, np.float32))
    w.add_tensor(f"{b}.ffn_up.weight", zero((d, d), np.float32))
    w.add_tensor(f"{b}.ffn_up.bias", zero(d, np.float32))
    w.add_tensor(f"{b}.ffn_down.weight", zero((d, d), np.float32))
    w.add_tensor(f"{b}.ffn_down.bias", zero(d, np.float32))
    w.add_tensor("v.post_ln.weight", p["post_ln_w"])
    w.add_tensor("v.post_ln.bias", p["post_ln_b"])
    w.add_tensor("mm.0.weight", p["mm0"])
    w.add_tensor("mm.0.bias", p["mm0_b"])
    w.add_tensor("mm.2.weight", p["mm2"])
    w.add_tensor("mm.2.bias", p["mm2_b"])
    path = Path(path)
    w.write(path)
    return path


def load_projector(path):
    """A ReadingProjector holding a reading-mmproj.gguf's weights."""
    torch = _torch()
    _, tt = T.read_gguf_tensors(path)
    proj = make_projector(0, n_out=tt["mm.2.weight"].shape[0])
    d = VISION_WIDTH
    state = dict(patch=(tt["v.patch_embd.weight"] + tt["v.patch_embd.weight.1"]).reshape(d, -1),
                 patch_bias=tt["v.patch_embd.bias"], post_ln_w=tt["v.post_ln.weight"],
                 post_ln_b=tt["v.post_ln.bias"], mm0=tt["mm.0.weight"], mm0_b=tt["mm.0.bias"],
                 mm2=tt["mm.2.weight"], mm2_b=tt["mm.2.bias"])
    proj.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()})
    return proj.eval()


# ----------------------------------------------------------------------------- the prompt's layout

class Layout:
    """Where a prompt's parts sit, as libmtmd lays out ``prompt`` with a picture of ``shape`` (height,
    width): text tokens before the picture, the picture's rows and their M-RoPE positions (t, h, w,
    e), the text after it. For ``reading.PROMPT`` (the default) the read-out follows at the next row."""

    def __init__(self, model_gguf, mmproj_gguf, prompt: str = R.PROMPT, shape=(R.CELL, R.CELL * R.COLUMNS)):
        from pyllama_spec.bindings.model import Model
        from pyllama_spec.bindings.mtmd import Bitmap, Projector

        with Model(model_gguf) as m, Projector(mmproj_gguf, m, n_threads=1) as proj:
            chunks = proj.tokenize(prompt, [Bitmap(np.zeros((*shape, 3), np.uint8))])
            self.pre = np.asarray(chunks[0].tokens, np.int64)
            media = chunks[1]
            self.image_pos = media.decoder_positions(len(self.pre))[:, [0, 2, 1, 3]].astype(np.int64)
            self.n_pos = int(media.n_pos)
            self.post = np.asarray(chunks[2].tokens, np.int64) if len(chunks) > 2 else np.zeros(0, np.int64)
        self.n_img = len(self.image_pos)
        if prompt == R.PROMPT and self.n_img != N_CELLS:
            raise SystemExit(f"a picture is {self.n_img} rows, expected {N_CELLS}")
        self.first_text = len(self.pre) + self.n_img  # row index of the first token after the picture
        self.readout = self.first_text + len(self.post)  # row index of the first read-out token

    def positions(self, n_rows: int) -> np.ndarray:
        """[n_rows, 4] M-RoPE positions of a prompt + what follows it, n_rows rows in all."""
        n_after = n_rows - self.first_text
        return np.concatenate([T._text_positions(0, len(self.pre)), self.image_pos,
                               T._text_positions(len(self.pre) + self.n_pos, n_after)])


def other_pictures(n: int, seed: int) -> list[np.ndarray]:
    """n pictures that are not text (train_tiny_pair.image_pool's kinds: flat colours, gradients,
    noise, checkerboards, rectangles), cut to whole 28-pixel cells (the PyTorch projector takes no
    resize) and to at most 448 a side (256 rows): the reading world's drafts and target also see
    pictures that are not for reading, so that they hold after any picture."""
    out = []
    for img in T.image_pool(n, seed):
        h, w = (min(448, v // 28 * 28) for v in img.shape[:2])
        out.append(np.ascontiguousarray(img[:h, :w]))
    return out


def picture_layouts(model_gguf, mmproj_gguf, pictures) -> dict[tuple, Layout]:
    """The layout of ``<__media__>\n`` + text for each picture's shape."""
    return {shape: Layout(model_gguf, mmproj_gguf, "<__media__>\n", shape)
            for shape in sorted({p.shape[:2] for p in pictures})}


def picture_batch(rng, pictures, layouts, corpus: np.ndarray, batch: int, tail: int):
    """[one of ``pictures``, then corpus text]: the picture uint8 [1, H, W, 3], tokens [B, n + 1] (-1 on
    image rows), positions [n, 4] and the layout; one picture a batch, so that rows line up."""
    torch = _torch()
    picture = pictures[int(rng.integers(len(pictures)))]
    layout = layouts[picture.shape[:2]]
    head = np.concatenate([layout.pre, np.full(layout.n_img, -1), layout.post])
    rows = []
    for _ in range(batch):
        s = int(rng.integers(0, len(corpus) - tail - 1))
        rows.append(np.concatenate([head, corpus[s:s + tail + 1]]))
    x = torch.from_numpy(np.stack(rows))
    return torch.from_numpy(picture[None]), x, torch.from_numpy(layout.positions(x.shape[1] - 1)), layout


def reading_batch(rng, layout: Layout, lines, corpus: np.ndarray, batch: int, tail: int):
    """Pictures uint8 [B, 28, 448, 3]; tokens [B, n + 1] (-1 on image rows): prompt, read-out, "\\n",
    then the corpus text after the line (a random line's for the other kinds), ``tail`` tokens after
    the prompt in all; positions [n, 4]; read-out lengths (with the newline); each cell's character."""
    torch = _torch()
    head = np.concatenate([layout.pre, np.full(N_CELLS, -1), layout.post])
    rows, pictures, lens, cells = [], [], [], np.full((batch, N_CELLS), SPACE, np.int64)
    for i in range(batch):
        s, after = draw_string(rng, lines)
        if after is None:
            after = lines[int(rng.integers(len(lines)))][1]
        after = min(after, len(corpus) - tail - 1)  # a line near the corpus's end: text from a little earlier
        read = np.frombuffer(s.encode("ascii"), np.uint8).astype(np.int64)
        cells[i, :len(read)] = read
        text = np.concatenate([read, [10], corpus[after:after + tail]])[:tail + 1]
        rows.append(np.concatenate([head, text]))
        pictures.append(R.render_varied(s, rng))
        lens.append(len(read) + 1)
    x = torch.from_numpy(np.stack(rows))
    pos = torch.from_numpy(layout.positions(x.shape[1] - 1))
    return (torch.from_numpy(np.stack(pictures)), x, pos, lens, torch.from_numpy(cells))


def _image_rows(layout: Layout, rows, n: int):
    """[B, n, width] embeddings: the picture's rows ([B or 1, n_img, width]) in place, zeros elsewhere."""
    torch = _torch()
    embd = torch.zeros(rows.shape[0], n, rows.shape[-1])
    embd[:, len(layout.pre):len(layout.pre) + layout.n_img] = rows
    return embd


def picture_text_loss(model, proj, batch):
    """Next-token loss of ``model`` on the text after one of the other pictures (picture_batch), as
    train_tiny_pair scores its [picture, text] batches."""
    picture, x, pos, layout = batch
    return T._image_text_loss(model, x, pos, _image_rows(layout, proj(picture), x.shape[1] - 1)[0])


def reading_losses(target, proj, layout: Layout, batch):
    """(loss, stats) of target and projector on one reading batch: next-token loss on the text after
    the picture, plus the read-out's once more, plus the cells' own characters (module docstring)."""
    torch = _torch()
    F = torch.nn.functional
    pictures, x, pos, lens, cells = batch
    B, n = x.shape[0], x.shape[1] - 1
    rows = proj(pictures)
    aux = F.cross_entropy(F.linear(rms_norm(rows, target.output_norm), target.output).reshape(-1, T.N_VOCAB),
                          cells.reshape(-1))
    logits, _ = target(x[:, :-1], pos[None].expand(B, n, 4), embd=_image_rows(layout, rows, n))
    labels = x[:, 1:].masked_fill(x[:, 1:] < 0, -100)
    r0 = layout.readout - 1  # the row whose logits give the first read-out token
    read = torch.full_like(labels, -100)
    for i, k in enumerate(lens):
        read[i, r0:r0 + k] = labels[i, r0:r0 + k]
    flat = logits.reshape(-1, T.N_VOCAB)
    text = F.cross_entropy(flat, labels.reshape(-1), ignore_index=-100)
    readout = F.cross_entropy(flat, read.reshape(-1), ignore_index=-100)
    with torch.no_grad():
        ok = (logits.argmax(-1) == labels) & (read >= 0)
        acc = float(ok.sum() / (read >= 0).sum())
    return text + readout + aux, dict(text=float(text), readout=float(readout), aux=float(aux), acc=acc)


def _apply(opt, loss, params) -> None:
    """One optimiser step on ``loss``, gradients clipped to norm 1."""
    opt.zero_grad()
    loss.backward()
    _torch().nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


def train_reader(target, proj, layout, lines, corpus, others, *, steps, seconds, batch, tail, text_share,
                 picture_share, text_seq, seed, log):
    """Target and projector: reading batches; corpus windows (``text_share``); [another picture, corpus
    text] batches (``picture_share``; ``others`` = (pictures, their layouts))."""
    torch = _torch()
    F = torch.nn.functional
    rng = np.random.default_rng(seed + 7)
    params = list(target.parameters()) + list(proj.parameters())
    peaks = [3e-3, 2e-3]  # projector, target
    opt = torch.optim.AdamW([dict(params=list(proj.parameters()), lr=peaks[0]),
                             dict(params=list(target.parameters()), lr=peaks[1])], betas=(0.9, 0.95),
                            weight_decay=0.01)
    t0, hist, step = time.time(), [], 0
    for step in range(steps):
        if time.time() - t0 > seconds:
            log(f"reader: time budget reached at step {step}")
            break
        for g, peak in zip(opt.param_groups, peaks):
            g["lr"] = T._lr(step, steps, peak)
        u = rng.random()
        if u < text_share:
            x = T._batch(rng, corpus, 4, text_seq + 1)
            logits, _ = target(x[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, T.N_VOCAB), x[:, 1:].reshape(-1))
        elif u < text_share + picture_share:
            loss = picture_text_loss(target, proj, picture_batch(rng, *others, corpus, 4, tail))
        else:
            loss, st = reading_losses(target, proj, layout, reading_batch(rng, layout, lines, corpus, batch, tail))
            hist.append([st["text"], st["readout"], st["aux"], st["acc"]])
        _apply(opt, loss, params)
        if step % 100 == 0 and hist:
            a = np.mean(hist[-50:], 0)
            log(f"reader step {step}: text {a[0]:.3f} read-out {a[1]:.3f} cells {a[2]:.3f} "
                f"read-out accuracy {a[3]:.3f} ({time.time() - t0:.0f}s)")
    a = np.mean(hist[-50:], 0)
    return dict(steps=step + 1, seconds=round(time.time() - t0, 1), train_text_loss=round(float(a[0]), 3),
                train_readout_loss=round(float(a[1]), 3), train_readout_accuracy=round(float(a[3]), 3))


def eval_after_pictures(model, proj, others, corpus, seed, n=16):
    """Held out: next-token loss on corpus text after other pictures (one a batch of 4)."""
    torch = _torch()
    rng = np.random.default_rng(seed + 109)
    with torch.no_grad():
        return round(float(np.mean([float(picture_text_loss(model, proj, picture_batch(rng, *others, corpus, 4, 96)))
                                    for _ in range(n)])), 3)


def eval_reader(target, proj, layout, lines, corpus, seed, n=8, batch=16):
    """Held out, teacher-forced: text loss after the picture and read-out accuracy."""
    torch = _torch()
    rng = np.random.default_rng(seed + 101)
    rows = []
    with torch.no_grad():
        for _ in range(n):
            _, st = reading_losses(target, proj, layout, reading_batch(rng, layout, lines, corpus, batch, 96))
            rows.append([st["text"], st["acc"]])
    a = np.mean(rows, 0)
    return dict(text_loss=round(float(a[0]), 3), readout_accuracy=round(float(a[1]), 3))


# ----------------------------------------------------------------------------- the MTP head

def head_batch(rng, target, proj, layout, lines, corpus, batch, tail, image_share, text_seq, others=None,
               picture_share=0.0):
    """One head batch for Q.mtp_losses: tokens [B, T + 1] (-1 on image rows), positions [B, T, 4],
    image rows [B, T, n_embd] or None, whether the picture's rows are hidden from the head, and the
    rows whose label is a read-out token (bool [B, T], or None for another batch): a reading batch
    (``image_share``), [another picture, corpus text] (``picture_share``), else corpus windows."""
    torch = _torch()
    u = rng.random()
    if others is not None and u < picture_share:
        picture, x, pos, lay = picture_batch(rng, *others, corpus, batch, tail)
        n = x.shape[1] - 1
        with torch.no_grad():
            embd = _image_rows(lay, proj(picture), n).expand(batch, n, -1)
        return x, pos[None].expand(batch, n, 4), embd, bool(rng.random() < 0.5), None
    if u < picture_share + image_share:
        pictures, x, pos, lens, _ = reading_batch(rng, layout, lines, corpus, batch, tail)
        n = x.shape[1] - 1
        with torch.no_grad():
            embd = _image_rows(layout, proj(pictures), n)
        read = torch.zeros(batch, n, dtype=torch.bool)
        for i, k in enumerate(lens):
            read[i, layout.readout - 1:layout.readout - 1 + k] = True
        return x, pos[None].expand(batch, n, 4), embd, bool(rng.random() < 0.5), read
    x = T._batch(rng, corpus, batch, text_seq + 1)
    return x, Q._default_pos(x[:, :-1], None), None, False, None


def train_head(target, head, proj, layout, lines, corpus, others, *, steps, seconds, batch, tail, image_share,
               picture_share, text_seq, read_weight, seed, log):
    """The head on reading batches and corpus windows, the target frozen; a read-out row's loss
    counts ``read_weight`` times (a dozen rows of a hundred: unweighted, the head learns the text
    around them and never reads)."""
    torch = _torch()
    for p in list(target.parameters()) + list(proj.parameters()):
        p.requires_grad_(False)
    rng = np.random.default_rng(seed + 61)
    opt = torch.optim.AdamW(head.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.01)
    t0, hist, step = time.time(), [], 0
    for step in range(steps):
        if time.time() - t0 > seconds:
            log(f"mtp: time budget reached at step {step}")
            break
        for g in opt.param_groups:
            g["lr"] = T._lr(step, steps, 2e-3)
        x, pos, embd, hide, read = head_batch(rng, target, proj, layout, lines, corpus, batch, tail, image_share,
                                              text_seq, others, picture_share)
        weight = None if read is None else 1.0 + (read_weight - 1.0) * read.float()
        loss, st = Q.mtp_losses(target, head, x, pos, embd, hide, row_weight=weight)
        _apply(opt, loss, list(head.parameters()))
        hist.append([float(loss), st["agree"], st["agree_chained"]])
        if step % 100 == 0:
            a = np.mean(hist[-50:], 0)
            log(f"mtp step {step}: loss {a[0]:.3f} agree {a[1]:.2f} chained {a[2]:.2f} ({time.time() - t0:.0f}s)")
    return dict(steps=step + 1, seconds=round(time.time() - t0, 1),
                train_loss=round(float(np.mean([h[0] for h in hist[-50:]])), 3))


def eval_head(target, head, proj, layout, lines, corpus, seed, *, hide, n=8, batch=8):
    """Held out: the head's agreement with the target's greedy choice on the read-out rows (first
    and chained step), the picture's rows in its cache or hidden from it."""
    torch = _torch()
    rng = np.random.default_rng(seed + 103)
    rows = []
    with torch.no_grad():
        for _ in range(n):
            x, pos, embd, _, read = head_batch(rng, target, proj, layout, lines, corpus, batch, 24, 1.0, 0)
            _, st = Q.mtp_losses(target, head, x, pos, embd, hide, row_weight=read.float())
            rows.append([st["agree"], st["agree_chained"]])
    a = np.mean(rows, 0)
    return dict(agree=round(float(a[0]), 3), agree_chained=round(float(a[1]), 3))


# ----------------------------------------------------------------------------- the draft VLM

#: A narrower hunyuan_vl of the same vocabulary (the shapes of trained-draft-vlm.gguf, which it starts
#: from). Its M-RoPE sections are contiguous, so the column's pairs are the slowest: sections [1, 1, 6, 0]
#: (llama.cpp takes a file as M-RoPE only when the first two are positive) give the column six pairs
#: from the third on, and the rope base of 20 turns the fastest of them by 0.47 radians a column, as
#: the target's base does its own.
DRAFT_VLM = dict(target_n_layer=2, target_n_ff=192, n_embd=48, n_head=3, n_head_kv=1, rope_sections=(1, 1, 6, 0),
                 rope_base=ROPE_BASE, merges=False)


def distill_losses(student, s_proj, teacher, t_proj, layout, batch):
    """(loss, stats) of the draft VLM on one reading batch: KL(teacher || student) of the next-token
    distribution on the text after the picture (each through its own projector), the read-out's once
    more, plus its cells' own characters through its output head (as the target's were trained)."""
    torch = _torch()
    F = torch.nn.functional
    pictures, x, pos, lens, cells = batch
    B, n = x.shape[0], x.shape[1] - 1
    p = pos[None].expand(B, n, 4)
    with torch.no_grad():
        t_logits, _ = teacher(x[:, :-1], p, embd=_image_rows(layout, t_proj(pictures), n))
    rows = s_proj(pictures)
    aux = F.cross_entropy(F.linear(rms_norm(rows, student.output_norm), student.output).reshape(-1, T.N_VOCAB),
                          cells.reshape(-1))
    s_logits, _ = student(x[:, :-1], p, embd=_image_rows(layout, rows, n))
    text = x[:, 1:] >= 0
    r0 = layout.readout - 1
    read = torch.zeros_like(text)
    for i, k in enumerate(lens):
        read[i, r0:r0 + k] = True
    t_logp, s_logp = F.log_softmax(t_logits, -1), F.log_softmax(s_logits, -1)
    row_kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1)
    kl = row_kl[text].mean()
    agree = (t_logits.argmax(-1) == s_logits.argmax(-1))
    return kl + row_kl[read].mean() + aux, dict(kl=float(kl), aux=float(aux), agree_read=float(agree[read].float().mean()),
                          agree_after=float(agree[text & ~read].float().mean()))


def picture_distill_loss(student, s_proj, teacher, t_proj, batch):
    """KL(teacher || student) on the text after one of the other pictures, each through its projector."""
    torch = _torch()
    F = torch.nn.functional
    picture, x, pos, layout = batch
    B, n = x.shape[0], x.shape[1] - 1
    p = pos[None].expand(B, n, 4)
    with torch.no_grad():
        t_logits, _ = teacher(x[:, :-1], p, embd=_image_rows(layout, t_proj(picture), n).expand(B, n, -1))
    s_logits, _ = student(x[:, :-1], p, embd=_image_rows(layout, s_proj(picture), n).expand(B, n, -1))
    text = x[:, 1:] >= 0
    t_logp, s_logp = F.log_softmax(t_logits[text], -1), F.log_softmax(s_logits[text], -1)
    return (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()


def train_draft_vlm(student, s_proj, teacher, t_proj, layout, lines, corpus, others, *, steps, seconds, batch, tail,
                    text_share, picture_share, text_seq, seed, log):
    torch = _torch()
    F = torch.nn.functional
    for p in list(teacher.parameters()) + list(t_proj.parameters()):
        p.requires_grad_(False)
    rng = np.random.default_rng(seed + 17)
    params = list(student.parameters()) + list(s_proj.parameters())
    peaks = [3e-3, 2e-3]
    opt = torch.optim.AdamW([dict(params=list(s_proj.parameters()), lr=peaks[0]),
                             dict(params=list(student.parameters()), lr=peaks[1])], betas=(0.9, 0.95),
                            weight_decay=0.01)
    t0, hist, step = time.time(), [], 0
    for step in range(steps):
        if time.time() - t0 > seconds:
            log(f"draft VLM: time budget reached at step {step}")
            break
        for g, peak in zip(opt.param_groups, peaks):
            g["lr"] = T._lr(step, steps, peak)
        u = rng.random()
        if u < picture_share:
            loss = picture_distill_loss(student, s_proj, teacher, t_proj, picture_batch(rng, *others, corpus, 4, tail))
        elif u < picture_share + text_share:
            x = T._batch(rng, corpus, 4, text_seq + 1)
            with torch.no_grad():
                t_logits, _ = teacher(x[:, :-1])
            s_logits, _ = student(x[:, :-1])
            t_logp, s_logp = F.log_softmax(t_logits, -1), F.log_softmax(s_logits, -1)
            loss = (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()
        else:
            loss, st = distill_losses(student, s_proj, teacher, t_proj, layout,
                                      reading_batch(rng, layout, lines, corpus, batch, tail))
            hist.append([st["kl"], st["aux"], st["agree_read"], st["agree_after"]])
        _apply(opt, loss, params)
        if step % 100 == 0 and hist:
            a = np.mean(hist[-50:], 0)
            log(f"draft VLM step {step}: KL {a[0]:.3f} cells {a[1]:.3f} agreement on the read-out {a[2]:.3f}, "
                f"after it {a[3]:.3f} ({time.time() - t0:.0f}s)")
    a = np.mean(hist[-50:], 0)
    return dict(steps=step + 1, seconds=round(time.time() - t0, 1), train_kl=round(float(a[0]), 3),
                train_agree_readout=round(float(a[2]), 3), train_agree_after=round(float(a[3]), 3))


def eval_draft_vlm(student, s_proj, teacher, t_proj, layout, lines, corpus, seed, n=8, batch=16):
    """Held out: KL and argmax agreement with the target on the read-out and after it."""
    torch = _torch()
    rng = np.random.default_rng(seed + 107)
    rows = []
    with torch.no_grad():
        for _ in range(n):
            _, st = distill_losses(student, s_proj, teacher, t_proj, layout,
                                   reading_batch(rng, layout, lines, corpus, batch, 96))
            rows.append([st["kl"], st["agree_read"], st["agree_after"]])
    a = np.mean(rows, 0)
    return dict(kl=round(float(a[0]), 3), agree_readout=round(float(a[1]), 3), agree_after=round(float(a[2]), 3))


def draft_vlm_main(args, log) -> int:
    """--draft-vlm: train the draft VLM and its projector for the committed reading target."""
    torch = _torch()
    out = Path(args.out)
    target_path = out / R.MODEL_FILES["target"]
    mmproj_path = out / R.MODEL_FILES["mmproj"]
    teacher, _, _ = Q.load(target_path)
    t_proj = load_projector(mmproj_path)
    layout = Layout(target_path, mmproj_path)
    pics, held_pics = other_pictures(args.pictures, args.seed), other_pictures(16, args.seed + 1000)
    others = (pics, picture_layouts(target_path, mmproj_path, pics))
    held_others = (held_pics, picture_layouts(target_path, mmproj_path, held_pics))
    train_files, held_files = T.corpus_files()
    corpus, held = corpus_bytes(train_files), corpus_bytes(held_files)
    lines, held_lines = code_lines(corpus), code_lines(held)
    start, _, _ = T.load_pair(args.draft_vlm_from)
    cfg = T.PairConfig(**DRAFT_VLM)
    torch.manual_seed(args.seed + 2)
    student = T.make_target(cfg)
    student.load_state_dict(start.state_dict())
    s_proj = make_projector(args.seed + 1, n_out=cfg.n_embd)
    student.train()
    info = train_draft_vlm(student, s_proj, teacher, t_proj, layout, lines, corpus, others,
                           steps=args.draft_vlm_steps, seconds=args.minutes * 60, batch=args.batch, tail=args.tail,
                           text_share=args.text_share, picture_share=args.picture_share, text_seq=args.text_seq,
                           seed=args.seed, log=log)
    student.eval()
    s_proj.eval()
    info["held_out"] = eval_draft_vlm(student, s_proj, teacher, t_proj, layout, held_lines, held, args.seed)
    rng = np.random.default_rng(args.seed + 111)
    with torch.no_grad():
        info["held_out"]["kl_after_other_pictures"] = round(float(np.mean([
            float(picture_distill_loss(student, s_proj, teacher, t_proj, picture_batch(rng, *held_others, held, 4, 96)))
            for _ in range(16)])), 3)
    d_path = T.write_target_gguf(out / R.DRAFT_FILES["draft_vlm"], {k: T._np(v) for k, v in student.state_dict().items()},
                                 cfg, name="reading-draft-vlm")
    p_path = write_mmproj(out / R.DRAFT_FILES["draft_vlm_mmproj"], s_proj, name="reading-draft-vlm-mmproj")
    log(json.dumps(dict(config=asdict(cfg), draft_vlm=info, seed=args.seed, args=vars(args), torch=torch.__version__,
                        threads=torch.get_num_threads(), all_steps=info["steps"] == args.draft_vlm_steps)))
    log(f"wrote {d_path} and {p_path}")
    return 0


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=60.0,
                    help="wall-clock cap for both trainings (a run stopped by it is not reproducible by --seed alone)")
    ap.add_argument("--out", default="pyllama_spec/models")
    ap.add_argument("--start-from", default=str(TOOLS.parent / "pyllama_spec" / "models" / "trained-qwen35-mtp.gguf"),
                    help="the trained qwen35 target and head to start from")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reader-steps", type=int, default=3000)
    ap.add_argument("--mtp-steps", type=int, default=6000)
    ap.add_argument("--batch", type=int, default=8, help="reading sequences a batch")
    ap.add_argument("--tail", type=int, default=64, help="tokens after the prompt (read-out, newline, code)")
    ap.add_argument("--text-share", type=float, default=0.2, help="share of batches that are corpus windows")
    ap.add_argument("--picture-share", type=float, default=0.15,
                    help="share of batches that are another picture (not text) then corpus text")
    ap.add_argument("--pictures", type=int, default=48, help="other pictures to train with (other_pictures)")
    ap.add_argument("--text-seq", type=int, default=256)
    ap.add_argument("--mtp-image-share", type=float, default=0.8, help="share of the head's batches that are reading")
    ap.add_argument("--mtp-picture-share", type=float, default=0.1,
                    help="share of the head's batches that are another picture (not text) then corpus text")
    ap.add_argument("--mtp-tail", type=int, default=32, help="tokens after the prompt in the head's reading batches")
    ap.add_argument("--mtp-read-weight", type=float, default=20.0, help="weight of a read-out row in the head's loss")
    ap.add_argument("--mtp-only", action="store_true",
                    help="train only the head, for the reading target already in --out (for trying head settings: the target read back from its file, whose ssm_a is stored as -exp(a_log), differs in the last bits, so the head differs from a full run's)")
    ap.add_argument("--draft-vlm", action="store_true",
                    help="train the draft VLM and its projector for the reading target already in --out")
    ap.add_argument("--draft-vlm-from", default=str(TOOLS.parent / "pyllama_spec" / "models" / "trained-draft-vlm.gguf"),
                    help="the draft VLM to start from (its shapes are kept)")
    ap.add_argument("--draft-vlm-steps", type=int, default=8000)
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(max(1, args.threads))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.time()

    def log(msg):
        print(f"[{time.time() - t_all:6.0f}s] {msg}", flush=True)

    if args.draft_vlm:
        return draft_vlm_main(args, log)
    train_files, held_files = T.corpus_files()
    corpus, held = corpus_bytes(train_files), corpus_bytes(held_files)
    lines, held_lines = code_lines(corpus), code_lines(held)
    target, head, cfg = Q.load(args.start_from)
    if head is None:
        raise SystemExit(f"{args.start_from} has no MTP head")
    cfg.rope_base, cfg.merges = ROPE_BASE, False
    start = (Q._state(target), Q._state(head))
    torch.manual_seed(args.seed)
    target, head = Q.make_target(cfg), Q.make_mtp(cfg)  # the same weights, under the new rope base
    target.load_state_dict({k: torch.from_numpy(v) for k, v in start[0].items()})
    head.load_state_dict({k: torch.from_numpy(v) for k, v in start[1].items()})
    proj = make_projector(args.seed)
    pics, held_pics = other_pictures(args.pictures, args.seed), other_pictures(16, args.seed + 1000)
    with tempfile.TemporaryDirectory() as tmp:  # the prompts' layouts, as libmtmd makes them
        probe = Q.write_gguf(Path(tmp) / "probe.gguf", start[0], cfg, start[1])
        probe_mmproj = write_mmproj(Path(tmp) / "probe-mmproj.gguf", proj)
        layout = Layout(probe, probe_mmproj)
        others = (pics, picture_layouts(probe, probe_mmproj, pics))
        held_others = (held_pics, picture_layouts(probe, probe_mmproj, held_pics))
    log(f"corpus: {len(train_files)} files / {len(corpus)} bytes, {len(lines)} drawable lines; held out "
        f"{len(held_files)} / {len(held)}, {len(held_lines)} lines; prompt: {len(layout.pre)} + {N_CELLS} image rows "
        f"over {layout.n_pos} positions + {len(layout.post)}")

    budget = args.minutes * 60
    if args.mtp_only:  # the reader as committed in --out
        target, _, _ = Q.load(out / R.MODEL_FILES["target"])
        proj = load_projector(out / R.MODEL_FILES["mmproj"])
        r_info = dict(steps=args.reader_steps, from_file=str(out / R.MODEL_FILES["target"]))
    else:
        target.train()
        r_info = train_reader(target, proj, layout, lines, corpus, others, steps=args.reader_steps,
                              seconds=budget * 0.7, batch=args.batch, tail=args.tail, text_share=args.text_share,
                              picture_share=args.picture_share, text_seq=args.text_seq, seed=args.seed, log=log)
    target.eval()
    proj.eval()
    r_info["held_out"] = eval_reader(target, proj, layout, held_lines, held, args.seed)
    r_info["held_out_text_loss"] = T.eval_target(target, held, args.text_seq, args.seed)
    r_info["held_out_text_loss_after_other_pictures"] = eval_after_pictures(target, proj, held_others, held, args.seed)
    log(f"reader: {r_info}")

    m_info = train_head(target, head, proj, layout, lines, corpus, others, steps=args.mtp_steps,
                        seconds=max(60.0, budget - (time.time() - t_all)), batch=args.batch, tail=args.mtp_tail,
                        image_share=args.mtp_image_share, picture_share=args.mtp_picture_share, text_seq=args.text_seq,
                        read_weight=args.mtp_read_weight,
                        seed=args.seed, log=log)
    head.eval()
    m_info["held_out_readout_rows_in_cache"] = eval_head(target, head, proj, layout, held_lines, held, args.seed,
                                                         hide=False)
    m_info["held_out_readout_rows_hidden"] = eval_head(target, head, proj, layout, held_lines, held, args.seed,
                                                       hide=True)
    log(f"mtp: {m_info}")

    t_path = Q.write_gguf(out / R.MODEL_FILES["target"], Q._state(target), cfg, Q._state(head),
                          name="reading-tiny-qwen35-mtp")
    p_path = write_mmproj(out / R.MODEL_FILES["mmproj"], proj)
    summary = dict(config=asdict(cfg), reader=r_info, mtp=m_info, seed=args.seed, args=vars(args),
                   torch=torch.__version__, threads=torch.get_num_threads(), total_s=round(time.time() - t_all),
                   all_steps=r_info["steps"] == args.reader_steps and m_info["steps"] == args.mtp_steps)
    log(json.dumps(summary))
    log(f"wrote {t_path} and {p_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
