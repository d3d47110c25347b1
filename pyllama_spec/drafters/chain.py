"""Several speculative types at once (llama-server's ``--spec-type ngram-mod,draft-mtp``).

As llama.cpp's ``common_speculative_draft``: the drafters are asked in priority order (the
n-gram types first, then the one with a draft or head; registry.PRIORITY), each for the
sequences no earlier one drafted for, and the first non-empty draft wins. Every drafter sees
every decode, begin and forget, so each keeps its own history; ``accept`` goes to the drafter
whose draft was verified (llama.cpp tells the others ``is_other``, which no drafter here uses).

Each drafter drafts up to its own length: a request's ``n_max`` is the budget (what is left of
the answer, the cache, the batch, or the request's ``speculative.n_max``), and the chain's own
``n_max`` is the longest of its drafters'.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from pyllama_spec.drafters import Drafter, DraftRequest, Proposal, TargetDecode


class ChainDrafter:
    def __init__(self, drafters: Sequence[Drafter]) -> None:
        self.drafters = tuple(drafters)
        self.name = ",".join(d.name for d in self.drafters)
        self.n_max = max(d.n_max for d in self.drafters)
        self.n_min = min(d.n_min for d in self.drafters)
        self._last: dict[int, Drafter] = {}  # seq_id -> the drafter of its last non-empty draft

    @property
    def n_max_limit(self) -> int:
        return max(d.n_max_limit for d in self.drafters)

    @n_max_limit.setter
    def n_max_limit(self, limit: int) -> None:  # rollback snapshots bound every drafter's reach
        for d in self.drafters:
            d.n_max_limit = min(d.n_max_limit, limit)
            d.n_max = min(d.n_max, limit)
        self.n_max = max(d.n_max for d in self.drafters)

    @property
    def limit_reason(self) -> str:
        return next((d.limit_reason for d in self.drafters if d.n_max_limit == self.n_max_limit), "")

    def process(self, decode: TargetDecode) -> None:
        for d in self.drafters:
            d.process(decode)

    def begin(self, seq_id: int) -> None:
        for d in self.drafters:
            if hasattr(d, "begin"):
                d.begin(seq_id)

    def draft(self, requests: Sequence[DraftRequest]) -> list[Proposal]:
        made: dict[int, Proposal] = {}
        for d in self.drafters:
            waiting = [i for i in range(len(requests)) if i not in made]
            if not waiting:
                break
            asked = [dataclasses.replace(requests[i], n_max=min(requests[i].n_max, d.n_max)) for i in waiting]
            for i, proposal in zip(waiting, d.draft(asked)):
                if len(proposal):
                    made[i] = proposal
                    self._last[requests[i].seq_id] = d
        return [made.get(i, Proposal([])) for i in range(len(requests))]

    def accept(self, seq_id: int, n_accepted: int) -> None:
        if hasattr(self._last.get(seq_id), "accept"):
            self._last[seq_id].accept(seq_id, n_accepted)

    def forget(self, seq_id: int, pos: int, draft_pos: int) -> None:
        for d in self.drafters:
            d.forget(seq_id, pos, draft_pos)

    def close(self) -> None:
        for d in self.drafters:
            d.close()
