#!/usr/bin/env python3
"""Train a tiny ``qwen35`` target with its multi-token-prediction (MTP) head, and export it to GGUF.

Not part of the installed package: PyTorch (CPU) is used here for training only.

    pip install torch==2.13.0
    python tools/train_qwen35_mtp.py --seed 0 --out pyllama_spec/models

Corpus, tokenizer, synthetic pictures and training loop are those of ``train_tiny_pair.py`` (this
module imports them); the vision projector is a random ``qwen3vl_merger`` (no deepstack), as
Qwen3.5's mmproj files are.

Layer plan: layer 0 is a gated delta net, layers 1-3 full attention (``qwen35.attention.recurrent_layers``
[true, false, false, false, false]; the nextn block is full attention). An all-attention plan
(``full_attention_interval`` 1) loads, but the pinned llama.cpp cannot decode it: qwen35 always
builds the hybrid memory's inputs, and with no recurrent layer its state-copy input (``s_copy``) is
in no graph node, gets no buffer, and ``llm_graph_input_mem_hybrid::set_input`` aborts
(``GGML_ASSERT(buffer)``, ggml-backend.cpp). So one layer is recurrent, with as many key heads as value
heads. The PyTorch modules below mirror, operation for operation, what the pinned llama.cpp builds
(``src/models/qwen35.cpp``, ``delta-net-base.cpp``):

delta-net layer (``build_layer_attn_linear``; a zero state at the start of a sequence)
    h = rms(x) * attn_norm; [q | k | v] = silu(causal_conv4(h Wqkv)); q, k l2-normed, q / sqrt(d);
    per head: S <- S exp(g), S <- S + beta (v - S k) k^T, o = S q, with beta = sigmoid(h Wbeta),
    g = softplus(h Walpha + dt_bias) * ssm_a; x = x + Wout (rms(o) * ssm_norm * silu(h Wz)); FFN as below

target (``graph``; M-RoPE sections ``ROPE_SECTIONS``, interleaved as ggml's IMROPE turns them)
    x = tok_embd[t] (an image row: the projector's embedding); per attention layer:
    h = rms(x) * attn_norm; [q | gate] per head = h Wq (2 x head_dim per head), k = h Wk, v = h Wv;
    q = rope(rms(q) * q_norm); k = rope(rms(k) * k_norm)     (norms BEFORE rope here)
    x = x + Wo (attn_causal(q, k, v) * sigmoid(gate));  x = x + Wdown(silu(Wgate h') * Wup h'),
    h' = rms(x) * post_attention_norm
    h_nextn = rms(x) * output_norm;  logits = output h_nextn

MTP head (``graph_mtp``, the nextn block ``blk.{n_layer}``), row at position p:
    u = eh_proj [rms(embedding of the row's token, or its image embedding) * enorm,
                 rms(h_nextn of the target's row before it) * hnorm]
    one layer as above on u (its own KV cache), then m = rms(u') * output_norm (shared),
    logits = output m; m is the hidden state a chained draft step pairs with its token.

Training (Qwen's MTP objective): the target first, like train_tiny_pair's (next-token loss, a share
of the batches start with a picture); then, the target frozen, the head on the target's hidden
states: row i pairs (x_i, h_{i-1}) and predicts x_{i+1} (corpus label, plus the target's own
distribution at i as a soft label: the head is accepted when it agrees with the target). A second
pass feeds each row with the head's own hidden state of the row before instead of the target's
(as a chained draft step does), attending to the first pass's rows before it. With a picture in
context, image rows enter the head as (image embedding, h) rows, or (half of the batches) are hidden
from it, as a drafter that leaves media rows out of the head's cache sees them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

TOOLS = Path(__file__).resolve().parent
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

import train_tiny_pair as T
from train_tiny_pair import (
    EPS,
    HEAD_DIM,
    N_EMBD,
    N_HEAD,
    N_HEAD_KV,
    N_VOCAB,
    ROPE_BASE,
    rms_norm,
)

from pyllama_spec.devtools import tiny
from pyllama_spec.gguf.writer import GGUFWriter, ValueType

ARCH = "qwen35"
#: Qwen3.5's mrope_section [11, 11, 10] (64 rotated dims) scaled to 8 rotation pairs: with ggml's
#: interleaved M-RoPE every pair turns by t, h or w (none by the zero e position), so a text row
#: (p, p, p, 0) turns exactly as NeoX rope at p.
ROPE_SECTIONS = [3, 3, 2, 0]
#: Which trunk layers are gated delta nets (``qwen35.attention.recurrent_layers``; the nextn block
#: is always full attention). The pinned llama.cpp cannot decode a qwen35 with none (module docstring).
RECURRENT_LAYERS = (True, False, False, False)
# gated delta net: as many key heads as value heads (ssm.group_count == ssm.time_step_rank), so no
# head-broadcast convention is involved; heads of HEAD_DIM; conv kernel 4
DN_HEADS, DN_CONV = N_HEAD, 4
DN_KEY_DIM = DN_VALUE_DIM = DN_HEADS * HEAD_DIM


@dataclass
class Qwen35Config:
    n_layer: int = 4
    n_ff: int = 256
    rope_sections: tuple = tuple(ROPE_SECTIONS)
    recurrent: tuple = RECURRENT_LAYERS
    rope_base: float = ROPE_BASE
    #: the tiny tokenizer's merges (False: one byte, one token; the reading world's files)
    merges: bool = True


def _torch():
    import torch

    return torch


def imrope_section_of_pair(half: int, sections) -> list[int]:
    """ggml's interleaved M-RoPE (``GGML_ROPE_TYPE_IMROPE``, ``ggml_mrope_cache_init``): rotation
    pair j turns by the position of section 1 (h) if s % 3 == 1 and s < 3 sections[1], 2 (w) if
    s % 3 == 2 and s < 3 sections[2], 0 (t) if s % 3 == 0 and s < 3 sections[0], else 3 (e), with
    s = j % sum(sections)."""
    total = int(sum(sections))
    out = []
    for j in range(half):
        s = j % total
        if s % 3 == 1 and s < 3 * sections[1]:
            out.append(1)
        elif s % 3 == 2 and s < 3 * sections[2]:
            out.append(2)
        elif s % 3 == 0 and s < 3 * sections[0]:
            out.append(0)
        else:
            out.append(3)
    return out


def rope_imrope(x, pos, sections, base=ROPE_BASE):
    """NeoX-style rotation of x [..., T, H, D] with interleaved M-RoPE: pos [(B,) T, 4] holds each
    row's (t, h, w, e) positions (a text row's are (p, p, p, 0))."""
    return T.rope_neox(x, pos, sections, section_of_pair=imrope_section_of_pair, base=base)


def _layer_params(n_ff: int):
    torch = _torch()
    nn = torch.nn
    s = 1 / math.sqrt(N_EMBD)
    return nn.ParameterDict(dict(
        attn_norm=nn.Parameter(torch.ones(N_EMBD)),
        wq=nn.Parameter(torch.randn(2 * N_HEAD * HEAD_DIM, N_EMBD) * s),  # per head [query | gate]
        wk=nn.Parameter(torch.randn(N_HEAD_KV * HEAD_DIM, N_EMBD) * s),
        wv=nn.Parameter(torch.randn(N_HEAD_KV * HEAD_DIM, N_EMBD) * s),
        wo=nn.Parameter(torch.randn(N_EMBD, N_HEAD * HEAD_DIM) * s * 0.5),
        q_norm=nn.Parameter(torch.ones(HEAD_DIM)),
        k_norm=nn.Parameter(torch.ones(HEAD_DIM)),
        post_norm=nn.Parameter(torch.ones(N_EMBD)),
        gate=nn.Parameter(torch.randn(n_ff, N_EMBD) * s),
        up=nn.Parameter(torch.randn(n_ff, N_EMBD) * s),
        down=nn.Parameter(torch.randn(N_EMBD, n_ff) / math.sqrt(n_ff) * 0.5),
    ))


def _qkv(L, x, pos, sections, base=ROPE_BASE):
    """The gated-attention projections of one qwen35 layer on x [B, T, n_embd] (already normed):
    roped, normed q [B, T, H, D], k, v [B, T, Hkv, D] and the output gate [B, T, H * D]."""
    F = _torch().nn.functional
    B, Tn = x.shape[:2]
    qg = F.linear(x, L["wq"]).view(B, Tn, N_HEAD, 2 * HEAD_DIM)
    q, gate = qg[..., :HEAD_DIM], qg[..., HEAD_DIM:].reshape(B, Tn, N_HEAD * HEAD_DIM)
    q = rope_imrope(rms_norm(q, L["q_norm"]), pos, sections, base)
    k = rope_imrope(rms_norm(F.linear(x, L["wk"]).view(B, Tn, N_HEAD_KV, HEAD_DIM), L["k_norm"]), pos, sections, base)
    v = F.linear(x, L["wv"]).view(B, Tn, N_HEAD_KV, HEAD_DIM)
    return q, k, v, gate


def _attn_out(L, a, gate):
    torch = _torch()
    B, Tn = a.shape[:2]
    return torch.nn.functional.linear(a.reshape(B, Tn, N_HEAD * HEAD_DIM) * torch.sigmoid(gate), L["wo"])


def _ffn(L, x):
    F = _torch().nn.functional
    h = rms_norm(x, L["post_norm"])
    return F.linear(F.silu(F.linear(h, L["gate"])) * F.linear(h, L["up"]), L["down"])


def _block(L, x, pos, mask, sections, base=ROPE_BASE):
    """One full-attention qwen35 layer (causal by ``mask`` [B or 1, T, T])."""
    q, k, v, gate = _qkv(L, rms_norm(x, L["attn_norm"]), pos, sections, base)
    x = x + _attn_out(L, T.attention(q, k, v, mask), gate)
    return x + _ffn(L, x)


def _delta_net_params(n_ff: int):
    torch = _torch()
    nn = torch.nn
    s = 1 / math.sqrt(N_EMBD)
    conv_dim = 2 * DN_KEY_DIM + DN_VALUE_DIM
    return nn.ParameterDict(dict(
        attn_norm=nn.Parameter(torch.ones(N_EMBD)),
        wqkv=nn.Parameter(torch.randn(conv_dim, N_EMBD) * s),  # channels [q | k | v], heads of HEAD_DIM
        wz=nn.Parameter(torch.randn(DN_VALUE_DIM, N_EMBD) * s),  # the output gate
        conv=nn.Parameter(torch.randn(conv_dim, DN_CONV) * 0.5),
        dt_bias=nn.Parameter(torch.randn(DN_HEADS) * 0.5),
        a_log=nn.Parameter(torch.randn(DN_HEADS) * 0.5),  # ssm_a = -exp(a_log) < 0: a decaying state
        wbeta=nn.Parameter(torch.randn(DN_HEADS, N_EMBD) * s),
        walpha=nn.Parameter(torch.randn(DN_HEADS, N_EMBD) * s),
        ssm_norm=nn.Parameter(torch.ones(HEAD_DIM)),
        ssm_out=nn.Parameter(torch.randn(N_EMBD, DN_VALUE_DIM) * s * 0.5),
        post_norm=nn.Parameter(torch.ones(N_EMBD)),
        gate=nn.Parameter(torch.randn(n_ff, N_EMBD) * s),
        up=nn.Parameter(torch.randn(n_ff, N_EMBD) * s),
        down=nn.Parameter(torch.randn(N_EMBD, n_ff) / math.sqrt(n_ff) * 0.5),
    ))


def _l2(x):
    """llama.cpp's build_gdn_l2_norm: x / sqrt(sum(x^2) + eps) over the last dim."""
    return x * _torch().rsqrt(x.pow(2).sum(-1, keepdim=True) + EPS)


