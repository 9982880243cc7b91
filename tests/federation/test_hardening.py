"""Hardening, against one live keyed federation.

Failover: every way a replica or the session directory can vanish ends in a completed request:
each test drives one path on purpose and counts every client outcome (a status code, or the name
of the client-side error), and streamed text is compared byte for byte with an undisturbed run.

The paths: the directory actor restarts (its state refilled from the replicas' reports), a
replica's health check fails under a running stream, and a replica dies just before a burst of
requests reaches the router. (Killing the streaming replica: test_live.py; losing a node:
test_multinode.py.)

Tenancy: a missing or wrong key is a 401; two keys never share a session's KV or placement;
a key over its rate gets 429 + Retry-After."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import ray

from replica.wire import Reach
from tests.federation.live import federation, ingress_reaches, replica_stats, stream_chat

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
DIRECTORY = ("fedserve_session_directory", "fedserve::fedserve::Replica")
KEY_A, KEY_B, KEY_C = "sk-hardening-a-01", "sk-hardening-b-02", "sk-hardening-c-03"
AUTH_A = {"Authorization": f"Bearer {KEY_A}"}
RATE, BURST = 2.0, 40.0  # per key: the failover tests' bursts fit; a flood of 80 cannot


@pytest.fixture(scope="module")
def fed():
    with federation(max_running_streams=8, max_queued_requests=16, max_failovers=6,
                    api_keys=(KEY_A, KEY_B, KEY_C), rate_limit_rps=RATE,
                    rate_limit_burst=BURST) as (url, cfg):
        yield url, cfg


def live_replicas(n: int, exclude: set[str] = frozenset(), timeout: float = 180) -> dict[str, dict]:
    """Wait until n replicas (none of them in `exclude`) answer with a running engine."""
    deadline = time.time() + timeout
    while True:
        try:
            stats = replica_stats(n + len(exclude))
        except Exception:  # noqa: BLE001 - a replica that is starting or gone: ask again
            stats = {}
        live = {k: v for k, v in stats.items() if k not in exclude}
        if len(live) >= n:
            return live
        assert time.time() < deadline, f"only {sorted(live)} live after {timeout}s"
        time.sleep(0.5)


def replica_handle():
    from ray import serve

    return serve.get_deployment_handle("Replica", app_name="fedserve")


def chat_body(messages, max_tokens=8, **kw) -> dict:
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **kw}


async def post_all(url: str, bodies: list[dict], sessions: list[str | None], auth=AUTH_A) -> list:
    """POST every body concurrently; each outcome is an httpx.Response or an error's name."""
    async def one(c, body, session):
        headers = {**auth, **({"X-Session-ID": session} if session else {})}
        try:
            return await c.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=240)
        except httpx.HTTPError as e:
            return type(e).__name__

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as c:
        return await asyncio.gather(*(one(c, b, s) for b, s in zip(bodies, sessions)))


def statuses(outcomes: list) -> list:
    return [o.status_code if isinstance(o, httpx.Response) else o for o in outcomes]


def test_directory_restart_loses_no_request_and_is_refilled_from_replicas(fed):
    url, _ = fed
    live_replicas(2)
    ingress_reaches(url, 2, AUTH_A)  # the first burst must see both (the module's first test)
    sessions = [f"dir-{i}" for i in range(8)]
    convs = {s: [{"role": "user", "content": f"Session {s}: name a color."}] for s in sessions}

    def turn(k: int) -> dict[str, str]:
        outcomes = asyncio.run(post_all(url, [chat_body(convs[s]) for s in sessions], sessions))
        assert statuses(outcomes) == [200] * len(sessions), statuses(outcomes)
        for s, r in zip(sessions, outcomes):
            convs[s] += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"Turn {k}: another?"}]
        return {s: r.headers["x-fedserve-replica"] for s, r in zip(sessions, outcomes)}

    first = turn(1)
    assert len(set(first.values())) == 2, first  # spread over both replicas
    directory = ray.get_actor(*DIRECTORY)
    ray.kill(directory, no_restart=False)  # it comes back empty
    second = turn(2)  # routed while the directory restarts: by the replicas' reports
    third = turn(3)
    assert third == second, (second, third)  # sticky again once it is back
    assert ray.get(directory.size.remote()) >= len(sessions)  # refilled, not only new placements


