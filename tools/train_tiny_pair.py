#!/usr/bin/env python3
"""Train a tiny M-RoPE target (``hunyuan_vl``) and a DFlash draft for it, and export both to GGUF.

Not part of the installed package: PyTorch (CPU) is used here for training only.

    pip install torch==2.13.0
    python tools/train_tiny_pair.py --seed 0 --out pyllama_spec/models

Two more drafts for that trained target (loaded, not retrained), each run writing its own files
and its section of the models' README.md:

    python tools/train_tiny_pair.py --eagle3 --target-from pyllama_spec/models/trained-target.gguf \
        --seed 0 --minutes 60 --out pyllama_spec/models      # trained-eagle3.gguf
    python tools/train_tiny_pair.py --draft-vlm --target-from pyllama_spec/models/trained-target.gguf \
        --seed 0 --minutes 60 --out pyllama_spec/models      # trained-draft-vlm(-mmproj).gguf

* ``--eagle3``: an EAGLE3 draft (``eagle3``, the graph of src/models/eagle3.cpp: ``make_eagle3``)
  reading target layers (1, 2, 3), trained on the target's greedy continuations and on sequences
  after a picture (every image row's features, laid out as the drafter lays them in each
  ``draft_positions`` mode), with EAGLE-3's training-time test (``eagle3_chain_logits``).
* ``--draft-vlm``: a narrower ``hunyuan_vl`` of the same vocabulary with its own random projector,
  trained on the target's data (text, and pictures through its own projector) to match the target's
  next-token distribution (``train_draft_vlm``).

Corpus: the Python standard library's own top-level sources (``<stdlib>/*.py``, sorted by
name; every 10th file is held out for evaluation), tokenized with the package's tiny
byte-level tokenizer *through llama.cpp* (so training sees exactly the tokens inference sees).

The PyTorch modules below mirror, operation for operation, the graphs the pinned llama.cpp
builds (``src/models/hunyuan-vl.cpp`` and ``src/models/dflash.cpp``):

target (hunyuan_vl, M-RoPE sections [2, 3, 3, 0]; text positions (p, p, p, 0) turn as NeoX rope)
    x = tok_embd[t] (an image row: the projector's embedding); per layer: layer_inp[l] = x;
    h = rms(x) * attn_norm; q, k, v = h Wq, h Wk, h Wv (per head);
    q = rms(rope(q)) * q_norm; k = rms(rope(k)) * k_norm   (rope BEFORE the q/k norms here)
    x = x + Wo attn_causal(q, k, v);  x = x + Wdown(silu(Wgate h') * Wup h'), h' = rms(x) * ffn_norm
    logits = output(rms(x) * output_norm)

draft (dflash, non-causal, sliding window W, temporal-only rope sections [8, 0, 0, 0] == NeoX)
    context rows (injected features f = concat(layer_inp[l] for l in target_layers)):
        g = rms(fc f) * enc.output_norm; per layer K = rope(rms(g Wk) * k_norm), V = g Wv  -> cache
    block rows [id_last, mask x (B - 1)] at positions a .. a + B - 1:
        x = target tok_embd[t]; per layer: h = rms(x) * attn_norm;
        q = rope(rms(h Wq) * q_norm), k = rope(rms(h Wk) * k_norm), v = h Wv   (rope AFTER the norms)
        attention over (cache context rows at positions < a) + (all block rows), key at position c
        visible to a query at position p iff p - c < W;  then FFN as the target; logits through the
        target's output head on rms(x) * output_norm.  Row i >= 1 predicts the token at a + i.

Pictures: the target is trained, like a vision-language model, with a share of its batches
starting with a picture (the tiny random projector's rows at their M-RoPE positions, computed by
llama.cpp's mtmd), so that it reads text after an image as well as without one.

Training objective of the draft (DFlash): anchors a in a sequence; context = target features
at positions < a; labels of block row i = the target's greedy choice at position a + i
(teacher-forced on the corpus text), i.e. distillation from the target.  Half of its sequences
follow a picture; their features come from llama.cpp's target (``generate_image_sequences``) and
the draft holds them as the engine's ``draft_positions`` modes do: "target" (image rows skipped,
positions jump by the image's n_pos) or "sequential" (image rows injected, consecutive
positions).  Block lengths are drawn
from ``BLOCK_LENGTHS`` (the engine decodes [id_last, mask x draft_max], so a shorter block has
fewer non-causal neighbours); the rows of a block and its context are masked exactly as
llama.cpp masks them (``draft_mask``).  Many anchors share one pass over a sequence.

``load_pair`` reads the GGUF files back into these modules (tests/test_trained_pair.py checks
parity with llama.cpp; set ``EMULATE_F16_KV`` there to mimic llama.cpp's F16 KV cache).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pyllama_spec.devtools import tiny  # noqa: E402
from pyllama_spec.gguf.writer import GGUFWriter, ValueType  # noqa: E402

CORPUS_GLOB = "/root/.pyenv/versions/3.11.7/lib/python3.11/*.py"
HELD_OUT_EVERY = 10  # sorted file index % 10 == 0 -> held out

# geometry fixed by the package's tiny writer: 4 query heads x 16, 2 KV heads
N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM = 64, 4, 2, 16
N_VOCAB = tiny.N_VOCAB
EPS = 1e-6
ROPE_BASE = 10000.0
TARGET_ROPE_SECTIONS = [2, 3, 3, 0]
DRAFT_ROPE_SECTIONS = [HEAD_DIM // 2, 0, 0, 0]


@dataclass
class PairConfig:
    target_n_layer: int = 4
    target_n_ff: int = 256
    draft_n_layer: int = 2
    draft_n_ff: int = 256
    target_layers: tuple = (1, 2, 3)  # GGUF values: indices of target layer inputs
    block_size: int = 16
    sliding_window: int = 32
    # the target's width and heads (of HEAD_DIM); the draft VLM (--draft-vlm) is a narrower hunyuan_vl
    n_embd: int = N_EMBD
    n_head: int = N_HEAD
    n_head_kv: int = N_HEAD_KV
    # the target's M-RoPE sections and rope base, and whether its tokenizer has the tiny merges
    # (the reading world's draft VLM differs in all three: tools/train_reading.py)
    rope_sections: tuple = tuple(TARGET_ROPE_SECTIONS)
    rope_base: float = ROPE_BASE
    merges: bool = True


# ----------------------------------------------------------------------------- torch modules
# (imported lazily so that the GGUF reader / writers work without torch)

def _torch():
    import torch

    return torch


def rms_norm(x, w=None):
    torch = _torch()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return y if w is None else y * w


def _section_of_pair(half: int, sections) -> list[int]:
    """ggml M-RoPE (not interleaved): rotation pair j turns by the position of section
    0 (t), 1 (h), 2 (w) or 3 (e) by where j % sum(sections) falls among the sections."""
    bounds = np.cumsum(sections)
    return [int(np.searchsorted(bounds, j % int(bounds[-1]), side="right")) for j in range(half)]


def rope_neox(x, pos, sections=None, section_of_pair=None, base=None):
    """ggml NeoX rope: x [..., T, H, D], pos [T] or [B, T] (int).  With ``sections``, ggml's
    M-RoPE (``ggml_rope_multi``): pos [(B,) T, 4] holds each row's (t, h, w, e) positions; a
    text row's (p, p, p, 0) turns exactly as NeoX rope at p. ``section_of_pair`` maps rotation
    pairs to sections (default: M-RoPE's contiguous sections; Qwen3.5 interleaves them). ``base``:
    the rope frequency base (default ROPE_BASE)."""
    torch = _torch()
    d = x.shape[-1]
    half = d // 2
    if sections is None:
        pos = pos[..., None].expand(*pos.shape, 4)
        sections = [half, 0, 0, 0]
    sec = (section_of_pair or _section_of_pair)(half, sections)
    base = ROPE_BASE if base is None else base
    if EMULATE_F16_KV:  # ggml: theta = p per section, then theta *= base^(-2/d) per pair, in float32
        scale = np.float32(base) ** np.float32(-2.0 / d)
        th = pos.detach().cpu().numpy().astype(np.float32)  # [..., 4]
        ang = []
        for j in range(half):
            ang.append(th[..., sec[j]])
            th = (th * scale).astype(np.float32)
        ang = torch.from_numpy(np.stack(ang, axis=-1))
    else:
        inv = base ** (-2.0 * torch.arange(half, dtype=torch.float64) / d)
        ang = pos.to(torch.float64)[..., sec] * inv  # [(B,) T, half]
    cos = torch.cos(ang).to(x.dtype)[..., None, :]  # [(B,) T, 1, half]
    sin = torch.sin(ang).to(x.dtype)[..., None, :]
    x0, x1 = x[..., :half], x[..., half:]
    return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)


# Parity tests set this: emulate llama.cpp's CPU attention numerics without flash attention
# (an F16 KV cache; ggml converts q and the softmax probabilities to F16 for the two mat-muls).
EMULATE_F16_KV = False


def _f16(x):
    return x.half().float() if EMULATE_F16_KV else x


def attention(q, k, v, mask):
    """q [B, Tq, H, D], k/v [B, Tk, Hkv, D], mask [B or 1, Tq, Tk] bool (True = visible)."""
    torch = _torch()
    q, k, v = _f16(q), _f16(k), _f16(v)
    rep = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(rep, dim=2)
    v = v.repeat_interleave(rep, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~mask[:, None], float("-inf"))
    p = _f16(torch.softmax(s, dim=-1))
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def _layer_params(n_ff: int, n_embd: int = N_EMBD, n_head: int = N_HEAD, n_head_kv: int = N_HEAD_KV):
    torch = _torch()
    nn = torch.nn
    return nn.ParameterDict(dict(
        attn_norm=nn.Parameter(torch.ones(n_embd)),
        wq=nn.Parameter(torch.randn(n_head * HEAD_DIM, n_embd) / math.sqrt(n_embd)),
        wk=nn.Parameter(torch.randn(n_head_kv * HEAD_DIM, n_embd) / math.sqrt(n_embd)),
        wv=nn.Parameter(torch.randn(n_head_kv * HEAD_DIM, n_embd) / math.sqrt(n_embd)),
        wo=nn.Parameter(torch.randn(n_embd, n_head * HEAD_DIM) / math.sqrt(n_embd) * 0.5),
        q_norm=nn.Parameter(torch.ones(HEAD_DIM)),
        k_norm=nn.Parameter(torch.ones(HEAD_DIM)),
        ffn_norm=nn.Parameter(torch.ones(n_embd)),
        gate=nn.Parameter(torch.randn(n_ff, n_embd) / math.sqrt(n_embd)),
        up=nn.Parameter(torch.randn(n_ff, n_embd) / math.sqrt(n_embd)),
        down=nn.Parameter(torch.randn(n_embd, n_ff) / math.sqrt(n_ff) * 0.5),
    ))


def _ffn(L, x):
    torch = _torch()
    h = rms_norm(x, L["ffn_norm"])
    return torch.nn.functional.linear(
        torch.nn.functional.silu(torch.nn.functional.linear(h, L["gate"])) * torch.nn.functional.linear(h, L["up"]),
        L["down"])


def make_target(cfg: PairConfig):
    torch = _torch()
    nn = torch.nn
    F = torch.nn.functional

    class TinyTarget(nn.Module):
        def __init__(self):
            super().__init__()
            self.cfg = cfg
            E = cfg.n_embd
            self.tok_embd = nn.Parameter(torch.randn(N_VOCAB, E))
            self.output = nn.Parameter(torch.randn(N_VOCAB, E) / math.sqrt(E))
            self.output_norm = nn.Parameter(torch.ones(E))
            self.layers = nn.ModuleList([_layer_params(cfg.target_n_ff, E, cfg.n_head, cfg.n_head_kv)
                                         for _ in range(cfg.target_n_layer)])

        def forward(self, tokens, pos=None, *, layer_ids=(), embd=None):
            """tokens [B, T] -> logits [B, T, V], {lid: layer input [B, T, n_embd]}.

            With an image: ``embd`` [B, T, n_embd] holds the projector's rows where tokens < 0,
            and ``pos`` [B, T, 4] every row's M-RoPE positions (text rows (p, p, p, 0))."""
            B, T = tokens.shape
            pos = torch.arange(T) if pos is None else pos
            sections = list(cfg.rope_sections) if pos.shape[-1] == 4 and pos.ndim == 3 else None
            x = self.tok_embd[tokens.clamp(min=0)]
            if embd is not None:
                x = torch.where((tokens < 0)[..., None], embd, x)
            causal = torch.ones(T, T, dtype=torch.bool).tril()[None]
            feats = {}
            for il, L in enumerate(self.layers):
                if il in layer_ids:
                    feats[il] = x
                h = rms_norm(x, L["attn_norm"])
                q = F.linear(h, L["wq"]).view(B, T, cfg.n_head, HEAD_DIM)
                k = F.linear(h, L["wk"]).view(B, T, cfg.n_head_kv, HEAD_DIM)
                v = F.linear(h, L["wv"]).view(B, T, cfg.n_head_kv, HEAD_DIM)
                q = rms_norm(rope_neox(q, pos, sections, base=cfg.rope_base), L["q_norm"])
                k = rms_norm(rope_neox(k, pos, sections, base=cfg.rope_base), L["k_norm"])
                a = attention(q, k, v, causal).reshape(B, T, cfg.n_head * HEAD_DIM)
                x = x + F.linear(a, L["wo"])
                x = x + _ffn(L, x)
            logits = F.linear(rms_norm(x, self.output_norm), self.output)
            return logits, feats

    return TinyTarget()


def make_draft(cfg: PairConfig):
    torch = _torch()
    nn = torch.nn
    F = torch.nn.functional

    class TinyDraft(nn.Module):
        def __init__(self):
            super().__init__()
            self.cfg = cfg
            n_in = len(cfg.target_layers) * N_EMBD
            self.fc = nn.Parameter(torch.randn(N_EMBD, n_in) / math.sqrt(n_in))
            self.enc_norm = nn.Parameter(torch.ones(N_EMBD))
            self.output_norm = nn.Parameter(torch.ones(N_EMBD))
            self.layers = nn.ModuleList([_layer_params(cfg.draft_n_ff) for _ in range(cfg.draft_n_layer)])

        def context_kv(self, feats, ctx_pos):
            """feats [B, Tc, n_in] at positions ctx_pos [Tc] or [B, Tc] -> per layer (K, V) as the
            draft cache holds them."""
            B, Tc, _ = feats.shape
            g = rms_norm(F.linear(feats, self.fc), self.enc_norm)
            out = []
            for L in self.layers:
                k = F.linear(g, L["wk"]).view(B, Tc, N_HEAD_KV, HEAD_DIM)
                k = rope_neox(rms_norm(k, L["k_norm"]), ctx_pos)
                v = F.linear(g, L["wv"]).view(B, Tc, N_HEAD_KV, HEAD_DIM)
                out.append((k, v))
            return out

        def forward(self, block_tokens, block_pos, ctx_kv, mask, tok_embd, output):
            """block_tokens [B, Tq] at positions block_pos [Tq]; mask [B, Tq, Tc + Tq] (True = visible)."""
            B, Tq = block_tokens.shape
            x = tok_embd[block_tokens]
            for L, (kc, vc) in zip(self.layers, ctx_kv):
                h = rms_norm(x, L["attn_norm"])
                q = rope_neox(rms_norm(F.linear(h, L["wq"]).view(B, Tq, N_HEAD, HEAD_DIM), L["q_norm"]), block_pos)
                k = rope_neox(rms_norm(F.linear(h, L["wk"]).view(B, Tq, N_HEAD_KV, HEAD_DIM), L["k_norm"]), block_pos)
                v = F.linear(h, L["wv"]).view(B, Tq, N_HEAD_KV, HEAD_DIM)
                a = attention(q, torch.cat([kc, k], 1), torch.cat([vc, v], 1), mask)
                x = x + F.linear(a.reshape(B, Tq, N_HEAD * HEAD_DIM), L["wo"])
                x = x + _ffn(L, x)
            return F.linear(rms_norm(x, self.output_norm), output)

    return TinyDraft()


def draft_mask(anchors, block_size: int, ctx_pos, window: int, lengths=None):
    """Visibility [B, nb*block, Tc + nb*block] and block positions [B, nb*block] for blocks at
    anchors [B, nb] (row indices into the context) over context rows at positions ctx_pos [B, Tc],
    exactly as llama.cpp masks a non-causal SWA draft: a block at anchor row a starts at position
    ctx_pos[a] and sees the context rows before a (the rows its draft cache holds) whose position
    is within the window.  ``lengths`` [B, nb] (optional): a block of length L has only its first
    L rows (the engine decodes [id_last, mask x draft_max]); the rows after them are hidden as keys."""
    torch = _torch()
    B, nb = anchors.shape
    Tc = ctx_pos.shape[1]
    i = torch.arange(block_size)
    apos = torch.gather(ctx_pos, 1, anchors)  # [B, nb]
    qpos = (apos[:, :, None] + i).reshape(B, nb * block_size)  # [B, Q]
    qanc = anchors[:, :, None].expand(B, nb, block_size).reshape(B, nb * block_size)
    c = torch.arange(Tc)
    ctx_vis = (c[None, None, :] < qanc[:, :, None]) & (qpos[:, :, None] - ctx_pos[:, None, :] < window)
    blk = torch.arange(nb).repeat_interleave(block_size)
    kpos = qpos  # block keys
    blk_vis = (blk[:, None] == blk[None, :])[None] & (qpos[:, :, None] - kpos[:, None, :] < window)
    if lengths is not None:
        blk_vis = blk_vis & (i.repeat(nb)[None, :] < lengths.repeat_interleave(block_size, dim=1))[:, None, :]
    return torch.cat([ctx_vis, blk_vis], dim=2), qpos


def draft_block_logits(draft, target, feats_all, tokens, anchors, cfg: PairConfig, lengths=None, ctx_pos=None):
    """Draft logits [B, nb*block, V] for blocks [tokens[a], mask...] at each anchor row a
    (context: the feature rows before a).  ctx_pos [B, T]: the rows' draft positions
    (default 0..T-1; after an image they jump, see ImageSequences)."""
    torch = _torch()
    B, T = tokens.shape
    nb, bs = anchors.shape[1], cfg.block_size
    if ctx_pos is None:
        ctx_pos = torch.arange(T)[None].expand(B, T)
    mask, qpos = draft_mask(anchors, bs, ctx_pos, cfg.sliding_window, lengths)
    ctx_kv = draft.context_kv(feats_all, ctx_pos)
    blk = torch.full((B, nb, bs), tiny.MASK_TOKEN_ID, dtype=torch.long)
    blk[:, :, 0] = torch.gather(tokens.clamp(min=0), 1, anchors)
    # positions differ per batch row: rope per row (loop over B keeps the modules simple)
    outs = []
    for b in range(B):
        kv_b = [(k[b:b + 1], v[b:b + 1]) for k, v in ctx_kv]
        outs.append(draft(blk[b:b + 1].reshape(1, nb * bs), qpos[b], kv_b, mask[b:b + 1],
                          target.tok_embd, target.output))
    return torch.cat(outs, 0), qpos


# ----------------------------------------------------------------------------- GGUF export / import

def _np(p) -> np.ndarray:
    return p.detach().cpu().numpy().astype(np.float32)


def _add_hparams(w: GGUFWriter, arch: str, n_layer: int, n_ff: int, sections: list[int] | None,
                 n_embd: int = N_EMBD, n_head: int = N_HEAD, n_head_kv: int = N_HEAD_KV,
                 rope_base: float = ROPE_BASE) -> None:
    """Hyper-parameters of a file written here; ``sections`` None: a plain 1-D rope."""
    w.add_string("general.architecture", arch)
    w.add_uint32(f"{arch}.context_length", 4096)
    w.add_uint32(f"{arch}.embedding_length", n_embd)
    w.add_uint32(f"{arch}.block_count", n_layer)
    w.add_uint32(f"{arch}.feed_forward_length", n_ff)
    w.add_uint32(f"{arch}.attention.head_count", n_head)
    w.add_uint32(f"{arch}.attention.head_count_kv", n_head_kv)
    w.add_uint32(f"{arch}.attention.key_length", HEAD_DIM)
    w.add_uint32(f"{arch}.attention.value_length", HEAD_DIM)
    w.add_uint32(f"{arch}.rope.dimension_count", HEAD_DIM)
    w.add_float32(f"{arch}.rope.freq_base", rope_base)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", EPS)
    if sections is not None:
        w.add_array(f"{arch}.rope.dimension_sections", ValueType.INT32, sections)


_LAYER_TENSORS = [("attn_norm", "attn_norm"), ("wq", "attn_q"), ("wk", "attn_k"), ("wv", "attn_v"),
                  ("wo", "attn_output"), ("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm"),
                  ("ffn_norm", "ffn_norm"), ("gate", "ffn_gate"), ("up", "ffn_up"), ("down", "ffn_down")]


def write_target_gguf(path, params: dict, cfg: PairConfig, name: str = "trained-tiny-hunyuan_vl") -> Path:
    """params: numpy arrays keyed as the torch module's state_dict."""
    w = GGUFWriter()
    _add_hparams(w, "hunyuan_vl", cfg.target_n_layer, cfg.target_n_ff, list(cfg.rope_sections), cfg.n_embd,
                 cfg.n_head, cfg.n_head_kv, cfg.rope_base)
    w.add_string("general.name", name)
    tiny._add_tokenizer(w, merges=cfg.merges)
    w.add_tensor("token_embd.weight", params["tok_embd"])
    w.add_tensor("output_norm.weight", params["output_norm"])
    w.add_tensor("output.weight", params["output"])
    for i in range(cfg.target_n_layer):
        for k, t in _LAYER_TENSORS:
            w.add_tensor(f"blk.{i}.{t}.weight", params[f"layers.{i}.{k}"])
    path = Path(path)
    w.write(path)
    return path


def write_draft_gguf(path, params: dict, cfg: PairConfig, name: str = "trained-tiny-dflash") -> Path:
    w = GGUFWriter()
    _add_hparams(w, "dflash", cfg.draft_n_layer, cfg.draft_n_ff, DRAFT_ROPE_SECTIONS)
    w.add_string("general.name", name)
    w.add_array("dflash.target_layers", ValueType.INT32, list(cfg.target_layers))
    w.add_uint32("dflash.block_size", cfg.block_size)
    w.add_uint32("dflash.attention.sliding_window", cfg.sliding_window)
    w.add_array("dflash.attention.sliding_window_pattern", ValueType.BOOL, [True] * cfg.draft_n_layer)
    tiny._add_tokenizer(w, with_mask_id=True, merges=cfg.merges)
    w.add_tensor("fc.weight", params["fc"])
    w.add_tensor("enc.output_norm.weight", params["enc_norm"])
    w.add_tensor("output_norm.weight", params["output_norm"])
    for i in range(cfg.draft_n_layer):
        for k, t in _LAYER_TENSORS:
            w.add_tensor(f"blk.{i}.{t}.weight", params[f"layers.{i}.{k}"])
    path = Path(path)
    w.write(path)
    return path


def read_gguf_tensors(path) -> tuple[dict, dict[str, np.ndarray]]:
    """(metadata, {name: float32 array in numpy shape}) of an F32/F16 GGUF file."""
    from pyllama_spec.gguf.reader import read_gguf
    from pyllama_spec.gguf.writer import read_gguf_metadata

    meta = read_gguf_metadata(path)
    info = read_gguf(path)
    raw = Path(path).read_bytes()
    out = {}
    for t in info.tensors.values():
        dt = {0: np.float32, 1: np.float16}[t.ggml_type]
        a = np.frombuffer(raw, dtype=dt, count=int(np.prod(t.dims)), offset=info.data_offset + t.offset)
        out[t.name] = a.reshape(tuple(reversed(t.dims))).astype(np.float32)
    return meta, out


def _params_from_gguf(tensors: dict, n_layer: int, top: dict) -> dict:
    p = {k: tensors[v] for k, v in top.items()}
    for i in range(n_layer):
        for k, t in _LAYER_TENSORS:
            p[f"layers.{i}.{k}"] = tensors[f"blk.{i}.{t}.weight"]
    return p


def load_pair(target_path, draft_path=None):
    """Torch modules (target, draft or None, cfg) holding the weights of GGUF files written here."""
    torch = _torch()
    tmeta, tt = read_gguf_tensors(target_path)
    cfg = PairConfig(target_n_layer=int(tmeta["hunyuan_vl.block_count"]),
                     target_n_ff=int(tmeta["hunyuan_vl.feed_forward_length"]),
                     n_embd=int(tmeta["hunyuan_vl.embedding_length"]), n_head=int(tmeta["hunyuan_vl.attention.head_count"]),
                     n_head_kv=int(tmeta["hunyuan_vl.attention.head_count_kv"]),
                     rope_sections=tuple(int(v) for v in tmeta["hunyuan_vl.rope.dimension_sections"]),
                     rope_base=float(tmeta["hunyuan_vl.rope.freq_base"]),
                     merges=bool(len(tmeta.get("tokenizer.ggml.merges", []))))
    target = make_target(cfg)
    p = _params_from_gguf(tt, cfg.target_n_layer, dict(tok_embd="token_embd.weight", output="output.weight",
                                                     output_norm="output_norm.weight"))
    target.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in p.items()})
    draft = load_draft(draft_path, cfg) if draft_path is not None else None
    return target.eval(), draft, cfg


