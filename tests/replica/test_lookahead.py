"""lookahead: a decode step is launched before the step before it has brought its tokens to the
host, its tokens fed on the device (Scheduler.schedule_ahead, ModelRunner.launch). Every request
must see exactly the events of the plain order, on the embedded model, while steps really run
ahead: stop strings (found a step late: the streams' rows in two steps in flight are dropped),
stop token ids, max_tokens, a cancel, a sampled stream (its token picked on the device too),
arrivals mid-run, retained sessions and their next turn, and a pool too small for all streams
(preemption; no step runs ahead without free blocks). Freed KV is poisoned with NaN, so a
stream that read a slot a dropped row wrote would show it."""

from __future__ import annotations

import pytest

from replica.core import EngineCore
from replica.config import EngineConfig
from replica.kv import BlockPool, SessionCache
from replica.models.registry import resolve_model
from replica.request import Request
from replica.sampling import SamplingParams
from replica.scheduler import Chunk, Scheduler, StepRecord
from replica.stream import Stream
from tests.replica.schedules import ask, greedy, mid_stream_stops, run_events

pytestmark = pytest.mark.slow

PROMPTS = ["Write one sentence about the sea.", "Name three colors.", "Count from one to ten.",
           "What is a lighthouse?", "Say hello.", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def loaded():
    return resolve_model("smollm2-135m", "cpu")


def core_of(loaded, lookahead: bool, blocks: int = 256, overlap: bool = True) -> EngineCore:
    core = EngineCore(EngineConfig(max_batch_tokens=64, poison_freed_kv=True, num_kv_blocks=blocks,
                                   overlap_events=overlap, lookahead=lookahead), loaded=loaded)
    core.ahead_steps = 0  # steps launched with their tokens fed on the device
    core.ahead_sampled = 0  # of them, those with a sampled stream
    launch = core.runner.launch

    def counted(record, feed=None):
        core.ahead_steps += feed is not None
        core.ahead_sampled += feed is not None and any(not c.stream.params.greedy
                                                       for c in record.chunks)
        return launch(record, feed)

    core.runner.launch = counted
    return core


def test_events_are_those_of_the_plain_order(loaded):
    plain = core_of(loaded, False)
    probe = run_events(plain, [Request(messages=ask(p), params=greedy(16), request_id=f"p{i}")
                        for i, p in enumerate(PROMPTS[:2])])
    stop, stop_id, at = mid_stream_stops(probe["p0"], probe["p1"])
    requests = [
        Request(messages=ask(PROMPTS[0]), params=greedy(16, stop=(stop,)), request_id="stop-string"),
        Request(messages=ask(PROMPTS[1]), params=greedy(16, stop_token_ids=(stop_id,)), request_id="stop-id"),
        Request(messages=ask(PROMPTS[3]), params=greedy(9), request_id="length"),
        Request(messages=ask(PROMPTS[4]), params=greedy(30), request_id="cancelled"),
        Request(messages=ask(PROMPTS[5]), params=greedy(24), request_id="late"),
        Request(messages=ask(PROMPTS[2]), params=SamplingParams(max_tokens=6, temperature=0.8, seed=7),
                request_id="sampled"),
    ]
    cancel = {"cancelled": 9}
    arrive = {"late": 12, "sampled": 30}  # "sampled" decodes after the others are done or nearly
    for overlap in (True, False):
        want = run_events(core_of(loaded, False, overlap=overlap), requests, cancel, arrive)
        ahead = core_of(loaded, True, overlap=overlap)
        got = run_events(ahead, requests, cancel, arrive)
        assert got == want
        assert ahead.ahead_steps >= 10
        assert ahead.ahead_sampled >= 3  # the sampled stream's picks fed steps too
        assert ahead.pool.num_free == ahead.pool.num_blocks  # every block back (no sessions)
    # and the cases happened as meant
    assert want["stop-string"][-1][3] == "stop" and len(want["stop-string"]) < 16
    assert want["stop-id"][-1][3] == "stop" and want["stop-id"][-1][4] == at + 1
    assert want["length"][-1][3] == "length" and want["cancelled"][-1][3] == "cancelled"
    assert want["late"][-1][3] == "length" and want["sampled"][-1][4] == 6


def test_sessions_and_a_small_pool_give_the_plain_tokens(loaded):
    """Two turns of three sessions, the second turn reusing the first's KV, on a pool that
    cannot hold every stream's context at once (preemptions), with lookahead and without."""
    def turns(core: EngineCore) -> dict[str, list[tuple]]:
        first = [Request(messages=ask(p), params=greedy(20), request_id=f"t1-{i}", session_id=f"s{i}")
                 for i, p in enumerate(PROMPTS[:3])]
        out = run_events(core, first)
        second = []
        for i, p in enumerate(PROMPTS[:3]):
            reply = "".join(e[0] for e in out[f"t1-{i}"])
            msgs = ask(p) + [{"role": "assistant", "content": reply}, {"role": "user", "content": "More."}]
            second.append(Request(messages=msgs, params=greedy(20), request_id=f"t2-{i}",
                                  session_id=f"s{i}"))
        out.update(run_events(core, second))
        return out

    plain, ahead = core_of(loaded, False, blocks=14), core_of(loaded, True, blocks=14)
    want, got = turns(plain), turns(ahead)
    assert got == want
    assert ahead.ahead_steps >= 5
    assert plain.scheduler.num_preemptions > 0  # the pool really was too small
    # the second turn reused the first's KV (on the plain core; the same events on the other)
    assert any(want[f"t2-{i}"][-1][5] > 0 for i in range(3))


def _scheduler(blocks: int, bs: int = 4) -> Scheduler:
    pool = BlockPool(blocks)
    return Scheduler(pool, SessionCache(pool, bs), bs, max_running=8, max_batch_tokens=64)


def _decoding(sched: Scheduler, n: int, prompt: int) -> StepRecord:
    """n streams prefilled (prompt tokens, one output token each) → their decode step."""
    for i in range(n):
        sched.add(Stream(f"r{i}", list(range(1, prompt + 1)), SamplingParams(temperature=0.0)))
    rec = sched.schedule()
    for c in rec.chunks:
        c.stream.num_computed = c.end
        c.stream.output_ids.append(7)
    rec = sched.schedule()
    assert all(c.end - c.start == 1 for c in rec.chunks) and len(rec.chunks) == n
    return rec


def test_schedule_ahead_feeds_every_decode_and_grows_tables_at_block_edges():
    sched = _scheduler(blocks=16)
    rec = _decoding(sched, 2, prompt=6)  # tokens 0..6: the decode step computes position 6
    before = [list(c.stream.block_table) for c in rec.chunks]
    nxt = sched.schedule_ahead(rec, lambda s: True)
    assert [(c.start, c.end, c.feed_row) for c in nxt.chunks] == [(7, 8, 0), (7, 8, 1)]
    assert all(c.samples for c in nxt.chunks)
    # position 7 is in block 1 (block size 4), which the prompt's table already had
    assert [c.stream.block_table for c in nxt.chunks] == before
    # one stream left out (it ends with this step's token): the other keeps its row index
    sched2 = _scheduler(blocks=16)
    rec2 = _decoding(sched2, 3, prompt=7)  # decode computes position 7; ahead needs block 2
    nxt2 = sched2.schedule_ahead(rec2, lambda s: s.request_id != "r1")
    assert [(c.stream.request_id, c.feed_row) for c in nxt2.chunks] == [("r0", 0), ("r2", 2)]
    assert [len(c.stream.block_table) for c in rec2.chunks] == [3, 2, 3]
    sched2.check_integrity()


def test_schedule_ahead_declines_where_schedule_would_do_something_else():
    sched = _scheduler(blocks=16)
    rec = _decoding(sched, 2, prompt=6)
    sched.add(Stream("waiting", [1, 2, 3], SamplingParams(temperature=0.0)))
    assert sched.schedule_ahead(rec, lambda s: True) is None  # an admission is due
    sched.max_running = 2  # every running place taken: the waiting stream could not get in
    assert len(sched.schedule_ahead(rec, lambda s: True).chunks) == 2
    sched = _scheduler(blocks=16)
    rec = _decoding(sched, 2, prompt=6)
    assert sched.schedule_ahead(rec, lambda s: False) is None  # nothing continues
    prefill = StepRecord((Chunk(rec.chunks[0].stream, 0, 7),) + rec.chunks[1:], ())
    assert sched.schedule_ahead(prefill, lambda s: True) is None  # not a decode step
    # no free block for position 8 of both streams (block 2 each): declined, nothing taken
    sched = _scheduler(blocks=5)
    rec = _decoding(sched, 2, prompt=7)
    free = sched.pool.num_free
    assert free == 1 and sched.schedule_ahead(rec, lambda s: True) is None
    assert sched.pool.num_free == free
