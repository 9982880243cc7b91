"""Helpers to run our forward pass on one sequence (all positions' logits), for parity tests."""

from __future__ import annotations

import torch

from replica.kv import KVCache
from replica.models.transformer import ForwardBatch, Transformer


def all_logits(model: Transformer, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Logits [len(ids), vocab] of one stream prefilled in one chunk."""
    cfg = model.cfg
    nblocks = -(-len(ids) // block_size)
    kv = KVCache(cfg.num_layers, nblocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    n = len(ids)
    pos = torch.arange(n)
    batch = ForwardBatch(
        token_ids=torch.tensor(ids), positions=pos, slots=pos.clone(),
        block_tables=torch.arange(nblocks, dtype=torch.int32)[None, :],
        tok_row=torch.zeros(n, dtype=torch.int32), ctx_lens=(pos + 1).to(torch.int32),
        logit_rows=pos.clone())
    logits, _ = model.forward(batch, kv)
    return logits
