"""Observability end to end: a real Prometheus scrapes Ray's metrics export of a live 2-replica
federation under a short load that makes every event happen once (sticky turns with prefix
reuse, a burst past admission → 429s and KV preemptions, a replica killed mid-stream →
failover and replay); then every dashboard panel's PromQL must return data."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
import ray

from federation import dashboards
from cli.main import main as cli_main
from tests.federation.live import federation, free_port

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
KV_BLOCK_BYTES = 737_280  # SmolLM2-135M, fp32, 16-token blocks: 30 layers × K,V × 3 heads × 64
DEADLINE_S = 60  # for Prometheus to hold every panel's series after the load


@contextmanager
def prometheus(target: str, workdir: str):
    """A real Prometheus on 127.0.0.1 scraping `target` every second; yields its base URL."""
    port = free_port()
    config = os.path.join(workdir, "prometheus.yml")
    with open(config, "w") as f:
        f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                "scrape_configs:\n  - job_name: ray\n    static_configs:\n"
                f"      - targets: ['{target}']\n")
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={workdir}/data",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=open(os.path.join(workdir, "prometheus.log"), "w"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 30
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.time() < deadline, "prometheus did not start"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    if shutil.which("prometheus") is None:
        pytest.skip("the prometheus binary is not installed (.ci/run installs it)")
    # Ray's agents export every 10 s by default; the test's scrape wants seconds
    old = os.environ.get("RAY_metrics_report_interval_ms")
    os.environ["RAY_metrics_report_interval_ms"] = "1000"
    metrics_port = free_port()
    try:
        with prometheus(f"127.0.0.1:{metrics_port}", str(tmp_path_factory.mktemp("prom"))) as prom, \
                federation(metrics_export_port=metrics_port, max_running_streams=2,
                           max_queued_requests=0, kv_cache_bytes=8 * KV_BLOCK_BYTES,
                           max_failovers=4) as (url, cfg):
            yield url, cfg, prom, metrics_port
    finally:
        if old is None:
            os.environ.pop("RAY_metrics_report_interval_ms", None)
        else:
            os.environ["RAY_metrics_report_interval_ms"] = old


def chat(url, messages, max_tokens, session=None):
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120,
                      headers={"X-Session-ID": session} if session else {})


def test_status_lists_every_replica_with_load_kv_and_sessions(fed, capsys):
    url, cfg = fed[0], fed[1]
    r = chat(url, [{"role": "user", "content": "Hi"}], 4, session="status-session")
    assert r.status_code == 200
    status = httpx.get(f"{url}/v1/fedserve/status", timeout=30).json()
    assert status["model"] == MODEL and len(status["replicas"]) == cfg.num_replicas
    for rep in status["replicas"]:
        assert rep["kv_blocks_total"] == 8 and rep["max_running"] == 2
    assert sum(rep["sessions"] for rep in status["replicas"]) >= 1
    assert cli_main(["status", "--url", url]) == 0
    screen = capsys.readouterr().out
    assert all(rep["replica"] in screen for rep in status["replicas"]) and "KV" in screen


def drive_load(url: str) -> None:
    """Each metric's event at least once; the replica kill comes last."""
    turn = [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "Name a river."}]
    first = chat(url, turn, 12, session="sticky")
    assert first.status_code == 200
    turn += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
             {"role": "user", "content": "And another?"}]
    assert chat(url, turn, 12, session="sticky").status_code == 200  # sticky, prefix reused
    # 6 at once past a capacity of 4 (2 replicas × 2 streams, no queue): 429s; two 5-block
    # streams in an 8-block pool: preemptions
    with ThreadPoolExecutor(6) as pool:
        codes = list(pool.map(lambda i: chat(url, [{"role": "user", "content": f"Story {i} about a cat."}],
                                             48, session=f"burst-{i}").status_code, range(6)))
    assert 429 in codes and 200 in codes, codes
    kill_streaming_replica(url)


def kill_streaming_replica(url: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write about rivers."}],
            "max_tokens": 40, "temperature": 0, "stream": True}
    killed = False
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120,
                      headers={"X-Session-ID": "failover"}) as r:
        replica = r.headers["x-fedserve-replica"]
        for i, line in enumerate(r.iter_lines()):
            assert '"error"' not in line, line
            if i == 6 and not killed:
                name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                            if a["name"].startswith("SERVE_REPLICA::fedserve#Replica#")
                            and a["name"].endswith(replica))
                ray.kill(ray.get_actor(name, namespace="serve"), no_restart=False)
                killed = True
    assert killed


def promql(expr: str) -> str:
    """A panel's expression as Prometheus runs it: Grafana's variables filled in."""
    return expr.replace("$application", "fedserve").replace("$__rate_interval", "5m")


def missing_panels(prom: str) -> list[str]:
    out = []
    for expr in dashboards.queries():
        r = httpx.get(f"{prom}/api/v1/query", params={"query": promql(expr)}, timeout=10).json()
        assert r["status"] == "success", (expr, r)
        if not r["data"]["result"]:
            out.append(expr)
    return out


def test_every_dashboard_panel_returns_data_under_load(fed):
    url, prom = fed[0], fed[2]
    drive_load(url)
    deadline = time.time() + DEADLINE_S
    while missing := missing_panels(prom):
        assert time.time() < deadline, f"no data after {DEADLINE_S}s for: {missing}"
        time.sleep(1)


def test_scrape_names_follow_prometheus_conventions(fed):
    """Ray prefixes `ray_` and appends `_total` to counters; ours carry base units."""
    text = httpx.get(f"http://127.0.0.1:{fed[3]}/metrics", timeout=10).text
    types = {}
    for line in text.splitlines():
        if line.startswith("# TYPE ray_fedserve_"):
            _, _, name, kind = line.split()
            types[name] = kind
    for name, kind in types.items():
        assert (kind == "counter") == name.endswith("_total"), name
        assert "_total_" not in name and not name.endswith("_total_total"), name
        if kind == "histogram":
            assert name.endswith("_seconds"), name
    assert {"ray_fedserve_replica_generated_tokens_total", "ray_fedserve_router_placements_total",
            "ray_fedserve_replica_time_to_first_token_seconds",
            "ray_fedserve_replica_kv_blocks_used"} <= set(types)
