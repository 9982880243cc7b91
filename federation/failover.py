"""Failover by replay (DESIGN.md, principle 4): calls into the replica deployment that outlive
the loss of a replica.

The ingress remembers the token ids it has streamed; if the replica dies, it resubmits the
request with them as resume_token_ids to another replica, which re-prefills and continues.
Decode is batch-invariant, so the client receives exactly the bytes of an uninterrupted run.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import ray

from federation import openai_api as api
from federation.metrics import IngressMetrics
from replica.errors import EngineDeadError
from replica.wire import EmbedResult, ErrorEvent, GenerateCall, TokenEvent

# a replica died or vanished under the request: retry elsewhere
LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
        ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError)


class ReplicaLost(Exception):
    """The replica's stream ended early, or its engine loop stopped: retry elsewhere."""


class Failover:
    """Streams and embeddings from the replica deployment, resubmitted to another replica (up to
    max_failovers times) when theirs is lost; a request error is raised as an APIError."""

    def __init__(self, replicas, max_failovers: int, retry_after_s: int,
                 metrics: IngressMetrics) -> None:
        self.replicas = replicas  # the Replica deployment's handle
        self.max_failovers = max_failovers
        self.retry_after_s = retry_after_s
        self.metrics = metrics

    async def events(self, call: GenerateCall) -> AsyncIterator[TokenEvent]:
        """The request's events across failovers. Raises APIError on a request error."""
        emitted: list[int] = []
        dead: list[str] = []
        for attempt in range(self.max_failovers + 1):
            last = None
            gen = self.replicas.options(stream=True).generate.remote(call.retry(attempt, emitted, dead))
            try:
                async for ev in gen:
                    if isinstance(ev, ErrorEvent):
                        if ev.code == EngineDeadError.code:  # that replica is lost
                            last = ev.replica or last
                            raise ReplicaLost(ev.message)
                        raise api.APIError.from_event(ev)
                    last = ev.replica
                    emitted += ev.token_ids
                    yield ev
                    if ev.finished:
                        return
                raise ReplicaLost("the replica's stream ended early")
            except (ReplicaLost, *LOST) as e:
                if last is not None:
                    dead.append(last)
                await self._before_retry(attempt, e)
                self.metrics.failovers.inc()
                if emitted:  # a Ray counter refuses inc(0); a loss before the first token replays none
                    self.metrics.replayed.inc(len(emitted))

    async def embed(self, texts: list[str]) -> EmbedResult:
        """Embeddings, retried on another replica when one is lost (nothing to replay)."""
        for attempt in range(self.max_failovers + 1):
            try:
                out = await self.replicas.embed.remote(texts)
            except LOST as e:
                await self._before_retry(attempt, e)
                continue
            if isinstance(out, ErrorEvent):
                if out.code == EngineDeadError.code:
                    await self._before_retry(attempt, ReplicaLost(EngineDeadError.code))
                    continue
                raise api.APIError.from_event(out)
            return out
        raise AssertionError("unreachable: _before_retry raises on the last attempt")

    async def _before_retry(self, attempt: int, e: BaseException) -> None:
        """Back off before retry `attempt + 1` (exponential, capped: Serve needs a few seconds
        to notice a lost node), or raise the clean 503 once the retries are spent."""
        if attempt >= self.max_failovers:
            raise api.APIError(503, f"no replica could finish the request after {attempt + 1} "
                               f"attempts ({type(e).__name__})", type_="server_error",
                               code="replicas_unavailable",
                               headers={"Retry-After": str(self.retry_after_s)})
        await asyncio.sleep(min(0.25 * 2 ** attempt, 4.0))
