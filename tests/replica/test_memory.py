"""KV pool sizing: explicit sizes win; CPU gets a bounded default; CUDA gets a share of the
memory free after the weights, less the step's measured peak and its graphs' bound."""

from __future__ import annotations

import pytest
import torch

from replica.config import CPU_KV_CACHE_BYTES, EngineConfig
from replica.errors import DeviceMemoryError, InvalidRequestError
from replica.kv import KVCache
from replica.memory import device_blocks, graph_bytes, prefill_bytes
from replica.models.synthetic import PRESETS, synthetic_model
from tests.replica.schedules import small_core

GiB = 1 << 30


def per_block(cfg, block_size=4, dtype=torch.float32):
    return KVCache.bytes_per_block(cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim, dtype)


def test_explicit_sizes_win_and_cpu_has_a_bounded_default():
    loaded = synthetic_model("tiny-llama", seed=1)
    cfg = loaded.config
    assert small_core(loaded, num_kv_blocks=37).pool.num_blocks == 37
    core = small_core(loaded, num_kv_blocks=None, kv_cache_bytes=per_block(cfg) * 50 + 7)
    assert core.pool.num_blocks == 50
    core = small_core(loaded, num_kv_blocks=None, kv_cache_bytes=None)
    assert core.pool.num_blocks == CPU_KV_CACHE_BYTES // per_block(cfg)
    assert core.stats()["kv_capacity_tokens"] == core.pool.num_blocks * 4 == core.kv_capacity_tokens


def test_bf16_pool_holds_twice_the_tokens_in_the_same_bytes():
    loaded = synthetic_model("tiny-llama", seed=1)
    size = per_block(loaded.config) * 64
    f32 = small_core(loaded, num_kv_blocks=None, kv_cache_bytes=size)
    bf16 = small_core(loaded, num_kv_blocks=None, kv_cache_bytes=size, kv_dtype="bfloat16")
    assert bf16.kv_capacity_tokens == 2 * f32.kv_capacity_tokens


def test_device_share_arithmetic():
    assert device_blocks(100 * GiB, 10 * GiB, 0.9, GiB) == 80
    assert device_blocks(100 * GiB, 0, 1.0, 3 * GiB) == 33
    with pytest.raises(DeviceMemoryError):
        device_blocks(10 * GiB, 9 * GiB, 0.9, GiB)
    with pytest.raises(InvalidRequestError):
        EngineConfig(gpu_memory_utilization=0.0)
    with pytest.raises(InvalidRequestError):
        EngineConfig(gpu_memory_utilization=1.5)


def test_graph_and_prefill_reserves_for_the_30b_preset_are_a_few_gib():
    from replica.models.spec import ModelConfig

    p = PRESETS["qwen3-30b-a3b-int4"]
    cfg = ModelConfig(name="x", arch=p.arch, vocab_size=p.vocab, hidden_size=p.hidden,
                      intermediate_size=p.intermediate, num_layers=p.layers, num_heads=p.heads,
                      num_kv_heads=p.kv_heads, head_dim=p.head_dim, rms_norm_eps=1e-6,
                      rope_theta=1e6, max_position=p.max_position, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_ids=(0,), num_experts=p.experts,
                      num_experts_per_tok=p.top_k, moe_intermediate_size=p.moe_intermediate)
    config = EngineConfig(device="cuda")
    graphs, pre = graph_bytes(cfg, config), prefill_bytes(cfg, config)
    assert 1 * GiB < graphs < 8 * GiB
    assert 32 << 20 < pre < 2 * GiB
    assert graph_bytes(cfg, EngineConfig(device="cuda", max_running_streams=8)) < graphs
