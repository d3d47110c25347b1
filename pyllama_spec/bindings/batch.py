"""Batch: a llama_batch_ext, filled from numpy arrays in one native call per kind of row.

Rows are tokens (one position each) or embeddings (``n_pos_per_embd`` positions
each: 4 sections for M-RoPE contexts). The batch remembers its rows' section-0
positions so that errors and drafters can say where it was.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np

from pyllama_spec._native import ffi, lib
from pyllama_spec.bindings.handle import NativeHandle
from pyllama_spec.errors import NativeCallError, check_batch_add

if TYPE_CHECKING:
    from pyllama_spec.bindings.model import Model


class BatchContext(Protocol):
    """What a batch asks of the context it fills (``bindings.context.Context`` is one). Said here,
    so that batch.py needs nothing of context.py, which makes and decodes batches."""

    @property
    def ptr(self): ...

    @property
    def role(self) -> str: ...

    @property
    def model(self) -> Model: ...


def _outputs_array(outputs, n: int) -> np.ndarray | None:
    if outputs is False or outputs is None:
        return None
    if outputs is True:
        return np.ones(n, dtype=np.int8)
    arr = np.ascontiguousarray(outputs, dtype=np.int8)
    if arr.shape != (n,):
        raise ValueError(f"outputs must have {n} entries, got shape {arr.shape}")
    return arr


class Batch(NativeHandle):
    """Rows to decode into one Context (``llama_batch_ext``)."""

    _what = "batch"

    def __init__(self, ctx: BatchContext) -> None:
        self._ctx = ctx
        ptr = lib.llama_batch_ext_init(ctx.ptr)
        if ptr == ffi.NULL:
            raise NativeCallError("llama_batch_ext_init", None, f"on the {ctx.role} context")
        self._ptr = ptr
        self._pos0: list[np.ndarray] = []  # section-0 positions of the rows added, in order
        self.n_rows = 0
        self.n_outputs = 0  # rows whose logits (and output embeddings) the decode keeps
        self.has_embeddings = False

    def _free(self, ptr) -> None:
        lib.llama_batch_ext_free(ptr)

    def clear(self) -> None:
        lib.llama_batch_ext_clear(self.ptr)
        self._pos0 = []
        self.n_rows = 0
        self.n_outputs = 0
        self.has_embeddings = False

    @property
    def positions(self) -> np.ndarray:
        """Section-0 position of every row, int32 [n_rows]."""
        return np.concatenate(self._pos0) if self._pos0 else np.zeros(0, dtype=np.int32)

    @property
    def first_pos(self) -> int | None:
        return int(self._pos0[0][0]) if self._pos0 else None

    def add_tokens(self, tokens: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray, *,
                   outputs: Sequence[bool] | np.ndarray | bool = False, seq_id: int = 0) -> None:
        tok = np.ascontiguousarray(tokens, dtype=np.int32)
        pos = np.ascontiguousarray(positions, dtype=np.int32)
        n = len(tok)
        if pos.shape != (n,):
            raise ValueError(f"{n} tokens need {n} positions, got shape {pos.shape}")
        out = _outputs_array(outputs, n)
        rc = lib.pyllama_batch_ext_add_tokens(
            self.ptr, seq_id, n, ffi.from_buffer("int32_t[]", tok), ffi.from_buffer("int32_t[]", pos),
            ffi.NULL if out is None else ffi.from_buffer("int8_t[]", out))
        self._check_add(rc, n)
        self._pos0.append(pos)
        self.n_outputs += 0 if out is None else int(np.count_nonzero(out))

    def add_tokens_with_states(self, tokens: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray,
                               states: np.ndarray, *, outputs: Sequence[bool] | np.ndarray | bool = False,
                               seq_id: int = 0) -> None:
        """Token rows that each carry a state row besides their token: ``states`` float32 [n, n_embd]
        (an MTP context's rows: the target's hidden state paired with each token)."""
        st = np.ascontiguousarray(states, dtype=np.float32)
        n = len(tokens)
        if st.ndim != 2 or st.shape[0] != n:
            raise ValueError(f"{n} tokens need {n} state rows, got shape {st.shape}")
        first = self.n_rows
        self.add_tokens(tokens, positions, outputs=outputs, seq_id=seq_id)
        if not self._set_states(lib.llama_batch_ext_set_embd_token, first, st):
            self._check_add(-2, n)

    def add_tree_tokens(self, tokens: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray,
                        seq_ids: Sequence[Sequence[int]]) -> None:
        """Token rows that each belong to several sequences (``seq_ids[i]``, ascending: a row
        attends by its first), all with logits: the nodes of a draft tree (tree.py)."""
        tok = np.ascontiguousarray(tokens, dtype=np.int32)
        pos = np.ascontiguousarray(positions, dtype=np.int32)
        n = len(tok)
        if pos.shape != (n,) or len(seq_ids) != n:
            raise ValueError(f"{n} tokens need {n} positions and {n} sequence-id lists")
        one = ffi.new("llama_pos[1]")
        for i in range(n):
            ids = seq_ids[i]
            idx = lib.llama_batch_ext_add_token(self.ptr, int(ids[0]), int(tok[i]))
            if idx < 0:
                self._check_add(idx, n)
            one[0] = int(pos[i])
            ok = lib.llama_batch_ext_set_pos(self.ptr, idx, one)
            for s in ids[1:]:
                ok = ok and lib.llama_batch_ext_add_seq(self.ptr, idx, int(s))
            if not ok:
                self._check_add(-3 if len(ids) > 1 else -4, n)
            if not lib.llama_batch_ext_set_output_logits(self.ptr, idx, True):
                self._check_add(-4, n)
        self.n_rows += n
        self.n_outputs += n
        self._pos0.append(pos)

    def add_embeddings(self, embd: np.ndarray, positions: np.ndarray, *,
                       outputs: Sequence[bool] | np.ndarray | bool = False, seq_id: int = 0) -> None:
        """Embedding rows: embd float32 [n, n_embd]; positions int32 [n, n_pos] (or [n] when n_pos is 1)."""
        e = np.ascontiguousarray(embd, dtype=np.float32)
        if e.ndim != 2:
            raise ValueError(f"embeddings must be 2-D [n_rows, n_embd], got shape {e.shape}")
        n, n_embd = e.shape
        p = np.ascontiguousarray(positions, dtype=np.int32)
        if p.ndim == 1:
            p = p.reshape(n, 1) if len(p) == n else p
        if p.ndim != 2 or p.shape[0] != n:
            raise ValueError(f"{n} embedding rows need positions of shape [{n}, n_pos], got {p.shape}")
        out = _outputs_array(outputs, n)
        rc = lib.pyllama_batch_ext_add_embds(
            self.ptr, seq_id, n, ffi.from_buffer("float[]", e), n_embd, ffi.from_buffer("int32_t[]", p),
            p.shape[1], ffi.NULL if out is None else ffi.from_buffer("int8_t[]", out))
        self._check_add(rc, n)
        self._pos0.append(np.ascontiguousarray(p[:, 0]))
        self.n_outputs += 0 if out is None else int(np.count_nonzero(out))
        self.has_embeddings = True

    def add_embeddings_with_states(self, embd: np.ndarray, positions: np.ndarray, states: np.ndarray, *,
                                   outputs: Sequence[bool] | np.ndarray | bool = False, seq_id: int = 0) -> None:
        """Embedding rows that each carry a state row too (``llama_batch_ext_set_embd_state``): an
        MTP context's media rows, the image row's embedding beside the target's hidden state paired
        with it. ``embd`` float32 [n, n_embd], ``positions`` int32 [n, n_pos], ``states`` float32
        [n, n_embd]. Raises NativeCallError where the build cannot carry them (``carries_embedding_states``)."""
        st = np.ascontiguousarray(states, dtype=np.float32)
        n = len(embd)
        if st.ndim != 2 or st.shape[0] != n:
            raise ValueError(f"{n} embedding rows need {n} state rows, got shape {st.shape}")
        first = self.n_rows
        self.add_embeddings(embd, positions, outputs=outputs, seq_id=seq_id)
        if not self._set_states(lib.llama_batch_ext_set_embd_state, first, st):
            before = self.n_rows
            self.clear()
            raise NativeCallError("llama_batch_ext_set_embd_state", None,
                                  f"a state row of {st.shape[1]} floats was refused ({self._ctx.role} context, "
                                  f"batch of {before} rows; the batch was cleared): this llama.cpp build cannot "
                                  "carry a state beside an embedding (patches/0004-mtp-media-rows.patch)")

    def _set_states(self, setter, first: int, states: np.ndarray) -> bool:
        """Give rows ``first``... one state row each (``setter``: llama_batch_ext_set_embd_token or
        _state; llama.cpp copies each row); False at the first row it refuses."""
        row = ffi.new("struct llama_embd *")
        row.n_rows, row.n_embd = 1, states.shape[1]
        base = ffi.cast("float *", ffi.from_buffer("float[]", states))
        for i in range(len(states)):
            row.data = base + i * states.shape[1]
            if not setter(self.ptr, first + i, row[0]):
                return False
        return True

    def carries_embedding_states(self, n_embd: int) -> bool:
        """Whether this build lets an embedding row carry a state row of ``n_embd`` floats besides
        (``add_embeddings_with_states``): the pinned llama.cpp leaves ``llama_batch_ext_set_embd_state``
        a TODO that refuses every row, patches/0004-mtp-media-rows.patch implements it. Tried on one
        row of zeros; the batch is cleared."""
        self.clear()
        zeros = np.zeros((1, n_embd), dtype=np.float32)
        try:
            self.add_embeddings(zeros, np.zeros((1, self._ctx.model.n_pos_per_embd), dtype=np.int32))
            row = ffi.new("struct llama_embd *")
            row.data, row.n_rows, row.n_embd = ffi.cast("float *", ffi.from_buffer("float[]", zeros)), 1, n_embd
            return bool(lib.llama_batch_ext_set_embd_state(self.ptr, 0, row[0]))
        finally:
            self.clear()

    def _check_add(self, rc: int, n: int) -> None:
        if rc < 0:
            # The native fill stops at the bad row with the rows before it added: clear the
            # batch, so that what it holds and what this object counts agree (nothing).
            before = self.n_rows
            self.clear()
            check_batch_add(rc, n_rows=n, batch_rows=before, role=self._ctx.role)
        self.n_rows += n
