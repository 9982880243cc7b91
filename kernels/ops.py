"""Device dispatch for the kernel families: CPU → kernels.cpu (C); CUDA → Triton (kernels.gpu).

Callers (the model) use only these names, so a backend is swapped without touching the model.
"""

from __future__ import annotations

import torch

from kernels import cpu


def _gpu():
    from kernels import gpu  # imported lazily: Triton only exists where CUDA does

    return gpu


def _backend(t: torch.Tensor):
    return cpu if t.device.type == "cpu" else _gpu()


def linear(lin, x: torch.Tensor) -> torch.Tensor:
    """x [n, in] → [n, out] for a kernels.linear.Linear."""
    return _backend(x).linear(lin, x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _backend(x).rms_norm(x, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _backend(gate).silu_mul(gate, up)


def softmax(x: torch.Tensor) -> torch.Tensor:
    return _backend(x).softmax(x)


def paged_attention(q, k_cache, v_cache, block_tables, tok_row, ctx_lens, scale: float):
    return _backend(q).paged_attention(q, k_cache, v_cache, block_tables, tok_row, ctx_lens, scale)


# ---- weight placement and fused ops (CUDA runs them as one kernel each; CPU keeps the ----------
# ---- separate ops, so its bits are exactly those of the unfused sequence) ---------------------
def prepare_linear(lin, device: str):
    """The Linear on `device`, in the storage that device's kernels read."""
    return lin.to(device) if device == "cpu" else _gpu().prepare_linear(lin, device)


def prepare_experts(experts, device: str):
    """CUDA: the experts stacked for the grouped MoE kernels; CPU: None (per-expert Linears)."""
    return None if device == "cpu" else _gpu().prepare_experts(experts, device)


def linear_residual(lin, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + x @ W.T."""
    backend = _backend(x)
    if backend is cpu:
        return residual + cpu.linear(lin, x)
    return backend.linear_residual(lin, x, residual)


def qkv_rope_store(qkv, positions, cos, sin, q_norm, k_norm, eps, slots, k_cache, v_cache,
                   num_heads: int) -> torch.Tensor:
    """CUDA only: q/k norm + RoPE of fused qkv, K/V written at slots; returns q [T, H, D]."""
    return _backend(qkv).qkv_rope_store(qkv, positions, cos, sin, q_norm, k_norm, eps, slots, k_cache,
                                 v_cache, num_heads)


def moe(x: torch.Tensor, router, experts, top_k: int, norm_topk_prob: bool,
        residual: torch.Tensor | None = None) -> torch.Tensor:
    """CUDA only: (residual +) the top-k mixture of stacked experts (prepare_experts)."""
    return _backend(x).moe(x, router, experts, top_k, norm_topk_prob, residual)
