"""The model: a GGUF file checked before any native call, then loaded by libllama
(weights, vocabulary, metadata, chat template, tokenizer).

The handle is owned by one ``Model``, freed by ``close()`` (also on ``with`` exit, and by a
guarded finalizer as a last resort); it closes the contexts made from it before it frees itself.
"""

from __future__ import annotations

import functools
import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from pyllama_spec._native import ffi, lib, raise_carried
from pyllama_spec.bindings.devices import check_connections
from pyllama_spec.bindings.handle import NativeHandle
from pyllama_spec.errors import ModelFileError, NativeCallError, forget_native_problems, with_native_log
from pyllama_spec.gguf.check import validate_gguf
from pyllama_spec.gguf.reader import GGUF_MAGIC

if TYPE_CHECKING:
    from pyllama_spec.bindings.devices import Placement

#: Token pieces a model keeps once read (each streamed token asks for one): the first this many.
PIECES_KEPT = 1 << 16
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
                 role: str = "target", placement: "Placement | None" = None, load_mtp: bool = False) -> None:
        self.path = check_gguf_file(path, f"{role} model")
        self.role = role
        self._contexts: weakref.WeakSet[NativeHandle] = weakref.WeakSet()  # the contexts made from it
        self.dependents: weakref.WeakSet = weakref.WeakSet()  # other handles bound to this model (projectors)
        #: RPC servers ("host:port") that hold some of this model's layers (see devices.py).
        self.endpoints: tuple[str, ...] = ()
        self._placement = None
        params = lib.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.main_gpu = main_gpu
        params.vocab_only = vocab_only
        # the multi-token-prediction (nextn) block's weights: skipped unless an MTP context will run them
        params.load_mtp = load_mtp
        self.load_mtp = load_mtp
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
        # (token, special) -> its piece: a model's pieces never change, and every streamed token
        # asks for one (the first PIECES_KEPT asked for are kept)
        self._pieces: dict[tuple[int, bool], bytes] = {}
        if placement is not None:
            placement.acquire()
            self._placement = placement
            self.endpoints = placement.endpoints

    def _free(self, ptr) -> None:
        for dependent in [*self.dependents, *self._contexts]:
            dependent.close()
        lib.llama_model_free(ptr)
        self._pieces.clear()
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
    def n_embd_out(self) -> int:
        """Width of an output embedding (llama-server's /embeddings vectors)."""
        return lib.llama_model_n_embd_out(self.ptr)

    @property
    def n_cls_out(self) -> int:
        """Outputs of a classifier head (a reranker's scores); 0 without one."""
        return lib.llama_model_n_cls_out(self.ptr)

    @property
    def has_encoder(self) -> bool:
        return lib.llama_model_has_encoder(self.ptr)

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
    def n_layer_nextn(self) -> int:
        """Multi-token-prediction (nextn) blocks after the last layer (Qwen3.5's MTP head); 0 for none."""
        return lib.llama_model_n_layer_nextn(self.ptr)

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
        """The model keeps a recurrent state (a recurrent or a hybrid model): its memory cannot be cut
        back to any position."""
        return bool(lib.llama_model_is_recurrent(self.ptr) or lib.llama_model_is_hybrid(self.ptr))

    @property
    def is_hybrid(self) -> bool:
        """Attention and recurrent layers both (Qwen3.5, Falcon-H1, ...)."""
        return bool(lib.llama_model_is_hybrid(self.ptr))

    @property
    def chat_template(self) -> str | None:
        return self.named_template(None)

    def named_template(self, name: str | None) -> str | None:
        """The GGUF's template of that name (``tokenizer.chat_template.NAME``; None: the chat template),
        or None when it has none: a reranker's "rerank" prompt, for one."""
        t = lib.llama_model_chat_template(self.ptr, ffi.NULL if name is None else name.encode())
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
    def nl(self) -> int:
        """The newline token."""
        return lib.llama_vocab_nl(self._vocab_ptr())

    @property
    def mask_token(self) -> int:
        """The vocabulary's mask token (a DFlash draft needs one), or -1."""
        return lib.llama_vocab_mask(self._vocab_ptr())

    @functools.cached_property
    def fim_tokens(self) -> dict[str, int]:
        """The vocabulary's fill-in-the-middle tokens by role ("pre", "suf", "mid", "pad", "rep",
        "sep"), each -1 when it has none (llama.cpp reads them from tokenizer.ggml.fim_*_token_id,
        or finds them by their text)."""
        vocab = self._vocab_ptr()
        return {"pre": lib.llama_vocab_fim_pre(vocab), "suf": lib.llama_vocab_fim_suf(vocab),
                "mid": lib.llama_vocab_fim_mid(vocab), "pad": lib.llama_vocab_fim_pad(vocab),
                "rep": lib.llama_vocab_fim_rep(vocab), "sep": lib.llama_vocab_fim_sep(vocab)}

    @property
    def add_bos(self) -> bool:
        return bool(lib.llama_vocab_get_add_bos(self._vocab_ptr()))

    @property
    def add_eos(self) -> bool:
        return bool(lib.llama_vocab_get_add_eos(self._vocab_ptr()))

    @property
    def add_sep(self) -> bool:
        return bool(lib.llama_vocab_get_add_sep(self._vocab_ptr()))

    @property
    def sep(self) -> int:
        """The sentence separator token (BERT's [SEP]), or -1."""
        return lib.llama_vocab_sep(self._vocab_ptr())

    @functools.cached_property
    def eog_tokens(self) -> tuple[int, ...]:
        """Every end-of-generation token of the vocabulary (one pass, kept)."""
        vocab = self._vocab_ptr()
        return tuple(t for t in range(self.n_vocab) if lib.llama_vocab_is_eog(vocab, t))

    def is_eog(self, token: int) -> bool:
        return bool(lib.llama_vocab_is_eog(self._vocab_ptr(), token))

    def token_text(self, token: int) -> str:
        self._check_token(token)
        return ffi.string(lib.llama_vocab_get_text(self._vocab_ptr(), token)).decode("utf-8", errors="replace")

    @property
    def max_token_bytes(self) -> int:
        """The most bytes of text any one token stands for (special tokens by their text); read
        once, on first use (one native call per vocabulary entry: about 0.3 s for 150k tokens)."""
        if self._max_token_bytes is None:
            self._max_token_bytes = max((len(self._piece(t, True)) for t in range(self.n_vocab)),
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
        """The bytes of one token's piece (may be part of a UTF-8 character). ValueError for an id
        outside the vocabulary."""
        piece = self._pieces.get((token, special))
        if piece is not None:
            self.ptr  # raises when closed, as without the cache
            return piece
        piece = self._piece(token, special)
        if len(self._pieces) < PIECES_KEPT:
            self._pieces[(token, special)] = piece
        return piece

    def _piece(self, token: int, special: bool) -> bytes:
        self._check_token(token)
        buf = ffi.new("char[]", 64)
        n = lib.llama_token_to_piece(self._vocab_ptr(), token, buf, 64, 0, special)
        if n < 0:
            buf = ffi.new("char[]", -n)
            n = lib.llama_token_to_piece(self._vocab_ptr(), token, buf, -n, 0, special)
        return ffi.buffer(buf, max(n, 0))[:]

    def _check_token(self, token: int) -> None:
        if not 0 <= token < self.n_vocab:  # llama.cpp throws past its vocabulary, which ends the process
            raise ValueError(f"token {token} is not in the vocabulary of {self.path.name} ({self.n_vocab} tokens)")

    def detokenize(self, tokens: Sequence[int] | np.ndarray, *, special: bool = False) -> str:
        """Token ids to text. ValueError for an id outside the vocabulary."""
        arr = np.ascontiguousarray(tokens, dtype=np.int32)
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= self.n_vocab):
            bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
            self._check_token(bad)
        cap = max(64, len(arr) * 8)
        for _ in range(2):
            buf = ffi.new("char[]", cap)
            n = lib.llama_detokenize(self._vocab_ptr(), ffi.from_buffer("llama_token[]", arr), len(arr), buf, cap,
                                     False, special)
            if n >= 0:
                return ffi.buffer(buf, n)[:].decode("utf-8", errors="replace")
            cap = -n
        raise NativeCallError("llama_detokenize", n)
