"""The session directory as a plain class: compare-and-set placement, refill from reports,
and forgetting a dead replica (the actor wraps exactly this)."""

from __future__ import annotations

from federation.directory import SessionDirectory


def test_place_is_compare_and_set():
    d = SessionDirectory()
    assert d.place("s", "r1") == "r1"
    assert d.place("s", "r2") == "r1"  # another router placed it first: its owner stands
    assert d.place("s", "r2", expect="r1") == "r2"  # a re-pin from the owner it saw
    assert d.lookup("s") == ("r2", d.incarnation)


def test_a_restarted_directory_is_refilled_and_known_placements_win():
    d = SessionDirectory()
    d.place("a", "r1")
    assert d.adopt({"r2": ["a", "b"], "r1": ["c"]}) == 2
    assert [d.lookup(s)[0] for s in "abc"] == ["r1", "r2", "r1"]
    assert SessionDirectory().incarnation != d.incarnation  # a restart is visible to routers


def test_a_dead_replica_is_forgotten():
    d = SessionDirectory()
    d.adopt({"r1": ["a", "b"], "r2": ["c"]})
    assert sorted(d.drop_replica("r1")) == ["a", "b"]
    assert d.counts() == {"r2": 1} and d.size() == 1 and d.lookup("a")[0] is None
