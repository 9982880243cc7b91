"""What the eager runner (replica/runner.py) and the decode graphs (replica/graphs.py) both need
to turn a step's chunks into model inputs: block tables as tensors, lists of ints as tensors, and
which prompt positions attend through the tiled prefill path."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from kernels import prefill
from replica.scheduler import Chunk


@dataclass(eq=False, slots=True)
class _Converted:
    """One stream's table as converted: valid while stream.block_table is `blocks` with n ids."""

    blocks: list[int]
    n: int
    tensor: torch.Tensor  # [n] int32
    padded: dict[int, torch.Tensor] = field(default_factory=dict)  # width → [width] int32


class BlockTables:
    """Each stream's block table as an int32 tensor, converted only when the table changes.
    A table only grows between preemptions (the scheduler replaces the list, never edits it),
    so a step converts the new blocks alone: no O(context) host work per stream per step.
    A step's tables go into its [S, width] tensor in one copy (stack), from per-stream copies
    zero-padded to that width, kept until the table changes."""

    def __init__(self) -> None:
        self._cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # stream → _Converted

    def _converted(self, stream) -> _Converted:
        table = stream.block_table
        hit = self._cache.get(stream)
        if hit is not None:
            if hit.blocks is table and len(table) == hit.n:
                return hit
            n = hit.n
            if len(table) > n and table[:n] == hit.blocks[:n]:
                tensor = torch.cat([hit.tensor, torch.tensor(table[n:], dtype=torch.int32)])
                hit = self._cache[stream] = _Converted(table, len(table), tensor)
                return hit
        hit = self._cache[stream] = _Converted(table, len(table),
                                               torch.tensor(table, dtype=torch.int32))
        return hit

    def get(self, stream) -> torch.Tensor:
        """→ [len(stream.block_table)] int32 on the host (shared: callers copy, never write)."""
        return self._converted(stream).tensor

    def padded(self, stream, width: int) -> torch.Tensor:
        """→ [width] int32 on the host: the table, then zeros (shared: callers copy, never
        write). width >= len(stream.block_table)."""
        conv = self._converted(stream)
        row = conv.padded.get(width)
        if row is None:
            if width < conv.n:
                raise ValueError(f"a table of {conv.n} blocks does not fit in width {width}")
            row = conv.padded[width] = torch.zeros(width, dtype=torch.int32)
            row[: conv.n] = conv.tensor
        return row

    def stack(self, streams, width: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """→ [len(streams), width] int32 on the host: row i is streams[i]'s table, zero-padded
        (written into out, a contiguous [len(streams), width] int32 tensor, when given)."""
        rows = [self.padded(s, width) for s in streams]
        return torch.stack(rows) if out is None else torch.stack(rows, out=out)


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}


def int_tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A list of Python ints as a [len(values)] host tensor of dtype (int64 or int32). Through
    numpy, which converts a list several times faster than torch.tensor does."""
    return torch.from_numpy(np.array(values, dtype=_NUMPY[dtype]))


def prefill_range(c: Chunk, enabled: bool) -> tuple[int, int] | None:
    """Positions [a, b) of chunk c that attend through kernels.prefill (None: none): its prompt
    positions from MIN_POSITION on."""
    if not enabled:
        return None
    a, b = max(c.start, prefill.MIN_POSITION), min(c.end, len(c.stream.prompt_ids))
    return (a, b) if a < b else None
