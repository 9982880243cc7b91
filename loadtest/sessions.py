"""Multi-turn sessions, run concurrently or alone, and their replay for bitwise reference checks.

A session is a function `next_messages(turn, history) -> list[dict] | None` (the user/tool messages
to append before the next assistant turn; None ends the session). The runner sends the history,
appends the assistant's reply, and records exactly what it sent, so a reference run can replay the
same message lists one at a time and compare every assistant message byte for byte.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import httpx
from tqdm import tqdm

from loadtest.client import ChatResult, stream_chat

NextMessages = Callable[[int, list[dict]], "list[dict] | None"]
BodyFn = Callable[[list[dict]], dict]


@dataclass
class Turn:
    """One assistant turn: the exact messages sent and what came back."""

    session: int
    turn: int
    messages: list[dict]
    result: ChatResult


def http_client(concurrency: int) -> httpx.Client:
    return httpx.Client(limits=httpx.Limits(max_connections=concurrency + 4,
                                            max_keepalive_connections=concurrency + 4))


def run_session(client: httpx.Client, url: str, index: int, session_id: str,
                next_messages: NextMessages, body: BodyFn, max_turns: int,
                deadline: float, timeout: float) -> list[Turn]:
    """Drive one session to its end, a failed turn, or the deadline (later turns not started)."""
    history: list[dict] = []
    turns: list[Turn] = []
    for t in range(max_turns):
        new = next_messages(t, history)
        if new is None or time.perf_counter() > deadline:
            break
        history = history + new
        budget = min(timeout, max(1.0, deadline - time.perf_counter()))
        res = stream_chat(client, url, body(history), session=session_id, timeout=budget)
        if res.timed_out and budget < timeout:  # the run's time limit, not the server, ended it
            res.timed_out, res.cut, res.error = False, True, "cut by the time limit"
        turns.append(Turn(index, t, history, res))
        if not res.ok:
            break
        history = history + [{"role": "assistant", "content": res.text}]
    return turns


def run_many(url: str, sessions: list[tuple[str, NextMessages]], body: BodyFn, max_turns: int,
             time_limit: float, timeout: float, concurrency: int | None = None) -> tuple[list[list[Turn]], float]:
    """Run sessions `concurrency` at a time (default: all at once); returns (turns per session, wall s)."""
    conc = concurrency or len(sessions)
    deadline = time.perf_counter() + time_limit
    t0 = time.perf_counter()
    # progress on a terminal only (disable=None: off when stderr is not a TTY, as in tests)
    with http_client(conc) as client, ThreadPoolExecutor(max_workers=conc) as pool, \
            tqdm(total=len(sessions), desc="sessions", unit="session", leave=False, disable=None) as bar:
        futs = [pool.submit(run_session, client, url, i, sid, nm, body, max_turns, deadline, timeout)
                for i, (sid, nm) in enumerate(sessions)]
        for f in futs:
            f.add_done_callback(lambda _: bar.update())
        out = [f.result() for f in futs]
    return out, time.perf_counter() - t0


def replay(url: str, turns: list[list[Turn]], body: BodyFn, timeout: float,
           suffix: str = "-ref") -> list[list[ChatResult]]:
    """The reference: every recorded turn's exact messages, resent one request at a time."""
    out: list[list[ChatResult]] = []
    with http_client(1) as client:
        for session in tqdm(turns, desc="reference replay", unit="session", leave=False, disable=None):
            out.append([stream_chat(client, url, body(t.messages),
                                    session=f"{t.result.session}{suffix}", timeout=timeout)
                        for t in session])
    return out
