"""Request routers for the replica deployment (Ray Serve RequestRouter subclasses).

StickyRouter: a session goes to the replica that holds its KV (the directory says which, or a
replica's reported resident_sessions); a new session goes to the least-loaded replica (active +
waiting streams, counting requests this router has in flight, then most free KV blocks); when a
session's replica is gone it is re-pinned by load. RoundRobinRouter: the plain baseline.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from federation.directory import directory_actor
from federation.metrics import RouterMetrics

log = logging.getLogger("fedserve.router")

DIRECTORY_TIMEOUT_S = 2.0  # one directory call; beyond it the router places without it
DIRECTORY_BACKOFF_S = 2.0  # after a failed call, how long the router does not ask again


def _payload(request: PendingRequest | None) -> dict:
    if request is None or not request.args or not isinstance(request.args[0], dict):
        return {}
    return request.args[0]


def _ranks(first: RunningReplica, rest: list[RunningReplica]) -> list[list[RunningReplica]]:
    """Serve's ranking: the chosen replica first, then the others as fallbacks."""
    return [[first], rest] if rest else [[first]]


def _usable(candidates: list[RunningReplica], request: PendingRequest | None) -> list[RunningReplica]:
    """Candidates minus the replicas a failover asks to avoid (unless none would remain)."""
    avoid = set(_payload(request).get("avoid", ()))
    kept = [r for r in candidates if r.replica_id.unique_id not in avoid]
    return kept or candidates


class StickyRouter(RequestRouter):
    """Sticky by residency, then least-loaded."""

    def initialize_state(self, **kwargs) -> None:
        dep = self._deployment_id
        self._directory = directory_actor(namespace=f"fedserve::{dep.app_name}::{dep.name}")
        self._inflight: Counter[str] = Counter()  # replica unique id → requests routed, not done
        self._routed: dict[str, str] = {}  # internal request id → replica unique id
        # placements decided but not yet routed: a burst of new sessions must see each other
        # before the first of them reaches on_request_routed
        self._reserved: Counter[str] = Counter()
        self._reservation: dict[str, str] = {}  # internal request id → reserved replica
        self._metrics = RouterMetrics()
        self._incarnation: str | None = None  # the directory's, as last seen
        self._directory_down_until = 0.0

    async def _ask(self, method, *args):
        """A directory call, or None when the directory is unreachable or slow."""
        if time.monotonic() < self._directory_down_until:
            return None
        try:
            return await asyncio.wait_for(method.remote(*args), DIRECTORY_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - any failure means: route without it
            self._directory_down_until = time.monotonic() + DIRECTORY_BACKOFF_S
            log.warning("session directory unavailable (%s); routing by replica reports",
                        type(e).__name__)
            return None

    async def _lookup(self, session: str, candidates: list[RunningReplica]) -> str | None:
        """The session's owner per the directory; refills a directory seen restarted."""
        answer = await self._ask(self._directory.lookup, session)
        if answer is None:
            return None
        owner, incarnation = answer
        if incarnation != self._incarnation:
            resident = {r.replica_id.unique_id: list((r.routing_stats or {}).get("resident_sessions", ()))
                        for r in candidates}
            if self._incarnation is not None or any(resident.values()):
                await self._ask(self._directory.adopt, resident)
                answer = await self._ask(self._directory.lookup, session)
                owner = answer[0] if answer is not None else None
            self._incarnation = incarnation
        return owner

    def _load(self, r: RunningReplica) -> tuple:
        stats = r.routing_stats or {}
        busy = stats.get("active_streams", 0) + stats.get("waiting_streams", 0)
        rid = r.replica_id.unique_id
        return (max(busy, self._inflight[rid]) + self._reserved[rid],
                -stats.get("free_kv_blocks", 0), rid)

    def _reserve(self, request: PendingRequest | None, rid: str | None) -> None:
        """Count (rid) / release (None) the request's decided, not yet routed placement."""
        key = request.metadata.internal_request_id if request is not None else None
        if key is None:
            return
        old = self._reservation.pop(key, None)
        if old is not None and self._reserved[old] > 0:
            self._reserved[old] -= 1
        if rid is not None:
            self._reservation[key] = rid
            self._reserved[rid] += 1

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        candidate_replicas = _usable(candidate_replicas, pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        session = _payload(pending_request).get("session_key")
        if session is None:
            ranked = sorted(candidate_replicas, key=self._load)
            return _ranks(ranked[0], ranked[1:])
        owner = await self._lookup(session, candidate_replicas)
        ranked = sorted(candidate_replicas, key=self._load)  # after the await: current loads
        if owner in by_id:
            chosen, reason = by_id[owner], "sticky"
        else:
            holders = [r for r in ranked if session in (r.routing_stats or {}).get("resident_sessions", ())]
            chosen = holders[0] if holders else ranked[0]
            reason = "re-pin" if owner is not None else ("sticky" if holders else "new")
            self._reserve(pending_request, chosen.replica_id.unique_id)  # no await since ranking
            winner = await self._ask(self._directory.place, session, chosen.replica_id.unique_id, owner)
            if winner in by_id and winner != chosen.replica_id.unique_id:
                chosen = by_id[winner]
                self._reserve(pending_request, winner)
        self._metrics.placed(reason)
        return _ranks(chosen, [r for r in ranked if r is not chosen])

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result) -> None:
        rid = replica_id.unique_id
        self._reserve(pending_request, None)  # now counted as in flight
        self._inflight[rid] += 1
        self._routed[pending_request.metadata.internal_request_id] = rid

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = self._routed.pop(internal_request_id, replica_id.unique_id)
        if self._inflight[rid] > 0:
            self._inflight[rid] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._inflight.pop(replica_id.unique_id, None)
        self._reserved.pop(replica_id.unique_id, None)
        self._directory.drop_replica.remote(replica_id.unique_id)


class RoundRobinRouter(RequestRouter):
    """Each request to the next replica in turn, ignoring sessions (the comparison baseline)."""

    def initialize_state(self, **kwargs) -> None:
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        candidate_replicas = _usable(candidate_replicas, pending_request)
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        i = next(self._turn) % len(ordered)
        return _ranks(ordered[i], ordered[i + 1:] + ordered[:i])