def _delta_net_block(L, x):
    """One gated-delta-net qwen35 layer (``build_layer_attn_linear``), from a zero state:
    causal conv (kernel DN_CONV) + silu over [q | k | v], l2-normed q and k (q / sqrt(d)), per head
    S <- S exp(g); S <- S + beta (v - S k) k^T; o = S q; then rms(o) * ssm_norm * silu(z), ssm_out."""
    torch = _torch()
    F = torch.nn.functional
    B, Tn = x.shape[:2]
    h = rms_norm(x, L["attn_norm"])
    qkv = F.linear(h, L["wqkv"])  # [B, T, C]
    C = qkv.shape[-1]
    conv = F.conv1d(F.pad(qkv.transpose(1, 2), (DN_CONV - 1, 0)), L["conv"][:, None, :], groups=C)
    qkv = F.silu(conv).transpose(1, 2)
    q = _l2(qkv[..., :DN_KEY_DIM].reshape(B, Tn, DN_HEADS, HEAD_DIM)) / math.sqrt(HEAD_DIM)
    k = _l2(qkv[..., DN_KEY_DIM:2 * DN_KEY_DIM].reshape(B, Tn, DN_HEADS, HEAD_DIM))
    v = qkv[..., 2 * DN_KEY_DIM:].reshape(B, Tn, DN_HEADS, HEAD_DIM)
    beta = torch.sigmoid(F.linear(h, L["wbeta"]))  # [B, T, H]
    decay = torch.exp(F.softplus(F.linear(h, L["walpha"]) + L["dt_bias"]) * -torch.exp(L["a_log"]))
    S = x.new_zeros(B, DN_HEADS, HEAD_DIM, HEAD_DIM)  # [value dim, key dim] per head
    outs = []
    for t in range(Tn):
        S = S * decay[:, t, :, None, None]
        kt = k[:, t]
        d = (v[:, t] - torch.einsum("bhvk,bhk->bhv", S, kt)) * beta[:, t, :, None]
        S = S + d[..., :, None] * kt[..., None, :]
        outs.append(torch.einsum("bhvk,bhk->bhv", S, q[:, t]))
    o = torch.stack(outs, 1)  # [B, T, H, D]
    z = F.linear(h, L["wz"]).view(B, Tn, DN_HEADS, HEAD_DIM)
    o = (rms_norm(o, L["ssm_norm"]) * F.silu(z)).reshape(B, Tn, DN_VALUE_DIM)
    x = x + F.linear(o, L["ssm_out"])
    return x + _ffn(L, x)


