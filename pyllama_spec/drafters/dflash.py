"""DFlash (and DFlash2) drafting: a block-diffusion draft conditioned on target layer inputs.

The draft has no token embedding or output head of its own: its context borrows the
target's (``ctx_other``). After every target decode, the inputs of the draft's
``target_layers`` are gathered for the decoded rows and injected into the draft's
cache at the same positions (``process``). A draft block ``[id_last, mask x n]`` is
then decoded non-causally at the sequence's next position and read out (``draft``).

Two rules keep this working after images:

* a media batch whose rows are pinned to one position (M-RoPE image) is not injected
  into a windowed draft cache: it could not free cells and would overflow;
* every draft block starts at the sequence's ``pos_next`` (or, in "sequential" mode,
  at the draft's own next position), never at a token count.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from pyllama_spec.bindings.batch import Batch
from pyllama_spec.bindings.context import Context
from pyllama_spec.bindings.model import Model
from pyllama_spec.drafters import DraftRequest, Proposal, TargetDecode, TraceEvent
from pyllama_spec.drafters.registry import wrong_draft_kind
from pyllama_spec.errors import IncompatibleModelsError

DEFAULT_BLOCK_SIZE = 16
DRAFT_TOP_K = 10  # upstream reads the draft's choice through a top-k 10 sampler


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """Facts read from a DFlash draft file."""

    target_layers: tuple[int, ...]
    block_size: int
    mask_token: int
    sliding_window: int
    causal: bool
    selector_top_k: int  # > 0: DFlash2 (drafts read from the selector lattice)
    markov: bool = False  # a Markov head (markov_w1): a DSpark draft (drafters/dspark.py)
    sample_from_anchor: bool = True  # DSpark: the anchor's row drafts too (dflash.sample_from_anchor)

    @property
    def is_dflash2(self) -> bool:
        return self.selector_top_k > 0

    @classmethod
    def read(cls, draft: Model) -> "DFlashConfig":
        block = draft.meta("dflash.block_size")
        causal = draft.meta("dflash.attention.causal")
        anchor = draft.meta("dflash.sample_from_anchor")
        return cls(target_layers=tuple(draft.target_layer_ids),
                   block_size=int(block) if block else DEFAULT_BLOCK_SIZE,
                   mask_token=draft.mask_token, sliding_window=draft.n_swa,
                   causal=causal == "true", selector_top_k=draft.dflash_selector_top_k,
                   markov=has_markov_head(_tensors(draft)),
                   sample_from_anchor=anchor is None or anchor == "true")


def _tensors(model: Model):
    from pyllama_spec.gguf.reader import read_gguf_shared

    return read_gguf_shared(model.path).tensors


def has_markov_head(tensors) -> bool:
    """A DFlash file with DSpark's Markov head (llama.cpp tells draft-dspark from draft-dflash so)."""
    from pyllama_spec.drafters.registry import MARKOV_HEAD_TENSOR

    return MARKOV_HEAD_TENSOR in tensors


def check_dflash_pair(target: Model, draft: Model, dflash_target_archs: list[str] | None) -> DFlashConfig:
    """Refuse, before any context exists, every pairing that would abort natively or cannot work."""
    if draft.arch != "dflash":
        raise IncompatibleModelsError(wrong_draft_kind(draft.path.name, draft.arch, "draft-dflash"))
    cfg = DFlashConfig.read(draft)
    if cfg.is_dflash2:
        from pyllama_spec.gguf.writer import read_gguf_metadata

        if "selector_hidden.weight" not in read_gguf_metadata(draft.path, with_tensors=True)["__tensors__"]:
            raise IncompatibleModelsError(f"the draft {draft.path.name} has dflash.selector_top_k but no "
                                          "selector_hidden.weight: not a DFlash2 draft")
    if dflash_target_archs is not None and target.arch not in dflash_target_archs:
        raise IncompatibleModelsError(
            f"the target architecture {target.arch!r} does not record its layer inputs in this build, so a "
            f"DFlash draft cannot read features from it (llama.cpp would abort). Targets that can: "
            f"{', '.join(dflash_target_archs)}. See patches/README.md.")
    if not cfg.target_layers:
        raise IncompatibleModelsError(f"the draft {draft.path.name} records no dflash.target_layers")
    bad = [lid for lid in cfg.target_layers if not 0 <= lid < target.n_layer]
    if bad:
        raise IncompatibleModelsError(
            f"the draft reads target layers {list(cfg.target_layers)}, but the target {target.path.name} has "
            f"{target.n_layer} layers (entries {bad} do not exist)")
    if 0 in cfg.target_layers and getattr(target, "n_embd_inp", target.n_embd) != target.n_embd:
        # Layer 0's input is a strided view of a wider input (Qwen3-VL deepstack); reading it aborts.
        raise IncompatibleModelsError(
            f"the draft reads target layer 0, whose input on this {target.arch} target is wider than n_embd "
            f"({target.n_embd_inp} vs {target.n_embd}, deepstack): llama.cpp cannot extract it")
    if draft.n_embd != target.n_embd:
        raise IncompatibleModelsError(f"draft n_embd {draft.n_embd} != target n_embd {target.n_embd}: "
                                      "this draft was trained for another target")
    if draft.n_vocab != target.n_vocab:
        raise IncompatibleModelsError(f"draft vocabulary ({draft.n_vocab} tokens) != target vocabulary "
                                      f"({target.n_vocab} tokens)")
    if cfg.mask_token < 0:
        raise IncompatibleModelsError(f"the draft {draft.path.name} has no mask token "
                                      "(tokenizer.ggml.mask_token_id): DFlash blocks need one")
    if cfg.block_size < 2:
        raise IncompatibleModelsError(f"dflash.block_size {cfg.block_size} is too small")
    return cfg


