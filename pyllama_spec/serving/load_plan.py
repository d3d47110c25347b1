"""What the Engine decides before and while it loads, apart from the loading itself.

``plan_load`` runs before anything native is allocated: it refuses a bad file, a context past
the target's training length, device options that do not fit (bindings/devices.py; RPC servers
are reached here) and a configuration the devices cannot hold (``estimate_memory``: the target's
parts and the drafting method's own, gguf/memory.py and drafters/registry.py), and resolves
``n_ctx=0`` to the training length. ``plan_drafts`` runs once the target and the draft are
loaded and paired: how far one draft may go, and the rollback snapshots a recurrent target needs.
"""

from __future__ import annotations

import dataclasses
import warnings

from pyllama_spec.bindings import devices
from pyllama_spec.bindings.model import Model, check_gguf_file
from pyllama_spec.drafters.registry import MemorySettings, Method, Pairing
from pyllama_spec.errors import InsufficientMemoryError, ModelFileError, TrainingLengthWarning
from pyllama_spec.gguf import memory
from pyllama_spec.gguf.reader import read_gguf_shared
from pyllama_spec.serving.config import EngineConfig


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    config: EngineConfig  # as given, with n_ctx=0 resolved to the training length
    placement: devices.EnginePlacement  # where the target's and the draft's layers go
    memory_estimate: memory.Estimate  # what the configuration needs, as checked against the devices


def plan_load(config: EngineConfig, method: Method | None) -> LoadPlan:
    """Check ``config`` against its files and devices; raise before anything is allocated."""
    c = config
    for path, what in ((c.model, "target model"), (c.draft, "draft model"), (c.mmproj, "mmproj"),
                       (c.mmproj_draft, "draft mmproj")):
        if path is not None:
            check_gguf_file(path, what)  # a clear error for a bad file comes first
    info = read_gguf_shared(c.model)
    for path, what, setting in ((c.model, "the target model", "model (-m)"), (c.draft, "the draft", "draft (-md)")):
        if path is not None and (info if path == c.model else read_gguf_shared(path)).arch == "clip":
            raise ModelFileError(f"{path} is a projector (an mmproj file), not a model: it cannot be {what}; pass it "
                                 f"as mmproj=... (--mmproj{' or --mmproj-draft' if path == c.draft else ''}) and a "
                                 f"language model as {setting}")
    n_ctx_train = int(info.metadata.get(f"{info.arch}.context_length", 0) or 0)
    if c.n_ctx == 0 and n_ctx_train:  # llama.cpp's -c 0: the model's training length
        c = dataclasses.replace(c, n_ctx=n_ctx_train)
    # each slot's positions start at 0; in one pool for every slot (kv_unified) a slot may take it all
    per_slot = c.n_ctx if c.kv_unified else c.n_ctx // c.n_parallel
    if n_ctx_train and per_slot > n_ctx_train:
        slots = "" if c.n_parallel == 1 or c.kv_unified else f" per slot ({c.n_parallel} slots share n_ctx {c.n_ctx})"
        fitting = n_ctx_train if c.kv_unified else n_ctx_train * c.n_parallel  # the n_ctx that keeps within it
        if "position_embd.weight" in info.tensors:
            # learned absolute positions (BERT, GPT-2, ...): a row past the table would abort in ggml's
            # get_rows, so the context is cut to the table (the default -c 4096 on a 512-row BERT too)
            warnings.warn(f"n_ctx {per_slot}{slots} is above the target's training length ({n_ctx_train} tokens, "
                          f"{info.arch}.context_length), and its positions are a learned table of that many rows: "
                          f"n_ctx is {fitting} (-c {fitting})", TrainingLengthWarning, stacklevel=4)
            c = dataclasses.replace(c, n_ctx=fitting)
        else:
            # RoPE: llama.cpp warns and goes on ("possible training context overflow"), and so does
            # llama-server: a context longer than training is the user's call, which the warning informs
            warnings.warn(f"n_ctx {per_slot}{slots} is above the target's training length ({n_ctx_train} tokens, "
                          f"{info.arch}.context_length): positions past it were never trained, and text there may "
                          f"degrade; n_ctx={fitting} (-c {fitting}) or "
                          "n_ctx=0 (-c 0) keeps within it", TrainingLengthWarning, stacklevel=4)
    placement = devices.plan(c, draft_uses_target_head=bool(method and method.uses_target_head))
    est = estimate_memory(c, method)
    budget = placement.memory_budget(c.n_gpu_layers)  # (device(s), free bytes)
    if budget is not None and budget[1] and not est.fits(budget[1]):
        what = "the target alone" if method is None else f"the target with {method.title} (spec_type {method.name})"
        draft_cache = ", -ctkd/-ctvd for the draft's cache" if any(p.kv for p in est.parts[1:]) else ""
        raise InsufficientMemoryError(
            f"this configuration ({what}) needs about {est.total / memory.MiB:.0f} MiB but {budget[0]} has "
            f"{budget[1] / memory.MiB:.0f} MiB free: {est.describe()}. Lower -c (n_ctx), use a quantized "
            f"KV cache (-ctk/-ctv q8_0 with -fa on{draft_cache}), or a smaller -ub")
    return LoadPlan(config=c, placement=placement, memory_estimate=est)


