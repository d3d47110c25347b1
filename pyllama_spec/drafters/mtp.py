"""MTP drafting: the target's own multi-token-prediction head (Qwen3.5/3.6's ``nextn`` block).

No draft file: the head is a block of the target's GGUF, run by a second context of the target
model (llama.cpp's ``LLAMA_CONTEXT_TYPE_MTP``, its own KV cache). The block reads a token's
embedding beside the target's final hidden state of the position before it, one transformer
layer, and the target's head: it predicts the token after next.

The pairing rule (llama.cpp's ``common_speculative_impl_draft_mtp``, single-head mode): the head
holds, at target position p, the pair (x_p, h_{p-1}) - the token at p with the target's hidden
state one row earlier. ``process`` writes these pairs for every text row the target decodes;
the last hidden row of each sequence is carried to the next batch (``_pending``), and a verify
step's rejected rows move it back (``forget``: the hidden row of the last row kept). A draft
starts with (id_last, pending) at the sequence's ``pos_next`` and feeds each drafted token
back with the head's own hidden state at the next position; those rows are dropped again once
read (the target's verify rows replace them).

Through images: a media row is written like a token, its embedding in place of the token's
(``TargetRows.embeddings``, what the target decoded it from), beside the target's hidden state of
the row before it, at the row's own M-RoPE positions (the graph rotates them with
``ggml_rope_multi`` and the target's sections): the pair (e_r, h_{r-1}), so the head's cache
holds a row for every row the target's holds, and the first text token after an item pairs with
the hidden state of the item's last row. This is vLLM's Qwen3.5 MTP input too (the image's
embeddings merged into ``inputs_embeds``, then normalised and concatenated with the hidden state).
The pinned llama.cpp cannot take such a row: its MTP graph reads a row without a token id from one
buffer for both its embedding and h, and the batch API's separate state row
(``llama_batch_ext_set_embd_state``) is a TODO that refuses it; patches/0004-mtp-media-rows.patch
implements that setter (``Batch.add_embeddings_with_states``). A build without it (a user's own
checkout) leaves media rows out of the head's cache, a gap attention does not mind, keeping the
pairing right.

Pinned image positions (``TargetRows.pinned``, one rule for every drafter): an M-RoPE image's rows
share one section-0 position. A windowed cache cannot hold them (it frees cells by position, and
they would never free); the head's cache is a full one (no window: the nextn block is a
full-attention layer) with as many cells per sequence as the target's, and it holds one row for
each row the target holds, plus at most a draft's rows, which the target's room for the verify
step bounds (``draft_limit``): it holds them, so pinned rows are written too
(``holds_pinned_rows``; were it smaller, they would be left out as a build without the patch
does). Drafts start at ``pos_next`` (the M-RoPE position after the item), never at a row count.

Differences from llama.cpp's ``--spec-type draft-mtp`` (text-only drafts, tokens and counts are
the same: tests/test_mtp.py compares them with llama-server):

* media rows: llama.cpp's ``process`` returns early on any embedding batch, so its head never sees
  an image (a hole in its cache) and its first token after one pairs with the hidden state of the
  text before the image; here every media row is written, paired as above (without the patch:
  left out, the pairing still right);
* a row whose h_{p-1} is unknown (after a ``forget`` to a position whose hidden state is gone, or
  a restored cache the head never saw) is left out rather than paired with a stale state. The
  drafter keeps the last text rows of a verify step's reach and the last row of the latest media
  item, so a cut inside the last step, or exactly at the end of a picture (a prompt ending with
  one, asked again), pairs the next row as an uncut decode would.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from pyllama_spec.bindings.batch import Batch
from pyllama_spec.bindings.context import Context
from pyllama_spec.bindings.model import Model
from pyllama_spec.drafters import (
    DRAFT_TOKEN_LIMIT,
    DraftRequest,
    Proposal,
    TargetDecode,
    TraceEvent,
    token_limit_reason,
)
from pyllama_spec.errors import IncompatibleModelsError

#: Architectures whose MTP head this drafter drives: one trained head (llama.cpp's single-head
#: mode, ``n_layer_nextn`` 1). Chained heads (step35) and heads sharing the target's cache
#: (gemma4) are other modes of llama.cpp's driver, not implemented here.
SINGLE_HEAD_ARCHS = ("qwen35", "qwen35moe")
DRAFT_TOP_K = 10  # upstream reads the head's choice through a top-k 10 sampler


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """Facts about the target's head."""

    n_layer_nextn: int
    n_embd: int