def memory_parts(settings) -> list:
    """The registry's memory parts (registry.py): the draft's weights, its cache (its window's cells)
    and the compute buffer of a ubatch that holds every sequence's block; its output rows are the
    target's vocabulary (it borrows the target's head, whose weights the target counts)."""
    from pyllama_spec.gguf import memory
    from pyllama_spec.gguf.reader import read_gguf_shared

    block = read_gguf_shared(settings.draft).metadata.get("dflash.block_size") or DEFAULT_BLOCK_SIZE
    return [memory.model_part("draft", settings.draft, n_ctx=settings.n_ctx,
                              n_ubatch=max(settings.n_ubatch, int(block) * settings.n_seq),
                              type_k=settings.cache_type_k, type_v=settings.cache_type_v,
                              n_vocab_out=memory.vocabulary_size(settings.target), live=(1, 2))]


def check_pair(target: Model, draft: Model, build_record: dict):
    """The registry's pairing check (registry.py): a block of ``block_size`` holds ``id_last`` and at
    most ``block_size - 1`` drafted tokens; DFlash2 walks its own lattice (no per-position logits)."""
    from pyllama_spec.drafters.registry import Pairing

    cfg = check_dflash_pair(target, draft, build_record.get("dflash_target_archs"))
    if cfg.markov:
        raise IncompatibleModelsError(f"the draft {draft.path.name} is a DSpark draft (it has a Markov head): load "
                                      "it with spec_type='draft-dspark' (--spec-type draft-dspark)")
    return Pairing(limit=cfg.block_size - 1, per_position_logits=not cfg.is_dflash2, data=cfg,
                   target_layers=cfg.target_layers)


def make(setup, *, dspark: bool = False) -> "DFlashDrafter":
    """The registry's constructor (registry.py); ``dspark``: DSpark's block layout (drafters/dspark.py)."""
    return DFlashDrafter(setup.target_ctx, setup.draft_model, setup.pairing.data, n_max=setup.n_max,
                         n_seq=setup.n_seq, n_min=setup.n_min, p_min=setup.p_min, n_ubatch=setup.n_ubatch,
                         n_threads=setup.n_threads, flash_attn=setup.flash_attn, swa_full=setup.swa_full,
                         dspark=dspark, **setup.cache_types)


