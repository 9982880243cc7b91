"""CUDA graphs of decode-only steps, one per (batch bucket, block-table width bucket).

The runner (replica/runner.py) replays them for steps where every stream decodes one token
(in a larger captured graph while the step's own is not captured: CAPTURE_AFTER); other steps
run eagerly. Padding rows of a bucket write no KV (slot -1) and read none (ctx 0),
and every kernel computes a row from that row alone, so a stream's bits are the same in any
bucket and in the eager path (tests/kernels/test_gpu.py checks it).
"""

from __future__ import annotations

import bisect

import torch

from replica.kv import KVCache
from replica.models.transformer import ForwardBatch, Transformer
from replica.scheduler import StepRecord
from replica.step_inputs import BlockTables, prefill_range

GRAPH_BATCHES = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)
# block-table width buckets: powers of two from here. 16 blocks of the default 16 tokens are
# 256 keys, one split of the paged attention (kernels/triton_attention.py SPLIT): a wider table
# launches its merge kernel even where no stream's keys need it (H100, 128 x 1: 484 tok/s at a
# 32-block bucket, 495 at 16, v29). The next width, the first with two splits, is captured
# with the narrowest (_capture: two captures at a batch bucket's first step where there was
# one), so a batch whose streams cross 256 tokens does not stop for a capture (H200, 64
# streams x 144 new tokens from 128: a 108 ms step, 6% of the run, v21)
MIN_GRAPH_BLOCKS = 16
# A step whose own graph is not captured yet replays the smallest captured graph that holds it
# (a larger batch bucket, a wider table bucket: its rows are padding, the same bits) instead of
# stopping every stream for a capture (~0.1 s at the 30B shape: the tail of a burst, streams
# finishing a few steps apart, meets a new bucket at each step); its own graph is captured on
# its CAPTURE_AFTER + 1st step, or earlier while the engine idles (capture_missed). A step that
# no captured graph holds captures its own at once.
CAPTURE_AFTER = 8