def _default_pos(tokens, pos):
    torch = _torch()
    B, Tn = tokens.shape
    if pos is None:
        pos = torch.arange(Tn)
    if pos.ndim == 1:  # text: (p, p, p, 0)
        pos = torch.stack([pos, pos, pos, torch.zeros_like(pos)], dim=-1)
    if pos.ndim == 2:
        pos = pos[None].expand(B, Tn, 4)
    return pos


def make_target(cfg: Qwen35Config):
    torch = _torch()
    nn = torch.nn
    F = nn.functional

    class Qwen35Target(nn.Module):
        def __init__(self):
            super().__init__()
            self.cfg = cfg
            self.tok_embd = nn.Parameter(torch.randn(N_VOCAB, N_EMBD))
            self.output = nn.Parameter(torch.randn(N_VOCAB, N_EMBD) / math.sqrt(N_EMBD))
            self.output_norm = nn.Parameter(torch.ones(N_EMBD))
            self.layers = nn.ModuleList([(_delta_net_params if cfg.recurrent[i] else _layer_params)(cfg.n_ff)
                                         for i in range(cfg.n_layer)])

        def embed(self, tokens, embd=None):
            x = self.tok_embd[tokens.clamp(min=0)]
            if embd is not None:
                x = torch.where((tokens < 0)[..., None], embd, x)
            return x

        def forward(self, tokens, pos=None, *, embd=None, layer_ids=None):
            """tokens [B, T] (-1 on image rows, whose rows ``embd`` [B, T, n_embd] holds) at M-RoPE
            positions pos [B, T, 4] (default: text 0..T-1) -> logits [B, T, V], h_nextn [B, T, n_embd]
            (the output-normed hidden state the MTP head pairs with the next token). With
            ``layer_ids``: logits, {lid: layer lid's input [B, T, n_embd]} instead (what an EAGLE3
            or DFlash draft reads, as train_tiny_pair's target gives it)."""
            if layer_ids is not None and not all(0 <= lid < cfg.n_layer for lid in layer_ids):
                raise ValueError(f"layer_ids {list(layer_ids)}: the target has layers 0..{cfg.n_layer - 1}")
            Tn = tokens.shape[1]
            pos = _default_pos(tokens, pos)
            x = self.embed(tokens, embd)
            causal = torch.ones(Tn, Tn, dtype=torch.bool).tril()[None]
            feats = {}
            for il, (L, recurrent) in enumerate(zip(self.layers, cfg.recurrent)):
                if layer_ids is not None and il in layer_ids:
                    feats[il] = x
                x = _delta_net_block(L, x) if recurrent else _block(L, x, pos, causal, cfg.rope_sections, cfg.rope_base)
            h = rms_norm(x, self.output_norm)
            return F.linear(h, self.output), (h if layer_ids is None else feats)

    return Qwen35Target()


