"""The session directory: session key → replica, one named Ray actor per application, so the
routers in every process agree where a session lives. It alone owns placement state.

It is a cache of what the replicas know, never the only copy: every replica reports the sessions
whose KV it retains (`resident_sessions`), so a directory that restarted empty is refilled from
them (`adopt`), and a router that cannot reach it places by those reports and by load.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter

import ray

# Ray gives the head node this resource; an actor that asks for a sliver of it lives there,
# where losing a worker machine cannot take it
HEAD_RESOURCE = "node:__internal_head__"


class SessionDirectory:
    """Plain class (tested directly); `directory_actor()` wraps it as a Ray actor.

    Each placement carries when it was made (unix seconds): a refill hears the same session from
    several sources (routers' recent placements, every replica that retains its KV, which after
    a move is the old replica too), and the newest of them is where the session's latest turn
    ran. The clocks are the machines' own; turns of one session are seconds apart, far more than
    the skew of synchronized clocks."""

    def __init__(self) -> None:
        self._where: dict[str, tuple[str, float]] = {}  # session → (replica, when)
        self.incarnation = uuid.uuid4().hex  # a restarted directory has a new one, and no state

    def lookup(self, session: str) -> tuple[str | None, str]:
        """(the session's replica or None, this directory's incarnation)."""
        return self._where.get(session, (None, 0.0))[0], self.incarnation

    def place(self, session: str, replica: str, expect: str | None = None) -> str:
        """Compare-and-set: place `session` on `replica` unless another router placed it
        elsewhere first (its current owner differs from `expect`); returns the owner."""
        current = self._where.get(session, (None, 0.0))[0]
        if current is not None and current != expect:
            return current
        self._where[session] = (replica, time.time())
        return replica

    def adopt(self, placements: list[tuple[str, str, float]]) -> int:
        """Refill from (session, replica, when) reports: routers' recent placements and the
        sessions each replica retains, with when it retained them. Per session the newest wins,
        a placement made since the restart included. Returns how many sessions it placed anew
        or moved."""
        before: dict[str, str | None] = {}
        for session, replica, when in placements:
            known = self._where.get(session)
            before.setdefault(session, None if known is None else known[0])
            if known is None or when > known[1]:
                self._where[session] = (replica, when)
        return sum(self._where[s][0] != owner for s, owner in before.items())

    def drop_replica(self, replica: str) -> list[str]:
        """Forget a dead replica; returns the sessions that lost their home."""
        gone = [s for s, (r, _) in self._where.items() if r == replica]
        for s in gone:
            del self._where[s]
        return gone

    def counts(self) -> dict[str, int]:
        return dict(Counter(r for r, _ in self._where.values()))

    def size(self) -> int:
        return len(self._where)


def directory_actor(namespace: str, name: str = "fedserve_session_directory"):
    """The application's directory actor (created on first use, detached, on the head node)."""
    on_head = {}
    if any(HEAD_RESOURCE in n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")):
        on_head = {"resources": {HEAD_RESOURCE: 0.001}}
    cls = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(SessionDirectory)
    return cls.options(name=name, namespace=namespace, get_if_exists=True,
                       lifetime="detached", **on_head).remote()
