"""Generation statistics: a dataclass, filled by the engine, printed elsewhere."""

from __future__ import annotations

import dataclasses
import time


@dataclasses.dataclass
class GenerationStats:
    """What one generate/stream call measured.

    ``acceptance_rate`` = accepted / drafted; ``mean_accepted_length`` = tokens gained per
    target decode step of the generation phase (accepted drafts + the target's own token; 1.0 without drafting); ``per_position_acceptance[i]``
    = how often draft token i was accepted when it was drafted.
    """

    # Cache rows the whole prompt takes (reused ones included), not only text tokens: text takes a
    # row per token, an image all its rows (its chunk's n_tokens). The name is kept (a public field).
    prompt_tokens: int = 0
    prompt_positions: int = 0  # positions the prompt spans (fewer than rows with M-RoPE images)
    prompt_reused: int = 0  # cache rows kept from an earlier call (not decoded again)
    generated_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    spec_steps: int = 0  # target verify steps that had a draft
    target_steps: int = 0  # all target decode steps in the generation phase
    per_position_drafted: list[int] = dataclasses.field(default_factory=list)
    per_position_accepted: list[int] = dataclasses.field(default_factory=list)
    images: int = 0
    chat_template: str | None = None  # "jinja" (the model's own), "builtin" (llama.cpp's), None (a raw prompt)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    target_seconds: float = 0.0  # inside native target calls (decode, media encode/decode)
    draft_seconds: float = 0.0  # inside native draft calls (feature injection, draft blocks)
    decode_target_seconds: float = 0.0  # the same two, for the generation phase only
    decode_draft_seconds: float = 0.0

    @property
    def prompt_decoded(self) -> int:
        """Prompt cache rows this call decoded: ``prompt_tokens`` minus the ``prompt_reused`` rows
        kept from an earlier call (llama-server's ``timings.prompt_n``). Not in ``as_dict()``."""
        return self.prompt_tokens - self.prompt_reused

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.accepted / self.target_steps if self.target_steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.per_position_accepted, self.per_position_drafted)]

    @property
    def tokens_per_second(self) -> float:
        """Decode speed: the tokens after the first over ``decode_seconds``, which start once the first
        is sampled (it comes from the prompt's last logits, in ``prefill_seconds``): llama-server's
        ``timings.predicted_per_second`` alike."""
        steps = self.generated_tokens - 1
        return steps / self.decode_seconds if self.decode_seconds > 0 and steps > 0 else 0.0

    @property
    def total_seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def decode_python_share(self) -> float:
        """Share of the generation phase spent outside native target and draft calls."""
        if self.decode_seconds <= 0:
            return 0.0
        return max(0.0, self.decode_seconds - self.decode_target_seconds - self.decode_draft_seconds) / \
            self.decode_seconds

    @property
    def python_seconds(self) -> float:
        """Time outside native target and draft calls."""
        return max(0.0, self.total_seconds - self.target_seconds - self.draft_seconds)

    def record_step(self, n_drafted: int, n_accepted: int, n_positions: int | None = None) -> None:
        """One verify step: tokens drafted and accepted; ``n_positions``: the draft positions it
        covered (a tree drafts several tokens per position; a chain one, the default)."""
        n_positions = n_drafted if n_positions is None else n_positions
        while len(self.per_position_drafted) < n_positions:
            self.per_position_drafted.append(0)
            self.per_position_accepted.append(0)
        for i in range(n_positions):
            self.per_position_drafted[i] += 1
            if i < n_accepted:
                self.per_position_accepted[i] += 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        self.spec_steps += 1 if n_drafted else 0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for name in ("acceptance_rate", "mean_accepted_length", "per_position_acceptance", "tokens_per_second",
                     "python_seconds", "decode_python_share"):
            d[name] = getattr(self, name)
        return d


@dataclasses.dataclass
class StatsTotals:
    """Sums over many generations (a conversation's turns, a server's requests)."""

    generations: int = 0
    prompt_rows: int = 0  # cache rows the prompts took (GenerationStats.prompt_tokens)
    prompt_rows_decoded: int = 0  # of which decoded, not reused from the cache
    prompt_rows_reused: int = 0
    generated_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    target_steps: int = 0
    spec_steps: int = 0  # target steps that verified a draft
    per_position_accepted: list = dataclasses.field(default_factory=list)  # accepted drafts by position
    longest_sequence: int = 0  # the most cache rows one generation's sequence held
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    def add(self, s: GenerationStats) -> None:
        self.generations += 1
        self.prompt_rows += s.prompt_tokens
        self.prompt_rows_decoded += s.prompt_decoded
        self.prompt_rows_reused += s.prompt_reused
        self.generated_tokens += s.generated_tokens
        self.drafted += s.drafted
        self.accepted += s.accepted
        self.target_steps += s.target_steps
        self.spec_steps += s.spec_steps
        grow = len(s.per_position_accepted) - len(self.per_position_accepted)
        self.per_position_accepted.extend([0] * max(grow, 0))
        for i, n in enumerate(s.per_position_accepted):
            self.per_position_accepted[i] += n
        # the last token generated is sampled, never decoded into the cache
        self.longest_sequence = max(self.longest_sequence, s.prompt_tokens + max(s.generated_tokens - 1, 0))
        self.prefill_seconds += s.prefill_seconds
        self.decode_seconds += s.decode_seconds

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_second(self) -> float:
        """As ``GenerationStats.tokens_per_second``: each generation's tokens after its first, over
        the decode time (the /metrics gauge predicted_tokens_seconds reads it too)."""
        steps = self.generated_tokens - self.generations
        return steps / self.decode_seconds if self.decode_seconds > 0 and steps > 0 else 0.0


class Stopwatch:
    """Adds the time spent inside a ``with`` block to one field of a GenerationStats (if not None)."""

    def __init__(self, stats: GenerationStats | None, field: str) -> None:
        self.stats = stats
        self.field = field

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.stats is not None:  # (None: a block nobody times)
            setattr(self.stats, self.field, getattr(self.stats, self.field) + time.perf_counter() - self.t0)