class DFlashDrafter:
    """The DFlash method behind the drafter protocol (see drafters/__init__.py), for ``n_seq`` sequences."""

    name = "dflash"

    def __init__(self, target_ctx: Context, draft_model: Model, config: DFlashConfig, *, n_max: int,
                 n_min: int = 0, p_min: float = 0.0, n_seq: int = 1, n_ubatch: int = 512,
                 n_threads: int | None = None, flash_attn: bool | None = False, swa_full: bool = False,
                 type_k: str = "f16", type_v: str = "f16", dspark: bool = False) -> None:
        self.config = config
        self.target_ctx = target_ctx
        self.n_embd_target = target_ctx.model.n_embd
        # A block is [id_last, mask x n]; the trained block size bounds n. n_max is the
        # default draft length; a request may ask for up to n_max_limit. DSpark's anchor-first
        # block is [id_last, mask x (n - 1)], and every row drafts: n up to the block size.
        self.dspark = dspark
        self._anchor_drafts = dspark and config.sample_from_anchor
        if dspark:
            self.name = "dspark"
        self.n_max_limit = config.block_size if self._anchor_drafts else config.block_size - 1
        self.n_max = max(1, min(n_max, self.n_max_limit))
        self.n_min = min(n_min, self.n_max)
        self.p_min = p_min
        # Non-causal blocks must fit in one ubatch: all slots' blocks go in one draft decode.
        ubatch = max(n_ubatch, config.block_size * n_seq)
        self.ctx = Context(draft_model, n_ctx=target_ctx.n_ctx, n_batch=ubatch, n_ubatch=ubatch, n_seq_max=n_seq,
                           n_threads=n_threads, flash_attn=flash_attn, swa_full=swa_full, type_k=type_k, type_v=type_v,
                           ctx_other=target_ctx, role="draft",
                           kv_unified=target_ctx.kv_unified)
        self.ctx.enable_draft_embeddings(True, masked=not config.is_dflash2)
        self._has_confidence = dspark and "conf_proj.weight" in _tensors(draft_model)
        self.ctx.set_causal_attn(config.causal)
        self._batch = Batch(self.ctx)
        self._n_pos = draft_model.n_pos_per_embd
        self._n_vocab = target_ctx.model.n_vocab
        self.trace: list[TraceEvent] | None = None  # set to [] to record "inject", "skip" and "draft"

    # --- protocol
    @property
    def limit_reason(self) -> str:
        block = self.config.block_size
        if self._anchor_drafts:
            return f"the draft's block size {block}" if self.n_max_limit == block else ""
        return f"the draft's block size {block} minus one" if self.n_max_limit == block - 1 else ""

    def forget(self, seq_id: int, pos: int, draft_pos: int) -> None:
        self.ctx.memory.remove(seq_id, draft_pos, -1)

    def process(self, decode: TargetDecode) -> None:
        """Inject the target's features for rows it just decoded (skipping pinned media), all sequences
        at once: up to n_ubatch rows a draft decode, in the order of ``decode.rows`` (by slot, as the
        target's batch holds them), a sequence's rows split where a decode is full."""
        step = self.ctx.n_ubatch
        self._batch.clear()
        for r in decode.rows:
            mode_target = r.draft_positions == "target"
            if mode_target and r.pinned:
                self._log("skip", r.seq_id, int(r.section0[0]), r.n_rows)
                continue
            features = decode.features(self.config.target_layers, r)
            pos0 = r.section0 if mode_target else r.first_draft_pos + np.arange(r.n_rows, dtype=np.int32)
            positions = self._draft_positions(pos0)
            at = 0
            while at < r.n_rows:
                n = min(r.n_rows - at, step - self._batch.n_rows)
                self._batch.add_embeddings(features[at:at + n], positions[at:at + n], seq_id=r.seq_id)
                self._log("inject", r.seq_id, int(positions[at, 0]), n)
                at += n
                if self._batch.n_rows == step:
                    self.ctx.decode(self._batch)
                    self._batch.clear()
        if self._batch.n_rows:
            self.ctx.decode(self._batch)

    def draft(self, requests: Sequence[DraftRequest]) -> list[Proposal]:
        """Up to n_max tokens after each request's id_last, every block in one draft decode.

        Fewer than a request's n_min tokens are not worth a verify: then it gets nothing.
        DSpark's Markov head runs on blocks of one size in a decode: requests of different lengths
        get a decode per length (padding a block past its request's length could run past the
        cells its sequence has left).
        """
        lengths = [min(rq.n_max, self.n_max_limit) for rq in requests]
        if self.dspark and len(set(lengths)) > 1:
            made: dict[int, Proposal] = {}
            for n in sorted(set(lengths)):
                mine = [i for i, k in enumerate(lengths) if k == n]
                made.update(zip(mine, self.draft([requests[i] for i in mine])))
            return [made[i] for i in range(len(requests))]
        self._batch.clear()
        blocks = []  # (first output row, n, block position)
        row = 0
        first = 0 if self._anchor_drafts else 1  # the block's first drafting row
        for rq in requests:
            n = min(rq.n_max, self.n_max_limit)
            size = n + first
            pos0 = rq.draft_pos
            tokens = np.full(size, self.config.mask_token, dtype=np.int32)
            tokens[0] = rq.id_last
            self._batch.add_tokens(tokens, np.arange(pos0, pos0 + size, dtype=np.int32),
                                   outputs=not self.config.is_dflash2, seq_id=rq.seq_id)
            self._log("draft", rq.seq_id, pos0, size)
            blocks.append((row, n, pos0))
            row += size
        if not blocks:
            return []
        self.ctx.decode(self._batch)
        proposals = []
        all_logits = None if self.config.is_dflash2 else self.ctx.output_logits(row)
        for rq, (at, n, pos0) in zip(requests, blocks):
            if self.config.is_dflash2:
                tokens, logits = self._read_lattice(n, at), None  # the lattice walk has no per-token distribution
            else:
                # A view, not a copy (n x n_vocab floats every step): the verifier reads it before the
                # draft context decodes again (see Proposal).
                logits = all_logits[at + first:at + first + n]  # row `at` is id_last (DSpark: it drafts too)
                tokens = self._read_block(logits, confidence_rows=(at + first, row) if self.dspark else None)
                logits = logits[:len(tokens)]
            proposals.append(Proposal(tokens, logits) if len(tokens) >= rq.n_min else Proposal([]))
        for rq in requests:
            # The blocks' own rows are noise: drop them before the target verifies.
            self.ctx.memory.remove(rq.seq_id, rq.draft_pos, -1)
        return proposals

    def close(self) -> None:
        self._batch.close()
        self.ctx.close()

    # --- reading a block
    def _read_block(self, logits: np.ndarray, confidence_rows: tuple[int, int] | None = None) -> list[int]:
        """The block's greedy tokens, cut where the draft is unsure under ``p_min``: for DSpark (its
        block's first drafting row and the decode's row count in ``confidence_rows``), where its
        confidence head's estimate falls below it, as llama.cpp; else where the best token's
        probability among the top-k does."""
        n = len(logits)
        best = np.argmax(logits, axis=1)
        if self.p_min <= 0.0:
            return best.tolist()
        if confidence_rows is not None:
            if not self._has_confidence:
                return best.tolist()  # no confidence head: llama.cpp reads the block whole too
            at, n_rows = confidence_rows
            confidence = self.ctx.draft_embeddings(n_rows)[at:at + n, 0]  # broadcast across the row
            low = np.flatnonzero(confidence < self.p_min)
            return best[:low[0] if len(low) else n].tolist()
        # Probability of the best token among the top-k candidates, as upstream's top-k sampler reports it.
        top = np.partition(logits, -DRAFT_TOP_K, axis=1)[:, -DRAFT_TOP_K:]
        p_best = 1.0 / np.exp(top - logits[np.arange(n), best][:, None]).sum(axis=1)
        out = []
        for tok, p in zip(best.tolist(), p_best.tolist()):
            if p < self.p_min:
                break
            out.append(tok)
        return out

    def _read_lattice(self, n: int, at: int = 0) -> list[int]:
        """DFlash2: walk the selector lattice in the block's output embeddings (candidates, then k x k transition scores)
        of the block whose row 0 (id_last) is batch row ``at``."""
        k = self.config.selector_top_k
        lattice = self.ctx.draft_embeddings(at + n + 1)[at:]
        out: list[int] = []
        predecessor = 0
        for i in range(1, n + 1):
            row = lattice[i]
            scores = row[k + predecessor * k: k + (predecessor + 1) * k]
            predecessor = int(np.argmax(scores))
            if self.p_min > 0.0 and 1.0 / np.exp(scores - scores[predecessor]).sum() < self.p_min:
                break
            tok = row[predecessor]
            if not (np.isfinite(tok) and tok == int(tok) and 0 <= tok < self._n_vocab):
                break  # not a token id: never hand the target garbage
            out.append(int(tok))
        return out

    def _draft_positions(self, pos0: np.ndarray) -> np.ndarray:
        """Rows' draft positions as the draft context wants them: the draft ropes on the temporal section."""
        pos0 = np.asarray(pos0, dtype=np.int32)
        if self._n_pos == 1:
            return pos0.reshape(-1, 1)
        out = np.zeros((len(pos0), self._n_pos), dtype=np.int32)
        out[:, :3] = pos0[:, None]
        return out

    def _log(self, call: str, seq: int, pos: int, n_rows: int) -> None:
        if self.trace is not None:
            self.trace.append(TraceEvent(call, seq, pos, n_rows))
