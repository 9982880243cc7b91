"""The federation's Prometheus metrics (router and ingress), exported through Ray's metrics agent.

On the scrape Ray prefixes `ray_` and appends `_total` to counters: `fedserve_router_placements`
appears as `ray_fedserve_router_placements_total{reason=...}`. `ray.serve.metrics` adds the
`deployment`, `replica` and `application` labels of the process that records (the router runs
in its caller, the ingress). Ray's `ray_serve_*` request/latency/error metrics are not repeated.
"""

from __future__ import annotations

PLACEMENT_REASONS = ("sticky", "new", "re-pin")  # hit, miss (first turn), owner gone


class RouterMetrics:
    """StickyRouter: where each session-keyed request was placed, and why."""

    def __init__(self) -> None:
        from ray.serve.metrics import Counter

        self.placements = Counter("fedserve_router_placements",
                                  description="Session-keyed requests placed, by reason: sticky "
                                              "(the session's replica), new, re-pin (its replica is gone)",
                                  tag_keys=("reason",))

    def placed(self, reason: str) -> None:
        self.placements.inc(tags={"reason": reason})


class IngressMetrics:
    """Ingress: failovers by replay and admission refusals."""

    def __init__(self) -> None:
        from ray.serve.metrics import Counter

        self.failovers = Counter("fedserve_failovers",
                                 description="Streams resubmitted to another replica after theirs was lost")
        self.replayed = Counter("fedserve_replayed_tokens",
                                description="Already-streamed tokens resubmitted on failover")
        self.rejected = Counter("fedserve_rejected_requests",
                                description="Requests refused by admission (HTTP 429), by code",
                                tag_keys=("code",))
