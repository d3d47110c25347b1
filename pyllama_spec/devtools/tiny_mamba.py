"""A tiny, real Mamba (Mamba-1) model for tests: llama.cpp's ``mamba`` architecture, a recurrent-only
model (no attention layer, no KV cache: its memory is the per-sequence conv and SSM states).

It shares the tiny targets' byte-level BPE tokenizer (devtools/tiny.py) and draws its weights from a
seed, so it says nothing useful, but deterministically, and its next token depends on the context.
It stands in for ``mamba-130m-hf`` (llama-cpp-python's recurrent-model tests).

    write_mamba("mamba.gguf")        # n_embd 64, 2 layers, d_state 16, d_conv 4, expand 2
    make_mamba(folder)               # cached by a hash of the parameters

The keys and tensors are those llama.cpp's ``llama_model_mamba`` loads (src/models/mamba.cpp); the
numpy shapes below are ggml's dimensions reversed.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from pyllama_spec.devtools import tiny
from pyllama_spec.gguf.writer import GGUFWriter

#: Bump when the generated files change, so make_mamba caches are invalidated.
GENERATOR_VERSION = 1
#: mamba-130m-hf's RMS norm epsilon.
RMS_EPS = 1e-5
# the range of the step sizes softplus(dt) starts at (Mamba's dt_min / dt_max initialization)
_DT_MIN, _DT_MAX = 1e-3, 1e-1


def write_mamba(path: str | Path, *, seed: int = 0, n_embd: int = 64, n_layer: int = 2, d_state: int = 16,
                d_conv: int = 4, expand: int = 2, dt_rank: int | None = None) -> Path:
    """Write a tiny ``mamba`` GGUF to ``path``: f32, ``n_layer`` Mamba blocks, the tiny vocabulary.

    ``dt_rank`` defaults to ceil(n_embd / 16), as Mamba's "auto". llama.cpp supports only
    ``expand`` 2 (d_inner = 2 n_embd)."""
    if expand != 2:
        raise ValueError(f"llama.cpp's mamba supports only expand 2, got {expand}")
    if min(n_embd, n_layer, d_state, d_conv) <= 0:
        raise ValueError("n_embd, n_layer, d_state and d_conv must be positive")
    d_inner = expand * n_embd
    dt_rank = dt_rank if dt_rank is not None else math.ceil(n_embd / 16)
    rng = np.random.default_rng(seed)

    def mat(n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:  # ggml dims [n_in, n_out]
        # std gain / sqrt(n_in): each output keeps about the size of its (unit-rms) input, times gain
        return (rng.standard_normal((n_out, n_in)) * (gain / math.sqrt(n_in))).astype(np.float32)

    def vec(n: int, std: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(n) * std).astype(np.float32)

    w = GGUFWriter()
    arch = "mamba"
    w.add_string("general.architecture", arch)
    w.add_string("general.name", "tiny-mamba")
    w.add_uint32(f"{arch}.context_length", tiny.TINY_CONTEXT_LENGTH)  # only metadata: no positions
    w.add_uint32(f"{arch}.embedding_length", n_embd)
    w.add_uint32(f"{arch}.block_count", n_layer)
    # no MLP and no attention heads (llama.cpp reads both as optional; convert_hf_to_gguf writes 0)
    w.add_uint32(f"{arch}.feed_forward_length", 0)
    w.add_uint32(f"{arch}.attention.head_count", 0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", RMS_EPS)
    w.add_uint32(f"{arch}.ssm.conv_kernel", d_conv)
    w.add_uint32(f"{arch}.ssm.inner_size", d_inner)
    w.add_uint32(f"{arch}.ssm.state_size", d_state)
    w.add_uint32(f"{arch}.ssm.time_step_rank", dt_rank)
    tiny._add_tokenizer(w)

    n_vocab = tiny.N_VOCAB
    # unit-size embeddings (the blocks start with an RMS norm); an output head of its own (not tied)
    # whose control rows are zero, as the tiny targets' are: greedy generation never picks EOS. The
    # rows of bytes outside printable ASCII are zero too, so greedy text is whole characters (no
    # half of a UTF-8 sequence), readable in a failing test's message
    w.add_tensor("token_embd.weight", rng.standard_normal((n_vocab, n_embd)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    head = mat(n_vocab, n_embd, 2.0)
    head[:ord(" ")] = head[ord("~") + 1:len(tiny.BYTE_TOKENS)] = 0.0
    head[tiny.FIRST_SPECIAL_ID:] = 0.0
    w.add_tensor("output.weight", head)
    for i in range(n_layer):
        p = f"blk.{i}"
        w.add_tensor(f"{p}.attn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"{p}.ssm_in.weight", mat(2 * d_inner, n_embd))  # x and the gate z
        # a depthwise causal convolution over the last d_conv tokens, per channel
        w.add_tensor(f"{p}.ssm_conv1d.weight", mat(d_inner, d_conv))
        w.add_tensor(f"{p}.ssm_conv1d.bias", vec(d_inner))
        w.add_tensor(f"{p}.ssm_x.weight", mat(dt_rank + 2 * d_state, d_inner))  # dt, B, C
        w.add_tensor(f"{p}.ssm_dt.weight", mat(d_inner, dt_rank, 0.5))
        # Mamba's dt bias: softplus(bias) is log-uniform in [dt_min, dt_max] (inverse softplus)
        dt = np.exp(rng.uniform(math.log(_DT_MIN), math.log(_DT_MAX), d_inner))
        w.add_tensor(f"{p}.ssm_dt.bias", (dt + np.log(-np.expm1(-dt))).astype(np.float32))
        # A = -exp(A_log) as checkpoints store it, Mamba's S4D-real init: -1 .. -d_state per channel
        # (negative: the state decays, so it stays bounded); no "weight" suffix on ssm_a / ssm_d
        w.add_tensor(f"{p}.ssm_a", -np.tile(np.arange(1, d_state + 1, dtype=np.float32), (d_inner, 1)))
        w.add_tensor(f"{p}.ssm_d", np.ones(d_inner, np.float32))
        # a small out-projection: each block nudges the residual stream, the token still leads
        w.add_tensor(f"{p}.ssm_out.weight", mat(n_embd, d_inner, 0.5))
    path = Path(path)
    w.write(path)
    return path


def make_mamba(folder: str | Path, **params) -> Path:
    """``write_mamba(**params)`` into ``folder``, once: the file name carries a hash of the parameters,
    and a file is written under a temporary name and renamed (concurrent test workers never see half
    of one)."""
    return tiny.cached_file(folder, "tiny-mamba", GENERATOR_VERSION, params, write_mamba)
