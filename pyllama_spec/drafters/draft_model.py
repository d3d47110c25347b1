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

import numpy as np

from ..errors import IncompatibleModelsError
from ..llama import Context, Model
from ..positions import SequencePositions
from . import Proposal, TargetRows


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


class DraftModelDrafter:
    """The ``draft-simple`` method behind the drafter protocol (see drafters/__init__.py)."""

    name = "draft-simple"

    def __init__(self, draft_model: Model, positions: SequencePositions, *, n_ctx: int, n_max: int,
                 n_min: int = 0, n_max_limit: int = 32, n_batch: int = 512, n_threads: int | None = None,
                 flash_attn: bool | None = False, type_k: str = "f16", type_v: str = "f16") -> None:
        self.positions = positions  # the draft shares the target's positions
        self.n_max_limit = n_max_limit
        self.n_max = max(1, min(n_max, n_max_limit))
        self.n_min = min(n_min, self.n_max)
        self.ctx = Context(draft_model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=n_threads,
                           flash_attn=flash_attn, type_k=type_k, type_v=type_v, role="draft")

    # --- protocol
    def process(self, rows: TargetRows) -> None:
        if rows.tokens is None:
            return  # media: the target's positions move on, the draft reads text only
        pos = rows.section0
        step = self.ctx.n_batch
        for s in range(0, len(pos), step):
            self.ctx.decode_tokens(rows.tokens[s:s + step], pos[s:s + step], outputs=False)

    def draft(self, id_last: int, n_max: int | None = None, n_min: int | None = None) -> Proposal:
        """Greedy tokens after id_last, which sits at the target's pos_next (the draft's next row)."""
        n = min(self.n_max if n_max is None else n_max, self.n_max_limit)
        n_min = self.n_min if n_min is None else n_min
        pos0 = self.positions.pos_next
        tokens, logits = [], []
        tok = id_last
        for i in range(n):
            self.ctx.decode_tokens([tok], [pos0 + i], outputs=True)
            row = self.ctx.logits(-1)  # a copy
            tok = int(np.argmax(row))
            tokens.append(tok)
            logits.append(row)
        self.ctx.memory.remove(0, pos0, -1)  # the draft's own rows; the verify batch comes back through process()
        if len(tokens) < max(n_min, 1):
            return Proposal([])
        return Proposal(tokens, np.stack(logits))

    def accept(self, n_kept: int) -> None:
        """The target kept n_kept rows of the verify batch at pos_next: forget the rest."""
        self.ctx.memory.remove(0, self.positions.pos_next + n_kept, -1)

    def truncate(self, target_pos: int) -> None:
        self.ctx.memory.remove(0, target_pos, -1)

    def reset(self) -> None:
        self.ctx.memory.clear()

    def close(self) -> None:
        self.ctx.close()