def make_mtp(cfg: Qwen35Config):
    torch = _torch()
    nn = torch.nn
    F = nn.functional

    class MTPHead(nn.Module):
        """The nextn block: borrows the target's output norm and head (and token embedding, through
        the ``emb`` rows the caller passes)."""

        def __init__(self):
            super().__init__()
            self.enorm = nn.Parameter(torch.ones(N_EMBD))
            self.hnorm = nn.Parameter(torch.ones(N_EMBD))
            # ggml_concat order: the embedding half first; start near "pass the embedding through"
            eh = torch.cat([torch.eye(N_EMBD) + torch.randn(N_EMBD, N_EMBD) * 0.02,
                            torch.randn(N_EMBD, N_EMBD) / math.sqrt(N_EMBD)], dim=1)
            self.eh_proj = nn.Parameter(eh)
            self.layer = _layer_params(cfg.n_ff)

        def inputs(self, emb, h_prev):
            return F.linear(torch.cat([rms_norm(emb, self.enorm), rms_norm(h_prev, self.hnorm)], -1), self.eh_proj)

        def forward(self, emb, h_prev, pos, mask, output_norm, output):
            """Rows (emb [B, T, n_embd], h_prev [B, T, n_embd]) at positions pos [B, T, 4], visibility
            mask [B or 1, T, T] -> logits [B, T, V], m [B, T, n_embd] (the head's own hidden state)."""
            x = _block(self.layer, self.inputs(emb, h_prev), pos, mask, cfg.rope_sections, cfg.rope_base)
            m = rms_norm(x, output_norm)
            return F.linear(m, output), m

        def chained(self, emb, m_prev, pos, mask, kv_first, output_norm, output):
            """A chained draft step for every row at once: row i is (emb_i, m_{i-1}) (the head's own
            hidden state of the row before) and attends to the first pass's rows before it
            (``kv_first`` = (K, V) of the first pass, ``mask`` [B or 1, T, T] over them) and to itself."""
            L = self.layer
            u = self.inputs(emb, m_prev)
            q, k, v, gate = _qkv(L, rms_norm(u, L["attn_norm"]), pos, cfg.rope_sections, cfg.rope_base)
            k1, v1 = kv_first
            Tn = emb.shape[1]
            strict = mask & ~torch.eye(Tn, dtype=torch.bool)[None]
            # keys: the first pass's rows (strictly before) then the row's own (the diagonal)
            keys, vals = torch.cat([k1, k], 1), torch.cat([v1, v], 1)
            own = torch.eye(Tn, dtype=torch.bool)[None].expand(strict.shape[0], Tn, Tn)
            a = T.attention(q, keys, vals, torch.cat([strict, own], -1))
            x = u + _attn_out(L, a, gate)
            x = x + _ffn(L, x)
            m = rms_norm(x, output_norm)
            return F.linear(m, output), m

        def first_pass_kv(self, emb, h_prev, pos):
            L = self.layer
            u = self.inputs(emb, h_prev)
            _, k, v, _ = _qkv(L, rms_norm(u, L["attn_norm"]), pos, cfg.rope_sections, cfg.rope_base)
            return k, v

    return MTPHead()


