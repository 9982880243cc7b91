"""The federation end to end: 2 replicas on a local Ray, driven over HTTP by the openai client."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter

import httpx
import openai
import pytest
import ray

from tests.federation.live import federation, replica_stats

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
    body = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0,
            "stream": True, **kw}
    text = ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        headers = dict(r.headers)
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:]).get("choices", []):
                    text += ch["delta"].get("content") or ""
    return text, headers


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
    """20 sessions × 4 turns, concurrently: each session on one replica, both replicas used."""
    url = fed[0]
    where: dict[int, set[str]] = {i: set() for i in range(20)}
    cached: list[int] = []

    async def session(i: int, c: httpx.AsyncClient):
        messages = [{"role": "system", "content": f"You are assistant number {i}."}]
        for turn in range(4):
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
            await asyncio.gather(*(session(i, c) for i in range(20)))

    asyncio.run(main())
    assert all(len(r) == 1 for r in where.values()), where
    share = Counter(next(iter(r)) for r in where.values())
    assert len(share) == 2 and min(share.values()) >= 5, share
    assert sum(c > 0 for c in cached) == len(cached), cached  # every later turn reused KV


def test_concurrent_streams_equal_sequential(fed):
    url = fed[0]
    convs = [[{"role": "user", "content": f"Write a line about the number {i}."}] for i in range(16)]
    sequential = [stream_text(url, m)[0] for m in convs]
    results: list[str | None] = [None] * 16

    def run(i):
        results[i] = stream_text(url, convs[i])[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
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


def test_z_killing_the_streaming_replica_is_invisible_to_the_client(fed):
    """Runs last in this module: it kills a replica (Serve restarts it)."""
    url = fed[0]
    messages = [{"role": "user", "content": "Write a long paragraph about rivers."}]
    params = {"max_tokens": 48, "temperature": 0.8, "seed": 11}
    reference, _ = stream_text(url, messages, **params)
    body = {"model": MODEL, "messages": messages, "stream": True, **params}
    text = ""
    killed = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=180,
                      headers={"X-Session-ID": "failover-session"}) as r:
        replica = r.headers["x-fedserve-replica"]
        for i, line in enumerate(r.iter_lines()):
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for ch in chunk.get("choices", []):
                    text += ch["delta"].get("content") or ""
            if i == 8 and killed is None:
                name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                            if a["name"].startswith("SERVE_REPLICA::fedserve#Replica#")
                            and a["name"].endswith(replica))
                ray.kill(ray.get_actor(name, namespace="serve"), no_restart=False)
                killed = replica
    assert killed is not None
    assert text == reference
    nxt = chat(url, messages + [{"role": "assistant", "content": text},
                                {"role": "user", "content": "Shorter?"}], session="failover-session")
    assert nxt.status_code == 200 and nxt.headers["x-fedserve-replica"] != killed
