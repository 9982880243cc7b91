"""CUDA backend: kernels.cpu's functions (same names and signatures) on Triton kernels, plus
the fused ops the CUDA forward uses (q/k-norm + RoPE + KV write, linear with a residual, MoE).

Each wrapper checks device and dtypes, allocates its output and launches the kernels of one
family (kernels/triton_*.py). None of them synchronizes with the host, so the decode step can be
captured in a CUDA graph. Activations are float32 in memory; GEMMs read them as fp16 operands for
q4/q8 weights (fp32 accumulation) and as exact fp32 for f32 weights (triton_int4.py says why).
"""

from __future__ import annotations

import torch

from kernels import triton_attention, triton_int4, triton_moe, triton_norm
from kernels.linear import Linear
from kernels.triton_moe import StackedExperts


def _cuda_f32(t: torch.Tensor, name: str) -> None:
    # the device is Triton's to check (CPU tensors are fine under TRITON_INTERPRET=1)
    if t.dtype != torch.float32:
        raise TypeError(f"{name}: expected a float32 tensor, got {t.dtype} on {t.device}")


# ---- kernels.cpu's API ------------------------------------------------------------------------
def linear(lin: Linear, x: torch.Tensor) -> torch.Tensor:
    """x [n, in] f32 → [n, out] f32; each row computed alone (batch-invariant)."""
    _cuda_f32(x, "x")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], lin.out_features, dtype=torch.float32, device=x.device)
    return triton_int4.linear(lin, x, out)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., K]."""
    _cuda_f32(x, "x")
    _cuda_f32(weight, "weight")
    k = x.shape[-1]
    rows = x.reshape(-1, k) if x.is_contiguous() else x.contiguous().reshape(-1, k)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    triton_norm.rms_norm(rows, weight, eps, out.view(-1, k))
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [n, K] tensors whose rows are contiguous (strided views allowed)."""
    _cuda_f32(gate, "gate")
    _cuda_f32(up, "up")
    out = torch.empty(gate.shape, dtype=torch.float32, device=gate.device)
    return triton_norm.silu_mul(gate, up, out)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Row softmax of x [n, K]."""
    _cuda_f32(x, "x")
    x = x if x.stride(-1) == 1 else x.contiguous()
    return triton_norm.softmax(x, torch.empty(x.shape, dtype=torch.float32, device=x.device))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, tok_row: torch.Tensor, ctx_lens: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Causal attention of each query token over its own stream's paged KV → [T, H, D]."""
    _cuda_f32(q, "q")
    q = q.contiguous()
    out = torch.empty_like(q)
    return triton_attention.paged_attention(q, k_cache, v_cache, block_tables, tok_row, ctx_lens,
                                            scale, out)


# ---- CUDA-only fused ops ----------------------------------------------------------------------
def prepare_linear(lin: Linear, device: str) -> Linear:
    """A Linear in the storage the kernels read, on `device`."""
    return triton_int4.to_gpu_format(lin.to(device))


def prepare_experts(experts: tuple[tuple[Linear, Linear], ...], device: str) -> StackedExperts:
    return StackedExperts.stack(tuple((g.to(device), d.to(device)) for g, d in experts))


def linear_residual(lin: Linear, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + x @ W.T, the add fused into the GEMM's epilogue."""
    _cuda_f32(x, "x")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape[0], lin.out_features, dtype=torch.float32, device=x.device)
    return triton_int4.linear(lin, x, out, residual=residual)


def qkv_rope_store(qkv, positions, cos, sin, q_norm, k_norm, eps, slots, k_cache, v_cache,
                   num_heads: int) -> torch.Tensor:
    """q [T, H, D] from fused qkv; k/v written to the caches (see triton_norm.qkv_rope_store)."""
    _cuda_f32(qkv, "qkv")
    d = k_cache.shape[-1]
    q = torch.empty(qkv.shape[0], num_heads, d, dtype=torch.float32, device=qkv.device)
    return triton_norm.qkv_rope_store(qkv, positions, cos, sin, q_norm, k_norm, eps, slots,
                                      k_cache, v_cache, num_heads, q)


def moe(x: torch.Tensor, router: Linear, experts: StackedExperts, top_k: int,
        norm_topk_prob: bool, residual: torch.Tensor | None = None) -> torch.Tensor:
    """(residual +) the top-k expert mixture of each row of x [T, hidden]."""
    _cuda_f32(x, "x")
    t, dev = x.shape[0], x.device
    ids = torch.empty(t, top_k, dtype=torch.int32, device=dev)
    wts = torch.empty(t, top_k, dtype=torch.float32, device=dev)
    triton_moe.route(x, router, top_k, norm_topk_prob, ids, wts)
    inter = torch.empty(t * top_k, experts.inter, dtype=triton_moe.inter_dtype(experts), device=dev)
    y = torch.empty(t * top_k, experts.hidden, dtype=torch.float32, device=dev)
    triton_moe.experts_forward(x, ids, experts, inter, y)
    out = torch.empty(t, experts.hidden, dtype=torch.float32, device=dev)
    return triton_moe.combine(y, wts, out, residual)