def estimate_memory(config: EngineConfig, method: Method | None) -> memory.Estimate:
    """What ``config`` needs, part by part, from the files alone: the target's, the drafting method's
    own (its registry entry's ``memory_parts``: a draft's weights and caches, a draft's projector, a
    head's context) and the projector's. ``load()`` checks it against the devices; ``pyllama-spec
    doctor`` prints it."""
    c = config
    parts = []
    if method is not None:
        parts = method.memory_parts(MemorySettings(
            target=c.model, draft=c.draft, mmproj_draft=c.mmproj_draft, n_ctx=c.n_ctx, n_batch=c.n_batch,
            n_ubatch=c.n_ubatch, n_seq=c.n_parallel, cache_type_k=c.cache_type_k_draft or c.cache_type_k,
            cache_type_v=c.cache_type_v_draft or c.cache_type_v))
    return memory.estimate(c.model, mmproj=c.mmproj, n_ctx=c.n_ctx, n_ubatch=c.n_ubatch, cache_type_k=c.cache_type_k,
                           cache_type_v=c.cache_type_v, method_parts=parts)


@dataclasses.dataclass(frozen=True)
class DraftPlan:
    draft_max: int  # the most tokens one draft proposes (0: no drafting)
    n_rs_seq: int  # recurrent-state snapshots per sequence, one per position a draft may roll back


def plan_drafts(config: EngineConfig, target: Model, pairing: Pairing | None) -> DraftPlan:
    """How far drafts go, given the pairing's limit; refuse a draft tree the target or draft cannot take."""
    c = config
    limit = pairing.limit if pairing else 0
    # With "auto" the drafter may draft up to its limit; each step's length is planned (draft_length.py).
    # None: the method's own length (an n-gram type's setting), which its drafter holds to.
    draft_max = (limit if c.draft_max in ("auto", None) else min(c.draft_max, limit)) if pairing else 0
    n_rs_seq = 0
    # A recurrent/hybrid target rolls back rejected drafts through state snapshots: one per
    # position that may be rolled back (llama.cpp also needs n_ubatch > n_rs_seq + 1).
    if draft_max and target.is_recurrent:
        n_rs_seq = min(draft_max, c.n_ubatch - 2)
        if n_rs_seq < 1:
            raise ValueError(f"a recurrent target needs n_ubatch >= 3 to roll back drafts, got {c.n_ubatch}")
        draft_max = n_rs_seq
    if c.draft_tree:
        if target.is_recurrent:
            raise ValueError("draft_tree needs an attention-only target: a recurrent state cannot hold "
                             "several branches at once")
        if not pairing.per_position_logits:
            raise ValueError(f"draft_tree needs the draft's distribution at every drafted position; this "
                             f"{c.spec_type} pairing has none (draft {c.draft})")
    return DraftPlan(draft_max=draft_max, n_rs_seq=n_rs_seq)
