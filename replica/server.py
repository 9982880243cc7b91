"""The replica deployment body: one resident Engine per replica (Serve applies the deployment
options in federation/app.py). Calls and events cross the process boundary as the frozen
dataclasses of replica/wire.py."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from replica.config import EngineConfig
from replica.engine import Engine
from replica.errors import FedserveError
from replica.metrics import ReplicaMetrics
from replica.wire import EmbedResult, ErrorEvent, GenerateCall, Reach, TokenEvent


class ReplicaServer:
    """Owns one Engine. `generate` streams TokenEvents (or one ErrorEvent); `embed` returns vectors."""

    def __init__(self, engine_kwargs: dict) -> None:
        self.engine = Engine(EngineConfig(**engine_kwargs))
        self.metrics = ReplicaMetrics()
        try:
            from ray import serve

            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside Serve (direct use in tests)
            self.replica_id = "local"

    def _error(self, e: FedserveError) -> ErrorEvent:
        return ErrorEvent(e.code, e.message, e.param, self.replica_id)

    async def generate(self, call: GenerateCall) -> AsyncIterator[TokenEvent | ErrorEvent]:
        try:
            req = call.to_request()
            timer = self.metrics.stream()
            async for ev in self.engine.stream(req):
                timer.event(len(ev.token_ids))
                if ev.finished:
                    timer.finished(ev.finish_reason, ev.prompt_tokens, ev.cached_tokens)
                yield TokenEvent(self.replica_id, ev.text, tuple(ev.token_ids), ev.finished,
                                 ev.finish_reason, ev.prompt_tokens, ev.completion_tokens,
                                 ev.cached_tokens)
        except FedserveError as e:
            yield self._error(e)

    async def embed(self, texts: list[str]) -> EmbedResult | ErrorEvent:
        try:
            vectors = await asyncio.to_thread(self.engine.embed, texts)
            tokens = sum(len(self.engine.tokenizer.encode(t)) for t in texts)
            return EmbedResult(self.replica_id, vectors, tokens)
        except FedserveError as e:
            return self._error(e)

    def info(self) -> dict:
        cfg = self.engine.model_config
        return {"model": cfg.name, "max_context": cfg.max_position, "synthetic": cfg.synthetic,
                "replica": self.replica_id}

    def stats(self, reach: Reach | None = None) -> dict:
        """Routing stats on demand; `reach` steers the call to a given replica."""
        return self.record_routing_stats()

    def check_integrity(self, reach: Reach | None = None) -> dict:
        """The KV pool's invariants, checked on the engine loop between steps (fuzzing and soak
        tests ask every replica after a run). `reach` as for stats."""
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

    def stop_engine(self, reach: Reach | None = None) -> str:
        """Stop this replica's engine (an operator's drain, and the tests' way to fail a health
        check): its streams end with engine_dead and move elsewhere, then Serve replaces it.
        `reach` as for stats. Returns the replica id."""
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
