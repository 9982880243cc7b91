"""StickyRouter's placement logic, driven directly: the real SessionDirectory behind an async
stand-in for its actor handle (gated or failing on demand), replicas as their routing stats.
The live paths (a real directory actor killed under load, Serve's fallbacks) are in
test_hardening.py; these pin down the orderings a live run hits only by chance."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

import federation.router as router_mod
from federation.directory import SessionDirectory
from replica.wire import GenerateCall


class Directory:
    """SessionDirectory's methods as `.method.remote(...)` awaitables; `down` makes every call
    fail, `adopt_gate` holds adopt calls until set."""

    def __init__(self) -> None:
        self.state = SessionDirectory()
        self.down = False
        self.adopt_gate: asyncio.Event | None = None
        self.calls: list[str] = []
        for name in ("lookup", "place", "adopt", "drop_replica"):
            setattr(self, name, SimpleNamespace(remote=self._method(name)))

    def restart(self) -> None:
        self.state = SessionDirectory()  # empty, with a new incarnation

    def _method(self, name: str):
        async def call(*args):
            self.calls.append(name)
            if self.down:
                raise ConnectionError("directory unreachable")
            if name == "adopt" and self.adopt_gate is not None:
                await self.adopt_gate.wait()
            return getattr(self.state, name)(*args)
        return call


class Placements:
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def placed(self, reason: str) -> None:
        self.reasons.append(reason)


def replica(rid: str, busy: int = 0, retained: dict[str, float] | None = None):
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid),
                           routing_stats={"active_streams": busy, "waiting_streams": 0,
                                          "free_kv_blocks": 100,
                                          "resident_retained_at": retained or {}})


def request(session: str, key: str):
    call = GenerateCall(request_id=key, params={}, session_id=session)
    return SimpleNamespace(args=[call], metadata=SimpleNamespace(internal_request_id=key))


@pytest.fixture
def routed(monkeypatch):
    """(router, directory): a StickyRouter without Serve around it."""
    directory = Directory()
    monkeypatch.setattr(router_mod, "directory_actor", lambda namespace: directory)
    monkeypatch.setattr(router_mod, "RouterMetrics", Placements)
    r = router_mod.StickyRouter.__new__(router_mod.StickyRouter)
    r._deployment_id = SimpleNamespace(app_name="app", name="Replica")
    r.initialize_state()
    return r, directory


def choose(r, replicas, session, key):
    return r.choose_replicas(replicas, request(session, key))


def ids(ranks) -> list[list[str]]:
    return [[x.replica_id.unique_id for x in rank] for rank in ranks]


def test_lookups_that_see_a_restarted_directory_all_wait_for_its_refill(routed):
    r, directory = routed
    sessions = [f"s{i}" for i in range(8)]
    for s in sessions:
        r._remember(s, "A")  # this router ran each session's last turn on A
    # the replicas' reports are stale (A's does not list them yet), and A is the busier one:
    # a lookup that ran ahead of the refill would place every session anew, on B
    replicas = [replica("A", busy=8), replica("B")]
    directory.restart()
    directory.adopt_gate = asyncio.Event()

    async def turn():
        tasks = [asyncio.ensure_future(choose(r, replicas, s, f"k{i}")) for i, s in enumerate(sessions)]
        while directory.calls.count("lookup") < len(sessions):  # every lookup saw the restart
            await asyncio.sleep(0)
        directory.adopt_gate.set()
        return await asyncio.gather(*tasks)

    ranks = asyncio.run(turn())
    assert [ids(x) for x in ranks] == [[["A"]]] * len(sessions)  # sticky: no fallback rank yet
    assert directory.calls.count("adopt") == 1  # one refill, awaited by all
    assert [directory.state.lookup(s)[0] for s in sessions] == ["A"] * len(sessions)
    assert r._metrics.reasons == ["sticky"] * len(sessions)


def test_a_failed_refill_is_tried_again_by_the_next_lookup(routed):
    r, directory = routed
    r._remember("s", "A")
    replicas = [replica("A", busy=3), replica("B")]
    directory.restart()

    async def adopt_fails(*args):
        raise ConnectionError("directory went away again")

    directory.adopt = SimpleNamespace(remote=adopt_fails)
    assert ids(asyncio.run(choose(r, replicas, "s", "k1"))) == [["A"]]  # still by its own placements
    directory.adopt = SimpleNamespace(remote=directory._method("adopt"))
    r._directory_down_until = 0.0  # the backoff after the failure has passed
    assert ids(asyncio.run(choose(r, replicas, "s", "k2"))) == [["A"]]
    assert directory.state.lookup("s")[0] == "A" and r._incarnation == directory.state.incarnation


@pytest.mark.parametrize("recent_at, reported_at, expected", [
    (100.0, 200.0, "B"),  # it moved to B after this router last placed it (another router did)
    (200.0, 100.0, "A"),  # B retains older KV of it: its latest turn ran on A
    (None, 100.0, "B"),   # only B's report knows it
    (100.0, None, "A"),   # only this router knows it
])
def test_an_unreachable_directory_routes_by_the_newest_of_own_placements_and_reports(
        routed, recent_at, reported_at, expected):
    r, directory = routed
    directory.down = True
    if recent_at is not None:
        r._recent["s"] = ("A", recent_at)
    replicas = [replica("A", busy=5), replica("B", busy=5, retained=(
        {"s": reported_at} if reported_at is not None else {}))]
    assert ids(asyncio.run(choose(r, replicas, "s", "k"))) == [[expected]]
    assert r._metrics.reasons == ["sticky"]


def test_an_unknown_session_goes_to_the_least_loaded_and_is_placed(routed):
    r, directory = routed
    replicas = [replica("A", busy=2), replica("B", busy=1)]
    assert ids(asyncio.run(choose(r, replicas, "s", "k"))) == [["B"], ["A"]]  # A: a fallback
    assert directory.state.lookup("s")[0] == "B" and r._metrics.reasons == ["new"]


def test_a_session_whose_replica_is_gone_is_re_pinned_where_its_kv_is(routed):
    r, directory = routed
    directory.state.place("s", "gone")
    replicas = [replica("A"), replica("B", busy=4, retained={"s": 50.0})]  # B has older KV of it
    assert ids(asyncio.run(choose(r, replicas, "s", "k"))) == [["B"], ["A"]]
    assert directory.state.lookup("s")[0] == "B" and r._metrics.reasons == ["re-pin"]
