"""Paged KV bookkeeping: the BlockPool (sole owner of free list and ref-counts) and the
SessionCache (retained KV of finished turns, LRU-evictable). Tensors live in KVCache.

Owners are named by strings ("stream:<id>", "session:<key>"); a block's ref-count equals the
number of owners holding it, which check_integrity() verifies.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch


class NoFreeBlocks(Exception):
    """The pool cannot satisfy an allocation (caller evicts or preempts)."""


class BlockPool:
    """Free list (FIFO: freed blocks are reused last) and ref-counts for num_blocks blocks."""

    def __init__(self, num_blocks: int, on_release=None) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self._on_release = on_release  # called with blocks that return to the free list

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, block: int) -> int:
        return self._ref[block]

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks with ref-count 1, lowest-waiting first; all or nothing."""
        if n > len(self._free):
            raise NoFreeBlocks(f"need {n} blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._ref[b] = 1
        return out

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._ref[b] <= 0:
                raise RuntimeError(f"incref of free block {b}")
            self._ref[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks reaching zero return to the free list."""
        released = []
        for b in blocks:
            if self._ref[b] <= 0:
                raise RuntimeError(f"double free of block {b}")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free.append(b)
                released.append(b)
        if released and self._on_release is not None:
            self._on_release(released)

    def check_integrity(self, owners: dict[str, list[int]]) -> None:
        """free + held == total; ref-count == number of owners; no free block is owned."""
        held = [0] * self.num_blocks
        for name, blocks in owners.items():
            if len(set(blocks)) != len(blocks):
                raise AssertionError(f"{name} holds a block twice: {blocks}")
            for b in blocks:
                held[b] += 1
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        for b in range(self.num_blocks):
            if held[b] != self._ref[b]:
                raise AssertionError(f"block {b}: ref-count {self._ref[b]} but {held[b]} owners")
            if (b in free) != (held[b] == 0):
                raise AssertionError(f"block {b}: free={b in free} with {held[b]} owners")


@dataclass
class RetainedSession:
    token_ids: list[int]  # tokens whose KV is in `blocks` (position i at blocks[i // bs])
    blocks: list[int]
    retained_at: float  # unix seconds: the federation's directory keeps the newest of its homes


class SessionCache:
    """Retained per-session KV, in LRU order. Holds one pool reference per block it keeps."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._sessions: OrderedDict[str, RetainedSession] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._sessions

    def keys(self) -> list[str]:
        return list(self._sessions)

    def retained_at(self) -> dict[str, float]:
        """Each retained session → when its last turn finished here (unix seconds)."""
        return {k: s.retained_at for k, s in self._sessions.items()}

    @property
    def num_blocks(self) -> int:
        return sum(len(s.blocks) for s in self._sessions.values())

    def owners(self) -> dict[str, list[int]]:
        return {f"session:{k}": s.blocks for k, s in self._sessions.items()}

    def retain(self, key: str, token_ids: list[int], blocks: list[int]) -> None:
        """Take over a finished stream's blocks (the caller's references move here)."""
        self.drop(key)
        needed = -(-len(token_ids) // self.block_size)
        self.pool.free(blocks[needed:])  # blocks past the computed tokens hold nothing useful
        self._sessions[key] = RetainedSession(list(token_ids), blocks[:needed], time.time())

    def claim(self, key: str, prompt_ids: list[int]) -> tuple[list[int], int]:
        """Hand the longest exact token prefix of `prompt_ids` to a new stream.

        Returns (blocks, num_cached). The entry leaves the cache; its references move to the
        caller. At least one prompt token is left uncached so the stream computes logits.
        """
        entry = self._sessions.pop(key, None)
        if entry is None:
            return [], 0
        limit = min(len(entry.token_ids), len(prompt_ids) - 1)
        n = 0
        while n < limit and entry.token_ids[n] == prompt_ids[n]:
            n += 1
        keep = -(-n // self.block_size)
        self.pool.free(entry.blocks[keep:])
        return entry.blocks[:keep], n

    def drop(self, key: str) -> None:
        entry = self._sessions.pop(key, None)
        if entry is not None:
            self.pool.free(entry.blocks)

    def evict_lru(self) -> str | None:
        """Free the least recently retained session; returns its key (None if empty)."""
        if not self._sessions:
            return None
        key = next(iter(self._sessions))
        self.drop(key)
        return key


class KVCache:
    """The KV tensors: per layer K and V of [num_blocks, block_size, kv_heads, head_dim], in
    the pool's dtype (bf16 on CUDA, fp32 on CPU; K/V are computed in fp32 and rounded once,
    when written)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.block_size = block_size
        self.dtype = dtype
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int,
                        dtype: torch.dtype = torch.float32) -> int:
        return 2 * num_layers * block_size * kv_heads * head_dim * dtype.itemsize

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v [T, kv_heads, head_dim] at flat slots [T] (block * block_size + offset)."""
        kc, vc = self.k[layer], self.v[layer]
        kc.view(-1, *kc.shape[2:]).index_copy_(0, slots, k.to(kc.dtype))
        vc.view(-1, *vc.shape[2:]).index_copy_(0, slots, v.to(vc.dtype))

    @staticmethod
    def renumber(block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(used, tables): the sorted ids of the blocks block_tables name, and the tables
        renumbered to index `used` (so K[used] can stand in for the pool)."""
        used = torch.unique(block_tables.to(torch.int64))  # sorted
        return used, torch.searchsorted(used, block_tables.to(torch.int64)).to(torch.int32)

    def poison(self, blocks: list[int]) -> None:
        """Fill blocks with NaN (debug mode: any read of freed KV then shows in the output)."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.k[0].device)
        for t in self.k + self.v:
            t.index_fill_(0, idx, float("nan"))
