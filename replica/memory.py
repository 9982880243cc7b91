"""How many KV blocks the pool gets: as configured, or sized from the device.

Precedence: num_kv_blocks, then kv_cache_bytes, then (CUDA) gpu_memory_utilization of the
memory free once the weights are resident, less what the step itself needs — its measured
activation peak at the full step token budget, the tiled prefill's buffers, and the CUDA graphs
the decode steps will capture — or (CPU) CPU_KV_CACHE_BYTES.
"""

from __future__ import annotations

import logging

import torch

from replica.config import CPU_KV_CACHE_BYTES, EngineConfig
from replica.errors import DeviceMemoryError
from replica.kv import KVCache
from replica.models.spec import ModelConfig
from replica.models.transformer import ForwardBatch, Transformer
from replica.graphs import GRAPH_BATCHES, MIN_GRAPH_BLOCKS

log = logging.getLogger("fedserve.engine")


def kv_pool_blocks(config: EngineConfig, model: Transformer, per_block: int) -> int:
    """The pool's block count for this config (see the module docstring)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_bytes is not None:
        return max(1, config.kv_cache_bytes // per_block)
    if not config.cuda:
        return max(1, CPU_KV_CACHE_BYTES // per_block)
    device = torch.device(config.device)
    peak = step_peak_bytes(model, config)
    free, total = torch.cuda.mem_get_info(device)
    reserve = peak + graph_bytes(model.cfg, config) + prefill_bytes(model.cfg, config)
    blocks = device_blocks(free, reserve, config.gpu_memory_utilization, per_block)
    log.info("KV pool: %d blocks (%.1f GiB) = %.2f x %.1f GiB free - %.2f GiB for the step "
             "(activations %.2f GiB)", blocks, blocks * per_block / 2**30,
             config.gpu_memory_utilization, free / 2**30, reserve / 2**30, peak / 2**30)
    return blocks


def device_blocks(free: int, reserve: int, utilization: float, per_block: int) -> int:
    """Blocks in utilization × free − reserve bytes (at least one, or DeviceMemoryError)."""
    budget = int(free * utilization) - reserve
    if budget < per_block:
        raise DeviceMemoryError(
            f"no room for the KV pool: {utilization:.2f} of {free / 2**30:.2f} GiB free, less "
            f"{reserve / 2**30:.2f} GiB for the step, is under one block ({per_block} bytes); "
            f"raise gpu_memory_utilization or give kv_cache_bytes")
    return budget // per_block


def step_peak_bytes(model: Transformer, config: EngineConfig) -> int:
    """CUDA: the allocation peak of one eager step of batch_tokens tokens (padding tokens,
    which write no KV and read none, over a one-block pool). Also compiles the step's kernels."""
    cfg, device = model.cfg, torch.device(config.device)
    t = config.batch_tokens
    rows = min(t, config.max_running_streams)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    kv = KVCache(cfg.num_layers, 1, config.block_size, cfg.num_kv_heads, cfg.head_dim,
                 config.kv_torch_dtype, config.device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    i64 = dict(dtype=torch.int64, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    batch = ForwardBatch(
        token_ids=torch.zeros(t, **i64), positions=torch.arange(t, **i64) % cfg.max_position,
        slots=torch.full((t,), -1, **i64), block_tables=torch.zeros(1, 1, **i32),
        tok_row=torch.zeros(t, **i32), ctx_lens=torch.zeros(t, **i32),
        logit_rows=torch.arange(rows, **i64))
    model.forward(batch, kv)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del kv, batch
    torch.cuda.empty_cache()
    return peak


def graph_bytes(cfg: ModelConfig, config: EngineConfig) -> int:
    """An upper bound on what the decode CUDA graphs hold once captured: each (batch bucket,
    table-width bucket) graph keeps its logits and activations, and the attention partials of
    its width (ModelRunner captures them lazily, after the pool exists)."""
    from kernels import triton_attention  # (its SPLIT: keys a split of the paged decode kernel)

    top = next(b for b in GRAPH_BATCHES if b >= min(config.max_running_streams, GRAPH_BATCHES[-1]))
    batches = sum(b for b in GRAPH_BATCHES if b <= top)
    moe = cfg.num_experts_per_tok * (cfg.hidden_size + 2 * cfg.moe_intermediate_size)
    per_row = 4 * (cfg.vocab_size + 16 * cfg.hidden_size + 4 * cfg.q_size + 2 * cfg.kv_size
                   + 2 * cfg.intermediate_size + moe)
    width, total = MIN_GRAPH_BLOCKS, 0
    max_blocks = -(-cfg.max_position // config.block_size)
    while True:
        splits = -(-width * config.block_size // triton_attention.SPLIT)
        partials = 4 * cfg.num_heads * (cfg.head_dim + 2) * splits if splits > 1 else 0
        total += batches * (per_row + partials)
        if width >= max_blocks:
            return total
        width *= 2


def prefill_bytes(cfg: ModelConfig, config: EngineConfig) -> int:
    """The tiled prefill's buffers at the longest context (kernels/prefill.py: the stream's
    gathered K and V, its queries and outputs), and the paged kernel's partials for the
    decode rows of an eager step at that context."""
    from kernels import prefill, triton_attention

    item = config.kv_torch_dtype.itemsize
    gathered = 2 * (cfg.max_position + prefill.PIECE) * cfg.kv_size * item
    queries = 3 * (config.batch_tokens + 2 * prefill.PIECE) * cfg.q_size * 4
    splits = -(-cfg.max_position // triton_attention.SPLIT)
    partials = config.max_running_streams * cfg.num_heads * splits * (cfg.head_dim + 2) * 4
    return gathered + queries + partials
