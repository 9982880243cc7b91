"""Overload: offer `--factor` × the federation's admission capacity for `--duration` seconds.

Each client sends streamed chats back to back; a 429 is honoured (the client waits its
Retry-After, capped at 1 s, and tries again). PASS: no 5xx, no timeout, no broken connection,
every accepted request (HTTP 200) streams to its end, and the server answers afterwards. The
report gives the status counts and the TTFT percentiles of accepted requests.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx

from loadtest import report
from loadtest.client import alive, chat_body, model_name, stream_chat
from loadtest.sessions import http_client

NAME = "overload"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--capacity", type=int, default=None,
                   help="streams admitted at once (default: the federation's, from its status)")
    p.add_argument("--factor", type=float, default=2.0, help="offered load as a multiple of capacity")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of offered load")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--out", default="loadtest-results")


def capacity_of(url: str, headers: dict) -> int:
    r = httpx.get(f"{url}/v1/fedserve/status", headers=headers, timeout=60)
    r.raise_for_status()
    return int(r.json()["ingress"]["capacity"])


def run(args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = model_name(args.url, args.model)
    capacity = args.capacity or capacity_of(args.url, headers)
    clients = max(1, round(args.factor * capacity))
    end = time.perf_counter() + args.duration
    lock = threading.Lock()
    records: list[dict] = []

    def client(i: int, http: httpx.Client) -> None:
        n = 0
        while time.perf_counter() < end:
            body = chat_body(model, [{"role": "user", "content": f"Client {i}, request {n}: "
                                      "say something about the weather."}], args.max_tokens)
            t0 = time.perf_counter() - (end - args.duration)
            r = stream_chat(http, args.url, body, session=f"overload-{i}-{n}", timeout=args.timeout)
            with lock:
                records.append({"t": t0, "status": r.status, "ok": r.ok, "error": r.error[:200],
                                "timed_out": r.timed_out, "ttft_s": r.ttft_s, "latency_s": r.latency_s})
            n += 1
            if r.status == 429:
                time.sleep(1.0)  # Retry-After is whole seconds; a polite client waits it out

    with http_client(clients) as http:
        http.headers.update(headers)
        with ThreadPoolExecutor(max_workers=clients) as pool:
            for f in [pool.submit(client, i, http) for i in range(clients)]:
                f.result()
    statuses = Counter(str(r["status"]) if r["status"] else "no response" for r in records)
    accepted = [r for r in records if r["status"] == 200]
    server_errors = [r for r in records if r["status"] >= 500]
    broken = [r for r in records if r["status"] in (0, 200) and not r["ok"]]
    ok_after = alive(args.url)
    return {"scenario": NAME, "url": args.url, "model": model, "capacity": capacity,
            "clients": clients, "factor": args.factor, "duration_s": args.duration,
            "max_tokens": args.max_tokens, "requests": len(records), "statuses": dict(statuses),
            "accepted": len(accepted), "accepted_completed": sum(r["ok"] for r in accepted),
            "rejected_429": statuses.get("429", 0), "server_errors": len(server_errors),
            "timeouts": sum(r["timed_out"] for r in records), "broken": len(broken),
            "errors": [r["error"] for r in server_errors + broken][:10],
            "ttft_accepted_s": report.percentiles([r["ttft_s"] for r in accepted if r["ttft_s"] is not None]),
            "latency_accepted_s": report.percentiles([r["latency_s"] for r in accepted]),
            "alive_after": ok_after,
            "passed": ok_after and not server_errors and not broken and bool(accepted),
            "records": records}


def render(res: dict) -> tuple[str, dict]:
    t, lat = res["ttft_accepted_s"], res["latency_accepted_s"]
    rows = [["offered", f"{res['clients']} clients = {res['factor']:g} × capacity {res['capacity']}, "
                        f"{res['duration_s']:g} s"],
            ["requests", res["requests"]], ["statuses", ", ".join(f"{k}: {v}" for k, v in
                                                                  sorted(res["statuses"].items()))],
            ["accepted / completed", f"{res['accepted']} / {res['accepted_completed']}"],
            ["5xx / timeouts / broken", f"{res['server_errors']} / {res['timeouts']} / {res['broken']}"],
            ["TTFT of accepted p50 / p99", f"{report.ms(t['p50'])} / {report.ms(t['p99'])}"],
            ["latency of accepted p50 / p99", f"{report.ms(lat['p50'])} / {report.ms(lat['p99'])}"],
            ["server answers after", "yes" if res["alive_after"] else "NO"],
            ["verdict", "PASS" if res["passed"] else "FAIL"]]
    fig, ax = report.new_figure(7, 3.5)
    for status, color in (("200", "tab:green"), ("429", "tab:orange")):
        xs = [r["t"] for r in res["records"] if str(r["status"]) == status]
        ax.hist(xs or [0], bins=30, alpha=0.7, color=color, label=status)
    ax.set_xlabel("request start (s)")
    ax.set_ylabel("requests")
    ax.set_title("answers over time under overload")
    ax.legend()
    return f"# Overload\n\n{report.md_table(['', ''], rows)}\n", {"statuses": fig}


def main(args) -> int:
    res = run(args)
    report.emit(args, NAME, res, render)
    return 0 if res["passed"] else 1
