"""Metrics, dashboard and status without a cluster: what each records, what the dashboard
queries, what `fedserve dashboards` and `fedserve status` print and send."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from ray.util.metrics import Counter, Gauge, Histogram

from federation import dashboards
from cli.main import main as cli_main
from federation.launch import free_port
from federation.metrics import IngressMetrics, RouterMetrics
from federation.status import render, summarize
from replica.metrics import ReplicaMetrics


class Recorder:
    """Stands in for one Ray metric: keeps what was recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, dict | None]] = []

    def inc(self, value: float = 1.0, tags: dict | None = None) -> None:
        assert value > 0, "a Ray counter refuses inc(0)"
        self.calls.append(("inc", value, tags))

    def observe(self, value: float, tags: dict | None = None) -> None:
        self.calls.append(("observe", value, tags))

    def set(self, value: float, tags: dict | None = None) -> None:
        self.calls.append(("set", value, tags))


def recording(m: ReplicaMetrics) -> ReplicaMetrics:
    for name, value in list(vars(m).items()):
        if isinstance(value, (Counter, Gauge, Histogram)):
            setattr(m, name, Recorder())
    return m


def scrape_names() -> set[str]:
    """Our metrics' names as Ray's export shows them: `ray_` prefix, `_total` on counters."""
    names = set()
    for group in (ReplicaMetrics(), RouterMetrics(), IngressMetrics()):
        for metric in vars(group).values():
            if isinstance(metric, Counter):
                names.add(f"ray_{metric._name}_total")
            elif isinstance(metric, Histogram):
                names.add(f"ray_{metric._name}_bucket")
            elif isinstance(metric, Gauge):
                names.add(f"ray_{metric._name}")
    return names


def test_stream_timer_records_ttft_once_then_one_gap_per_token():
    m = recording(ReplicaMetrics())
    timer = m.stream()
    timer.event(0)  # an event without tokens (held-back text) is no token
    timer.event(1)
    timer.event(2)
    timer.finished("stop", prompt_tokens=10, cached_tokens=0)
    assert [c[0] for c in m.ttft.calls] == ["observe"]
    assert len(m.inter_token.calls) == 2 and m.inter_token.calls[0][1] == m.inter_token.calls[1][1]
    assert [c[1] for c in m.generated.calls] == [1, 2]
    assert m.finished.calls == [("inc", 1.0, {"finish_reason": "stop"})]
    assert m.prompt_tokens.calls == [("inc", 10, None)] and m.reused_tokens.calls == []


def test_record_stats_sets_gauges_and_counts_only_new_preemptions():
    m = recording(ReplicaMetrics())
    stats = {"active_streams": 3, "waiting_streams": 1, "free_kv_blocks": 4, "total_kv_blocks": 11,
             "resident_sessions": ["a", "b"]}
    for total in (0, 3, 3, 5):
        m.record_stats(stats, total)
    m.record_stats(stats, None)  # an engine that does not report them
    assert [c[1] for c in m.preemptions.calls] == [3, 2]
    assert m.kv_used.calls[-1][1] == 7 and m.kv_free.calls[-1][1] == 4
    assert m.sessions.calls[-1][1] == 2 and m.running.calls[-1][1] == 3


def test_every_dashboard_query_names_a_metric_that_is_exported():
    ours = scrape_names()
    for expr in dashboards.queries():
        for name in re.findall(r"\b(ray_[a-z_]+)\{", expr):
            assert name in ours or name.startswith("ray_serve_"), (name, expr)
    used = {n for e in dashboards.queries() for n in re.findall(r"\b(ray_fedserve_[a-z_]+)\{", e)}
    # every fedserve metric has a panel (histograms through their buckets)
    assert used == ours, ours ^ used


