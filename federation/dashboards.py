"""The fedserve Grafana dashboard, as code.

`dashboard()` builds the Grafana JSON model from the panel list below: fedserve's own metrics
(federation/metrics.py, replica/metrics.py) and Ray Serve's. Names are as they appear on
Ray's scrape: `ray_` prefixed, counters with `_total`. `fedserve dashboards export` writes it;
`fedserve dashboards push` uploads it through the Grafana HTTP API (grafana-client). Every
panel's PromQL is run against a real Prometheus in tests/federation/test_metrics.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

UID = "fedserve-federation"
TITLE = "fedserve federation"
APP = 'application=~"$application"'  # every query is filtered by the application variable
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Panel:
    """One time-series panel: (PromQL, legend) per line, a Grafana unit, a help text."""

    title: str
    targets: tuple[tuple[str, str], ...]
    unit: str = "short"
    description: str = ""


def _rate(metric: str, by: str = "", extra: str = "") -> str:
    sel = f"{{{APP}{', ' + extra if extra else ''}}}"
    inner = f"rate({metric}{sel}[{RATE}])"
    return f"sum by ({by}) ({inner})" if by else f"sum({inner})"


def _gauge(metric: str, by: str = "replica") -> str:
    return f"sum by ({by}) ({metric}{{{APP}}})"


def _quantiles(bucket: str, by: str = "") -> tuple[tuple[str, str], ...]:
    group = f"le{', ' + by if by else ''}"
    suffix = f" {{{{{by}}}}}" if by else ""
    return tuple((f"histogram_quantile({q}, sum by ({group}) (rate({bucket}{{{APP}}}[{RATE}])))",
                  f"p{int(q * 100)}{suffix}") for q in (0.5, 0.95, 0.99))


PLACEMENTS = "ray_fedserve_router_placements_total"
REPLICAS = "Replicas (fedserve)"
ROUTING = "Routing and admission (fedserve)"
SERVE = "Ray Serve"

ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    (REPLICAS, (
        Panel("Running and waiting streams",
              ((_gauge("ray_fedserve_replica_running_streams"), "running {{replica}}"),
               (_gauge("ray_fedserve_replica_waiting_streams"), "waiting {{replica}}")),
              description="Streams in each replica's running set, and admitted but waiting"),
        Panel("KV blocks",
              ((_gauge("ray_fedserve_replica_kv_blocks_used"), "used {{replica}}"),
               (_gauge("ray_fedserve_replica_kv_blocks_free"), "free {{replica}}")),
              description="Used: held by running streams and retained sessions"),
        Panel("KV pool in use",
              ((f"{_gauge('ray_fedserve_replica_kv_blocks_used')} / ("
                f"{_gauge('ray_fedserve_replica_kv_blocks_used')} + "
                f"{_gauge('ray_fedserve_replica_kv_blocks_free')})", "{{replica}}"),),
              unit="percentunit"),
        Panel("Retained sessions",
              ((_gauge("ray_fedserve_replica_retained_sessions"), "{{replica}}"),),
              description="Sessions whose KV a replica keeps for their next turn"),
        Panel("Generated tokens/s",
              ((_rate("ray_fedserve_replica_generated_tokens_total", "replica"), "{{replica}}"),
               (_rate("ray_fedserve_replica_generated_tokens_total"), "federation")),
              unit="tps"),
        Panel("Time to first token", _quantiles("ray_fedserve_replica_time_to_first_token_seconds_bucket"),
              unit="s", description="From a request's arrival at its replica to its first token"),
        Panel("Inter-token latency", _quantiles("ray_fedserve_replica_inter_token_seconds_bucket"),
              unit="s"),
        Panel("Prefix reuse",
              ((f"{_rate('ray_fedserve_replica_prefix_reused_tokens_total')} / "
                f"{_rate('ray_fedserve_replica_prompt_tokens_total')}", "reused / prompt tokens"),),
              unit="percentunit",
              description="Share of prompt tokens served from a session's retained KV"),
        Panel("Preemptions/s",
              ((_rate("ray_fedserve_replica_preemptions_total", "replica"), "{{replica}}"),),
              description="Running streams whose KV was freed under memory pressure (recomputed later)"),
        Panel("Finished streams/s by reason",
              ((_rate("ray_fedserve_replica_finished_streams_total", "finish_reason"),
                "{{finish_reason}}"),)),
    )),
    (ROUTING, (
        Panel("Placements/s by reason",
              ((_rate(PLACEMENTS, "reason"), "{{reason}}"),),
              description="sticky: to the session's replica; new: first turn; re-pin: its replica was gone"),
        Panel("Sticky hit ratio",
              ((_rate(PLACEMENTS, extra='reason="sticky"') + " / "
                + _rate(PLACEMENTS, extra='reason!="new"'), "sticky / (sticky + re-pin)"),),
              unit="percentunit"),
        Panel("Failovers and replayed tokens/s",
              ((_rate("ray_fedserve_failovers_total"), "failovers"),
               (_rate("ray_fedserve_replayed_tokens_total"), "replayed tokens")),
              description="Streams resubmitted after their replica was lost, and the tokens replayed"),
        Panel("Rejected requests/s (429)",
              ((_rate("ray_fedserve_rejected_requests_total", "code"), "{{code}}"),),
              description="Refused by admission: every replica and the queue were full"),
    )),
    (SERVE, (
        Panel("HTTP requests/s",
              ((_rate("ray_serve_num_http_requests_total", "route, status_code"),
                "{{route}} {{status_code}}"),), unit="reqps"),
        Panel("HTTP latency", _quantiles("ray_serve_http_request_latency_ms_bucket"), unit="ms"),
        Panel("HTTP errors/s",
              ((_rate("ray_serve_num_http_error_requests_total", "route, error_code"),
                "{{route}} {{error_code}}"),), unit="reqps"),
        Panel("Replica processing latency",
              _quantiles("ray_serve_deployment_processing_latency_ms_bucket", "deployment"), unit="ms"),
        Panel("Healthy replicas",
              ((_gauge("ray_serve_deployment_replica_healthy", "deployment"), "{{deployment}}"),)),
        Panel("Requests in replicas",
              ((_gauge("ray_serve_replica_processing_queries", "deployment, replica"),
                "{{deployment}} {{replica}}"),)),
    )),
)


def panels() -> list[Panel]:
    return [p for _, row in ROWS for p in row]


def queries() -> list[str]:
    """Every PromQL expression of the dashboard (with Grafana's variables in it)."""
    return [expr for p in panels() for expr, _ in p.targets]


def dashboard() -> dict:
    """The Grafana dashboard JSON model (schema 39: rows, time-series panels, two variables)."""
    out, y, pid = [], 0, 1
    for row, row_panels in ROWS:
        out.append({"type": "row", "id": pid, "title": row, "collapsed": False,
                    "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": []})
        pid, y = pid + 1, y + 1
        for i, p in enumerate(row_panels):
            out.append(_panel(p, pid, {"x": 12 * (i % 2), "y": y + 8 * (i // 2), "w": 12, "h": 8}))
            pid += 1
        y += 8 * ((len(row_panels) + 1) // 2)
    return {"uid": UID, "title": TITLE, "tags": ["fedserve", "ray-serve"], "timezone": "browser",
            "schemaVersion": 39, "version": 1, "editable": True, "refresh": "10s",
            "time": {"from": "now-30m", "to": "now"}, "panels": out,
            "templating": {"list": [
                {"name": "datasource", "label": "Prometheus", "type": "datasource",
                 "query": "prometheus", "current": {}, "hide": 0},
                {"name": "application", "label": "Serve application", "type": "query",
                 "datasource": {"type": "prometheus", "uid": "${datasource}"},
                 "query": {"query": "label_values(ray_serve_deployment_replica_healthy, application)",
                           "refId": "application"},
                 "definition": "label_values(ray_serve_deployment_replica_healthy, application)",
                 "includeAll": True, "allValue": ".*", "multi": True, "refresh": 2,
                 "current": {"text": "All", "value": "$__all"}, "hide": 0},
            ]}}


def _panel(p: Panel, pid: int, grid: dict) -> dict:
    ds = {"type": "prometheus", "uid": "${datasource}"}
    return {"type": "timeseries", "id": pid, "title": p.title, "description": p.description,
            "datasource": ds, "gridPos": grid,
            "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                        "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(ord("A") + i), "datasource": ds, "expr": expr,
                         "legendFormat": legend, "range": True}
                        for i, (expr, legend) in enumerate(p.targets)]}


def export(path: str | None = None) -> str:
    """The dashboard as JSON text; written to `path` when given."""
    text = json.dumps(dashboard(), indent=2) + "\n"
    if path:
        with open(path, "w") as f:
            f.write(text)
    return text


def push(url: str, token: str, folder_uid: str | None = None) -> dict:
    """Create or replace the dashboard on a Grafana server; returns Grafana's answer."""
    from grafana_client import GrafanaApi

    api = GrafanaApi.from_url(url, credential=token)
    body = {"dashboard": dashboard(), "overwrite": True, "message": "fedserve dashboards push"}
    if folder_uid:
        body["folderUid"] = folder_uid
    return api.dashboard.update_dashboard(body)
