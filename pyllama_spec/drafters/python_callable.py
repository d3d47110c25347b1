"""A draft model written in Python (``spec_type="draft-python"``): llama-cpp-python's
``LlamaDraftModel``, a callable ``draft(input_ids) -> token ids``, run inside the engine's slot loop.

At each step it is called with the sequence's tokens so far and the last sampled one
(``input_ids``: int32, as llama-cpp-python passes ``self.input_ids[:n_tokens]``; a picture's rows
are left out, as llama-server's n-gram drafters see the text alone) and returns the tokens it
proposes; the target verifies them, so the output is the target's whatever it proposes. What it
returns is cut to the step's draft length and at the first value that is not a token id of the
target's vocabulary. An exception it raises ends the generation with that exception. It runs on
the slot loop's thread, one sequence at a time, so it holds up the other slots while it runs:
keep it quick.

Not a llama.cpp type: there is no command-line flag for it (a Python object cannot be named on a
command line); ``pyllama_spec.llama_cpp.Llama(draft_model=...)`` and ``load(draft_callable=...)``.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Sequence

import numpy as np

from pyllama_spec.drafters import DRAFT_TOKEN_LIMIT, DraftRequest, Proposal, token_limit_reason
from pyllama_spec.drafters.token_history import SEPARATOR, HistoryDrafter, no_memory_parts, tokens_only_pairing

memory_parts = no_memory_parts  # the registry's functions (registry.py)


def check_pair(target, draft, build_record: dict):
    return tokens_only_pairing(DRAFT_TOKEN_LIMIT)


def make(setup) -> "CallableDrafter":
    """The registry's constructor (registry.py)."""
    if setup.draft_callable is None:
        raise ValueError('spec_type="draft-python" needs draft_callable= (a function input_ids -> token ids)')
    return CallableDrafter(setup.draft_callable, n_vocab=setup.target_ctx.model.n_vocab, n_max=setup.n_max,
                           n_min=setup.n_min, n_max_limit=setup.pairing.limit)


class CallableDrafter(HistoryDrafter):
    """A Python callable behind the drafter protocol (drafters/__init__.py)."""

    name = "draft-python"

    def __init__(self, draft: Callable[[np.ndarray], Any], *, n_vocab: int, n_max: int, n_min: int = 0,
                 n_max_limit: int = DRAFT_TOKEN_LIMIT) -> None:
        if not callable(draft):
            raise TypeError(f"draft_callable must be callable (input_ids -> token ids), got {type(draft).__name__}")
        self.draft_fn = draft
        self.n_vocab = n_vocab
        self.n_max_limit = n_max_limit
        self.n_max = max(1, min(n_max, n_max_limit))
        self.n_min = min(n_min, self.n_max)
        super().__init__()

    @property
    def limit_reason(self) -> str:
        return token_limit_reason(self.n_max_limit)

    def draft(self, requests: Sequence[DraftRequest]) -> list[Proposal]:
        out = []
        for rq in requests:
            tokens = self._history.tokens(rq.seq_id)
            input_ids = np.append(tokens[tokens != SEPARATOR], np.int32(rq.id_last)).astype(np.intc)
            proposed = self.draft_fn(input_ids)
            if not isinstance(proposed, (np.ndarray, list, tuple)) and not hasattr(proposed, "__iter__"):
                raise TypeError(f"the draft function returned {type(proposed).__name__}: return the proposed token "
                                "ids (an empty array for none)")
            found = []
            # read at most n_max items of whatever iterable it returned (an array, a list, a generator)
            for t in itertools.islice(iter(np.ravel(proposed) if isinstance(proposed, np.ndarray) else proposed),
                                      rq.n_max):
                if isinstance(t, np.generic):
                    t = t.item()
                if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t != int(t) \
                        or not 0 <= t < self.n_vocab:
                    break  # not a token id: never hand the target garbage
                found.append(int(t))
            out.append(Proposal(found if len(found) >= max(rq.n_min, 1) else []))
        return out
