"""Server counters, and the Prometheus text format of ``GET /metrics``."""

from __future__ import annotations

import collections
import dataclasses
import threading

from pyllama_spec.speculative.stats import GenerationStats, StatsTotals


@dataclasses.dataclass
class ServerMetrics:
    requests: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # (route, status)
    generations: StatsTotals = dataclasses.field(default_factory=StatsTotals)
    # the generations since the last scrape: llama-server's throughput gauges are averages over this
    # window, and each scrape starts a new one (its metrics buckets)
    window: StatsTotals = dataclasses.field(default_factory=StatsTotals)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)
    # embeddings (server/embeddings.py): prompt rows decoded and the decodes they took; no token sampled
    embedding_rows: int = 0
    embedding_decodes: int = 0

    def count_request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] += 1

    def add_generation(self, stats: GenerationStats) -> None:
        with self._lock:
            self.generations.add(stats)
            self.window.add(stats)

    def add_embeddings(self, rows: int, decodes: int) -> None:
        with self._lock:
            self.embedding_rows += rows
            self.embedding_decodes += decodes

    def prometheus(self, *, queue_depth: int, running: int, slots: int, busy_per_decode: float = 0.0) -> str:
        with self._lock:
            lines, g = [], self.generations

            def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
                lines.append(f"# HELP pyllama_spec_{name} {help_text}")
                lines.append(f"# TYPE pyllama_spec_{name} {kind}")
                lines.extend(f"pyllama_spec_{name}{labels} {value:g}" for labels, value in samples)

            metric("requests_total", "counter", "HTTP requests answered, by route and status (with "
                   "--sleep-idle-seconds not /health, /models, GET /props, /metrics and the page, which are "
                   "answered while the model sleeps)",
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
            lines.extend(self._llama_server_series(queue_depth=queue_depth, running=running,
                                                   busy_per_decode=busy_per_decode))
            self.window = StatsTotals()
            return "\n".join(lines) + "\n"

    def _llama_server_series(self, *, queue_depth: int, running: int, busy_per_decode: float) -> list[str]:
        """llama-server's own series (tools/server/server-task.cpp, to_metrics), under its names, so
        that a dashboard made for llama-server reads this server too. Its throughput gauges are
        averages over the generations since the previous scrape (``window``), as there. An embedding's
        prompt counts as processed prompt tokens and its decodes as decodes, as there."""
        g, w = self.generations, self.window
        counters = [
            ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens",
             g.prompt_rows_decoded + self.embedding_rows),
            ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", g.prompt_rows_reused),
            ("prompt_seconds_total", "Total time spent processing prompts", g.prefill_seconds),
            ("tokens_predicted_total", "Number of generation tokens processed", g.generated_tokens),
            ("tokens_predicted_seconds_total", "Total time spent generating tokens", g.decode_seconds),
            ("n_decode_total", "Total number of target decode steps (generating, and embeddings' decodes)",
             g.target_steps + self.embedding_decodes),
            ("n_tokens_max", "Largest observed sequence length (prompt + generation)", g.longest_sequence),
            ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", g.drafted),
            ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model",
             g.accepted),
            ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps",
             g.spec_steps),
        ]
        gauges = [
            ("prompt_tokens_seconds", "Average prompt throughput in tokens/s",
             w.prompt_rows_decoded / w.prefill_seconds if w.prefill_seconds else 0.0),
            ("predicted_tokens_seconds", "Average generation throughput in tokens/s", w.tokens_per_second),
            ("requests_processing", "Number of requests processing", running),
            ("requests_deferred", "Number of requests deferred", queue_depth),
            ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call", busy_per_decode),
        ]
        out = []
        for kind, items in (("counter", counters), ("gauge", gauges)):
            for name, help_text, value in items:
                out += [f"# HELP llamacpp:{name} {help_text}", f"# TYPE llamacpp:{name} {kind}",
                        f"llamacpp:{name} {value:g}"]
        if g.per_position_accepted:
            name = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"
            out += [f"# HELP {name} Accepted tokens per draft position", f"# TYPE {name} counter"]
            out += [f'{name}{{position="{i}"}} {n}' for i, n in enumerate(g.per_position_accepted)]
        return out
