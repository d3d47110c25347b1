"""What a configuration will need, from GGUF metadata alone, before anything is allocated.

Parts of one size model each: weights (the tensors' exact byte sizes), KV caches (cells x layers
x KV heads x head widths at the chosen cache types; a sliding-window cache holds
min(n_ctx, window + n_ubatch) cells, padded to 256 as llama.cpp pads it) and compute buffers.
Without flash attention a compute buffer is dominated by one layer's attention scores (heads x
n_ubatch x cells, f32) and the mask (cells x n_ubatch, f32); the rest is a ubatch of feed-forward
and output activations. That is the shape of llama.cpp's graph at this pin, checked against what
it allocates on the tiny, bench and trained models (tests/test_memory.py); with flash attention
the scores are not stored whole and the estimate is an upper bound. A projector's compute buffer
depends on the image and is not estimated.

``estimate`` counts the target and its projector; every drafting method adds its own parts (a
draft's weights and caches, a draft's projector, a head's context), made here by ``model_part``
and ``projector_part`` from what its registry entry says (drafters/registry.py).

Pure Python: reads files with gguf_check, nothing native.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

from pyllama_spec.gguf.reader import (
    read_gguf_shared as read_gguf,  # read-only use, parsed once per load
)

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class KVCacheType:
    """What one KV cache type stores: blocks of ``block`` values, ``block_bytes`` bytes each
    (a quantized type's block holds its scales too; an unquantized type has blocks of one value)."""

    name: str
    block: int
    block_bytes: int

    @property
    def bytes_per_value(self) -> float:
        return self.block_bytes / self.block

    @property
    def quantized(self) -> bool:
        return self.block > 1


#: The KV cache types this package offers (llama.cpp's -ctk / -ctv names), in the order the CLI lists them.
KV_CACHE_TYPE_FACTS: dict[str, KVCacheType] = {t.name: t for t in (
    KVCacheType("f32", 1, 4), KVCacheType("f16", 1, 2), KVCacheType("bf16", 1, 2),
    KVCacheType("q8_0", 32, 34), KVCacheType("q4_0", 32, 18), KVCacheType("q4_1", 32, 20),
    KVCacheType("iq4_nl", 32, 18), KVCacheType("q5_0", 32, 22), KVCacheType("q5_1", 32, 24))}
KV_CACHE_TYPE_NAMES: tuple[str, ...] = tuple(KV_CACHE_TYPE_FACTS)


@dataclasses.dataclass
class Part:
    name: str  # "target", "mmproj", and a method's: "draft", "draft mmproj", "MTP head"
    weights: int
    kv: int
    compute: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute


@dataclasses.dataclass
class Estimate:
    parts: list[Part]

    @property
    def total(self) -> int:
        return sum(p.total for p in self.parts)

    def fits(self, free_bytes: int) -> bool:
        return self.total <= free_bytes

    def describe(self) -> str:
        return "; ".join(f"{p.name} {p.total / MiB:.0f} MiB (weights {p.weights / MiB:.0f}, KV {p.kv / MiB:.0f}, "
                         f"compute {p.compute / MiB:.0f})" for p in self.parts) + f"; in all {self.total / MiB:.0f} MiB"

    def table(self) -> list[tuple[str, str, str, str, str]]:
        rows = [(p.name, *(f"{v / MiB:.1f} MiB" for v in (p.weights, p.kv, p.compute, p.total))) for p in self.parts]
        rows.append(("all", "", "", "", f"{self.total / MiB:.1f} MiB"))
        return rows


def _hparams(info, key: str, default=None, *, largest: bool = False):
    """A hyperparameter of the model's architecture; of one given per layer, the first layer's (or, with
    ``largest``, the largest)."""
    v = info.metadata.get(f"{info.arch}.{key}", default)
    if hasattr(v, "__len__") and not isinstance(v, str):
        return max((int(x) for x in v), default=default) if largest else int(v[0])
    return int(v) if v is not None else default


def kv_bytes_per_row(path: str | Path, *, type_k: str, type_v: str) -> int:
    """An upper bound on the KV cache bytes one cache row of ``path`` takes: every layer counted as an
    attention layer with the most KV heads any layer has, none windowed (a sliding-window model's
    global layers keep every row)."""
    for kind in (type_k, type_v):
        _check_cache_type(kind)
    info = read_gguf(path)

    def most(key: str, default: int) -> int:
        return _hparams(info, key, default, largest=True)

    n_layer = most("block_count", 0) + most("nextn_predict_layers", 0)
    n_embd = most("embedding_length", 0)
    n_head = max(most("attention.head_count", 1), 1)
    n_head_kv = max(most("attention.head_count_kv", n_head), 1)
    head_k = most("attention.key_length", n_embd // n_head)
    head_v = most("attention.value_length", head_k)
    return int(n_layer * n_head_kv * (head_k * KV_CACHE_TYPE_FACTS[type_k].bytes_per_value
                                      + head_v * KV_CACHE_TYPE_FACTS[type_v].bytes_per_value))


def _weights(info) -> int:
    return sum(t.nbytes for t in info.tensors.values())


def model_part(name: str, path: str | Path, *, n_ctx: int, n_ubatch: int, type_k: str, type_v: str,
               n_vocab_out: int | None = None, live: tuple[int, int] = (2, 4), nextn_only: bool = False) -> Part:
    """One context's part: the model's weights, its KV cache of ``n_ctx`` cells (its window's, for a
    sliding-window model) and the compute buffer of an ``n_ubatch``-row ubatch. ``n_vocab_out``: the
    rows of its output (default: its own vocabulary's); ``live``: rows of f32 activations alive at the
    graph's peak, (x n_ff, x n_embd). ``nextn_only``: a second context on the same model that holds its
    nextn (MTP) layers only, whose weights are the model's (counted with it)."""
    for kind in (type_k, type_v):
        _check_cache_type(kind)
    info = read_gguf(path)
    n_layer = _hparams(info, "nextn_predict_layers", 0) if nextn_only else _hparams(info, "block_count", 0)
    n_embd = _hparams(info, "embedding_length", 0)
    n_ff = _hparams(info, "feed_forward_length", 0)
    n_head = _hparams(info, "attention.head_count", 1)
    n_head_kv = _hparams(info, "attention.head_count_kv", n_head)
    head_k = _hparams(info, "attention.key_length", n_embd // max(n_head, 1))
    head_v = _hparams(info, "attention.value_length", head_k)
    window = _hparams(info, "attention.sliding_window", 0)
    cells = n_ctx
    if window:  # a sliding-window cache keeps the window and one ubatch, padded as llama.cpp pads it
        cells = min(n_ctx, -(-(window + n_ubatch) // 256) * 256)
    kv = int(n_layer * cells * n_head_kv * (head_k * KV_CACHE_TYPE_FACTS[type_k].bytes_per_value
                                             + head_v * KV_CACHE_TYPE_FACTS[type_v].bytes_per_value))
    n_vocab = n_vocab_out or vocabulary_size(path)
    # With flash attention the scores are not stored whole, but its own buffers take part of that
    # room (measured: 21 of the 35.5 MiB on the bench draft): counting them keeps an upper bound.
    scores = n_head * n_ubatch * cells * 4 + cells * n_ubatch * 4
    # Rows of f32 activations alive at the graph's peak besides the scores: (x n_ff, x n_embd),
    # fitted to llama.cpp's allocations (a causal target keeps more alive than a DFlash block).
    activations = n_ubatch * (live[0] * n_ff + live[1] * n_embd + n_vocab) * 4
    return Part(name, 0 if nextn_only else _weights(info), kv, scores + activations)


def projector_part(name: str, path: str | Path) -> Part:
    """A projector's part: its weights (its compute buffer depends on the image)."""
    return Part(name, _weights(read_gguf(path)), 0, 0)


def vocabulary_size(path: str | Path) -> int:
    """The tokens in a model file's vocabulary."""
    return len(read_gguf(path).metadata.get("tokenizer.ggml.tokens", ()))


def _check_cache_type(kind: str | None) -> None:
    if kind is not None and kind not in KV_CACHE_TYPE_FACTS:
        raise ValueError(f"{kind!r} is not a KV cache type; use one of {', '.join(KV_CACHE_TYPE_NAMES)}")


def estimate(model: str | Path, *, mmproj: str | Path | None = None, n_ctx: int = 4096, n_ubatch: int = 512,
             cache_type_k: str = "f16", cache_type_v: str = "f16", method_parts: Sequence[Part] = ()) -> Estimate:
    """The memory a load() with these settings needs, part by part (see the module): the target's,
    then ``method_parts`` (the drafting method's own, drafters/registry.py), then the projector's."""
    target = model_part("target", model, n_ctx=n_ctx, n_ubatch=n_ubatch, type_k=cache_type_k, type_v=cache_type_v)
    parts = [target, *method_parts]
    if mmproj is not None:
        parts.append(projector_part("mmproj", mmproj))
    return Estimate(parts)
