"""`fedserve bench federation`: routing overhead (HTTP + ingress + router vs the engine called
directly, p50/p99 of a 1-token request) and aggregate tok/s of N concurrent streams with 1 vs 2
replicas, in one run. Prints a table and writes JSON."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from tqdm import tqdm

from federation.config import FederationConfig

PROMPT = "Write a haiku about the sea."


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3


def direct_latency(model: str, n: int) -> list[float]:
    from replica import Engine, EngineConfig, Request, SamplingParams

    with Engine(EngineConfig(model=model)) as engine:
        params = SamplingParams(max_tokens=1, temperature=0.0)
        msgs = ({"role": "user", "content": PROMPT},)
        engine.generate([Request(messages=msgs, params=params)])
        out = []
        for _ in tqdm(range(n), desc="direct requests", leave=False, disable=None):  # TTY only
            t = time.perf_counter()
            engine.generate([Request(messages=msgs, params=params)])
            out.append(time.perf_counter() - t)
    return out


def http_latency(url: str, model: str, n: int) -> list[float]:
    body = {"model": model, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": PROMPT}]}
    out = []
    with httpx.Client(timeout=120) as c:
        c.post(f"{url}/v1/chat/completions", json=body)
        for i in tqdm(range(n), desc="HTTP requests", leave=False, disable=None):
            t = time.perf_counter()
            r = c.post(f"{url}/v1/chat/completions", json=body,
                       headers={"X-Session-ID": f"bench-{i}"})
            out.append(time.perf_counter() - t)
            r.raise_for_status()
    return out


def http_throughput(url: str, model: str, streams: int, max_tokens: int) -> float:
    async def one(c: httpx.AsyncClient, i: int) -> int:
        r = await c.post(f"{url}/v1/completions", timeout=600, json={
            "model": model, "prompt": f"{PROMPT} ({i})", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    async def main() -> float:
        async with httpx.AsyncClient() as c:
            t = time.perf_counter()
            tokens = await asyncio.gather(*(one(c, i) for i in range(streams)))
            return sum(tokens) / (time.perf_counter() - t)

    return asyncio.run(main())


def bench(model: str, requests: int, streams: int, max_tokens: int, json_path: str | None) -> dict:
    from federation.launch import free_port, start, stop, wait_ready

    result: dict = {"model": model, "requests": requests, "streams": streams,
                    "max_tokens": max_tokens}
    direct = direct_latency(model, requests)
    result["direct_ms"] = {"p50": _pct(direct, 0.5), "p99": _pct(direct, 0.99)}
    for replicas in (1, 2):
        cfg = FederationConfig(model=model, num_replicas=replicas, one_replica_per_node=False)
        url = start(cfg, "127.0.0.1", free_port(), num_cpus=4)
        try:
            wait_ready(url)
            if replicas == 1:
                lat = http_latency(url, model, requests)
                result["http_ms"] = {"p50": _pct(lat, 0.5), "p99": _pct(lat, 0.99)}
            result[f"tok_per_s_{replicas}_replicas"] = http_throughput(url, model, streams, max_tokens)
        finally:
            stop()
    print(format_table(result))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
    return result


def format_table(r: dict) -> str:
    d, h = r["direct_ms"], r["http_ms"]
    return "\n".join([
        f"federation benchmark: {r['model']} ({r['requests']} one-token requests; "
        f"{r['streams']} streams x {r['max_tokens']} tokens)",
        f"{'path':<28} {'p50 ms':>8} {'p99 ms':>8}",
        f"{'engine, called directly':<28} {d['p50']:>8.1f} {d['p99']:>8.1f}",
        f"{'HTTP + ingress + router':<28} {h['p50']:>8.1f} {h['p99']:>8.1f}",
        f"{'routing overhead':<28} {h['p50'] - d['p50']:>8.1f} {h['p99'] - d['p99']:>8.1f}",
        f"aggregate tok/s, {r['streams']} streams: 1 replica {r['tok_per_s_1_replicas']:.1f}, "
        f"2 replicas {r['tok_per_s_2_replicas']:.1f} "
        f"(ratio {r['tok_per_s_2_replicas'] / r['tok_per_s_1_replicas']:.2f}x)",
    ])
