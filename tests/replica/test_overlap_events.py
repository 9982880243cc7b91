"""overlap_events: a step's token events are detokenized and delivered while the next step runs
(on CUDA, between its launch and the host's wait). Every request must see exactly the events,
text, token ids and finish of the plain order, on the embedded model: greedy and sampled
streams, stop strings (found one step late, so the stream's row in the step in flight is
dropped), stop token ids, max_tokens, and a cancel."""

from __future__ import annotations

import pytest

from replica.core import EngineCore
from replica.models.registry import resolve_model
from replica.request import Request
from replica.sampling import SamplingParams
from replica.config import EngineConfig
from tests.replica.schedules import ask, greedy, mid_stream_stops, run_events

pytestmark = pytest.mark.slow

PROMPTS = ["Write one sentence about the sea.", "Name three colors.", "Count from one to ten.",
           "What is a lighthouse?", "Say hello."]


@pytest.fixture(scope="module")
def loaded():
    return resolve_model("smollm2-135m", "cpu")


def core_of(loaded, overlap: bool) -> EngineCore:
    return EngineCore(EngineConfig(max_batch_tokens=64, poison_freed_kv=True, num_kv_blocks=256,
                                   overlap_events=overlap), loaded=loaded)


def run(core: EngineCore, requests: list[Request], cancel: dict[str, int] | None = None):
    """run_events, then every block back (no sessions kept)."""
    events = run_events(core, requests, cancel)
    assert core.pool.num_free == core.pool.num_blocks
    return events


def test_events_are_those_of_the_plain_order(loaded):
    plain = core_of(loaded, False)
    # what the greedy streams say, to pick stop strings and stop ids that occur mid-stream
    probe = run(plain, [Request(messages=ask(p), params=greedy(16), request_id=f"p{i}")
                        for i, p in enumerate(PROMPTS)])
    stop, stop_id, at = mid_stream_stops(probe["p0"], probe["p1"])
    requests = [
        Request(messages=ask(PROMPTS[0]), params=greedy(16, stop=(stop,)), request_id="stop-string"),
        Request(messages=ask(PROMPTS[1]), params=greedy(16, stop_token_ids=(stop_id,)), request_id="stop-id"),
        Request(messages=ask(PROMPTS[2]), params=SamplingParams(max_tokens=20, temperature=0.8, seed=7),
                request_id="sampled"),
        Request(messages=ask(PROMPTS[3]), params=greedy(9), request_id="length"),
        Request(messages=ask(PROMPTS[4]), params=greedy(30), request_id="cancelled"),
    ]
    cancel = {"cancelled": 6}
    want = run(plain, requests, cancel)
    got = run(core_of(loaded, True), requests, cancel)
    assert got == want
    # and the cases happened as meant
    assert want["stop-string"][-1][3] == "stop" and len(want["stop-string"]) < 16
    assert want["stop-id"][-1][3] == "stop" and want["stop-id"][-1][4] == at + 1
    assert want["length"][-1][3] == "length" and want["cancelled"][-1][3] == "cancelled"


def test_deferred_events_arrive_one_step_later_and_none_is_left_behind(loaded):
    core = core_of(loaded, True)
    seen: list[int] = []
    core.add(core.prepare(Request(messages=ask(PROMPTS[0]), params=greedy(5), request_id="a")),
             lambda ev: seen.append(len(ev.token_ids)))
    core.step()  # the prompt and the first token: its event waits for the next step
    assert seen == []
    core.step()
    assert seen == [1]
    while core.has_work:
        core.step()
    assert sum(seen) == 5 and not core._pending
