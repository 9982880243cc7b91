"""Request routers for the replica deployment (Ray Serve RequestRouter subclasses).

StickyRouter: a session goes to the replica that holds its KV (the directory says which; where it
does not know, the newest of this router's own placements and the replicas' reports of the
sessions they retain); a new session goes to the least-loaded replica
(active + waiting streams, counting requests this router has in flight, then most free KV
blocks); when a session's replica is gone it is re-pinned by load. RoundRobinRouter: the plain
baseline.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter, OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from federation.directory import directory_actor
from federation.metrics import RouterMetrics
from replica.wire import call_routing

log = logging.getLogger("fedserve.router")

DIRECTORY_TIMEOUT_S = 2.0  # one directory call; beyond it the router places without it
DIRECTORY_BACKOFF_S = 2.0  # after a failed call, how long the router does not ask again
# a session's replica is the only rank offered for this long after a request's first routing
# round (Serve asks again after each failed round, backing off, and its queue-length probe waits
# 0.1 s, then up to 1 s): a probe slow on a busy machine must not move a session off its KV;
# after that the other replicas are fallbacks, so a replica that stopped answering cannot hold a
# request until its death is noticed
STICKY_WAIT_S = 5.0
RECENT_PLACEMENTS = 100_000  # sessions this router remembers placing (its fallback directory)


def _routing(request: PendingRequest | None) -> tuple[str | None, tuple[str, ...]]:
    """(session id, replicas to avoid) of a pending call (replica/wire.py)."""
    if request is None or not request.args:
        return None, ()
    return call_routing(request.args[0])


def _retained(replica: RunningReplica) -> dict[str, float]:
    """The sessions a replica reports retaining (its resident_sessions) → when their last turn
    finished there (unix seconds)."""
    return (replica.routing_stats or {}).get("resident_retained_at") or {}


def _ranks(first: RunningReplica, rest: list[RunningReplica]) -> list[list[RunningReplica]]:
    """Serve's ranking: the chosen replica first, then the others as fallbacks."""
    return [[first], rest] if rest else [[first]]