def load_draft(draft_path, cfg: PairConfig):
    """The DFlash draft module of a file written here; its shapes go into ``cfg`` (any target's)."""
    torch = _torch()
    dmeta, dt = read_gguf_tensors(draft_path)
    cfg.draft_n_layer = int(dmeta["dflash.block_count"])
    cfg.draft_n_ff = int(dmeta["dflash.feed_forward_length"])
    cfg.target_layers = tuple(int(x) for x in dmeta["dflash.target_layers"])
    cfg.block_size = int(dmeta["dflash.block_size"])
    cfg.sliding_window = int(dmeta["dflash.attention.sliding_window"])
    draft = make_draft(cfg)
    p = _params_from_gguf(dt, cfg.draft_n_layer, dict(fc="fc.weight", enc_norm="enc.output_norm.weight",
                                                    output_norm="output_norm.weight"))
    draft.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in p.items()})
    return draft.eval()


# ----------------------------------------------------------------------------- corpus

def corpus_files() -> tuple[list[str], list[str]]:
    files = sorted(glob.glob(CORPUS_GLOB))
    train = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY != 0]
    held = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY == 0]
    return train, held


def tokenize_files(files: list[str], tokenizer_gguf: Path) -> np.ndarray:
    """Tokens of the files (each followed by a blank line), with llama.cpp's tokenizer."""
    from pyllama_spec.bindings.model import Model

    out = []
    with Model(tokenizer_gguf) as m:
        for f in files:
            text = Path(f).read_text(encoding="utf-8", errors="replace")
            out.append(m.tokenize(text + "\n\n", add_special=False, parse_special=False).astype(np.int32))
    return np.concatenate(out)


def _tokenizer_only_gguf(folder: Path, cfg: PairConfig) -> Path:
    torch = _torch()
    torch.manual_seed(0)
    t = make_target(cfg)
    return write_target_gguf(folder / "tokenizer-probe.gguf", {k: _np(v) for k, v in t.state_dict().items()}, cfg)


# ----------------------------------------------------------------------------- training

def _batch(rng: np.random.Generator, toks: np.ndarray, batch: int, seq: int):
    torch = _torch()
    starts = rng.integers(0, len(toks) - seq - 1, size=batch)
    return torch.from_numpy(np.stack([toks[s:s + seq] for s in starts]).astype(np.int64))


def _lr(step: int, n: int, peak: float, warm: int = 50) -> float:
    if step < warm:
        return peak * (step + 1) / warm
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, n - warm)))))


