"""Turns a StepRecord into a ForwardBatch, runs the model, returns per-chunk outputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replica.kv import KVCache
from replica.models.transformer import ForwardBatch, Transformer
from replica.scheduler import StepRecord


@dataclass(frozen=True, eq=False)
class StepOutput:
    logits: dict[int, torch.Tensor]  # chunk index → [vocab] fp32 (CPU), for sampling chunks
    hidden: dict[int, torch.Tensor]  # chunk index → [n, hidden] fp32 (CPU), for embed chunks


class ModelRunner:
    def __init__(self, model: Transformer, kv: KVCache) -> None:
        self.model = model
        self.kv = kv
        self.block_size = kv.block_size

    def build(self, record: StepRecord) -> tuple[ForwardBatch, list[int], list[tuple[int, int, int]]]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        logit_rows: list[int] = []
        sample_chunks: list[int] = []
        hidden_spans: list[tuple[int, int, int]] = []  # (chunk, first row, last row + 1)
        mb = max(len(c.stream.block_table) for c in record.chunks)
        tables = torch.zeros(len(record.chunks), mb, dtype=torch.int32)
        for r, c in enumerate(record.chunks):
            s = c.stream
            table = s.block_table
            tables[r, : len(table)] = torch.tensor(table, dtype=torch.int32)
            first = len(ids)
            ids.extend(s.tokens[c.start: c.end])
            p = range(c.start, c.end)
            pos.extend(p)
            slots.extend(table[i // bs] * bs + i % bs for i in p)
            rows.extend([r] * (c.end - c.start))
            if c.samples:
                logit_rows.append(len(ids) - 1)
                sample_chunks.append(r)
            if s.embed:
                hidden_spans.append((r, first, len(ids)))
        dev = self.model.device
        positions = torch.tensor(pos, dtype=torch.int64)
        hidden_rows = torch.cat([torch.arange(a, b) for _, a, b in hidden_spans]) if hidden_spans else None
        batch = ForwardBatch(
            token_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=positions.to(dev),
            slots=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=tables.to(dev),
            tok_row=torch.tensor(rows, dtype=torch.int32, device=dev),
            ctx_lens=(positions + 1).to(torch.int32).to(dev),
            logit_rows=torch.tensor(logit_rows, dtype=torch.int64, device=dev),
            hidden_rows=None if hidden_rows is None else hidden_rows.to(dev),
        )
        return batch, sample_chunks, hidden_spans

    def execute(self, record: StepRecord) -> StepOutput:
        if not record.chunks:
            return StepOutput({}, {})
        batch, sample_chunks, hidden_spans = self.build(record)
        logits, hidden = self.model.forward(batch, self.kv)
        out_logits = {}
        if logits is not None:
            logits = logits.cpu()
            out_logits = {r: logits[i] for i, r in enumerate(sample_chunks)}
        out_hidden = {}
        if hidden is not None:
            hidden = hidden.cpu()
            off = 0
            for r, a, b in hidden_spans:
                out_hidden[r] = hidden[off: off + (b - a)]
                off += b - a
        return StepOutput(out_logits, out_hidden)