def memory_parts(settings) -> list:
    """The registry's memory parts (registry.py): the head's own context on the target (make() opens
    it with the target's cells and ubatch): a cache of the nextn layers only and a compute buffer as
    large as the target's; its weights are the target's, counted there."""
    from pyllama_spec.gguf import memory

    return [memory.model_part("MTP head", settings.target, n_ctx=settings.n_ctx, n_ubatch=settings.n_ubatch,
                              type_k=settings.cache_type_k, type_v=settings.cache_type_v, nextn_only=True)]


def check_pair(target: Model, draft, build_record: dict):
    """The registry's pairing check (registry.py): the target must carry one nextn block, of an
    architecture whose MTP graph this build has and whose mode this drafter drives."""
    from pyllama_spec.drafters.registry import Pairing

    built = build_record.get("mtp_target_archs")
    if built is not None and target.arch not in built:
        raise IncompatibleModelsError(
            f"this build of llama.cpp has no MTP graph for the target architecture {target.arch!r}; "
            f"architectures with one: {', '.join(built)}")
    if target.arch not in SINGLE_HEAD_ARCHS:
        raise IncompatibleModelsError(
            f"draft-mtp drives the single MTP head of {', '.join(SINGLE_HEAD_ARCHS)} targets; "
            f"{target.path.name} is a {target.arch!r} model")
    n = target.n_layer_nextn
    if n == 0:
        raise IncompatibleModelsError(
            f"the target {target.path.name} has no MTP head (no nextn layers: {target.arch}.nextn_predict_layers "
            "is 0 or absent; a GGUF converted without its MTP block cannot draft with draft-mtp)")
    if n != 1:
        raise IncompatibleModelsError(f"the target {target.path.name} has {n} nextn layers; the {target.arch} "
                                      "MTP graph runs exactly one")
    if not getattr(target, "load_mtp", False):
        raise IncompatibleModelsError(f"the target {target.path.name} was loaded without its MTP block (load_mtp)")
    return Pairing(limit=DRAFT_TOKEN_LIMIT, per_position_logits=True, data=MTPConfig(n, target.n_embd))


def make(setup) -> "MTPDrafter":
    """The registry's constructor (registry.py)."""
    return MTPDrafter(setup.target_ctx, n_max=setup.n_max, n_min=setup.n_min, p_min=setup.p_min,
                      n_seq=setup.n_seq, n_batch=setup.n_batch, n_ubatch=setup.n_ubatch,
                      n_threads=setup.n_threads, flash_attn=setup.flash_attn, **setup.cache_types)


