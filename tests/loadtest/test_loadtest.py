"""Every load-test scenario, at small sizes, against one live 2-replica federation; each must
yield a valid report (JSON with real values, Markdown, non-empty PNGs). The corruption check must
also be able to fail: a proxy that alters one token of one response is caught."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.federation.live import federation
from tests.loadtest.proxy import corrupting_proxy

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fed_url():
    with federation(max_running_streams=8, max_queued_requests=8) as (url, _):
        yield url


def fedserve(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", "loadtest", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def load_report(out: Path, name: str) -> dict:
    """The JSON result, after checking the Markdown and every PNG it names exist and are non-empty."""
    data = json.loads((out / f"{name}.json").read_text())
    assert (out / f"{name}.md").read_text().startswith("# ")
    assert data["plots"], "a report has at least one plot"
    for png in data["plots"].values():
        blob = (out / png).read_bytes()
        assert blob.startswith(b"\x89PNG") and len(blob) > 1000
    return data


def test_matrix_survives_and_matches_sequential(fed_url, tmp_path):
    out = fedserve("matrix", "--url", fed_url, "--label", "batched", "--max-tokens", "8",
                   "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "6 chats + 6 embeddings | SURVIVED | yes" in out.stdout
    data = load_report(tmp_path, "matrix_batched")
    assert [r["verdict"] for r in data["rows"]] == ["SURVIVED"] * 4
    assert all(r["wall_s"] > 0 for r in data["rows"]) and data["all_equal"]


def test_corruption_check_is_clean_on_fedserve(fed_url, tmp_path):
    out = fedserve("corruption", "--url", fed_url, "--sessions", "4", "--turns", "3",
                   "--start-tokens", "64", "--end-tokens", "192", "--max-tokens", "8",
                   "--ignore-eos", "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "| verdict | CLEAN |" in out.stdout
    data = load_report(tmp_path, "corruption")
    assert data["requests"] == data["verified"] == 12 and data["corrupted"] == 0
    assert data["corruption_rate"] == 0.0 and data["timeouts"] == 0
    lo, hi = data["prompt_tokens_range"]
    assert lo < 150 < 200 < hi, "contexts grow every turn"
    assert all(r["completion_tokens"] == 8 for r in data["records"])
    assert data["throughput_tok_s"] > 0 and data["ttft_s"]["p50"] > 0 and data["itl_s"]["n"] > 0


def test_corruption_check_catches_one_altered_token(fed_url, tmp_path):
    with corrupting_proxy(fed_url, corrupt_nth=3) as proxy:
        out = fedserve("corruption", "--url", proxy.url, "--sessions", "2", "--turns", "2",
                       "--start-tokens", "32", "--end-tokens", "64", "--max-tokens", "6",
                       "--ignore-eos", "--out", str(tmp_path))
    assert proxy.corrupted == 1
    assert out.returncode == 1, out.stdout + out.stderr
    assert "| verdict | CORRUPTION |" in out.stdout and "ZZZ" in out.stdout
    data = load_report(tmp_path, "corruption")
    assert data["corrupted"] == 1 and data["sessions_corrupted"] == 1
    bad = [r for r in data["records"] if r["verdict"] == "CORRUPTED"]
    assert "ZZZ" in bad[0]["text"] and "ZZZ" not in bad[0]["reference"]


def test_needle_recall_table_and_heatmap(fed_url, tmp_path):
    out = fedserve("needle", "--url", fed_url, "--lengths", "64,160", "--depths", "0,0.5",
                   "--max-context", "2048", "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "recall:" in out.stdout
    data = load_report(tmp_path, "needle")
    assert len(data["cells"]) == 4 and all(c["ok"] and c["prompt_tokens"] > 50 for c in data["cells"])
    assert 0.0 <= data["recall"] <= 1.0 and "heatmap" in data["plots"]


def test_multiturn_reports_ttft_reuse_and_throughput(fed_url, tmp_path):
    # one federation in the test: both columns point at it (the sticky one); the side-by-side
    # rendering and ratios are what is checked here
    out = fedserve("multiturn", "--policy", "both", "--sticky-url", fed_url, "--round-robin-url",
                   fed_url, "--conversations", "3", "--concurrency", "3", "--turns", "3",
                   "--system-tokens", "48", "--prefix-tokens", "48", "--turn-tokens", "24",
                   "--max-tokens", "6", "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sticky / round_robin" in out.stdout
    data = load_report(tmp_path, "multiturn")
    for r in data["results"]:
        assert r["completed"] == r["requests"] == 9 and r["throughput_tok_s"] > 0
        assert [p["turn"] for p in r["per_turn"]] == [1, 2, 3]
        assert r["per_turn"][-1]["reuse"] > 0.3, "later turns reuse the session's KV"
        assert r["replicas_per_conversation"] == 1.0
    assert data["sticky_over_round_robin"]["throughput"] > 0


def test_capstone_agents_match_sequential_and_email_is_denied(fed_url, tmp_path):
    out = fedserve("capstone", "--url", fed_url, "--tasks", "1", "--max-tokens", "8",
                   "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "verdict: **PASS**" in out.stdout
    data = load_report(tmp_path, "capstone")
    assert data["survived"] and data["transcripts_equal"] and data["denial_enforced"]
    agents = {a["agent"]: a for a in data["agents"]}
    assert set(agents) == {"calculator", "memory", "send-email", "summarize"}
    assert all(a["turns"] == 2 for a in agents.values())
    email = agents["send-email"]
    assert email["outbox"] == [] and not any(c["executed"] for c in email["tool_calls"])
    calc = agents["calculator"]["transcript"]
    assert any(m["content"].startswith("TOOL calculator RESULT: ") for m in calc)


def test_overload_at_twice_capacity_rejects_with_429_and_completes_every_accepted(fed_url, tmp_path):
    out = fedserve("overload", "--url", fed_url, "--factor", "2", "--duration", "5",
                   "--max-tokens", "4", "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "| verdict | PASS |" in out.stdout
    data = load_report(tmp_path, "overload")
    assert data["clients"] == 2 * data["capacity"] == 2 * (2 * 8 + 8)
    assert data["rejected_429"] > 0 and data["server_errors"] == data["timeouts"] == data["broken"] == 0
    assert data["accepted"] == data["accepted_completed"] >= data["capacity"]
    assert set(data["statuses"]) == {"200", "429"}
    assert 0 < data["ttft_accepted_s"]["p50"] <= data["ttft_accepted_s"]["p99"]


def test_locust_users_record_ttft_itl_and_tokens_per_s(fed_url, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = subprocess.run(
        # bounded by completed turns (-t is only the ceiling), so a slow machine runs longer
        # instead of completing fewer
        [sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py", "--headless", "-u", "4",
         "-r", "4", "-t", "150s", "--max-requests", "8", "--host", fed_url, "--max-tokens", "8",
         "--only-summary", "--lt-out", str(tmp_path)],
        capture_output=True, text=True, timeout=200, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    for name in ("chat", "ttft", "itl", "tokens_per_s"):
        assert f"SSE      {name}" in out.stdout + out.stderr
    data = load_report(tmp_path, "locust")
    assert data["completed"] >= 8 and data["error_count"] == 0
    assert 0 < data["ttft_s"]["p50"] < data["latency_s"]["p50"]
    assert data["itl_s"]["n"] > data["completed"] and data["tokens_per_s"]["p50"] > 0
