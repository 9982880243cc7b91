"""Turns a StepRecord into a ForwardBatch, runs the model, returns per-chunk outputs.

On CUDA, decode-only steps replay a CUDA graph of the forward (replica/graphs.py); other steps
run eagerly, with the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from kernels.cpu import torch_on_one_thread
from replica.graphs import DecodeGraphs
from replica.kv import KVCache
from replica.models.transformer import ForwardBatch, PrefillSpan, Transformer
from replica.sampling import pick
from replica.scheduler import Chunk, StepRecord
from replica.step_inputs import BlockTables, int_tensor, prefill_range


@dataclass(frozen=True, eq=False)
class StepOutput:
    """One step's results, keyed by the chunk's index in its StepRecord."""

    logits: Mapping[int, torch.Tensor]  # chunk index → [vocab] fp32 (CPU), for sampling chunks
    hidden: dict[int, torch.Tensor]  # chunk index → [n, hidden] fp32 (CPU), for embed chunks
    tokens: dict[int, int] = field(default_factory=dict)  # chunk index → its pick, sampling chunks


class HostRows(Mapping):
    """chunk index → that chunk's logits on the host, copied from the device on first read (once;
    tests read them; the engine does not: its tokens are picked on the device). Valid
    until the next execute."""

    def __init__(self, device_logits: torch.Tensor, row_of: dict[int, int]) -> None:
        """device_logits [R, vocab] fp32, R >= len(row_of); row_of: chunk → its row there."""
        self._dev, self._row_of = device_logits, row_of
        self._fetched: dict[int, torch.Tensor] = {}  # chunk → [vocab] fp32 on the host

    def __getitem__(self, chunk: int) -> torch.Tensor:
        """→ [vocab] fp32 on the host."""
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


@dataclass(eq=False)
class Launched:
    """A step started on the device (ModelRunner.launch), its results not yet collected."""

    record: StepRecord
    logits: torch.Tensor | None  # [R, vocab] fp32 on the device, R >= len(sample_chunks)
    picks: torch.Tensor | None  # [R] int64 on the device: each row's token (replica/sampling.pick)
    sample_chunks: list[int]  # the chunk of each logits row
    hidden: dict[int, torch.Tensor]  # chunk index → [n, hidden] fp32 (CPU), embed chunks
    ids: torch.Tensor | None = None  # [L] int64 on the host (filled by `done`)
    done: torch.cuda.Event | None = None  # CUDA: recorded after the copy to the host


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
        kind = torch.device(model.device).type
        cuda, self._cpu = kind == "cuda", kind == "cpu"
        self.tables = BlockTables()
        self.graphs = DecodeGraphs(model, kv, fast_prefill, self.tables) if cuda else None
        # pinned staging (CUDA) of the picked ids, two buffers used in turn
        self._host_ids: list[torch.Tensor | None] = [None, None]
        self._turn = 0
        # host work to run while a step's device work is in flight: called by the next collect
        # (execute), before it waits for the step, then cleared; the caller sets it
        self.while_running: Callable[[], None] | None = None

    def prefill_range(self, c: Chunk) -> tuple[int, int] | None:
        return prefill_range(c, self.fast_prefill)

    def build(self, record: StepRecord, feed_ids: torch.Tensor | None = None
              ) -> tuple[ForwardBatch, list[int], list[tuple[int, int, int]]]:
        """→ (the step's T tokens from S = len(record.chunks) streams as a ForwardBatch on the
        model's device; sample_chunks: the chunk of each of its L logit rows; hidden_spans:
        (chunk, first token row, end) of each embed chunk, in the order of its E hidden rows).
        feed_ids [R] int64 on the device: the picks of the step before, where a chunk
        with feed_row >= 0 takes its token (every chunk of a step scheduled ahead)."""
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
        streams = [c.stream for c in record.chunks]
        tables = self.tables.stack(streams, max(len(s.block_table) for s in streams))  # [S, MB]
        for r, c in enumerate(record.chunks):
            s = c.stream
            table = s.block_table
            first = len(ids)
            if c.feed_row >= 0:
                ids.append(c.feed_row)  # a row of feed_ids, gathered on the device below
            else:
                ids.extend(s.token_slice(c.start, c.end))
            p = range(c.start, c.end)
            pos.extend(p)
            slots.extend(table[i // bs] * bs + i % bs for i in p)
            rows.extend([r] * (c.end - c.start))
            fast = prefill_range(c, self.fast_prefill)
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
        positions = int_tensor(pos, torch.int64)  # [T]
        tok_row = int_tensor(rows, torch.int32)  # [T]
        hidden_rows = (torch.cat([torch.arange(a, b) for _, a, b in hidden_spans])  # [E]
                       if hidden_spans else None)
        split = {}
        if spans:
            paged_rows = int_tensor(paged, torch.int64)  # [P]
            split = dict(prefill=tuple(spans), paged_rows=paged_rows.to(dev),
                         paged_tok_row=tok_row[paged_rows].to(dev),
                         paged_ctx_lens=(positions[paged_rows] + 1).to(torch.int32).to(dev))
        token_ids = int_tensor(ids, torch.int64).to(dev)
        if any(c.feed_row >= 0 for c in record.chunks):
            if feed_ids is None or not all(c.feed_row >= 0 for c in record.chunks):
                raise ValueError("a step scheduled ahead needs the step before's picks, for all its chunks")
            token_ids = feed_ids.index_select(0, token_ids)
        batch = ForwardBatch(
            token_ids=token_ids,
            positions=positions.to(dev),
            slots=int_tensor(slots, torch.int64).to(dev),
            block_tables=tables.to(dev),
            tok_row=tok_row.to(dev),
            ctx_lens=(positions + 1).to(torch.int32).to(dev),
            logit_rows=int_tensor(logit_rows, torch.int64).to(dev),
            hidden_rows=None if hidden_rows is None else hidden_rows.to(dev),
            **split,
        )
        return batch, sample_chunks, hidden_spans

    def execute(self, record: StepRecord) -> StepOutput:
        """→ logits [vocab] fp32 per sampling chunk, hidden [n, hidden] fp32 per embed chunk,
        and the token of each sampling chunk: collect(launch(record))."""
        if not record.chunks:
            return StepOutput({}, {})
        return self.collect(self.launch(record))

    def launch(self, record: StepRecord, feed: "Launched | None" = None) -> "Launched":
        """Start the step on the device and queue its tokens' copy to the host; on CUDA this
        returns before the device is done (collect waits). Every sampling chunk gets its token
        where the logits are (replica/sampling.pick: argmax for greedy streams, the seeded
        draw for the others), so on CUDA only ids cross to the host. feed: the step launched
        before this one, when record was scheduled ahead of it (Scheduler.schedule_ahead):
        each chunk's token is feed's pick of row chunk.feed_row, taken on the device.
        Decode-only steps replay a CUDA graph; the rest run eagerly. On the CPU torch's own ops
        run on one thread, the C kernels on their team (kernels/cpu.torch_on_one_thread)."""
        if not record.chunks:
            raise ValueError("launch: an empty step")
        if self._cpu:
            with torch_on_one_thread():
                return self._launch(record, feed)
        return self._launch(record, feed)

    def _launch(self, record: StepRecord, feed: "Launched | None") -> "Launched":
        feed_ids = None if feed is None else feed.picks
        if self.graphs is not None and self.graphs.accepts(record):
            logits, argmax = self.graphs.launch(record, feed_ids)  # [bucket, vocab], [bucket]
            sample_chunks = list(range(len(record.chunks)))
            hidden_out = {}
        else:
            batch, sample_chunks, hidden_spans = self.build(record, feed_ids)
            logits, hidden = self.model.forward(batch, self.kv)  # [L, vocab] fp32, [E, hidden]
            hidden_out = {}
            if hidden is not None:
                hidden = hidden.cpu()
                off = 0
                for r, a, b in hidden_spans:
                    hidden_out[r] = hidden[off: off + (b - a)]
                    off += b - a
            if logits is None:
                return Launched(record, None, None, [], hidden_out)
            argmax = torch.argmax(logits, dim=-1)
        chunks = record.chunks
        # a sampled token is the one at position chunk.end (the stream's next)
        sampled = [(i, chunks[r].stream.params, chunks[r].end) for i, r in enumerate(sample_chunks)
                   if not chunks[r].stream.params.greedy]
        picks = pick(logits, argmax, sampled)  # [R]
        n = len(sample_chunks)
        out = Launched(record, logits, picks, sample_chunks, hidden_out)
        if self._cpu:
            out.ids = picks[:n]
        else:
            out.ids = self._to_host(picks[:n])
            out.done = torch.cuda.Event()
            out.done.record(torch.cuda.current_stream(logits.device))
        return out

    def collect(self, launched: "Launched") -> StepOutput:
        """Wait for a launched step's results (running while_running first) → its StepOutput.
        Logits stay valid until the next launch (on CUDA they sit in reused buffers)."""
        self._overlap()
        if launched.logits is None:
            return StepOutput({}, launched.hidden)
        if launched.done is not None:
            launched.done.synchronize()
        sample_chunks = launched.sample_chunks
        row_of = {r: i for i, r in enumerate(sample_chunks)}
        tokens = dict(zip(sample_chunks, launched.ids.tolist()))
        return StepOutput(HostRows(launched.logits, row_of), launched.hidden, tokens)

    def _to_host(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [N] int64 on the device → [N] int64 in a pinned host buffer, copied after the
        step's work in stream order (not waited for). Two buffers in turn: a step's ids stay
        readable while the next one is launched and copies its own."""
        self._turn ^= 1
        t = self._turn
        if self._host_ids[t] is None or self._host_ids[t].shape[0] < ids.shape[0]:
            self._host_ids[t] = torch.empty(max(ids.shape[0], 128), dtype=torch.int64,
                                            pin_memory=True)
        host_ids = self._host_ids[t][: ids.shape[0]]
        host_ids.copy_(ids, non_blocking=True)
        return host_ids

    def _overlap(self) -> None:
        """Run while_running once (it is cleared first: a step runs it at most once)."""
        fn, self.while_running = self.while_running, None
        if fn is not None:
            fn()
