"""DSpark (llama.cpp's ``draft-dspark``): a DFlash draft with a Markov head, drafted anchor-first.

A DSpark file is a DFlash draft (drafters/dflash.py: the target's layer inputs injected, a block
decoded non-causally) carrying ``markov_w1`` / ``markov_w2``: in the draft's graph each block
position's logits get a bias from the token before it (the previous position's argmax, chained
through the block), and, with ``conf_proj``, a confidence per position (llama.cpp cuts a draft
where it falls below ``p_min``). Its block is anchor-first: ``[id_last, mask x (n - 1)]``, and
every row, the anchor's included, drafts a token, so a draft may be as long as the block
(``dflash.sample_from_anchor`` false: the anchor's row is a bonus and drafts nothing, as DFlash).
The graph needs every block of a decode the same size: slots asking different lengths get a
draft decode per length.

llama.cpp picks this type for a draft with a Markov head when no ``--spec-type`` is given; so
does ``load`` (registry.default_spec_type).
"""

from __future__ import annotations

from pyllama_spec.drafters import dflash
from pyllama_spec.errors import IncompatibleModelsError

memory_parts = dflash.memory_parts  # the same draft context as DFlash's


def check_pair(target, draft, build_record: dict):
    """The registry's pairing check (registry.py): DFlash's, and a Markov head."""
    from pyllama_spec.drafters.registry import Pairing

    cfg = dflash.check_dflash_pair(target, draft, build_record.get("dflash_target_archs"))
    if not cfg.markov:
        raise IncompatibleModelsError(f"the draft {draft.path.name} is a DFlash draft without DSpark's Markov head "
                                      "(markov_w1.weight): load it with spec_type='draft-dflash'")
    if cfg.is_dflash2:
        raise IncompatibleModelsError(f"the draft {draft.path.name} has both a DFlash2 selector and a Markov head: "
                                      "llama.cpp reads it as neither")
    limit = cfg.block_size if cfg.sample_from_anchor else cfg.block_size - 1
    return Pairing(limit=limit, per_position_logits=True, data=cfg, target_layers=cfg.target_layers)


def make(setup) -> "dflash.DFlashDrafter":
    """The registry's constructor (registry.py)."""
    return dflash.make(setup, dspark=True)
