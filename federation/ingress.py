"""The OpenAI-compatible ingress: auth, validation, admission, the session key, and the
responses (JSON or SSE). It calls the replicas through failover by replay (federation/failover.py).
"""


import asyncio
import json
import time
from dataclasses import replace
from typing import AsyncIterator

from ray import serve
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from federation import openai_api as api
from federation.config import FederationConfig
from federation.failover import Failover
from federation.tenancy import RateLimits, Tenants, namespaced
from replica.wire import GenerateCall, TokenEvent
from federation.metrics import IngressMetrics

app = FastAPI(title="fedserve", docs_url=None, redoc_url=None)

CAPACITY_REFRESH_S = 5.0


@app.exception_handler(api.APIError)
async def _api_error(_: Request, e: api.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
    message, param = api.validation_message(e.errors())
    return JSONResponse(api.APIError(400, message, param=param).body(), status_code=400)


@serve.ingress(app)  # at import, so every process that unpickles the class sees the same routes
class Ingress:
    """FastAPI ingress deployment body."""

    def __init__(self, replicas, config: dict) -> None:
        self.cfg = FederationConfig(**config)
        self.tenants = Tenants(self.cfg.api_keys)
        self.limits = RateLimits(self.cfg.rate_limit_rps,
                                 self.cfg.rate_limit_burst or 2 * self.cfg.rate_limit_rps)
        self.replicas = replicas
        self.active = 0
        self.capacity = self._capacity(self.cfg.num_replicas)
        self._capacity_checked = time.monotonic()  # the replica count is re-read every few seconds
        self.metrics = IngressMetrics()
        self.failover = Failover(replicas, self.cfg.max_failovers, self.cfg.retry_after_s,
                                 self.metrics)

    # ---- routes -------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(self, request: Request):
        body = await self._body(request, api.ChatRequest)
        if len(body.messages) > self.cfg.max_messages:
            raise api.APIError(413, f"{len(body.messages)} messages exceed the limit of "
                               f"{self.cfg.max_messages}", param="messages", code="too_many_messages")
        max_tokens = self._max_tokens(body.max_completion_tokens or body.max_tokens)
        call = GenerateCall(request_id="", params=body.params(max_tokens),
                            messages=tuple(body.engine_messages()))
        return await self._run(request, body, call, chat=True)

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        body = await self._body(request, api.CompletionRequest)
        params = body.params(self._max_tokens(body.max_tokens or 16))
        call = (GenerateCall(request_id="", params=params, prompt_token_ids=tuple(body.prompt))
                if isinstance(body.prompt, list) else
                GenerateCall(request_id="", params=params, prompt=body.prompt))
        return await self._run(request, body, call, chat=False)

    @app.post("/v1/embeddings")
    async def embeddings(self, request: Request):
        body = await self._body(request, api.EmbeddingRequest)
        try:
            texts = body.texts()
        except ValueError as e:
            raise api.APIError(400, str(e), param="input")
        self._admit()
        out = await self.failover.embed(texts)
        data = [{"object": "embedding", "index": i,
                 "embedding": api.encode_embedding(v, body.encoding_format)}
                for i, v in enumerate(out.vectors)]
        return JSONResponse({"object": "list", "data": data, "model": self.cfg.name,
                             "usage": {"prompt_tokens": out.prompt_tokens,
                                       "total_tokens": out.prompt_tokens}},
                            headers={"X-Session-ID": "", "X-Fedserve-Replica": out.replica})

    @app.get("/v1/models")
    async def models(self, request: Request):
        self.tenants.authenticate(request.headers.get("authorization"))
        return {"object": "list", "data": [{"id": self.cfg.name, "object": "model",
                                            "created": 0, "owned_by": "fedserve"}]}

    @app.get("/health")
    async def health(self):
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(self):
        try:
            info = await asyncio.wait_for(self.replicas.info.remote(), timeout=5)
        except Exception as e:  # noqa: BLE001 - readiness reports any failure
            return JSONResponse({"status": "not ready", "reason": type(e).__name__}, status_code=503)
        return {"status": "ready", "model": info["model"]}

    @app.get("/v1/fedserve/status")
    async def status(self, request: Request):
        """Every replica's load, KV use and retained sessions (`fedserve status`)."""
        from federation.status import gather

        self.tenants.authenticate(request.headers.get("authorization"))

        return {"model": self.cfg.name, "expected_replicas": self.cfg.num_replicas,
                "ingress": {"active": self.active, "capacity": self.capacity},
                "replicas": await gather(self.replicas, self.cfg.num_replicas)}

    # ---- plumbing -----------------------------------------------------------------------
    def _max_tokens(self, n: int | None) -> int | None:
        if n is not None and n > self.cfg.max_completion_tokens:
            raise api.APIError(400, f"max_tokens={n} exceeds this federation's limit of "
                               f"{self.cfg.max_completion_tokens}", param="max_tokens",
                               code="max_tokens_too_large")
        return n

    async def _body(self, request: Request, model_cls):
        """The validated body of an authenticated, rate-admitted request (tenant on request.state)."""
        request.state.tenant = self.tenants.authenticate(request.headers.get("authorization"))
        try:
            self.limits.admit(request.state.tenant)
        except api.APIError:
            self.metrics.rejected.inc(tags={"code": "rate_limited"})
            raise
        raw = await request.body()
        if len(raw) > self.cfg.max_body_bytes:
            raise api.APIError(413, f"request body of {len(raw)} bytes exceeds the limit of "
                               f"{self.cfg.max_body_bytes}", code="body_too_large")
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise api.APIError(400, f"the body is not valid JSON: {e}", code="invalid_json")
        if not isinstance(data, dict):
            raise api.APIError(400, "the body must be a JSON object", code="invalid_json")
        try:
            body = model_cls.model_validate(data)
        except ValidationError as e:
            message, param = api.validation_message(e.errors())
            raise api.APIError(400, message, param=param)
        if body.model != self.cfg.name:
            raise api.APIError(404, f"the model {body.model!r} does not exist; this federation "
                               f"serves {self.cfg.name!r}", param="model", code="model_not_found")
        return body

    def _capacity(self, replicas: int) -> int:
        return replicas * self.cfg.max_running_streams + self.cfg.max_queued_requests

    async def _refresh_capacity(self) -> None:
        """Capacity follows the replicas Serve runs now: a `serve deploy` that scales the Replica
        deployment changes it without restarting this ingress."""
        try:
            app = serve.get_replica_context().app_name
            status = await asyncio.to_thread(serve.status)
            running = status.applications[app].deployments["Replica"].replica_states.get("RUNNING", 0)
        except Exception:  # noqa: BLE001 - keep the last known capacity
            return
        if running:
            self.capacity = self._capacity(running)

    def _admit(self) -> None:
        if time.monotonic() - self._capacity_checked > CAPACITY_REFRESH_S:
            self._capacity_checked = time.monotonic()
            self._refresh = asyncio.get_running_loop().create_task(self._refresh_capacity())
        if self.active >= self.capacity:
            self.metrics.rejected.inc(tags={"code": "overloaded"})
            raise api.APIError(429, "all replicas are busy and the queue is full; retry later",
                               type_="rate_limit_exceeded", code="overloaded",
                               headers={"Retry-After": str(self.cfg.retry_after_s)})

    def _session(self, request: Request, body) -> str:
        return request.headers.get("x-session-id") or body.session_id or body.session_key()

    async def _run(self, request: Request, body, call: GenerateCall, chat: bool):
        self._admit()
        session = self._session(request, body)  # the client's key; behind us, the tenant's
        call = replace(call, session_id=namespaced(request.state.tenant, session),
                       request_id=api.new_id("req"))
        rid = api.new_id("chatcmpl" if chat else "cmpl")
        model = self.cfg.name
        events = self.failover.events(call)
        self.active += 1
        try:
            first = await anext(events)  # errors before any token become plain HTTP errors
        except BaseException:
            self.active -= 1
            await events.aclose()
            raise
        headers = {"X-Session-ID": session, "X-Fedserve-Replica": first.replica}
        if body.stream:
            return StreamingResponse(self._sse(events, first, rid, model, chat, body.include_usage),
                                     media_type="text/event-stream", headers=headers)
        try:
            text, last = first.text, first
            async for ev in events:
                text += ev.text
                last = ev
        finally:
            self.active -= 1
            await events.aclose()
        headers["X-Fedserve-Replica"] = last.replica
        use = api.usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens)
        build = api.chat_response if chat else api.completion_response
        return JSONResponse(build(rid, model, text, last.finish_reason, use), headers=headers)

    async def _sse(self, events, first: TokenEvent, rid: str, model: str, chat: bool,
                   include_usage: bool) -> AsyncIterator[str]:
        """SSE frames; a client disconnect cancels this generator, which aborts the stream."""
        chunk = api.chat_chunk if chat else api.completion_chunk
        try:
            if chat:
                yield api.chat_chunk(rid, model, {"role": "assistant", "content": ""})
            ev = first
            while True:
                reason = ev.finish_reason if ev.finished else None
                if ev.text or reason:
                    yield (chunk(rid, model, {"content": ev.text} if ev.text else {}, reason)
                           if chat else chunk(rid, model, ev.text, reason))
                if ev.finished:
                    if include_usage:
                        use = api.usage(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens)
                        yield (chunk(rid, model, {}, None, use, choices=False) if chat
                               else chunk(rid, model, "", None, use, choices=False))
                    break
                ev = await anext(events)
        except api.APIError as e:
            yield api.error_chunk(e)
        finally:
            self.active -= 1
            await events.aclose()
        yield api.DONE