class MTPDrafter:
    """The MTP method behind the drafter protocol (see drafters/__init__.py), for ``n_seq`` sequences."""

    name = "mtp"

    def __init__(self, target_ctx: Context, *, n_max: int, n_min: int = 0, p_min: float = 0.0, n_seq: int = 1,
                 n_batch: int = 512, n_ubatch: int = 512, n_threads: int | None = None,
                 flash_attn: bool | None = False, type_k: str = "f16", type_v: str = "f16") -> None:
        self.target_ctx = target_ctx
        model = target_ctx.model
        self.n_max_limit = DRAFT_TOKEN_LIMIT
        self.n_max = max(1, min(n_max, self.n_max_limit))
        self.n_min = min(n_min, self.n_max)
        self.p_min = p_min
        # As llama-server: the head's cache holds as many positions per sequence as the target's.
        self.ctx = Context(model, n_ctx=target_ctx.n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_seq_max=n_seq,
                           n_threads=n_threads, flash_attn=flash_attn, type_k=type_k, type_v=type_v,
                           mtp=True, role="draft", kv_unified=target_ctx.kv_unified)
        self.ctx.enable_draft_embeddings(True, masked=True)  # the head's own hidden state, per drafted row
        self._batch = Batch(self.ctx)
        n_embd = model.n_embd
        # Media rows need a state row beside an embedding row (patches/0004-mtp-media-rows.patch).
        self.writes_media = self._batch.carries_embedding_states(n_embd)
        # The one rule for pinned rows (module docstring): a full cache with the target's cells per
        # sequence holds every row the target holds.
        self.holds_pinned_rows = self.ctx.n_ctx_seq >= target_ctx.n_ctx_seq
        # Per sequence: the hidden state the next row pairs with, and whether it is known (after a
        # forget to a position whose hidden state is gone, the next row is left out instead of mispaired).
        self._pending = np.zeros((n_seq, n_embd), dtype=np.float32)
        self._known = np.ones(n_seq, dtype=bool)
        # The target position the pending state pairs at (None: wherever the next text row is, after
        # a media item); a row elsewhere (a restored cache the head never saw) is not paired with it.
        self._pending_pos: list[int | None] = [0] * n_seq
        # Per sequence: the last text rows processed (first position, hidden states; a verify step's
        # worth): forget moves the pending state back to one of them (its last accepted row).
        self._recent: list[tuple[int, np.ndarray] | None] = [None] * n_seq
        # Per sequence: the position after the last media item and the hidden state of its last row,
        # for a cache cut exactly there (a prompt ending with a picture, asked again): the text row
        # at that position pairs with it rather than being left out.
        self._media_end: list[tuple[int, np.ndarray] | None] = [None] * n_seq
        # set to [] to record (call, seq, first position, rows): "pair" text rows written, "media" media
        # rows written, "skip" media rows left out, "draft" a draft's first row
        self.trace: list[TraceEvent] | None = None

    # --- protocol
    @property
    def limit_reason(self) -> str:
        return token_limit_reason(self.n_max_limit)
    def forget(self, seq_id: int, pos: int, draft_pos: int) -> None:
        """Drop the head's rows from target position ``pos`` on; the next row pairs with h_{pos-1}."""
        self.ctx.memory.remove(seq_id, pos, -1)
        self._pending_pos[seq_id] = pos
        recent, media_end = self._recent[seq_id], self._media_end[seq_id]
        if pos == 0:
            self._pending[seq_id] = 0.0  # as llama.cpp starts: nothing before position 0
            self._known[seq_id] = True
        elif recent is not None and recent[0] <= pos - 1 < recent[0] + len(recent[1]):
            self._pending[seq_id] = recent[1][pos - 1 - recent[0]]
            self._known[seq_id] = True
        elif media_end is not None and media_end[0] == pos:
            self._pending[seq_id] = media_end[1]
            self._known[seq_id] = True
        else:
            self._known[seq_id] = False
        if recent is not None and pos <= recent[0]:
            self._recent[seq_id] = None
        if media_end is not None and pos < media_end[0]:
            self._media_end[seq_id] = None  # the cut removes (part of) the item

    def process(self, decode: TargetDecode) -> None:
        """Write (x_p, h_{p-1}) for every row the target just decoded, x_p a token or a media row's
        embedding, all sequences in one decode (text rows; media rows in another: a batch holds one kind)."""
        text, media = [], []  # (rows of one sequence: token ids or embeddings, positions, paired states, seq)
        for r in decode.rows:
            s = r.seq_id
            h = decode.hidden(r)
            if r.has_embeddings:
                # Where the text after the item starts: one past its largest position in any section
                # (an M-RoPE picture's last row holds it; a 1-D item's positions advance row by row).
                # A wrong guess would only leave a row out after a cut (forget).
                self._media_end[s] = (int(r.positions.max()) + 1, h[-1].copy())
            if r.has_embeddings and not self._writes(r):
                # Left out (module docstring); the row after the media item pairs with its last row.
                self._log("skip", s, int(r.section0[0]), r.n_rows)
                self._pending[s] = h[-1]
                self._known[s] = True
                self._pending_pos[s] = None
                continue
            paired = np.concatenate([self._pending[s][None], h[:-1]])
            at = self._pending_pos[s]
            known = self._known[s] and (at is None or at == int(r.section0[0]))
            first = 0 if known else 1  # an unknown h_{p-1}: leave that row out
            if first < r.n_rows:
                rows = r.embeddings if r.has_embeddings else r.tokens
                (media if r.has_embeddings else text).append(
                    (rows[first:], r.positions[:, first:], paired[first:], s))
                self._log("media" if r.has_embeddings else "pair", s, int(r.section0[first]), r.n_rows - first)
            self._pending[s] = h[-1]
            self._known[s] = True
            if r.has_embeddings:
                self._pending_pos[s] = None  # the text after an item starts past its positions, not its rows
                continue
            self._pending_pos[s] = int(r.section0[-1]) + 1
            keep = self.n_max_limit + 1  # the most rows a verify step can cut back into
            self._recent[s] = (int(r.section0[-keep:][0]), h[-keep:])
        for parts, add in ((text, self._add_text), (media, self._add_media)):
            if parts:
                self._decode_rows(parts, add)

    def _writes(self, rows) -> bool:
        """Whether media ``rows`` go into the head's cache: their embeddings are given, the build can
        carry them, and, pinned, this cache can hold them (module docstring)."""
        return rows.embeddings is not None and self.writes_media and (self.holds_pinned_rows or not rows.pinned)

    def _add_text(self, tokens, positions, states, seq_id: int) -> None:
        self._batch.add_tokens_with_states(tokens, positions[0], states, seq_id=seq_id)

    def _add_media(self, embd, positions, states, seq_id: int) -> None:
        self._batch.add_embeddings_with_states(embd, np.ascontiguousarray(positions.T), states, seq_id=seq_id)

    def _decode_rows(self, parts, add) -> None:
        """Decode ``parts`` (one sequence's rows each, in order), filling batches of n_batch rows."""
        step = self.ctx.n_batch
        self._batch.clear()
        for rows, positions, states, seq in parts:
            at = 0
            while at < len(rows):
                n = min(step - self._batch.n_rows, len(rows) - at)
                add(rows[at:at + n], positions[:, at:at + n], states[at:at + n], seq)
                at += n
                if self._batch.n_rows == step:
                    self.ctx.decode(self._batch)
                    self._batch.clear()
        if self._batch.n_rows:
            self.ctx.decode(self._batch)
            self._batch.clear()

    def draft(self, requests: Sequence[DraftRequest]) -> list[Proposal]:
        """Up to n_max tokens after each request's id_last: one head decode per drafted position,
        for every drafting sequence at once. Fewer than a request's n_min tokens: nothing."""
        drafted: dict[int, list[int]] = {rq.seq_id: [] for rq in requests}
        logits_of: dict[int, np.ndarray | None] = {rq.seq_id: None for rq in requests}
        active = [rq for rq in requests if self._known[rq.seq_id] and self._pending_pos[rq.seq_id] in (None, rq.pos)
                  and min(rq.n_max, self.n_max_limit) > 0]
        self._batch.clear()
        for rq in active:
            self._batch.add_tokens_with_states([rq.id_last], [rq.pos], self._pending[rq.seq_id][None],
                                               outputs=True, seq_id=rq.seq_id)
            self._log("draft", rq.seq_id, rq.pos, 1)
        # each drafted token goes back in with the head's own hidden state, at the next position:
        # the whole chain in one native call (bindings: Context.draft_chain)
        chains = self.ctx.draft_chain(self._batch, [rq.seq_id for rq in active], [rq.pos + 1 for rq in active],
                                      [min(rq.n_max, self.n_max_limit) for rq in active], p_min=self.p_min,
                                      top_k=DRAFT_TOP_K, feed_states=True)
        for rq, (tokens, rows) in zip(active, chains):
            drafted[rq.seq_id], logits_of[rq.seq_id] = tokens, rows
        for rq in requests:
            # The drafted rows are guesses: the target's verify rows replace them (process).
            self.ctx.memory.remove(rq.seq_id, rq.pos, -1)
        out = []
        for rq in requests:
            tokens = drafted[rq.seq_id]
            if len(tokens) < rq.n_min or not tokens:
                out.append(Proposal([]))
            else:
                out.append(Proposal(tokens, logits_of[rq.seq_id]))
        return out

    def close(self) -> None:
        self._batch.close()
        self.ctx.close()

    def _log(self, call: str, seq: int, pos: int, n_rows: int) -> None:
        if self.trace is not None:
            self.trace.append(TraceEvent(call, seq, pos, n_rows))
