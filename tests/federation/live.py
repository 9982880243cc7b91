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
    try:  # a start that fails half-way (Serve's proxy not ready in time) still shuts Ray down:
        # the next test module's ray.init would otherwise find this one running
        url = start(cfg, "127.0.0.1", port, num_cpus=4, metrics_export_port=metrics_export_port)
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


def ingress_reaches(url: str, num_replicas: int, headers: dict | None = None,
                    timeout: float = 120) -> None:
    """Wait until the ingress's own router reaches num_replicas replicas (GET
    /v1/fedserve/status goes through it): its view of the running replicas can lag the
    driver's for a while after a start, and a burst placed before then sees only one."""
    import time

    import httpx

    deadline = time.time() + timeout
    while True:
        try:
            got = len(httpx.get(f"{url}/v1/fedserve/status", headers=headers or {},
                                timeout=60).json()["replicas"])
        except (httpx.HTTPError, KeyError, ValueError):
            got = 0
        if got >= num_replicas:
            return
        assert time.time() < deadline, f"the ingress reaches {got} of {num_replicas} replicas"
        time.sleep(0.5)


def stream_chat(url: str, body: dict, headers: dict | None = None, on_line=None,
                timeout: float = 240) -> tuple[str, dict]:
    """POST a streamed chat; returns its content text and the response headers. No frame may be
    an error; `on_line(i, headers)` runs after each SSE line (the tests' hook to kill or stop the
    streaming replica mid-stream)."""
    import json

    import httpx

    text = ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True},
                      headers=headers or {}, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        got = dict(r.headers)
        for i, line in enumerate(r.iter_lines()):
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for ch in chunk.get("choices", []):
                    text += ch["delta"].get("content") or ""
            if on_line is not None:
                on_line(i, got)
    return text, got
