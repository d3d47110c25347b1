"""Draft-model drafting (llama.cpp's ``draft-simple``): a small model with the target's
vocabulary, in a context of its own, drafts token by token.

A text-only draft sees the sequence's text: every text row the target decodes is decoded
into the draft's context at the *target's* positions. Media rows are not (a text model cannot
read them); the positions after an image jump as the target's do (``pos_next``), so the draft
reads the text around the image at the right distances.

A vision draft model (``mmproj_draft``: a small VLM of the target's family with a projector of
its own, e.g. a 2B drafting for a 32B) sees the picture too. The engine cuts the prompt with
both projectors and pairs each media item with its twin (``Chunk.draft``); each projector
encodes its own (speculative/media.py), and the draft's rows are decoded here at the draft's own
positions: its projector's grid from the draft's ``pos_next``, which then moves by the
draft's ``n_pos`` (positions.py), not the target's. Everything in this draft's cache is laid
out by those draft positions (``DraftRequest.draft_pos``, ``forget``'s ``draft_pos``). The
draft's context is as large as the target's, so its rows never outnumber the target's: an
item that its projector cuts into more rows than the target's (beyond what earlier items left
spare) is not decoded into the draft, which then reads the text around it as a text-only
draft does.

Drafting decodes one token at a time after ``id_last`` and reads the draft's logits; those
rows are removed before the target verifies, and the verify batch is decoded into the draft
like any other text.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from pyllama_spec.bindings.batch import Batch
from pyllama_spec.bindings.context import Context
from pyllama_spec.bindings.model import Model
from pyllama_spec.drafters import (
    DRAFT_TOKEN_LIMIT,
    DraftMedia,
    DraftRequest,
    Proposal,
    TargetDecode,
    TargetRows,
    token_limit_reason,
)
from pyllama_spec.drafters.registry import wrong_draft_kind
from pyllama_spec.errors import IncompatibleModelsError

log = logging.getLogger(__name__)


def check_draft_model(target: Model, draft: Model) -> None:
    """Refuse, before any context exists, a draft model that cannot propose the target's tokens."""
    if draft.arch in ("dflash", "eagle3"):  # a draft that needs the target's features: another method's
        raise IncompatibleModelsError(wrong_draft_kind(draft.path.name, draft.arch, "draft-simple"))
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


def memory_parts(settings) -> list:
    """The registry's memory parts (registry.py): the draft model's weights, its cache (as many cells as
    the target's) and the compute buffer of its ubatch (n_batch rows: make() gives it one ubatch per
    batch), then its own projector's weights when it has one (mmproj_draft)."""
    from pyllama_spec.gguf import memory

    parts = [memory.model_part("draft", settings.draft, n_ctx=settings.n_ctx, n_ubatch=settings.n_batch,
                               type_k=settings.cache_type_k, type_v=settings.cache_type_v)]
    if settings.mmproj_draft is not None:
        parts.append(memory.projector_part("draft mmproj", settings.mmproj_draft))
    return parts


def check_pair(target: Model, draft: Model, build_record: dict):
    """The registry's pairing check (registry.py)."""
    from pyllama_spec.drafters.registry import Pairing

    check_draft_model(target, draft)
    return Pairing(limit=DRAFT_TOKEN_LIMIT, per_position_logits=True)


def make(setup) -> "DraftModelDrafter":
    """The registry's constructor (registry.py): one draft context laid out by the target's positions."""
    return DraftModelDrafter(setup.draft_model, n_ctx=setup.n_ctx, n_max=setup.n_max, n_seq=setup.n_seq,
                             n_min=setup.n_min, n_max_limit=setup.pairing.limit, n_batch=setup.n_batch,
                             n_threads=setup.n_threads, flash_attn=setup.flash_attn,
                             projector=setup.draft_projector, kv_unified=setup.target_ctx.kv_unified,
                             **setup.cache_types)


