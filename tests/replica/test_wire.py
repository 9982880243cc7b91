"""The replica's wire contract (replica/wire.py) end to end without Ray: a GenerateCall through a
ReplicaServer yields TokenEvents, a bad call one ErrorEvent whose code the HTTP edge maps."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from federation.openai_api import STATUS_OF_CODE, APIError
from replica import errors
from replica.server import ReplicaServer
from replica.wire import ErrorEvent, GenerateCall, Reach, TokenEvent, call_routing


@pytest.fixture(scope="module")
def server():
    s = ReplicaServer({"model": "synthetic:tiny-llama"})
    yield s
    s.engine.shutdown()


def collect(server, call):
    async def run():
        return [ev async for ev in server.generate(call)]
    return asyncio.run(run())


def test_a_call_streams_token_events_and_a_retry_resumes_where_it_stopped(server):
    call = GenerateCall("req-1", {"max_tokens": 6, "temperature": 0.0}, session_id="t/s",
                        prompt_token_ids=(1, 5, 9, 14))
    events = collect(server, call)
    assert all(isinstance(ev, TokenEvent) and ev.replica == "local" for ev in events)
    tokens = [t for ev in events for t in ev.token_ids]
    assert len(tokens) == 6 and events[-1].finished and events[-1].completion_tokens == 6
    again = call.retry(1, tokens[:2], ["r-dead"])
    assert (again.request_id, again.resume_token_ids, again.avoid) == ("req-1#1", tuple(tokens[:2]), ("r-dead",))
    assert call.retry(2, [], []).request_id == "req-1#2"
    resumed = [t for ev in collect(server, again) for t in ev.token_ids]
    assert resumed == tokens[2:]  # a failover's replay continues with exactly the same tokens


def test_a_bad_call_is_one_error_event_mapped_to_a_4xx(server):
    events = collect(server, GenerateCall("req-2", {"max_tokens": 0}, prompt="hi"))
    assert len(events) == 1 and isinstance(events[0], ErrorEvent)
    e = APIError.from_event(events[0])
    assert e.status == 400 and e.param == "max_tokens" and e.type == "invalid_request_error"


def test_every_engine_error_kind_has_a_status():
    kinds = [c for c in vars(errors).values()
             if isinstance(c, type) and issubclass(c, errors.FedserveError)]
    assert {k.code for k in kinds} <= set(STATUS_OF_CODE)


def test_routers_read_session_and_avoid_from_any_call():
    call = GenerateCall("r", {}, session_id="t/s", prompt="x", avoid=("a",))
    assert call_routing(call) == ("t/s", ("a",))
    assert call_routing(Reach(("b", "c"))) == (None, ("b", "c"))
    assert call_routing({"session_id": "x"}) == (None, ())
    assert pickle.loads(pickle.dumps(call)) == call  # what Ray does with it