def test_dashboard_model_has_unique_ids_and_non_overlapping_panels():
    model = dashboards.dashboard()
    panels = model["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for p in panels:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, p["title"]
        cells |= mine
    assert {v["name"] for v in model["templating"]["list"]} == {"datasource", "application"}
    assert all(t["expr"] for p in panels if p["type"] == "timeseries" for t in p["targets"])


def test_dashboards_export_writes_the_model(tmp_path, capsys):
    out = tmp_path / "fedserve.json"
    assert cli_main(["dashboards", "export", "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == dashboards.dashboard()
    assert cli_main(["dashboards", "export"]) == 0
    assert json.loads(capsys.readouterr().out)["uid"] == dashboards.UID


@pytest.fixture
def fake_grafana():
    """A stand-in Grafana on 127.0.0.1 that records dashboard uploads."""
    received: list[tuple[str, str, dict]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received.append((self.path, self.headers.get("Authorization"), body))
            answer = json.dumps({"status": "success", "uid": body["dashboard"]["uid"],
                                 "url": f"/d/{body['dashboard']['uid']}"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        thread.join(timeout=10)


def test_dashboards_push_uploads_with_the_token(fake_grafana, capsys):
    url, received = fake_grafana
    assert cli_main(["dashboards", "push", "--url", url, "--token", "glsa_test"]) == 0
    [(path, auth, body)] = received
    assert path == "/api/dashboards/db" and auth == "Bearer glsa_test"
    assert body["overwrite"] is True and body["dashboard"] == dashboards.dashboard()
    assert "success" in capsys.readouterr().out


def test_status_screen_shows_each_replica_kv_and_sessions():
    reps = [summarize({"replica": "abc123", "active_streams": 2, "waiting_streams": 1,
                       "max_running_streams": 8, "free_kv_blocks": 25, "total_kv_blocks": 100,
                       "resident_sessions": ["s1", "s2", "s3"]}),
            summarize({"replica": "def456", "total_kv_blocks": 100, "free_kv_blocks": 100})]
    screen = render({"model": "m", "expected_replicas": 2, "ingress": {"active": 3, "capacity": 80},
                     "replicas": reps})
    row = next(line for line in screen.splitlines() if line.startswith("abc123"))
    assert "2/8" in row and "75/100 (75%)" in row and row.split()[-1] == "3"
    assert "replicas 2/2" in screen and "3/80" in screen and "def456" in screen


def test_status_command_reports_an_unreachable_url(capsys):
    assert cli_main(["status", "--url", f"http://127.0.0.1:{free_port()}"]) == 1
    assert "error" in capsys.readouterr().err


class FakeReplicas:
    """A deployment handle whose router honours `avoid`; the first call hits a dying replica."""

    def __init__(self, ids: list[str]) -> None:
        self.ids, self.calls = ids, 0
        self.stats = self

    def remote(self, reach):
        self.calls += 1
        calls, avoid = self.calls, set(reach.avoid)

        async def answer() -> dict:
            if calls == 1:
                raise RuntimeError("replica died")
            rid = next((i for i in self.ids if i not in avoid), self.ids[0])
            return {"replica": rid, "total_kv_blocks": 10, "free_kv_blocks": 10,
                    "resident_sessions": [rid]}
        return answer()


def test_gather_reaches_every_replica_through_the_avoid_list_despite_a_failure():
    import asyncio

    from federation.status import gather

    fake = FakeReplicas(["r2", "r1", "r3"])
    out = asyncio.run(gather(fake, 3))
    assert [r["replica"] for r in out] == ["r1", "r2", "r3"] and all(r["sessions"] == 1 for r in out)


def test_free_port_is_outside_the_ephemeral_range_and_free():
    # a port from bind(0) is ephemeral and can be handed to another socket before the server
    # binds it (CI once: "Failed to bind to address"); free_port stays out of that range
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_lo = int(f.read().split()[0])
    except OSError:
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range here")
    if ephemeral_lo <= 20000:
        pytest.skip("this kernel's ephemeral ports start below free_port's range")
    import socket

    for _ in range(20):
        port = free_port()
        assert 20000 <= port < min(32768, ephemeral_lo), port
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: it binds