class DecodeGraphs:
    """CUDA graphs of decode-only steps, captured on first use per (batch bucket, width bucket)."""

    def __init__(self, model: Transformer, kv: KVCache, fast_prefill: bool = False,
                 tables: BlockTables | None = None) -> None:
        self.model = model
        self.kv = kv
        self.block_size = kv.block_size
        self.device = torch.device(model.device)
        self.fast_prefill = fast_prefill  # then a prompt token past MIN_POSITION runs eagerly
        self.tables = tables or BlockTables()
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._misses: dict[tuple[int, int], int] = {}  # uncaptured key → steps run padded

    def accepts(self, record: StepRecord) -> bool:
        """Whether a graph runs this step: every chunk decodes one sampled token on the paged
        path, and the step fits the largest batch bucket."""
        return (len(record.chunks) <= GRAPH_BATCHES[-1]
                and all(c.end - c.start == 1 and c.samples
                        and prefill_range(c, self.fast_prefill) is None for c in record.chunks))

    def key(self, record: StepRecord) -> tuple[int, int]:
        return self.key_for(len(record.chunks), max(len(c.stream.block_table) for c in record.chunks))

    @staticmethod
    def key_for(streams: int, table_blocks: int = 1) -> tuple[int, int]:
        """(batch bucket, table-width bucket) of a decode step."""
        width = MIN_GRAPH_BLOCKS
        while width < table_blocks:
            width *= 2
        return GRAPH_BATCHES[bisect.bisect_left(GRAPH_BATCHES, streams)], width

    def warm(self, streams: int, table_blocks: int) -> None:
        """Capture the graph a decode step of `streams` streams with tables of `table_blocks`
        blocks will replay, if it is not yet captured (benchmarks: capture outside timing)."""
        self._capture(self.key_for(min(streams, GRAPH_BATCHES[-1]), table_blocks))

    def _capture(self, key: tuple[int, int]) -> "_Graph":
        """key's graph, captured now if it is not yet; at the narrowest width, the next
        width's too (MIN_GRAPH_BLOCKS)."""
        for k in (key, (key[0], 2 * key[1])) if key[1] == MIN_GRAPH_BLOCKS else (key,):
            if k not in self._graphs:
                self._graphs[k] = _Graph(self.model, self.kv, *k, self.device)
        return self._graphs[key]

    @property
    def captured(self) -> set[tuple[int, int]]:
        return set(self._graphs)

    def graph_for(self, record: StepRecord) -> tuple[tuple[int, int], "_Graph"]:
        """(key, graph) the step replays: its own graph, or while that is not captured (and has
        been missed at most CAPTURE_AFTER times) the smallest captured one holding it;
        captured now when there is none."""
        key = self.key(record)
        g = self._graphs.get(key)
        if g is not None:
            return key, g
        misses = self._misses.get(key, 0) + 1
        if misses <= CAPTURE_AFTER:
            holders = [k for k in self._graphs if k[0] >= key[0] and k[1] >= key[1]]
            if holders:
                self._misses[key] = misses
                bigger = min(holders)  # the fewest rows first (they cost; width hardly)
                return bigger, self._graphs[bigger]
        self._misses.pop(key, None)
        return key, self._capture(key)

    def capture_missed(self) -> bool:
        """Capture the graph that steps replayed padded into another most often (the engine
        calls this when it has nothing to do); False when there was none."""
        if not self._misses:
            return False
        key = max(self._misses, key=self._misses.__getitem__)
        del self._misses[key]
        self._capture(key)
        return True

    def launch(self, record: StepRecord, feed_ids: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the step's graph (not waited for) → (logits [bucket, vocab] fp32, argmax
        [bucket] int64) on the device: the graph's outputs, whose first len(record.chunks) rows
        are the step's. feed_ids [R] int64 on the device: the picks of the step before, for a
        step scheduled ahead (each chunk's token is feed_ids[chunk.feed_row])."""
        _, g = self.graph_for(record)
        g.load(record, self.block_size, self.tables, feed_ids)
        g.graph.replay()
        return g.logits, g.argmax

    def time_decode(self, streams: int, context: int, iters: int = 20) -> float:
        """Median ms of the decode graph for `streams` streams each reading `context` keys, on
        inputs made up for it (benchmarks): stream i reads its own run of blocks (the pool's
        blocks in turn, wrapping when it is too small) and writes nothing (slot -1)."""
        bs = self.block_size
        per = -(-context // bs)
        self.warm(streams, per)
        key = self.key_for(min(streams, GRAPH_BATCHES[-1]), per)
        g = self._graphs[key]
        n = min(streams, g.batch)
        ints, ctx = g.host_ints[0], g.host_ctx[0]
        ints.zero_()
        ints[1, :n] = context - 1
        ints[2] = -1
        ctx.zero_()
        ctx[:n] = context
        blocks = torch.arange(n * per, dtype=torch.int32) % self.kv.num_blocks
        ctx[g.batch:].view(g.batch, g.width)[:n, :per] = blocks.view(n, per)
        g.ints.copy_(ints, non_blocking=True)
        g.ctx.copy_(ctx, non_blocking=True)
        return self.time_replay(key, iters)

    def time_replay(self, key: tuple[int, int], iters: int = 20) -> float:
        """Median ms of replaying the graph `key` on its current inputs (benchmarks)."""
        g = self._graphs[key]
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]


class _Graph:
    """Static inputs for `batch` rows and `width` table columns, and the captured forward."""

    def __init__(self, model: Transformer, kv: KVCache, batch: int, width: int,
                 device: torch.device) -> None:
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        # inputs in two tensors, so a replay's inputs cross to the device in two copies
        self.ints = torch.zeros(3, batch, **i64)  # [3, B]: token_ids, positions, slots
        self.ctx = torch.zeros(batch + batch * width, **i32)  # [B + B*W]: ctx_lens, then tables
        # pinned staging, two sets used in turn: a set is rewritten only after the step that
        # copied from it is done (the engine collects a step before it launches the one after
        # the next), so a step can be staged while the one before runs
        self.host_ints = [torch.zeros(3, batch, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self.host_ctx = [torch.zeros(batch + batch * width, dtype=torch.int32, pin_memory=True)
                         for _ in range(2)]
        self._turn = 0
        self.fed = torch.zeros(batch, **i64)  # the fed tokens of a step scheduled ahead
        self.batch, self.width = batch, width
        self.fb = ForwardBatch(
            token_ids=self.ints[0], positions=self.ints[1], slots=self.ints[2],
            block_tables=self.ctx[batch:].view(batch, width), tok_row=torch.arange(batch, **i32),
            ctx_lens=self.ctx[:batch], logit_rows=torch.arange(batch, **i64))
        self.ints[2].fill_(-1)  # warm-up and capture on padding: no KV written or read
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            model.forward(self.fb, kv)  # compiles every kernel outside the capture
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits, _ = model.forward(self.fb, kv)  # [B, vocab] fp32
            self.argmax = torch.argmax(self.logits, dim=-1)  # [B] int64: greedy picks stay on the GPU

    def load(self, record: StepRecord, block_size: int, tables: BlockTables,
             feed_ids: torch.Tensor | None = None) -> None:
        """Stage the step's n <= B decode tokens in rows [0, n) and padding after them; with
        feed_ids, each row's token is feed_ids[chunk.feed_row], gathered on the device."""
        self._turn ^= 1
        ints, ctx = self.host_ints[self._turn], self.host_ctx[self._turn]
        stage_decode(record, block_size, tables, ints, ctx)
        self.ints.copy_(ints, non_blocking=True)
        self.ctx.copy_(ctx, non_blocking=True)
        if record.chunks[0].feed_row >= 0:
            if feed_ids is None:
                raise ValueError("a step scheduled ahead needs the step before's picks")
            n = len(record.chunks)
            torch.index_select(feed_ids, 0, self.ints[0, :n], out=self.fed[:n])
            self.ints[0, :n].copy_(self.fed[:n])


def stage_decode(record: StepRecord, block_size: int, tables: BlockTables, ints: torch.Tensor,
                 ctx: torch.Tensor) -> None:
    """Write a decode graph's inputs for the step's n <= B decode tokens into host tensors:
    ints [3, B] int64 (token ids, positions, slots) and ctx [B + B*W] int32 (context lengths,
    then the block tables as [B, W], each zero-padded). Rows [n, B) are padding: token 0,
    position 0, slot -1 (writes no KV), context 0 (reads none), a table of zeros. Every element
    is written (a chunk scheduled ahead: its feed row in place of its token). One pass over the
    chunks in Python; the rows go in with a few bulk writes."""
    b = ints.shape[1]
    w = (ctx.shape[0] - b) // b
    chunks = record.chunks
    n = len(chunks)
    streams = [c.stream for c in chunks]
    pos = [c.start for c in chunks]
    # a chunk scheduled ahead stages its feed row: the device swaps in that row's pick
    toks = [c.feed_row if c.feed_row >= 0 else s.token_at(p) for c, s, p in zip(chunks, streams, pos)]
    slots = [s.block_table[p // block_size] * block_size + p % block_size
             for s, p in zip(streams, pos)]
    host, lens = ints.numpy(), ctx.numpy()  # the tensors' memory: [3, B] int64, [B + B*W] int32
    host[0, :n], host[1, :n], host[2, :n] = toks, pos, slots
    host[:2, n:] = 0
    host[2, n:] = -1
    lens[:n] = host[1, :n] + 1
    lens[n:b] = 0
    tables.stack(streams, w, out=ctx[b: b + n * w].view(n, w))  # [n, W]
    lens[b + n * w:] = 0
