"""An inference context on a Model (its KV cache, compute buffers, outputs), and its Memory.

The handle is owned by one ``Context``, freed by ``close()`` (also on ``with`` exit, and by a
guarded finalizer). Decode return codes become exceptions from ``pyllama_spec.errors``;
logits and layer inputs come out as numpy arrays.
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

from pyllama_spec._native import arm_interrupts, ffi, interrupted_during_call, lib, raise_carried
from pyllama_spec.bindings.handle import NativeHandle
from pyllama_spec.errors import (
    IncompatibleModelsError,
    KVMemoryError,
    NativeCallError,
    check_decode,
    check_set_lora,
    check_state,
    forget_native_problems,
)
from pyllama_spec.gguf.memory import KV_CACHE_TYPE_FACTS, KV_CACHE_TYPE_NAMES

if TYPE_CHECKING:
    from pyllama_spec.bindings.batch import Batch
    from pyllama_spec.bindings.lora import LoraAdapter
    from pyllama_spec.bindings.model import Model

#: The ggml type of each KV cache type, by llama.cpp's -ctk / -ctv names. The names and their
#: facts (bytes, block, quantized) are gguf.memory's KV_CACHE_TYPE_NAMES / KV_CACHE_TYPE_FACTS.
KV_CACHE_TYPES = {"f32": lib.GGML_TYPE_F32, "f16": lib.GGML_TYPE_F16, "bf16": lib.GGML_TYPE_BF16,
                  "q8_0": lib.GGML_TYPE_Q8_0, "q4_0": lib.GGML_TYPE_Q4_0, "q4_1": lib.GGML_TYPE_Q4_1,
                  "iq4_nl": lib.GGML_TYPE_IQ4_NL, "q5_0": lib.GGML_TYPE_Q5_0, "q5_1": lib.GGML_TYPE_Q5_1}
assert tuple(KV_CACHE_TYPES) == KV_CACHE_TYPE_NAMES, "KV_CACHE_TYPES must map exactly gguf.memory's names"

#: How an embeddings context pools a sequence's rows into one vector, by llama-server's --pooling
#: names ("unspecified": what the model's GGUF declares).
POOLING_TYPES = {"unspecified": lib.LLAMA_POOLING_TYPE_UNSPECIFIED, "none": lib.LLAMA_POOLING_TYPE_NONE,
                 "mean": lib.LLAMA_POOLING_TYPE_MEAN, "cls": lib.LLAMA_POOLING_TYPE_CLS,
                 "last": lib.LLAMA_POOLING_TYPE_LAST, "rank": lib.LLAMA_POOLING_TYPE_RANK}
_POOLING_OF = {v: k for k, v in POOLING_TYPES.items()}


class Context(NativeHandle):
    """An inference context (KV cache, compute buffers) on a Model.

    ``role`` ("target" or "draft") is named in every error. ``ctx_other`` lets a
    DFlash draft borrow the target's token embeddings and output head. ``mtp=True`` makes a
    context that runs the model's multi-token-prediction (nextn) block instead of its layers
    (llama.cpp's ``LLAMA_CONTEXT_TYPE_MTP``; the model must be loaded with ``load_mtp``).
    """

    _what = "context"

    def __init__(self, model: Model, *, n_ctx: int = 4096, n_batch: int = 512, n_ubatch: int = 512,
                 n_seq_max: int = 1, n_rs_seq: int = 0, n_threads: int | None = None,
                 n_threads_batch: int | None = None, type_k: str = "f16", type_v: str = "f16",
                 flash_attn: bool | None = False, swa_full: bool = False, embeddings: bool = False,
                 kv_unified: bool = False, ctx_other: "Context | None" = None, role: str = "target",
                 mtp: bool = False, pooling: str = "unspecified") -> None:
        self.model = model
        self.role = role
        self._other = ctx_other  # keeps the borrowed context alive as long as this one
        self._borrowers: weakref.WeakSet[Context] = weakref.WeakSet()  # contexts whose ctx_other is this one
        self._token_batch: Batch | None = None
        self._layer_inputs: frozenset[int] = frozenset()
        self._draft_embeddings = False
        self._draft_embeddings_masked = True
        self._lora: tuple[tuple[LoraAdapter, float], ...] = ()  # what set_lora set: kept alive here
        self.last_decode_rows = 0  # rows of the last successful decode: what the output buffers hold
        params = lib.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = min(n_ubatch, n_batch)
        if n_seq_max > n_batch:
            # llama.cpp reserves an output row per sequence within n_batch, and aborts past it.
            raise ValueError(f"the {role} context cannot hold {n_seq_max} sequences with n_batch {n_batch}: "
                             "n_batch must be at least the number of sequences")
        params.n_seq_max = n_seq_max
        params.n_rs_seq = n_rs_seq
        threads = n_threads or max(1, (os.cpu_count() or 2))
        params.n_threads = threads
        params.n_threads_batch = n_threads_batch or threads
        for name, kind in (("type_k", type_k), ("type_v", type_v)):
            if kind not in KV_CACHE_TYPES:
                raise ValueError(f"{name} {kind!r} is not a KV cache type; use one of {', '.join(KV_CACHE_TYPE_NAMES)}")
        if KV_CACHE_TYPE_FACTS[type_v].quantized and flash_attn is False:
            # llama.cpp refuses a quantized V cache without flash attention (it returns no context).
            raise ValueError(f"a quantized V cache ({type_v}) needs flash attention: -fa on (flash_attn=True) "
                             "or auto, or an unquantized V cache (f16)")
        for kind, width, name in zip((type_k, type_v), model.head_dims(), ("K", "V")):
            block = KV_CACHE_TYPE_FACTS[kind].block
            if width and width % block:
                raise ValueError(f"a {kind} {name} cache stores blocks of {block} values, which do not divide this "
                                 f"{role} model's {name} head width {width}; use f16 or bf16 for it")
        params.type_k, params.type_v = KV_CACHE_TYPES[type_k], KV_CACHE_TYPES[type_v]
        params.flash_attn_type = (lib.LLAMA_FLASH_ATTN_TYPE_AUTO if flash_attn is None else
                                  lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else
                                  lib.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.swa_full = swa_full
        params.kv_unified = kv_unified  # one cache for all sequences (draft trees share its cells)
        self.kv_unified = kv_unified  # every sequence may use n_ctx cells of the one pool
        params.embeddings = embeddings
        if pooling not in POOLING_TYPES:
            raise ValueError(f"pooling {pooling!r} is not a pooling type; use one of {', '.join(POOLING_TYPES)}")
        params.pooling_type = POOLING_TYPES[pooling]
        params.no_perf = True
        if ctx_other is not None:
            params.ctx_other = ctx_other.ptr
        if mtp:
            if not getattr(model, "load_mtp", False) or model.n_layer_nextn == 0:
                raise IncompatibleModelsError(f"an MTP context needs a model with a nextn block loaded with "
                                              f"load_mtp=True ({model.path.name})")
            params.ctx_type = lib.LLAMA_CONTEXT_TYPE_MTP
        if n_rs_seq > 0 and model.is_recurrent and params.n_ubatch <= n_rs_seq + 1:
            # llama.cpp aborts (split_equal: n_ubatch > n_keep_tail) instead of refusing.
            raise ValueError(f"a recurrent {role} model with n_rs_seq={n_rs_seq} needs n_ubatch > {n_rs_seq + 1}, "
                             f"got {params.n_ubatch}")
        model.check_remote()
        ptr = lib.llama_init_from_model(model.ptr, params)
        if ptr == ffi.NULL:
            raise_carried()
            model.check_remote()
            raise NativeCallError("llama_init_from_model", None,
                                  f"could not create the {role} context (n_ctx={n_ctx}, n_batch={n_batch}, "
                                  f"n_ubatch={n_ubatch}); see the 'pyllama_spec.native' log")
        self._ptr = ptr
        # Ctrl-C stops a long decode between graph nodes (the flag is set by the shim's SIGINT hook).
        lib.llama_set_abort_callback(ptr, lib.pyllama_abort_requested, ffi.NULL)
        model._contexts.add(self)
        if ctx_other is not None:
            ctx_other._borrowers.add(self)
        self.memory = Memory(self)
        raise_carried()

    def _free(self, ptr) -> None:
        for borrower in list(self._borrowers):  # a draft must not outlive the target it reads from
            borrower.close()
        if self._token_batch is not None:
            self._token_batch.close()
        lib.llama_free(ptr)

    @property
    def n_ctx(self) -> int:
        return lib.llama_n_ctx(self.ptr)

    @property
    def n_ctx_seq(self) -> int:
        """Cache rows one sequence may use: n_ctx / n_seq_max (each sequence has its own share)."""
        return lib.llama_n_ctx_seq(self.ptr)

    @property
    def n_seq_max(self) -> int:
        return lib.llama_n_seq_max(self.ptr)

    @property
    def n_batch(self) -> int:
        return lib.llama_n_batch(self.ptr)

    @property
    def n_ubatch(self) -> int:
        return lib.llama_n_ubatch(self.ptr)

    def set_causal_attn(self, causal: bool) -> None:
        lib.llama_set_causal_attn(self.ptr, causal)

    @property
    def causal_attn(self) -> bool:
        """Whether a row attends to the rows before it only (a decoder), not to every row (an encoder)."""
        return bool(lib.llama_get_causal_attn(self.ptr))

    @property
    def has_memory(self) -> bool:
        """Whether the context keeps a memory (a KV cache or recurrent state): an encoder-only
        model (BERT) has none, and must take each sequence whole, in one ubatch."""
        return lib.llama_get_memory(self.ptr) != ffi.NULL

    # --- embeddings (llama-server's --embeddings)
    @property
    def pooling(self) -> str:
        """How the context pools a sequence's output rows ("none", "mean", "cls", "last", "rank";
        made with ``pooling=``, or what the model declares)."""
        return _POOLING_OF.get(lib.llama_pooling_type(self.ptr), "unknown")

    def set_embeddings(self, on: bool) -> None:
        """Decodes from now on give output embeddings (pooled by sequence unless pooling is "none")
        rather than logits."""
        lib.llama_set_embeddings(self.ptr, on)
        self.last_decode_rows = 0

    def output_embeddings(self, n_outputs: int) -> np.ndarray:
        """The output embeddings of the first n_outputs output rows of the last decode (pooling
        "none"), float32 [n_outputs, n_embd_out], a copy."""
        self._check_rows(n_outputs)
        ptr = lib.llama_get_embeddings(self.ptr)
        raise_carried()
        if ptr == ffi.NULL:
            raise NativeCallError("llama_get_embeddings", None, f"{self.role} context has no output embeddings")
        n = self.model.n_embd_out
        return np.frombuffer(ffi.buffer(ptr, n_outputs * n * 4), dtype=np.float32).reshape(n_outputs, n).copy()

    def embeddings_of_row(self, i: int) -> np.ndarray:
        """The output embedding of output row ``i`` of the last decode (pooling "none"), float32
        [n_embd_out], a copy."""
        ptr = lib.llama_get_embeddings_ith(self.ptr, i)
        raise_carried()
        if ptr == ffi.NULL:
            raise NativeCallError("llama_get_embeddings_ith", None, f"{self.role} context has no embedding for row {i}")
        return np.frombuffer(ffi.buffer(ptr, self.model.n_embd_out * 4), dtype=np.float32).copy()

    def embeddings_of_sequence(self, seq_id: int) -> np.ndarray:
        """The pooled embedding of sequence ``seq_id`` in the last decode, float32 [n_embd_out]
        (pooling "rank": [n_cls_out], the classifier's scores), a copy."""
        ptr = lib.llama_get_embeddings_seq(self.ptr, seq_id)
        raise_carried()
        if ptr == ffi.NULL:
            raise NativeCallError("llama_get_embeddings_seq", None,
                                  f"{self.role} context has no pooled embedding for sequence {seq_id}")
        n = max(1, self.model.n_cls_out) if self.pooling == "rank" else self.model.n_embd_out
        return np.frombuffer(ffi.buffer(ptr, n * 4), dtype=np.float32).copy()

    # --- LoRA adapters
    def set_lora(self, adapters: Sequence["LoraAdapter"], scales: Sequence[float]) -> None:
        """Apply these adapters at these scales to every decode from now on (a scale of 0: not
        applied; no adapters: the model alone). Each must be loaded against this context's model.
        Setting the set already in use costs nothing (llama.cpp compares them)."""
        from pyllama_spec.bindings.lora import check_scales

        adapters, scales = list(adapters), check_scales(scales)
        if len(adapters) != len(scales):
            raise ValueError(f"{len(adapters)} LoRA adapters but {len(scales)} scales")
        for a in adapters:
            if a.model is not self.model:
                raise ValueError(f"the LoRA adapter {a.path} was loaded against another model than this "
                                 f"{self.role} context's ({self.model.path.name})")
        ptrs = ffi.new("struct llama_adapter_lora *[]", [a.ptr for a in adapters] or 1)
        rc = lib.llama_set_adapters_lora(self.ptr, ptrs, len(adapters), ffi.new("float[]", scales or 1))
        check_set_lora(rc, role=self.role, n_adapters=len(adapters))
        for a, _ in self._lora:
            a.contexts.discard(self)
        self._lora = tuple(zip(adapters, scales))
        for a in adapters:
            a.contexts.add(self)

    @property
    def lora(self) -> tuple[tuple["LoraAdapter", float], ...]:
        """The (adapter, scale) pairs the last set_lora applied."""
        return self._lora

    def drop_lora(self, adapter: "LoraAdapter") -> None:
        """Stop using ``adapter`` (it is about to be freed); the others keep their scales."""
        kept = [(a, s) for a, s in self._lora if a is not adapter]
        self.set_lora([a for a, _ in kept], [s for _, s in kept])

    # --- processing
    def decode(self, batch: "Batch") -> None:
        """Decode a batch into this context; raises DecodeError naming this context."""
        forget_native_problems()
        self.last_decode_rows = 0
        self.model.check_remote()  # a lost server: no native call on its layers
        arm_interrupts()
        rc = lib.llama_process(self.ptr, lib.LLAMA_PROCESS_TYPE_DECODE, batch.ptr)
        raise_carried()
        self.model.check_remote()  # lost during this decode: its outputs are zeros, or rc says "failed"
        ctrl_c = rc == 2 and interrupted_during_call()
        check_decode(rc, "llama_process(DECODE)", role=self.role, n_rows=batch.n_rows, offset=batch.first_pos,
                     detail="interrupted (Ctrl-C)" if ctrl_c else "")
        self.last_decode_rows = batch.n_rows

    def encode(self, batch: "Batch") -> None:
        """Run the model's encoder graph over a batch (an EAGLE3 draft's feature fusion: every row
        is an output, read with ``draft_embeddings``); the batch must fit in one ubatch.
        Raises DecodeError naming this context."""
        forget_native_problems()
        self.last_decode_rows = 0
        self.model.check_remote()
        if batch.n_rows > self.n_ubatch:  # llama.cpp asserts (aborts) instead of refusing
            raise ValueError(f"the {self.role} context encodes at most n_ubatch={self.n_ubatch} rows at once, "
                             f"got {batch.n_rows}")
        arm_interrupts()
        rc = lib.llama_process(self.ptr, lib.LLAMA_PROCESS_TYPE_ENCODE, batch.ptr)
        raise_carried()
        self.model.check_remote()
        ctrl_c = rc == 2 and interrupted_during_call()
        check_decode(rc, "llama_process(ENCODE)", role=self.role, n_rows=batch.n_rows, offset=batch.first_pos,
                     detail="interrupted (Ctrl-C)" if ctrl_c else "")
        self.last_decode_rows = batch.n_rows

    def draft_chain(self, batch: "Batch", seq_ids: Sequence[int], next_pos: Sequence[int], n_max: Sequence[int], *,
                    p_min: float = 0.0, top_k: int = 10, feed_states: bool = False,
                    keep_logits: bool = True) -> list[tuple[list[int], np.ndarray | None]]:
        """A drafter's chain of one-token decodes in one native call (``pyllama_draft_chain``):
        ``batch`` holds the first decode's rows, one output row per sequence of ``seq_ids`` in that
        order; each step takes every row's most likely token (ending that sequence's draft before a
        token whose probability among the ``top_k`` most likely is under ``p_min``, and after
        ``n_max[i]`` tokens) and decodes it at the sequence's next position, ``next_pos[i]`` for the
        first, with the row's output embedding as its state where ``feed_states`` (EAGLE3, MTP).

        Returns each sequence's drafted tokens and their logits rows (float32 [n, n_vocab], or None
        without ``keep_logits``). Once the chain has started the batch is cleared, whatever happens.
        Raises ValueError (before any decode, the batch left as given) for a batch or arguments that
        do not fit together, DecodeError naming this context (a Ctrl-C in any of the decodes stops
        the chain there)."""
        n_seq = len(seq_ids)
        if not len(next_pos) == len(n_max) == n_seq:
            raise ValueError(f"draft_chain takes one position and one length per sequence: {n_seq} sequences, "
                             f"{len(next_pos)} positions, {len(n_max)} lengths")
        if any(n < 1 for n in n_max):
            raise ValueError(f"every sequence's draft length must be at least 1, got {list(n_max)}")
        if batch.n_outputs != n_seq:
            raise ValueError(f"the batch must hold one output row per sequence ({n_seq}), it holds {batch.n_outputs}")
        if feed_states and not (self._draft_embeddings and self._draft_embeddings_masked):
            raise ValueError(f"feed_states reads the output rows' embeddings: turn them on for output rows only "
                             f"(enable_draft_embeddings(True, masked=True)) on the {self.role} context")
        max_n = max(n_max, default=0)
        if n_seq == 0:
            batch.clear()
            return []
        ids = np.ascontiguousarray(seq_ids, dtype=np.int32)
        first = np.ascontiguousarray(next_pos, dtype=np.int32)
        limits = np.ascontiguousarray(n_max, dtype=np.int32)
        n_vocab = self._n_vocab_out
        tokens = np.empty((n_seq, max_n), dtype=np.int32)
        logits = np.empty((n_seq, max_n, n_vocab), dtype=np.float32) if keep_logits else None
        drafted = np.zeros(n_seq, dtype=np.int32)
        last_rows = ffi.new("int32_t *")
        forget_native_problems()
        self.last_decode_rows = 0
        self.model.check_remote()
        arm_interrupts()
        n_rows, offset = batch.n_rows, batch.first_pos
        try:
            rc = lib.pyllama_draft_chain(
                self.ptr, batch.ptr, n_seq, ffi.from_buffer("int32_t[]", ids), ffi.from_buffer("int32_t[]", first),
                ffi.from_buffer("int32_t[]", limits), max_n, p_min, top_k, feed_states, n_vocab, self.model.n_embd,
                ffi.from_buffer("int32_t[]", tokens),
                ffi.NULL if logits is None else ffi.from_buffer("float[]", logits),
                ffi.from_buffer("int32_t[]", drafted), last_rows)
        finally:
            batch.clear()  # the native chain cleared it on every return; again here, cheaply, in case it never ran
        raise_carried()
        self.model.check_remote()
        if rc != 0:
            ctrl_c = rc == 2 and interrupted_during_call()
            check_decode(rc, "pyllama_draft_chain", role=self.role, n_rows=n_rows, offset=offset,
                         detail="interrupted (Ctrl-C)" if ctrl_c else
                         "no logits or output embeddings after a decode" if rc == -100 else
                         "a drafted row was refused by the batch" if rc < -200 else "")
        self.last_decode_rows = int(last_rows[0])
        return [(tokens[i, :drafted[i]].tolist(), None if logits is None else logits[i, :drafted[i]])
                for i in range(n_seq)]

    def _check_rows(self, n_rows: int) -> None:
        """Output buffers hold the rows of the last decode only; reading more would be stale or abort."""
        if not 0 < n_rows <= self.last_decode_rows:
            raise ValueError(f"the {self.role} context's last decode produced {self.last_decode_rows} rows; "
                             f"cannot read {n_rows}")

    def decode_tokens(self, tokens: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray,
                      *, outputs: Sequence[bool] | np.ndarray | bool = False, seq_id: int = 0) -> None:
        """Decode token rows at explicit positions (one batch, no row loop in Python)."""
        batch = self.shared_token_batch()
        batch.clear()
        batch.add_tokens(tokens, positions, outputs=outputs, seq_id=seq_id)
        self.decode(batch)

    def shared_token_batch(self) -> "Batch":
        """The context's reusable batch for token rows (made once: every speculative step fills it)."""
        if self._token_batch is None:
            from pyllama_spec.bindings.batch import Batch

            self._token_batch = Batch(self)
        return self._token_batch

    def logits(self, i: int = -1) -> np.ndarray:
        """Logits of output row i (negative counts from the last output), float32 [n_vocab]."""
        ptr = lib.llama_get_logits_ith(self.ptr, i)
        if ptr == ffi.NULL:
            raise NativeCallError("llama_get_logits_ith", None, f"{self.role} context has no logits for row {i}")
        return np.frombuffer(ffi.buffer(ptr, self._n_vocab_out * 4), dtype=np.float32).copy()

    def output_logits(self, n_outputs: int) -> np.ndarray:
        """Logits of the first n_outputs output rows of the last decode, float32 [n_outputs, n_vocab].

        A view into native memory, valid until the next decode on this context.
        """
        self._check_rows(n_outputs)
        ptr = lib.llama_get_logits(self.ptr)
        if ptr == ffi.NULL:
            raise NativeCallError("llama_get_logits", None, f"{self.role} context has no logits")
        n = self._n_vocab_out
        return np.frombuffer(ffi.buffer(ptr, n_outputs * n * 4), dtype=np.float32).reshape(n_outputs, n)

    @property
    def _n_vocab_out(self) -> int:
        """Width of a logits row: a draft borrows its output head (and vocabulary) from ctx_other."""
        return (self._other or self).model.n_vocab

    # --- DFlash: the target's layer inputs, the draft's output embeddings
    def enable_layer_inputs(self, layer_ids: Iterable[int], enable: bool = True) -> None:
        """Record the inputs of these layers on every decode (a DFlash target's features)."""
        for lid in layer_ids:
            if not 0 <= lid < self.model.n_layer:
                raise IncompatibleModelsError(
                    f"layer {lid} does not exist in the {self.role} model ({self.model.n_layer} layers)")
            lib.pyllama_set_embeddings_layer_inp(self.ptr, lid, enable)
            self._layer_inputs = self._layer_inputs | {lid} if enable else self._layer_inputs - {lid}
        self.last_decode_rows = 0  # nothing recorded for these layers until the next decode

    @property
    def recorded_layers(self) -> frozenset[int]:
        """The layers whose inputs every decode records (``enable_layer_inputs``)."""
        return self._layer_inputs

    def layer_input(self, lid: int, n_rows: int) -> np.ndarray:
        """Input of layer ``lid`` for the first n_rows rows of the last decode: float32 [n_rows, n_embd].

        A view into native memory, valid until the next decode on this context.
        """
        if lid not in self._layer_inputs:
            raise ValueError(f"layer {lid} inputs are not recorded on the {self.role} context; "
                             "call enable_layer_inputs first")
        self._check_rows(n_rows)
        ptr = lib.pyllama_get_embeddings_layer_inp(self.ptr, lid)
        n_embd = self.model.n_embd
        return np.frombuffer(ffi.buffer(ptr, n_rows * n_embd * 4), dtype=np.float32).reshape(n_rows, n_embd)

    def enable_draft_embeddings(self, enable: bool = True, masked: bool = True) -> None:
        """Keep a DFlash draft's output embeddings of every decode (``masked``: only of the rows
        the batch asks outputs for; DFlash2 reads its selector lattice from every row). llama.cpp
        names them the "nextn" embeddings."""
        lib.pyllama_set_embeddings_nextn(self.ptr, enable, masked)
        self._draft_embeddings = enable
        self._draft_embeddings_masked = masked

    @property
    def records_draft_embeddings(self) -> bool:
        """Whether every decode keeps the output embeddings (``enable_draft_embeddings``)."""
        return self._draft_embeddings

    def draft_embeddings(self, n_rows: int) -> np.ndarray:
        """A DFlash draft's output embeddings of the first n_rows rows of the last decode,
        float32 [n_rows, n_embd] (a view)."""
        if not self._draft_embeddings:
            raise ValueError(f"draft embeddings are off on the {self.role} context")
        self._check_rows(n_rows)
        ptr = lib.pyllama_get_embeddings_nextn(self.ptr)
        if ptr == ffi.NULL:
            raise NativeCallError("llama_get_embeddings_nextn", None, f"{self.role} context has none")
        n = self.model.n_embd
        return np.frombuffer(ffi.buffer(ptr, n_rows * n * 4), dtype=np.float32).reshape(n_rows, n)


class Memory:
    """The memory (KV cache / recurrent state) of one Context, by sequence and position."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx

    def _mem(self):
        return lib.llama_get_memory(self._ctx.ptr)

    def clear(self, data: bool = True) -> None:
        lib.llama_memory_clear(self._mem(), data)

    def remove(self, seq_id: int = 0, p0: int = -1, p1: int = -1) -> None:
        """Remove positions [p0, p1) of a sequence (-1: open end). Raises if it cannot be done."""
        if not lib.llama_memory_seq_rm(self._mem(), seq_id, p0, p1):
            raise KVMemoryError("llama_memory_seq_rm", None,
                                f"{self._ctx.role} context cannot remove positions [{p0}, {p1}) of sequence "
                                f"{seq_id} (a recurrent model needs n_rs_seq > 0 to roll back)")

    def copy(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Let sequence ``dst`` also hold the cells of ``src`` at positions [p0, p1) (-1: open end).

        In a unified cache this shares the cells (no data is copied)."""
        lib.llama_memory_seq_cp(self._mem(), src, dst, p0, p1)

    def pos_min(self, seq_id: int = 0) -> int:
        """Smallest position held for the sequence, -1 when empty."""
        return lib.llama_memory_seq_pos_min(self._mem(), seq_id)

    def pos_max(self, seq_id: int = 0) -> int:
        """Largest position held for the sequence, -1 when empty."""
        return lib.llama_memory_seq_pos_max(self._mem(), seq_id)

    def seq_size(self, seq_id: int) -> int:
        """The bytes ``save_seq`` would take for the sequence (llama_state_seq_get_size)."""
        forget_native_problems()
        size = lib.llama_state_seq_get_size(self._ctx.ptr, seq_id)
        check_state(size, "llama_state_seq_get_size", role=self._ctx.role, seq_id=seq_id, size=0)
        return size

    def save_seq(self, seq_id: int) -> bytes:
        """What the memory holds for one sequence (its KV cells with their positions, or its
        recurrent state), as llama.cpp serializes it (llama_state_seq_get_data): ``load_seq``
        puts it back into a context of the same model and cache layout."""
        forget_native_problems()
        ctx = self._ctx.ptr
        size = lib.llama_state_seq_get_size(ctx, seq_id)
        check_state(size, "llama_state_seq_get_size", role=self._ctx.role, seq_id=seq_id, size=0)
        buf = bytearray(size)
        n = lib.llama_state_seq_get_data(ctx, ffi.from_buffer("uint8_t[]", buf), size, seq_id)
        check_state(n, "llama_state_seq_get_data", role=self._ctx.role, seq_id=seq_id, size=size)
        return bytes(memoryview(buf)[:n])

    def load_seq(self, seq_id: int, data: bytes) -> int:
        """Replace what the memory holds for ``seq_id`` with ``data`` from ``save_seq``; the bytes
        read. On failure (KVMemoryError) llama.cpp has emptied the sequence."""
        forget_native_problems()
        n = lib.llama_state_seq_set_data(self._ctx.ptr, ffi.from_buffer("uint8_t[]", data), len(data), seq_id)
        check_state(n, "llama_state_seq_set_data", role=self._ctx.role, seq_id=seq_id, size=len(data))
        return n
