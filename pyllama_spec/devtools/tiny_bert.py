"""A tiny, real BERT embedding model (and reranker) for tests: llama.cpp's ``bert`` architecture
with bge-small's WordPiece vocabulary and random weights.

The vocabulary comes from the pinned llama.cpp's ``models/ggml-vocab-bert-bge.gguf`` (a
vocabulary-only file of bge-small-en-v1.5), so it tokenizes as the real model does ("hello hello
hello" is [CLS] hello hello hello [SEP]); the weights are drawn from a seed, so the vectors mean
nothing, but they are deterministic and differ between inputs. It stands in for
``bert-bge-small`` (llama.cpp's server tests) and ``bge-small-en-v1.5`` (llama-cpp-python's).

    write_bert("bert.gguf")                       # CLS pooling, as bge-small declares
    write_bert("rerank.gguf", rerank=True)        # a classifier head and RANK pooling
    make_bert(folder)                             # cached by a hash of the parameters
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pyllama_spec.devtools import tiny
from pyllama_spec.gguf.reader import read_gguf
from pyllama_spec.gguf.writer import GGUFWriter, ValueType

#: Bump when the generated files change, so make_bert caches are invalidated.
GENERATOR_VERSION = 1
VOCAB_FILE = "models/ggml-vocab-bert-bge.gguf"
#: llama.cpp's pooling types (enum llama_pooling_type), as the GGUF key ``bert.pooling_type`` holds them.
POOLING_MEAN, POOLING_CLS, POOLING_RANK = 1, 2, 4
#: The tokenizer keys copied from the vocabulary file.
_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.token_type_count", "tokenizer.ggml.unknown_token_id",
                   "tokenizer.ggml.seperator_token_id", "tokenizer.ggml.padding_token_id",
                   "tokenizer.ggml.cls_token_id", "tokenizer.ggml.mask_token_id")


def vocabulary_file() -> Path:
    """bge-small's vocabulary in the pinned llama.cpp tree (extracted by the native build)."""
    from pyllama_spec.native_build.source import pinned_source

    return pinned_source().path / VOCAB_FILE


def write_bert(path: str | Path, *, seed: int = 0, n_embd: int = 32, n_layer: int = 2, n_head: int = 2,
               n_ff: int = 64, context_length: int = 512, rerank: bool = False, pooling: int | None = None) -> Path:
    """Write a tiny ``bert`` GGUF to ``path``: f32, ``n_layer`` encoder layers, bge's vocabulary.

    ``pooling`` is the pooling the file declares (CLS by default, as bge-small; RANK with
    ``rerank``, which adds llama.cpp's classifier head: ``cls`` and ``cls.output``, one label)."""
    if n_embd % n_head:
        raise ValueError(f"n_embd {n_embd} is not a multiple of n_head {n_head}")
    vocab = read_gguf(vocabulary_file(), "vocabulary").metadata
    n_vocab = len(vocab["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(seed)

    def mat(n_out: int, n_in: int, std: float = 0.05) -> np.ndarray:  # ggml dims [n_in, n_out]
        return (rng.standard_normal((n_out, n_in)) * std).astype(np.float32)

    def vec(n: int, std: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(n) * std).astype(np.float32)

    w = GGUFWriter()
    arch = "bert"
    w.add_string("general.architecture", arch)
    w.add_string("general.name", "tiny-bert-reranker" if rerank else "tiny-bert")
    w.add_uint32(f"{arch}.context_length", context_length)
    w.add_uint32(f"{arch}.embedding_length", n_embd)
    w.add_uint32(f"{arch}.feed_forward_length", n_ff)
    w.add_uint32(f"{arch}.block_count", n_layer)
    w.add_uint32(f"{arch}.attention.head_count", n_head)
    w.add_float32(f"{arch}.attention.layer_norm_epsilon", 1e-12)
    w.add_bool(f"{arch}.attention.causal", False)
    w.add_uint32(f"{arch}.pooling_type", pooling if pooling is not None else POOLING_RANK if rerank else POOLING_CLS)
    if rerank:
        w.add_array(f"{arch}.classifier.output_labels", ValueType.STRING, ["relevance"])
    for key in _TOKENIZER_KEYS:
        value = vocab[key]
        if isinstance(value, str):
            w.add_string(key, value)
        elif key == "tokenizer.ggml.tokens":
            w.add_array(key, ValueType.STRING, value)
        elif key == "tokenizer.ggml.token_type":
            w.add_array(key, ValueType.INT32, [int(t) for t in value])
        else:
            w.add_uint32(key, int(value))

    def linear(name: str, n_out: int, n_in: int, std: float = 0.2) -> None:  # a weight and its bias
        w.add_tensor(f"{name}.weight", mat(n_out, n_in, std))
        w.add_tensor(f"{name}.bias", vec(n_out))

    def norm(name: str, n: int) -> None:  # a layer norm: unit scale, a small bias
        w.add_tensor(f"{name}.weight", np.ones(n, np.float32))
        w.add_tensor(f"{name}.bias", vec(n))

    w.add_tensor("token_embd.weight", mat(n_vocab, n_embd, 0.5))
    w.add_tensor("token_types.weight", mat(2, n_embd, 0.1))
    w.add_tensor("position_embd.weight", mat(context_length, n_embd, 0.1))
    norm("token_embd_norm", n_embd)
    for i in range(n_layer):
        p = f"blk.{i}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            linear(f"{p}.{name}", n_embd, n_embd)
        norm(f"{p}.attn_output_norm", n_embd)
        linear(f"{p}.ffn_up", n_ff, n_embd)
        linear(f"{p}.ffn_down", n_embd, n_ff)
        norm(f"{p}.layer_output_norm", n_embd)
    if rerank:
        linear("cls", n_embd, n_embd)
        linear("cls.output", 1, n_embd, 0.5)
    path = Path(path)
    w.write(path)
    return path


def make_bert(folder: str | Path, **params) -> Path:
    """``write_bert(**params)`` into ``folder``, once: the file name carries a hash of the parameters,
    and a file is written under a temporary name and renamed (concurrent test workers never see half
    of one)."""
    stem = "tiny-bert-rerank" if params.get("rerank") else "tiny-bert"
    return tiny.cached_file(folder, stem, GENERATOR_VERSION, params, write_bert)
