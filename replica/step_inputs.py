"""What the eager runner (replica/runner.py) and the decode graphs (replica/graphs.py) both need
to turn a step's chunks into model inputs: block tables as tensors, and which prompt positions
attend through the tiled prefill path."""

from __future__ import annotations

import weakref

import torch

from kernels import prefill
from replica.scheduler import Chunk


class BlockTables:
    """Each stream's block table as an int32 tensor, converted only when the table changes.
    A table only grows between preemptions (the scheduler replaces the list, never edits it),
    so a step converts the new blocks alone: no O(context) host work per stream per step."""

    def __init__(self) -> None:
        self._cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get(self, stream) -> torch.Tensor:
        """→ [len(stream.block_table)] int32 on the host (shared: callers copy, never write)."""
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
