"""The federation end to end: 2 replicas on a local Ray, driven over HTTP by the openai client."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import Counter

import httpx
import openai
import pytest
import ray
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replica.wire import Reach
from tests.federation.live import federation, ingress_reaches, replica_stats, stream_chat

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def fed():
    with federation(max_running_streams=8, max_queued_requests=8, max_failovers=4) as (url, cfg):
        yield url, cfg


@pytest.fixture(scope="module")
def client(fed):
    return openai.OpenAI(base_url=f"{fed[0]}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(url, messages, session=None, **kw):
    body = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0, **kw}
    headers = {"X-Session-ID": session} if session else {}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    return r


def stream_text(url, messages, **kw) -> tuple[str, dict]:
    return stream_chat(url, {"model": MODEL, "messages": messages, "max_tokens": 24,
                             "temperature": 0, **kw})


def test_openai_client_chat_stream_completions_embeddings_models(client):
    out = client.chat.completions.create(model=MODEL, max_tokens=32, temperature=0,
                                         messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in out.choices[0].message.content
    assert out.usage.completion_tokens > 0 and out.choices[0].finish_reason == "stop"
    pieces = list(client.chat.completions.create(
        model=MODEL, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Say hello."}]))
    text = "".join(p.choices[0].delta.content or "" for p in pieces if p.choices)
    assert text and 0 < pieces[-1].usage.completion_tokens <= 16
    cmpl = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                     temperature=0)
    assert "Paris" in cmpl.choices[0].text
    emb = client.embeddings.create(model=MODEL, input=["hello world", "bonjour"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) == 576
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_headers_name_session_and_replica(fed):
    r = chat(fed[0], [{"role": "user", "content": "hi"}], session="my-session")
    assert r.status_code == 200
    assert r.headers["x-session-id"] == "my-session" and r.headers["x-fedserve-replica"]


def test_sessions_stick_spread_and_reuse_kv(fed):
    """12 sessions × 3 turns, concurrently: each session on one replica, both replicas used."""
    url = fed[0]
    ingress_reaches(url, 2)
    where: dict[int, set[str]] = {i: set() for i in range(12)}
    cached: list[int] = []

    async def session(i: int, c: httpx.AsyncClient):
        messages = [{"role": "system", "content": f"You are assistant number {i}."}]
        for turn in range(3):
            messages.append({"role": "user", "content": f"Turn {turn}: tell me a fact about {i}."})
            r = await c.post(f"{url}/v1/chat/completions", timeout=300,
                             json={"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            where[i].add(r.headers["x-fedserve-replica"])
            if turn:
                cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
            messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})

    async def main():
        async with httpx.AsyncClient() as c:
            await asyncio.gather(*(session(i, c) for i in range(12)))

    asyncio.run(main())
    assert all(len(r) == 1 for r in where.values()), where
    share = Counter(next(iter(r)) for r in where.values())
    assert len(share) == 2 and min(share.values()) >= 3, share
    assert sum(c > 0 for c in cached) == len(cached), cached  # every later turn reused KV


def test_concurrent_streams_equal_sequential(fed):
    url = fed[0]
    convs = [[{"role": "user", "content": f"Write a line about the number {i}."}] for i in range(8)]
    sequential = [stream_text(url, m)[0] for m in convs]
    results: list[str | None] = [None] * 8

    def run(i):
        results[i] = stream_text(url, convs[i])[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == sequential


BAD = [
    (b"{not json", 400),
    (json.dumps({"model": MODEL}).encode(), 400),
    (json.dumps({"model": MODEL, "messages": []}).encode(), 400),
    (json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400),
    (json.dumps({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}).encode(), 400),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}).encode(), 400),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}).encode(), 400),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**7}).encode(), 400),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}).encode(), 400),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}).encode(), 400),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}).encode(), 400),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "word " * 9000}]}).encode(), 400),
    (json.dumps({"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]}).encode(), 404),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * (5 << 20)}]}).encode(), 413),
]


def test_bad_input_gets_openai_errors_and_the_server_keeps_serving(fed):
    url = fed[0]
    for raw, status in BAD:
        r = httpx.post(f"{url}/v1/chat/completions", content=raw, timeout=60,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == status, (raw[:80], r.status_code, r.text[:200])
        err = r.json()["error"]
        assert err["message"] and err["type"] and "Traceback" not in err["message"]
    assert chat(url, [{"role": "user", "content": "still there?"}]).status_code == 200


def test_overload_gets_429_with_retry_after_and_disconnect_frees_kv(fed):
    url, cfg = fed
    capacity = cfg.num_replicas * cfg.max_running_streams + cfg.max_queued_requests
    statuses: list[int] = []
    retry_after: list[str] = []

    async def one(c):
        r = await c.post(f"{url}/v1/completions", timeout=300,
                         json={"model": MODEL, "prompt": "Count slowly:", "max_tokens": 24})
        statuses.append(r.status_code)
        if r.status_code == 429:
            retry_after.append(r.headers.get("retry-after"))
            assert r.json()["error"]["code"] == "overloaded"

    async def flood():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=100)) as c:
            await asyncio.gather(*(one(c) for _ in range(capacity + 12)))

    asyncio.run(flood())
    assert statuses.count(429) >= 1 and statuses.count(200) >= capacity - 4, Counter(statuses)
    assert all(v == str(cfg.retry_after_s) for v in retry_after)
    # a client that walks away mid-stream: its stream is cancelled and its blocks come back
    body = {"model": MODEL, "prompt": "Tell a very long story:", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    deadline = time.time() + 30
    while time.time() < deadline:
        stats = replica_stats(cfg.num_replicas)
        if all(s["active_streams"] == 0 for s in stats.values()):
            break
        time.sleep(0.5)
    assert all(s["active_streams"] == 0 for s in stats.values()), stats


# ---- fuzzing: generated and hostile inputs against the live endpoints -------------------------
HOSTILE = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
    st.lists(st.integers(min_value=-5, max_value=200_000), max_size=6),
    st.dictionaries(st.text(max_size=8), st.integers(), max_size=3))


def mostly(valid, hostile=HOSTILE):
    """Valid values three times in four, so generated requests reach the engine, not only the
    validator; the hostile rest covers wrong types, huge numbers, NaN and unicode."""
    return st.one_of(valid, valid, valid, hostile)


SMALL_TOKENS = mostly(st.integers(min_value=1, max_value=3),
                      st.one_of(st.integers(min_value=-3, max_value=0),
                                st.integers(min_value=10 ** 6, max_value=2 ** 70),
                                st.text(max_size=5), st.floats(allow_nan=True), st.booleans()))
CONTENT = mostly(st.text(max_size=60), st.one_of(
    st.none(), st.integers(),
    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", ""]),
                                    "text": st.one_of(st.text(max_size=20), st.integers())}),
             max_size=2)))
MESSAGE = st.fixed_dictionaries({"role": mostly(st.sampled_from(["system", "user", "assistant",
                                                                 "developer"])),
                                 "content": CONTENT})
SAMPLING = {"temperature": mostly(st.floats(0, 2)), "top_p": mostly(st.floats(0.01, 1)),
            "top_k": mostly(st.integers(0, 50)), "seed": mostly(st.integers(0, 2 ** 63)),
            "stop": mostly(st.lists(st.text(min_size=1, max_size=3), max_size=2)),
            "n": mostly(st.just(1)), "stream": mostly(st.booleans()),
            "stream_options": mostly(st.just({"include_usage": True})),
            "session_id": mostly(st.text(max_size=20)), "ignore_eos": mostly(st.booleans()),
            "max_completion_tokens": SMALL_TOKENS}


def _body(fields: dict):
    return st.fixed_dictionaries({"model": mostly(st.just(MODEL)), **fields},
                                  optional={k: v for k, v in SAMPLING.items() if k not in fields})


VALID_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                       "content": st.text(min_size=1, max_size=40)})
VALID_SAMPLING = {"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
                  "top_k": st.integers(0, 50), "seed": st.integers(0, 2 ** 63),
                  "stream": st.booleans(), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2)}
VALID = st.one_of(  # whole requests that must succeed: the 200 path under generated values
    st.tuples(st.just("/v1/chat/completions"), st.fixed_dictionaries(
        {"model": st.just(MODEL), "max_tokens": st.integers(1, 3),
         "messages": st.lists(VALID_MESSAGE, min_size=1, max_size=3).map(
             lambda ms: ms + [{"role": "user", "content": "go"}])}, optional=VALID_SAMPLING)),
    st.tuples(st.just("/v1/completions"), st.fixed_dictionaries(
        {"model": st.just(MODEL), "max_tokens": st.integers(1, 3),
         "prompt": st.text(min_size=1, max_size=60)}, optional=VALID_SAMPLING)))

REQUESTS = st.one_of(
    VALID,
    st.tuples(st.just("/v1/chat/completions"),
              _body({"messages": mostly(st.lists(MESSAGE, min_size=0, max_size=4)),
                     "max_tokens": SMALL_TOKENS})),
    st.tuples(st.just("/v1/completions"),
              _body({"prompt": mostly(st.text(max_size=60)), "max_tokens": SMALL_TOKENS})),
    st.tuples(st.just("/v1/embeddings"),
              st.fixed_dictionaries({"model": mostly(st.just(MODEL)),
                                     "input": mostly(st.text(max_size=40)),
                                     "encoding_format": st.one_of(st.sampled_from(["float", "base64"]),
                                                                  HOSTILE)})),
    st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]),
              st.one_of(st.binary(max_size=80), st.text(max_size=80).map(str.encode))),
)


def every_replica(method: str, n: int) -> dict[str, dict]:
    """Call `method` on each of the n replicas (reached through the router's avoid list)."""
    from ray import serve

    handle = serve.get_deployment_handle("Replica", app_name="fedserve")
    seen: dict[str, dict] = {}
    for _ in range(n * 4):
        out = getattr(handle, method).remote(Reach(tuple(seen))).result(timeout_s=60)
        seen[out["replica"]] = out
        if len(seen) == n:
            break
    return seen


def test_fuzzed_requests_get_4xx_json_or_a_200_and_never_a_5xx(fed):
    url, cfg = fed
    seen: Counter = Counter()
    with httpx.Client(timeout=120) as c:
        @settings(max_examples=520, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(REQUESTS)
        def one(req):
            path, body = req
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = c.post(f"{url}{path}", content=raw, headers={"Content-Type": "application/json"})
            seen[r.status_code] += 1
            assert r.status_code < 500, (path, raw[:300], r.status_code, r.text[:300])
            if r.status_code != 200:
                err = r.json()["error"]
                assert err["message"] and err["type"] and "Traceback" not in err["message"]
            elif not r.headers.get("content-type", "").startswith("text/event-stream"):
                r.json()  # a whole JSON body (a stream may be asked for with 1 or "true" too)

        one()
    assert sum(seen.values()) >= 500 and seen[200] >= 30 and sum(v for k, v in seen.items() if k >= 400) >= 100, seen
    assert all(v["alive"] and v["ok"] for v in every_replica("check_integrity", cfg.num_replicas).values())
    assert chat(url, [{"role": "user", "content": "still there?"}]).status_code == 200


def test_truncated_clients_and_partial_bodies_leave_the_server_healthy(fed):
    url, cfg = fed
    host, port = url.removeprefix("http://").split(":")
    # slow and broken bodies: a declared length never sent, then the connection dropped or stalled
    stalled = []
    for declared, sent in ((1000, b'{"model": "'), (50, b""), (10, b"{}" * 20)):
        s = socket.create_connection((host, int(port)), timeout=30)
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
                  f"\r\nContent-Length: {declared}\r\n\r\n".encode() + sent)
        stalled.append(s)
    stalled.pop().close()
    # streams whose clients walk away after a few frames
    for i in range(4):
        body = {"model": MODEL, "prompt": f"Count to fifty, number {i}:", "max_tokens": 200, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for k, _ in enumerate(r.iter_lines()):
                if k > 3:
                    break
    assert chat(url, [{"role": "user", "content": "hello while others stall"}]).status_code == 200
    for s in stalled:
        s.close()
    deadline = time.time() + 60
    while any(s["active_streams"] for s in replica_stats(cfg.num_replicas).values()):
        assert time.time() < deadline, "abandoned streams were not cancelled"
        time.sleep(0.5)
    assert all(v["alive"] and v["ok"] for v in every_replica("check_integrity", cfg.num_replicas).values())


def test_z_killing_the_streaming_replica_is_invisible_to_the_client(fed):
    """Runs last in this module: it kills a replica (Serve restarts it)."""
    url = fed[0]
    messages = [{"role": "user", "content": "Write a long paragraph about rivers."}]
    params = {"max_tokens": 48, "temperature": 0.8, "seed": 11}
    reference, _ = stream_text(url, messages, **params)
    body = {"model": MODEL, "messages": messages, **params}
    killed = None

    def kill_it(i: int, headers: dict) -> None:
        nonlocal killed
        if i == 8 and killed is None:
            replica = headers["x-fedserve-replica"]
            name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                        if a["name"].startswith("SERVE_REPLICA::fedserve#Replica#")
                        and a["name"].endswith(replica))
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=False)
            killed = replica

    text, _ = stream_chat(url, body, {"X-Session-ID": "failover-session"}, kill_it, timeout=180)
    assert killed is not None
    assert text == reference
    nxt = chat(url, messages + [{"role": "assistant", "content": text},
                                {"role": "user", "content": "Shorter?"}], session="failover-session")
    assert nxt.status_code == 200 and nxt.headers["x-fedserve-replica"] != killed
