"""EAGLE3 drafting: a one-layer decoder fed an encoder's fusion of three target layers' inputs.

The draft file (``eagle3`` architecture, src/models/eagle3.cpp) holds an encoder (``fc``: the
inputs of the target's three ``target_layers``, side by side, projected to the draft's width:
``g``) and one decoder layer that reads a token embedding and a ``g`` row together. As in
llama.cpp's ``common_speculative_impl_draft_eagle3``:

* the decoder row at draft position P is the pair ``(t_{P+1}, g_P)``: the *next* row's token with
  this row's features. So the last row the target decoded cannot be written yet (its partner is
  the token the target samples next): it is held back and written by whichever call has that
  token, the next ``process`` or ``draft`` (which gets it as ``id_last``);
* a draft writes that held-back row with ``id_last`` at its position and reads the first draft
  token from it; every further step feeds the drafted token with the decoder's own pre-norm
  output (as ``g``) at the next position. The first drafted row is at the sequence's next
  position (``pos_next``, or the draft's own in "sequential" mode): never a token count.
* the draft's logits are over the target's vocabulary: with a reduced draft vocabulary (``d2t``)
  llama.cpp's graph scatters them to the target ids and puts -inf everywhere else, so drafted
  tokens, the verifier's rejection sampling and the logits a Proposal carries are all target ids.

Through images (where llama.cpp skips every embedding batch): the target's features at image
rows reach the encoder like any others; an image row's own token is the vocabulary's image
placeholder (``<|image_pad|>`` and kin: what the training data of Qwen-VL EAGLE3 drafts holds at
image rows), so the row before an image is written with that token as partner, and the image's
last row with the first token after it. The draft's cache is 1-D (plain rope), and llama.cpp keeps
a 1-D cache's positions consecutive. So under the one pinned rule (``TargetRows.pinned``):
in "target" mode the rows of an M-RoPE image, which all share one section-0 position, are held
back until the position after the image is known, then laid in order over the positions the
image spans (the draft's cache is not windowed, so it can hold them; it never holds more rows
than the target). In "sequential" mode every row takes the draft's next position.

``writes_media = False`` leaves a picture's rows out, as llama.cpp does, to measure what seeing them is
worth; unlike llama.cpp (whose EAGLE3 fails on text before a picture), the sequence then starts afresh
in the draft after the picture.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from pyllama_spec.bindings.batch import Batch
from pyllama_spec.bindings.context import Context
from pyllama_spec.bindings.model import Model
from pyllama_spec.drafters import (
    DRAFT_TOKEN_LIMIT,
    DraftRequest,
    Proposal,
    TargetDecode,
    TargetRows,
    TraceEvent,
    token_limit_reason,
)
from pyllama_spec.drafters.registry import wrong_draft_kind
from pyllama_spec.errors import IncompatibleModelsError

DRAFT_TOP_K = 10  # upstream reads the draft's choice through a top-k 10 sampler (p_min compares with it)
#: Tokens that stand for an image row in the vocabularies of the VL families (the first found is used).
MEDIA_TOKENS = ("<|image_pad|>", "<|vision_pad|>", "<image>", "<IMG_CONTEXT>", "<|IMAGE|>")


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """Facts read from an EAGLE3 draft file."""

    target_layers: tuple[int, int, int]
    target_hidden_size: int
    n_draft_vocab: int  # the reduced vocabulary's size (the target's without d2t)
    has_d2t: bool


def _gguf_facts(draft: Model):
    from pyllama_spec.gguf.reader import read_gguf_shared

    return read_gguf_shared(draft.path, "draft model")


def check_eagle3_pair(target: Model, draft: Model, layer_input_archs: list[str] | None) -> Eagle3Config:
    """Refuse, before any context exists, every pairing that would abort natively or cannot work."""
    if draft.arch != "eagle3":
        raise IncompatibleModelsError(wrong_draft_kind(draft.path.name, draft.arch, "draft-eagle3"))
    layers = tuple(draft.target_layer_ids)
    if len(layers) != 3:  # the loader refuses this too; say it in our words if it ever gets through
        raise IncompatibleModelsError(f"an EAGLE3 draft reads exactly 3 target layers; {draft.path.name} "
                                      f"names {len(layers)} ({list(layers)})")
    if layer_input_archs is not None and target.arch not in layer_input_archs:
        raise IncompatibleModelsError(
            f"the target architecture {target.arch!r} does not record its layer inputs in this build, so an "
            f"EAGLE3 draft cannot read features from it (llama.cpp would abort). Targets that can: "
            f"{', '.join(layer_input_archs)}. See patches/README.md.")
    bad = [lid for lid in layers if not 0 <= lid < target.n_layer]
    if bad:
        # llama.cpp reads layer n_layer as the target's final hidden state, which none of the
        # targets this package serves exposes (their graphs keep no "nextn" output)
        raise IncompatibleModelsError(
            f"the draft reads target layers {list(layers)}, but the target {target.path.name} has "
            f"{target.n_layer} layers (entries {bad} are not the input of one of its layers)")
    if 0 in layers and target.n_embd_inp != target.n_embd:
        raise IncompatibleModelsError(
            f"the draft reads target layer 0, whose input on this {target.arch} target is wider than n_embd "
            f"({target.n_embd_inp} vs {target.n_embd}, deepstack): llama.cpp cannot extract it")
    info = _gguf_facts(draft)
    hidden = int(info.metadata.get("eagle3.target_hidden_size", 0) or 0)
    if hidden != target.n_embd:
        raise IncompatibleModelsError(f"the draft's eagle3.target_hidden_size is {hidden} but the target's n_embd "
                                      f"is {target.n_embd}: this draft was trained for another target")
    tensors = info.tensors
    own_embd, own_head = tensors.get("token_embd.weight"), tensors.get("output.weight")
    if (own_embd is None or own_head is None) and draft.n_embd != target.n_embd:
        raise IncompatibleModelsError(f"draft n_embd {draft.n_embd} != target n_embd {target.n_embd}, and the draft "
                                      "borrows the target's token embedding or output head")
    if draft.n_vocab != target.n_vocab:
        raise IncompatibleModelsError(f"draft vocabulary ({draft.n_vocab} tokens) != target vocabulary "
                                      f"({target.n_vocab} tokens)")
    if own_embd is not None and own_embd.dims[1] != target.n_vocab:
        raise IncompatibleModelsError(f"the draft's token_embd has {own_embd.dims[1]} rows for a vocabulary of "
                                      f"{target.n_vocab}")
    n_draft_vocab = target.n_vocab
    d2t = tensors.get("d2t")
    if d2t is not None:
        from pyllama_spec.gguf.reader import read_tensor

        ids = read_tensor(info, "d2t")  # validate_gguf checked its type and that the head matches it
        if ids.size and (ids.min() < 0 or ids.max() >= target.n_vocab):
            raise IncompatibleModelsError(f"the draft's d2t maps to target ids up to {int(ids.max())} (min "
                                          f"{int(ids.min())}), outside the target's vocabulary of {target.n_vocab}")
        if np.unique(ids).size != ids.size:
            raise IncompatibleModelsError("the draft's d2t maps two draft tokens to one target token")
        n_draft_vocab = int(ids.size)
    elif own_head is not None and own_head.dims[1] != target.n_vocab:
        raise IncompatibleModelsError(f"the draft's output head has {own_head.dims[1]} rows but it has no d2t to map "
                                      f"them to the target's {target.n_vocab} tokens")
    return Eagle3Config(layers, hidden, n_draft_vocab, d2t is not None)


def memory_parts(settings) -> list:
    """The registry's memory parts (registry.py): the draft's weights, its cache (as many cells as the
    target's) and the compute buffer of its ubatch; its output rows are the target's vocabulary (a
    reduced vocabulary is scattered to the target's ids)."""
    from pyllama_spec.gguf import memory

    return [memory.model_part("draft", settings.draft, n_ctx=settings.n_ctx,
                              n_ubatch=max(settings.n_ubatch, settings.n_seq), type_k=settings.cache_type_k,
                              type_v=settings.cache_type_v, n_vocab_out=memory.vocabulary_size(settings.target),
                              live=(1, 2))]


def check_pair(target: Model, draft: Model, build_record: dict):
    """The registry's pairing check (registry.py): drafts of up to DRAFT_TOKEN_LIMIT tokens, each with
    the draft's distribution over the target's vocabulary."""
    from pyllama_spec.drafters.registry import Pairing

    cfg = check_eagle3_pair(target, draft, build_record.get("dflash_target_archs"))
    return Pairing(limit=DRAFT_TOKEN_LIMIT, per_position_logits=True, data=cfg, target_layers=cfg.target_layers)


def make(setup) -> Eagle3Drafter:
    """The registry's constructor (registry.py)."""
    return Eagle3Drafter(setup.target_ctx, setup.draft_model, setup.pairing.data, n_max=setup.n_max,
                         n_min=setup.n_min, p_min=setup.p_min, n_seq=setup.n_seq, n_batch=setup.n_batch,
                         n_ubatch=setup.n_ubatch, n_threads=setup.n_threads, flash_attn=setup.flash_attn,
                         **setup.cache_types)


def media_token(model: Model) -> int:
    """The token an image row stands for in ``model``'s vocabulary (``MEDIA_TOKENS``); the padding
    token (else 0) when it has none of them."""
    for text in MEDIA_TOKENS:
        ids = model.tokenize(text, parse_special=True)
        if len(ids) == 1 and model.token_to_bytes(int(ids[0]), special=True) == text.encode():
            return int(ids[0])
    pad = model.meta("tokenizer.ggml.padding_token_id")
    return int(pad) if pad and pad.isdigit() else 0


@dataclasses.dataclass
class _Rows:
    """Rows of one sequence: each row's own input token, its encoder output ``g`` and its draft
    position (for a pinned image row in "target" mode: the image's first position, ``pinned``)."""

    tokens: np.ndarray  # int32 [n]
    g: np.ndarray  # float32 [n, n_embd]
    pos: np.ndarray  # int32 [n]
    pinned: np.ndarray  # bool [n]

    @classmethod
    def empty(cls, n_embd: int) -> _Rows:
        return cls(np.zeros(0, np.int32), np.zeros((0, n_embd), np.float32), np.zeros(0, np.int32),
                   np.zeros(0, bool))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, at) -> _Rows:
        return _Rows(self.tokens[at], self.g[at], self.pos[at], self.pinned[at])

    def __add__(self, other: _Rows) -> _Rows:
        if not len(other) or not len(self):  # the common case of a step: nothing held back, or nothing new
            return other if not len(self) else self
        return _Rows(np.concatenate([self.tokens, other.tokens]), np.concatenate([self.g, other.g]),
                     np.concatenate([self.pos, other.pos]), np.concatenate([self.pinned, other.pinned]))


def _lay_out(rows: _Rows, next_pos: int | None) -> tuple[_Rows, int]:
    """``rows`` with their draft positions, and how many of the given rows they cover (a prefix).

    A run of image rows (they share their first position ``a``) is laid in order over the positions
    the image spans, [a, the next row's position), one position after another, since a 1-D cache
    takes consecutive positions only: several rows to a position when the image has more rows than
    positions (a pinned image), a row repeated when it has fewer (a tall, thin picture). A run still
    at the end has no next row yet: it and what follows are left unplaced."""
    if not rows.pinned.any():  # text rows only: already in place
        return rows, len(rows)
    parts, n, i = [], len(rows), 0
    while i < n:
        if not rows.pinned[i]:  # text rows up to the next image row
            j = _first_false(~rows.pinned[i:], i)
            parts.append(rows[i:j])
            i = j
            continue
        j = _first_false(rows.pinned[i:] & (rows.pos[i:] == rows.pos[i]), i)  # the image's run
        end = int(rows.pos[j]) if j < n else next_pos
        if end is None:
            break
        a, k = int(rows.pos[i]), j - i
        span = max(1, end - a)
        if k >= span:  # each position gets one or more rows, in order
            run = rows[i:j]
            run.pos = (a + (np.arange(k) * span) // k).astype(np.int32)
        else:  # each position gets one row, rows repeated in order
            run = rows[i + (np.arange(span) * k) // span]
            run.pos = (a + np.arange(span)).astype(np.int32)
        parts.append(run)
        i = j
    placed = _Rows.empty(rows.g.shape[1])
    for part in parts:
        placed = placed + part
    return placed, i


def _first_false(flags: np.ndarray, offset: int) -> int:
    """offset + the index of the first False in ``flags`` (offset + len(flags) when all are True)."""
    stop = np.flatnonzero(~flags)
    return offset + (int(stop[0]) if len(stop) else len(flags))


class Eagle3Drafter:
    """The EAGLE3 method behind the drafter protocol (see drafters/__init__.py), for ``n_seq`` sequences."""

    name = "eagle3"

    def __init__(self, target_ctx: Context, draft_model: Model, config: Eagle3Config, *, n_max: int,
                 n_min: int = 0, p_min: float = 0.0, n_seq: int = 1, n_batch: int = 512, n_ubatch: int = 512,
                 n_threads: int | None = None, flash_attn: bool | None = False,
                 type_k: str = "f16", type_v: str = "f16") -> None:
        self.config = config
        self.target_ctx = target_ctx
        self.n_max_limit = DRAFT_TOKEN_LIMIT
        self.n_max = max(1, min(n_max, self.n_max_limit))
        self.n_min = min(n_min, self.n_max)
        self.p_min = p_min
        batch = max(n_batch, n_seq * (self.n_max_limit + 1))
        self.ctx = Context(draft_model, n_ctx=target_ctx.n_ctx, n_batch=batch, n_ubatch=max(n_ubatch, n_seq),
                           n_seq_max=n_seq, n_threads=n_threads, flash_attn=flash_attn, type_k=type_k,
                           type_v=type_v, ctx_other=target_ctx, role="draft",
                           kv_unified=target_ctx.kv_unified)
        # the encoder's output (g) and the decoder's pre-norm output (the next step's g)
        self.ctx.enable_draft_embeddings(True, masked=True)
        self._batch = Batch(self.ctx)
        self._n_embd = draft_model.n_embd
        self._media_token = media_token(target_ctx.model)
        # per sequence: rows decoded by the target and not yet written into the draft's cache (the
        # last one waits for its partner), and the rows of the last process (to take one back after
        # a rollback, as llama.cpp's accept() does)
        self._pending = {s: _Rows.empty(self._n_embd) for s in range(n_seq)}
        self._last = {s: _Rows.empty(self._n_embd) for s in range(n_seq)}
        self.trace: list[TraceEvent] | None = None  # set to [] to record "write", "seed", "restart" and "skip"
        # False: the draft never sees a picture's rows, as llama.cpp leaves them out (to measure what
        # seeing them is worth; _leave_out says what else goes with them)
        self.writes_media = True

    # --- protocol
    @property
    def limit_reason(self) -> str:
        return token_limit_reason(self.n_max_limit)
    def forget(self, seq_id: int, pos: int, draft_pos: int) -> None:
        """The sequence now ends before draft position ``draft_pos``: the row before it is again the
        held-back one (its partner is whatever comes next), and everything after it goes."""
        keep = draft_pos - 1
        self.ctx.memory.remove(seq_id, keep, -1)  # keep == -1: all of it
        pend, last = self._pending[seq_id], self._last[seq_id]
        at = np.flatnonzero((last.pos == keep) & ~last.pinned)
        if keep >= 0 and len(at):
            self._pending[seq_id] = last[at[-1:]]
        elif keep >= 0 and len(pend) and pend.pos[-1] == keep and not pend.pinned[-1]:
            self._pending[seq_id] = pend[-1:]
        else:
            # that row is no longer known (a reset, or a rollback past the last decode): the next rows
            # start the draft's cache for this sequence afresh (_write)
            self._pending[seq_id] = _Rows.empty(self._n_embd)
        if keep < 0:
            self._last[seq_id] = _Rows.empty(self._n_embd)

    def process(self, decode: TargetDecode) -> None:
        """Encode the target's features for every row it just decoded (image rows too), and write every
        row whose partner and position are now known into the draft's cache, all sequences at once."""
        kept = []
        for r in decode.rows:  # a target decode is all text rows or all media rows
            if self.writes_media or not r.has_embeddings:
                kept.append(r)
            else:
                self._leave_out(r)
        if not kept:
            return
        feats = np.concatenate([decode.features(self.config.target_layers, r) for r in kept])
        g = self._encode(feats)
        writes: list[tuple[int, _Rows]] = []
        at = 0
        for r in kept:
            new = _Rows(self._own_tokens(r), g[at:at + r.n_rows], *self._positions(r))
            at += r.n_rows
            self._last[r.seq_id] = new
            rows = self._pending[r.seq_id] + new
            placed, n_placed = _lay_out(rows, None)
            # each placed row's partner is the next row's token; the last row of all waits for its own
            following = rows.tokens[n_placed:n_placed + 1] if len(placed) else rows.tokens[:0]
            partners = np.concatenate([placed.tokens[1:], following])
            n_write = len(partners)
            if n_write > 0:
                done = placed[:n_write]
                done.tokens = partners.astype(np.int32)
                writes.append((r.seq_id, done))
            self._pending[r.seq_id] = placed[n_write:] + rows[n_placed:]
        self._write(writes)

    def draft(self, requests: Sequence[DraftRequest]) -> list[Proposal]:
        """Up to n_max tokens after each request's id_last: one decode per drafted position for all
        sequences together (the chain in one native call). Fewer than a request's n_min tokens are
        not worth a verify: it gets nothing."""
        self._batch.clear()
        active = []  # (request, position of its first drafted row)
        for rq in requests:
            rows = self._pending[rq.seq_id]
            n = min(rq.n_max, self.n_max_limit)
            if not len(rows) or n <= 0:
                continue
            placed, n_placed = _lay_out(rows, rq.draft_pos)
            if n_placed != len(rows) or placed.pos[-1] != rq.draft_pos - 1:
                continue  # the held-back row is not where this sequence ends: nothing to draft from
            pos = placed.pos
            seed = _Rows(np.append(placed.tokens[1:], rq.id_last).astype(np.int32), placed.g, pos, placed.pinned)
            self._start_at(rq.seq_id, int(pos[0]))
            outputs = np.zeros(len(seed), dtype=bool)
            outputs[-1] = True
            self._batch.add_tokens_with_states(seed.tokens, seed.pos, seed.g, outputs=outputs, seq_id=rq.seq_id)
            self._log("seed", rq.seq_id, int(pos[0]), len(rows))
            # the seed rows are now in the draft's cache; the last stays held back (its partner, id_last,
            # is only a guess until the target verifies: a rollback rewrites it)
            self._pending[rq.seq_id] = placed[-1:]
            active.append((rq, n))
        drafted = {rq.seq_id for rq, _ in active}
        # every further step feeds the drafted token with the decoder's own pre-norm output (as g)
        # at the next position: one native call for the whole chain (bindings: Context.draft_chain)
        chains = self.ctx.draft_chain(self._batch, [rq.seq_id for rq, _ in active],
                                      [rq.draft_pos for rq, _ in active], [n for _, n in active],
                                      p_min=self.p_min, top_k=DRAFT_TOP_K, feed_states=True)
        proposals = {rq.seq_id: chain for (rq, _), chain in zip(active, chains)}
        out = []
        for rq in requests:
            toks, rows = proposals.get(rq.seq_id, ([], None))
            if rq.seq_id in drafted:
                # the drafted rows are guesses: drop them before the target verifies
                self.ctx.memory.remove(rq.seq_id, rq.draft_pos, -1)
            if len(toks) < max(rq.n_min, 1):
                out.append(Proposal([]))
            else:
                out.append(Proposal(toks, rows))
        return out

    def close(self) -> None:
        self._batch.close()
        self.ctx.close()

    # --- parts
    def _leave_out(self, r: TargetRows) -> None:
        """``writes_media`` False: a picture's rows never reach the draft. Its 1-D cache cannot hold the
        gap they leave, and the held-back row before them would be written with the first token after
        them as its partner, so the sequence starts afresh after the picture (what came before it goes)."""
        self.forget(r.seq_id, 0, 0)
        self._log("skip", r.seq_id, int(r.first_draft_pos), r.n_rows)

    def _own_tokens(self, r: TargetRows) -> np.ndarray:
        """Each row's own input token: the text token, or the image placeholder for a media row."""
        if r.has_embeddings or r.tokens is None:
            return np.full(r.n_rows, self._media_token, dtype=np.int32)
        return np.asarray(r.tokens, dtype=np.int32)

    @staticmethod
    def _positions(r: TargetRows) -> tuple[np.ndarray, np.ndarray]:
        """Draft positions of the rows (see the module docstring) and which are pinned."""
        n = r.n_rows
        if r.draft_positions != "target":
            return r.first_draft_pos + np.arange(n, dtype=np.int32), np.zeros(n, bool)
        if r.pinned or r.has_embeddings:
            # an image's rows share section 0's first position (pinned or not: its other sections
            # advance): a run that _lay_out spreads over the positions the image spans
            return np.full(n, int(r.section0[0]), dtype=np.int32), np.ones(n, bool)
        return np.asarray(r.section0, dtype=np.int32).copy(), np.zeros(n, bool)

    def _encode(self, feats: np.ndarray) -> np.ndarray:
        """The encoder's g rows for target features [n, 3 x n_embd_target], in chunks of one ubatch."""
        out = np.empty((len(feats), self._n_embd), dtype=np.float32)
        step = self.ctx.n_ubatch
        for s in range(0, len(feats), step):
            chunk = feats[s:s + step]
            self._batch.clear()
            # the per-row encoder reads no positions, but llama.cpp checks them against sequence 0's
            # cache (which the encoder leaves alone): placeholders after its end, as upstream does
            pos0 = self.ctx.memory.pos_max(0) + 1
            self._batch.add_embeddings(chunk, np.arange(pos0, pos0 + len(chunk), dtype=np.int32), outputs=True)
            self.ctx.encode(self._batch)
            out[s:s + len(chunk)] = self.ctx.draft_embeddings(len(chunk))
        self._batch.clear()
        return out

    def _write(self, writes: list[tuple[int, _Rows]]) -> None:
        """Decode (partner token, g) rows into the draft's cache, every sequence in one batch when it fits."""
        self._batch.clear()
        limit = self.ctx.n_batch
        for seq, rows in writes:
            self._start_at(seq, int(rows.pos[0]))
            s = 0
            while s < len(rows):
                e = min(s + limit, len(rows))
                # never split rows that share a position between two decodes: the second would
                # start at the position the first ended at, which a 1-D cache refuses
                while e < len(rows) and e > s + 1 and rows.pos[e] == rows.pos[e - 1]:
                    e -= 1
                if e == s + 1 and e < len(rows) and rows.pos[e] == rows.pos[s]:
                    e = min(s + limit, len(rows))  # one position holds more rows than a batch: llama.cpp will say so
                part, s = rows[s:e], e
                if self._batch.n_rows + len(part) > limit:
                    self.ctx.decode(self._batch)
                    self._batch.clear()
                self._batch.add_tokens_with_states(part.tokens, part.pos, part.g, seq_id=seq)
                self._log("write", seq, int(part.pos[0]), len(part))
        if self._batch.n_rows:
            self.ctx.decode(self._batch)
        self._batch.clear()

    def _start_at(self, seq: int, first: int) -> None:
        """Make the sequence's draft cache end right before ``first``, where rows are about to go."""
        self.ctx.memory.remove(seq, first, -1)  # a row written before (a draft's seed) is written again
        if self.ctx.memory.pos_max(seq) != first - 1:
            # a 1-D cache keeps positions consecutive: after a gap (the row before was lost to a
            # rollback) the sequence starts afresh in the draft, which only costs acceptance
            self.ctx.memory.remove(seq, -1, -1)
            self._log("restart", seq, first, 0)

    def _log(self, call: str, seq: int, pos: int, n_rows: int) -> None:
        if self.trace is not None:
            self.trace.append(TraceEvent(call, seq, pos, n_rows))
