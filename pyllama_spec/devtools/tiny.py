"""Tiny, real GGUF models for tests: a vision-language target, its mmproj and a DFlash draft.

All three files share one byte-level tokenizer (GPT-2 style BPE over the 256
byte tokens plus a few merges and ChatML/vision/mask control tokens), are
built deterministically from a seed with numpy, and load in the pinned
llama.cpp / libmtmd in a few milliseconds.

* ``write_target``: an M-RoPE text model that records its layer inputs, so it
  can feed a DFlash draft: dense ``hunyuan_vl``, hybrid ``qwen35`` (gated
  delta net layers alternating with attention, ``full_attention_interval`` 2),
  ``qwen2vl`` (q/k/v biases, no q/k norms) or ``qwen3vl`` (q/k norms plus
  deepstack: ``n_deepstack`` extra input slices of width n_embd, added to the
  outputs of the first ``n_deepstack`` layers, so ``n_embd_inp`` =
  n_embd x (1 + n_deepstack)).  ``qwen2vl`` / ``qwen3vl`` record their layer
  inputs only in a build with ``patches/0001-record-layer-inputs-qwen-vl.patch``.
* ``write_mmproj``: a ``clip`` vision tower with the ``qwen2vl_merger``
  projector, or the ``qwen3vl_merger`` projector with deepstack layers (its
  output rows are n_embd x (1 + len(deepstack_layers)) wide, matching a
  ``qwen3vl`` target); a 672x672 image becomes 576 image tokens over 24
  positions.
* ``write_draft``: a ``dflash`` draft that borrows the target's token
  embedding and output head (through the draft context's ``ctx_other``).
* ``make_tiny_set``: all three, cached in a folder by a hash of the parameters.
* ``write_draft(dflash2=True)`` / ``make_tiny_set(dflash2=True)``: a DFlash2 draft (conv
  layers plus a candidate selector whose lattice the engine walks).
* ``make_draft_vlm``: a small VLM with the same vocabulary and a projector of its own, wider
  than the targets (a vision draft model for ``draft-simple`` with ``mmproj_draft``).
* ``make_bench_set``: the same three, wider (n_embd 1024, 12 layers: a 142M-parameter
  f16 target) for benchmarks, cached the same way.

Widths: n_embd 64 (4 query heads, 2 KV heads of 16) gives the original tiny files; any
multiple of 128 gives heads of 64 (``n_embd // 64`` query heads, half as many KV heads).
``dtype`` ("f32" or "f16") sets how the matrices are stored.

The ``predictable`` knob (target only; the draft needs nothing extra):
random weights give a draft that is never accepted.  With ``predictable`` > 0
every token embedding gets a coefficient along one shared unit direction ``s``
(which is projected out of all other embedding and output rows), and the output
row of ``ATTRACTOR_TOKEN_ID`` reads ``s``.  Layer weights are small, so the
residual stream, and hence the greedy choice, is dominated by the current
token's embedding:

* a fraction ``predictable`` of the tokens carry ``+s``: after them the target's
  greedy choice is the attractor token;
* the attractor itself carries ``-s`` (so the target moves on to another token;
  that token is forced into the ``+s`` set so the walk comes back), except at
  ``predictable`` = 1 where it carries ``+s`` and the target repeats it forever;
* the mask token carries ``+2s``: the draft, whose block rows are mask tokens
  and whose own weights are small, proposes the attractor at every position.

So at 0 < predictable < 1 a speculative step typically accepts the first draft
token and rejects the next (exercising both accept and rollback); at 1 every
draft token is accepted.  Control tokens have zero output rows: the tiny
targets never choose them (in particular never EOS), they generate until a
token limit.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pyllama_spec.embedded import TinyModels, draw_demo_image  # noqa: F401 - owned at run time, used here and by tests
from pyllama_spec.gguf.writer import GGUFWriter, ValueType

# Bump when the generated files change, so make_tiny_set caches are invalidated.
GENERATOR_VERSION = 2
#: The training context the tiny models declare: long, so tests can run long chats (it is only metadata).
TINY_CONTEXT_LENGTH = 131072

# -- tokenizer ------------------------------------------------------------------


def _bytes_to_unicode() -> list[str]:
    """GPT-2's reversible byte -> printable unicode character map, indexed by byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


BYTE_TOKENS = _bytes_to_unicode()  # token id == byte value
MERGES = [("Ġ", "t"), ("h", "e"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("Ġt", "he")]
MERGED_TOKENS = [a + b for a, b in MERGES]

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, MASK_TOKEN]

TOKENS = BYTE_TOKENS + MERGED_TOKENS + SPECIAL_TOKENS
N_VOCAB = len(TOKENS)
#: Fill-in-the-middle tokens (Qwen2.5-Coder's names) by llama.cpp's role, appended after TOKENS by
#: ``fim=True`` (llama-server's /infill needs pre, suf and mid; rep and sep give the repo-level layout).
FIM_TOKENS = {"pre": "<|fim_prefix|>", "suf": "<|fim_suffix|>", "mid": "<|fim_middle|>", "pad": "<|fim_pad|>",
              "rep": "<|repo_name|>", "sep": "<|file_sep|>"}
FIM_TOKEN_ID = {role: N_VOCAB + i for i, role in enumerate(FIM_TOKENS)}
TOKEN_ID = {t: i for i, t in enumerate(TOKENS)}
BOS_TOKEN_ID = PAD_TOKEN_ID = TOKEN_ID[ENDOFTEXT]
EOS_TOKEN_ID = TOKEN_ID[IM_END]
MASK_TOKEN_ID = TOKEN_ID[MASK_TOKEN]
FIRST_SPECIAL_ID = TOKEN_ID[ENDOFTEXT]
# the token a `predictable` target tends to choose (a plain byte token: "a")
ATTRACTOR_TOKEN_ID = ord("a")

_TOKEN_TYPE_NORMAL, _TOKEN_TYPE_CONTROL = 1, 3

# ChatML; content may be a string or a list of parts with "text" (llama-server
# sends image parts as {"type": "media_marker", "text": "<__media__>"}).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['text'] is defined -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _add_tokenizer(w: GGUFWriter, *, with_mask_id: bool = False, chat_template: str = CHAT_TEMPLATE,
                   fim: bool = False, merges: bool = True) -> None:
    """The tiny tokenizer's keys; ``merges=False`` writes no merges (one byte, one token; the merged
    tokens stay in the vocabulary, never produced by tokenizing)."""
    tokens = TOKENS + list(FIM_TOKENS.values()) if fim else TOKENS
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "qwen2")
    w.add_array("tokenizer.ggml.tokens", ValueType.STRING, tokens)
    types = [_TOKEN_TYPE_NORMAL] * (len(BYTE_TOKENS) + len(MERGED_TOKENS))
    types += [_TOKEN_TYPE_CONTROL] * (len(tokens) - len(types))
    w.add_array("tokenizer.ggml.token_type", ValueType.INT32, types)
    if fim:  # llama.cpp's keys (it would also find these tokens by their text)
        for role, token in FIM_TOKEN_ID.items():
            w.add_uint32(f"tokenizer.ggml.fim_{role}_token_id", token)
    w.add_array("tokenizer.ggml.merges", ValueType.STRING, [f"{a} {b}" for a, b in MERGES] if merges else [])
    w.add_uint32("tokenizer.ggml.bos_token_id", BOS_TOKEN_ID)
    w.add_uint32("tokenizer.ggml.eos_token_id", EOS_TOKEN_ID)
    w.add_uint32("tokenizer.ggml.padding_token_id", PAD_TOKEN_ID)
    if with_mask_id:
        w.add_uint32("tokenizer.ggml.mask_token_id", MASK_TOKEN_ID)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.chat_template", chat_template)


# -- shared shapes -------------------------------------------------------------

# head geometry of the original width (n_embd 64); wider models use _geometry(n_embd)
N_HEAD, N_HEAD_KV, HEAD_DIM = 4, 2, 16
TINY_N_EMBD = N_HEAD * HEAD_DIM
# wider models: head dim 64, n_embd // 64 query heads, half as many KV heads
WIDE_HEAD_DIM = 64
DTYPES = {"f32": np.float32, "f16": np.float16}
TARGET_ARCHS = ("hunyuan_vl", "qwen35", "qwen35moe", "qwen2vl", "qwen3vl")
#: Target architectures ``write_target(mtp=True)`` can give a multi-token-prediction block.
MTP_ARCHS = ("qwen35", "qwen35moe")
#: The tiny qwen35moe's experts: how many, how many a token uses (its shared expert comes besides).
MOE_N_EXPERT, MOE_N_EXPERT_USED = 4, 2
#: Size of the hidden state's contribution to the tiny MTP block's input (``_add_mtp_block``).
MTP_HIDDEN_STD = 0.5
PROJECTORS = ("qwen2vl_merger", "qwen3vl_merger")
# deepstack of the tiny qwen3vl set: vision blocks 0 and 1 feed target layers 0 and 1
QWEN3VL_DEEPSTACK_LAYERS = (0, 1)
# scales of the `predictable` construction (see module docstring)
_SHARED_COEF, _ATTRACTOR_GAIN, _OUTPUT_STD, _LAYER_STD = 4.0, 3.0, 0.1, 0.02


