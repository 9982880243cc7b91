"""Continuous batching: decide, each step, which tokens of which streams run.

Order of a step: running decodes (one token each, oldest first), then running prefills
(chunked under the token budget), then admissions from the waiting queue (FIFO, by free
blocks). When a running stream needs a block and none is free, retained sessions are evicted
(LRU) first, then the newest running stream is preempted: its blocks are freed and it is
recomputed later — slower, never wrong, since every op is batch- and chunk-invariant.

The scheduler returns a plain StepRecord; it never calls the model.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from replica.kv import BlockPool, SessionCache
from replica.stream import Stream


@dataclass(frozen=True)
class Chunk:
    """Feed stream.tokens[start:end] this step. feed_row >= 0: a chunk scheduled ahead
    (Scheduler.schedule_ahead) — its one token is not on the host yet: it is the greedy pick
    of row feed_row of the step before, taken on the device."""

    stream: Stream
    start: int
    end: int
    feed_row: int = -1

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the stream's last token: its logits pick the next one
        (a chunk scheduled ahead does, once the step before has given it its token)."""
        return self.feed_row >= 0 or (self.end == self.stream.num_tokens and not self.stream.embed)


@dataclass(frozen=True)
class StepRecord:
    chunks: tuple[Chunk, ...]
    preempted: tuple[Stream, ...]
    exhausted: tuple[Stream, ...] = ()  # cannot grow even alone: the pool is too small for it

    @property
    def num_tokens(self) -> int:
        return sum(c.end - c.start for c in self.chunks)


