"""Server counters, and the Prometheus text format of ``GET /metrics``."""

from __future__ import annotations

import collections
import dataclasses
import threading


@dataclasses.dataclass
class ServerMetrics:
    requests: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # (route, status)
    prompt_tokens: int = 0  # cache rows the prompts took
    prompt_tokens_decoded: int = 0  # of which decoded (not reused from the cache)
    generated_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    target_steps: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def count_request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] += 1

    def add_generation(self, stats) -> None:
        with self._lock:
            self.prompt_tokens += stats.prompt_tokens
            self.prompt_tokens_decoded += stats.prompt_decoded
            self.generated_tokens += stats.generated_tokens
            self.drafted += stats.drafted
            self.accepted += stats.accepted
            self.target_steps += stats.target_steps
            self.prefill_seconds += stats.prefill_seconds
            self.decode_seconds += stats.decode_seconds

    def prometheus(self, *, queue_depth: int, running: int, slots: int) -> str:
        with self._lock:
            lines = []

            def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
                lines.append(f"# HELP pyllama_spec_{name} {help_text}")
                lines.append(f"# TYPE pyllama_spec_{name} {kind}")
                lines.extend(f"pyllama_spec_{name}{labels} {value:g}" for labels, value in samples)

            metric("requests_total", "counter", "HTTP requests answered, by route and status",
                   [(f'{{route="{r}",status="{s}"}}', n) for (r, s), n in sorted(self.requests.items())] or
                   [("", 0)])
            metric("prompt_tokens_total", "counter", "cache rows of the prompts", [("", self.prompt_tokens)])
            metric("prompt_tokens_decoded_total", "counter", "prompt rows decoded (not reused from the cache)",
                   [("", self.prompt_tokens_decoded)])
            metric("generated_tokens_total", "counter", "tokens generated", [("", self.generated_tokens)])
            metric("draft_tokens_total", "counter", "tokens drafted", [("", self.drafted)])
            metric("draft_tokens_accepted_total", "counter", "drafted tokens the target accepted",
                   [("", self.accepted)])
            metric("target_steps_total", "counter", "target verify steps", [("", self.target_steps)])
            metric("prefill_seconds_total", "counter", "time in prefill", [("", self.prefill_seconds)])
            metric("decode_seconds_total", "counter", "time generating", [("", self.decode_seconds)])
            metric("queue_depth", "gauge", "requests waiting for a slot", [("", queue_depth)])
            metric("busy", "gauge", "generations running (at most the slots)", [("", running)])
            metric("slots", "gauge", "sequence slots (-np)", [("", slots)])
            return "\n".join(lines) + "\n"