def _usable(candidates: list[RunningReplica], request: PendingRequest | None) -> list[RunningReplica]:
    """Candidates minus the replicas a failover asks to avoid (unless none would remain)."""
    avoid = set(_routing(request)[1])
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
        self._incarnation: str | None = None  # the directory's, as last refilled
        self._refill: tuple[str, asyncio.Future] | None = None  # (incarnation, its refill)
        # internal request id → (session, replica chosen): Serve may still send a request to a
        # fallback rank (the chosen replica's probe failed), and the directory must follow
        self._placed: dict[str, tuple[str, str]] = {}
        self._first_round: dict[str, float] = {}  # internal request id → its first round (monotonic)
        # session → (replica it last ran on, when it was routed there, unix seconds)
        self._recent: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._directory_down_until = 0.0

    async def _ask(self, method, *args):
        """A directory call, or None when the directory is unreachable or slow."""
        if time.monotonic() < self._directory_down_until:
            return None
        try:
            return await asyncio.wait_for(method.remote(*args), DIRECTORY_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - any failure means: route without it
            self._directory_down_until = time.monotonic() + DIRECTORY_BACKOFF_S
            log.warning("session directory unavailable (%s); routing by this router's placements "
                        "and the replicas' reports", type(e).__name__)
            return None

    async def _lookup(self, session: str, candidates: list[RunningReplica]) -> str | None:
        """The session's owner per the directory, or None (unknown to it, or it is unreachable).
        A directory seen restarted is refilled first, once, and every lookup that saw the
        restart waits for that refill: one that ran ahead of it would find the session
        unknown and place it by reports that may be seconds old."""
        answer = await self._ask(self._directory.lookup, session)
        if answer is not None and answer[1] != self._incarnation:
            await self._refilled(answer[1], candidates)
            answer = await self._ask(self._directory.lookup, session)
        return answer[0] if answer is not None else None

    async def _refilled(self, incarnation: str, candidates: list[RunningReplica]) -> None:
        """The refill of directory `incarnation`, started by the first lookup to see it (or
        again, if the last try failed), awaited by all."""
        if self._refill is None or self._refill[0] != incarnation or (
                self._refill[1].done() and not self._refill[1].result()):
            self._refill = (incarnation, asyncio.ensure_future(self._refill_from(candidates)))
        if await asyncio.shield(self._refill[1]):
            self._incarnation = incarnation

    async def _refill_from(self, candidates: list[RunningReplica]) -> bool:
        """A (re)started directory learns this router's recent placements and every session a
        replica reports it retains, each with its time: a session that moved is retained by
        its old replica too, and other routers remember it there; the newest report wins.
        True once the directory took them."""
        known = [(session, rid, when) for session, (rid, when) in self._recent.items()]
        for r in candidates:
            known += [(session, r.replica_id.unique_id, when)
                      for session, when in _retained(r).items()]
        return not known or await self._ask(self._directory.adopt, known) is not None

    def _last_seen(self, session: str, ranked: list[RunningReplica]) -> RunningReplica | None:
        """Where the session's latest turn ran, by this router's own placements and the
        replicas' reports of the KV they retain (the newest wins, as in a refill); None if
        no live replica has it."""
        seen = {r.replica_id.unique_id: _retained(r)[session]
                for r in ranked if session in _retained(r)}
        rid, when = self._recent.get(session, (None, 0.0))
        if rid is not None:
            seen[rid] = max(seen.get(rid, 0.0), when)
        live = [r for r in ranked if r.replica_id.unique_id in seen]
        return max(live, key=lambda r: seen[r.replica_id.unique_id], default=None)

    def _remember(self, session: str, rid: str) -> None:
        self._recent[session] = (rid, time.time())
        self._recent.move_to_end(session)
        if len(self._recent) > RECENT_PLACEMENTS:
            self._recent.popitem(last=False)

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
        session = _routing(pending_request)[0]
        if session is None:
            ranked = sorted(candidate_replicas, key=self._load)
            return _ranks(ranked[0], ranked[1:])
        owner = await self._lookup(session, candidate_replicas)
        ranked = sorted(candidate_replicas, key=self._load)  # after the await: current loads
        if owner in by_id:
            chosen, reason = by_id[owner], "sticky"
        else:
            # the directory does not know it (or is unreachable), or its replica is gone: the
            # replica its latest turn ran on, else the least loaded
            last = self._last_seen(session, ranked)
            chosen = last or ranked[0]
            reason = "re-pin" if owner is not None else ("sticky" if last else "new")
            self._reserve(pending_request, chosen.replica_id.unique_id)  # no await since ranking
            winner = await self._ask(self._directory.place, session, chosen.replica_id.unique_id, owner)
            if winner in by_id and winner != chosen.replica_id.unique_id:
                chosen = by_id[winner]
                self._reserve(pending_request, winner)
        self._metrics.placed(reason)
        rest = [r for r in ranked if r is not chosen]
        if pending_request is not None:
            key = pending_request.metadata.internal_request_id
            self._placed[key] = (session, chosen.replica_id.unique_id)
            first = self._first_round.setdefault(key, time.monotonic())
            if reason == "sticky" and time.monotonic() - first < STICKY_WAIT_S:
                rest = []  # wait for the replica that holds the session's KV
        return _ranks(chosen, rest)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result) -> None:
        rid = replica_id.unique_id
        self._reserve(pending_request, None)  # now counted as in flight
        self._inflight[rid] += 1
        self._routed[pending_request.metadata.internal_request_id] = rid
        self._first_round.pop(pending_request.metadata.internal_request_id, None)
        placed = self._placed.pop(pending_request.metadata.internal_request_id, None)
        if placed is not None:
            session, meant = placed
            self._remember(session, rid)
            if meant != rid:  # it ran elsewhere: its KV will be there
                self._directory.place.remote(session, rid, meant)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = self._routed.pop(internal_request_id, replica_id.unique_id)
        self._placed.pop(internal_request_id, None)
        self._first_round.pop(internal_request_id, None)
        if self._inflight[rid] > 0:
            self._inflight[rid] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._inflight.pop(replica_id.unique_id, None)
        self._reserved.pop(replica_id.unique_id, None)
        for session in [s for s, (r, _) in self._recent.items() if r == replica_id.unique_id]:
            del self._recent[session]
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
