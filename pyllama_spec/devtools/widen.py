"""The trained tiny pair at the cost of a 142M-parameter model: zero padding, same function.

``widen_trained_pair`` writes the embedded trained pair (``pyllama_spec/models``: a 4-layer,
64-wide ``hunyuan_vl`` target, its ``qwen2vl_merger`` mmproj and a 2-layer DFlash draft) in the
shapes of ``tiny.make_bench_set``: by default n_embd 1024, 12 layers, n_ff 2816, 16 heads of 64
with 8 KV heads, f16 matrices: 142,135,808 target parameters (the draft: 26,745,088).  Every
weight that is not a trained one is zero, and the trained ones are placed (and scaled by powers
of two) so that the wide files compute **the trained pair's function** -- the same logits, the
same draft proposals, so the trained acceptance (about 0.53 at draft_max 7 on held-out code) --
while every decode costs what a dense 142M f16 model costs (ggml's matmuls do not skip zeros).
It is a benchmark fixture, not a better model: nothing is learned, the extra width and layers
carry zeros.  ``widen_trained_eagle3`` and ``widen_trained_draft_model`` widen the other trained drafts
for that target; ``widen_trained_qwen35_mtp`` widens the trained hybrid qwen35 target with its own MTP
head (``draft-mtp``) the same way, to 141,828,720 trunk parameters (the head: 13,176,960 more).

How the function is kept (checked against the pinned llama.cpp: ``src/models/hunyuan-vl.cpp``,
``src/models/dflash.cpp``, ``src/models/eagle3.cpp``, ``ggml_mrope_cache_init`` /
``ggml_rope_cache_init`` / ``rotate_pairs`` in ggml-cpu):

* residual: the trained 64 dims are wide dims 0..63, scaled by ``s_r = sqrt(n_embd / 64)``
  (4 at 1024): the token embedding, the merger's output (image rows) and every layer's output
  projection (``attn_output``, ``ffn_down``) are multiplied by s_r.  An RMS norm over n_embd
  then sees ``mean(x^2)`` exactly as the trained model did (``s_r^2 * sum / n_embd = sum / 64``,
  epsilon included), and its output is s_r times larger: every residual norm weight
  (``attn_norm``, ``ffn_norm``, ``output_norm``, the draft's ``enc.output_norm``) is divided by
  s_r.  The draft's ``fc`` reads target layer inputs (s_r times the trained ones) and is left
  unscaled, so its output is s_r times the trained one, as its norm expects.
* heads: trained query head h is wide head h, trained KV head h is wide KV head h (the GQA
  ratio is 2 in both, and ggml maps query head h to KV head h // ratio).  ggml's M-RoPE and NeoX
  rope rotate pair i = (dim i, dim i + n_rot / 2) at ``base^(-2i / n_rot)``, the section chosen
  by pair index: trained pair i (head dim 16) goes to wide pair ``k * i`` (k = 64 / 16 = 4),
  same frequency, and the sections are scaled by k ([2, 3, 3, 0] -> [8, 12, 12, 0]; the draft's
  [8, 0, 0, 0] -> [32, 0, 0, 0]), so pair k*i falls in the same section.  The q and k
  projections are scaled by ``s_h = sqrt(64 / 16) = 2``: the per-head RMS norm over 64 dims then
  sees the trained mean (epsilon included) and gives the trained normalised vector times s_h;
  the k_norm weight is divided by s_h (the K cache holds the trained values) and the q_norm
  weight kept, so q.k is s_h times the trained one, which the wider head's attention scale
  1/sqrt(64) = 1/sqrt(16) / s_h cancels.  Heads the trained model does not have are zero:
  zero q and k, uniform attention over zero values, zero output.
* feed-forward: the trained 256 units are units 0..255 of 2816; layers past the trained four
  are all zero (including their norms): the residual passes through them unchanged.
* draft: the same padding; its ``fc`` (3 x n_embd -> n_embd) holds each trained 64 x 64 block
  at the matching wide block; it reads target layers (1, 2, 3) as trained.
* mmproj: the vision tower as trained (f32), the merger's last projection padded to n_embd.
* draft model (``widen_trained_draft_model``: ``trained-draft-vlm.gguf``, a 48-wide 2-layer
  ``hunyuan_vl`` with 3 query heads / 1 KV head of 16, used as ``draft-simple``): the target's
  construction (``write_widened_hunyuan_vl``) with explicit heads, since ``tiny._geometry`` makes
  only GQA ratio 2: by default n_embd 768 = 12 heads of 64 / 4 KV heads (ratio 3, query head h
  still reads KV head h // 3), s_r = sqrt(768 / 48) = 4, s_h = 2; widths are 48 times a power of 4
  so that both scales stay powers of two.
* EAGLE3 (``widen_trained_eagle3``: ``trained-eagle3.gguf``, for the widened target; checked
  against ``src/models/eagle3.cpp``): it borrows the target's token embedding (s_r times the
  trained rows) and output head, and its residual starts at the raw ``g`` (the ``fc`` output, or
  the previous step's pre-norm output).  ``fc`` unscaled (g is s_r times the trained g), every
  norm divided by s_r (``attn_norm``, ``attn_norm_2``, ``ffn_norm``, ``output_norm``), so the
  [embedding | g] input of Q/K/V is the trained one, at columns 0..63 and n_embd..n_embd+63;
  ``attn_output`` and ``ffn_down`` times s_r.  There are no q/k norms: Q alone is scaled by s_h
  (q.k is s_h times the trained one, cancelled by the attention scale; K and V, so the cache,
  as trained).  Its rope is LLAMA_ROPE_TYPE_NORM, which rotates adjacent pairs (2i, 2i + 1) at
  ``base^(-2i / n_rot)``: trained pair i goes to wide pair k * i (dims 2ki, 2ki + 1).

* qwen35 + MTP (``widen_trained_qwen35_mtp``: ``trained-qwen35-mtp.gguf``, a 64-wide hybrid target of
  4 trunk layers -- a gated delta net, then three gated-attention layers -- and one nextn (MTP) block,
  drafting with ``draft-mtp``, and its ``qwen3vl_merger`` projector; checked against
  ``src/models/qwen35.cpp`` (``graph``, ``graph_mtp``), ``src/models/delta-net-base.cpp``,
  ``build_gdn_l2_norm`` (``src/models/models.h``) and ``ggml_mrope_cache_init``):

  - residual: as above (``attn_norm`` and ``post_attention_norm``, the FFN's input norm, divided by
    s_r; ``attn_output``, ``ssm_out`` and ``ffn_down`` times s_r).  The final ``output_norm`` keeps its
    trained weight, so its output h -- the hidden state the MTP head reads (llama.cpp's ``t_h_nextn``),
    also the embeddings -- is s_r times the trained one, and ``output`` is divided by s_r (the trained
    logits).  Dividing the final norm instead would hand the head the trained h, whose RMS over n_embd
    dims would count epsilon s_r^2 times over: not the trained function.
  - gated delta nets: q and k are L2-normalised per head (``rms_norm(x, eps / n) / sqrt(n)`` = x /
    sqrt(sum x^2 + eps) over the head's n dims), q is scaled by 1 / sqrt(head dim) in the recurrence,
    and the output's gated norm (``ssm_norm`` times silu(z)) is an RMS over the head's dims: a wider
    head would change the function.  So heads keep the trained ``ssm.state_size`` (16) and zero heads
    are added: n_embd / 16 key heads = as many value heads (64 at 1024; ``ssm.inner_size`` = n_embd, the
    trained ratio).  ``attn_qkv``'s rows, and the conv channels, are [q heads | k heads | v heads],
    which ggml views at 0, key_dim and 2 key_dim: each part keeps its trained heads first;
    ``attn_gate`` (z) rows, ``ssm_out`` columns, ``ssm_a``, ``ssm_dt``, ``ssm_beta`` and ``ssm_alpha``
    (one per value head) too; ``ssm_norm`` (one weight per head dim, shared) as trained.  The input norm
    already gives the trained normed input, so nothing but ``ssm_out`` is scaled.  A zero head has zero
    projections and conv taps, so q = k = v = 0 (the L2 norm of 0 is 0): its state stays 0 whatever
    its decay (``ssm_a`` = ``ssm_dt`` = 0: g = 0, exp(g) = 1) and beta (sigmoid(0)), its output is 0,
    its gated norm 0, and ``ssm_out``'s zero columns add nothing.  Key heads = value heads (checked),
    so each value head reads its own key head however llama.cpp maps one to the other.
  - gated attention (the trunk's and the MTP block's): as "heads" above, 16 heads of 64 with 8 KV heads
    at 1024 (GQA ratio 2, as trained).  ``attn_q`` holds per head its query, then its output gate
    (sigmoid(gate) multiplies the attention output dim by dim): the query half goes as q (pair i to pair
    k*i, times s_h), the gate half to the dims of the values it multiplies (the same map), unscaled; a
    gate over a zero value dim gives sigmoid(0) x 0 = 0.  The rope is interleaved M-RoPE
    (``LLAMA_ROPE_TYPE_IMROPE``): pair i takes section t, h or w by i % 3, while i < 3 x that section's
    size; k = 4 is 1 modulo 3 (every power of 4 is), so k*i % 3 = i % 3 and k*i < 3 k s exactly when
    i < 3 s: the sections times k ([3, 3, 2, 0] -> [12, 12, 8, 0]) keep each pair's section.
  - MTP block (``blk.{n_layer}``, after the trunk): [enorm(token embedding, or an image row), hnorm(h)]
    -> ``eh_proj`` -> a gated attention layer and FFN -> the shared final norm and output head.  Both
    inputs are s_r times the trained ones, so ``enorm`` and ``hnorm`` divided by s_r give the trained
    normed halves, at ``eh_proj``'s columns 0..63 and n_embd..n_embd+63; ``eh_proj`` times s_r starts the
    block's residual at s_r times the trained one; the block as a trunk layer.  Its own h (fed back for
    a chained draft step) is s_r times the trained one, as the target's.
  - layers past the trained four: all zero, each a delta net unless (i + 1) % 4 == 0 (Qwen3.5's
    ``full_attention_interval``; ``attention.recurrent_layers`` written out).  The projector: as above
    (a ``qwen3vl_merger`` without deepstack layers is the same merger).

All the scale factors are powers of two at widths 256 and 1024, so they are exact in f32 and
f16.  In f32 the wide pair gives the trained logits up to summation order (about 1e-6); in f16
the matrices are rounded to f16 (and ggml rounds matmul inputs to f16 too), so logits move by
about 1e-3 and a greedy continuation can part from the trained one at a near tie
(``tests/test_widen.py``; ``bench/dflash_bench_size.py`` reports how many tokens agree).
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np

from pyllama_spec.devtools import tiny
from pyllama_spec.embedded import DRAFT, MMPROJ, MODELS_DIR, TARGET
from pyllama_spec.gguf.reader import GGUFInfo, ValueType, read_gguf, read_tensor
from pyllama_spec.gguf.writer import GGUFWriter

#: Bump when the written files change (cache names carry it).
WIDEN_VERSION = 1
#: The trained EAGLE3 draft beside the pair (``widen_trained_eagle3``).
EAGLE3 = "trained-eagle3.gguf"
#: The trained draft model beside the pair (``widen_trained_draft_model``: a 48-wide, 2-layer
#: ``hunyuan_vl`` of the target's vocabulary, 3 query heads / 1 KV head of 16, used as ``draft-simple``).
DRAFT_MODEL = "trained-draft-vlm.gguf"
#: The trained qwen35 target with its MTP (nextn) block, and its projector (``widen_trained_qwen35_mtp``).
QWEN35_MTP, QWEN35_MTP_MMPROJ = "trained-qwen35-mtp.gguf", "trained-qwen35-mtp-mmproj.gguf"
#: qwen35 layers past the trained ones: a gated delta net unless (i + 1) % this is 0 (Qwen3.5's interval).
QWEN35_FULL_ATTENTION_INTERVAL = 4


class _Layout:
    """Where trained rows/columns go in the wide tensors, and the two scales."""

    def __init__(self, t: GGUFInfo, *, n_embd: int, n_ff: int, adjacent_pairs: bool = False,
                 n_head: int | None = None, n_head_kv: int | None = None):
        """``n_head`` / ``n_head_kv`` None: ``tiny._geometry(n_embd)``'s heads (ratio 2); given (both):
        heads of ``n_embd // n_head``, with both scales required to be powers of two."""
        arch = t.arch
        m = t.metadata
        self.n_embd_t = int(m[f"{arch}.embedding_length"])
        self.n_head_t = int(m[f"{arch}.attention.head_count"])
        self.n_kv_t = int(m[f"{arch}.attention.head_count_kv"])
        self.hd_t = int(m[f"{arch}.attention.key_length"])
        if n_head is None and n_head_kv is None:
            g = tiny._geometry(n_embd)
            self.n_embd, self.n_head, self.n_kv, self.hd = g.n_embd, g.n_head, g.n_head_kv, g.head_dim
        else:
            self.n_embd, self.n_head, self.n_kv, self.hd = _explicit_geometry(
                n_embd, n_head, n_head_kv, n_embd_t=self.n_embd_t, hd_t=self.hd_t)
        self.n_ff = n_ff
        if self.n_embd < self.n_embd_t or self.n_head < self.n_head_t or self.n_kv < self.n_kv_t:
            raise ValueError(f"n_embd {n_embd} gives {self.n_head} heads / {self.n_kv} KV heads of {self.hd}: "
                             f"fewer than the trained {self.n_head_t} / {self.n_kv_t}")
        if self.n_head // self.n_kv != self.n_head_t // self.n_kv_t:
            raise ValueError("the GQA ratio must stay the same")
        if self.hd % self.hd_t or self.hd_t % 2:
            raise ValueError(f"head dim {self.hd} is not a multiple of the trained {self.hd_t}")
        self.k = self.hd // self.hd_t  # trained rope pair i -> wide pair k * i
        self.s_r = math.sqrt(self.n_embd / self.n_embd_t)  # residual scale
        self.s_h = math.sqrt(self.hd / self.hd_t)  # q/k scale
        self.res = np.arange(self.n_embd_t)  # trained residual dims -> wide dims 0..n_embd_t-1
        half_t, half_w = self.hd_t // 2, self.hd // 2
        d = np.arange(self.hd_t)
        if adjacent_pairs:  # LLAMA_ROPE_TYPE_NORM: pair i = dims (2i, 2i + 1)
            self.head_map = 2 * self.k * (d // 2) + d % 2
        else:  # NeoX / M-RoPE: pair i = dims (i, i + half)
            self.head_map = np.where(d < half_t, self.k * d, self.k * (d - half_t) + half_w)  # dim in a head

    def head_rows(self, n_heads: int) -> np.ndarray:
        """Wide row of each trained row of a [n_heads x head_dim] projection output."""
        return (np.arange(n_heads)[:, None] * self.hd + self.head_map[None, :]).reshape(-1)


def _power_of_four(num: int, den: int) -> bool:
    """num / den is 4^j (j >= 0): its square root, a scale, is a power of two (exact in f32 and f16)."""
    if num % den:
        return False
    r = num // den
    return r & (r - 1) == 0 and r.bit_length() % 2 == 1


def _explicit_geometry(n_embd: int, n_head: int | None, n_head_kv: int | None, *, n_embd_t: int,
                       hd_t: int) -> tuple[int, int, int, int]:
    """(n_embd, n_head, n_head_kv, head_dim) for explicit head counts, checked: heads of
    n_embd // n_head, n_head a multiple of n_head_kv, and both scales (sqrt(n_embd / n_embd_t),
    sqrt(head_dim / hd_t)) powers of two."""
    if n_head is None or n_head_kv is None:
        raise ValueError("give both n_head and n_head_kv, or neither")
    if n_embd <= 0 or not _power_of_four(n_embd, n_embd_t):
        raise ValueError(f"n_embd {n_embd} must be the trained {n_embd_t} times a power of 4 (1, 4, 16, ...): the "
                         "residual scale sqrt(n_embd / trained) must be a power of two")
    if n_head <= 0 or n_head_kv <= 0 or n_embd % n_head or n_head % n_head_kv:
        raise ValueError(f"n_embd {n_embd} / n_head {n_head} / n_head_kv {n_head_kv}: n_embd must be a multiple "
                         "of n_head and n_head a multiple of n_head_kv")
    hd = n_embd // n_head
    if not _power_of_four(hd, hd_t):
        raise ValueError(f"head dim {hd} (n_embd {n_embd} / {n_head} heads) must be the trained {hd_t} times a "
                         "power of 4: the q/k scale sqrt(head dim / trained) must be a power of two")
    return n_embd, n_head, n_head_kv, hd


def _copy_metadata(w: GGUFWriter, info: GGUFInfo, overrides: dict) -> None:
    """Every key of ``info`` in its order and type, with ``overrides`` (key -> value) applied."""
    for key, value in info.metadata.items():
        vtype, elem = info.types[key]
        value = overrides.get(key, value)
        if vtype == ValueType.ARRAY:
            w.add_array(key, elem, value.tolist() if isinstance(value, np.ndarray) else list(value))
        else:
            w.add_value(key, vtype, value)


def _pad(shape: tuple[int, ...], dtype, rows=None, cols=None, value=None) -> np.ndarray:
    """A zero array of ``shape`` with ``value`` at [rows][:, cols] (either may be None: the first ones)."""
    out = np.zeros(shape, dtype)
    if value is None:
        return out
    value = np.asarray(value, np.float32)
    rows = np.arange(value.shape[0]) if rows is None else rows
    if out.ndim == 1:
        out[rows] = value
    else:
        cols = np.arange(value.shape[1]) if cols is None else cols
        out[np.ix_(rows, cols)] = value
    return out


def _residual_norm(L: "_Layout", weight: np.ndarray | None) -> np.ndarray:
    """A norm over the residual (trained dims 0..n_embd_t-1, s_r times larger): its weight / s_r (zero if None)."""
    return _pad((L.n_embd,), np.float32, L.res, value=None if weight is None else weight / np.float32(L.s_r))


def _add_ffn(w: GGUFWriter, L: "_Layout", p: str, t, *, n_ff_t: int, n_ff: int, mat, norm: str = "ffn_norm") -> None:
    """Block ``p``'s feed-forward: the trained units first (``t(name)``: the trained tensor, or None for
    a block the trained model does not have), ``ffn_down`` scaled by s_r into the residual; ``norm``: the
    name of its input norm (qwen35's is ``post_attention_norm``)."""
    ff_t = np.arange(n_ff_t)
    down = t("ffn_down")
    w.add_tensor(f"{p}.{norm}.weight", _residual_norm(L, t(norm)))
    w.add_tensor(f"{p}.ffn_gate.weight", _pad((n_ff, L.n_embd), mat, ff_t, L.res, t("ffn_gate")))
    w.add_tensor(f"{p}.ffn_up.weight", _pad((n_ff, L.n_embd), mat, ff_t, L.res, t("ffn_up")))
    w.add_tensor(f"{p}.ffn_down.weight", _pad((L.n_embd, n_ff), mat, L.res, ff_t,
                                              None if down is None else down * np.float32(L.s_r)))


def _pad_fc(L: "_Layout", fc_t: np.ndarray, mat) -> np.ndarray:
    """A draft's ``fc`` over target layer inputs side by side (each n_embd wide, the trained dims first),
    unscaled: it reads inputs s_r times the trained ones, so its output is s_r times the trained one."""
    n_feat = fc_t.shape[1] // L.n_embd_t
    cols = np.concatenate([j * L.n_embd + L.res for j in range(n_feat)])
    return _pad((L.n_embd, n_feat * L.n_embd), mat, L.res, cols, fc_t)


def _block(info: GGUFInfo, p: str, trained: bool):
    """``t(name)`` for block ``p``: the trained ``{p}.{name}.weight``, or None for every name when the
    trained model does not have the block."""
    return (lambda name: read_tensor(info, f"{p}.{name}.weight")) if trained else (lambda name: None)


def _add_attention(w: GGUFWriter, L: _Layout, p: str, t, *, mat, gated: bool = False) -> None:
    """Block ``p``'s attention norm and attention with q/k norms (module docstring, "heads"): trained head h
    at wide head h, its dims at ``L.head_map``; q and k times s_h, k_norm / s_h, ``attn_output`` times s_r.
    ``gated`` (qwen35): ``attn_q`` holds each head's query, then its output gate; the gate's dims go where
    the value dims they multiply go (``head_map`` too), unscaled."""
    qrows, kvrows, res, f32 = L.head_rows(L.n_head_t), L.head_rows(L.n_kv_t), L.res, np.float32
    q_out, kv_out = L.n_head * L.hd, L.n_kv * L.hd
    sc = lambda v, s: None if v is None else v * np.float32(s)  # noqa: E731
    w.add_tensor(f"{p}.attn_norm.weight", _residual_norm(L, t("attn_norm")))
    if gated:
        q = t("attn_q")
        if q is not None:  # [query | gate] per head: the query half times s_h
            q = q * np.tile(np.repeat(np.array([L.s_h, 1.0], f32), L.hd_t), L.n_head_t)[:, None]
        w.add_tensor(f"{p}.attn_q.weight", _pad((2 * q_out, L.n_embd), mat, L.head_rows(2 * L.n_head_t), res, q))
    else:
        w.add_tensor(f"{p}.attn_q.weight", _pad((q_out, L.n_embd), mat, qrows, res, sc(t("attn_q"), L.s_h)))
    w.add_tensor(f"{p}.attn_k.weight", _pad((kv_out, L.n_embd), mat, kvrows, res, sc(t("attn_k"), L.s_h)))
    w.add_tensor(f"{p}.attn_v.weight", _pad((kv_out, L.n_embd), mat, kvrows, res, t("attn_v")))
    w.add_tensor(f"{p}.attn_output.weight", _pad((L.n_embd, q_out), mat, res, qrows, sc(t("attn_output"), L.s_r)))
    w.add_tensor(f"{p}.attn_q_norm.weight", _pad((L.hd,), f32, L.head_map, value=t("attn_q_norm")))
    w.add_tensor(f"{p}.attn_k_norm.weight", _pad((L.hd,), f32, L.head_map, value=sc(t("attn_k_norm"), 1 / L.s_h)))


def _add_layers(w: GGUFWriter, info: GGUFInfo, L: _Layout, *, n_layer: int, n_ff_t: int, n_ff: int, mat) -> None:
    """Attention + FFN blocks: the trained ones padded, the rest zero."""
    n_layer_t = sum(1 for n in info.tensors if n.endswith(".attn_norm.weight"))
    for i in range(n_layer):
        p = f"blk.{i}"
        t = _block(info, p, i < n_layer_t)
        _add_attention(w, L, p, t, mat=mat)
        _add_ffn(w, L, p, t, n_ff_t=n_ff_t, n_ff=n_ff, mat=mat)


def _attention_overrides(arch: str, L: _Layout, *, n_layer: int, n_ff: int, sections) -> dict:
    return {f"{arch}.embedding_length": L.n_embd, f"{arch}.block_count": n_layer,
            f"{arch}.feed_forward_length": n_ff, f"{arch}.attention.head_count": L.n_head,
            f"{arch}.attention.head_count_kv": L.n_kv, f"{arch}.attention.key_length": L.hd,
            f"{arch}.attention.value_length": L.hd, f"{arch}.rope.dimension_count": L.hd,
            **({} if sections is None else {f"{arch}.rope.dimension_sections": [int(s) * L.k for s in sections]})}


def _check_trained(info: GGUFInfo, arch: str, *, sections: bool = True) -> None:
    if info.arch != arch:
        raise ValueError(f"{info.path}: expected a {arch!r} file, got {info.arch!r}")
    bad = [t.name for t in info.tensors.values() if t.ggml_type not in (0, 1)]
    if bad:
        raise ValueError(f"{info.path}: only F32/F16 tensors can be widened, not {bad[:3]}")
    hd = info.metadata[f"{arch}.attention.key_length"]
    if info.metadata[f"{arch}.rope.dimension_count"] != hd:
        raise ValueError(f"{info.path}: rope must span the head")
    if sections and int(np.sum(info.metadata[f"{arch}.rope.dimension_sections"])) != hd // 2:
        raise ValueError(f"{info.path}: rope sections must cover the head's {hd // 2} pairs")
    scaling = info.metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":  # YaRN's correction dims depend on the rope's width
        raise ValueError(f"{info.path}: rope scaling {scaling!r}; widen.py keeps rope frequencies only without it")


def write_widened_target(path: Path, trained: Path, *, n_embd: int, n_layer: int, n_ff: int, dtype: str) -> Path:
    """The trained target padded to ``n_embd`` (``tiny._geometry``'s heads), ``n_layer``, ``n_ff``."""
    return write_widened_hunyuan_vl(path, trained, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff, dtype=dtype)


def write_widened_hunyuan_vl(path: Path, trained: Path, *, n_embd: int, n_layer: int, n_ff: int, dtype: str,
                             n_head: int | None = None, n_head_kv: int | None = None,
                             what: str = "trained target") -> Path:
    """Any trained ``hunyuan_vl`` file (a target, or a draft model used with ``draft-simple``) padded to
    ``n_embd``, ``n_layer``, ``n_ff``: the same logits (module docstring). ``n_head`` / ``n_head_kv``
    None: ``tiny._geometry(n_embd)``'s heads (GQA ratio 2); given: heads of ``n_embd // n_head``,
    the trained GQA ratio kept and both scales powers of two (``_Layout``)."""
    info = read_gguf(trained, what)
    _check_trained(info, "hunyuan_vl")
    arch, m = info.arch, info.metadata
    n_layer_t, n_ff_t = int(m[f"{arch}.block_count"]), int(m[f"{arch}.feed_forward_length"])
    if n_layer < n_layer_t or n_ff < n_ff_t:
        raise ValueError(f"n_layer {n_layer} / n_ff {n_ff} below the trained {n_layer_t} / {n_ff_t}")
    L = _Layout(info, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv)
    mat = tiny._np_dtype(dtype)
    w = GGUFWriter()
    over = _attention_overrides(arch, L, n_layer=n_layer, n_ff=n_ff, sections=m[f"{arch}.rope.dimension_sections"])
    over["general.name"] = f"widened-{m.get('general.name', arch)}-{n_embd}x{n_layer}"
    _copy_metadata(w, info, over)
    n_vocab = info.tensors["token_embd.weight"].dims[1]
    w.add_tensor("token_embd.weight", _pad((n_vocab, L.n_embd), mat, None, L.res,
                                           read_tensor(info, "token_embd.weight") * np.float32(L.s_r)))
    w.add_tensor("output_norm.weight", _residual_norm(L, read_tensor(info, "output_norm.weight")))
    w.add_tensor("output.weight", _pad((n_vocab, L.n_embd), mat, None, L.res, read_tensor(info, "output.weight")))
    _add_layers(w, info, L, n_layer=n_layer, n_ff_t=n_ff_t, n_ff=n_ff, mat=mat)
    _check_all_padded(info, w, trained)
    w.write(path)
    return path


def _check_all_padded(info: GGUFInfo, w: GGUFWriter, trained: Path, renamed: dict | None = None) -> None:
    """Every trained tensor has its wide counterpart (a tensor left out would change the function);
    ``renamed``: trained name prefix -> wide one (a block that moves)."""
    renamed = renamed or {}
    # a moved block's trained names match only their new names (a wide tensor that happens to carry the old
    # name, a zero layer, says nothing of the moved one)
    wide = {n for n in w._tensors if not n.startswith(tuple(renamed))}
    for old, new in renamed.items():
        wide |= {old + n.removeprefix(new) for n in w._tensors if n.startswith(new)}
    extra = set(info.tensors) - wide
    if extra:
        raise ValueError(f"{trained}: tensors widen.py does not know how to pad: {sorted(extra)[:5]}")


def write_widened_draft(path: Path, trained: Path, trained_target: Path, *, n_embd: int, n_ff: int,
                        dtype: str) -> Path:
    info = read_gguf(trained, "trained draft")
    _check_trained(info, "dflash")
    arch, m = info.arch, info.metadata
    n_layer, n_ff_t = int(m[f"{arch}.block_count"]), int(m[f"{arch}.feed_forward_length"])
    if n_ff < n_ff_t:
        raise ValueError(f"draft n_ff {n_ff} below the trained {n_ff_t}")
    if int(m[f"{arch}.embedding_length"]) != read_gguf(trained_target).metadata["hunyuan_vl.embedding_length"]:
        raise ValueError("draft and target widths differ")
    L, mat = _Layout(info, n_embd=n_embd, n_ff=n_ff), tiny._np_dtype(dtype)
    w = GGUFWriter()
    over = _attention_overrides(arch, L, n_layer=n_layer, n_ff=n_ff, sections=m[f"{arch}.rope.dimension_sections"])
    over["general.name"] = f"widened-{m.get('general.name', arch)}-{n_embd}"
    _copy_metadata(w, info, over)
    fc_t = read_tensor(info, "fc.weight")  # numpy (n_embd_t, n_feat * n_embd_t)
    assert fc_t.shape[1] // L.n_embd_t == len(m["dflash.target_layers"])
    w.add_tensor("fc.weight", _pad_fc(L, fc_t, mat))
    for name in ("enc.output_norm.weight", "output_norm.weight"):
        w.add_tensor(name, _residual_norm(L, read_tensor(info, name)))
    _add_layers(w, info, L, n_layer=n_layer, n_ff_t=n_ff_t, n_ff=n_ff, mat=mat)
    _check_all_padded(info, w, trained)
    w.write(path)
    return path


def _check_eagle3(info: GGUFInfo, target: GGUFInfo) -> None:
    """What write_widened_eagle3's construction assumes of the trained EAGLE3 draft and its target."""
    _check_trained(info, "eagle3", sections=False)  # a plain 1-D rope
    m, ta = info.metadata, target.arch
    n_embd_t, n_layer_tgt = int(target.metadata[f"{ta}.embedding_length"]), int(target.metadata[f"{ta}.block_count"])
    if int(m["eagle3.embedding_length"]) != n_embd_t or int(m.get("eagle3.target_hidden_size", 0)) != n_embd_t:
        raise ValueError(f"{info.path}: the draft's width ({m['eagle3.embedding_length']}) and target_hidden_size "
                         f"({m.get('eagle3.target_hidden_size')}) must both be its target's n_embd ({n_embd_t})")
    layers = [int(x) for x in m.get("eagle3.target_layers", [])]
    if len(layers) != 3 or not all(0 <= x < n_layer_tgt for x in layers):
        # layer n_layer would be the target's final hidden state, which a deeper (widened) target
        # does not have at that index
        raise ValueError(f"{info.path}: eagle3.target_layers {layers} must be three layers of the trained "
                         f"target's {n_layer_tgt}")
    if int(m["eagle3.block_count"]) != 1:
        raise ValueError(f"{info.path}: an eagle3 draft has one decoder layer")
    for key in ("eagle3.norm_before_residual", "eagle3.norm_before_fc"):
        if m.get(key):  # the residual would carry the normed g (not s_r times the trained one)
            raise ValueError(f"{info.path}: {key} is set; widen.py pads only the plain EAGLE3 graph")
    own = [n for n in ("token_embd.weight", "output.weight", "d2t") if n in info.tensors]
    if own:
        raise ValueError(f"{info.path}: widen.py pads a draft that borrows its target's token embedding and "
                         f"output head, not one with {own}")


def write_widened_eagle3(path: Path, trained: Path, trained_target: Path, *, n_embd: int, n_ff: int,
                         dtype: str) -> Path:
    """The trained EAGLE3 draft padded to ``n_embd`` (its target: ``write_widened_target``'s at the same
    ``n_embd``): the same drafts from the widened target as the trained draft makes from the trained one.

    As src/models/eagle3.cpp computes it (no q/k norms, LLAMA_ROPE_TYPE_NORM rope, the target's
    token embedding and output head, the residual starting at the raw ``g``): ``fc`` unscaled (it
    reads target layer inputs s_r times the trained ones, so g is s_r times the trained g); every
    norm weight divided by s_r (``attn_norm`` over the target's embedding rows, which are s_r
    times the trained ones; ``attn_norm_2`` over g; ``ffn_norm``; ``output_norm``), so the
    [embedding | g] pair that Q/K/V read is the trained one, at columns 0..63 and n_embd..n_embd+63;
    Q alone scaled by s_h (q.k is then s_h times the trained one, which the wider head's 1/sqrt(64)
    cancels) with K and V as trained, so the KV cache holds the trained values; adjacent rope pairs
    (2i, 2i + 1) go to wide pair k*i, the same frequency; ``attn_output`` and ``ffn_down`` scaled by
    s_r, so the residual, the pre-norm output (the next step's g) included, is s_r times the trained.
    """
    info = read_gguf(trained, "trained EAGLE3 draft")
    target = read_gguf(trained_target, "trained target")
    _check_eagle3(info, target)
    arch, m = info.arch, info.metadata
    n_ff_t = int(m[f"{arch}.feed_forward_length"])
    if n_ff < n_ff_t:
        raise ValueError(f"EAGLE3 n_ff {n_ff} below the trained {n_ff_t}")
    L, mat = _Layout(info, n_embd=n_embd, n_ff=n_ff, adjacent_pairs=True), tiny._np_dtype(dtype)
    w = GGUFWriter()
    over = _attention_overrides(arch, L, n_layer=1, n_ff=n_ff, sections=None)
    over.update({"eagle3.target_hidden_size": L.n_embd,
                 "general.name": f"widened-{m.get('general.name', arch)}-{n_embd}"})
    _copy_metadata(w, info, over)
    f32, res, n_t = np.float32, L.res, L.n_embd_t
    t = lambda name: read_tensor(info, name)  # noqa: E731
    w.add_tensor("fc.weight", _pad_fc(L, t("fc.weight"), mat))  # the three layers' inputs side by side
    w.add_tensor("output_norm.weight", _residual_norm(L, t("output_norm.weight")))
    p = "blk.0"
    pair = np.concatenate([res, L.n_embd + res])  # [embedding | g]: trained columns 0..2n_t-1
    assert t(f"{p}.attn_q.weight").shape[1] == 2 * n_t
    qrows, kvrows = L.head_rows(L.n_head_t), L.head_rows(L.n_kv_t)
    q_out, kv_out = L.n_head * L.hd, L.n_kv * L.hd
    w.add_tensor(f"{p}.attn_norm.weight", _residual_norm(L, t(f"{p}.attn_norm.weight")))  # over the target's embedding rows
    w.add_tensor(f"{p}.attn_norm_2.weight", _residual_norm(L, t(f"{p}.attn_norm_2.weight")))  # over g
    w.add_tensor(f"{p}.attn_q.weight", _pad((q_out, 2 * L.n_embd), mat, qrows, pair,
                                            t(f"{p}.attn_q.weight") * f32(L.s_h)))
    w.add_tensor(f"{p}.attn_k.weight", _pad((kv_out, 2 * L.n_embd), mat, kvrows, pair, t(f"{p}.attn_k.weight")))
    w.add_tensor(f"{p}.attn_v.weight", _pad((kv_out, 2 * L.n_embd), mat, kvrows, pair, t(f"{p}.attn_v.weight")))
    w.add_tensor(f"{p}.attn_output.weight", _pad((L.n_embd, q_out), mat, res, qrows,
                                                 t(f"{p}.attn_output.weight") * f32(L.s_r)))
    _add_ffn(w, L, p, lambda name: t(f"{p}.{name}.weight"), n_ff_t=n_ff_t, n_ff=n_ff, mat=mat)
    _check_all_padded(info, w, trained)
    w.write(path)
    return path


def write_widened_mmproj(path: Path, trained: Path, *, n_embd: int) -> Path:
    """The trained mmproj (a ``qwen2vl_merger``, or a ``qwen3vl_merger`` without deepstack layers: the same
    mm.0 -> GELU -> mm.2 merger) with the merger's last projection (``mm.2``) padded to ``n_embd`` and scaled
    by s_r (image rows enter the residual); everything else as it is (f32)."""
    info = read_gguf(trained, "trained mmproj")
    kind = info.metadata.get("clip.projector_type")
    if kind not in ("qwen2vl_merger", "qwen3vl_merger"):
        raise ValueError(f"{trained}: only a qwen2vl_merger or qwen3vl_merger mmproj can be widened, not {kind!r}")
    if any(info.metadata.get("clip.vision.is_deepstack_layers", [])):
        # deepstack features are n_embd-wide slices added to target layers: not padded here
        raise ValueError(f"{trained}: a qwen3vl_merger with deepstack layers cannot be widened")
    n_t = int(info.metadata["clip.vision.projection_dim"])
    s_r = np.float32(math.sqrt(n_embd / n_t))
    w = GGUFWriter()
    _copy_metadata(w, info, {"clip.vision.projection_dim": n_embd,
                             "general.name": f"widened-{info.metadata.get('general.name', 'mmproj')}-{n_embd}"})
    res = np.arange(n_t)
    for name in info.tensors:
        x = read_tensor(info, name)
        if name == "mm.2.weight":
            x = _pad((n_embd, x.shape[1]), x.dtype, res, None, x * s_r)
        elif name == "mm.2.bias":
            x = _pad((n_embd,), x.dtype, res, value=x * s_r)
        w.add_tensor(name, x)
    w.write(path)
    return path


class _DeltaNet:
    """Where a qwen35 gated delta net's trained heads go: head h stays head h (of ``hd`` =
    ``ssm.state_size`` dims, as trained), zero heads after them up to ``n_heads``; key heads = value heads."""

    def __init__(self, info: GGUFInfo, *, n_heads: int):
        a, m = info.arch, info.metadata
        self.hd, self.d_conv = int(m[f"{a}.ssm.state_size"]), int(m[f"{a}.ssm.conv_kernel"])
        self.n_t, n_k_t = int(m[f"{a}.ssm.time_step_rank"]), int(m[f"{a}.ssm.group_count"])
        if n_k_t != self.n_t or int(m[f"{a}.ssm.inner_size"]) != self.n_t * self.hd:
            # with as many key heads as value heads every value head reads its own key head, however
            # llama.cpp maps one to the other (repeat, or the fused kernel's index)
            raise ValueError(f"{info.path}: widen.py pads a delta net of as many key as value heads "
                             f"(ssm.group_count {n_k_t}, ssm.time_step_rank {self.n_t}) of ssm.state_size dims")
        if n_heads < self.n_t:
            raise ValueError(f"{n_heads} delta-net heads: fewer than the trained {self.n_t}")
        self.n = n_heads
        kd_t, kd = self.n_t * self.hd, self.n * self.hd
        # attn_qkv's rows and the conv channels are [q heads | k heads | v heads], ggml's views of them
        # start at 0, key_dim and 2 key_dim: each part keeps its trained heads first
        self.qkv = np.concatenate([np.arange(kd_t), kd + np.arange(kd_t), 2 * kd + np.arange(kd_t)])
        self.v = np.arange(kd_t)  # z's rows and ssm_out's columns: [head, dim], the trained heads first
        self.heads = np.arange(self.n_t)  # ssm_a, ssm_dt, ssm_beta, ssm_alpha: one per value head


def _add_delta_net(w: GGUFWriter, L: _Layout, D: _DeltaNet, p: str, t, raw, *, mat) -> None:
    """Block ``p``'s gated delta net (``t(name)``: ``{p}.{name}.weight``, ``raw(name)``: ``{p}.{name}``,
    trained, or None for a zero block): the trained heads in place (``_DeltaNet``), ``ssm_out`` times s_r.
    A zero head (or block) has q = k = v = 0 (zero projections and conv taps), so its state stays 0, its
    output and gated norm are 0, and its ``ssm_a`` / ``ssm_dt`` of 0 decay nothing (exp(0) = 1)."""
    f32, n_qkv, n_v = np.float32, 3 * D.n * D.hd, D.n * D.hd
    out = t("ssm_out")
    w.add_tensor(f"{p}.attn_norm.weight", _residual_norm(L, t("attn_norm")))
    w.add_tensor(f"{p}.attn_qkv.weight", _pad((n_qkv, L.n_embd), mat, D.qkv, L.res, t("attn_qkv")))
    w.add_tensor(f"{p}.attn_gate.weight", _pad((n_v, L.n_embd), mat, D.v, L.res, t("attn_gate")))
    w.add_tensor(f"{p}.ssm_conv1d.weight", _pad((n_qkv, D.d_conv), f32, D.qkv, None, t("ssm_conv1d")))
    w.add_tensor(f"{p}.ssm_dt.bias", _pad((D.n,), f32, D.heads, value=raw("ssm_dt.bias")))
    w.add_tensor(f"{p}.ssm_a", _pad((D.n,), f32, D.heads, value=raw("ssm_a")))
    w.add_tensor(f"{p}.ssm_beta.weight", _pad((D.n, L.n_embd), mat, D.heads, L.res, t("ssm_beta")))
    w.add_tensor(f"{p}.ssm_alpha.weight", _pad((D.n, L.n_embd), mat, D.heads, L.res, t("ssm_alpha")))
    w.add_tensor(f"{p}.ssm_norm.weight", _pad((D.hd,), f32, value=t("ssm_norm")))  # per head, shared
    w.add_tensor(f"{p}.ssm_out.weight", _pad((L.n_embd, n_v), mat, L.res, D.v,
                                             None if out is None else out * f32(L.s_r)))


def _qwen35_recurrent(info: GGUFInfo, n_layer_t: int) -> list[bool]:
    """Which trained trunk layers are gated delta nets, as llama.cpp reads it: the
    ``attention.recurrent_layers`` array, else a layer is recurrent unless (i + 1) % full_attention_interval
    is 0 (default 4)."""
    m = info.metadata
    plan = m.get("qwen35.attention.recurrent_layers")
    if plan is None:
        every = int(m.get("qwen35.full_attention_interval", QWEN35_FULL_ATTENTION_INTERVAL))
        return [(i + 1) % every != 0 for i in range(n_layer_t)]
    if any(plan[n_layer_t:]):
        raise ValueError(f"{info.path}: its nextn (MTP) block is marked recurrent")
    return [bool(x) for x in plan[:n_layer_t]]


def _qwen35_layout(info: GGUFInfo, *, n_embd: int, n_layer: int, n_ff: int):
    """The checks and layouts of ``write_widened_qwen35``: (attention layout, delta-net layout, the wide
    file's recurrent layers, trunk and nextn block included, trained trunk layers, trained n_ff)."""
    _check_trained(info, "qwen35")
    m = info.metadata
    n_all_t, n_ff_t = int(m["qwen35.block_count"]), int(m["qwen35.feed_forward_length"])
    if int(m.get("qwen35.nextn_predict_layers", 0)) != 1:
        raise ValueError(f"{info.path}: widen.py pads a qwen35 target with one MTP (nextn) block, not "
                         f"{m.get('qwen35.nextn_predict_layers', 0)}")
    n_layer_t = n_all_t - 1
    if m["qwen35.attention.key_length"] != m["qwen35.attention.value_length"]:
        raise ValueError(f"{info.path}: key and value heads must be of one size")
    if "output.weight" not in info.tensors:  # tied: the head would read the s_r-times token embedding
        raise ValueError(f"{info.path}: widen.py pads a qwen35 target with its own output.weight")
    if n_embd <= 0 or not _power_of_four(n_embd, int(m["qwen35.embedding_length"])):
        raise ValueError(f"n_embd {n_embd} must be the trained {m['qwen35.embedding_length']} times a power of 4 "
                         "(256, 1024, 4096): the residual scale sqrt(n_embd / trained) must be a power of two")
    if n_layer < n_layer_t or n_ff < n_ff_t:
        raise ValueError(f"n_layer {n_layer} / n_ff {n_ff} below the trained {n_layer_t} / {n_ff_t}")
    L = _Layout(info, n_embd=n_embd, n_ff=n_ff)
    if L.k % 3 != 1:  # interleaved M-RoPE: pair i's section is chosen by i % 3 (module docstring)
        raise ValueError(f"head dim {L.hd} is {L.k} times the trained {L.hd_t}: the interleaved M-RoPE keeps "
                         "its sections only for a factor of 1 modulo 3 (a power of 4)")
    D = _DeltaNet(info, n_heads=n_embd // L.n_embd_t * int(m["qwen35.ssm.time_step_rank"]))
    trained = _qwen35_recurrent(info, n_layer_t)
    recurrent = [trained[i] if i < n_layer_t else (i + 1) % QWEN35_FULL_ATTENTION_INTERVAL != 0
                 for i in range(n_layer)] + [False]
    return L, D, recurrent, n_layer_t, n_ff_t


def write_widened_qwen35(path: Path, trained: Path, *, n_embd: int, n_layer: int, n_ff: int, dtype: str) -> Path:
    """The trained ``qwen35`` target with its MTP (nextn) block padded to ``n_embd``, ``n_layer`` trunk layers
    and ``n_ff``: the same logits, hidden state and MTP head (module docstring, "qwen35 + MTP")."""
    info = read_gguf(trained, "trained qwen35 target")
    L, D, recurrent, n_layer_t, n_ff_t = _qwen35_layout(info, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff)
    arch, m, mat, f32 = info.arch, info.metadata, tiny._np_dtype(dtype), np.float32
    w = GGUFWriter()
    over = _attention_overrides(arch, L, n_layer=n_layer + 1, n_ff=n_ff,
                                sections=m[f"{arch}.rope.dimension_sections"])
    over.update({f"{arch}.ssm.group_count": D.n, f"{arch}.ssm.time_step_rank": D.n,
                 f"{arch}.ssm.inner_size": D.n * D.hd, f"{arch}.attention.recurrent_layers": recurrent,
                 "general.name": f"widened-{m.get('general.name', arch)}-{n_embd}x{n_layer}"})
    _copy_metadata(w, info, over)
    if f"{arch}.attention.recurrent_layers" not in m:  # the layers past the trained ones follow the interval rule
        w.add_array(f"{arch}.attention.recurrent_layers", ValueType.BOOL, recurrent)
    n_vocab = info.tensors["token_embd.weight"].dims[1]
    w.add_tensor("token_embd.weight", _pad((n_vocab, L.n_embd), mat, None, L.res,
                                           read_tensor(info, "token_embd.weight") * f32(L.s_r)))
    # the final norm's weight as trained: its output (the hidden state the MTP head reads) is s_r times the
    # trained one, which the head's hnorm takes as it takes the residual; the output head divides it out
    w.add_tensor("output_norm.weight", _pad((L.n_embd,), f32, L.res, value=read_tensor(info, "output_norm.weight")))
    w.add_tensor("output.weight", _pad((n_vocab, L.n_embd), mat, None, L.res,
                                       read_tensor(info, "output.weight") / f32(L.s_r)))
    for i in range(n_layer):
        p = f"blk.{i}"
        t = _block(info, p, i < n_layer_t)
        if recurrent[i]:
            raw = (lambda name: read_tensor(info, f"{p}.{name}")) if i < n_layer_t else (lambda name: None)
            _add_delta_net(w, L, D, p, t, raw, mat=mat)
        else:
            _add_attention(w, L, p, t, mat=mat, gated=True)
        _add_ffn(w, L, p, t, n_ff_t=n_ff_t, n_ff=n_ff, mat=mat, norm="post_attention_norm")
    # the MTP block: [enorm(token embedding), hnorm(hidden state)] -> eh_proj -> a gated attention layer;
    # both inputs are s_r times the trained ones, so both norms / s_r; eh_proj's output enters its residual
    p, t = f"blk.{n_layer}", _block(info, f"blk.{n_layer_t}", True)
    _add_attention(w, L, p, t, mat=mat, gated=True)
    _add_ffn(w, L, p, t, n_ff_t=n_ff_t, n_ff=n_ff, mat=mat, norm="post_attention_norm")
    pair = np.concatenate([L.res, L.n_embd + L.res])  # ggml_concat(e, h): the embedding half first
    w.add_tensor(f"{p}.nextn.eh_proj.weight", _pad((L.n_embd, 2 * L.n_embd), mat, L.res, pair,
                                                   t("nextn.eh_proj") * f32(L.s_r)))
    w.add_tensor(f"{p}.nextn.enorm.weight", _residual_norm(L, t("nextn.enorm")))
    w.add_tensor(f"{p}.nextn.hnorm.weight", _residual_norm(L, t("nextn.hnorm")))
    _check_all_padded(info, w, trained, renamed={f"blk.{n_layer_t}.": f"blk.{n_layer}."})
    w.write(path)
    return path


def _digest(paths) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(Path(p).read_bytes())
    return h.hexdigest()[:16]


def widen_trained_pair(folder: str | Path, *, trained: str | Path = MODELS_DIR, n_embd: int = 1024,
                       n_layer: int = 12, n_ff: int = 2816, draft_n_ff: int | None = None,
                       dtype: str = "f16") -> tiny.TinyModels:
    """Write (or reuse) the trained tiny pair widened by zero padding, in ``folder``.

    The trained tiny function at the cost of a 142M model: with the defaults the target has
    ``make_bench_set``'s shapes (``hunyuan_vl``, n_embd 1024 = 16 heads of 64 / 8 KV heads,
    12 layers, n_ff 2816, f16 matrices; 142,135,808 parameters as ``Model.n_params`` counts
    them, ``tiny.bench_n_params()``), the 2-layer draft n_ff ``draft_n_ff`` (default n_ff:
    26,745,088 parameters), and both compute what the trained pair in ``trained``
    (default: the embedded ``pyllama_spec/models``) computes; see the module docstring for
    the construction and for what f16 changes.  ``n_embd`` is 64 (no widening: only the
    dtype changes) or a multiple of 128 from 256 up (heads of 64); ``n_layer`` and ``n_ff``
    at least the trained 4 and 256.

    Files are named ``widened-hunyuan_vl-{hash}-{target,mmproj,draft}.gguf`` by a hash of the
    parameters, ``WIDEN_VERSION`` and the trained files' bytes, and written atomically (a
    temporary name, then a rename), so a second call reuses them.  Writing the default set
    takes a few seconds (peak memory under 1 GB).
    """
    trained = Path(trained)
    src = tiny.TinyModels(target=trained / TARGET, mmproj=trained / MMPROJ, draft=trained / DRAFT)
    draft_n_ff = n_ff if draft_n_ff is None else draft_n_ff
    tiny._np_dtype(dtype)
    params = dict(v=WIDEN_VERSION, kind="widened", trained=_digest([src.target, src.mmproj, src.draft]),
                  n_embd=n_embd, n_layer=n_layer, n_ff=n_ff, draft_n_ff=draft_n_ff, dtype=dtype)
    models = tiny._set_paths(folder, "widened", "hunyuan_vl", params)
    if not models.target.exists():
        tiny._write_atomic(lambda p: write_widened_target(p, src.target, n_embd=n_embd, n_layer=n_layer,
                                                          n_ff=n_ff, dtype=dtype), models.target)
    if not models.mmproj.exists():
        tiny._write_atomic(lambda p: write_widened_mmproj(p, src.mmproj, n_embd=n_embd), models.mmproj)
    if not models.draft.exists():
        tiny._write_atomic(lambda p: write_widened_draft(p, src.draft, src.target, n_embd=n_embd, n_ff=draft_n_ff,
                                                         dtype=dtype), models.draft)
    return models


def widen_trained_eagle3(folder: str | Path, *, trained: str | Path = MODELS_DIR, n_embd: int = 1024,
                         n_ff: int = 2816, dtype: str = "f16") -> Path:
    """Write (or reuse) the trained EAGLE3 draft (``trained-eagle3.gguf`` in ``trained``) widened to
    ``n_embd`` in ``folder``: the draft for ``widen_trained_pair``'s target at the same ``n_embd``
    (any ``n_layer``: it reads target layers 1, 2, 3), proposing what the trained draft proposes with
    the trained target (``write_widened_eagle3``; in f16 up to the rounding the module docstring
    describes). ``n_ff`` is the draft's (default the pair's 2816: 17,043,456 parameters at n_embd 1024).

    Named ``widened-eagle3-{hash}.gguf`` by a hash of the parameters, ``WIDEN_VERSION`` and the
    trained target's and draft's bytes (``tiny.cached_file``), written atomically, reused by a
    second call.
    """
    trained = Path(trained)
    src, tgt = trained / EAGLE3, trained / TARGET
    tiny._np_dtype(dtype)
    params = dict(kind="widened-eagle3", trained=_digest([tgt, src]), n_embd=n_embd, n_ff=n_ff, dtype=dtype)

    def write(path, **_):
        write_widened_eagle3(path, src, tgt, n_embd=n_embd, n_ff=n_ff, dtype=dtype)

    return tiny.cached_file(folder, "widened-eagle3", WIDEN_VERSION, params, write)


def widen_trained_draft_model(folder: str | Path, *, trained: str | Path = MODELS_DIR, n_embd: int = 768,
                              n_head: int | None = None, n_head_kv: int | None = None, n_layer: int | None = None,
                              n_ff: int = 2048, dtype: str = "f16") -> Path:
    """Write (or reuse) the trained draft model (``trained-draft-vlm.gguf`` in ``trained``, without its
    optional projector) widened by zero padding in ``folder``: as ``spec_type="draft-simple"`` beside
    ``widen_trained_pair``'s target it proposes what the trained draft model proposes beside the
    trained target (it reads nothing of the target, so any target width; in f16 up to the rounding
    the module docstring describes).

    Same construction as the target's (``write_widened_hunyuan_vl``) with explicit heads: by default
    n_embd 768 = 12 heads of 64 with 4 KV heads (the trained GQA ratio 3; ``n_head`` default
    n_embd // 64, ``n_head_kv`` default n_head / 3), residual scale sqrt(768 / 48) = 4, head scale
    sqrt(64 / 16) = 2, ``n_layer`` default the trained 2, ``n_ff`` 2048, f16 matrices.  ``n_embd`` must
    be 48 times a power of 4 (192, 768, 3072) so that both scales are powers of two.

    Named ``widened-draft-model-{hash}.gguf`` by a hash of the parameters, ``WIDEN_VERSION`` and the
    trained draft's bytes (``tiny.cached_file``), written atomically, reused by a second call.
    """
    src = Path(trained) / DRAFT_MODEL
    tiny._np_dtype(dtype)
    info = read_gguf(src, "trained draft model")
    _check_trained(info, "hunyuan_vl")
    m = info.metadata
    n_head_t, n_kv_t = int(m["hunyuan_vl.attention.head_count"]), int(m["hunyuan_vl.attention.head_count_kv"])
    if n_head is None:
        n_head = n_embd // 64 if n_embd % 64 == 0 else 0
    if n_head_kv is None:
        n_head_kv = n_head * n_kv_t // n_head_t if n_head * n_kv_t % n_head_t == 0 else 0
    n_layer_t, n_ff_t = int(m["hunyuan_vl.block_count"]), int(m["hunyuan_vl.feed_forward_length"])
    n_layer = n_layer_t if n_layer is None else n_layer
    if n_layer < n_layer_t or n_ff < n_ff_t:
        raise ValueError(f"draft model n_layer {n_layer} / n_ff {n_ff} below the trained {n_layer_t} / {n_ff_t}")
    # the checks, before naming a file (a bad width leaves nothing behind)
    _Layout(info, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv)
    params = dict(kind="widened-draft-model", trained=_digest([src]), n_embd=n_embd, n_head=n_head,
                  n_head_kv=n_head_kv, n_layer=n_layer, n_ff=n_ff, dtype=dtype)

    def write(path, **_):
        write_widened_hunyuan_vl(path, src, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff, dtype=dtype, n_head=n_head,
                                 n_head_kv=n_head_kv, what="trained draft model")

    return tiny.cached_file(folder, "widened-draft-model", WIDEN_VERSION, params, write)


def widen_trained_qwen35_mtp(folder: str | Path, *, trained: str | Path = MODELS_DIR, n_embd: int = 1024,
                             n_layer: int = 12, n_ff: int = 2240, dtype: str = "f16") -> tiny.TinyModels:
    """Write (or reuse) the trained qwen35 target with its MTP head (``trained-qwen35-mtp.gguf`` in
    ``trained``) and its projector widened by zero padding, in ``folder``: with ``spec_type="draft-mtp"``
    (no draft file: the head is the target's nextn block) it drafts and accepts what the trained target's
    head does, and alone gives the trained logits (``write_widened_qwen35``; in f16 up to the rounding the
    module docstring describes).

    Defaults: n_embd 1024 (gated attention of 16 heads of 64 with 8 KV heads; delta nets of 64 key =
    64 value heads of 16), 12 trunk layers (the trained four -- a delta net, three attention layers --
    then 8 zero layers, each a delta net unless (i + 1) % 4 == 0: 7 delta nets and 5 attention layers in
    all), n_ff 2240, f16 matrices: 141,828,720 parameters in the trunk a target decode runs (about the
    142M of ``widen_trained_pair``'s target), 13,176,960 in the MTP block a draft step runs,
    155,005,680 in all (``Model.n_params``).  ``n_embd`` must be 64 times a power of 4 (256, 1024, 4096),
    so that both scales are powers of two; ``n_layer`` (the trunk's, the MTP block comes after) and
    ``n_ff`` at least the trained 4 and 256.

    Returns a ``TinyModels`` with ``draft`` None.  Named ``widened-qwen35-{hash}-{target,mmproj}.gguf`` by a
    hash of the parameters, ``WIDEN_VERSION`` and the trained files' bytes, written atomically, reused by a
    second call.

    >>> import pyllama_spec as ps
    >>> m = widen_trained_qwen35_mtp("/tmp/widened")                                # doctest: +SKIP
    >>> with ps.load(m.target, mmproj=m.mmproj, spec_type="draft-mtp", draft_max=3) as engine:  # doctest: +SKIP
    ...     print(engine.generate("def add(a, b):\\n", max_tokens=16).stats.acceptance_rate)
    """
    trained = Path(trained)
    src, proj = trained / QWEN35_MTP, trained / QWEN35_MTP_MMPROJ
    tiny._np_dtype(dtype)
    # the checks, before naming a file (a bad width leaves nothing behind)
    _qwen35_layout(read_gguf(src, "trained qwen35 target"), n_embd=n_embd, n_layer=n_layer, n_ff=n_ff)
    params = dict(v=WIDEN_VERSION, kind="widened-qwen35-mtp", trained=_digest([src, proj]), n_embd=n_embd,
                  n_layer=n_layer, n_ff=n_ff, dtype=dtype)
    paths = tiny._set_paths(folder, "widened", "qwen35", params)
    models = tiny.TinyModels(target=paths.target, mmproj=paths.mmproj, draft=None)
    if not models.target.exists():
        tiny._write_atomic(lambda p: write_widened_qwen35(p, src, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff,
                                                          dtype=dtype), models.target)
    if not models.mmproj.exists():
        tiny._write_atomic(lambda p: write_widened_mmproj(p, proj, n_embd=n_embd), models.mmproj)
    return models