class Scheduler:
    """Owns the waiting queue and the running set; allocates blocks through the pool."""

    def __init__(self, pool: BlockPool, sessions: SessionCache, block_size: int,
                 max_running: int, max_batch_tokens: int, retain_sessions: bool = True) -> None:
        self.pool = pool
        self.sessions = sessions
        self.block_size = block_size
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.retain_sessions = retain_sessions
        self.waiting: deque[Stream] = deque()
        self.running: list[Stream] = []  # admission order
        self._arrivals = 0
        self.num_preemptions = 0  # total, for stats and tests

    # ---- membership ---------------------------------------------------------------------
    def add(self, stream: Stream) -> None:
        self._arrivals += 1
        stream.arrival = self._arrivals
        self.waiting.append(stream)

    def finish(self, stream: Stream) -> None:
        """Remove a finished or cancelled stream; retain its KV for its session if it has one."""
        if stream in self.running:
            self.running.remove(stream)
        elif stream in self.waiting:
            self.waiting.remove(stream)
        keep = (self.retain_sessions and stream.session_id is not None and not stream.embed
                and stream.finish_reason not in ("cancelled", "error"))
        if keep and stream.num_computed > 0:
            self.sessions.retain(stream.session_id, stream.tokens[: stream.num_computed],
                                 stream.block_table)
        else:
            self.pool.free(stream.block_table)
        stream.block_table = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def owners(self) -> dict[str, list[int]]:
        out = {s.owner: s.block_table for s in self.running if s.block_table}
        out.update(self.sessions.owners())
        return out

    def check_integrity(self) -> None:
        self.pool.check_integrity(self.owners())
        for s in self.waiting:
            assert not s.block_table, f"waiting {s.owner} holds blocks"

    # ---- one step -----------------------------------------------------------------------
    def schedule(self) -> StepRecord:
        budget = self.max_batch_tokens
        chunks: list[Chunk] = []
        preempted: list[Stream] = []
        exhausted: list[Stream] = []
        decodes: list[Stream] = []
        prefills: list[Stream] = []
        for s in self.running:
            left = s.num_tokens - s.num_computed
            if left == 1:
                decodes.append(s)
            elif left > 1:
                prefills.append(s)
        for s in decodes + prefills:
            if budget == 0:
                break
            if s in preempted:
                continue
            n = min(s.num_tokens - s.num_computed, budget)
            if not self._grow(s, s.num_computed + n, preempted):
                if len(self.running) == 1 and not self.sessions.keys():
                    exhausted.append(s)  # alone and still out of blocks: it can never continue
                else:
                    self._preempt(s, preempted)
                continue
            chunks.append(Chunk(s, s.num_computed, s.num_computed + n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            s = self.waiting[0]
            if s in preempted:
                break  # readmit next step at the earliest
            if not s.block_table and s.num_computed == 0:
                self._claim_session(s)
            n = min(s.num_tokens - s.num_computed, budget)
            # admission by free blocks: the whole current context must fit, not just this chunk
            if not self._grow(s, s.num_tokens, None):
                self._release(s)
                break
            self.waiting.popleft()
            self.running.append(s)
            chunks.append(Chunk(s, s.num_computed, s.num_computed + n))
            budget -= n
        if preempted:  # a stream preempted after it was scheduled (by an older one) drops out
            chunks = [c for c in chunks if c.stream not in preempted]
        return StepRecord(tuple(chunks), tuple(preempted), tuple(exhausted))

    def schedule_ahead(self, record: StepRecord, continues) -> StepRecord | None:
        """The decode step after `record`, scheduled while `record` runs, before its tokens reach
        the host (EngineCore's lookahead): each stream of `record` for which continues(stream)
        holds decodes the token `record` picks for it, fed on the device (Chunk.feed_row).
        Only where schedule() would give the same streams one decode each once `record` is
        done: record decodes every running stream one token, no stream waits for a free
        running place (an admission is tried when one is free), and the blocks
        for one more token are free without evicting or preempting (None otherwise; nothing is
        changed then). Streams that finished since `record` was scheduled are left out. A
        stream that `record` ends (a stop token; a stop string or a cancel before this step
        ends) has its row computed and dropped; its KV slot is written past its tokens, where
        nothing reads it."""
        chunks = record.chunks
        live = [(i, c) for i, c in enumerate(chunks) if not c.stream.finished]
        admits = self.waiting and len(self.running) < self.max_running  # schedule() would try
        if (admits or not live or record.preempted or record.exhausted
                or len(live) != len(self.running) or len(live) > self.max_batch_tokens):
            return None
        rows: list[tuple[int, Stream, int]] = []  # (row in record, stream, blocks it needs)
        for i, c in live:
            s = c.stream
            if c.end - c.start != 1 or c.end != s.num_tokens or s.embed:
                return None
            if continues(s):
                rows.append((i, s, max(0, -(-(c.end + 1) // self.block_size) - len(s.block_table))))
        if not rows or sum(n for _, _, n in rows) > self.pool.num_free:
            return None
        out = []
        for i, s, n in rows:
            if n:
                s.block_table = s.block_table + self.pool.allocate(n)
            end = chunks[i].end
            out.append(Chunk(s, end, end + 1, feed_row=i))
        return StepRecord(tuple(out), ())

    def _claim_session(self, s: Stream) -> None:
        if s.session_id is None or s.embed or not self.retain_sessions:
            return
        blocks, n = self.sessions.claim(s.session_id, s.tokens)
        s.block_table, s.num_computed, s.num_cached = blocks, n, n

    def _grow(self, s: Stream, num_tokens: int, preempted: list[Stream] | None) -> bool:
        """Give s blocks for num_tokens tokens: evict sessions, then (if allowed) preempt newer
        running streams. False if impossible."""
        need = -(-num_tokens // self.block_size) - len(s.block_table)
        while need > self.pool.num_free:
            if self.sessions.evict_lru() is not None:
                continue
            if preempted is None:
                return False
            victim = next((v for v in reversed(self.running) if v is not s and v not in preempted
                           and v.arrival > s.arrival), None)
            if victim is None:
                return False
            self._preempt(victim, preempted)
        if need > 0:
            s.block_table = s.block_table + self.pool.allocate(need)
        return True

    def _preempt(self, s: Stream, preempted: list[Stream]) -> None:
        self.running.remove(s)
        self._release(s)
        s.num_preemptions += 1
        self.num_preemptions += 1
        preempted.append(s)
        # back to the front, keeping arrival order among preempted streams
        i = 0
        while i < len(self.waiting) and self.waiting[i].arrival < s.arrival:
            i += 1
        self.waiting.insert(i, s)

    def _release(self, s: Stream) -> None:
        """Drop all of s's KV; it will be recomputed from token 0."""
        self.pool.free(s.block_table)
        s.block_table, s.num_computed, s.num_cached = [], 0, 0
