"""The replica's Prometheus metrics, exported through Ray's metrics agent.

Names follow Prometheus conventions with base units. On the scrape Ray prefixes every
application metric with `ray_` and appends `_total` to counters, so `fedserve_replica_
generated_tokens` appears as `ray_fedserve_replica_generated_tokens_total`; `ray.serve.metrics`
adds the `deployment`, `replica` and `application` labels. Ray's own `ray_serve_*` metrics
(requests, latencies, queue lengths, health) are not repeated here.
"""

from __future__ import annotations

import threading
import time

# seconds; a CPU replica's first token takes 0.05–5 s, a GPU's 0.01–1 s
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
INTER_TOKEN_BUCKETS_S = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ReplicaMetrics:
    """One replica's metrics: gauges set from Engine.stats(), stream timings from its events."""

    def __init__(self) -> None:
        from ray.serve.metrics import Counter, Gauge, Histogram

        self.running = Gauge("fedserve_replica_running_streams",
                             description="Streams in the engine's running set")
        self.waiting = Gauge("fedserve_replica_waiting_streams",
                             description="Streams admitted and waiting for a running slot")
        self.kv_used = Gauge("fedserve_replica_kv_blocks_used",
                             description="KV blocks held by streams and retained sessions")
        self.kv_free = Gauge("fedserve_replica_kv_blocks_free", description="KV blocks free")
        self.sessions = Gauge("fedserve_replica_retained_sessions",
                              description="Sessions whose KV the replica retains for their next turn")
        self.preemptions = Counter("fedserve_replica_preemptions",
                                   description="Running streams preempted (KV freed, recomputed later)")
        self.prompt_tokens = Counter("fedserve_replica_prompt_tokens",
                                     description="Prompt tokens of finished streams")
        self.reused_tokens = Counter("fedserve_replica_prefix_reused_tokens",
                                     description="Prompt tokens served from retained KV instead of prefill")
        self.generated = Counter("fedserve_replica_generated_tokens",
                                 description="Tokens generated and streamed")
        self.finished = Counter("fedserve_replica_finished_streams",
                                description="Streams finished, by finish reason",
                                tag_keys=("finish_reason",))
        self.ttft = Histogram("fedserve_replica_time_to_first_token_seconds",
                              description="From a request's arrival at the replica to its first token",
                              boundaries=list(TTFT_BUCKETS_S))
        self.inter_token = Histogram("fedserve_replica_inter_token_seconds",
                                     description="Between consecutive tokens of one stream",
                                     boundaries=list(INTER_TOKEN_BUCKETS_S))
        self._lock = threading.Lock()
        self._preemptions_seen = 0

    def record_stats(self, stats: dict, preemptions_total: int | None) -> None:
        """Gauges from Engine.stats(); `preemptions_total` is the engine's running count."""
        total = stats.get("total_kv_blocks", 0)
        free = stats.get("free_kv_blocks", 0)
        self.running.set(stats.get("active_streams", 0))
        self.waiting.set(stats.get("waiting_streams", 0))
        self.kv_used.set(total - free)
        self.kv_free.set(free)
        self.sessions.set(len(stats.get("resident_sessions", ())))
        if preemptions_total is None:
            return
        with self._lock:  # Serve may call this from more than one thread
            delta = preemptions_total - self._preemptions_seen
            self._preemptions_seen = max(self._preemptions_seen, preemptions_total)
        if delta > 0:  # a Ray counter refuses inc(0)
            self.preemptions.inc(delta)

    def stream(self) -> "StreamTimer":
        """A timer for one request, started now (its arrival at the replica)."""
        return StreamTimer(self)


class StreamTimer:
    """Times one stream's events: time to first token, then the gap per following token."""

    def __init__(self, metrics: ReplicaMetrics) -> None:
        self.m = metrics
        self.last = time.perf_counter()
        self.first = True

    def event(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.perf_counter()
        if self.first:  # tokens that arrive with the first one add no gap
            self.m.ttft.observe(now - self.last)
            self.first = False
        else:  # an event carrying n tokens (text held back for a stop string) spans n gaps
            for _ in range(num_tokens):
                self.m.inter_token.observe((now - self.last) / num_tokens)
        self.last = now
        self.m.generated.inc(num_tokens)

    def finished(self, reason: str | None, prompt_tokens: int, cached_tokens: int) -> None:
        self.m.finished.inc(tags={"finish_reason": reason or "unknown"})
        if prompt_tokens > 0:
            self.m.prompt_tokens.inc(prompt_tokens)
        if cached_tokens > 0:
            self.m.reused_tokens.inc(cached_tokens)
