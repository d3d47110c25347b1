"""Pythonic wrappers over libllama: Model, Context, Memory, Sampler.

Each native handle is owned by exactly one object, freed by ``close()`` (also on
``with`` exit, and by a guarded finalizer as a last resort). A model closes the
contexts made from it before it frees itself. Return codes become exceptions from
``pyllama_spec.errors``; bulk data comes out as numpy arrays.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

from pyllama_spec._native import (
    arm_interrupts,
    ffi,
    interrupted_during_call,
    lib,
    raise_carried,
)
from pyllama_spec.bindings.devices import check_connections
from pyllama_spec.bindings.handle import NativeHandle
from pyllama_spec.errors import (
    IncompatibleModelsError,
    KVMemoryError,
    ModelFileError,
    NativeCallError,
    check_decode,
    forget_native_problems,
    with_native_log,
)
from pyllama_spec.gguf.check import validate_gguf
from pyllama_spec.gguf.memory import KV_CACHE_TYPE_FACTS, KV_CACHE_TYPE_NAMES
from pyllama_spec.gguf.reader import GGUF_MAGIC

if TYPE_CHECKING:
    from pyllama_spec.bindings.batch import Batch
    from pyllama_spec.bindings.devices import Placement

#: The ggml type of each KV cache type, by llama.cpp's -ctk / -ctv names. The names and their
#: facts (bytes, block, quantized) are gguf.memory's KV_CACHE_TYPE_NAMES / KV_CACHE_TYPE_FACTS.
KV_CACHE_TYPES = {"f32": lib.GGML_TYPE_F32, "f16": lib.GGML_TYPE_F16, "bf16": lib.GGML_TYPE_BF16,
                  "q8_0": lib.GGML_TYPE_Q8_0, "q4_0": lib.GGML_TYPE_Q4_0, "q4_1": lib.GGML_TYPE_Q4_1,
                  "iq4_nl": lib.GGML_TYPE_IQ4_NL, "q5_0": lib.GGML_TYPE_Q5_0, "q5_1": lib.GGML_TYPE_Q5_1}
assert tuple(KV_CACHE_TYPES) == KV_CACHE_TYPE_NAMES, "KV_CACHE_TYPES must map exactly gguf.memory's names"
_MROPE_TYPES = {lib.LLAMA_ROPE_TYPE_MROPE, lib.LLAMA_ROPE_TYPE_IMROPE}


def check_gguf_file(path: str | os.PathLike, what: str) -> Path:
    """Refuse, before any native call, a path that is missing, not a GGUF file, or corrupt
    in a way llama.cpp would abort on (``gguf_check.validate_gguf``)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelFileError(f"{what} file not found: {p}")
    if not p.is_file():
        raise ModelFileError(f"{what} path is not a file: {p}")
    try:
        with open(p, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise ModelFileError(f"{what} file cannot be read: {p}: {e}") from e
    if head[:4] != GGUF_MAGIC:
        raise ModelFileError(f"{what} file is not a GGUF model (no GGUF magic, found {head[:4]!r}): {p}")
    if len(head) < 8:
        raise ModelFileError(f"{what} file is truncated: {p}")
    validate_gguf(p, what)
    return p


def _read_str(fn, *args, size: int = 256) -> str | None:
    """Call a native function that writes a string into a buffer, growing it if needed."""
    buf = ffi.new("char[]", size)
    n = fn(*args, buf, size)
    if n < 0:
        return None
    if n >= size:
        buf = ffi.new("char[]", n + 1)
        fn(*args, buf, n + 1)
    return ffi.string(buf).decode("utf-8", errors="replace")


class Model(NativeHandle):
    """A GGUF model loaded by libllama (weights, vocabulary, metadata).

    >>> with Model("target.gguf") as m:          # doctest: +SKIP
    ...     print(m.arch, m.n_embd, m.tokenize("hello"))
    """

    _what = "model"

    def __init__(self, path: str | os.PathLike, *, n_gpu_layers: int = 0, main_gpu: int = 0,
                 vocab_only: bool = False, use_mmap: bool = True, use_mlock: bool = False,
                 role: str = "target", placement: "Placement | None" = None) -> None:
        self.path = check_gguf_file(path, f"{role} model")
        self.role = role
        self._contexts: weakref.WeakSet[Context] = weakref.WeakSet()
        self.dependents: weakref.WeakSet = weakref.WeakSet()  # other handles bound to this model (projectors)
        #: RPC servers ("host:port") that hold some of this model's layers (see devices.py).
        self.endpoints: tuple[str, ...] = ()
        self._placement = None
        params = lib.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.main_gpu = main_gpu
        params.vocab_only = vocab_only
        keep_alive = placement.apply(params) if placement is not None else []  # devices, split, overrides
        if use_mlock and not lib.llama_supports_mlock():
            raise ValueError("--mlock is not supported on this system")
        if use_mlock or not use_mmap:  # llama.cpp's --mlock / --no-mmap
            params.load_mode = {(True, True): lib.LLAMA_LOAD_MODE_MMAP_MLOCK, (False, True): lib.LLAMA_LOAD_MODE_MLOCK,
                                (False, False): lib.LLAMA_LOAD_MODE_NONE}[(use_mmap, use_mlock)]
        forget_native_problems()
        ptr = lib.llama_model_load_from_file(str(self.path).encode(), params)
        del keep_alive
        try:
            raise_carried()  # Ctrl-C during a load lands in the log callback
            if placement is not None:
                check_connections(placement.endpoints)  # a server lost during the load: say which
        except BaseException:
            if ptr != ffi.NULL:
                lib.llama_model_free(ptr)
            raise
        if ptr == ffi.NULL:
            raise ModelFileError(with_native_log(
                f"llama_model_load_from_file could not load the {role} model {self.path} "
                "(corrupt or truncated GGUF, or an architecture this build does not know)"))
        self._ptr = ptr
        self._vocab = lib.llama_model_get_vocab(ptr)
        self._max_token_bytes: int | None = None
        if placement is not None:
            placement.acquire()
            self._placement = placement
            self.endpoints = placement.endpoints

    def _free(self, ptr) -> None:
        for dependent in [*self.dependents, *self._contexts]:
            dependent.close()
        lib.llama_model_free(ptr)
        if self._placement is not None:
            self._placement.release()

    def check_remote(self) -> None:
        """Raise RemoteDeviceError when the connection to a server holding this model's layers was lost."""
        if self.endpoints:
            check_connections(self.endpoints)

    # --- facts
    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as a string, or None when the key is absent."""
        return _read_str(lib.llama_model_meta_val_str, self.ptr, key.encode())

    @property
    def arch(self) -> str:
        return self.meta("general.architecture") or "unknown"

    @property
    def n_embd(self) -> int:
        return lib.llama_model_n_embd(self.ptr)

    @property
    def n_embd_inp(self) -> int:
        return lib.llama_model_n_embd_inp(self.ptr)

    def head_dims(self) -> tuple[int | None, int | None]:
        """Key and value head widths from the GGUF (None when the file does not say)."""
        def key(name):
            v = self.meta(f"{self.arch}.attention.{name}")
            return int(v) if v and v.isdigit() else None

        n_head = key("head_count")
        default = self.n_embd // n_head if n_head else None
        return key("key_length") or default, key("value_length") or default

    @property
    def n_layer(self) -> int:
        return lib.llama_model_n_layer(self.ptr)

    @property
    def n_ctx_train(self) -> int:
        return lib.llama_model_n_ctx_train(self.ptr)

    @property
    def n_swa(self) -> int:
        return lib.llama_model_n_swa(self.ptr)

    @property
    def n_params(self) -> int:
        return lib.llama_model_n_params(self.ptr)

    @property
    def size_bytes(self) -> int:
        return lib.llama_model_size(self.ptr)

    @property
    def is_mrope(self) -> bool:
        return lib.llama_model_rope_type(self.ptr) in _MROPE_TYPES

    @property
    def n_pos_per_embd(self) -> int:
        """Positions per embedding row: 4 sections for M-RoPE, else 1."""
        return 4 if self.is_mrope else 1

    @property
    def is_recurrent(self) -> bool:
        return bool(lib.llama_model_is_recurrent(self.ptr) or lib.llama_model_is_hybrid(self.ptr))

    @property
    def chat_template(self) -> str | None:
        t = lib.llama_model_chat_template(self.ptr, ffi.NULL)
        return None if t == ffi.NULL else ffi.string(t).decode("utf-8", errors="replace")

    # --- DFlash facts (what a draft records about its target)
    @property
    def target_layer_ids(self) -> list[int]:
        n = lib.pyllama_model_target_layer_ids_n(self.ptr)
        ids = lib.pyllama_model_target_layer_ids(self.ptr)
        return [] if n == 0 or ids == ffi.NULL else [int(ids[i]) for i in range(n)]

    @property
    def dflash_selector_top_k(self) -> int:
        return int(lib.pyllama_model_dflash_selector_top_k(self.ptr))

    # --- vocabulary
    @property
    def n_vocab(self) -> int:
        return lib.llama_vocab_n_tokens(self._vocab_ptr())

    def _vocab_ptr(self):
        self.ptr  # raises when closed
        return self._vocab

    @property
    def bos(self) -> int:
        return lib.llama_vocab_bos(self._vocab_ptr())

    @property
    def eos(self) -> int:
        return lib.llama_vocab_eos(self._vocab_ptr())

    @property
    def mask_token(self) -> int:
        """The vocabulary's mask token (a DFlash draft needs one), or -1."""
        return lib.llama_vocab_mask(self._vocab_ptr())

    @property
    def add_bos(self) -> bool:
        return bool(lib.llama_vocab_get_add_bos(self._vocab_ptr()))

    def is_eog(self, token: int) -> bool:
        return bool(lib.llama_vocab_is_eog(self._vocab_ptr(), token))

    def token_text(self, token: int) -> str:
        return ffi.string(lib.llama_vocab_get_text(self._vocab_ptr(), token)).decode("utf-8", errors="replace")

    @property
    def max_token_bytes(self) -> int:
        """The most bytes of text any one token stands for (special tokens by their text); read
        once, on first use (one native call per vocabulary entry: about 0.3 s for 150k tokens)."""
        if self._max_token_bytes is None:
            self._max_token_bytes = max((len(self.token_to_bytes(t, special=True)) for t in range(self.n_vocab)),
                                        default=1) or 1
        return self._max_token_bytes

    def tokens_at_least(self, n_bytes: int) -> int:
        """A lower bound on the tokens of any text of ``n_bytes`` UTF-8 bytes, known without
        tokenizing it: a token covers at most ``max_token_bytes``. Only for the tokenizers that
        never shrink the text before splitting it (BPE, SentencePiece); 0 for the others (Unigram
        and WordPiece normalise: collapsed whitespace, compatibility forms)."""
        if self.meta("tokenizer.ggml.model") not in ("gpt2", "llama"):
            return 0
        return n_bytes // self.max_token_bytes

    def apply_chat_template(self, messages: Sequence[tuple[str, str]], *, add_assistant: bool = True) -> str:
        """(role, text) messages through this model's chat template (llama.cpp's built-in renderer)."""
        template = self.chat_template
        if template is None:
            raise ValueError(f"the model {self.path.name} has no chat template: pass prompt= instead of messages=")
        keep = [(ffi.new("char[]", r.encode()), ffi.new("char[]", c.encode())) for r, c in messages]
        chat = ffi.new("llama_chat_message[]", len(keep))
        for i, (r, c) in enumerate(keep):
            chat[i].role, chat[i].content = r, c
        tmpl = ffi.new("char[]", template.encode())
        size = 1024 + 2 * sum(len(c) for _, c in messages)
        for _ in range(2):
            buf = ffi.new("char[]", size)
            n = lib.llama_chat_apply_template(tmpl, chat, len(keep), add_assistant, buf, size)
            if n < 0:
                raise ValueError(f"llama.cpp does not support the chat template of {self.path.name}; "
                                 "format the prompt yourself and pass prompt=")
            if n < size:
                return ffi.buffer(buf, n)[:].decode("utf-8")
            size = n + 1
        raise AssertionError("unreachable")

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = True) -> np.ndarray:
        """Text to token ids (int32 array)."""
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = ffi.new("llama_token[]", cap)
        n = lib.llama_tokenize(self._vocab_ptr(), data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = ffi.new("llama_token[]", cap)
            n = lib.llama_tokenize(self._vocab_ptr(), data, len(data), buf, cap, add_special, parse_special)
            if n < 0:
                raise NativeCallError("llama_tokenize", n)
        return np.frombuffer(ffi.buffer(buf, n * 4), dtype=np.int32).copy()

    def token_to_bytes(self, token: int, *, special: bool = False) -> bytes:
        """The bytes of one token's piece (may be part of a UTF-8 character)."""
        buf = ffi.new("char[]", 64)
        n = lib.llama_token_to_piece(self._vocab_ptr(), token, buf, 64, 0, special)
        if n < 0:
            buf = ffi.new("char[]", -n)
            n = lib.llama_token_to_piece(self._vocab_ptr(), token, buf, -n, 0, special)
        return ffi.buffer(buf, max(n, 0))[:]

    def detokenize(self, tokens: Sequence[int] | np.ndarray, *, special: bool = False) -> str:
        arr = np.ascontiguousarray(tokens, dtype=np.int32)
        cap = max(64, len(arr) * 8)
        for _ in range(2):
            buf = ffi.new("char[]", cap)
            n = lib.llama_detokenize(self._vocab_ptr(), ffi.from_buffer("llama_token[]", arr), len(arr), buf, cap,
                                     False, special)
            if n >= 0:
                return ffi.buffer(buf, n)[:].decode("utf-8", errors="replace")
            cap = -n
        raise NativeCallError("llama_detokenize", n)


class Context(NativeHandle):
    """An inference context (KV cache, compute buffers) on a Model.

    ``role`` ("target" or "draft") is named in every error. ``ctx_other`` lets a
    DFlash draft borrow the target's token embeddings and output head.
    """

    _what = "context"

    def __init__(self, model: Model, *, n_ctx: int = 4096, n_batch: int = 512, n_ubatch: int = 512,
                 n_seq_max: int = 1, n_rs_seq: int = 0, n_threads: int | None = None,
                 n_threads_batch: int | None = None, type_k: str = "f16", type_v: str = "f16",
                 flash_attn: bool | None = False, swa_full: bool = False, embeddings: bool = False,
                 kv_unified: bool = False, ctx_other: "Context | None" = None, role: str = "target") -> None:
        self.model = model
        self.role = role
        self._other = ctx_other  # keeps the borrowed context alive as long as this one
        self._borrowers: weakref.WeakSet[Context] = weakref.WeakSet()  # contexts whose ctx_other is this one
        self._token_batch: Batch | None = None
        self._layer_inputs: set[int] = set()
        self._draft_embeddings = False
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
        params.embeddings = embeddings
        params.no_perf = True
        if ctx_other is not None:
            params.ctx_other = ctx_other.ptr
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
            (self._layer_inputs.add if enable else self._layer_inputs.discard)(lid)
        self.last_decode_rows = 0  # nothing recorded for these layers until the next decode

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


class Sampler(NativeHandle):
    """A llama.cpp sampler chain: penalties -> top-k -> top-p -> min-p -> temperature -> dist, or greedy."""

    _what = "sampler"

    def __init__(self, model: Model, *, temperature: float = 0.0, top_k: int = 40, top_p: float = 0.95,
                 min_p: float = 0.05, presence_penalty: float = 0.0, repeat_penalty: float = 1.0,
                 frequency_penalty: float = 0.0, penalty_last_n: int = 64, seed: int = 0) -> None:
        self.temperature = temperature
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        self._ptr = chain
        if presence_penalty or frequency_penalty or repeat_penalty != 1.0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_penalties(
                model.n_vocab, penalty_last_n, repeat_penalty, frequency_penalty, presence_penalty))
        if temperature <= 0.0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
            return
        if top_k > 0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(top_k))
        if top_p < 1.0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(top_p, 1))
        if min_p > 0.0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_min_p(min_p, 1))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(temperature))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(seed & 0xFFFFFFFF))

    def _free(self, ptr) -> None:
        lib.llama_sampler_free(ptr)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def sample(self, ctx: Context, i: int = -1) -> int:
        """Sample from output row i of ctx's last decode (and accept the token)."""
        return int(lib.llama_sampler_sample(self.ptr, ctx.ptr, i))

    def accept(self, token: int) -> None:
        lib.llama_sampler_accept(self.ptr, token)

    def reset(self) -> None:
        lib.llama_sampler_reset(self.ptr)

