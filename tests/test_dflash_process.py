"""DFlashDrafter.process: the target's rows of several sequences injected into the draft's cache in the
target batch's order, n_ubatch rows a draft decode, a sequence's rows split where one is full."""

from __future__ import annotations

import numpy as np
from conftest import N_THREADS

import pyllama_spec as ps
from pyllama_spec.drafters import TargetDecode, TargetRows


class _Features:
    """A stand-in for the target's context: every recorded layer's input, random, for ``n`` rows."""

    def __init__(self, n_embd: int, n_rows: int) -> None:
        self.rows = np.random.default_rng(0).standard_normal((n_rows, n_embd)).astype(np.float32)

    def layer_input(self, lid: int, n: int) -> np.ndarray:
        return self.rows[:n] * np.float32(1 + lid)


def test_rows_of_two_sequences_cross_a_draft_decode_in_the_batch_order(tiny_dense):
    with ps.load(tiny_dense.target, draft=tiny_dense.draft, n_parallel=2, n_ctx=4096, n_threads=N_THREADS) as engine:
        drafter = engine.drafter
        step = drafter.ctx.n_ubatch
        n0, n1 = step - 3, 10  # sequence 0 leaves 3 rows of the first decode to sequence 1
        rows = [TargetRows(positions=np.arange(n0, dtype=np.int32)[None, :], has_embeddings=False, first_draft_pos=0,
                           seq_id=0, row_offset=0),
                TargetRows(positions=np.arange(n1, dtype=np.int32)[None, :], has_embeddings=False, first_draft_pos=0,
                           seq_id=1, row_offset=n0)]
        decoded = []
        real_decode = drafter.ctx.decode
        drafter.ctx.decode = lambda batch: (decoded.append(batch.n_rows), real_decode(batch))[1]
        drafter.trace = []
        drafter.process(TargetDecode(rows, _Features(engine.model.n_embd, n0 + n1)))
        memory = drafter.ctx.memory
        assert [tuple(e) for e in drafter.trace] == [("inject", 0, 0, n0), ("inject", 1, 0, 3), ("inject", 1, 3, n1 - 3)]
        assert decoded == [step, n1 - 3]
        assert (memory.pos_max(0), memory.pos_max(1)) == (n0 - 1, n1 - 1)