@dataclass(frozen=True)
class _Geometry:
    """Attention shapes for one width (also the qwen35 gated-delta-net shapes: heads of
    ``head_dim``, ``n_head_kv`` key heads, ``n_head`` value heads)."""

    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int

    @property
    def tiny(self) -> bool:
        """The original width: weights are drawn in float64 (the original stream, byte-identical files)."""
        return self.n_embd == TINY_N_EMBD

    @property
    def rope_sections(self) -> list[int]:
        # M-RoPE sections summing to head_dim / 2, the first two > 0: Qwen2-VL's [16, 24, 24, 0]
        # scaled, i.e. [2, 3, 3, 0] at head dim 16 and [8, 12, 12, 0] at 64
        return [self.head_dim // 8, 3 * self.head_dim // 16, 3 * self.head_dim // 16, 0]

    @property
    def layer_std(self) -> float:
        # keep the per-element size of each layer's contribution independent of the width
        # (exactly _LAYER_STD at n_embd 64), so `predictable` works the same at any width
        return _LAYER_STD * float(np.sqrt(TINY_N_EMBD / self.n_embd))

    @property
    def output_std(self) -> float:
        return _OUTPUT_STD * float(np.sqrt(TINY_N_EMBD / self.n_embd))


def _geometry(n_embd: int, what: str = "n_embd") -> _Geometry:
    """Head geometry for a width: 4 / 2 heads of 16 at 64, else heads of 64 (``n_embd // 64``
    query heads, half as many KV heads); ``n_embd`` must then be a multiple of 128."""
    if n_embd == TINY_N_EMBD:
        return _Geometry(n_embd, N_HEAD, N_HEAD_KV, HEAD_DIM)
    if n_embd <= 0 or n_embd % (2 * WIDE_HEAD_DIM):
        raise ValueError(f"{what} must be {TINY_N_EMBD} or a multiple of {2 * WIDE_HEAD_DIM}, got {n_embd}")
    n_head = n_embd // WIDE_HEAD_DIM
    return _Geometry(n_embd, n_head, n_head // 2, WIDE_HEAD_DIM)


def _np_dtype(dtype: str):
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def _rms_norm(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)


class _Weights:
    """Draws tensors in a fixed order from one seeded generator.

    ``fast=False`` draws float64 and rounds to float32 (the original stream of the
    n_embd 64 models); ``fast=True`` draws float32 directly (about twice as fast, for
    wide models).  Matrices (``mat``) are stored as ``dtype``; ``mat(..., keep_f32=True)``
    and ``vec`` stay float32 (norms, biases, convolutions, additive embeddings).
    """

    def __init__(self, seed: int, std: float = _LAYER_STD, *, fast: bool = False, dtype=np.float32):
        self.rng = np.random.default_rng(seed)
        self.std = std
        self.fast = fast
        self.dtype = dtype

    def mat(self, n_out: int, n_in: int, std: float | None = None, *, keep_f32: bool = False) -> np.ndarray:
        """A weight with ggml dims [n_in, n_out] (numpy shape (n_out, n_in))."""
        s = self.std if std is None else std
        if self.fast:
            x = self.rng.standard_normal((n_out, n_in), dtype=np.float32)
            x *= np.float32(s)
        else:
            x = (self.rng.standard_normal((n_out, n_in)) * s).astype(np.float32)
        return x if keep_f32 else x.astype(self.dtype, copy=False)

    def vec(self, n: int, std: float | None = None) -> np.ndarray:
        s = self.std if std is None else std
        return (self.rng.standard_normal(n) * s).astype(np.float32)


def _ones(n: int) -> np.ndarray:
    return np.ones(n, dtype=np.float32)


def _add_attention_hparams(w: GGUFWriter, arch: str, *, g: _Geometry, n_layer: int, n_ff: int,
                           rope_sections: list[int] | None) -> None:
    n_embd = g.n_embd
    w.add_string("general.architecture", arch)
    w.add_uint32(f"{arch}.context_length", TINY_CONTEXT_LENGTH)
    w.add_uint32(f"{arch}.embedding_length", n_embd)
    w.add_uint32(f"{arch}.block_count", n_layer)
    w.add_uint32(f"{arch}.feed_forward_length", n_ff)
    w.add_uint32(f"{arch}.attention.head_count", g.n_head)
    w.add_uint32(f"{arch}.attention.head_count_kv", g.n_head_kv)
    w.add_uint32(f"{arch}.attention.key_length", g.head_dim)
    w.add_uint32(f"{arch}.attention.value_length", g.head_dim)
    w.add_uint32(f"{arch}.rope.dimension_count", g.head_dim)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    if rope_sections is not None:  # None: a plain 1-D rope
        w.add_array(f"{arch}.rope.dimension_sections", ValueType.INT32, rope_sections)


def _add_attention_layer(w: GGUFWriter, r: _Weights, i: int, g: _Geometry, *, q_out: int) -> None:
    p, n_embd = f"blk.{i}", g.n_embd
    w.add_tensor(f"{p}.attn_q.weight", r.mat(q_out, n_embd))
    w.add_tensor(f"{p}.attn_k.weight", r.mat(g.n_head_kv * g.head_dim, n_embd))
    w.add_tensor(f"{p}.attn_v.weight", r.mat(g.n_head_kv * g.head_dim, n_embd))
    w.add_tensor(f"{p}.attn_output.weight", r.mat(n_embd, g.n_head * g.head_dim))
    w.add_tensor(f"{p}.attn_q_norm.weight", _ones(g.head_dim))
    w.add_tensor(f"{p}.attn_k_norm.weight", _ones(g.head_dim))


def _add_ffn(w: GGUFWriter, r: _Weights, i: int, n_embd: int, n_ff: int) -> None:
    w.add_tensor(f"blk.{i}.ffn_gate.weight", r.mat(n_ff, n_embd))
    w.add_tensor(f"blk.{i}.ffn_up.weight", r.mat(n_ff, n_embd))
    w.add_tensor(f"blk.{i}.ffn_down.weight", r.mat(n_embd, n_ff))


# -- target ------------------------------------------------------------------------


def _embedding_and_head(r: _Weights, g: _Geometry, predictable: float, fim_seed: int | None = None
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Token embedding and output head, with the `predictable` structure (module docstring).

    Drawn in float64 at every width (N_VOCAB rows only), stored as ``r.dtype``. With ``fim_seed``,
    the FIM tokens' rows follow, drawn from a generator of their own seeded so (the other rows stay
    the same), with zero output rows like every control token's."""
    n_embd = g.n_embd
    embd = r.rng.standard_normal((N_VOCAB, n_embd))
    head = r.rng.standard_normal((N_VOCAB, n_embd)) * g.output_std
    shared = r.rng.standard_normal(n_embd)
    shared /= np.linalg.norm(shared)
    member = r.rng.random(N_VOCAB) < predictable  # drawn even at 0: same base weights for any knob
    if predictable > 0:
        embd -= np.outer(embd @ shared, shared)
        head -= np.outer(head @ shared, shared)
        head[ATTRACTOR_TOKEN_ID] = _ATTRACTOR_GAIN * shared
        head[FIRST_SPECIAL_ID:] = 0.0
        if predictable < 1:
            # make the attractor's successor lead back to the attractor (bigram estimate;
            # the layers only add small terms)
            tail = embd[ATTRACTOR_TOKEN_ID] - _SHARED_COEF * shared
            member[int(np.argmax(head @ _rms_norm(tail)))] = True
        coef = np.where(member, _SHARED_COEF, 0.0)
        coef[ATTRACTOR_TOKEN_ID] = _SHARED_COEF if predictable >= 1 else -_SHARED_COEF
        coef[MASK_TOKEN_ID] = 2 * _SHARED_COEF
        embd += np.outer(coef, shared)
    head[FIRST_SPECIAL_ID:] = 0.0  # never choose control tokens (e.g. EOS)
    if fim_seed is not None:
        extra = np.random.default_rng(fim_seed).standard_normal((len(FIM_TOKENS), n_embd))
        embd = np.concatenate([embd, extra])
        head = np.concatenate([head, np.zeros_like(extra)])
    return embd.astype(np.float32).astype(r.dtype), head.astype(np.float32).astype(r.dtype)


def write_target(path: str | Path, *, arch: str = "hunyuan_vl", seed: int = 0, n_embd: int = 64,
                 n_layer: int = 4, n_ff: int = 128, predictable: float = 0.0,
                 n_deepstack: int | None = None, dtype: str = "f32", chat_template: str = CHAT_TEMPLATE,
                 fim: bool = False, mtp: bool = False) -> Path:
    """Write a tiny M-RoPE target (one of ``TARGET_ARCHS``) that can feed a DFlash draft.

    ``chat_template`` is the ``tokenizer.chat_template`` it carries (a minimal ChatML by default).
    ``fim=True`` adds the fill-in-the-middle tokens (``FIM_TOKENS``, ids ``FIM_TOKEN_ID``) after
    the others, with llama.cpp's ``tokenizer.ggml.fim_*_token_id`` keys (llama-server's /infill).

    Heads: at ``n_embd`` 64, 4 query heads, 2 KV heads, head dim 16 (M-RoPE sections
    [2, 3, 3, 0]); at a wider ``n_embd`` (a multiple of 128), heads of 64, ``n_embd // 64``
    query heads and half as many KV heads (sections [8, 12, 12, 0]); a ``qwen35`` delta net
    then has ``n_head_kv`` key heads and ``n_head`` value heads of ``head_dim``.  Layer and
    output-head weights are scaled by sqrt(64 / n_embd), so ``predictable`` behaves alike
    at any width.  ``dtype`` ("f32" or "f16") is the storage type of the matrices (token
    embedding, output head, projections); norms, biases and convolutions stay f32.  Wide
    models draw their layer weights in float32 (fast); the n_embd 64 ones keep the
    original float64 stream.  ``predictable`` in [0, 1]: see module docstring.
    ``n_deepstack`` (``qwen3vl`` only; default ``len(QWEN3VL_DEEPSTACK_LAYERS)``, at most
    ``n_layer``): the ``qwen3vl.n_deepstack_layers`` key; the matching mmproj is
    ``write_mmproj(projector="qwen3vl_merger", deepstack_layers=...)`` with as many layers.
    ``mtp=True`` (``MTP_ARCHS``): one multi-token-prediction (nextn) block after the last layer,
    as Qwen3.5 GGUFs carry it (``_add_mtp_block``); ``block_count`` counts it, as llama.cpp's loader
    expects (``nextn_predict_layers`` 1).
    """
    if mtp and arch not in MTP_ARCHS:
        raise ValueError(f"mtp=True needs one of {MTP_ARCHS}, got {arch!r}")
    if arch not in TARGET_ARCHS:
        raise ValueError(f"arch must be one of {TARGET_ARCHS}, got {arch!r}")
    if arch != "qwen3vl" and n_deepstack:
        raise ValueError("n_deepstack is a qwen3vl setting")
    if arch == "qwen3vl":
        n_deepstack = len(QWEN3VL_DEEPSTACK_LAYERS) if n_deepstack is None else n_deepstack
        if not 0 <= n_deepstack <= n_layer:
            raise ValueError(f"n_deepstack must be in [0, n_layer={n_layer}]")
    g = _geometry(n_embd)
    np_dtype = _np_dtype(dtype)
    if not 0.0 <= predictable <= 1.0:
        raise ValueError("predictable must be in [0, 1]")
    hybrid = arch in ("qwen35", "qwen35moe")  # gated delta net layers between attention layers
    if hybrid and n_layer % 2:
        raise ValueError(f"{arch} needs an even n_layer (full_attention_interval 2)")
    r = _Weights(seed, g.layer_std, fast=not g.tiny, dtype=np_dtype)
    w = GGUFWriter()
    # [2, 3, 3, 0] sums to head_dim / 2; first two > 0 make it M-RoPE (Qwen2-VL's [16, 24, 24, 0]
    # scaled to head_dim 16; the interleaved M-RoPE of qwen35 / qwen3vl takes the same sections)
    _add_attention_hparams(w, arch, g=g, n_layer=n_layer + int(mtp), n_ff=n_ff, rope_sections=g.rope_sections)
    w.add_string("general.name", f"tiny-{arch}")
    if mtp:
        w.add_uint32(f"{arch}.nextn_predict_layers", 1)
    if arch == "qwen3vl":
        w.add_uint32("qwen3vl.n_deepstack_layers", n_deepstack)
    if hybrid:
        # gated delta net: n_head_kv key heads, n_head value heads, of head_dim (2 x 16, 4 x 16 at 64)
        w.add_uint32(f"{arch}.ssm.conv_kernel", 4)
        w.add_uint32(f"{arch}.ssm.state_size", g.head_dim)
        w.add_uint32(f"{arch}.ssm.group_count", g.n_head_kv)
        w.add_uint32(f"{arch}.ssm.time_step_rank", g.n_head)
        w.add_uint32(f"{arch}.ssm.inner_size", g.n_head * g.head_dim)
        w.add_uint32(f"{arch}.full_attention_interval", 2)
    if arch == "qwen35moe":
        w.add_uint32("qwen35moe.expert_count", MOE_N_EXPERT)
        w.add_uint32("qwen35moe.expert_used_count", MOE_N_EXPERT_USED)
        w.add_uint32("qwen35moe.expert_feed_forward_length", n_ff)
        w.add_uint32("qwen35moe.expert_shared_feed_forward_length", n_ff)
    _add_tokenizer(w, chat_template=chat_template, fim=fim)

    embd, head = _embedding_and_head(r, g, predictable, fim_seed=seed + 3_000_017 if fim else None)
    w.add_tensor("token_embd.weight", embd)
    w.add_tensor("output_norm.weight", _ones(n_embd))
    w.add_tensor("output.weight", head)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", _ones(n_embd))
        if arch in ("hunyuan_vl", "qwen3vl"):  # q/k norms
            _add_attention_layer(w, r, i, g, q_out=g.n_head * g.head_dim)
            w.add_tensor(f"blk.{i}.ffn_norm.weight", _ones(n_embd))
        elif arch == "qwen2vl":  # q/k/v biases, no q/k norms
            _add_biased_attention_layer(w, r, i, g)
            w.add_tensor(f"blk.{i}.ffn_norm.weight", _ones(n_embd))
        else:
            w.add_tensor(f"blk.{i}.post_attention_norm.weight", _ones(n_embd))
            if (i + 1) % 2 == 0:  # attention layer: query and gate in one projection
                _add_attention_layer(w, r, i, g, q_out=2 * g.n_head * g.head_dim)
            else:
                _add_delta_net_layer(w, r, i, g)
        (_add_moe_ffn if arch == "qwen35moe" else _add_ffn)(w, r, i, n_embd, n_ff)
    if mtp:
        _add_mtp_block(w, n_layer, g, n_ff, seed=seed, dtype=np_dtype, moe=arch == "qwen35moe")
    path = Path(path)
    w.write(path)
    return path


def _add_moe_ffn(w: GGUFWriter, r: _Weights, i: int, n_embd: int, n_ff: int) -> None:
    """A qwen35moe feed-forward: ``MOE_N_EXPERT`` experts of width n_ff behind a router, and a
    gated shared expert of width n_ff (src/models/qwen35moe.cpp)."""
    p, n_exp = f"blk.{i}", MOE_N_EXPERT
    w.add_tensor(f"{p}.ffn_gate_inp.weight", r.mat(n_exp, n_embd, keep_f32=True))
    # ggml dims [n_embd, n_ff, n_expert] / [n_ff, n_embd, n_expert]: numpy shapes reversed
    w.add_tensor(f"{p}.ffn_gate_exps.weight", np.stack([r.mat(n_ff, n_embd) for _ in range(n_exp)]))
    w.add_tensor(f"{p}.ffn_up_exps.weight", np.stack([r.mat(n_ff, n_embd) for _ in range(n_exp)]))
    w.add_tensor(f"{p}.ffn_down_exps.weight", np.stack([r.mat(n_embd, n_ff) for _ in range(n_exp)]))
    w.add_tensor(f"{p}.ffn_gate_inp_shexp.weight", r.vec(n_embd))
    w.add_tensor(f"{p}.ffn_gate_shexp.weight", r.mat(n_ff, n_embd))
    w.add_tensor(f"{p}.ffn_up_shexp.weight", r.mat(n_ff, n_embd))
    w.add_tensor(f"{p}.ffn_down_shexp.weight", r.mat(n_embd, n_ff))


def _add_mtp_block(w: GGUFWriter, i: int, g: _Geometry, n_ff: int, *, seed: int, dtype, moe: bool = False) -> None:
    """The nextn block ``blk.{i}`` of a qwen35 target (src/models/qwen35.cpp, ``graph_mtp``; with
    ``moe``, of a qwen35moe one, whose block has the same experts as its layers): a
    full-attention qwen35 layer (query and gate in one projection) behind ``eh_proj``, which maps
    ``[enorm(token embedding), hnorm(target hidden)]`` to the block's input; it reads out with the
    target's own output norm and head.

    ``eh_proj`` passes the token embedding through (identity plus small noise) and adds the hidden
    state through a random matrix: the head then proposes about what the target's bigram does
    (the tiny targets' choice is dominated by the current token, module docstring), so with
    ``predictable`` > 0 drafts are often accepted, and which hidden row a token is paired with
    changes the drafts (a wrong pairing shows). Drawn from a generator of its own, so the other
    tensors are the same as without the block."""
    r = _Weights(seed + 7_000_003, g.layer_std, fast=not g.tiny, dtype=dtype)
    n_embd, p = g.n_embd, f"blk.{i}"
    w.add_tensor(f"{p}.attn_norm.weight", _ones(n_embd))
    w.add_tensor(f"{p}.post_attention_norm.weight", _ones(n_embd))
    _add_attention_layer(w, r, i, g, q_out=2 * g.n_head * g.head_dim)
    (_add_moe_ffn if moe else _add_ffn)(w, r, i, n_embd, n_ff)
    e_part = np.eye(n_embd, dtype=np.float32) + r.mat(n_embd, n_embd, keep_f32=True)
    h_part = r.mat(n_embd, n_embd, std=MTP_HIDDEN_STD / np.sqrt(n_embd), keep_f32=True)
    # ggml dims [2 n_embd, n_embd]: numpy (n_embd, 2 n_embd), the embedding half first (ggml_concat order)
    w.add_tensor(f"{p}.nextn.eh_proj.weight", np.concatenate([e_part, h_part], axis=1).astype(dtype))
    w.add_tensor(f"{p}.nextn.enorm.weight", _ones(n_embd))
    w.add_tensor(f"{p}.nextn.hnorm.weight", _ones(n_embd))


def _add_biased_attention_layer(w: GGUFWriter, r: _Weights, i: int, g: _Geometry) -> None:
    p, n_embd = f"blk.{i}", g.n_embd
    for name, n_out in (("attn_q", g.n_head * g.head_dim), ("attn_k", g.n_head_kv * g.head_dim),
                        ("attn_v", g.n_head_kv * g.head_dim)):
        w.add_tensor(f"{p}.{name}.weight", r.mat(n_out, n_embd))
        w.add_tensor(f"{p}.{name}.bias", r.vec(n_out))
    w.add_tensor(f"{p}.attn_output.weight", r.mat(n_embd, g.n_head * g.head_dim))


def _add_delta_net_layer(w: GGUFWriter, r: _Weights, i: int, g: _Geometry) -> None:
    # n_head_kv key heads and n_head value heads of head_dim (2 x 16 and 4 x 16 at n_embd 64)
    key_dim, value_dim, n_v_heads, conv = g.n_head_kv * g.head_dim, g.n_head * g.head_dim, g.n_head, 4
    p, n_embd = f"blk.{i}", g.n_embd
    w.add_tensor(f"{p}.attn_qkv.weight", r.mat(2 * key_dim + value_dim, n_embd))
    w.add_tensor(f"{p}.attn_gate.weight", r.mat(value_dim, n_embd))
    w.add_tensor(f"{p}.ssm_conv1d.weight", r.mat(2 * key_dim + value_dim, conv, std=0.5, keep_f32=True))
    w.add_tensor(f"{p}.ssm_dt.bias", r.vec(n_v_heads, std=0.5))
    # ssm_a = -exp(A_log): must be negative for a decaying state
    w.add_tensor(f"{p}.ssm_a", -np.exp(r.vec(n_v_heads, std=0.5)))
    w.add_tensor(f"{p}.ssm_beta.weight", r.mat(n_v_heads, n_embd))
    w.add_tensor(f"{p}.ssm_alpha.weight", r.mat(n_v_heads, n_embd))
    w.add_tensor(f"{p}.ssm_norm.weight", _ones(g.head_dim))
    w.add_tensor(f"{p}.ssm_out.weight", r.mat(n_embd, value_dim))


# -- mmproj ----------------------------------------------------------------------


def _clip_writer(name: str, projector_type: str, *, n_embd: int, n_ff: int, n_block: int, target_n_embd: int,
                 image_size: int, patch: int, use_gelu: bool = False) -> GGUFWriter:
    """A GGUF writer holding a Qwen-VL vision tower's metadata (the keys in the converter's order)."""
    w = GGUFWriter()
    w.add_string("general.architecture", "clip")
    w.add_string("general.name", name)
    w.add_string("clip.projector_type", projector_type)
    w.add_bool("clip.has_vision_encoder", True)
    if use_gelu:
        w.add_bool("clip.use_gelu", True)
    for key, value in (("embedding_length", n_embd), ("feed_forward_length", n_ff), ("block_count", n_block),
                       ("attention.head_count", 2)):
        w.add_uint32(f"clip.vision.{key}", value)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    for key, value in (("projection_dim", target_n_embd), ("image_size", image_size), ("patch_size", patch),
                       ("spatial_merge_size", 2)):
        w.add_uint32(f"clip.vision.{key}", value)
    w.add_array("clip.vision.image_mean", ValueType.FLOAT32, [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", ValueType.FLOAT32, [0.5, 0.5, 0.5])
    return w


def _add_vision_norms(w: GGUFWriter, b: str, n_embd: int) -> None:
    """A vision block's two layer norms (ones and zeros: nothing drawn)."""
    for ln in ("ln1", "ln2"):
        w.add_tensor(f"{b}.{ln}.weight", _ones(n_embd))
        w.add_tensor(f"{b}.{ln}.bias", np.zeros(n_embd, np.float32))


def _add_vision_ffn(w: GGUFWriter, r: "_Weights", b: str, n_embd: int, n_ff: int) -> None:
    """A vision block's feed-forward, drawn in this order. up: ggml [n_embd, n_ff], down: ggml
    [n_ff, n_embd] (this orientation is not "swapped")."""
    w.add_tensor(f"{b}.ffn_up.weight", r.mat(n_ff, n_embd))
    w.add_tensor(f"{b}.ffn_up.bias", r.vec(n_ff))
    w.add_tensor(f"{b}.ffn_down.weight", r.mat(n_embd, n_ff))
    w.add_tensor(f"{b}.ffn_down.bias", r.vec(n_embd))


def _add_patch_embeddings(w: GGUFWriter, r: "_Weights", n_embd: int, patch: int) -> None:
    """Qwen-VL's temporal patch conv, split in two frames: two ggml [patch, patch, 3, n_embd] tensors."""
    for name in ("v.patch_embd.weight", "v.patch_embd.weight.1"):
        w.add_tensor(name, (r.rng.standard_normal((n_embd, 3, patch, patch)) * 0.02).astype(np.float32))


def write_mmproj(path: str | Path, *, target_n_embd: int = 64, seed: int = 0,
                 projector: str = "qwen2vl_merger", deepstack_layers: tuple[int, ...] = (),
                 dtype: str = "f32", patch: int = 14, n_block: int = 1) -> Path:
    """Write a tiny ``clip`` vision projector for a target of width ``target_n_embd``.

    ``projector``: ``qwen2vl_merger`` (one vision block, separate q/k/v) or
    ``qwen3vl_merger`` (Qwen3-VL: fused qkv, patch bias, learned position embeddings,
    gelu, a post norm, and deepstack mergers on the vision blocks in
    ``deepstack_layers``; it has max(deepstack_layers) + 1 vision blocks, at least one).
    A ``qwen3vl_merger`` output row is ``target_n_embd * (1 + len(deepstack_layers))``
    wide: it fits a ``qwen3vl`` target written with ``n_deepstack=len(deepstack_layers)``.
    The vision tower is 32 wide at any ``target_n_embd`` (which may be any positive width);
    ``dtype`` ("f32" or "f16") is the storage type of its matrices (the patch and position
    embeddings, norms and biases stay f32). ``patch`` (``qwen2vl_merger`` only): the patch size,
    which sets the grid a picture is cut into (14: a 672x672 image is 576 rows over 24 positions;
    16: 441 rows over 21; 12: 784 rows over 28). ``n_block`` (``qwen2vl_merger`` only): its vision
    blocks (1; more make an encode of many small graph nodes, as a real encoder's dozens of layers do,
    where one block's attention is a few large ones).
    """
    np_dtype = _np_dtype(dtype)
    if (patch != 14 or n_block != 1) and projector != "qwen2vl_merger":
        raise ValueError("patch and n_block are qwen2vl_merger settings")
    if n_block < 1:
        raise ValueError(f"n_block must be at least 1, got {n_block}")
    if patch < 2 or patch % 2:
        raise ValueError(f"patch must be an even size >= 2, got {patch}")
    if target_n_embd <= 0:
        raise ValueError(f"target_n_embd must be positive, got {target_n_embd}")
    if projector not in PROJECTORS:
        raise ValueError(f"projector must be one of {PROJECTORS}, got {projector!r}")
    if projector == "qwen3vl_merger":
        return _write_qwen3vl_mmproj(Path(path), target_n_embd=target_n_embd, seed=seed,
                                     deepstack_layers=tuple(deepstack_layers), np_dtype=np_dtype)
    if deepstack_layers:
        raise ValueError("deepstack_layers needs projector='qwen3vl_merger'")
    n_embd, n_ff, merged = 32, 64, 32 * 4
    r = _Weights(seed + 1_000_003, std=0.05, fast=target_n_embd != TINY_N_EMBD, dtype=np_dtype)
    w = _clip_writer("tiny-mmproj", "qwen2vl_merger", n_embd=n_embd, n_ff=n_ff, n_block=n_block,
                     target_n_embd=target_n_embd, image_size=448, patch=patch)
    # two patch embeddings: qwen2-vl's temporal conv split in two frames; ggml [14, 14, 3, 32]
    _add_patch_embeddings(w, r, n_embd, patch)
    for i in range(n_block):
        b = f"v.blk.{i}"
        _add_vision_norms(w, b, n_embd)
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(f"{b}.{name}.weight", r.mat(n_embd, n_embd))
            w.add_tensor(f"{b}.{name}.bias", r.vec(n_embd))
        _add_vision_ffn(w, r, b, n_embd, n_ff)
    w.add_tensor("mm.0.weight", r.mat(merged, merged))
    w.add_tensor("mm.0.bias", r.vec(merged))
    w.add_tensor("mm.2.weight", r.mat(target_n_embd, merged, std=0.5))
    w.add_tensor("mm.2.bias", r.vec(target_n_embd))
    path = Path(path)
    w.write(path)
    return path


def _write_qwen3vl_mmproj(path: Path, *, target_n_embd: int, seed: int,
                          deepstack_layers: tuple[int, ...], np_dtype=np.float32) -> Path:
    n_embd, n_ff, patch, merged, image_size = 32, 64, 14, 32 * 4, 448
    if any(d < 0 for d in deepstack_layers) or len(set(deepstack_layers)) != len(deepstack_layers):
        raise ValueError(f"deepstack_layers must be distinct vision block indices >= 0, got {deepstack_layers}")
    n_block = max(deepstack_layers, default=0) + 1
    r = _Weights(seed + 3_000_017, std=0.05, fast=target_n_embd != TINY_N_EMBD, dtype=np_dtype)
    w = _clip_writer("tiny-mmproj-qwen3vl", "qwen3vl_merger", n_embd=n_embd, n_ff=n_ff, n_block=n_block,
                     target_n_embd=target_n_embd, image_size=image_size, patch=patch, use_gelu=True)
    # as the converter writes it; libmtmd finds the deepstack layers by their tensors
    w.add_array("clip.vision.is_deepstack_layers", ValueType.BOOL, [i in deepstack_layers for i in range(n_block)])

    # the temporal conv split in two frames, ggml [14, 14, 3, 32], plus its bias (required here)
    _add_patch_embeddings(w, r, n_embd, patch)
    w.add_tensor("v.patch_embd.bias", r.vec(n_embd))
    # learned absolute positions for a (448 / 14)^2 grid, interpolated to other sizes: ggml [32, 1024]
    w.add_tensor("v.position_embd.weight", r.mat((image_size // patch) ** 2, n_embd, std=0.02, keep_f32=True))
    for il in range(n_block):
        b = f"v.blk.{il}"
        _add_vision_norms(w, b, n_embd)
        w.add_tensor(f"{b}.attn_qkv.weight", r.mat(3 * n_embd, n_embd))
        w.add_tensor(f"{b}.attn_qkv.bias", r.vec(3 * n_embd))
        w.add_tensor(f"{b}.attn_out.weight", r.mat(n_embd, n_embd))
        w.add_tensor(f"{b}.attn_out.bias", r.vec(n_embd))
        _add_vision_ffn(w, r, b, n_embd, n_ff)
        if il in deepstack_layers:
            # a merger of its own over the 2x2-merged block output: norm [128], fc1 [128, 128], fc2 [128, n]
            d = f"v.deepstack.{il}"
            w.add_tensor(f"{d}.norm.weight", _ones(merged))
            w.add_tensor(f"{d}.norm.bias", np.zeros(merged, np.float32))
            w.add_tensor(f"{d}.fc1.weight", r.mat(merged, merged))
            w.add_tensor(f"{d}.fc1.bias", r.vec(merged))
            w.add_tensor(f"{d}.fc2.weight", r.mat(target_n_embd, merged, std=0.5))
            w.add_tensor(f"{d}.fc2.bias", r.vec(target_n_embd))
    w.add_tensor("v.post_ln.weight", _ones(n_embd))
    w.add_tensor("v.post_ln.bias", np.zeros(n_embd, np.float32))
    w.add_tensor("mm.0.weight", r.mat(merged, merged))
    w.add_tensor("mm.0.bias", r.vec(merged))
    w.add_tensor("mm.2.weight", r.mat(target_n_embd, merged, std=0.5))
    w.add_tensor("mm.2.bias", r.vec(target_n_embd))
    w.write(path)
    return path


# -- draft -------------------------------------------------------------------------


# DFlash2 defaults for the tiny drafts: 4 candidates per position (a lattice row of
# 4 + 4 x 4 = 20 <= 64 floats), a rank-8 selector, kernel-4 convolutions in groups of 16
DFLASH2_SELECTOR_TOP_K, DFLASH2_SELECTOR_RANK, DFLASH2_CONV_KERNEL_SIZE, DFLASH2_CONV_GROUP_SIZE = 4, 8, 4, 16


def write_draft(path: str | Path, *, target_n_embd: int = 64, target_layers: tuple[int, ...] = (1, 3),
                target_n_layer: int = 4, block_size: int = 16, sliding_window: int | None = 32,
                n_layer: int = 1, n_ff: int = 128, seed: int = 0, dtype: str = "f32",
                dflash2: bool = False, selector_top_k: int = DFLASH2_SELECTOR_TOP_K,
                selector_rank: int = DFLASH2_SELECTOR_RANK, conv_kernel_size: int = DFLASH2_CONV_KERNEL_SIZE,
                conv_group_size: int = DFLASH2_CONV_GROUP_SIZE, fim: bool = False, dspark: bool = False,
                markov_rank: int = 8, confidence_head: bool = True) -> Path:
    """Write a tiny ``dflash`` draft for a target of width ``target_n_embd`` (``fim``: for a target
    written with ``fim=True``, whose vocabulary it shares).

    Head geometry as in ``write_target`` (64 or a multiple of 128), but temporal-only
    rope sections [head_dim / 2, 0, 0, 0]; ``dtype`` as in ``write_target``.
    ``target_layers`` are the GGUF values (HF ``target_layer_ids`` + 1): indices of
    target layer inputs, each < ``target_n_layer`` (larger ones abort natively).
    ``sliding_window`` None or 0 writes a draft without a window.  The draft has no
    token embedding or output head: it uses the target's via ``ctx_other``.

    ``dflash2=True`` writes a DFlash2 draft (upstream ``DFlash2DraftModel``): the same
    weights (same stream, so the same base draft) plus the keys ``dflash.conv_kernel_size``,
    ``dflash.conv_group_size``, ``dflash.selector_rank``, ``dflash.selector_top_k`` and the
    tensors ``selector_predecessor`` / ``selector_successor`` [rank, n_vocab],
    ``selector_hidden`` [n_embd, rank] and, per layer, ``blk.N.{attn,ffn}_conv_base``
    [n_embd, kernel, 2] and ``blk.N.{attn,ffn}_conv_proj.weight``
    [n_embd, 2 * kernel * (n_embd / group)] (ggml order), drawn from a second generator.
    The convolutions start near the identity (tap 0 of each base is 1), so a DFlash2
    draft still proposes what the plain draft would, up to the small selector term.
    llama.cpp needs ``n_embd`` divisible by ``conv_group_size`` and
    ``n_embd >= selector_top_k * (selector_top_k + 1)`` (the lattice row).

    ``dspark=True`` writes a DSpark draft (DFlash with a Markov head, llama.cpp's
    ``draft-dspark``): the same weights plus ``markov_w1`` / ``markov_w2`` [rank, n_vocab] (each
    drafted position's logits get ``markov_w2 . markov_w1[previous token]``, the chain run in the
    graph) and, with ``confidence_head``, ``conf_proj`` [n_embd + rank, 1] and its bias (a
    per-position acceptance estimate, read under ``p_min``); its block is anchor-first
    (``dflash.sample_from_anchor`` absent: true).
    """
    g = _geometry(target_n_embd, "target_n_embd")
    np_dtype = _np_dtype(dtype)
    if not target_layers or any(not 0 <= t < target_n_layer for t in target_layers):
        raise ValueError(f"target_layers must be non-empty and in [0, {target_n_layer})")
    if dflash2:
        _check_dflash2(target_n_embd, block_size=block_size, selector_top_k=selector_top_k,
                       selector_rank=selector_rank, conv_kernel_size=conv_kernel_size,
                       conv_group_size=conv_group_size)
    n_embd = target_n_embd
    r = _Weights(seed + 2_000_003, g.layer_std, fast=not g.tiny, dtype=np_dtype)
    w = GGUFWriter()
    # temporal-only sections [head_dim / 2, 0, 0, 0]: the draft follows the target's text positions
    _add_attention_hparams(w, "dflash", g=g, n_layer=n_layer, n_ff=n_ff,
                           rope_sections=[g.head_dim // 2, 0, 0, 0])
    w.add_string("general.name", "tiny-dflash")
    w.add_array("dflash.target_layers", ValueType.INT32, list(target_layers))
    w.add_uint32("dflash.block_size", block_size)
    if sliding_window:
        w.add_uint32("dflash.attention.sliding_window", sliding_window)
        w.add_array("dflash.attention.sliding_window_pattern", ValueType.BOOL, [True] * n_layer)
    _add_tokenizer(w, with_mask_id=True, fim=fim)

    w.add_tensor("fc.weight", r.mat(n_embd, len(target_layers) * n_embd))
    w.add_tensor("enc.output_norm.weight", _ones(n_embd))
    w.add_tensor("output_norm.weight", _ones(n_embd))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", _ones(n_embd))
        _add_attention_layer(w, r, i, g, q_out=g.n_head * g.head_dim)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", _ones(n_embd))
        _add_ffn(w, r, i, n_embd, n_ff)
    if dflash2:
        _add_dflash2(w, seed=seed, g=g, n_layer=n_layer, selector_top_k=selector_top_k,
                     selector_rank=selector_rank, conv_kernel_size=conv_kernel_size,
                     conv_group_size=conv_group_size, np_dtype=np_dtype)
    if dspark:
        m = _Weights(seed + 6_000_011, g.layer_std, fast=not g.tiny)
        # ggml [rank, n_vocab]: a row per token (numpy [n_vocab, rank])
        w.add_tensor("markov_w1.weight", m.mat(N_VOCAB, markov_rank, std=0.5, keep_f32=True))
        w.add_tensor("markov_w2.weight", m.mat(N_VOCAB, markov_rank, std=0.5, keep_f32=True))
        if confidence_head:
            w.add_tensor("conf_proj.weight", m.mat(1, n_embd + markov_rank, std=0.1, keep_f32=True))
            w.add_tensor("conf_proj.bias", np.array([1.0], dtype=np.float32))
    path = Path(path)
    w.write(path)
    return path


def _check_dflash2(n_embd: int, *, block_size: int, selector_top_k: int, selector_rank: int,
                   conv_kernel_size: int, conv_group_size: int) -> None:
    """Refuse what llama.cpp's DFlash2 loader refuses (src/models/dflash.cpp, load_arch_tensors)."""
    for name, v in (("selector_top_k", selector_top_k), ("selector_rank", selector_rank),
                    ("conv_kernel_size", conv_kernel_size), ("conv_group_size", conv_group_size),
                    ("block_size", block_size)):
        if int(v) <= 0:
            raise ValueError(f"DFlash2 needs {name} > 0, got {v}")
    if n_embd % conv_group_size:
        raise ValueError(f"DFlash2 needs n_embd ({n_embd}) divisible by conv_group_size ({conv_group_size})")
    if n_embd < selector_top_k * (selector_top_k + 1):
        raise ValueError(f"DFlash2 needs n_embd ({n_embd}) >= selector_top_k * (selector_top_k + 1) "
                         f"= {selector_top_k * (selector_top_k + 1)} (one lattice row per embedding row)")


def _add_dflash2(w: GGUFWriter, *, seed: int, g: _Geometry, n_layer: int, selector_top_k: int,
                 selector_rank: int, conv_kernel_size: int, conv_group_size: int, np_dtype) -> None:
    """The DFlash2 keys and tensors (see ``write_draft``), from their own generator."""
    n_embd, kernel, rank = g.n_embd, conv_kernel_size, selector_rank
    w.add_uint32("dflash.conv_kernel_size", kernel)
    w.add_uint32("dflash.conv_group_size", conv_group_size)
    w.add_uint32("dflash.selector_rank", rank)
    w.add_uint32("dflash.selector_top_k", selector_top_k)
    r = _Weights(seed + 4_000_037, g.layer_std, fast=not g.tiny, dtype=np_dtype)
    projected = 2 * kernel * (n_embd // conv_group_size)
    for i in range(n_layer):
        for side in ("attn", "ffn"):
            # base taps [2 sides, kernel, n_embd] (ggml [n_embd, kernel, 2]): tap 0 = 1 (identity), others small
            base = r.rng.standard_normal((2, kernel, n_embd)).astype(np.float32) * np.float32(0.02)
            base[:, 0, :] += 1.0
            w.add_tensor(f"blk.{i}.{side}_conv_base", base)
            # dynamic taps: ggml [n_embd, 2 * kernel * groups]
            w.add_tensor(f"blk.{i}.{side}_conv_proj.weight", r.mat(projected, n_embd))
    # codebooks: ggml [rank, n_vocab]; gate: ggml [n_embd, rank]
    w.add_tensor("selector_predecessor.weight", r.mat(N_VOCAB, rank, std=0.3))
    w.add_tensor("selector_successor.weight", r.mat(N_VOCAB, rank, std=0.3))
    w.add_tensor("selector_hidden.weight", r.mat(rank, n_embd, std=0.1))


EAGLE3_TARGET_LAYERS = (1, 2, 3)  # a tiny 4-layer target's layers whose inputs feed an EAGLE3 draft


def write_eagle3_draft(path: str | Path, target: str | Path, *, target_layers: tuple[int, ...] = EAGLE3_TARGET_LAYERS,
                       d2t: int | None = None, n_ff: int = 128, seed: int = 0, passthrough: float = 1.0) -> Path:
    """Write a tiny ``eagle3`` draft for the tiny ``target`` file (its width, layers and vocabulary).

    As src/models/eagle3.cpp loads it: keys ``eagle3.target_layers`` (three target layers whose
    *inputs* the encoder reads, each < the target's layer count) and ``eagle3.target_hidden_size``;
    ``fc`` [3 x target n_embd -> n_embd], one decoder layer whose attention reads
    [token embedding, g] (``attn_norm`` / ``attn_norm_2``, Q/K/V 2 x n_embd wide), no token
    embedding of its own (it borrows the target's through ``ctx_other``).

    ``d2t`` None: no reduced vocabulary, the draft borrows the target's output head too.
    ``d2t`` = n: a reduced vocabulary of n draft tokens: tensor ``d2t`` (I64, the absolute target
    id of each draft token, as convert_hf_to_gguf writes it) and an output head of n rows, copied
    from the target's rows for those ids. The ids are drawn from the seed among the plain tokens,
    always with ``ATTRACTOR_TOKEN_ID``.

    ``passthrough``: ``fc`` passes the last named layer's input through at this gain (plus small
    noise), so the draft's first guess follows the target's residual stream: with a
    ``predictable=1`` target (which repeats the attractor) every draft is accepted; with random
    targets few are.
    """
    from pyllama_spec.gguf.reader import read_gguf, read_tensor

    info = read_gguf(target, "target model")
    arch = info.arch
    n_tgt, n_layer_tgt = int(info.metadata[f"{arch}.embedding_length"]), int(info.metadata[f"{arch}.block_count"])
    n_vocab = len(info.metadata["tokenizer.ggml.tokens"])
    if len(target_layers) != 3 or any(not 0 <= t < n_layer_tgt for t in target_layers):
        raise ValueError(f"target_layers must be three layers in [0, {n_layer_tgt})")
    g = _geometry(n_tgt, "the target's n_embd")
    n_embd = n_tgt
    r = _Weights(seed + 5_000_011, g.layer_std, fast=not g.tiny)
    w = GGUFWriter()
    _add_attention_hparams(w, "eagle3", g=g, n_layer=1, n_ff=n_ff, rope_sections=None)  # 1-D rope (LLAMA_ROPE_TYPE_NORM)
    w.add_string("general.name", "tiny-eagle3")
    w.add_array("eagle3.target_layers", ValueType.INT32, list(target_layers))
    w.add_uint32("eagle3.target_hidden_size", n_tgt)
    _add_tokenizer(w, fim=n_vocab > N_VOCAB)

    fc = r.mat(n_embd, 3 * n_tgt)
    fc[:, 2 * n_tgt:] += np.float32(passthrough) * np.eye(n_embd, n_tgt, dtype=np.float32)
    w.add_tensor("fc.weight", fc)
    w.add_tensor("output_norm.weight", _ones(n_embd))
    if d2t is not None:
        plain = np.array([t for t in range(FIRST_SPECIAL_ID) if t != ATTRACTOR_TOKEN_ID])
        if not 1 <= d2t <= len(plain) + 1:
            raise ValueError(f"d2t must be in [1, {len(plain) + 1}] draft tokens")
        rng = np.random.default_rng(seed + 5_000_077)
        ids = np.sort(np.concatenate([[ATTRACTOR_TOKEN_ID], rng.choice(plain, d2t - 1, replace=False)]))
        w.add_tensor("d2t", ids.astype(np.int64))
        w.add_tensor("output.weight", read_tensor(info, "output.weight")[ids].astype(np.float32))
    i = 0
    w.add_tensor(f"blk.{i}.attn_norm.weight", _ones(n_embd))
    w.add_tensor(f"blk.{i}.attn_norm_2.weight", _ones(n_embd))
    w.add_tensor(f"blk.{i}.attn_q.weight", r.mat(g.n_head * g.head_dim, 2 * n_embd))
    w.add_tensor(f"blk.{i}.attn_k.weight", r.mat(g.n_head_kv * g.head_dim, 2 * n_embd))
    w.add_tensor(f"blk.{i}.attn_v.weight", r.mat(g.n_head_kv * g.head_dim, 2 * n_embd))
    w.add_tensor(f"blk.{i}.attn_output.weight", r.mat(n_embd, g.n_head * g.head_dim))
    w.add_tensor(f"blk.{i}.ffn_norm.weight", _ones(n_embd))
    _add_ffn(w, r, i, n_embd, n_ff)
    path = Path(path)
    w.write(path)
    return path


# -- cached set --------------------------------------------------------------------


def cached_file(folder: str | Path, stem: str, version: int, params: dict, write) -> Path:
    """``write(path, **params)`` into ``folder`` once: the file name, ``stem-HASH.gguf``, carries a hash of
    the parameters and the writer's ``version``, so a second call with the same ones reuses the file
    (tiny_bert.py's and tiny_mamba.py's models)."""
    key = hashlib.sha256(json.dumps({"v": version, **params}, sort_keys=True).encode()).hexdigest()[:10]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem}-{key}.gguf"
    if not path.exists():
        _write_atomic(write, path, **params)
    return path


def _write_atomic(write, path: Path, **kwargs) -> None:
    # write to a unique temporary name, then rename: concurrent test workers never see half a file
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp, **kwargs)
    os.replace(tmp, path)


def _set_paths(folder: str | Path, prefix: str, arch: str, params: dict) -> "TinyModels":
    """Where a cached set lives: file names carry a short hash of every parameter that made them."""
    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:10]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return TinyModels(*(folder / f"{prefix}-{arch}-{key}-{part}.gguf" for part in ("target", "mmproj", "draft")))


@dataclass(frozen=True)
class _SetSpec:
    """What one cached set is written from: ``make_tiny_set`` and ``make_bench_set`` differ
    only in defaults and in which sizes they expose, so both fill one in for ``_make_set``."""

    prefix: str  # the start of the file names: "tiny" or "bench"
    arch: str
    seed: int
    window: int | None  # the draft's sliding window (None or 0: none)
    predictable: float
    n_layer: int  # target layers
    target_layers: tuple[int, ...]  # target layers whose inputs feed the draft
    block_size: int
    draft_n_layer: int
    # width and storage: the writers' defaults (the original n_embd 64 files) are all the tiny set uses
    n_embd: int = TINY_N_EMBD
    n_ff: int = 128
    dtype: str = "f32"
    dflash2: bool = False
    fim: bool = False  # the vocabulary has FIM tokens (write_target's fim)
    mtp: bool = False  # the target carries an MTP (nextn) block (write_target's mtp)
    # kind / n_embd / n_ff / dtype enter the file-name hash only for the bench set, whose sizes are
    # parameters; the tiny set's are fixed, and leaving them out keeps its cached file names valid
    sizes_in_key: bool = False

    def check(self) -> None:
        """Refuse bad parameters before writing anything (the writers check too, but one by one)."""
        if self.arch not in TARGET_ARCHS:
            raise ValueError(f"arch must be one of {TARGET_ARCHS}, got {self.arch!r}")
        _geometry(self.n_embd)
        _np_dtype(self.dtype)
        if not self.target_layers or any(not 0 <= t < self.n_layer for t in self.target_layers):
            raise ValueError(f"target_layers must be non-empty and in [0, {self.n_layer})")
        if self.mtp and self.arch not in MTP_ARCHS:
            raise ValueError(f"mtp=True needs one of {MTP_ARCHS}, got {self.arch!r}")

    def cache_key(self) -> dict:
        """The parameters hashed into the file names (see ``_set_paths``)."""
        key = dict(v=GENERATOR_VERSION, arch=self.arch, seed=self.seed, window=self.window or 0,
                   predictable=float(self.predictable), n_layer=self.n_layer,
                   target_layers=list(self.target_layers), block_size=self.block_size,
                   draft_n_layer=self.draft_n_layer)
        if self.sizes_in_key:
            key.update(kind=self.prefix, n_embd=self.n_embd, n_ff=self.n_ff, dtype=self.dtype)
        if self.dflash2:  # only when set, so the names of the plain sets do not change
            key["dflash2"] = True
        if self.fim:
            key["fim"] = True
        if self.mtp:
            key["mtp"] = True
        return key


def _make_set(folder: str | Path, spec: _SetSpec) -> TinyModels:
    """Write (or reuse) the three files of ``spec`` in ``folder``; each file missing is written atomically."""
    spec.check()
    models = _set_paths(folder, spec.prefix, spec.arch, spec.cache_key())
    # a qwen3vl target takes the qwen3vl_merger projector, with as many deepstack layers as it has
    qwen3vl = spec.arch == "qwen3vl"
    deep = dict(n_deepstack=len(QWEN3VL_DEEPSTACK_LAYERS)) if qwen3vl else {}
    proj = dict(projector="qwen3vl_merger", deepstack_layers=QWEN3VL_DEEPSTACK_LAYERS) if qwen3vl else {}
    if not models.target.exists():
        _write_atomic(write_target, models.target, arch=spec.arch, seed=spec.seed, n_embd=spec.n_embd,
                      n_layer=spec.n_layer, n_ff=spec.n_ff, predictable=spec.predictable, dtype=spec.dtype,
                      fim=spec.fim, mtp=spec.mtp, **deep)
    if not models.mmproj.exists():
        _write_atomic(write_mmproj, models.mmproj, target_n_embd=spec.n_embd, seed=spec.seed, dtype=spec.dtype,
                      **proj)
    if not models.draft.exists():
        # the draft's FFN is as wide as the target's
        _write_atomic(write_draft, models.draft, target_n_embd=spec.n_embd, target_layers=spec.target_layers,
                      target_n_layer=spec.n_layer, block_size=spec.block_size, sliding_window=spec.window,
                      n_layer=spec.draft_n_layer, n_ff=spec.n_ff, seed=spec.seed, dtype=spec.dtype,
                      dflash2=spec.dflash2, fim=spec.fim)
    return models


def make_tiny_set(folder: str | Path, *, arch: str = "hunyuan_vl", seed: int = 0, window: int | None = 32,
                  predictable: float = 0.5, n_layer: int = 4, target_layers: tuple[int, ...] = (1, 3),
                  block_size: int = 16, draft_n_layer: int = 1, dflash2: bool = False, fim: bool = False,
                  mtp: bool = False) -> TinyModels:
    """Write (or reuse) a target, mmproj and draft that fit together, in ``folder``.

    ``arch`` is one of ``TARGET_ARCHS``; a ``qwen3vl`` set gets a ``qwen3vl_merger`` mmproj
    with ``QWEN3VL_DEEPSTACK_LAYERS`` and a target with as many deepstack layers, the
    others the ``qwen2vl_merger`` mmproj.  Files are named by a short hash of the
    parameters (and ``GENERATOR_VERSION``), so a second call with the same parameters
    reuses them.  ``dflash2=True`` makes the draft a DFlash2 draft (``write_draft(dflash2=True)``,
    default selector / convolution sizes); it enters the hash only when set, so the
    names of the plain sets do not change. ``fim=True`` gives the target and draft the FIM tokens
    (``write_target(fim=True)``), for /infill; it too enters the hash only when set. ``mtp=True``
    gives the target its MTP head (``write_target(mtp=True)``; ``MTP_ARCHS`` only), for draft-mtp; it
    too enters the hash only when set.
    """
    return _make_set(folder, _SetSpec(
        prefix="tiny", arch=arch, seed=seed, window=window, predictable=predictable, n_layer=n_layer,
        target_layers=tuple(target_layers), block_size=block_size, draft_n_layer=draft_n_layer, dflash2=dflash2,
        fim=fim, mtp=mtp))


@dataclass(frozen=True)
class TinyDraftVLM:
    """A small vision-language model with a projector of its own, to draft for a tiny target."""

    model: Path
    mmproj: Path


def make_draft_vlm(folder: str | Path, *, arch: str = "qwen2vl", seed: int = 1, n_embd: int = 128,
                   n_layer: int = 2, predictable: float = 0.5, patch: int = 16) -> TinyDraftVLM:
    """Write (or reuse) a vision draft model for the tiny targets: a small VLM with their vocabulary
    and a projector of its own (``load(target, mmproj=..., draft=vlm.model, mmproj_draft=vlm.mmproj)``).

    By default another width than the targets' 64 (128: heads of 64, M-RoPE sections [8, 12, 12, 0]
    where the targets have [2, 3, 3, 0]), another architecture, fewer layers and another seed: so
    neither model can read the other's image rows, and only its own projector shows it the picture.
    Its projector's ``patch`` (16 by default, the targets' 14) cuts a picture into another grid: a
    672x672 image is 441 rows over 21 positions in the draft, 576 over 24 in the target.
    ``arch``: an attention-only one of ``TARGET_ARCHS`` (a draft model must roll back); a ``qwen3vl``
    one gets the ``qwen3vl_merger`` projector with ``QWEN3VL_DEEPSTACK_LAYERS`` (patch 14 only, and
    at least 3 layers: a deepstack slice goes to every layer but the last).
    Cached in ``folder`` by a hash of the parameters, as ``make_tiny_set``.
    """
    if arch not in TARGET_ARCHS or arch in ("qwen35", "qwen35moe"):
        raise ValueError(f"arch must be an attention-only one of {TARGET_ARCHS}, got {arch!r}")
    _geometry(n_embd)
    qwen3vl = arch == "qwen3vl"
    if qwen3vl and patch != 14:
        raise ValueError("a qwen3vl draft's projector has patch 14")
    if qwen3vl and n_layer <= len(QWEN3VL_DEEPSTACK_LAYERS):
        # qwen3vl.cpp adds deepstack slice i to layer i's output, and not to the last layer's
        raise ValueError(f"a qwen3vl draft takes {len(QWEN3VL_DEEPSTACK_LAYERS)} deepstack slices: it needs at "
                         f"least {len(QWEN3VL_DEEPSTACK_LAYERS) + 1} layers, got n_layer={n_layer}")
    key = dict(v=GENERATOR_VERSION, kind="draft-vlm", arch=arch, seed=seed, n_embd=n_embd, n_layer=n_layer,
               predictable=float(predictable), patch=patch)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vlm = TinyDraftVLM(*(folder / f"draft-vlm-{arch}-{digest}-{part}.gguf" for part in ("model", "mmproj")))
    if not vlm.model.exists():
        deep = dict(n_deepstack=len(QWEN3VL_DEEPSTACK_LAYERS)) if qwen3vl else {}
        _write_atomic(write_target, vlm.model, arch=arch, seed=seed, n_embd=n_embd, n_layer=n_layer,
                      predictable=predictable, **deep)
    if not vlm.mmproj.exists():
        proj = dict(projector="qwen3vl_merger", deepstack_layers=QWEN3VL_DEEPSTACK_LAYERS) if qwen3vl else \
            dict(patch=patch)
        _write_atomic(write_mmproj, vlm.mmproj, target_n_embd=n_embd, seed=seed, **proj)
    return vlm


def bench_n_params(*, n_embd: int = 1024, n_layer: int = 12, n_ff: int = 2816, arch: str = "hunyuan_vl",
                   draft_n_layer: int = 2, n_target_layers: int = 3) -> dict[str, int]:
    """Parameter counts of the target and draft ``make_bench_set`` writes (as llama.cpp counts them)."""
    g = _geometry(n_embd)
    attn = 2 * n_embd * g.n_head * g.head_dim + 2 * n_embd * g.n_head_kv * g.head_dim + 2 * g.head_dim
    ffn = 3 * n_embd * n_ff
    if arch == "qwen35moe":  # router, experts, shared expert and its gate (_add_moe_ffn)
        ffn = MOE_N_EXPERT * n_embd + (MOE_N_EXPERT + 1) * 3 * n_embd * n_ff + n_embd
    norms = 2 * n_embd
    if arch in ("hunyuan_vl", "qwen3vl"):
        layers = n_layer * (attn + ffn + norms)
    elif arch == "qwen2vl":
        layers = n_layer * (attn - 2 * g.head_dim + (g.n_head + 2 * g.n_head_kv) * g.head_dim + ffn + norms)
    else:  # qwen35(moe): attention (with a query gate) on odd layers, gated delta net on even ones
        kd, vd, nv = g.n_head_kv * g.head_dim, g.n_head * g.head_dim, g.n_head
        delta = (2 * kd + vd) * n_embd + vd * n_embd + (2 * kd + vd) * 4 + 2 * nv + 2 * nv * n_embd \
            + g.head_dim + n_embd * vd
        n_attn = n_layer // 2
        layers = n_attn * (attn + n_embd * g.n_head * g.head_dim) + (n_layer - n_attn) * delta \
            + n_layer * (ffn + norms)
    target = 2 * N_VOCAB * n_embd + n_embd + layers
    draft = n_target_layers * n_embd * n_embd + 2 * n_embd + draft_n_layer * (attn + ffn + norms)
    return {"target": target, "draft": draft}


def make_bench_set(folder: str | Path, *, n_embd: int = 1024, n_layer: int = 12, n_ff: int = 2816,
                   dtype: str = "f16", predictable: float = 0.5, window: int | None = 32,
                   target_layers: tuple[int, ...] = (1, 6, 11), seed: int = 0, arch: str = "hunyuan_vl",
                   block_size: int = 16, draft_n_layer: int = 2, mtp: bool = False) -> TinyModels:
    """Write (or reuse) a larger random target, mmproj and draft for benchmarks, in ``folder``.

    Same construction as ``make_tiny_set`` (same tokenizer, ``predictable`` knob, tiny
    vision tower), but wide: with the defaults (``hunyuan_vl``, n_embd 1024 = 16 heads
    of 64 with 8 KV heads, 12 layers, n_ff 2816, f16) the target has 142,135,808
    parameters (a 284 MB file) and the 2-layer draft 26,745,088 (54 MB), as
    ``pyllama_spec.Model(...).n_params`` reports them; see ``bench_n_params``.  Writing the
    set takes about 4 s (peak memory about 0.9 GB).  Files are named ``bench-{arch}-{hash}-*.gguf``
    by a hash of the parameters (and ``GENERATOR_VERSION``) and written atomically, so a
    second call reuses them. ``mtp=True`` (``arch="qwen35"`` or ``"qwen35moe"``): the target carries
    its MTP head, as ``make_tiny_set``'s, for draft-mtp at this size.
    """
    return _make_set(folder, _SetSpec(
        prefix="bench", arch=arch, seed=seed, window=window, predictable=predictable, n_layer=n_layer,
        target_layers=tuple(target_layers), block_size=block_size, draft_n_layer=draft_n_layer,
        n_embd=n_embd, n_ff=n_ff, dtype=dtype, sizes_in_key=True, mtp=mtp))
