"""Encoding one media item for the target and, with a vision draft model, for the draft too.

A vision draft model (``draft-simple`` with ``mmproj_draft``) reads the same picture through a
projector of its own: the engine pairs each of the target's media chunks with the draft
projector's chunk of the same item (``Chunk.draft``). Each projector encodes its chunk once.
The two encodes run at the same time where that gains something: when either encoder runs on
a GPU (a GPU encode leaves the CPU to the other; two GPU encodes overlap). On a CPU alone
they would share the same cores, so they run one after the other.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from pyllama_spec.errors import ImageError, IncompatibleModelsError


@dataclasses.dataclass(frozen=True)
class EncodedMedia:
    """A media item's embeddings: the target's float32 [n_tokens, n_embd_inp], and the draft
    projector's rows of it (``chunk.draft``'s, at the draft's width) or None without one."""

    target: np.ndarray
    draft: np.ndarray | None = None


def runs_concurrently(*projectors) -> bool:
    """Whether encodes on these projectors are worth running at the same time (see the module)."""
    return any(getattr(p, "on_gpu", False) for p in projectors)


def encode_media(projector, chunk, *, concurrent: bool | None = None) -> EncodedMedia:
    """Encode ``chunk`` with ``projector`` and its draft twin (``chunk.draft``) with the twin's own
    projector. ``concurrent``: run the two encodes at the same time (None: where the hardware
    allows, ``runs_concurrently``). Raises what either encode raises (the target's first)."""
    twin = chunk.draft
    if twin is None:
        return EncodedMedia(projector.encode(chunk))
    draft_projector = twin.projector
    if concurrent is None:
        concurrent = runs_concurrently(projector, draft_projector)
    if not concurrent:
        return EncodedMedia(projector.encode(chunk), draft_projector.encode(twin))
    result: dict = {}

    def encode_twin() -> None:
        try:
            result["draft"] = draft_projector.encode(twin)
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            result["error"] = e

    worker = threading.Thread(target=encode_twin, name="pyllama-spec-encode-draft", daemon=True)
    worker.start()
    try:
        target = projector.encode(chunk)
    finally:
        worker.join()  # the twin's chunk and projector must outlive its encode
    if "error" in result:
        raise result["error"]
    return EncodedMedia(target, result["draft"])


def check_draft_projector(target_projector, draft_projector) -> None:
    """Refuse, at load, a vision draft model's projector that cannot read what the target's reads
    (its width was checked against the draft model when it was loaded: mtmd refuses a mismatch)."""
    name = draft_projector.path.name
    if target_projector is None:
        raise IncompatibleModelsError(f"the draft projector {name} (mmproj_draft) is given but the target has no "
                                      "projector (mmproj): the target would take no pictures to show the draft")
    for what in ("vision", "audio"):
        if getattr(target_projector, f"supports_{what}") and not getattr(draft_projector, f"supports_{what}"):
            raise IncompatibleModelsError(
                f"the target's projector {target_projector.path.name} reads {what}, the draft's {name} does not: "
                f"a vision draft model's projector must read every kind of media the target's does")


def pair_with_draft(parts: list, draft_chunks) -> None:
    """Give every media chunk among the target's prompt ``parts`` its twin (``Chunk.draft``) among
    ``draft_chunks``, the same prompt cut by the draft's projector: the i-th media chunk of one is
    the i-th of the other. ImageError when the two projectors cut the media differently (one that
    slices a large picture into tiles may make more pieces of it than the other): the draft's
    rows of an item could not be laid beside the target's."""
    mine = [p for p in parts if not isinstance(p, np.ndarray)]
    theirs = [c for c in draft_chunks if not c.is_text]
    same = len(mine) == len(theirs) and all(a.type == b.type and a.id == b.id for a, b in zip(mine, theirs))
    if not same:
        raise ImageError(f"the draft's projector cuts this prompt's media into {len(theirs)} piece(s) "
                         f"({', '.join(c.type for c in theirs) or 'none'}), the target's into {len(mine)} "
                         f"({', '.join(c.type for c in mine) or 'none'}): a vision draft model needs a projector "
                         "that cuts every picture into as many pieces as the target's")
    for a, b in zip(mine, theirs):
        a.draft = b