def mtp_rows(target, tokens, h, embd=None):
    """The head's input rows for a decoded sequence: row i pairs the embedding of row i (token or
    image row) with the target's h_nextn of row i - 1 (zeros before row 0, as llama.cpp starts)."""
    torch = _torch()
    emb = target.embed(tokens, embd)
    h_prev = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1)
    return emb, h_prev


# ----------------------------------------------------------------------------- GGUF export / import

_LAYER_TENSORS = [("attn_norm", "attn_norm"), ("wq", "attn_q"), ("wk", "attn_k"), ("wv", "attn_v"),
                  ("wo", "attn_output"), ("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm"),
                  ("post_norm", "post_attention_norm"), ("gate", "ffn_gate"), ("up", "ffn_up"),
                  ("down", "ffn_down")]
_DELTA_NET_TENSORS = [("attn_norm", "attn_norm.weight"), ("wqkv", "attn_qkv.weight"), ("wz", "attn_gate.weight"),
                      ("conv", "ssm_conv1d.weight"), ("dt_bias", "ssm_dt.bias"), ("wbeta", "ssm_beta.weight"),
                      ("walpha", "ssm_alpha.weight"), ("ssm_norm", "ssm_norm.weight"), ("ssm_out", "ssm_out.weight"),
                      ("post_norm", "post_attention_norm.weight"), ("gate", "ffn_gate.weight"),
                      ("up", "ffn_up.weight"), ("down", "ffn_down.weight")]


def write_gguf(path, params: dict, cfg: Qwen35Config, mtp_params: dict | None = None,
               name: str = "trained-tiny-qwen35-mtp") -> Path:
    """A qwen35 GGUF from numpy arrays keyed as the target's state_dict (and the head's, which
    becomes the nextn block ``blk.{n_layer}``; ``block_count`` counts it, as the loader expects)."""
    w = GGUFWriter()
    n_all = cfg.n_layer + (1 if mtp_params is not None else 0)
    w.add_string("general.architecture", ARCH)
    for key, value in (("context_length", 4096), ("embedding_length", N_EMBD), ("block_count", n_all),
                       ("feed_forward_length", cfg.n_ff), ("attention.head_count", N_HEAD),
                       ("attention.head_count_kv", N_HEAD_KV), ("attention.key_length", HEAD_DIM),
                       ("attention.value_length", HEAD_DIM), ("rope.dimension_count", HEAD_DIM)):
        w.add_uint32(f"{ARCH}.{key}", value)
    w.add_float32(f"{ARCH}.rope.freq_base", cfg.rope_base)
    w.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", EPS)
    w.add_array(f"{ARCH}.rope.dimension_sections", ValueType.INT32, list(cfg.rope_sections))
    w.add_string("general.name", name)
    if mtp_params is not None:
        w.add_uint32(f"{ARCH}.nextn_predict_layers", 1)
    for key, value in (("ssm.conv_kernel", DN_CONV), ("ssm.state_size", HEAD_DIM), ("ssm.group_count", DN_HEADS),
                       ("ssm.time_step_rank", DN_HEADS), ("ssm.inner_size", DN_VALUE_DIM)):
        w.add_uint32(f"{ARCH}.{key}", value)
    # one entry per block, the nextn block included (it is full attention)
    w.add_array(f"{ARCH}.attention.recurrent_layers", ValueType.BOOL, list(cfg.recurrent) + [False] * (n_all - cfg.n_layer))
    tiny._add_tokenizer(w, merges=cfg.merges)
    w.add_tensor("token_embd.weight", params["tok_embd"])
    w.add_tensor("output_norm.weight", params["output_norm"])
    w.add_tensor("output.weight", params["output"])
    for i in range(cfg.n_layer):
        if cfg.recurrent[i]:
            for k, t in _DELTA_NET_TENSORS:
                w.add_tensor(f"blk.{i}.{t}", params[f"layers.{i}.{k}"])
            w.add_tensor(f"blk.{i}.ssm_a", -np.exp(params[f"layers.{i}.a_log"]))
            continue
        for k, t in _LAYER_TENSORS:
            w.add_tensor(f"blk.{i}.{t}.weight", params[f"layers.{i}.{k}"])
    if mtp_params is not None:
        i = cfg.n_layer
        for k, t in _LAYER_TENSORS:
            w.add_tensor(f"blk.{i}.{t}.weight", mtp_params[f"layer.{k}"])
        w.add_tensor(f"blk.{i}.nextn.eh_proj.weight", mtp_params["eh_proj"])
        w.add_tensor(f"blk.{i}.nextn.enorm.weight", mtp_params["enorm"])
        w.add_tensor(f"blk.{i}.nextn.hnorm.weight", mtp_params["hnorm"])
    path = Path(path)
    w.write(path)
    return path


