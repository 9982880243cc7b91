"""The replica deployment body: one resident Engine per replica (Serve applies the deployment
options in federation/app.py). Events cross the process boundary as plain dicts."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from replica.config import EngineConfig
from replica.engine import Engine
from replica.errors import FedserveError
from replica.metrics import ReplicaMetrics
from replica.request import Request
from replica.sampling import SamplingParams


def error_event(e: FedserveError) -> dict:
    return {"error": {"status": e.status, "message": e.message, "param": e.param, "code": e.code,
                      "type": type(e).__name__}}


class ReplicaServer:
    """Owns one Engine. `generate` streams event dicts; `embed` returns vectors."""

    def __init__(self, engine_kwargs: dict) -> None:
        self.engine = Engine(EngineConfig(**engine_kwargs))
        self.metrics = ReplicaMetrics()
        try:
            from ray import serve

            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside Serve (direct use in tests)
            self.replica_id = "local"

    async def generate(self, payload: dict) -> AsyncIterator[dict]:
        """payload: prompt | prompt_token_ids | messages, params (SamplingParams fields),
        session_key, resume_token_ids, request_id."""
        try:
            req = Request(
                prompt=payload.get("prompt"),
                prompt_token_ids=(tuple(payload["prompt_token_ids"])
                                  if payload.get("prompt_token_ids") is not None else None),
                messages=tuple(payload["messages"]) if payload.get("messages") else None,
                params=SamplingParams(**payload.get("params", {})),
                session_id=payload.get("session_key"),
                resume_token_ids=tuple(payload.get("resume_token_ids") or ()),
                request_id=payload["request_id"],
            )
            timer = self.metrics.stream()
            async for ev in self.engine.stream(req):
                timer.event(len(ev.token_ids))
                if ev.finished:
                    timer.finished(ev.finish_reason, ev.prompt_tokens, ev.cached_tokens)
                yield {"text": ev.text, "token_ids": list(ev.token_ids), "finished": ev.finished,
                       "finish_reason": ev.finish_reason, "prompt_tokens": ev.prompt_tokens,
                       "completion_tokens": ev.completion_tokens,
                       "cached_tokens": ev.cached_tokens, "replica": self.replica_id}
        except FedserveError as e:
            yield error_event(e)

    async def embed(self, texts: list[str]) -> dict:
        try:
            vectors = await asyncio.to_thread(self.engine.embed, texts)
            tokens = sum(len(self.engine.tokenizer.encode(t)) for t in texts)
            return {"vectors": vectors, "prompt_tokens": tokens, "replica": self.replica_id}
        except FedserveError as e:
            return error_event(e)

    def info(self) -> dict:
        cfg = self.engine.model_config
        return {"model": cfg.name, "max_context": cfg.max_position, "synthetic": cfg.synthetic,
                "replica": self.replica_id}

    def stats(self, routing: dict | None = None) -> dict:
        """Routing stats on demand; `routing` may carry {"avoid": [...]} to reach a given replica."""
        return self.record_routing_stats()

    def check_integrity(self, routing: dict | None = None) -> dict:
        """The KV pool's invariants, checked on the engine loop between steps (fuzzing and soak
        tests ask every replica after a run). `routing` as for stop_engine."""
        found: dict = {}

        def check() -> None:
            try:
                self.engine.core.check_integrity()
                found["ok"] = True
            except Exception as e:  # noqa: BLE001 - reported, never raised into the loop
                found["error"] = f"{type(e).__name__}: {e}"

        if self.engine.is_alive:
            self.engine.run_on_loop(check)
        return {"replica": self.replica_id, "alive": self.engine.is_alive,
                "ok": found.get("ok", False), "error": found.get("error")}

    def stop_engine(self, routing: dict | None = None) -> str:
        """Stop this replica's engine (an operator's drain, and the tests' way to fail a health
        check): its streams end with engine_dead and move elsewhere, then Serve replaces it.
        `routing` may carry {"avoid": [...]} to reach a given replica. Returns the replica id."""
        self.engine.shutdown()
        return self.replica_id

    def check_health(self) -> None:
        if not self.engine.is_alive:
            raise RuntimeError("the engine loop is dead")

    def record_routing_stats(self) -> dict:
        stats = self.engine.stats()
        stats["replica"] = self.replica_id
        self.metrics.record_stats(stats, self._preemptions(stats))
        return stats

    def _preemptions(self, stats: dict) -> int | None:
        """The engine's preemption count. Engine.stats() does not report it yet, so until it
        does this reads the scheduler's counter (an int, read without the loop's help)."""
        if "num_preemptions" in stats:
            return stats["num_preemptions"]
        scheduler = getattr(getattr(self.engine, "core", None), "scheduler", None)
        return getattr(scheduler, "num_preemptions", None)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