def test_a_failing_health_check_moves_the_stream_byte_identical(fed):
    url, _ = fed
    live_replicas(2)
    messages = [{"role": "user", "content": "Write a long paragraph about mountains."}]
    body = chat_body(messages, max_tokens=40, temperature=0.7, seed=5)

    def read(stream_body: dict, on_line=None) -> tuple[str, str]:
        text, headers = stream_chat(url, stream_body, {"X-Session-ID": "health-session", **AUTH_A},
                                    on_line)
        return text, headers["x-fedserve-replica"]

    reference, _ = read({**body, "seed": 5})
    stopped: list[str] = []

    def stop_its_engine(i: int, headers: dict) -> None:
        replica = headers["x-fedserve-replica"]
        if i == 6 and not stopped:
            others = [k for k in live_replicas(2) if k != replica]
            stopped.append(replica_handle().stop_engine.remote(Reach(tuple(others))).result(timeout_s=60))

    text, replica = read(body, stop_its_engine)
    assert stopped == [replica]  # the engine stopped was the one streaming
    assert text == reference
    live_replicas(2, exclude={replica})  # Serve replaced the failed replica


def test_a_burst_right_after_a_replica_dies_all_completes(fed):
    url, _ = fed
    victim = next(iter(live_replicas(2)))
    name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("SERVE_REPLICA::fedserve#Replica#") and a["name"].endswith(victim))
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)  # the router still lists it
    bodies = [chat_body([{"role": "user", "content": f"Burst {i}: say a number."}]) for i in range(12)]
    outcomes = asyncio.run(post_all(url, bodies, [f"burst-{i}" for i in range(12)]))
    assert statuses(outcomes) == [200] * 12, statuses(outcomes)
    assert all(r.headers["x-fedserve-replica"] != victim for r in outcomes)
    live_replicas(2, exclude={victim})


def test_a_missing_or_wrong_key_is_401_everywhere_but_health(fed):
    url, _ = fed
    body = chat_body([{"role": "user", "content": "hi"}])
    for headers in ({}, {"Authorization": "Bearer sk-not-a-key-000"}, {"Authorization": KEY_A}):
        for method, path, payload in (("POST", "/v1/chat/completions", body),
                                      ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi"}),
                                      ("POST", "/v1/embeddings", {"model": MODEL, "input": "hi"}),
                                      ("GET", "/v1/models", None)):
            r = httpx.request(method, f"{url}{path}", json=payload, headers=headers, timeout=60)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{url}/v1/models", headers=AUTH_A, timeout=30).status_code == 200


def test_the_same_session_id_from_two_keys_shares_no_kv_and_no_placement(fed):
    url, _ = fed
    live_replicas(2)
    conv = [{"role": "system", "content": "You are a careful archivist of long lists."},
            {"role": "user", "content": "List ten rivers of Europe, one per line."}]

    def post(key: str, messages) -> httpx.Response:
        r = httpx.post(f"{url}/v1/chat/completions", json=chat_body(messages), timeout=240,
                       headers={"Authorization": f"Bearer {key}", "X-Session-ID": "shared-id"})
        assert r.status_code == 200, r.text
        assert r.headers["x-session-id"] == "shared-id"  # the client's key, not the namespace
        return r

    first = post(KEY_A, conv)
    conv2 = conv + [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "And five more?"}]
    assert post(KEY_A, conv2).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    other = post(KEY_B, conv2)  # the same id and the same prefix, another tenant: nothing reused
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    directory = ray.get_actor(*DIRECTORY)
    owner, _ = ray.get(directory.lookup.remote("shared-id"))
    assert owner is None  # placements are kept under each tenant's namespace only


def test_a_key_over_its_rate_gets_429_with_retry_after_and_others_are_untouched(fed):
    url, _ = fed

    async def flood():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=80)) as c:
            return await asyncio.gather(*(
                c.post(f"{url}/v1/chat/completions", content=b"{not json", timeout=120,
                       headers={"Authorization": f"Bearer {KEY_C}", "Content-Type": "application/json"})
                for _ in range(80)))

    outcomes = asyncio.run(flood())
    codes = [r.status_code for r in outcomes]
    assert set(codes) == {400, 429} and codes.count(400) >= BURST, codes
    limited = [r for r in outcomes if r.status_code == 429]
    assert all(r.json()["error"]["code"] == "rate_limited" and int(r.headers["retry-after"]) >= 1
               for r in limited)
    ok = httpx.post(f"{url}/v1/chat/completions", json=chat_body([{"role": "user", "content": "hi"}]),
                    headers=AUTH_A, timeout=120)
    assert ok.status_code == 200  # another key's bucket