def load(path):
    """(target, head or None, cfg): torch modules holding the weights of a GGUF written here."""
    torch = _torch()
    meta, tt = T.read_gguf_tensors(path)
    n_nextn = int(meta.get(f"{ARCH}.nextn_predict_layers", 0))
    cfg = Qwen35Config(n_layer=int(meta[f"{ARCH}.block_count"]) - n_nextn,
                       n_ff=int(meta[f"{ARCH}.feed_forward_length"]),
                       rope_sections=tuple(int(s) for s in meta[f"{ARCH}.rope.dimension_sections"]))
    cfg.recurrent = tuple(bool(r) for r in meta[f"{ARCH}.attention.recurrent_layers"])[:cfg.n_layer]
    cfg.rope_base = float(meta.get(f"{ARCH}.rope.freq_base", ROPE_BASE))
    cfg.merges = bool(len(meta.get("tokenizer.ggml.merges", [])))
    target = make_target(cfg)
    p = dict(tok_embd=tt["token_embd.weight"], output=tt["output.weight"], output_norm=tt["output_norm.weight"])
    for i in range(cfg.n_layer):
        if cfg.recurrent[i]:
            p.update({f"layers.{i}.{k}": tt[f"blk.{i}.{t}"] for k, t in _DELTA_NET_TENSORS})
            # stored as -exp(a_log); float32 log/exp round trip: exact enough, and the parity tests
            # compare with the file's values through the same path
            p[f"layers.{i}.a_log"] = np.log(-tt[f"blk.{i}.ssm_a"]).astype(np.float32)
            continue
        for k, t in _LAYER_TENSORS:
            p[f"layers.{i}.{k}"] = tt[f"blk.{i}.{t}.weight"]
    target.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in p.items()})
    head = None
    if n_nextn:
        head = make_mtp(cfg)
        i = cfg.n_layer
        p = {f"layer.{k}": tt[f"blk.{i}.{t}.weight"] for k, t in _LAYER_TENSORS}
        p.update(eh_proj=tt[f"blk.{i}.nextn.eh_proj.weight"], enorm=tt[f"blk.{i}.nextn.enorm.weight"],
                 hnorm=tt[f"blk.{i}.nextn.hnorm.weight"])
        head.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in p.items()})
        head.eval()
    return target.eval(), head, cfg


def write_random(path, *, seed: int = 0, cfg: Qwen35Config | None = None, scale: float = 1.0) -> Path:
    """A random (untrained) qwen35 + MTP file from these modules' initialisation, for parity tests.
    ``scale`` multiplies the norm weights' spread around 1 (0: all ones), so that norms are tested too."""
    torch = _torch()
    cfg = cfg or Qwen35Config()
    torch.manual_seed(seed)
    target, head = make_target(cfg), make_mtp(cfg)
    with torch.no_grad():
        for p in list(target.parameters()) + list(head.parameters()):
            if p.ndim == 1:  # norms: not all ones, so that a misplaced weight shows
                p.add_(torch.randn_like(p) * 0.2 * scale)
    return write_gguf(path, _state(target), cfg, _state(head), name="random-tiny-qwen35-mtp")


def _state(module) -> dict:
    return {k: T._np(v) for k, v in module.state_dict().items()}


# ----------------------------------------------------------------------------- MTP training

def _head_batch(target, rng, toks, images, batch, seq, image_share, image_text):
    """One head batch: tokens [B, T + 1] (-1 on image rows), positions [B, T, 4], image rows
    [B, T, n_embd] or None, and whether image rows are hidden from the head (a drafter that leaves
    media rows out of its cache)."""
    if images and rng.random() < image_share:
        x, pos, embd = T.image_text_batch(rng, toks, images, batch, image_text)
        Tn = x.shape[1] - 1
        return x, pos[None].expand(batch, Tn, 4), embd[None].expand(batch, Tn, N_EMBD), bool(rng.random() < 0.5)
    x = T._batch(rng, toks, batch, seq + 1)
    return x, _default_pos(x[:, :-1], None), None, False


