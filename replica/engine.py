"""Engine: the offline and async API over EngineCore, with the step loop on its own thread.

The loop thread alone touches EngineCore's state; callers hand it commands through a queue
and receive StreamEvents through per-request sinks (thread-safe hand-offs).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import threading
import weakref
from typing import AsyncIterator, Sequence

from replica.config import EngineConfig
from replica.core import EngineCore
from replica.errors import EngineDeadError, FedserveError
from replica.models.spec import LoadedModel
from replica.request import Request, RequestOutput, StreamEvent
from replica.sampling import SamplingParams

log = logging.getLogger("fedserve.engine")
_live: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _stop_live_engines() -> None:
    """Stop every step loop before the interpreter finalizes. A daemon thread still inside a
    kernel or a torch op when finalization begins is killed by a forced unwind through C++
    frames, which aborts or segfaults the process after its work is done (measured: 1 exit in 3
    of a script that made an Engine and returned)."""
    for engine in list(_live):
        engine.shutdown()


class Engine:
    """A resident model decoding many streams with isolated KV and batch-invariant steps."""

    def __init__(self, config: EngineConfig | None = None, *, loaded: LoadedModel | None = None) -> None:
        self.config = config or EngineConfig()
        self.core = EngineCore(self.config, loaded)
        self.tokenizer = self.core.tokenizer
        self.model_config = self.core.model_config
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._stats = self.core.stats()
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fedserve-engine", daemon=True)
        self._thread.start()
        _live.add(self)

    # ---- loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        core = self.core
        try:
            while not self._stop.is_set():
                self._drain(block=not core.has_work)
                if core.has_work:
                    core.step()
                    self._stats = core.stats()
                elif self._cmds.empty() and not core.idle():  # (idle: a graph captured)
                    core.check_integrity()  # cheap, and the pool is quiet now
                    self._stats = core.stats()
        except BaseException as e:  # the loop must never die silently
            self._error = e
            log.exception("fedserve engine loop died")
            dead = EngineDeadError(f"engine loop died: {e!r}")
            core.fail_all(dead)
            self._fail_pending(dead)
            raise

    def _fail_pending(self, error: EngineDeadError) -> None:
        """Requests enqueued but never admitted get their final error event too."""
        while True:
            try:
                kind, arg, sink = self._cmds.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                sink(StreamEvent(arg.request_id, "", (), True, "error", error=error))

    def _drain(self, block: bool) -> None:
        while True:
            try:
                cmd = self._cmds.get(timeout=0.05) if block else self._cmds.get_nowait()
            except queue.Empty:
                return
            block = False
            kind, arg, sink = cmd
            if kind == "add":
                try:
                    self.core.add(arg, sink)
                except FedserveError as e:
                    sink(StreamEvent(arg.request_id, "", (), True, "error", error=e))
            elif kind == "abort":
                self.core.abort(arg)
            elif kind == "call":
                arg()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def _submit(self, kind: str, arg, sink=None) -> None:
        if not self.is_alive:
            raise EngineDeadError(f"the engine loop is not running ({self._error!r})")
        self._cmds.put((kind, arg, sink))

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    # ---- API ----------------------------------------------------------------------------
    def submit(self, request: Request, sink, embed: bool = False) -> None:
        """Validate (raising typed errors here, in the caller) and enqueue a request."""
        stream = self.core.prepare(request, embed=embed)
        self._submit("add", stream, sink)

    def abort(self, request_id: str) -> None:
        if self.is_alive:
            self._cmds.put(("abort", request_id, None))

    def generate(self, prompts: str | Sequence[str] | Sequence[Request],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Run all prompts concurrently (continuous batching); outputs in prompt order."""
        if isinstance(prompts, (str, Request)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("one SamplingParams, or one per prompt")
        reqs = [p if isinstance(p, Request) else Request(prompt=p, params=sp)
                for p, sp in zip(prompts, plist)]
        collected: dict[str, list[StreamEvent]] = {r.request_id: [] for r in reqs}
        done = threading.Semaphore(0)

        def sink_for(rid):
            def sink(ev: StreamEvent) -> None:
                collected[rid].append(ev)
                if ev.finished:
                    done.release()
            return sink

        streams = [self.core.prepare(r) for r in reqs]  # all validated before any is enqueued
        for s in streams:
            self._submit("add", s, sink_for(s.request_id))
        for _ in reqs:
            while not done.acquire(timeout=1.0):
                if not self.is_alive:
                    raise EngineDeadError(f"engine loop died: {self._error!r}")
        return [_collect(r, collected[r.request_id]) for r in reqs]

    async def stream(self, request: Request) -> AsyncIterator[StreamEvent]:
        """Events of one request as they are produced; cancelling the iteration aborts it."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self.submit(request, lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev))
        finished = False
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(q.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if not self.is_alive:  # never hang on a dead loop
                        finished = True
                        raise EngineDeadError(f"engine loop died: {self._error!r}")
                    continue
                if ev.error is not None:
                    finished = True
                    raise ev.error
                yield ev
                if ev.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request.request_id)

    def embed(self, texts: str | Sequence[str]) -> list[list[float]]:
        """Mean-pooled, L2-normalized final hidden states, through the same scheduler."""
        from replica.core import embed_request

        if isinstance(texts, str):
            texts = [texts]
        reqs = [embed_request(t) for t in texts]
        results: dict[str, StreamEvent] = {}
        done = threading.Semaphore(0)

        def sink(ev: StreamEvent) -> None:
            if ev.finished:
                results[ev.request_id] = ev
                done.release()

        streams = [self.core.prepare(r, embed=True) for r in reqs]
        for s in streams:
            self._submit("add", s, sink)
        for _ in reqs:
            while not done.acquire(timeout=1.0):
                if not self.is_alive:
                    raise EngineDeadError(f"engine loop died: {self._error!r}")
        out = []
        for r in reqs:
            ev = results[r.request_id]
            if ev.error is not None:
                raise ev.error
            out.append(list(ev.embedding))
        return out

    async def aembed(self, texts: Sequence[str]) -> list[list[float]]:
        return await asyncio.to_thread(self.embed, texts)

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV pool holds (on CUDA sized from the device by default)."""
        return self.core.kv_capacity_tokens

    def stats(self) -> dict:
        """The replica → router contract (DESIGN.md), as of the last step."""
        return dict(self._stats)

    def run_on_loop(self, fn, timeout: float = 30.0):
        """Run fn() on the loop thread between steps (tests: integrity checks, inspection;
        benchmarks: CUDA work, which must not race the loop's own) → its value, or None when
        it did not finish within timeout seconds."""
        done, out = threading.Event(), []
        self._submit("call", lambda: (out.append(fn()), done.set()))
        done.wait(timeout=timeout)
        return out[0] if out else None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _collect(req: Request, events: list[StreamEvent]) -> RequestOutput:
    last = events[-1]
    if last.error is not None:
        raise last.error
    ids = [t for ev in events for t in ev.token_ids]
    return RequestOutput(req.request_id, "".join(ev.text for ev in events),
                         list(req.resume_token_ids) + ids, last.finish_reason,
                         last.prompt_tokens, last.cached_tokens)
