"""Server counters, and the Prometheus text format of ``GET /metrics``."""

from __future__ import annotations

import collections
import dataclasses
import threading

from pyllama_spec.spec.stats import GenerationStats, StatsTotals


@dataclasses.dataclass
class ServerMetrics:
    requests: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # (route, status)
    generations: StatsTotals = dataclasses.field(default_factory=StatsTotals)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def count_request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] += 1

    def add_generation(self, stats: GenerationStats) -> None:
        with self._lock:
            self.generations.add(stats)

    def prometheus(self, *, queue_depth: int, running: int, slots: int) -> str:
        with self._lock:
            lines, g = [], self.generations

            def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
                lines.append(f"# HELP pyllama_spec_{name} {help_text}")
                lines.append(f"# TYPE pyllama_spec_{name} {kind}")
                lines.extend(f"pyllama_spec_{name}{labels} {value:g}" for labels, value in samples)

            metric("requests_total", "counter", "HTTP requests answered, by route and status",
                   [(f'{{route="{r}",status="{s}"}}', n) for (r, s), n in sorted(self.requests.items())] or
                   [("", 0)])
            metric("prompt_tokens_total", "counter", "cache rows of the prompts", [("", g.prompt_rows)])
            metric("prompt_tokens_decoded_total", "counter", "prompt rows decoded (not reused from the cache)",
                   [("", g.prompt_rows_decoded)])
            metric("generated_tokens_total", "counter", "tokens generated", [("", g.generated_tokens)])
            metric("draft_tokens_total", "counter", "tokens drafted", [("", g.drafted)])
            metric("draft_tokens_accepted_total", "counter", "drafted tokens the target accepted",
                   [("", g.accepted)])
            metric("target_steps_total", "counter", "target verify steps", [("", g.target_steps)])
            metric("prefill_seconds_total", "counter", "time in prefill", [("", g.prefill_seconds)])
            metric("decode_seconds_total", "counter", "time generating", [("", g.decode_seconds)])
            metric("queue_depth", "gauge", "requests waiting for a slot", [("", queue_depth)])
            metric("busy", "gauge", "generations running (at most the slots)", [("", running)])
            metric("slots", "gauge", "sequence slots (-np)", [("", slots)])
            return "\n".join(lines) + "\n"
