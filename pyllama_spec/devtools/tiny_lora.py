"""Tiny, real GGUF LoRA adapters for the tiny targets (``tiny.write_target``), for tests.

``write_lora`` reads a target's tensor shapes and writes an adapter that llama.cpp's
``llama_adapter_lora_init`` (src/llama-adapter.cpp) loads against it:

* metadata ``general.type = "adapter"``, ``general.architecture`` (the target's),
  ``adapter.type = "lora"``, ``adapter.lora.alpha``;
* for each adapted matrix ``W`` (ggml dims ``[n_in, n_out]``) a pair ``W.lora_a``
  (ggml ``[n_in, rank]``) and ``W.lora_b`` (ggml ``[rank, n_out]``): llama.cpp adds
  ``scale * alpha / rank * B (A x)`` to ``W x``, where ``scale`` is the adapter's scale
  (``--lora-scaled FILE:SCALE``, 1 by default).

The pairs are seeded numpy draws, sized against the target's own weights: at scale 1 each
adapted matrix moves by ``strength`` times its own RMS, so the target's greedy output changes
visibly (the output head is adapted by default), while scale 0 is exactly the target alone.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Sequence

import numpy as np

from pyllama_spec.gguf.reader import read_gguf, read_tensor
from pyllama_spec.gguf.writer import GGUFWriter

#: The target tensors ``write_lora`` adapts unless told otherwise (fnmatch patterns): every
#: attention and feed-forward projection, and the output head.
DEFAULT_TENSORS = ("blk.*.attn_q.weight", "blk.*.attn_k.weight", "blk.*.attn_v.weight",
                   "blk.*.attn_output.weight", "blk.*.ffn_gate.weight", "blk.*.ffn_up.weight",
                   "blk.*.ffn_down.weight", "output.weight")


def write_lora(path: str | Path, target: str | Path, *, rank: int = 4, alpha: float | None = None,
               seed: int = 0, strength: float = 1.0, tensors: Sequence[str] = DEFAULT_TENSORS,
               arch: str | None = None, task_name: str | None = None, prompt_prefix: str | None = None) -> Path:
    """Write a LoRA adapter for the target GGUF ``target`` to ``path`` and return ``path``.

    ``rank``: the inner width of each pair; ``alpha`` (default: ``rank``, so the factor
    alpha / rank is 1): the ``adapter.lora.alpha`` key. ``strength``: how far each adapted
    matrix moves at scale 1, as a fraction of its own RMS. ``tensors``: fnmatch patterns of
    the target's 2-D tensors to adapt (at least one must match). ``arch`` overrides the
    ``general.architecture`` written (an adapter "for another model", for tests).
    ``task_name`` / ``prompt_prefix``: the optional ``adapter.lora.*`` strings llama-server
    lists in GET /lora-adapters.

    >>> write_lora("tiny-lora.gguf", "tiny-hunyuan_vl-target.gguf")     # doctest: +SKIP
    """
    if rank < 1:
        raise ValueError(f"rank must be at least 1, got {rank}")
    info = read_gguf(target, "target model")
    names = [n for n, t in info.tensors.items()
             if len(t.dims) == 2 and any(fnmatch.fnmatchcase(n, p) for p in tensors)]
    if not names:
        raise ValueError(f"no 2-D tensor of {target} matches {list(tensors)}")
    rng = np.random.default_rng(seed)
    alpha = float(rank if alpha is None else alpha)
    w = GGUFWriter()
    w.add_string("general.type", "adapter")
    w.add_string("general.architecture", arch or info.arch or "")
    w.add_string("general.name", f"tiny-lora-{seed}")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    if task_name is not None:
        w.add_string("adapter.lora.task_name", task_name)
    if prompt_prefix is not None:
        w.add_string("adapter.lora.prompt_prefix", prompt_prefix)
    for name in names:
        n_in, n_out = info.tensors[name].dims
        weight = read_tensor(info, name).astype(np.float32)
        target_rms = float(np.sqrt(np.mean(weight * weight))) or 1.0
        # A x has unit-size rows for unit-size inputs; B then gives each output strength x RMS(W)
        # after llama.cpp's alpha / rank factor (and the sqrt(rank) that summing rank terms adds)
        a = rng.standard_normal((rank, n_in)) / np.sqrt(n_in)
        b = rng.standard_normal((n_out, rank)) * strength * target_rms * np.sqrt(n_in / rank) * rank / alpha
        w.add_tensor(f"{name}.lora_a", a.astype(np.float32))
        w.add_tensor(f"{name}.lora_b", b.astype(np.float32))
    path = Path(path)
    w.write(path)
    return path
