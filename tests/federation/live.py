"""A live local federation for tests: real Ray, real Serve, real HTTP on 127.0.0.1."""

from __future__ import annotations

import os
from contextlib import contextmanager

from federation.config import FederationConfig
from federation.launch import free_port, wait_ready  # noqa: F401 (re-exported for tests)
from replica.wire import Reach


@contextmanager
def federation(metrics_export_port: int | None = None, **overrides):
    """Deploy a federation on a local Ray; yields (base url, FederationConfig).
    metrics_export_port: where Ray serves the node's Prometheus scrape (None: Ray picks)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from federation.launch import start, stop

    cfg = FederationConfig(**{"num_replicas": 2, "one_replica_per_node": False, **overrides})
    port = free_port()
    url = start(cfg, "127.0.0.1", port, num_cpus=4, metrics_export_port=metrics_export_port)
    try:
        wait_ready(url)
        yield url, cfg
    finally:
        stop()


def replica_stats(num_replicas: int) -> dict[str, dict]:
    """Routing stats of every replica, reached one by one through the router's avoid list."""
    from ray import serve

    handle = serve.get_deployment_handle("Replica", app_name="fedserve")
    seen: dict[str, dict] = {}
    for _ in range(num_replicas * 4):
        st = handle.stats.remote(Reach(tuple(seen))).result(timeout_s=30)
        seen[st["replica"]] = st
        if len(seen) == num_replicas:
            break
    return seen
