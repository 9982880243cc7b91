"""The session directory as a plain class: compare-and-set placement, refill from reports
(the newest placement of a session wins), and forgetting a dead replica (the actor wraps exactly this)."""

from __future__ import annotations

import time

from federation.directory import SessionDirectory


def test_place_is_compare_and_set():
    d = SessionDirectory()
    assert d.place("s", "r1") == "r1"
    assert d.place("s", "r2") == "r1"  # another router placed it first: its owner stands
    assert d.place("s", "r2", expect="r1") == "r2"  # a re-pin from the owner it saw
    assert d.lookup("s") == ("r2", d.incarnation)


def test_a_restarted_directory_is_refilled_and_the_newest_report_wins():
    d = SessionDirectory()
    d.place("a", "r1")  # placed since the restart: newer than any report from before it
    now = time.time()
    reports = [("a", "r2", now - 60), ("b", "r2", now - 60), ("c", "r1", now - 60),
               # "b" moved to r1 later (r2 still retains its older KV); a stale router
               # remembers "c" on r2 from before it moved
               ("b", "r1", now - 30), ("c", "r2", now - 90)]
    assert d.adopt(reports) == 2
    assert [d.lookup(s)[0] for s in "abc"] == ["r1", "r1", "r1"]
    assert d.adopt(list(reversed(reports))) == 0  # the order heard in does not matter
    assert [d.lookup(s)[0] for s in "abc"] == ["r1", "r1", "r1"]
    assert SessionDirectory().incarnation != d.incarnation  # a restart is visible to routers


def test_a_dead_replica_is_forgotten():
    d = SessionDirectory()
    d.adopt([("a", "r1", 1.0), ("b", "r1", 1.0), ("c", "r2", 1.0)])
    assert sorted(d.drop_replica("r1")) == ["a", "b"]
    assert d.counts() == {"r2": 1} and d.size() == 1 and d.lookup("a")[0] is None
