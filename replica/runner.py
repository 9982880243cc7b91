"""Turns a StepRecord into a ForwardBatch, runs the model, returns per-chunk outputs.

On CUDA, decode-only steps replay a CUDA graph of the forward (replica/graphs.py); other steps
run eagerly, with the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from replica.graphs import DecodeGraphs
from replica.kv import KVCache
from replica.models.transformer import ForwardBatch, PrefillSpan, Transformer
from replica.scheduler import Chunk, StepRecord
from replica.step_inputs import BlockTables, int_tensor, prefill_range


@dataclass(frozen=True, eq=False)
class StepOutput:
    """One step's results, keyed by the chunk's index in its StepRecord."""

    logits: Mapping[int, torch.Tensor]  # chunk index → [vocab] fp32 (CPU), for sampling chunks
    hidden: dict[int, torch.Tensor]  # chunk index → [n, hidden] fp32 (CPU), for embed chunks
    greedy: dict[int, int] = field(default_factory=dict)  # chunk index → argmax, greedy chunks


class HostRows(Mapping):
    """chunk index → that chunk's logits on the host. Rows fetched at step time (the chunks that
    sample on the host) are here already; any other row is copied from the device on first read
    (tests read them; the engine does not). Valid until the next execute."""

    def __init__(self, device_logits: torch.Tensor, row_of: dict[int, int],
                 fetched: dict[int, torch.Tensor]) -> None:
        """device_logits [R, vocab] fp32, R >= len(row_of); row_of: chunk → its row there;
        fetched: chunk → [vocab] fp32 on the host, the rows copied already."""
        self._dev, self._row_of, self._fetched = device_logits, row_of, fetched

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
        # host work to run while a step's device work is in flight (CUDA): called at most once
        # per execute, after the step is launched and before the host waits on it; the caller
        # sets and clears it, and runs it itself where execute did not (CPU)
        self.while_running: Callable[[], None] | None = None

    def prefill_range(self, c: Chunk) -> tuple[int, int] | None:
        return prefill_range(c, self.fast_prefill)

    def build(self, record: StepRecord) -> tuple[ForwardBatch, list[int], list[tuple[int, int, int]]]:
        """→ (the step's T tokens from S = len(record.chunks) streams as a ForwardBatch on the
        model's device; sample_chunks: the chunk of each of its L logit rows; hidden_spans:
        (chunk, first token row, end) of each embed chunk, in the order of its E hidden rows)."""
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
        batch = ForwardBatch(
            token_ids=int_tensor(ids, torch.int64).to(dev),
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
        and the token of each greedy chunk. Greedy chunks get their token (argmax, first index on
        ties) chosen where the logits are, so on CUDA only ids and the rows of host-sampled chunks
        cross to the host. Logits are valid until the next execute (on CUDA they sit in reused
        buffers)."""
        if not record.chunks:
            return StepOutput({}, {})
        if self.graphs is not None and self.graphs.accepts(record):
            logits, argmax = self.graphs.run(record)  # [bucket, vocab] fp32, [bucket] int64
            return self._pick(record, logits, argmax, list(range(len(record.chunks))))
        batch, sample_chunks, hidden_spans = self.build(record)
        logits, hidden = self.model.forward(batch, self.kv)  # [L, vocab] fp32, [E, hidden]
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
        """logits [R, vocab] fp32 and argmax [R] int64 on one device, R >= L = len(sample_chunks):
        row i < L belongs to chunk sample_chunks[i] (the rows after it are padding)."""
        row_of = {r: i for i, r in enumerate(sample_chunks)}
        chunks = record.chunks
        greedy_rows: list[int] = []
        host_rows: list[int] = []
        for i, r in enumerate(sample_chunks):
            (greedy_rows if chunks[r].stream.params.greedy else host_rows).append(i)
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
        """ids [N] int64, logits [R, vocab] fp32 on the device → (ids [N] int64, logits[rows]
        [len(rows), vocab] fp32 or None when rows is empty), in pinned host buffers, with one
        synchronization."""
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
        self._overlap()
        torch.cuda.current_stream(logits.device).synchronize()
        return host_ids, out

    def _overlap(self) -> None:
        """Run while_running once (it is cleared first: a step runs it at most once)."""
        fn, self.while_running = self.while_running, None
        if fn is not None:
            fn()