def train_target(target, toks, held, *, steps, seconds, batch, seq, seed, log, images=None, held_images=None,
                 image_share=0.0, image_text=384):
    """Next-token training on corpus windows; with ``images`` (EncodedImage), a share of the
    batches puts a picture before the text, as a vision-language model is trained, so that the
    target's text after an image is as good as without one (the loss is on text rows only)."""
    torch = _torch()
    F = torch.nn.functional
    rng = np.random.default_rng(seed + 11)
    img_rng = np.random.default_rng(seed + 13)  # its own stream: text batches stay those of a text-only run
    opt = torch.optim.AdamW(target.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    t0, step, losses = time.time(), 0, []
    for step in range(steps):
        if time.time() - t0 > seconds:
            log(f"target: time budget reached at step {step}")
            break
        for g in opt.param_groups:
            g["lr"] = _lr(step, steps, 3e-3)
        if images and img_rng.random() < image_share:
            loss = _image_text_loss(target, *image_text_batch(img_rng, toks, images, batch, image_text))
        else:
            x = _batch(rng, toks, batch, seq + 1)
            logits, _ = target(x[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, N_VOCAB), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(target.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 100 == 0:
            log(f"target step {step} loss {np.mean(losses[-100:]):.3f} ({time.time() - t0:.0f}s)")
    info = dict(steps=step + 1, seconds=round(time.time() - t0, 1), train_loss=float(np.mean(losses[-100:])),
                held_out_loss=eval_target(target, held, seq, seed))
    if held_images:
        info["held_out_loss_after_image"] = eval_target_after_images(target, held, held_images, image_text, seed)
    return info


def eval_target(target, toks, seq, seed, n=16):
    torch = _torch()
    F = torch.nn.functional
    rng = np.random.default_rng(seed + 99)
    with torch.no_grad():
        x = _batch(rng, toks, n, seq + 1)
        logits, _ = target(x[:, :-1])
        return float(F.cross_entropy(logits.reshape(-1, N_VOCAB), x[:, 1:].reshape(-1)))


def eval_target_after_images(target, toks, encoded, text_len, seed, n=16):
    """Held-out text loss after held-out pictures (one picture per sequence)."""
    torch = _torch()
    rng = np.random.default_rng(seed + 98)
    with torch.no_grad():
        return float(np.mean([float(_image_text_loss(target, *image_text_batch(rng, toks, encoded, 1, text_len)))
                              for _ in range(n)]))


BLOCK_LENGTHS = (4, 8, 16)  # rows of a drafted block: draft_max 3, 7 and 15 (+ id_last)


def generate_greedy(target_gguf, toks: np.ndarray, n_seqs: int, prompt_len: int, gen_len: int, seed: int,
                    log=print) -> np.ndarray:
    """[n_seqs, prompt_len + gen_len] tokens: corpus prompts, each continued greedily by the target
    (llama.cpp, the same model as the PyTorch one): the text the draft has to predict at run time."""
    from pyllama_spec.bindings.context import Context
    from pyllama_spec.bindings.model import Model

    rng = np.random.default_rng(seed + 31)
    out = np.zeros((n_seqs, prompt_len + gen_len), np.int32)
    t0 = time.time()
    with Model(target_gguf) as m, Context(m, n_ctx=prompt_len + gen_len + 16, n_batch=prompt_len,
                                          n_ubatch=prompt_len, n_threads=1, flash_attn=False) as ctx:
        last = np.zeros(prompt_len, bool)
        last[-1] = True
        for i in range(n_seqs):
            s = int(rng.integers(0, len(toks) - prompt_len))
            out[i, :prompt_len] = toks[s:s + prompt_len]
            ctx.memory.clear()
            ctx.decode_tokens(out[i, :prompt_len], np.arange(prompt_len), outputs=last)
            for j in range(gen_len):
                out[i, prompt_len + j] = t = int(np.argmax(ctx.logits(-1)))
                if j + 1 < gen_len:
                    ctx.decode_tokens([t], [prompt_len + j], outputs=True)
            if i % 256 == 0:
                log(f"greedy generations: {i}/{n_seqs} ({time.time() - t0:.0f}s)")
    return out


# ----------------------------------------------------------------------------- pictures (target and draft data)

def image_pool(n: int, seed: int) -> list[np.ndarray]:
    """n synthetic RGB pictures (uint8 [h, w, 3], sides 112..672, so at most 576 image rows):
    solid colours, gradients, noise, blurred noise, checkerboards and random rectangles.  They
    stand in for photos: the tiny projector is random, so what matters is the spread of image
    embeddings the target sees (identical rows for a flat picture, varied rows for texture)."""
    rng = np.random.default_rng(seed + 53)
    kinds = ("solid", "gradient", "noise", "blurred", "checker", "rects")
    out = []
    for i in range(n):
        h, w = (int(v) for v in rng.integers(112, 673, size=2))
        kind = kinds[i % len(kinds)]
        c0, c1 = rng.integers(0, 256, size=(2, 3))
        if kind == "solid":
            img = np.broadcast_to(c0, (h, w, 3))
        elif kind == "gradient":
            t = np.linspace(0.0, 1.0, w if rng.random() < 0.5 else h)
            t = t[None, :, None] if len(t) == w else t[:, None, None]
            img = np.broadcast_to(c0 + (c1 - c0) * t, (h, w, 3))
        elif kind == "noise":
            img = rng.integers(0, 256, size=(h, w, 3))
        elif kind == "blurred":
            small = rng.integers(0, 256, size=(max(2, h // 32), max(2, w // 32), 3))
            img = np.repeat(np.repeat(small, 32, 0), 32, 1)[:h, :w]
            img = np.pad(img, ((0, h - img.shape[0]), (0, w - img.shape[1]), (0, 0)), mode="edge")
        elif kind == "checker":
            k = int(rng.integers(8, 64))
            yy, xx = np.mgrid[:h, :w]
            img = np.where((((yy // k) + (xx // k)) % 2 == 0)[..., None], c0, c1)
        else:
            img = np.broadcast_to(c0, (h, w, 3)).copy()
            for _ in range(int(rng.integers(2, 8))):
                y0, x0 = int(rng.integers(0, h)), int(rng.integers(0, w))
                img[y0:y0 + int(rng.integers(8, h)), x0:x0 + int(rng.integers(8, w))] = rng.integers(0, 256, 3)
        out.append(np.ascontiguousarray(img, dtype=np.uint8))
    return out


@dataclass
class EncodedImage:
    """A picture as the target takes it after ``MEDIA_MARKER + "\\n"``: text tokens before it, the
    projector's rows with their M-RoPE positions (t, h, w, e) from position len(pre), the
    positions it advances, and the text tokens after it."""

    pre: np.ndarray
    embd: np.ndarray
    pos: np.ndarray
    n_pos: int
    post: np.ndarray


def encode_images(model_gguf, mmproj_gguf, images: list[np.ndarray]) -> list[EncodedImage]:
    from pyllama_spec.bindings.model import Model
    from pyllama_spec.bindings.mtmd import MEDIA_MARKER, Bitmap, Projector

    out = []
    with Model(model_gguf) as m, Projector(mmproj_gguf, m, n_threads=1) as proj:
        for img in images:
            chunks = proj.tokenize(MEDIA_MARKER + "\n", [Bitmap(img)])
            pre, media, post = chunks[0].tokens, chunks[1], chunks[2].tokens
            # decoder_positions() is (t, x, y, z); the decoder takes (t, h = y, w = x, e)
            pos = media.decoder_positions(len(pre))[:, [0, 2, 1, 3]].astype(np.int64)
            out.append(EncodedImage(pre, proj.encode(media), pos, media.n_pos, post))
    return out


def _text_positions(p0: int, n: int) -> np.ndarray:
    p = p0 + np.arange(n)
    return np.stack([p, p, p, np.zeros_like(p)], axis=1)


def image_text_batch(rng, toks: np.ndarray, encoded: list[EncodedImage], batch: int, text_len: int,
                     teacher: list[EncodedImage] | None = None):
    """One target batch of [picture, corpus text] (one picture per batch, so rows line up):
    tokens [B, T + 1] (-1 on image rows), M-RoPE positions [T, 4], embeddings [T, n_embd]; with
    ``teacher`` (the same pictures through another projector), also the teacher's embeddings."""
    torch = _torch()
    pick = int(rng.integers(0, len(encoded)))
    e = encoded[pick]
    n_img = len(e.embd)
    head = np.concatenate([e.pre, np.full(n_img, -1), e.post])
    rows = []
    for _ in range(batch):
        s = int(rng.integers(0, len(toks) - text_len - 1))
        rows.append(np.concatenate([head, toks[s:s + text_len + 1]]))
    T = len(rows[0]) - 1
    n_after = T - len(e.pre) - n_img
    pos = np.concatenate([_text_positions(0, len(e.pre)), e.pos, _text_positions(len(e.pre) + e.n_pos, n_after)])
    def rows_of(image_embd):
        embd = np.zeros((T, image_embd.shape[1]), np.float32)
        embd[len(e.pre):len(e.pre) + n_img] = image_embd
        return torch.from_numpy(embd)

    out = (torch.from_numpy(np.stack(rows).astype(np.int64)), torch.from_numpy(pos), rows_of(e.embd))
    if teacher is not None:  # the same picture through the teacher's projector (--draft-vlm)
        out += (rows_of(teacher[pick].embd),)
    return out


def _image_text_loss(target, x, pos, embd):
    """Next-token loss on the text rows of an image_text_batch."""
    torch = _torch()
    B, T = x.shape[0], x.shape[1] - 1
    logits, _ = target(x[:, :-1], pos[None].expand(B, T, 4), embd=embd[None].expand(B, T, embd.shape[-1]))
    labels = x[:, 1:].masked_fill(x[:, 1:] < 0, -100)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, N_VOCAB), labels.reshape(-1), ignore_index=-100)


@dataclass
class ImageSequences:
    """Draft training rows after an image, as llama.cpp's target produced them.

    Each sequence is ``MEDIA_MARKER + "\n"`` (or another prompt around the marker) with a picture
    (mtmd: pre text, image, post text) followed by a corpus prompt and the target's greedy continuation
    of it.  Rows are laid out [pre | the image's last W rows | post] (every image row where a picture
    has fewer than W): no draft query after the image can see an earlier
    image row, since every post row is more than W positions past them in "sequential" mode and
    image rows are never injected in "target" mode.  The target features are read from llama.cpp
    (layer inputs, with the image's M-RoPE positions), so the PyTorch target needs no image path.
    """

    feats: np.ndarray  # float32 [N, R, n_in]: the draft's injected features per row
    tokens: np.ndarray  # int32 [N, R]: the token of a text row, -1 on image rows
    greedy: np.ndarray  # int32 [N, R]: the target's argmax after a text row, -1 on image rows
    pos_target: np.ndarray  # int32 [N, R]: draft positions in "target" mode (image rows unused)
    pos_sequential: np.ndarray  # int32 [N, R]: draft positions in "sequential" mode
    n_pre: int
    n_image: int  # image rows kept (the draft's window, or every row of pictures smaller than it)

    def __len__(self) -> int:
        return len(self.tokens)

    def rows(self, i: int, mode: str, seq: int):
        """(tokens, feats, greedy, positions, first post row) of sequence i as a draft in ``mode``
        holds it, cut to seq rows."""
        if mode == "target":
            cols = np.r_[0:self.n_pre, self.n_pre + self.n_image:self.tokens.shape[1]][:seq]
            pos, first = self.pos_target, self.n_pre
        else:
            cols = np.arange(seq)
            pos, first = self.pos_sequential, self.n_pre + self.n_image
        return self.tokens[i, cols], self.feats[i, cols], self.greedy[i, cols], pos[i, cols], first


def _check_pictures(images, n_seqs: int, one_each: bool) -> None:
    if not len(images):
        raise ValueError("no pictures to make sequences after")
    if one_each and n_seqs > len(images):
        raise ValueError(f"one picture a sequence: {n_seqs} sequences need as many pictures, got {len(images)}")


def generate_image_sequences(target_gguf, mmproj_gguf, toks: np.ndarray, images: list[np.ndarray], n_seqs: int,
                             prompt_len: int, gen_len: int, cfg: PairConfig, seed: int, log=print,
                             prompt: str | None = None, one_each: bool = False) -> ImageSequences:
    """n_seqs sequences [picture, corpus prompt, greedy continuation] decoded by the trained target
    in llama.cpp, with the target layer inputs of every row (see ImageSequences).

    ``prompt``: the text around the picture (its media marker first; default the marker and a
    newline); ``one_each``: sequence i takes picture i (else a random one). The image's last W rows
    are kept (W: the draft's window); pictures of fewer rows must all have as many, and all are kept."""
    from pyllama_spec.bindings.context import Context
    from pyllama_spec.bindings.model import Model
    from pyllama_spec.bindings.mtmd import MEDIA_MARKER, Bitmap, Projector
    from pyllama_spec.speculative.positions import SequencePositions

    _check_pictures(images, n_seqs, one_each)
    rng = np.random.default_rng(seed + 41)
    lids = list(cfg.target_layers)
    W = cfg.sliding_window
    t0 = time.time()
    with Model(target_gguf) as m, Projector(mmproj_gguf, m, n_threads=1) as proj:
        prepared = []  # per picture: pre tokens, image chunk (kept alive by its Chunks), embeddings, post tokens
        for img in images:
            chunks = proj.tokenize(prompt or MEDIA_MARKER + "\n", [Bitmap(img)])
            kinds = [c.type for c in chunks]
            if kinds != ["text", "image", "text"]:
                raise RuntimeError(f"unexpected chunk layout for an image prompt: {kinds}")
            prepared.append((chunks, chunks[0].tokens, chunks[1], proj.encode(chunks[1]), chunks[2].tokens))
        sizes = {min(W, p[2].n_tokens) for p in prepared}
        if len(sizes) != 1:
            raise RuntimeError(f"pictures of fewer rows than the window {W} must all have as many: {sorted(sizes)}")
        W = sizes.pop()  # the image rows kept: every row a query after the picture can see
        n_pre, n_post0 = len(prepared[0][1]), len(prepared[0][4])
        n_post = n_post0 + prompt_len + gen_len
        R = n_pre + W + n_post
        n_in = len(lids) * N_EMBD
        out = ImageSequences(feats=np.zeros((n_seqs, R, n_in), np.float32), tokens=np.full((n_seqs, R), -1, np.int32),
                             greedy=np.full((n_seqs, R), -1, np.int32), pos_target=np.zeros((n_seqs, R), np.int32),
                             pos_sequential=np.zeros((n_seqs, R), np.int32), n_pre=n_pre, n_image=W)
        max_rows = max(p[2].n_tokens for p in prepared)
        with Context(m, n_ctx=n_pre + max_rows + n_post + 16, n_batch=512, n_ubatch=512, n_threads=1,
                     flash_attn=False) as ctx:
            ctx.enable_layer_inputs(lids)

            def features(n):
                return np.concatenate([ctx.layer_input(lid, n) for lid in lids], axis=1)

            post0 = n_pre + W
            for i in range(n_seqs):
                _, pre, media, embd, post_start = prepared[i if one_each else int(rng.integers(0, len(prepared)))]
                s = int(rng.integers(0, len(toks) - prompt_len))
                # the draft's positions in each mode, by the engine's own bookkeeping
                track = {mode: SequencePositions(mode) for mode in ("target", "sequential")}
                ctx.memory.clear()
                ctx.decode_tokens(pre, np.arange(n_pre), outputs=True)
                out.tokens[i, :n_pre], out.feats[i, :n_pre] = pre, features(n_pre)
                out.pos_target[i, :n_pre] = out.pos_sequential[i, :n_pre] = np.arange(n_pre)
                for t in track.values():
                    t.advance_text(n_pre)
                image_feats = []
                pos = proj.decode_media(ctx, media, embd, track["target"].pos_next, n_batch=ctx.n_batch,
                                        on_batch=lambda b: image_feats.append(features(b.n_rows).copy()))
                for t in track.values():
                    t.advance_media(media.n_tokens, media.n_pos)
                assert pos == track["target"].pos_next
                out.feats[i, n_pre:post0] = np.concatenate(image_feats)[-W:]
                # the image's last W rows sit just before the sequential draft's next position
                out.pos_sequential[i, n_pre:post0] = track["sequential"].draft_pos_next - W + np.arange(W)
                # post text: decoded as one batch (all rows output), then continued greedily
                post = np.concatenate([post_start, toks[s:s + prompt_len]]).astype(np.int32)
                n_p = len(post)
                ctx.decode_tokens(post, pos + np.arange(n_p), outputs=True)
                out.tokens[i, post0:post0 + n_p] = post
                out.feats[i, post0:post0 + n_p] = features(n_p)
                out.greedy[i, post0:post0 + n_p] = ctx.output_logits(n_p).argmax(-1)
                for j in range(n_p, n_post):
                    t = int(out.greedy[i, post0 + j - 1])
                    ctx.decode_tokens([t], [pos + j], outputs=True)
                    out.tokens[i, post0 + j] = t
                    out.feats[i, post0 + j] = features(1)[0]
                    out.greedy[i, post0 + j] = int(np.argmax(ctx.logits(-1)))
                out.pos_target[i, post0:] = track["target"].draft_pos_next + np.arange(n_post)
                out.pos_sequential[i, post0:] = track["sequential"].draft_pos_next + np.arange(n_post)
                if i % 256 == 0:
                    log(f"image sequences: {i}/{n_seqs} ({time.time() - t0:.0f}s)")
    return out


@dataclass
class DraftRow:
    """One training sequence as the draft sees it: tokens, injected features (None: compute them
    with the PyTorch target), the target's greedy choice after each row (None: likewise), the
    rows' draft positions, and the first row a block may start at."""

    tokens: np.ndarray
    feats: np.ndarray | None
    greedy: np.ndarray | None
    pos: np.ndarray
    first: int


@dataclass
class DraftData:
    """Draft training sequences: corpus windows, windows of the target's own greedy text, and
    (``images``) greedy text after a picture, in either ``draft_positions`` mode."""

    toks: np.ndarray
    gen: np.ndarray | None = None
    gen_share: float = 0.0
    images: ImageSequences | None = None
    image_share: float = 0.0
    image_modes: tuple = ("target", "sequential")

    def sample(self, rng, batch: int, seq: int) -> list[DraftRow]:
        rows = []
        for _ in range(batch):
            if self.images is not None and rng.random() < self.image_share:
                i = int(rng.integers(0, len(self.images)))
                mode = self.image_modes[int(rng.integers(0, len(self.image_modes)))]
                rows.append(DraftRow(*self.images.rows(i, mode, seq)))
                continue
            if self.gen is not None and rng.random() < self.gen_share:
                r = self.gen[int(rng.integers(0, len(self.gen)))]
                o = int(rng.integers(0, len(r) - seq + 1))
                t = r[o:o + seq]
            else:
                s = int(rng.integers(0, len(self.toks) - seq - 1))
                t = self.toks[s:s + seq]
            rows.append(DraftRow(t, None, None, np.arange(seq), 1))
        return rows


def _draft_step_data(target, rng, data: DraftData, cfg, batch, seq, n_blocks, variable_length=False):
    """Tokens, target features, draft positions, anchors and labels (target greedy) for one draft batch."""
    torch = _torch()
    rows = data.sample(rng, batch, seq)
    x = torch.from_numpy(np.stack([r.tokens for r in rows]).astype(np.int64))
    pos = torch.from_numpy(np.stack([r.pos for r in rows]).astype(np.int64))
    f = torch.zeros(batch, seq, len(cfg.target_layers) * N_EMBD)
    greedy = torch.zeros(batch, seq, dtype=torch.long)  # greedy[t] = target's choice for row t + 1
    text = [k for k, r in enumerate(rows) if r.feats is None]
    if text:
        with torch.no_grad():
            logits, feats = target(x[text], layer_ids=cfg.target_layers)
        greedy[text] = logits.argmax(-1)
        f[text] = torch.cat([feats[lid] for lid in cfg.target_layers], dim=-1)
    for k, r in enumerate(rows):
        if r.feats is not None:
            f[k] = torch.from_numpy(r.feats)
            greedy[k] = torch.from_numpy(r.greedy.astype(np.int64))
    bs = cfg.block_size
    anchors = torch.from_numpy(np.sort(np.stack([rng.choice(np.arange(r.first, seq - bs + 1), n_blocks, replace=False)
                                                 for r in rows]), axis=1)).long()
    qidx = (anchors[:, :, None] + torch.arange(bs)).reshape(batch, -1)
    labels = torch.gather(greedy, 1, qidx - 1)  # label of block row i: the target's choice after row a + i - 1
    row = torch.arange(bs).repeat(n_blocks)[None].expand(batch, -1)
    labels = labels.masked_fill(row == 0, -100)  # row 0 is the anchor itself
    lengths = None
    if variable_length:
        lengths = torch.from_numpy(rng.choice([n for n in BLOCK_LENGTHS if n <= bs], (batch, n_blocks))).long()
        labels = labels.masked_fill(row >= lengths.repeat_interleave(bs, dim=1), -100)
    return x, f, pos, anchors, labels, lengths


def train_draft(draft, target, data: DraftData, held: dict, cfg, *, steps, seconds, batch, seq, n_blocks, seed,
                log):
    torch = _torch()
    F = torch.nn.functional
    rng = np.random.default_rng(seed + 23)
    for p in target.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    t0, step, losses = time.time(), 0, []
    for step in range(steps):
        if time.time() - t0 > seconds:
            log(f"draft: time budget reached at step {step}")
            break
        for g in opt.param_groups:
            g["lr"] = _lr(step, steps, 3e-3)
        x, f, pos, anchors, labels, lengths = _draft_step_data(target, rng, data, cfg, batch, seq, n_blocks,
                                                               variable_length=True)
        logits, _ = draft_block_logits(draft, target, f, x, anchors, cfg, lengths, ctx_pos=pos)
        loss = F.cross_entropy(logits.reshape(-1, N_VOCAB), labels.reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0:
            log(f"draft step {step} loss {np.mean(losses[-50:]):.3f} ({time.time() - t0:.0f}s)")
    info = dict(steps=step + 1, seconds=round(time.time() - t0, 1), train_loss=float(np.mean(losses[-50:])))
    for name, d in held.items():
        info[name] = eval_draft(draft, target, d, cfg, seq, n_blocks, seed)
    return info


def eval_draft(draft, target, data: DraftData, cfg, seq, n_blocks, seed, batch=16):
    """Held-out: draft loss, per-row agreement with the target's greedy choice, and the expected
    accepted length of a full block (leading rows that all agree)."""
    torch = _torch()
    F = torch.nn.functional
    rng = np.random.default_rng(seed + 77)
    with torch.no_grad():
        x, f, pos, anchors, labels, _ = _draft_step_data(target, rng, data, cfg, batch, seq, n_blocks)
        logits, _ = draft_block_logits(draft, target, f, x, anchors, cfg, ctx_pos=pos)
        loss = F.cross_entropy(logits.reshape(-1, N_VOCAB), labels.reshape(-1), ignore_index=-100)
        ok = (logits.argmax(-1) == labels).reshape(batch, n_blocks, cfg.block_size)[:, :, 1:].float()
        run = ok.cumprod(-1).sum(-1)
    return dict(loss=round(float(loss), 3), row_agreement=[round(float(a), 2) for a in ok.mean((0, 1))],
                mean_accepted_full_block=round(float(run.mean()), 2))


# ----------------------------------------------------------------------------- EAGLE3 draft (--eagle3)
#
# src/models/eagle3.cpp, operation for operation (no q/k norms; plain 1-D rope, LLAMA_ROPE_TYPE_NORM):
#   encoder: g = fc f   (f = the target's layer inputs at ``target_layers``, side by side)
#   decoder row (token t, g) at position p:  h = [rms(tok_embd[t]) * attn_norm | rms(g) * attn_norm_2];
#       q, k, v = h Wq, h Wk, h Wv (2 x n_embd wide inputs); q, k = rope_norm(q, p), rope_norm(k, p)
#       x = Wo attn_causal(q, k, v) + g;  prenorm = x + Wdown(silu(Wgate x') * Wup x'), x' = rms(x) * ffn_norm
#       logits = target output(rms(prenorm) * output_norm)    (token embedding and head: the target's)
# Input convention (common_speculative_impl_draft_eagle3): the row at position P is (t_{P+1}, g_P);
# a drafted token is fed with the previous row's prenorm as its g, at the next position.


@dataclass
class Eagle3Config:
    target_layers: tuple = (1, 2, 3)  # eagle3.target_layers: the target layers whose inputs the encoder reads
    n_ff: int = 256
    ttt_steps: int = 7  # training-time test: chain steps trained per anchor (step 0 reads the target's g)
    merges: bool = True  # the tokenizer's merges, as its target's (the reading world's have none)


def rope_norm(x, pos):
    """ggml's plain rope (LLAMA_ROPE_TYPE_NORM, the one llama.cpp gives the eagle3 arch): rotation pair
    j is (x[2j], x[2j + 1]), turned by the angle of NeoX's pair j (x[j], x[j + d/2])."""
    torch = _torch()
    d = x.shape[-1]
    perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    return rope_neox(x[..., perm], pos)[..., torch.argsort(perm)]


def make_eagle3(ecfg: Eagle3Config):
    torch = _torch()
    nn = torch.nn
    F = torch.nn.functional

    class TinyEagle3(nn.Module):
        def __init__(self):
            super().__init__()
            self.ecfg = ecfg
            n_in, n_attn_in = len(ecfg.target_layers) * N_EMBD, 2 * N_EMBD
            self.fc = nn.Parameter(torch.randn(N_EMBD, n_in) / math.sqrt(n_in))
            self.output_norm = nn.Parameter(torch.ones(N_EMBD))
            self.blk = nn.ParameterDict(dict(
                attn_norm=nn.Parameter(torch.ones(N_EMBD)),  # input_layernorm, on the token embedding
                hidden_norm=nn.Parameter(torch.ones(N_EMBD)),  # attn_norm_2, on g
                wq=nn.Parameter(torch.randn(N_HEAD * HEAD_DIM, n_attn_in) / math.sqrt(n_attn_in)),
                wk=nn.Parameter(torch.randn(N_HEAD_KV * HEAD_DIM, n_attn_in) / math.sqrt(n_attn_in)),
                wv=nn.Parameter(torch.randn(N_HEAD_KV * HEAD_DIM, n_attn_in) / math.sqrt(n_attn_in)),
                wo=nn.Parameter(torch.randn(N_EMBD, N_HEAD * HEAD_DIM) / math.sqrt(N_EMBD) * 0.5),
                ffn_norm=nn.Parameter(torch.ones(N_EMBD)),
                gate=nn.Parameter(torch.randn(ecfg.n_ff, N_EMBD) / math.sqrt(N_EMBD)),
                up=nn.Parameter(torch.randn(ecfg.n_ff, N_EMBD) / math.sqrt(N_EMBD)),
                down=nn.Parameter(torch.randn(N_EMBD, ecfg.n_ff) / math.sqrt(ecfg.n_ff) * 0.5),
            ))

        def encode(self, feats):
            """The encoder graph: g = fc f, for target features [..., 3 x n_embd]."""
            return F.linear(feats, self.fc)

        def qkv(self, emb, g, pos):
            """q, k, v of rows (token embedding emb, g) [B, T, n_embd] at 1-D positions pos [B, T]."""
            B, T, _ = emb.shape
            L = self.blk
            h = torch.cat([rms_norm(emb, L["attn_norm"]), rms_norm(g, L["hidden_norm"])], dim=-1)
            q = rope_norm(F.linear(h, L["wq"]).view(B, T, N_HEAD, HEAD_DIM), pos)
            k = rope_norm(F.linear(h, L["wk"]).view(B, T, N_HEAD_KV, HEAD_DIM), pos)
            return q, k, F.linear(h, L["wv"]).view(B, T, N_HEAD_KV, HEAD_DIM)

        def finish(self, a, g, output):
            """(logits, prenorm) from the attention output a [B, T, H, D] of rows whose g is g."""
            x = F.linear(a.reshape(*a.shape[:2], N_HEAD * HEAD_DIM), self.blk["wo"]) + g
            prenorm = x + _ffn(self.blk, x)
            return F.linear(rms_norm(prenorm, self.output_norm), output), prenorm

        def forward(self, emb, g, pos, output):
            """All rows at once, each seeing every row at or before its position (llama.cpp's causal
            mask on a 1-D cache: rows that share a position see each other): (logits, prenorm)."""
            q, k, v = self.qkv(emb, g, pos)
            return self.finish(attention(q, k, v, pos[:, None, :] <= pos[:, :, None]), g, output)

    return TinyEagle3()


def _attention_with_chain(q, k0, v0, mask0, chain):
    """attention() over the rows k0/v0 (mask0 [B, A, T]) plus, for each query, one key of each earlier
    chain step (chain: [(k, v) [B, A, Hkv, D]], query a's own keys): a drafted row sees the context and
    the rows drafted before it in its own chain."""
    torch = _torch()
    q, k0, v0 = _f16(q), _f16(k0), _f16(v0)
    rep = q.shape[2] // k0.shape[2]
    k0, v0 = k0.repeat_interleave(rep, dim=2), v0.repeat_interleave(rep, dim=2)
    scale = 1.0 / math.sqrt(q.shape[-1])
    s0 = torch.einsum("bqhd,bkhd->bhqk", q, k0) * scale
    s0 = s0.masked_fill(~mask0[:, None], float("-inf"))
    ks = [_f16(k).repeat_interleave(rep, dim=2) for k, _ in chain]
    vs = [_f16(v).repeat_interleave(rep, dim=2) for _, v in chain]
    sc = torch.stack([(q * k).sum(-1) for k in ks], dim=-1).permute(0, 2, 1, 3) * scale  # [B, H, A, j]
    p = _f16(torch.softmax(torch.cat([s0, sc], dim=-1), dim=-1))
    T = k0.shape[1]
    out = torch.einsum("bhqk,bkhd->bqhd", p[..., :T], v0)
    for i, v in enumerate(vs):
        out = out + p[..., T + i].permute(0, 2, 1)[..., None] * v
    return out


def eagle3_chain_logits(draft, emb_table, output, partners, feats, pos, key_ok, anchors, steps):
    """Training-time test: logits [steps][B, A, V] of chains drafted from anchor rows.

    Rows r < T (feats [B, T, n_in], 1-D positions pos [B, T], key_ok [B, T]: rows that exist) are
    the draft's cache, (partners[r], g_r) at pos[r].  The chain at anchor a (anchors [B, A]): step 0
    is row a itself (llama.cpp's held-back row, written by draft() with id_last); step j >= 1 is
    (partners[a + j], the prenorm of step j - 1) at pos[a] + j, as draft() feeds a drafted token.
    Each step sees the cache rows at or before pos[a] and the chain's earlier steps.  ``partners``
    [B, >= T + steps - 1]: the tokens (the real ones: teacher forcing; the drafted ones for parity)."""
    torch = _torch()
    B, T = feats.shape[:2]
    g_all = draft.encode(feats)
    q_all, k0, v0 = draft.qkv(emb_table[partners[:, :T]], g_all, pos)

    def take(x):  # the anchor rows of x [B, T, ...]
        return torch.gather(x, 1, anchors.view(B, -1, *([1] * (x.ndim - 2))).expand(-1, -1, *x.shape[2:]))

    apos = torch.gather(pos, 1, anchors)
    mask0 = (pos[:, None, :] <= apos[:, :, None]) & key_ok[:, None, :]
    g = take(g_all)
    chain, out = [], []
    for j in range(steps):
        if j == 0:
            q = take(q_all)
            a = attention(q, k0, v0, mask0)
        else:
            tok = torch.gather(partners, 1, anchors + j)
            q, k, v = draft.qkv(emb_table[tok], g, apos + j)
            chain.append((k, v))
            a = _attention_with_chain(q, k0, v0, mask0, chain)
        logits, g = draft.finish(a, g, output)
        out.append(logits)
    return out


_EAGLE3_TENSORS = [("fc", "fc.weight"), ("output_norm", "output_norm.weight"),
                   ("blk.attn_norm", "blk.0.attn_norm.weight"), ("blk.hidden_norm", "blk.0.attn_norm_2.weight"),
                   ("blk.wq", "blk.0.attn_q.weight"), ("blk.wk", "blk.0.attn_k.weight"),
                   ("blk.wv", "blk.0.attn_v.weight"), ("blk.wo", "blk.0.attn_output.weight"),
                   ("blk.ffn_norm", "blk.0.ffn_norm.weight"), ("blk.gate", "blk.0.ffn_gate.weight"),
                   ("blk.up", "blk.0.ffn_up.weight"), ("blk.down", "blk.0.ffn_down.weight")]


def write_eagle3_gguf(path, params: dict, ecfg: Eagle3Config, name: str = "trained-tiny-eagle3") -> Path:
    """An ``eagle3`` draft as pyllama_spec.devtools.tiny.write_eagle3_draft lays one out (no d2t: it
    borrows the target's token embedding and output head)."""
    w = GGUFWriter()
    _add_hparams(w, "eagle3", 1, ecfg.n_ff, None)
    w.add_string("general.name", name)
    w.add_array("eagle3.target_layers", ValueType.INT32, list(ecfg.target_layers))
    w.add_uint32("eagle3.target_hidden_size", N_EMBD)
    tiny._add_tokenizer(w, merges=ecfg.merges)
    for k, t in _EAGLE3_TENSORS:
        w.add_tensor(t, params[k])
    path = Path(path)
    w.write(path)
    return path


def load_eagle3(path):
    """(TinyEagle3 module, Eagle3Config) holding the weights of an eagle3 file written here."""
    torch = _torch()
    meta, tensors = read_gguf_tensors(path)
    ecfg = Eagle3Config(target_layers=tuple(int(x) for x in meta["eagle3.target_layers"]),
                        n_ff=int(meta["eagle3.feed_forward_length"]),
                        merges=bool(len(meta.get("tokenizer.ggml.merges", []))))
    draft = make_eagle3(ecfg)
    draft.load_state_dict({k: torch.from_numpy(tensors[t].copy()) for k, t in _EAGLE3_TENSORS})
    return draft.eval(), ecfg


@dataclass
class ImageContinuations:
    """Sequences [``MEDIA_MARKER + "\\n"`` (or another prompt around the marker) with a picture, a corpus
    prompt, the target's greedy continuation of it], decoded by the trained target in llama.cpp, with every row's target layer
    inputs. The rows up to the picture's last one (its "head") do not depend on what follows, so
    they are kept once per picture; the text after it per sequence. ``rows`` lays a sequence out as
    the EAGLE3 drafter holds it, in either ``draft_positions`` mode, with its own ``_lay_out``."""

    head_tokens: list  # per picture: own tokens of the rows before the text (the media token on image rows)
    head_feats: list  # per picture: their layer inputs [n, n_in]
    head_pos: list  # per picture: their target positions (section 0; an image's rows share its first)
    n_image: list  # per picture: image rows
    n_pos: list  # per picture: positions the image spans
    picture: np.ndarray  # [N]: the picture of each sequence
    tokens: np.ndarray  # [N, n_post]: the text after the picture
    feats: np.ndarray  # [N, n_post, n_in]
    greedy: np.ndarray  # [N, n_post]: the target's argmax after each text row

    def __len__(self) -> int:
        return len(self.picture)

    def rows(self, i: int, mode: str):
        """(own tokens, feats, greedy (-1: none), 1-D draft positions) of sequence i as the drafter
        lays it out in ``mode`` (drafters/eagle3.py: _positions, _lay_out)."""
        from pyllama_spec.drafters.eagle3 import _lay_out, _Rows

        p = int(self.picture[i])
        n_head, n_img, n_post = len(self.head_tokens[p]), self.n_image[p], self.tokens.shape[1]
        n_pre = n_head - n_img
        tokens = np.concatenate([self.head_tokens[p], self.tokens[i]])
        greedy = np.concatenate([np.full(n_head, -1, np.int32), self.greedy[i]])
        if mode == "target":
            a = int(self.head_pos[p][n_pre])
            pos = np.concatenate([self.head_pos[p], a + self.n_pos[p] + np.arange(n_post)]).astype(np.int32)
            pinned = np.arange(n_head + n_post) >= n_pre
            pinned[n_head:] = False
        else:
            pos = np.arange(n_head + n_post, dtype=np.int32)
            pinned = np.zeros(n_head + n_post, bool)
        # lay out row indices (carried as the one-column "g") to know which row went where
        index = np.arange(len(tokens), dtype=np.float32)[:, None]
        placed, n_placed = _lay_out(_Rows(tokens.astype(np.int32), index, pos, pinned), None)
        assert n_placed == len(tokens)
        src = placed.g[:, 0].astype(np.int64)
        feats = np.concatenate([self.head_feats[p], self.feats[i]])[src]
        return placed.tokens, feats, greedy[src], placed.pos


def generate_image_continuations(target_gguf, mmproj_gguf, toks: np.ndarray, images: list[np.ndarray], n_seqs: int,
                                 prompt_len: int, gen_len: int, target_layers, seed: int,
                                 log=print, prompt: str | None = None, one_each: bool = False) -> ImageContinuations:
    """n_seqs sequences [picture, corpus prompt, greedy continuation] decoded by the trained target in
    llama.cpp, with the layer inputs ``target_layers`` of every row (see ImageContinuations).
    ``prompt`` and ``one_each`` as for generate_image_sequences."""
    from pyllama_spec.bindings.context import Context
    from pyllama_spec.bindings.model import Model
    from pyllama_spec.bindings.mtmd import MEDIA_MARKER, Bitmap, Projector
    from pyllama_spec.drafters.eagle3 import media_token

    _check_pictures(images, n_seqs, one_each)
    rng = np.random.default_rng(seed + 43)
    lids = list(target_layers)
    t0 = time.time()
    with Model(target_gguf) as m, Projector(mmproj_gguf, m, n_threads=1) as proj:
        media = media_token(m)
        prepared = []
        for img in images:
            chunks = proj.tokenize(prompt or MEDIA_MARKER + "\n", [Bitmap(img)])
            if [c.type for c in chunks] != ["text", "image", "text"]:
                raise RuntimeError(f"unexpected chunk layout for an image prompt: {[c.type for c in chunks]}")
            prepared.append((chunks, proj.encode(chunks[1])))
        n_pre = len(prepared[0][0][0].tokens)
        n_post = len(prepared[0][0][2].tokens) + prompt_len + gen_len
        n_in = len(lids) * N_EMBD
        heads = [None] * len(images)
        out = ImageContinuations(head_tokens=[], head_feats=[], head_pos=[], n_image=[], n_pos=[],
                                 picture=np.zeros(n_seqs, np.int64), tokens=np.zeros((n_seqs, n_post), np.int32),
                                 feats=np.zeros((n_seqs, n_post, n_in), np.float32),
                                 greedy=np.zeros((n_seqs, n_post), np.int32))
        max_rows = max(c[1].n_tokens for c, _ in prepared)
        with Context(m, n_ctx=n_pre + max_rows + n_post + 16, n_batch=512, n_ubatch=512, n_threads=1,
                     flash_attn=False) as ctx:
            ctx.enable_layer_inputs(lids)

            def features(n):
                return np.concatenate([ctx.layer_input(lid, n) for lid in lids], axis=1)

            for i in range(n_seqs):
                p = i if one_each else int(rng.integers(0, len(images)))
                s = int(rng.integers(0, len(toks) - prompt_len))
                chunks, embd = prepared[p]
                pre, chunk, post_start = chunks[0].tokens, chunks[1], chunks[2].tokens
                ctx.memory.clear()
                ctx.decode_tokens(pre, np.arange(n_pre), outputs=True)
                head = [features(n_pre).copy()]
                pos = proj.decode_media(ctx, chunk, embd, n_pre, n_batch=ctx.n_batch,
                                        on_batch=lambda b, head=head: head.append(features(b.n_rows).copy()))
                if heads[p] is None:  # the same rows each time: keep them once
                    section0 = chunk.decoder_positions(n_pre)[:, 0]
                    heads[p] = (np.concatenate([pre, np.full(chunk.n_tokens, media)]).astype(np.int32),
                                np.concatenate(head), np.concatenate([np.arange(n_pre), section0]).astype(np.int32),
                                chunk.n_tokens, pos - n_pre)
                post = np.concatenate([post_start, toks[s:s + prompt_len]]).astype(np.int32)
                n_p = len(post)
                ctx.decode_tokens(post, pos + np.arange(n_p), outputs=True)
                out.picture[i] = p
                out.tokens[i, :n_p] = post
                out.feats[i, :n_p] = features(n_p)
                out.greedy[i, :n_p] = ctx.output_logits(n_p).argmax(-1)
                for j in range(n_p, n_post):
                    t = int(out.greedy[i, j - 1])
                    ctx.decode_tokens([t], [pos + j], outputs=True)
                    out.tokens[i, j] = t
                    out.feats[i, j] = features(1)[0]
                    out.greedy[i, j] = int(np.argmax(ctx.logits(-1)))
                if i % 128 == 0:
                    log(f"image continuations: {i}/{n_seqs} ({time.time() - t0:.0f}s)")
    empty = (np.zeros(0, np.int32), np.zeros((0, n_in), np.float32), np.zeros(0, np.int32), 0, 0)
    for tokens, feats, pos, n_image, n_pos in (h or empty for h in heads):  # pictures never drawn stay empty
        out.head_tokens.append(tokens)
        out.head_feats.append(feats)
        out.head_pos.append(pos)
        out.n_image.append(n_image)
        out.n_pos.append(n_pos)
    return out


def target_features(target, seqs: np.ndarray, layers, batch: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """The PyTorch target's layer inputs ``layers`` (side by side) [N, T, n_in] and greedy choices
    [N, T] for token sequences [N, T] (computed once: the draft's training reads them many times)."""
    torch = _torch()
    feats, greedy = [], []
    with torch.no_grad():
        for s in range(0, len(seqs), batch):
            logits, f = target(torch.from_numpy(seqs[s:s + batch].astype(np.int64)), layer_ids=layers)
            feats.append(torch.cat([f[lid] for lid in layers], dim=-1).numpy())
            greedy.append(logits.argmax(-1).numpy().astype(np.int32))
    return np.concatenate(feats), np.concatenate(greedy)


@dataclass
class Eagle3Data:
    """EAGLE3 training sequences: corpus windows (features from the PyTorch target), windows of the
    target's greedy text (``gen``, with ``gen_feats`` = target_features(gen)), and (``images``)
    greedy text after a picture in either mode."""

    toks: np.ndarray
    gen: np.ndarray | None = None
    gen_share: float = 0.0
    images: ImageContinuations | None = None
    image_share: float = 0.0
    image_modes: tuple = ("target", "sequential")
    gen_feats: tuple | None = None  # (feats [N, T, n_in], greedy [N, T]) of gen

    def sample(self, rng, batch: int, seq: int) -> list[tuple]:
        """batch sequences (own tokens, feats or None, greedy or None, positions)."""
        rows = []
        for _ in range(batch):
            if self.images is not None and rng.random() < self.image_share:
                i = int(rng.integers(0, len(self.images)))
                rows.append(self.images.rows(i, self.image_modes[int(rng.integers(0, len(self.image_modes)))]))
                continue
            if self.gen is not None and rng.random() < self.gen_share:
                i = int(rng.integers(0, len(self.gen)))
                o = int(rng.integers(0, self.gen.shape[1] - seq + 1))
                f, g = self.gen_feats[0][i, o:o + seq], self.gen_feats[1][i, o:o + seq]
                rows.append((self.gen[i, o:o + seq].astype(np.int32), f, g, np.arange(seq, dtype=np.int32)))
                continue
            s = int(rng.integers(0, len(self.toks) - seq - 1))
            rows.append((self.toks[s:s + seq].astype(np.int32), None, None, np.arange(seq, dtype=np.int32)))
        return rows


def _eagle3_step_data(target, rng, data: Eagle3Data, ecfg: Eagle3Config, batch, seq, n_anchors):
    """One batch, as groups of sequences of one length (text; after a picture), each a tuple
    (partners [B, T + steps - 1], feats [B, T, n_in], pos [B, T], key_ok [B, T], anchors [B, A],
    labels [steps, B, A]).  A row's partner is the next row's own token; the label of chain step j
    from anchor a is the target's greedy choice after row a + 1 + j (-100 where that row is not text,
    or a row between is not)."""
    torch = _torch()
    steps = ecfg.ttt_steps
    rows = data.sample(rng, batch, seq)
    text = [k for k, r in enumerate(rows) if r[1] is None]
    if text:
        x = torch.from_numpy(np.stack([rows[k][0] for k in text]).astype(np.int64))
        with torch.no_grad():
            logits, f = target(x, layer_ids=ecfg.target_layers)
        feats = torch.cat([f[lid] for lid in ecfg.target_layers], dim=-1).numpy()
        greedy = logits.argmax(-1).numpy()
        for n, k in enumerate(text):
            rows[k] = (rows[k][0], feats[n], greedy[n], rows[k][3])
    # sequences of one length together (text windows; sequences after a picture): less padding
    groups = []
    for members in ([k for k in range(len(rows)) if len(rows[k][0]) == seq],
                    [k for k in range(len(rows)) if len(rows[k][0]) != seq]):
        if not members:
            continue
        n_rows = [len(rows[k][0]) - 1 for k in members]  # the last row has no partner yet
        T, B = max(n_rows), len(members)
        n_in = rows[members[0]][1].shape[1]
        partners = np.zeros((B, T + steps - 1), np.int64)
        feats = np.zeros((B, T, n_in), np.float32)
        pos = np.zeros((B, T), np.int64)
        key_ok = np.zeros((B, T), bool)
        labels = np.full((steps, B, n_anchors), -100, np.int64)
        anchors = np.zeros((B, n_anchors), np.int64)
        for b, (k, n) in enumerate(zip(members, n_rows)):
            own, f, gr, p = rows[k]
            partners[b, :n] = own[1:]
            feats[b, :n], pos[b, :n], key_ok[b, :n] = f[:n], p[:n], True
            pos[b, n:] = p[n - 1] + 1 + np.arange(T - n)  # padding: after every real row (never a key)
            # y[r]: the target's choice after row r, for text rows; a chain through a non-text row is void
            y = np.where(gr >= 0, gr, -100).astype(np.int64)
            ok = np.cumsum(gr < 0)  # non-text rows up to r
            valid = [a for a in range(n) if y[a + 1] >= 0 and ok[a + 1] == ok[a]]
            pick = rng.choice(valid, min(n_anchors, len(valid)), replace=False) if valid else []
            anchors[b, :len(pick)] = pick
            for c, a in enumerate(pick):
                for j in range(steps):
                    r = a + 1 + j
                    if r > n or y[r] < 0 or ok[r] != ok[a]:
                        break
                    labels[j, b, c] = y[r]
        groups.append(tuple(torch.from_numpy(v) for v in (partners, feats, pos, key_ok, anchors, labels)))
    return groups


def _eagle3_group_loss(draft, target, group, ecfg, weights):
    """(weighted loss, per-step (loss sum, correct, count), correct [steps, B, A] bool) of one group."""
    torch = _torch()
    F = torch.nn.functional
    partners, feats, pos, key_ok, anchors, labels = group
    logits = eagle3_chain_logits(draft, target.tok_embd, target.output, partners, feats, pos, key_ok, anchors,
                                 ecfg.ttt_steps)
    total, stats, correct = 0.0, [], []
    for j, lg in enumerate(logits):
        lab = labels[j].reshape(-1)
        n = int((lab >= 0).sum())
        lsum = F.cross_entropy(lg.reshape(-1, N_VOCAB), lab, ignore_index=-100, reduction="sum")
        hit = (lg.argmax(-1) == labels[j]) & (labels[j] >= 0)
        correct.append(hit)
        total = total + weights[j] * lsum / max(1, n)
        stats.append((float(lsum.detach()), int(hit.sum()), n))
    return total, stats, torch.stack(correct)


def train_eagle3(draft, target, data: Eagle3Data, held: dict, ecfg, *, steps, seconds, batch, seq, n_anchors, seed,
                 log):
    """AdamW on the chain loss (step j weighted 0.8^j, as EAGLE-3): the draft learns the target's
    greedy choice from the target's features at step 0 and from its own outputs after."""
    torch = _torch()
    rng = np.random.default_rng(seed + 29)
    for p in target.parameters():
        p.requires_grad_(False)
    weights = [0.8 ** j for j in range(ecfg.ttt_steps)]
    weights = [w / sum(weights) for w in weights]
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    t0, c0, step, losses = time.time(), time.process_time(), 0, []
    for step in range(steps):
        if time.time() - t0 > seconds:
            log(f"eagle3: time budget reached at step {step}")
            break
        for g in opt.param_groups:
            g["lr"] = _lr(step, steps, 3e-3)
        groups = _eagle3_step_data(target, rng, data, ecfg, batch, seq, n_anchors)
        loss = sum(_eagle3_group_loss(draft, target, grp, ecfg, weights)[0] * grp[0].shape[0] for grp in groups) / batch
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0:
            log(f"eagle3 step {step} loss {np.mean(losses[-50:]):.3f} ({time.time() - t0:.0f}s)")
    info = dict(steps=step + 1, seconds=round(time.time() - t0, 1), cpu_seconds=round(time.process_time() - c0, 1),
                train_loss=float(np.mean(losses[-50:])))
    for name, d in held.items():
        info[name] = eval_eagle3(draft, target, d, ecfg, seq, n_anchors, seed)
    return info


def eval_eagle3(draft, target, data: Eagle3Data, ecfg, seq, n_anchors, seed, batch=16):
    """Held out, teacher-forced chains: loss and agreement with the target per chain step, and the
    mean leading steps that all agree (the accepted length of a draft of ttt_steps tokens)."""
    torch = _torch()
    rng = np.random.default_rng(seed + 79)
    weights = [1.0] * ecfg.ttt_steps
    lsum, hits, counts, runs = np.zeros(ecfg.ttt_steps), np.zeros(ecfg.ttt_steps), np.zeros(ecfg.ttt_steps), []
    with torch.no_grad():
        for grp in _eagle3_step_data(target, rng, data, ecfg, batch, seq, n_anchors):
            _, stats, correct = _eagle3_group_loss(draft, target, grp, ecfg, weights)
            for j, (ls, h, n) in enumerate(stats):
                lsum[j] += ls
                hits[j] += h
                counts[j] += n
            full = grp[5][-1] >= 0  # anchors whose whole chain is labelled
            runs.append(correct.long().cumprod(0).sum(0)[full].float())
    return dict(loss=round(float(lsum.sum() / counts.sum()), 3),
                step_agreement=[round(float(h / max(1, n)), 2) for h, n in zip(hits, counts)],
                mean_accepted_chain=round(float(torch.cat(runs).mean()), 2))


# ----------------------------------------------------------------------------- draft VLM (--draft-vlm)

def train_draft_vlm(vlm, teacher, toks, held, *, steps, seconds, batch, seq, seed, log, images, teacher_images,
                    held_images, held_teacher_images, image_share, image_text):
    """The target's recipe (corpus windows; a share of the batches with a picture first, the picture
    through the VLM's own projector) with the target as teacher: the loss is the KL divergence from
    the target's next-token distribution (the teacher sees the same picture through its projector)
    on the text rows, so the small model learns to guess what the target will say."""
    torch = _torch()
    rng = np.random.default_rng(seed + 17)
    img_rng = np.random.default_rng(seed + 19)
    for p in teacher.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(vlm.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    t0, c0, step, losses = time.time(), time.process_time(), 0, []
    for step in range(steps):
        if time.time() - t0 > seconds:
            log(f"draft VLM: time budget reached at step {step}")
            break
        for g in opt.param_groups:
            g["lr"] = _lr(step, steps, 3e-3)
        if img_rng.random() < image_share:
            batch_data = image_text_batch(img_rng, toks, images, batch, image_text, teacher=teacher_images)
        else:
            batch_data = (_batch(rng, toks, batch, seq + 1),)
        loss = _distill_loss(vlm, teacher, *batch_data)[0]
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vlm.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 100 == 0:
            log(f"draft VLM step {step} KL {np.mean(losses[-100:]):.3f} ({time.time() - t0:.0f}s)")
    info = dict(steps=step + 1, seconds=round(time.time() - t0, 1), cpu_seconds=round(time.process_time() - c0, 1),
                train_kl=float(np.mean(losses[-100:])),
                held_out_loss=eval_target(vlm, held, seq, seed),
                held_out_loss_after_image=eval_target_after_images(vlm, held, held_images, image_text, seed))
    erng = np.random.default_rng(seed + 97)
    with torch.no_grad():
        text = [_distill_loss(vlm, teacher, _batch(erng, held, 16, seq + 1))]
        image = [_distill_loss(vlm, teacher, *image_text_batch(erng, held, held_images, 1, image_text,
                                                               teacher=held_teacher_images)) for _ in range(16)]
    info["held_out_kl"], info["held_out_agreement"] = round(float(text[0][0]), 3), round(text[0][1], 3)
    info["held_out_kl_after_image"] = round(float(np.mean([float(k) for k, _ in image])), 3)
    info["held_out_agreement_after_image"] = round(float(np.mean([a for _, a in image])), 3)
    return info


def _distill_loss(student, teacher, x, pos=None, embd=None, teacher_embd=None):
    """(KL(teacher || student) per text row, share of those rows where both argmaxes agree) for a
    batch of corpus windows x [B, T + 1], or of [picture, text] (image_text_batch with a teacher)."""
    torch = _torch()
    F = torch.nn.functional
    B, T = x.shape[0], x.shape[1] - 1
    kw_s, kw_t = {}, {}
    if pos is not None:
        pos = pos[None].expand(B, T, 4)
        kw_s = dict(embd=embd[None].expand(B, T, embd.shape[-1]))
        kw_t = dict(embd=teacher_embd[None].expand(B, T, teacher_embd.shape[-1]))
    with torch.no_grad():
        t_logits, _ = teacher(x[:, :-1], pos, **kw_t)
    s_logits, _ = student(x[:, :-1], pos, **kw_s)
    rows = x[:, 1:] >= 0  # rows whose next row is text: what a draft guesses
    t_logp = F.log_softmax(t_logits[rows], -1)
    s_logp = F.log_softmax(s_logits[rows], -1)
    kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()
    agree = float((t_logp.argmax(-1) == s_logp.argmax(-1)).float().mean())
    return kl, agree


# ----------------------------------------------------------------------------- main

README = """# Trained tiny target and its drafts

Small GGUF files trained on CPU by `tools/train_tiny_pair.py` (PyTorch, training only), so that
tests can show real draft acceptance (random weights accept nothing).

* `trained-target.gguf`: `hunyuan_vl` (M-RoPE sections [2, 3, 3, 0]), {target_n_layer} layers, n_embd 64,
  4 heads x 16 (2 KV heads), n_ff {target_n_ff}, the package's tiny byte-level tokenizer (`pyllama_spec.devtools.tiny`).
* `trained-draft.gguf`: `dflash`, {draft_n_layer} layers, n_ff {draft_n_ff}, target_layers {target_layers},
  block_size {block_size}, sliding window {sliding_window}, non-causal; borrows the target's token embedding
  and output head.
* `trained-mmproj.gguf`: `pyllama_spec.devtools.tiny.write_mmproj(seed={seed})` (random `qwen2vl_merger`
  projector, untrained), so image prompts run.
* `trained-eagle3.gguf` (an EAGLE3 draft) and `trained-draft-vlm.gguf` with `trained-draft-vlm-mmproj.gguf`
  (a small draft VLM and its own projector): trained for this target by `--eagle3` and `--draft-vlm`
  runs, see their sections below.

## Command

```
pip install torch==2.13.0
python tools/train_tiny_pair.py {argv}
```

Seed {seed}; torch {torch_version}, {threads} thread(s). {capped}

## Corpus

`{corpus}` (Python {py}), sorted by name; every {every}th file (index % {every} == 0) held out:
{n_train} training files ({n_train_tok} tokens), {n_held} held-out files ({n_held_tok} tokens).
Tokens come from llama.cpp's tokenizer on these files (no special tokens).

## Training

* target: {t_steps} steps of batch {batch} x {seq} tokens, AdamW, {t_sec} s; {target_image_share} of the
  batches (drawn at random) are instead [one of {images} synthetic pictures (`image_pool`, see below), then
  {image_text} corpus tokens], loss on the text rows only, so that, like a vision-language model, the
  target reads text after a picture as well as without one;
  train loss {t_loss:.3f}, held-out loss {t_held:.3f} nats/token; {t_held_img:.3f} after one of 16 held-out pictures.
* draft data: {gen_seqs} random {gen_prompt}-token corpus prompts, each continued greedily for {gen_len} tokens
  by the trained target (llama.cpp); {gen_share} of the draft's training rows are windows of these,
  the rest corpus windows.
* image data ({image_share} of the draft's training rows, half in each `draft_positions` mode):
  {image_seqs} sequences `<__media__>` + a picture (one of {images} synthetic ones from `image_pool`:
  flat colours, gradients, noise, checkerboards, rectangles; 112..672 pixels a side) + "\\n" + a
  {gen_prompt}-token corpus prompt continued greedily for {gen_len} tokens, all decoded by the trained
  target in llama.cpp, whose layer inputs are the draft's context. In "target" mode the draft holds
  the text rows at the target's positions (the image's rows are skipped, its positions jumped);
  in "sequential" mode it also holds the image's rows, at consecutive positions.
* draft (DFlash objective: blocks [anchor, mask x (L - 1)], L drawn from {lengths} (the engine's
  draft_max + 1), at {n_blocks} anchors per sequence; context = target layer inputs {target_layers}
  before the anchor through `fc` + `enc.output_norm`, SWA window {sliding_window}; labels = the target's
  greedy choices): {d_steps} steps of batch {d_batch} x {d_seq}, {d_sec} s; train loss {d_loss:.3f}.
  Held out, full blocks of {block_size}, teacher-forced (loss; agreement with the target per block row
  1..{bm1}; mean leading rows all agreeing):
  * corpus text: {ht[loss]}; {ht[row_agreement]}; {ht[mean_accepted_full_block]}
  * the target's greedy continuations of held-out prompts: {hg[loss]}; {hg[row_agreement]};
    {hg[mean_accepted_full_block]}
{held_images}
Total wall time {total} s. Parity with llama.cpp: `tests/test_trained_pair.py`.
"""


# checked for the committed trained-eagle3 / trained-draft-vlm files by running each command twice
DETERMINISTIC = (" Deterministic for a seed, thread count and machine: two runs of the committed "
                 "files' command gave byte-identical files.")

EAGLE3_README = """## EAGLE3 draft (`trained-eagle3.gguf`)

`eagle3` (llama.cpp's src/models/eagle3.cpp): an encoder `fc` over the inputs of target layers
{layers} (side by side, 3 x 64 -> 64), then one decoder layer (4 heads x 16, 2 KV heads, n_ff {n_ff},
plain 1-D rope) over [token embedding | g]; no `d2t`: it borrows the target's token embedding and
output head. Trained for the committed `trained-target.gguf` (loaded, not retrained); drafts with
`spec_type="draft-eagle3"`.

```
pip install torch==2.13.0
python tools/train_tiny_pair.py {argv}
```

Seed {seed}; torch {torch_version}, {threads} thread(s). {capped} Wall time {total} s: data {data_s} s,
training {train_s} s ({cpu_s} s of CPU; the machine was shared).

* data: {gen_seqs} random {gen_prompt}-token corpus prompts of the training files, each continued greedily
  for {gen_len} tokens by the target (llama.cpp); {gen_share} of the text sequences are windows of these,
  the rest corpus windows (features and labels from the PyTorch target).
  {image_seqs} sequences `<__media__>` + a picture (one of {images} from `image_pool`, as for the DFlash
  draft) + "\\n" + a {gen_prompt}-token prompt continued greedily for {gen_len} tokens, decoded by the
  target in llama.cpp, every row's layer inputs kept, the picture's rows included ({image_share} of the
  sequences, half in each `draft_positions` mode: the drafter's own layout (drafters/eagle3.py
  `_lay_out`): in "target" mode an image's rows share its positions, in "sequential" mode one row a
  position; an image row's own token is `<|image_pad|>`).
* objective (EAGLE-3 with training-time test): the row at position P is (t_(P+1), g_P), g = `fc` of
  the target's features; from {anchors} anchor rows per sequence a chain of {ttt} steps, step j >= 1
  fed the real next token and the draft's own output of step j - 1 (before the output norm) as g, at
  P + j, seeing the context rows and its own earlier steps, exactly as llama.cpp's draft() runs it;
  label of each step: the target's greedy choice; loss weight 0.8^j. AdamW, batch {batch} x {seq},
  {steps} steps, {train_s} s; train loss {loss:.3f}.
* held out (loss over all steps; agreement with the target per chain step 1..{ttt}; mean accepted
  length of a {ttt}-token chain, teacher-forced):
{held}
"""

VLM_README = """## Draft VLM (`trained-draft-vlm.gguf`, `trained-draft-vlm-mmproj.gguf`)

A smaller `hunyuan_vl` of the same vocabulary (M-RoPE sections [2, 3, 3, 0]): {n_layer} layers,
n_embd {n_embd}, {n_head} heads x 16 ({n_head_kv} KV head(s)), n_ff {n_ff}; its own projector
`trained-draft-vlm-mmproj.gguf` = `pyllama_spec.devtools.tiny.write_mmproj(target_n_embd={n_embd},
seed={mmproj_seed})` (random `qwen2vl_merger`, untrained; same patch grid as `trained-mmproj.gguf`, so
both cut a picture into the same rows). A draft model (`spec_type="draft-simple"`) that can see the
picture through its own projector.

```
pip install torch==2.13.0
python tools/train_tiny_pair.py {argv}
```

Seed {seed}; torch {torch_version}, {threads} thread(s). {capped} Wall time {total} s.

* trained on the target's data (corpus windows of {seq} tokens, batch {batch}; {image_share_t} of the
  batches [one of {images} pictures from `image_pool` through its own projector, then {image_text}
  corpus tokens]; the target had 0.25: a small model needs more pictures to read text after one as
  well as without), distilled from the target: loss = KL(target || draft) of the next-token
  distribution on the text rows (the target sees the same picture through `trained-mmproj.gguf`).
  AdamW, {steps} steps, {sec} s ({cpu_s} s of CPU); train KL {kl:.3f}.
* held out: corpus loss {held_loss:.3f} nats/token ({held_loss_img:.3f} after one of 16 held-out pictures;
  the target: {t_held:.3f} / {t_held_img:.3f}); KL from the target {held_kl} ({held_kl_img} after a
  picture); argmax agreement with the target {agree} ({agree_img} after a picture).
"""


def _set_readme_section(readme: Path, text: str) -> None:
    """Put ``text`` (a "## " section) in README.md in place of its old version, else before the
    "## Measured" sections (else at the end)."""
    title = text.split("\n", 1)[0]
    old = readme.read_text().rstrip("\n") if readme.exists() else ""
    sections = old.split("\n\n## ")
    sections = [sections[0]] + ["## " + x for x in sections[1:]]
    at = next((i for i, x in enumerate(sections) if x.split("\n", 1)[0] == title), None)
    if at is not None:
        sections[at] = text.rstrip("\n")
    else:
        at = next((i for i, x in enumerate(sections) if x.startswith("## Measured")), len(sections))
        sections.insert(at, text.rstrip("\n"))
    readme.write_text("\n\n".join(sections) + "\n")


def _kept_readme_parts(readme: Path) -> tuple[list[str], list[str]]:
    """What a new target's README keeps of the old one: the --eagle3 / --draft-vlm runs' sections (their
    files are not rewritten here), and the other tools' documents after this one (each from a "# "
    heading: the qwen35 target's, the reading world's), as they are. Its "## Measured" sections go:
    they measured the old files."""
    old = readme.read_text().rstrip("\n") if readme.exists() else ""
    docs = old.split("\n\n# ")
    kept = [x for x in docs[0].split("\n\n## ")[1:] if x.startswith(("EAGLE3 draft", "Draft VLM"))]
    return kept, ["# " + d for d in docs[1:]]


def train_drafts_for_target(args, out: Path, toks, held, corpus: dict, log) -> int:
    """--eagle3 / --draft-vlm: drafts for the trained target ``--target-from`` (not retrained), each
    written with its section of README.md."""
    torch = _torch()
    target_path = Path(args.target_from)
    mmproj_path = target_path.with_name("trained-mmproj.gguf")
    if not mmproj_path.exists():
        raise SystemExit(f"{mmproj_path} (the target's projector) not found beside {target_path}")
    target, _, _ = load_pair(target_path)
    shown = "python tools/train_tiny_pair.py " + " ".join(sys.argv[1:])
    threads = torch.get_num_threads()
    seconds = args.minutes * 60
    if args.eagle3:
        t0 = time.time()
        ecfg = Eagle3Config(ttt_steps=args.eagle3_ttt)
        gen = generate_greedy(target_path, toks, args.eagle3_gen_seqs, args.gen_prompt, args.gen_len, args.seed, log)
        gen_held = generate_greedy(target_path, held, 32, args.gen_prompt, args.gen_len, args.seed + 1, log)
        gen_f = target_features(target, gen, ecfg.target_layers)
        data = Eagle3Data(toks, gen, args.gen_share, gen_feats=gen_f)
        held_sets = {"held_out_text": Eagle3Data(held), "held_out_greedy": Eagle3Data(
            held, gen_held, 1.0, gen_feats=target_features(target, gen_held, ecfg.target_layers))}
        if args.eagle3_image_seqs:
            imgs = generate_image_continuations(target_path, mmproj_path, toks, image_pool(args.images, args.seed),
                                                args.eagle3_image_seqs, args.gen_prompt, args.gen_len,
                                                ecfg.target_layers, args.seed, log)
            imgs_held = generate_image_continuations(target_path, mmproj_path, held, image_pool(16, args.seed + 1000),
                                                     32, args.gen_prompt, args.gen_len, ecfg.target_layers,
                                                     args.seed + 1, log)
            data = Eagle3Data(toks, gen, args.gen_share, imgs, args.image_share, gen_feats=gen_f)
            for mode in ("target", "sequential"):
                held_sets[f"held_out_image_{mode}"] = Eagle3Data(held, images=imgs_held, image_share=1.0,
                                                                 image_modes=(mode,))
        data_s = time.time() - t0
        log(f"eagle3 data: {len(gen)} greedy text, {args.eagle3_image_seqs} after a picture ({data_s:.0f}s)")
        torch.manual_seed(args.seed + 2)
        draft = make_eagle3(ecfg)
        info = train_eagle3(draft, target, data, held_sets, ecfg, steps=args.eagle3_steps, seconds=seconds,
                            batch=args.eagle3_batch, seq=args.draft_seq, n_anchors=args.eagle3_anchors,
                            seed=args.seed, log=log)
        log(f"eagle3: {json.dumps(info)}")
        draft.eval()
        write_eagle3_gguf(out / "trained-eagle3.gguf", {k: _np(v) for k, v in draft.state_dict().items()}, ecfg)
        names = {"held_out_text": "corpus text", "held_out_greedy": "the target's greedy continuations of held-out prompts",
                 "held_out_image_target": "the same after one of 16 held-out pictures, \"target\" mode",
                 "held_out_image_sequential": "the same after one of 16 held-out pictures, \"sequential\" mode"}
        _set_readme_section(out / "README.md", EAGLE3_README.format(
            layers=ecfg.target_layers, n_ff=ecfg.n_ff, argv=shown.split(" ", 2)[2], seed=args.seed,
            torch_version=torch.__version__, threads=threads,
            capped=("All steps ran (not stopped by --minutes)." + DETERMINISTIC if info["steps"] == args.eagle3_steps
                    else "**Stopped by the --minutes cap**: the step count above is what ran."),
            total=round(time.time() - t0), data_s=round(data_s), train_s=info["seconds"], gen_seqs=len(gen),
            gen_prompt=args.gen_prompt, gen_len=args.gen_len, gen_share=args.gen_share,
            image_seqs=args.eagle3_image_seqs, images=args.images, image_share=args.image_share,
            anchors=args.eagle3_anchors, ttt=ecfg.ttt_steps, batch=args.eagle3_batch, seq=args.draft_seq,
            steps=info["steps"], loss=info["train_loss"], cpu_s=info["cpu_seconds"],
            held="\n".join(f"  * {names[k]}: {v['loss']}; {v['step_agreement']}; {v['mean_accepted_chain']}"
                           for k, v in info.items() if k in names)))
        log(f"wrote {out}/trained-eagle3.gguf and its README section")
    if args.draft_vlm:
        t0 = time.time()
        vcfg = PairConfig(target_n_layer=args.vlm_layers, target_n_ff=args.vlm_ff, n_embd=args.vlm_embd,
                          n_head=args.vlm_heads, n_head_kv=args.vlm_heads_kv)
        if vcfg.n_head * HEAD_DIM != vcfg.n_embd:
            raise SystemExit(f"--vlm-embd must be --vlm-heads x {HEAD_DIM}")
        mmproj_seed = args.seed + 1  # another projector than the target's (seed args.seed)
        vlm_mmproj = tiny.write_mmproj(out / "trained-draft-vlm-mmproj.gguf", target_n_embd=vcfg.n_embd,
                                       seed=mmproj_seed)
        with tempfile.TemporaryDirectory() as tmp:
            probe = _tokenizer_only_gguf(Path(tmp), vcfg)  # a model of the VLM's width, for its projector
            pictures = encode_images(probe, vlm_mmproj, image_pool(args.images, args.seed))
            held_pictures = encode_images(probe, vlm_mmproj, image_pool(16, args.seed + 1000))
        t_pictures = encode_images(target_path, mmproj_path, image_pool(args.images, args.seed))
        t_held_pictures = encode_images(target_path, mmproj_path, image_pool(16, args.seed + 1000))
        for a, b in zip(pictures + held_pictures, t_pictures + t_held_pictures):
            if not (np.array_equal(a.pos, b.pos) and np.array_equal(a.pre, b.pre) and np.array_equal(a.post, b.post)):
                raise SystemExit("the two projectors cut a picture differently")
        torch.manual_seed(args.seed + 3)
        vlm = make_target(vcfg)
        info = train_draft_vlm(vlm, target, toks, held, steps=args.vlm_steps, seconds=seconds, batch=args.batch,
                               seq=args.seq, seed=args.seed, log=log, images=pictures, teacher_images=t_pictures,
                               held_images=held_pictures, held_teacher_images=t_held_pictures,
                               image_share=args.vlm_image_share, image_text=args.image_text)
        log(f"draft VLM: {json.dumps(info)}")
        vlm.eval()
        write_target_gguf(out / "trained-draft-vlm.gguf", {k: _np(v) for k, v in vlm.state_dict().items()}, vcfg,
                          name="trained-tiny-hunyuan_vl-draft")
        t_held = eval_target(target, held, args.seq, args.seed)
        t_held_img = eval_target_after_images(target, held, t_held_pictures, args.image_text, args.seed)
        _set_readme_section(out / "README.md", VLM_README.format(
            n_layer=vcfg.target_n_layer, n_embd=vcfg.n_embd, n_head=vcfg.n_head, n_head_kv=vcfg.n_head_kv,
            n_ff=vcfg.target_n_ff, mmproj_seed=mmproj_seed, argv=shown.split(" ", 2)[2], seed=args.seed,
            torch_version=torch.__version__, threads=threads,
            capped=("All steps ran (not stopped by --minutes)." + DETERMINISTIC if info["steps"] == args.vlm_steps
                    else "**Stopped by the --minutes cap**: the step count above is what ran."),
            total=round(time.time() - t0), seq=args.seq, batch=args.batch, image_share_t=args.vlm_image_share,
            images=args.images, image_text=args.image_text, steps=info["steps"], sec=info["seconds"],
            cpu_s=info["cpu_seconds"],
            kl=info["train_kl"], held_loss=info["held_out_loss"], held_loss_img=info["held_out_loss_after_image"],
            t_held=t_held, t_held_img=t_held_img, held_kl=info["held_out_kl"],
            held_kl_img=info["held_out_kl_after_image"], agree=info["held_out_agreement"],
            agree_img=info["held_out_agreement_after_image"]))
        log(f"wrote {out}/trained-draft-vlm.gguf, trained-draft-vlm-mmproj.gguf and their README section")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=30.0,
                    help="wall-clock cap for both trainings (a run stopped by it is not reproducible by --seed alone)")
    ap.add_argument("--out", default="pyllama_spec/models")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1 or 2; 2 is much slower when anything else runs)")
    ap.add_argument("--target-steps", type=int, default=2200)
    ap.add_argument("--draft-steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=4, help="target batch (sequences)")
    ap.add_argument("--seq", type=int, default=512, help="target sequence length (longest in-distribution context)")
    ap.add_argument("--draft-batch", type=int, default=8)
    ap.add_argument("--draft-seq", type=int, default=384, help="= --gen-prompt + --gen-len")
    ap.add_argument("--draft-blocks", type=int, default=16, help="anchors per sequence in a draft batch")
    ap.add_argument("--gen-prompt", type=int, default=256, help="corpus tokens before each greedy continuation")
    ap.add_argument("--target-share", type=float, default=0.55, help="share of --minutes for the target")
    ap.add_argument("--gen-seqs", type=int, default=1024,
                    help="corpus prompts the target continues greedily (draft training data)")
    ap.add_argument("--gen-len", type=int, default=128, help="greedy tokens per generated sequence")
    ap.add_argument("--gen-share", type=float, default=0.75, help="share of draft training rows from them")
    ap.add_argument("--images", type=int, default=48, help="synthetic pictures the image sequences draw from")
    ap.add_argument("--image-seqs", type=int, default=1024,
                    help="greedy continuations after a picture (draft training data; 0: text only)")
    ap.add_argument("--image-share", type=float, default=0.5,
                    help="share of draft training rows from them (half in each draft_positions mode)")
    ap.add_argument("--target-image-share", type=float, default=0.25,
                    help="share of the target's training batches with a picture before the text")
    ap.add_argument("--image-text", type=int, default=384, help="corpus tokens after a picture in those batches")
    ap.add_argument("--target-from", default=None,
                    help="load this trained target GGUF instead of training one (with --eagle3 / --draft-vlm: "
                         "the target they are trained for; its trained-mmproj.gguf beside it)")
    ap.add_argument("--eagle3", action="store_true",
                    help="train an EAGLE3 draft for --target-from instead (trained-eagle3.gguf)")
    ap.add_argument("--eagle3-steps", type=int, default=2000)
    ap.add_argument("--eagle3-batch", type=int, default=8, help="sequences per EAGLE3 batch")
    ap.add_argument("--eagle3-anchors", type=int, default=48, help="chains trained per sequence")
    ap.add_argument("--eagle3-ttt", type=int, default=Eagle3Config.ttt_steps,
                    help="training-time test: chain steps per anchor (1: the target's features only)")
    ap.add_argument("--eagle3-gen-seqs", type=int, default=512,
                    help="corpus prompts the target continues greedily (EAGLE3 training data)")
    ap.add_argument("--eagle3-image-seqs", type=int, default=384,
                    help="greedy continuations after a picture (EAGLE3 training data; 0: text only)")
    ap.add_argument("--draft-vlm", action="store_true",
                    help="train a small hunyuan_vl draft VLM for --target-from instead (trained-draft-vlm.gguf "
                         "and its own projector, trained-draft-vlm-mmproj.gguf)")
    ap.add_argument("--vlm-steps", type=int, default=3000)
    ap.add_argument("--vlm-layers", type=int, default=2)
    ap.add_argument("--vlm-embd", type=int, default=48, help="width (heads of 16)")
    ap.add_argument("--vlm-heads", type=int, default=3)
    ap.add_argument("--vlm-heads-kv", type=int, default=1)
    ap.add_argument("--vlm-ff", type=int, default=192)
    ap.add_argument("--vlm-image-share", type=float, default=0.5,
                    help="share of the draft VLM's batches with a picture first (pictures with many alike rows, "
                         "e.g. a large flat one, are the hard case for a small model)")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(max(1, min(2, args.threads)))
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = PairConfig()
    t_all = time.time()

    def log(msg):
        print(f"[{time.time() - t_all:6.0f}s] {msg}", flush=True)

    train_files, held_files = corpus_files()
    with tempfile.TemporaryDirectory() as tmp:
        probe = _tokenizer_only_gguf(Path(tmp), cfg)
        toks = tokenize_files(train_files, probe)
        held = tokenize_files(held_files, probe)
    log(f"corpus: {len(train_files)} files / {len(toks)} tokens, held out {len(held_files)} / {len(held)}")
    if args.eagle3 or args.draft_vlm:
        if not args.target_from:
            ap.error("--eagle3 and --draft-vlm train drafts for a trained target: name it with --target-from")
        corpus = dict(corpus=CORPUS_GLOB, n_train=len(train_files), n_train_tok=len(toks), n_held=len(held_files),
                      n_held_tok=len(held))
        return train_drafts_for_target(args, out, toks, held, corpus, log)

    mmproj_path = tiny.write_mmproj(out / "trained-mmproj.gguf", target_n_embd=N_EMBD, seed=args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        probe = _tokenizer_only_gguf(Path(tmp), cfg)
        pictures = encode_images(probe, mmproj_path, image_pool(args.images, args.seed))
        held_pictures = encode_images(probe, mmproj_path, image_pool(16, args.seed + 1000))
    log(f"pictures: {len(pictures)} training ({sum(len(e.embd) for e in pictures)} image rows), "
        f"{len(held_pictures)} held out")

    torch.manual_seed(args.seed)
    budget = args.minutes * 60
    if args.target_from:
        target, _, _ = load_pair(args.target_from)
        t_info = dict(steps=0, seconds=0.0, train_loss=float("nan"),
                      held_out_loss=eval_target(target, held, args.seq, args.seed), loaded_from=args.target_from,
                      held_out_loss_after_image=eval_target_after_images(target, held, held_pictures, args.image_text,
                                                                         args.seed))
    else:
        target = make_target(cfg)
        t_info = train_target(target, toks, held, steps=args.target_steps, seconds=budget * args.target_share,
                              batch=args.batch, seq=args.seq, seed=args.seed, log=log, images=pictures,
                              held_images=held_pictures, image_share=args.target_image_share,
                              image_text=args.image_text)
    log(f"target: {t_info}")
    target.eval()
    target_path = write_target_gguf(out / "trained-target.gguf",
                                    {k: _np(v) for k, v in target.state_dict().items()}, cfg)

    gen_prompt = args.gen_prompt
    gen = generate_greedy(target_path, toks, args.gen_seqs, gen_prompt, args.gen_len, args.seed, log)
    gen_held = generate_greedy(target_path, held, 64, gen_prompt, args.gen_len, args.seed + 1, log)
    log(f"greedy data: {gen.shape} training, {gen_held.shape} held out")
    data = DraftData(toks, gen, args.gen_share)
    held_sets = {"held_out_text": DraftData(held), "held_out_greedy": DraftData(held, gen_held, 1.0)}
    if args.image_seqs:
        # pictures and text the draft is evaluated on come from other seeds / held-out files
        imgs = generate_image_sequences(target_path, mmproj_path, toks, image_pool(args.images, args.seed),
                                        args.image_seqs, gen_prompt, args.gen_len, cfg, args.seed, log)
        imgs_held = generate_image_sequences(target_path, mmproj_path, held, image_pool(16, args.seed + 1000),
                                             64, gen_prompt, args.gen_len, cfg, args.seed + 1, log)
        log(f"image data: {imgs.tokens.shape} training, {imgs_held.tokens.shape} held out")
        data = DraftData(toks, gen, args.gen_share, imgs, args.image_share)
        for mode in ("target", "sequential"):
            held_sets[f"held_out_image_{mode}"] = DraftData(held, images=imgs_held, image_share=1.0,
                                                            image_modes=(mode,))

    torch.manual_seed(args.seed + 1)
    draft = make_draft(cfg)
    d_info = train_draft(draft, target, data, held_sets, cfg, steps=args.draft_steps,
                         seconds=max(60.0, budget - (time.time() - t_all)), batch=args.draft_batch,
                         seq=args.draft_seq,
                         n_blocks=args.draft_blocks, seed=args.seed, log=log)
    log(f"draft: {d_info}")
    write_draft_gguf(out / "trained-draft.gguf", {k: _np(v) for k, v in draft.state_dict().items()}, cfg)

    shown = " ".join(sys.argv[1:]) if argv is None else " ".join(argv)
    if t_info["steps"] == args.target_steps and d_info["steps"] == args.draft_steps:
        capped = ("All steps ran (not stopped by --minutes). Training is deterministic for a seed, thread count "
                  "and machine (two runs of the committed files' command gave byte-identical GGUF files).")
    else:
        capped = "**Stopped by the --minutes cap**: step counts above are what ran."
    log(json.dumps(dict(config=asdict(cfg), target=t_info, draft=d_info, seed=args.seed, args=vars(args))))
    readme = out / "README.md"
    kept, others = _kept_readme_parts(readme)
    readme.write_text(README.format(
        **asdict(cfg), seed=args.seed, argv=shown, torch_version=torch.__version__, threads=torch.get_num_threads(),
        corpus=CORPUS_GLOB, py=sys.version.split()[0], every=HELD_OUT_EVERY, n_train=len(train_files),
        n_train_tok=len(toks), n_held=len(held_files), n_held_tok=len(held), t_steps=t_info["steps"],
        batch=args.batch, seq=args.seq, t_sec=t_info["seconds"], t_loss=t_info["train_loss"],
        t_held=t_info["held_out_loss"], bm1=cfg.block_size - 1, n_blocks=args.draft_blocks,
        d_steps=d_info["steps"], d_sec=d_info["seconds"], d_loss=d_info["train_loss"],
        gen_seqs=args.gen_seqs, gen_len=args.gen_len, gen_prompt=args.gen_prompt, d_batch=args.draft_batch,
        d_seq=args.draft_seq, gen_share=args.gen_share,
        ht=d_info["held_out_text"], hg=d_info["held_out_greedy"], total=round(time.time() - t_all),
        target_image_share=args.target_image_share, image_text=args.image_text,
        t_held_img=t_info.get("held_out_loss_after_image", float("nan")),
        image_share=args.image_share if args.image_seqs else 0, image_seqs=args.image_seqs, images=args.images,
        held_images="".join(
            f"  * the same after one of 16 held-out pictures, \"{mode}\" mode: {d_info[k]['loss']}; "
            f"{d_info[k]['row_agreement']};\n    {d_info[k]['mean_accepted_full_block']}\n"
            for mode in ("target", "sequential") if (k := f"held_out_image_{mode}") in d_info),
        lengths=list(BLOCK_LENGTHS), capped=capped))
    for section in kept:
        _set_readme_section(readme, "## " + section)
    if others:
        readme.write_text(readme.read_text().rstrip("\n") + "\n\n" + "\n\n".join(others) + "\n")
    log(f"wrote {out}/trained-target.gguf, trained-draft.gguf, trained-mmproj.gguf, README.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
