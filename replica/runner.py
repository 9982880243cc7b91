"""Turns a StepRecord into a ForwardBatch, runs the model, returns per-chunk outputs.

On CUDA, decode-only steps replay a CUDA graph of the forward, one per (batch bucket, block-table
width bucket); other steps run eagerly. Padding rows of a bucket write no KV (slot -1) and read
none (ctx 0), and every kernel computes a row from that row alone, so a stream's bits are the
same in any bucket and in the eager path (tests/kernels/test_gpu.py checks it).
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from kernels import prefill
from replica.kv import KVCache
from replica.models.transformer import ForwardBatch, PrefillSpan, Transformer
from replica.scheduler import Chunk, StepRecord

GRAPH_BATCHES = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)
MIN_GRAPH_BLOCKS = 16  # block-table width buckets: powers of two from here


@dataclass(frozen=True, eq=False)
class StepOutput:
    logits: Mapping[int, torch.Tensor]  # chunk index → [vocab] fp32 (CPU), for sampling chunks
    hidden: dict[int, torch.Tensor]  # chunk index → [n, hidden] fp32 (CPU), for embed chunks
    greedy: dict[int, int] = field(default_factory=dict)  # chunk index → argmax, greedy chunks


class HostRows(Mapping):
    """chunk index → that chunk's logits on the host. Rows fetched at step time (the chunks that
    sample on the host) are here already; any other row is copied from the device on first read
    (tests read them; the engine does not). Valid until the next execute."""

    def __init__(self, device_logits: torch.Tensor, row_of: dict[int, int],
                 fetched: dict[int, torch.Tensor]) -> None:
        self._dev, self._row_of, self._fetched = device_logits, row_of, fetched

    def __getitem__(self, chunk: int) -> torch.Tensor:
        row = self._fetched.get(chunk)
        if row is None:
            row = self._fetched[chunk] = self._dev[self._row_of[chunk]].to("cpu")
        return row

    def __contains__(self, chunk: object) -> bool:
        return chunk in self._row_of

    def __iter__(self) -> Iterator[int]:
        return iter(self._row_of)

    def __len__(self) -> int:
        return len(self._row_of)


class BlockTables:
    """Each stream's block table as an int32 tensor, converted only when the table changes.
    A table only grows between preemptions (the scheduler replaces the list, never edits it),
    so a step converts the new blocks alone: no O(context) host work per stream per step."""

    def __init__(self) -> None:
        self._cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get(self, stream) -> torch.Tensor:
        table = stream.block_table
        hit = self._cache.get(stream)
        if hit is not None:
            old, n, tensor = hit
            if old is table and len(table) == n:
                return tensor
            if len(table) > n and table[:n] == old[:n]:
                tensor = torch.cat([tensor, torch.tensor(table[n:], dtype=torch.int32)])
                self._cache[stream] = (table, len(table), tensor)
                return tensor
        tensor = torch.tensor(table, dtype=torch.int32)
        self._cache[stream] = (table, len(table), tensor)
        return tensor


def prefill_range(c: Chunk, enabled: bool) -> tuple[int, int] | None:
    """Positions [a, b) of chunk c that attend through kernels.prefill (None: none): its prompt
    positions from MIN_POSITION on."""
    if not enabled:
        return None
    a, b = max(c.start, prefill.MIN_POSITION), min(c.end, len(c.stream.prompt_ids))
    return (a, b) if a < b else None


class ModelRunner:
    """fast_prefill: prompt tokens at positions >= kernels.prefill.MIN_POSITION attend through
    the tiled prefill path. Which path a token takes depends on its position and its stream's
    prompt length only, so a stream's bits never depend on the batch or on its chunking; and
    tokens after the prompt (decoded, or recomputed after a preemption or a resume) always take
    the paged kernel, as decode did, so a recompute gives the bits of the original run."""

    def __init__(self, model: Transformer, kv: KVCache, fast_prefill: bool = False) -> None:
        self.model = model
        self.kv = kv
        self.block_size = kv.block_size
        self.fast_prefill = fast_prefill
        cuda = torch.device(model.device).type == "cuda"
        self.tables = BlockTables()
        self.graphs = DecodeGraphs(model, kv, fast_prefill, self.tables) if cuda else None
        self._host: torch.Tensor | None = None  # pinned staging for logits rows (CUDA)
        self._host_ids: torch.Tensor | None = None  # pinned staging for argmax ids (CUDA)

    def prefill_range(self, c: Chunk) -> tuple[int, int] | None:
        return prefill_range(c, self.fast_prefill)

    def build(self, record: StepRecord) -> tuple[ForwardBatch, list[int], list[tuple[int, int, int]]]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        logit_rows: list[int] = []
        sample_chunks: list[int] = []
        hidden_spans: list[tuple[int, int, int]] = []  # (chunk, first row, last row + 1)
        spans: list[PrefillSpan] = []
        paged: list[int] = []  # rows that attend through the paged kernel (when spans exist)
        mb = max(len(c.stream.block_table) for c in record.chunks)
        tables = torch.zeros(len(record.chunks), mb, dtype=torch.int32)
        for r, c in enumerate(record.chunks):
            s = c.stream
            table = s.block_table
            tables[r, : len(table)] = self.tables.get(s)
            first = len(ids)
            ids.extend(s.token_slice(c.start, c.end))
            p = range(c.start, c.end)
            pos.extend(p)
            slots.extend(table[i // bs] * bs + i % bs for i in p)
            rows.extend([r] * (c.end - c.start))
            fast = self.prefill_range(c)
            if fast is None:
                paged.extend(range(first, len(ids)))
            else:
                a, b = fast[0] - c.start + first, fast[1] - c.start + first
                spans.append(PrefillSpan(a, b - a, fast[0], r))
                paged.extend(range(first, a))
                paged.extend(range(b, len(ids)))
            if c.samples:
                logit_rows.append(len(ids) - 1)
                sample_chunks.append(r)
            if s.embed:
                hidden_spans.append((r, first, len(ids)))
        dev = self.model.device
        positions = torch.tensor(pos, dtype=torch.int64)
        hidden_rows = torch.cat([torch.arange(a, b) for _, a, b in hidden_spans]) if hidden_spans else None
        split = {}
        if spans:
            paged_rows = torch.tensor(paged, dtype=torch.int64)
            split = dict(prefill=tuple(spans), paged_rows=paged_rows.to(dev),
                         paged_tok_row=torch.tensor(rows, dtype=torch.int32)[paged_rows].to(dev),
                         paged_ctx_lens=(positions[paged_rows] + 1).to(torch.int32).to(dev))
        batch = ForwardBatch(
            token_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=positions.to(dev),
            slots=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=tables.to(dev),
            tok_row=torch.tensor(rows, dtype=torch.int32, device=dev),
            ctx_lens=(positions + 1).to(torch.int32).to(dev),
            logit_rows=torch.tensor(logit_rows, dtype=torch.int64, device=dev),
            hidden_rows=None if hidden_rows is None else hidden_rows.to(dev),
            **split,
        )
        return batch, sample_chunks, hidden_spans

    def execute(self, record: StepRecord) -> StepOutput:
        """Greedy chunks get their token (argmax, first index on ties) chosen where the logits
        are, so on CUDA only ids and the rows of host-sampled chunks cross to the host.
        Logits are valid until the next execute (on CUDA they sit in reused buffers)."""
        if not record.chunks:
            return StepOutput({}, {})
        if self.graphs is not None and self.graphs.accepts(record):
            logits, argmax = self.graphs.run(record)
            return self._pick(record, logits, argmax, list(range(len(record.chunks))))
        batch, sample_chunks, hidden_spans = self.build(record)
        logits, hidden = self.model.forward(batch, self.kv)
        out_hidden = {}
        if hidden is not None:
            hidden = hidden.cpu()
            off = 0
            for r, a, b in hidden_spans:
                out_hidden[r] = hidden[off: off + (b - a)]
                off += b - a
        if logits is None:
            return StepOutput({}, out_hidden)
        out = self._pick(record, logits, torch.argmax(logits, dim=-1), sample_chunks)
        return StepOutput(out.logits, out_hidden, out.greedy)

    def _pick(self, record: StepRecord, logits: torch.Tensor, argmax: torch.Tensor,
              sample_chunks: list[int]) -> StepOutput:
        """logits/argmax rows i belong to chunks sample_chunks[i] (more rows may follow: padding)."""
        row_of = {r: i for i, r in enumerate(sample_chunks)}
        greedy_rows = [i for i, r in enumerate(sample_chunks)
                       if record.chunks[r].stream.params.greedy]
        host_rows = [i for i, r in enumerate(sample_chunks)
                     if not record.chunks[r].stream.params.greedy]
        n = len(sample_chunks)
        if logits.device.type == "cpu":
            ids = argmax[:n]
            fetched = {sample_chunks[i]: logits[i] for i in host_rows}
        else:
            ids, rows = self._to_host(argmax[:n], logits, host_rows)
            fetched = {sample_chunks[i]: rows[j] for j, i in enumerate(host_rows)}
        ids = ids.tolist()
        greedy = {sample_chunks[i]: ids[i] for i in greedy_rows}
        return StepOutput(HostRows(logits, row_of, fetched), {}, greedy)

    def _to_host(self, ids: torch.Tensor, logits: torch.Tensor,
                 rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, logits[rows]) copied to pinned host buffers with one synchronization."""
        n, v = len(rows), logits.shape[1]
        if self._host_ids is None or self._host_ids.shape[0] < ids.shape[0]:
            self._host_ids = torch.empty(max(ids.shape[0], 128), dtype=torch.int64, pin_memory=True)
        host_ids = self._host_ids[: ids.shape[0]]
        host_ids.copy_(ids, non_blocking=True)
        out = None
        if n:
            if self._host is None or self._host.shape[0] < n or self._host.shape[1] != v:
                self._host = torch.empty(max(n, 64), v, dtype=torch.float32, pin_memory=True)
            out = self._host[:n]
            index = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
            out.copy_(logits.index_select(0, index), non_blocking=True)
        torch.cuda.current_stream(logits.device).synchronize()
        return host_ids, out


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

    def accepts(self, record: StepRecord) -> bool:
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
        key = self.key_for(min(streams, GRAPH_BATCHES[-1]), table_blocks)
        if key not in self._graphs:
            self._graphs[key] = _Graph(self.model, self.kv, *key, self.device)

    @property
    def captured(self) -> set[tuple[int, int]]:
        return set(self._graphs)

    def run(self, record: StepRecord) -> tuple[torch.Tensor, torch.Tensor]:
        """→ (logits [bucket, vocab], argmax [bucket]) on the device: the graph's outputs, whose
        first len(record.chunks) rows are the step's."""
        key = self.key(record)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = _Graph(self.model, self.kv, *key, self.device)
        g.load(record, self.block_size, self.tables)
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
        ints, ctx = g.host_ints, g.host_ctx
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
        self.ints = torch.zeros(3, batch, **i64)  # token_ids, positions, slots
        self.ctx = torch.zeros(batch + batch * width, **i32)  # ctx_lens, then the tables
        self.host_ints = torch.zeros(3, batch, dtype=torch.int64, pin_memory=True)
        self.host_ctx = torch.zeros(batch + batch * width, dtype=torch.int32, pin_memory=True)
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
            self.logits, _ = model.forward(self.fb, kv)
            self.argmax = torch.argmax(self.logits, dim=-1)  # greedy picks stay on the device

    def load(self, record: StepRecord, block_size: int, tables: BlockTables) -> None:
        n, b, w = len(record.chunks), self.batch, self.width
        toks, pos, slots = [], [], []
        ints, ctx = self.host_ints, self.host_ctx
        ctx.zero_()
        rows = ctx[b:].view(b, w)
        for i, c in enumerate(record.chunks):
            s, p = c.stream, c.start
            table = s.block_table
            toks.extend(s.token_slice(p, p + 1))
            pos.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
            rows[i, : len(table)] = tables.get(s)
        ints[:, n:] = 0
        ints[2, n:] = -1
        ints[:, :n] = torch.tensor([toks, pos, slots], dtype=torch.int64)
        ctx[:n] = torch.tensor(pos, dtype=torch.int32) + 1
        self.ints.copy_(ints, non_blocking=True)
        self.ctx.copy_(ctx, non_blocking=True)
