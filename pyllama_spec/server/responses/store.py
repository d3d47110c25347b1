"""The responses kept for ``previous_response_id`` (see the package's doc): each response's
conversation, bounded in count and bytes, the least recently used going first."""

from __future__ import annotations

import collections
import dataclasses
import json


@dataclasses.dataclass(frozen=True, eq=False)
class Turn:
    """One response's share of a conversation: its request's input items, then its output items, kept
    as compact JSON. What it holds in memory is what it counts (as Python objects, a request's items
    took about 24 times the bytes counted for them), and it is parsed back only when continued."""

    data: bytes
    # Its output continued the assistant message the conversation ended with (llama-server prefills a
    # final assistant message), and repeats it whole: that message is left out before this turn.
    continues: bool = False

    @classmethod
    def of(cls, items, *, continues: bool = False) -> "Turn":
        # UTF-8 (not \\u escapes: a CJK character is 3 bytes, not 6); a lone surrogate a client sent
        # is kept as it came
        text = json.dumps(list(items), separators=(",", ":"), ensure_ascii=False)
        return cls(text.encode("utf-8", "surrogatepass"), continues)

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def items(self) -> list:
        return json.loads(self.data.decode("utf-8", "surrogatepass"))


class ResponseStore:
    """Each stored response's conversation (the turns from the first one to its own), for
    ``previous_response_id``; at most ``max_responses`` of them, holding at most ``max_bytes``, the
    least recently used (made or continued) evicted first. A conversation shares its earlier turns
    with the responses it continues, so a turn is counted once however many responses hold it.
    Used on the event loop only."""

    def __init__(self, max_responses: int, max_bytes: int) -> None:
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._conversations: collections.OrderedDict[str, tuple[Turn, ...]] = collections.OrderedDict()
        self._held: dict[int, list] = {}  # id(turn) -> [turn, how many stored conversations hold it]
        self.bytes = 0  # the sizes of the distinct turns held

    def __len__(self) -> int:
        return len(self._conversations)

    def get(self, response_id: str) -> tuple[Turn, ...] | None:
        """The conversation up to and including response ``response_id``'s output, or None."""
        turns = self._conversations.get(response_id)
        if turns is not None:
            self._conversations.move_to_end(response_id)
        return turns

    def put(self, response_id: str, turns: tuple[Turn, ...]) -> bool:
        """Keep ``turns`` as ``response_id``'s conversation, evicting the least recently used ones to
        make room; False (nothing kept) when it alone is over the byte limit."""
        if self.max_responses <= 0 or sum(t.size for t in turns) > self.max_bytes:
            return False
        if response_id in self._conversations:
            self._release(self._conversations.pop(response_id))
        self._conversations[response_id] = turns
        for turn in turns:
            held = self._held.setdefault(id(turn), [turn, 0])
            held[1] += 1
            if held[1] == 1:
                self.bytes += turn.size
        while len(self._conversations) > self.max_responses or self.bytes > self.max_bytes:
            self._release(self._conversations.popitem(last=False)[1])  # never the one just put: it fits alone
        return True

    def _release(self, turns: tuple[Turn, ...]) -> None:
        """One conversation fewer holds ``turns``: those no other holds are freed."""
        for turn in turns:
            held = self._held[id(turn)]
            held[1] -= 1
            if held[1] == 0:
                del self._held[id(turn)]
                self.bytes -= turn.size


def conversation_items(turns: tuple[Turn, ...]) -> list[dict]:
    """The items of a stored conversation, in order (parsed from each turn's JSON: off the event loop
    when large); the message a turn continued gives way to the turn's output, which holds it whole
    (kept twice, the assistant's text doubled at every hop)."""
    out: list = []
    for turn in turns:
        if turn.continues:
            while out and is_assistant_message(out[-1]):
                out.pop()
        out.extend(turn.items)
    return out


def is_assistant_message(item) -> bool:
    return isinstance(item, dict) and item.get("role") == "assistant" and item.get("type") in ("message", None)
