"""One-screen federation status: every replica's load, KV use and retained sessions.

The ingress gathers it (`GET /v1/fedserve/status`) by asking the replica deployment for stats
once per replica, each call avoiding the replicas already heard from (the routers honour the
call's `Reach(avoid=...)`), until a replica answers twice or all expected ones have.
"""

from __future__ import annotations

import asyncio

STATS_TIMEOUT_S = 5.0


def summarize(stats: dict) -> dict:
    """A replica's routing stats as the status reports them (session keys are not listed)."""
    total = stats.get("total_kv_blocks", 0)
    free = stats.get("free_kv_blocks", 0)
    return {"replica": stats.get("replica", "?"),
            "running": stats.get("active_streams", 0),
            "waiting": stats.get("waiting_streams", 0),
            "max_running": stats.get("max_running_streams", 0),
            "kv_blocks_used": total - free, "kv_blocks_total": total,
            "kv_capacity_tokens": stats.get("kv_capacity_tokens"),
            "sessions": len(stats.get("resident_sessions", ()))}


async def gather(replicas, expected: int) -> list[dict]:
    """Summaries of the replicas reachable through the handle `replicas`, by replica id."""
    from replica.wire import Reach  # here: the status screen alone needs no torch

    seen: dict[str, dict] = {}
    for _ in range(2 * expected + 1):  # routers may pick a seen replica before a new one
        try:
            st = await asyncio.wait_for(replicas.stats.remote(Reach(tuple(seen))), STATS_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a replica dying or starting: report the others
            continue
        if st["replica"] in seen and len(seen) >= expected:
            break
        seen[st["replica"]] = summarize(st)
    return [seen[k] for k in sorted(seen)]


def render(status: dict) -> str:
    """The status as a terminal screen."""
    ingress = status.get("ingress", {})
    lines = [f"model {status.get('model', '?')}   replicas {len(status['replicas'])}"
             f"/{status.get('expected_replicas', '?')}   ingress in flight "
             f"{ingress.get('active', 0)}/{ingress.get('capacity', '?')}", ""]
    head = f"{'replica':<12} {'running':>9} {'waiting':>8} {'KV blocks used':>20} {'sessions':>9}"
    lines += [head, "-" * len(head)]
    for r in status["replicas"]:
        total = r["kv_blocks_total"] or 1
        kv = f"{r['kv_blocks_used']}/{r['kv_blocks_total']} ({100 * r['kv_blocks_used'] / total:.0f}%)"
        lines.append(f"{r['replica'][:12]:<12} {r['running']:>4}/{r['max_running']:<4} "
                     f"{r['waiting']:>8} {kv:>20} {r['sessions']:>9}")
    return "\n".join(lines)
