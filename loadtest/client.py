"""A small OpenAI-compatible client for load tests: streamed chat with per-token timing, and
embeddings. Plain httpx, so it works against any server and in any process (no Ray, no locust)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class ChatResult:
    """One streamed chat completion, with client-side timing."""

    text: str = ""
    ok: bool = False
    status: int = 0
    error: str = ""
    timed_out: bool = False
    cut: bool = False  # stopped by the scenario's overall time limit (not a server timeout)
    ttft_s: float | None = None  # request sent → first content token
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks
    latency_s: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replica: str = ""
    session: str = ""

    def summary(self) -> dict:
        return {"ok": self.ok, "status": self.status, "error": self.error,
                "timed_out": self.timed_out, "cut": self.cut, "ttft_s": self.ttft_s,
                "latency_s": self.latency_s,
                "completion_tokens": self.completion_tokens, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "replica": self.replica}


def chat_body(model: str, messages: list[dict], max_tokens: int, temperature: float = 0.0,
              seed: int | None = None, stream: bool = True, **extra) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": temperature, "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if seed is not None:
        body["seed"] = seed
    return body


def parse_sse_line(line: str) -> dict | None:
    """One SSE line → its JSON event, or None (comments, blank lines, [DONE])."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    return json.loads(data)


def stream_chat(client: httpx.Client, url: str, body: dict, session: str | None = None,
                timeout: float = 120.0) -> ChatResult:
    """POST a streaming chat and read the SSE response line by line, timing every chunk."""
    res = ChatResult(session=session or "")
    headers = {"X-Session-ID": session} if session else {}
    t0 = time.perf_counter()
    last = None
    try:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers,
                           timeout=timeout) as r:
            res.status = r.status_code
            res.replica = r.headers.get("x-fedserve-replica", "")
            if r.status_code != 200:
                r.read()
                res.error = r.text[:500]
                return res
            for line in r.iter_lines():
                if time.perf_counter() - t0 > timeout:
                    raise httpx.ReadTimeout("stream exceeded its time budget")
                ev = parse_sse_line(line)
                if ev is None:
                    continue
                if "error" in ev:
                    res.error = json.dumps(ev["error"])[:500]
                    return res
                if ev.get("usage"):
                    u = ev["usage"]
                    res.prompt_tokens = u.get("prompt_tokens", 0)
                    res.completion_tokens = u.get("completion_tokens", 0)
                    res.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                for ch in ev.get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content") or ""
                    if not piece:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        res.ttft_s = now - t0
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    res.text += piece
            res.ok = True
    except httpx.TimeoutException as e:
        res.timed_out, res.error = True, f"timeout: {e}"
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.latency_s = time.perf_counter() - t0
    return res


def embed(client: httpx.Client, url: str, model: str, texts: list[str],
          timeout: float = 120.0) -> tuple[bool, str, list[list[float]]]:
    """POST /v1/embeddings → (ok, error, vectors)."""
    try:
        r = client.post(f"{url}/v1/embeddings", json={"model": model, "input": texts},
                        timeout=timeout)
    except httpx.HTTPError as e:
        return False, f"{type(e).__name__}: {e}", []
    if r.status_code != 200:
        return False, f"HTTP {r.status_code}: {r.text[:300]}", []
    return True, "", [d["embedding"] for d in r.json()["data"]]


def model_name(url: str, given: str | None = None) -> str:
    """The served model: `given`, else the first one GET /v1/models lists."""
    if given:
        return given
    r = httpx.get(f"{url}/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def alive(url: str) -> bool:
    """Whether the server still answers (GET /v1/models, which every OpenAI server has)."""
    try:
        return httpx.get(f"{url}/v1/models", timeout=15).status_code == 200
    except httpx.HTTPError:
        return False