def mtp_losses(target, head, x, pos, embd, hide_images, *, chained_weight=0.5, row_weight=None):
    """(loss, stats) of the head on one batch, the target frozen: pass 1 rows (x_i, h_{i-1}) and
    pass 2 rows (x_i, m_{i-1}) (a chained draft step) predict x_{i+1}; each with the corpus label
    (Qwen's MTP objective) plus the target's own distribution at row i (KL), on rows whose label is
    text and whose own row the head holds. ``row_weight`` [B, T] (default: all 1) weighs each row's
    loss (the reading world weighs its read-out rows up)."""
    torch = _torch()
    F = torch.nn.functional
    tokens, labels = x[:, :-1], x[:, 1:]
    B, Tn = tokens.shape
    with torch.no_grad():
        t_logits, h = target(tokens, pos, embd=embd)
        emb, h_prev = mtp_rows(target, tokens, h, embd)
        t_logp = F.log_softmax(t_logits, -1)
    mask = torch.ones(Tn, Tn, dtype=torch.bool).tril()[None].expand(B, Tn, Tn)
    valid = labels >= 0
    if hide_images:
        img = tokens < 0
        mask = (mask & ~img[:, None, :]) | torch.eye(Tn, dtype=torch.bool)[None]
        valid = valid & ~img
    out_norm, out = target.output_norm.detach(), target.output.detach()
    logits1, m = head(emb, h_prev, pos, mask, out_norm, out)
    kv = head.first_pass_kv(emb, h_prev, pos)
    m_prev = torch.cat([torch.zeros_like(m[:, :1]), m[:, :-1].detach()], 1)
    logits2, _ = head.chained(emb, m_prev, pos, mask, kv, out_norm, out)

    def loss_of(logits):
        lp = F.log_softmax(logits, -1)
        if row_weight is None:
            ce = F.cross_entropy(logits.reshape(-1, N_VOCAB), labels.masked_fill(~valid, -100).reshape(-1),
                                 ignore_index=-100)
            kl = ((t_logp.exp() * (t_logp - lp)).sum(-1) * valid).sum() / valid.sum().clamp(min=1)
        else:
            w = row_weight * valid
            rows = F.cross_entropy(logits.reshape(-1, N_VOCAB), labels.clamp(min=0).reshape(-1), reduction="none")
            ce = (rows.view(B, Tn) * w).sum() / w.sum().clamp(min=1)
            kl = ((t_logp.exp() * (t_logp - lp)).sum(-1) * w).sum() / w.sum().clamp(min=1)
        scored = valid if row_weight is None else valid & (row_weight > 0)
        agree = ((logits.argmax(-1) == t_logits.argmax(-1)) & scored).sum() / scored.sum().clamp(min=1)
        return ce + kl, float(ce.detach()), float(agree)

    l1, ce1, a1 = loss_of(logits1)
    l2, ce2, a2 = loss_of(logits2)
    return l1 + chained_weight * l2, dict(ce=ce1, agree=a1, ce_chained=ce2, agree_chained=a2)


def train_mtp(target, head, toks, held, *, steps, seconds, batch, seq, seed, log, images=None, held_images=None,
              image_share=0.25, image_text=256):
    torch = _torch()
    for p in target.parameters():
        p.requires_grad_(False)
    rng = np.random.default_rng(seed + 61)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    t0, step, hist = time.time(), 0, []
    for step in range(steps):
        if time.time() - t0 > seconds:
            log(f"mtp: time budget reached at step {step}")
            break
        for g in opt.param_groups:
            g["lr"] = T._lr(step, steps, 3e-3)
        loss, st = mtp_losses(target, head, *_head_batch(target, rng, toks, images, batch, seq, image_share,
                                                          image_text))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        hist.append([float(loss), st["ce"], st["agree"], st["agree_chained"]])
        if step % 50 == 0:
            a = np.mean(hist[-50:], 0)
            log(f"mtp step {step} loss {a[0]:.3f} ce {a[1]:.3f} agree {a[2]:.2f} chained {a[3]:.2f} "
                f"({time.time() - t0:.0f}s)")
    a = np.mean(hist[-50:], 0)
    info = dict(steps=step + 1, seconds=round(time.time() - t0, 1), train_loss=round(float(a[0]), 3),
                train_ce=round(float(a[1]), 3))
    info["held_out_text"] = eval_mtp(target, head, held, None, batch, seq, seed, 0.0, image_text)
    if held_images:
        for hide in (False, True):
            info[f"held_out_image_{'hidden' if hide else 'held'}"] = eval_mtp(
                target, head, held, held_images, 1, seq, seed, 1.0, image_text, hide=hide)
    return info


