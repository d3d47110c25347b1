"""The prompt cache in host memory: llama-server's ``--cache-ram``.

A slot's cache holds one conversation. When a request takes a slot whose cache it shares little
with (another conversation, on a server with fewer slots than conversations), what the slot
held would be lost: instead it is copied here first (the target's memory of the sequence, as
llama.cpp serializes it, with the parts it holds), and the entry that shares most with the new
prompt, if better than what the slot holds, is put back into the slot. So an agent that
alternates between conversations, or a harness that runs many on one slot, pays for each
prompt once, as with llama-server (``server_prompt_cache`` in tools/server/server-task.cpp,
whose rules this follows):

* an entry is taken when a slot would keep less than half of what it holds, when the prompt
  shares too little with any slot for one to be picked by it (llama-server's
  ``--slot-prompt-similarity``, 0.1: the least recently used slot is taken), or when a slot the
  request names holds something else;
* a slot's cache already held whole by an entry is not copied again; entries held whole by the
  new copy go;
* an entry is loaded only when it keeps more of its own rows and more of the prompt than the
  slot does, and never when the prompt would keep less than a quarter of it (a large entry is
  not spent on a small prefix); a loaded entry leaves the cache (it is in the slot again);
* the oldest entries go when the total passes the size limit, or the rows pass the token limit
  (the context's size, raised to what the size limit holds at the entries' mean size per row).

With ``cache_idle_slots`` (llama-server's default) every idle slot is copied here when a request
starts, so a slot another request takes later can be restored; where the slots share one pool
of cells (``--kv-unified``) they are then emptied, their cells going to the busy slots, as
llama-server does. The entry a request takes is chosen first (and taken out of the cache), as
llama-server chooses it, but loaded into the slot after the idle slots were emptied: in one pool
of cells its rows then go low, not above the idle slots' (llama.cpp's attention reads every cell
up to the last one used).
A recurrent or hybrid target's state cannot be cut back, so for one an entry is loaded only when
the prompt extends all of it.

What this does not keep: the drafter's state. A restored slot's drafter starts from the rows
decoded after the restore (``Sequence.restore_state``): its first drafts see less of the
conversation, the text is the same. An entry is loaded only into a slot whose LoRA scales and
draft position mode are the ones it was decoded under.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pyllama_spec.errors import KVMemoryError
from pyllama_spec.speculative.sequence import SavedSequence, rows_of, shared_rows

if TYPE_CHECKING:
    from pyllama_spec.speculative.sequence import Sequence

log = logging.getLogger("pyllama_spec.prompt_cache")

MIB = 1 << 20
#: llama-server's --slot-prompt-similarity: a slot is picked by the prompt's likeness to its cache
#: above this share of the prompt; below it the slot is taken as any other (and its cache saved).
SLOT_PROMPT_SIMILARITY = 0.1


@dataclass(eq=False)  # an entry is itself (its parts are numpy arrays: no == between them)
class Entry:
    saved: SavedSequence = field(repr=False)  # (its memory may be hundreds of MB)
    lora_scales: tuple[float, ...]
    rows: int

    @property
    def size(self) -> int:
        return len(self.saved.memory)


class PromptCache:
    """Saved slot caches, oldest first, within ``limit_mib`` MiB (-1: no limit) and ``limit_rows``
    cache rows (0: no limit; raised to what the size limit holds). Not thread-safe: the slot
    loop's turn uses it."""

    def __init__(self, limit_mib: int, limit_rows: int) -> None:
        if limit_mib == 0:
            raise ValueError("a prompt cache of 0 MiB is no cache: do not make one")
        self.limit_bytes = 0 if limit_mib < 0 else limit_mib * MIB
        self.limit_rows = limit_rows
        self.entries: collections.deque[Entry] = collections.deque()
        self.size = 0  # bytes of all entries
        self.rows = 0  # cache rows of all entries

    def _add(self, entry: Entry) -> None:
        self.entries.append(entry)
        self.size += entry.size
        self.rows += entry.rows

    def _drop(self, entry: Entry) -> None:
        self.entries.remove(entry)
        self.size -= entry.size
        self.rows -= entry.rows

    def _drop_oldest(self) -> None:
        self._drop(self.entries[0])

    # ------------------------------------------------------------------ the two operations
    def save(self, seq: "Sequence", lora_scales: tuple[float, ...]) -> bool:
        """Copy what ``seq`` holds into the cache; False when there is nothing to copy, an entry
        holds it all already, or it alone passes the size limit."""
        cached = seq.cached
        if not cached:
            return False
        rows, mode = seq.positions.n_rows, seq.positions.draft_positions
        held_whole = []  # entries the new one holds whole: of no more use once it is in
        for e in self.entries:
            if e.lora_scales != lora_scales or e.saved.draft_positions != mode:
                continue
            shared = shared_rows(e.saved.parts, cached)
            if shared == rows:
                return False  # (llama-server: "prompt is already in the cache")
            if shared == e.rows:
                held_whole.append(e)
        try:
            size = seq.ctx.memory.seq_size(seq.seq_id)
            if self.limit_bytes and size > self.limit_bytes:
                log.warning("prompt cache: slot %d's %d rows take %.1f MiB, more than the cache's %.0f MiB: "
                            "not saved", seq.seq_id, rows, size / MIB, self.limit_bytes / MIB)
                return False
            for e in held_whole:
                self._drop(e)
            while self.entries and self.limit_bytes and self.size + size > self.limit_bytes:
                self._drop_oldest()
            saved = seq.save_state()
        except KVMemoryError as e:  # this context cannot save the sequence: the request goes on without
            log.warning("prompt cache: slot %d could not be saved: %s", seq.seq_id, e)
            return False
        except MemoryError:  # as llama-server: the host is fuller than the limit said; hold less from now on
            self.limit_bytes = max(1, int(0.4 * self.size))
            log.warning("prompt cache: out of host memory saving slot %d: the limit is now %.1f MiB",
                        seq.seq_id, self.limit_bytes / MIB)
            self.trim()
            return False
        self._add(Entry(saved, tuple(lora_scales), rows))
        log.debug("prompt cache: saved slot %d, %d rows, %.2f MiB", seq.seq_id, rows, size / MIB)
        return True

    def best_for(self, seq: "Sequence", parts: list, lora_scales: tuple[float, ...],
                 draft_positions: str) -> Entry | None:
        """The entry that keeps more of ``parts`` and of itself than ``seq`` does, if any."""
        n_new = max(rows_of(parts), 1)
        have = seq.positions.n_rows
        lcp = seq.prefix_length(parts)
        best_keep = lcp / have if have else -1.0  # an empty slot: any entry is better
        best_sim = lcp / n_new
        best: Entry | None = None
        # A recurrent state cannot be cut back: an entry it would have to cut (one holding more
        # than the prompt shares with it) would be restored only to be reset.
        whole_only = seq.ctx.model.is_recurrent
        for e in self.entries:
            if e.lora_scales != lora_scales or e.saved.draft_positions != draft_positions:
                continue
            shared = shared_rows(e.saved.parts, parts)
            keep, sim = shared / max(e.rows, 1), shared / n_new
            if keep < 0.25 or (whole_only and not shared == e.rows < n_new):
                continue  # don't spend a large entry on a small prefix
            if keep > best_keep and sim > best_sim:
                best, best_keep, best_sim = e, keep, sim
        return best

    def take(self, entry: Entry) -> None:
        """Take ``entry`` out of the cache, to ``load`` it into a slot (later saves cannot drop it)."""
        self._drop(entry)

    def put_back(self, entry: Entry) -> None:
        """An entry taken and not loaded after all: back into the cache, as the newest."""
        self._add(entry)

    def load(self, seq: "Sequence", entry: Entry) -> bool:
        """Put a taken ``entry`` into ``seq``; False when the target refuses its memory (KVMemoryError:
        the entry is gone and ``seq`` left empty)."""
        try:
            seq.restore_state(entry.saved)
        except KVMemoryError as e:
            log.warning("prompt cache: slot %d refused a saved prompt of %d rows (%s): dropped",
                        seq.seq_id, entry.rows, e)
            return False
        log.debug("prompt cache: restored %d rows into slot %d", entry.rows, seq.seq_id)
        return True

    def clear(self) -> None:
        self.entries.clear()
        self.size = self.rows = 0

    def trim(self) -> None:
        """Drop the oldest entries past the limits (llama-server's ``update``)."""
        while self.entries and self.limit_bytes and self.size > self.limit_bytes:
            self._drop_oldest()
        per_row = max(1.0, self.size / max(1, self.rows))
        limit_rows = max(self.limit_rows, int(self.limit_bytes / per_row)) if self.limit_bytes else self.limit_rows
        while self.entries and limit_rows and self.rows > limit_rows:
            self._drop_oldest()
        log.debug("prompt cache: %d prompts, %d rows, %.2f MiB", len(self.entries), self.rows, self.size / MIB)


def takes_cache_update(seq: "Sequence", parts: list, named_slot: bool) -> bool:
    """Whether a request for ``parts`` taking ``seq`` goes through the cache (llama-server's
    ``update_cache`` in get_available_slot): when the slot would keep less than half of what it
    holds; when the prompt is too unlike the slot's cache to have picked it and the request did
    not name its slot (the least recently used slot); and when a named slot holds something else."""
    have = seq.positions.n_rows
    lcp = seq.prefix_length(parts)
    if have and lcp / max(rows_of(parts), 1) > SLOT_PROMPT_SIMILARITY:
        return lcp / have < 0.5
    return bool(have) if named_slot else True
