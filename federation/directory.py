"""The session directory: session key → replica, one named Ray actor per application, so the
routers in every process agree where a session lives. It alone owns placement state."""

from __future__ import annotations

from collections import Counter

import ray


class SessionDirectory:
    """Plain class (tested directly); `directory_actor()` wraps it as a Ray actor."""

    def __init__(self) -> None:
        self._where: dict[str, str] = {}

    def lookup(self, session: str) -> str | None:
        return self._where.get(session)

    def place(self, session: str, replica: str, expect: str | None = None) -> str:
        """Compare-and-set: place `session` on `replica` unless another router placed it
        elsewhere first (its current owner differs from `expect`); returns the owner."""
        current = self._where.get(session)
        if current is not None and current != expect:
            return current
        self._where[session] = replica
        return replica

    def drop_replica(self, replica: str) -> list[str]:
        """Forget a dead replica; returns the sessions that lost their home."""
        gone = [s for s, r in self._where.items() if r == replica]
        for s in gone:
            del self._where[s]
        return gone

    def counts(self) -> dict[str, int]:
        return dict(Counter(self._where.values()))

    def size(self) -> int:
        return len(self._where)


def directory_actor(namespace: str, name: str = "fedserve_session_directory"):
    """The application's directory actor (created on first use, detached)."""
    cls = ray.remote(num_cpus=0, max_restarts=-1)(SessionDirectory)
    return cls.options(name=name, namespace=namespace, get_if_exists=True,
                       lifetime="detached").remote()