def eval_mtp(target, head, toks, images, batch, seq, seed, image_share, image_text, n=8, hide=None):
    """Held-out: head cross-entropy and agreement with the target's greedy choice (first and
    chained draft step), averaged over n batches."""
    torch = _torch()
    rng = np.random.default_rng(seed + 97)
    rows = []
    with torch.no_grad():
        for _ in range(n):
            x, pos, embd, hidden = _head_batch(target, rng, toks, images, batch, seq, image_share, image_text)
            _, st = mtp_losses(target, head, x, pos, embd, hidden if hide is None else hide)
            rows.append([st["ce"], st["agree"], st["agree_chained"]])
    a = np.mean(rows, 0)
    return dict(ce=round(float(a[0]), 3), agree=round(float(a[1]), 3), agree_chained=round(float(a[2]), 3))


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=60.0,
                    help="wall-clock cap for both trainings (a run stopped by it is not reproducible by --seed alone)")
    ap.add_argument("--out", default="pyllama_spec/models")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--target-steps", type=int, default=1000)
    ap.add_argument("--mtp-steps", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=4, help="target batch (sequences)")
    ap.add_argument("--seq", type=int, default=512, help="target sequence length")
    ap.add_argument("--mtp-batch", type=int, default=8)
    ap.add_argument("--mtp-seq", type=int, default=256)
    ap.add_argument("--images", type=int, default=48, help="synthetic training pictures")
    ap.add_argument("--target-image-share", type=float, default=0.25)
    ap.add_argument("--mtp-image-share", type=float, default=0.25)
    ap.add_argument("--image-text", type=int, default=384, help="corpus tokens after a picture (target batches)")
    ap.add_argument("--mtp-image-text", type=int, default=256, help="corpus tokens after a picture (head batches)")
    ap.add_argument("--target-share", type=float, default=0.6, help="share of --minutes for the target")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(max(1, args.threads))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = Qwen35Config()
    t_all = time.time()

    def log(msg):
        print(f"[{time.time() - t_all:6.0f}s] {msg}", flush=True)

    train_files, held_files = T.corpus_files()
    mmproj_path = out / "trained-qwen35-mtp-mmproj.gguf"
    tiny.write_mmproj(mmproj_path, target_n_embd=N_EMBD, seed=args.seed, projector="qwen3vl_merger")
    with tempfile.TemporaryDirectory() as tmp:
        probe = write_random(Path(tmp) / "probe.gguf", seed=args.seed, cfg=cfg)  # tokenizer and mtmd's text model
        toks = T.tokenize_files(train_files, probe)
        held = T.tokenize_files(held_files, probe)
        pictures = T.encode_images(probe, mmproj_path, T.image_pool(args.images, args.seed))
        held_pictures = T.encode_images(probe, mmproj_path, T.image_pool(16, args.seed + 1000))
    log(f"corpus: {len(train_files)} files / {len(toks)} tokens, held out {len(held_files)} / {len(held)}; "
        f"pictures: {len(pictures)} training, {len(held_pictures)} held out")

    budget = args.minutes * 60
    torch.manual_seed(args.seed)
    target = make_target(cfg)
    t_info = T.train_target(target, toks, held, steps=args.target_steps, seconds=budget * args.target_share,
                            batch=args.batch, seq=args.seq, seed=args.seed, log=log, images=pictures,
                            held_images=held_pictures, image_share=args.target_image_share,
                            image_text=args.image_text)
    log(f"target: {t_info}")
    target.eval()

    torch.manual_seed(args.seed + 1)
    head = make_mtp(cfg)
    m_info = train_mtp(target, head, toks, held, steps=args.mtp_steps,
                       seconds=max(60.0, budget - (time.time() - t_all)), batch=args.mtp_batch, seq=args.mtp_seq,
                       seed=args.seed, log=log, images=pictures, held_images=held_pictures,
                       image_share=args.mtp_image_share, image_text=args.mtp_image_text)
    log(f"mtp: {m_info}")
    head.eval()
    path = write_gguf(out / "trained-qwen35-mtp.gguf", _state(target), cfg, _state(head))
    summary = dict(config=asdict(cfg), target=t_info, mtp=m_info, seed=args.seed, args=vars(args),
                   torch=torch.__version__, threads=torch.get_num_threads(), total_s=round(time.time() - t_all),
                   all_steps=t_info["steps"] == args.target_steps and m_info["steps"] == args.mtp_steps,
                   n_train_files=len(train_files), n_train_tokens=len(toks), n_held_files=len(held_files),
                   n_held_tokens=len(held))
    log(json.dumps(summary))
    log(f"wrote {path} and {mmproj_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