class DraftModelDrafter:
    """The ``draft-simple`` method behind the drafter protocol (see drafters/__init__.py), for ``n_seq``
    sequences in one draft context: laid out by the target's positions, or, with the draft's own
    ``projector`` (a vision draft model), by the draft's."""

    name = "draft-simple"

    def __init__(self, draft_model: Model, *, n_ctx: int, n_max: int, n_min: int = 0, n_max_limit: int = DRAFT_TOKEN_LIMIT,
                 n_seq: int = 1, n_batch: int = 512, n_threads: int | None = None,
                 flash_attn: bool | None = False, type_k: str = "f16", type_v: str = "f16",
                 projector=None, kv_unified: bool = False) -> None:
        self.n_max_limit = n_max_limit
        self.n_max = max(1, min(n_max, n_max_limit))
        self.n_min = min(n_min, self.n_max)
        #: The draft model's own projector (not owned: the engine closes it); None for a text-only draft.
        self.projector = projector
        self.ctx = Context(draft_model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_seq_max=n_seq,
                           n_threads=n_threads, flash_attn=flash_attn, type_k=type_k, type_v=type_v, role="draft",
                           kv_unified=kv_unified)
        self._batch = Batch(self.ctx)
        # A vision draft's media items per sequence, in order: (first draft position, the rows the draft
        # holds for it minus the target's). Their sum stays <= 0: the draft never needs more rows.
        self._media: dict[int, list[tuple[int, int]]] = {}
        self.media_skipped = 0  # media items not decoded into the draft (more rows than the target's)

    @property
    def sees_media(self) -> bool:
        """Whether the draft decodes pictures (through its own projector)."""
        return self.projector is not None

    def _text_positions(self, r: TargetRows) -> np.ndarray:
        if self.sees_media:  # the draft's own positions: after an image they are not the target's
            return r.first_draft_pos + np.arange(r.n_rows, dtype=np.int32)
        return r.section0

    # --- protocol
    @property
    def limit_reason(self) -> str:
        return token_limit_reason(self.n_max_limit)
    def process(self, decode: TargetDecode) -> None:
        """Decode the text rows of every sequence into the draft, and a vision draft's own rows of each
        media item (a text-only draft skips media rows: the positions move on)."""
        step = self.ctx.n_batch
        pending = 0
        self._batch.clear()
        for r in decode.rows:
            if r.tokens is None:
                if r.draft_media is not None and self.sees_media:
                    if pending:
                        self.ctx.decode(self._batch)
                        self._batch.clear()
                        pending = 0
                    self._decode_media(r.seq_id, r.first_draft_pos, r.draft_media)
                continue
            pos = self._text_positions(r)
            for s in range(0, r.n_rows, step):
                n = min(step, r.n_rows - s)
                if pending + n > step:
                    self.ctx.decode(self._batch)
                    self._batch.clear()
                    pending = 0
                self._batch.add_tokens(r.tokens[s:s + n], pos[s:s + n], seq_id=r.seq_id)
                pending += n
        if pending:
            self.ctx.decode(self._batch)

    def _decode_media(self, seq_id: int, pos0: int, media: DraftMedia) -> None:
        """Decode a media item's rows, as the draft's projector made them, at the draft's positions from pos0."""
        items = self._media.setdefault(seq_id, [])
        n = media.chunk.n_tokens
        extra = n - media.target_rows
        if sum(e for _, e in items) + extra > 0:
            # More rows than the target gave it: the draft's context (the target's size) could overflow.
            items.append((pos0, -media.target_rows))
            self.media_skipped += 1
            log.warning("the draft's projector cut this %s into %d rows, the target's into %d: the draft reads "
                        "the text around it only", media.chunk.type, n, media.target_rows)
            return
        positions = self.projector.media_positions(media.chunk, pos0)  # [n, n_pos sections of the draft]
        non_causal = self.projector.uses_non_causal(media.chunk)
        step = self.ctx.n_batch
        try:
            for s in range(0, n, step):
                self._batch.clear()
                self._batch.add_embeddings(media.embd[s:s + step], positions[s:s + step], seq_id=seq_id)
                if non_causal:
                    self.ctx.set_causal_attn(False)
                try:
                    self.ctx.decode(self._batch)
                finally:
                    if non_causal:
                        self.ctx.set_causal_attn(True)
        finally:
            self._batch.clear()
        items.append((pos0, extra))

    def draft(self, requests: Sequence[DraftRequest]) -> list[Proposal]:
        """Greedy tokens after each id_last (at the target's pos_next, the draft's next row), one token
        per request in each draft decode."""
        n_of = [min(rq.n_max, self.n_max_limit) for rq in requests]
        # where id_last sits in the draft's cache: the draft's own position for a vision draft
        base = [rq.draft_pos if self.sees_media else rq.pos for rq in requests]
        # id_last first, then each greedy token at the next position: the chain in one native call
        # (bindings: Context.draft_chain)
        going = [k for k, n in enumerate(n_of) if n > 0]
        self._batch.clear()
        for k in going:
            self._batch.add_tokens([requests[k].id_last], [base[k]], outputs=True, seq_id=requests[k].seq_id)
        chains = self.ctx.draft_chain(self._batch, [requests[k].seq_id for k in going], [base[k] + 1 for k in going],
                                      [n_of[k] for k in going])
        chain_of = dict(zip(going, chains))
        out = []
        for k, (rq, b) in enumerate(zip(requests, base)):
            toks, rows = chain_of.get(k, ([], None))
            # The draft's own rows go; the verify batch comes back through process().
            self.ctx.memory.remove(rq.seq_id, b, -1)
            out.append(Proposal(toks, rows) if len(toks) >= max(rq.n_min, 1) else Proposal([]))
        return out

    def forget(self, seq_id: int, pos: int, draft_pos: int) -> None:
        if not self.sees_media:
            self.ctx.memory.remove(seq_id, pos, -1)
            return
        self.ctx.memory.remove(seq_id, draft_pos, -1)
        if seq_id in self._media:
            self._media[seq_id] = [item for item in self._media[seq_id] if item[0] < draft_pos]

    def close(self) -> None:
        self._batch.close()
        self.ctx.close()
