"""Draft-model drafting (llama.cpp's ``draft-simple``): a small model with the target's
vocabulary, in a context of its own, drafts token by token.

The draft sees the sequence's text: every text row the target decodes is decoded into the
draft's context at the *target's* positions. Media rows are not (a text model cannot read
them); the positions after an image jump as the target's do (``pos_next``), so the draft
reads the text around the image at the right distances. Drafting decodes one token at a
time after ``id_last`` and reads the draft's logits; those rows are removed before the
target verifies, and the verify batch is decoded into the draft like any other text.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from pyllama_spec.bindings.batch import Batch
from pyllama_spec.bindings.context import Context
from pyllama_spec.bindings.model import Model
from pyllama_spec.drafters import DRAFT_TOKEN_LIMIT, DraftRequest, Proposal, TargetDecode
from pyllama_spec.errors import IncompatibleModelsError


def check_draft_model(target: Model, draft: Model) -> None:
    """Refuse, before any context exists, a draft model that cannot propose the target's tokens."""
    if draft.n_vocab != target.n_vocab:
        raise IncompatibleModelsError(f"the draft model {draft.path.name} has {draft.n_vocab} tokens, the target "
                                      f"{target.n_vocab}: a draft model needs the target's vocabulary")
    sample = range(0, target.n_vocab, max(1, target.n_vocab // 64))
    differ = [t for t in sample if draft.token_text(t) != target.token_text(t)]
    if differ:
        t = differ[0]
        raise IncompatibleModelsError(f"the draft model {draft.path.name} spells token {t} as "
                                      f"{draft.token_text(t)!r}, the target as {target.token_text(t)!r}: "
                                      "not the same vocabulary")
    if draft.is_recurrent:
        raise IncompatibleModelsError(f"the draft model {draft.path.name} is recurrent: it cannot roll back "
                                      "rejected drafts; use an attention-only draft model")


def check_pair(target: Model, draft: Model, build_record: dict):
    """The registry's pairing check (registry.py)."""
    from pyllama_spec.drafters.registry import Pairing

    check_draft_model(target, draft)
    return Pairing(limit=DRAFT_TOKEN_LIMIT, per_position_logits=True)


def make(setup) -> "DraftModelDrafter":
    """The registry's constructor (registry.py): one draft context laid out by the target's positions."""
    return DraftModelDrafter(setup.draft_model, n_ctx=setup.n_ctx, n_max=setup.n_max, n_seq=setup.n_seq,
                             n_min=setup.n_min, n_max_limit=setup.pairing.limit, n_batch=setup.n_batch,
                             n_threads=setup.n_threads, flash_attn=setup.flash_attn, **setup.cache_types)


class DraftModelDrafter:
    """The ``draft-simple`` method behind the drafter protocol (see drafters/__init__.py), for ``n_seq``
    sequences in one draft context (laid out by the target's positions)."""

    name = "draft-simple"

    def __init__(self, draft_model: Model, *, n_ctx: int, n_max: int, n_min: int = 0, n_max_limit: int = DRAFT_TOKEN_LIMIT,
                 n_seq: int = 1, n_batch: int = 512, n_threads: int | None = None,
                 flash_attn: bool | None = False, type_k: str = "f16", type_v: str = "f16") -> None:
        self.n_max_limit = n_max_limit
        self.n_max = max(1, min(n_max, n_max_limit))
        self.n_min = min(n_min, self.n_max)
        self.ctx = Context(draft_model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_seq_max=n_seq,
                           n_threads=n_threads, flash_attn=flash_attn, type_k=type_k, type_v=type_v, role="draft")
        self._batch = Batch(self.ctx)

    # --- protocol
    def process(self, decode: TargetDecode) -> None:
        """Decode the text rows of every sequence into the draft (media rows: the positions move on)."""
        text = [r for r in decode.rows if r.tokens is not None]
        step = self.ctx.n_batch
        pending = 0
        self._batch.clear()
        for r in text:
            for s in range(0, r.n_rows, step):
                n = min(step, r.n_rows - s)
                if pending + n > step:
                    self.ctx.decode(self._batch)
                    self._batch.clear()
                    pending = 0
                self._batch.add_tokens(r.tokens[s:s + n], r.section0[s:s + n], seq_id=r.seq_id)
                pending += n
        if pending:
            self.ctx.decode(self._batch)

    def draft(self, requests: Sequence[DraftRequest]) -> list[Proposal]:
        """Greedy tokens after each id_last (at the target's pos_next, the draft's next row), one token
        per request in each draft decode."""
        n_of = [min(rq.n_max, self.n_max_limit) for rq in requests]
        tokens: list[list[int]] = [[] for _ in requests]
        logits: list[list[np.ndarray]] = [[] for _ in requests]
        last = [rq.id_last for rq in requests]
        for i in range(max(n_of, default=0)):
            active = [k for k, n in enumerate(n_of) if i < n]
            self._batch.clear()
            for k in active:
                self._batch.add_tokens([last[k]], [requests[k].pos + i], outputs=True, seq_id=requests[k].seq_id)
            self.ctx.decode(self._batch)
            rows = self.ctx.output_logits(len(active))
            for j, k in enumerate(active):
                row = np.array(rows[j])  # a copy: the next decode reuses the buffer
                last[k] = int(np.argmax(row))
                tokens[k].append(last[k])
                logits[k].append(row)
        out = []
        for rq, toks, rows in zip(requests, tokens, logits):
            # The draft's own rows go; the verify batch comes back through process().
            self.ctx.memory.remove(rq.seq_id, rq.pos, -1)
            out.append(Proposal(toks, np.stack(rows)) if len(toks) >= max(rq.n_min, 1) else Proposal([]))
        return out

    def forget(self, seq_id: int, pos: int, draft_pos: int) -> None:
        self.ctx.memory.remove(seq_id, pos, -1)

    def close(self) -> None:
        self._batch.close()
        self.ctx.close()
