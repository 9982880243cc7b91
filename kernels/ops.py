"""Device dispatch, the one layer between the model and the kernel families: CPU tensors go to
kernels.cpu (C), CUDA tensors straight to the Triton family that owns the op
(kernels/triton_linear.py, triton_norm.py, triton_attention.py, triton_moe.py).

Callers (the model) use only these names, so a backend is swapped without touching the model.
The Triton families are imported inside the CUDA branches: importing this module (or running
on the CPU) never imports Triton, and a process that imported Triton without TRITON_INTERPRET=1
can no longer interpret kernels (tests/test_imports.py).
"""

from __future__ import annotations

import torch

from kernels import cpu


def _triton(where: torch.Tensor | str) -> bool:
    """Whether a tensor (or a device name) runs on the Triton kernels: everything off the CPU.
    A test routes CPU tensors through the interpreted kernels by patching this."""
    device = where.device if isinstance(where, torch.Tensor) else torch.device(where)
    return device.type != "cpu"


def linear(lin, x: torch.Tensor) -> torch.Tensor:
    """x [n, in] f32 → [n, out] f32 for a kernels.linear.Linear (placed by prepare_linear)."""
    if not _triton(x):
        return cpu.linear(lin, x)
    from kernels import triton_linear

    return triton_linear.linear(lin, x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., K] f32, weight [K] → [..., K]: RMSNorm over the last dim."""
    if not _triton(x):
        return cpu.rms_norm(x, weight, eps)
    from kernels import triton_norm

    return triton_norm.rms_norm(x, weight, eps)


def norm_linear(lin, h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h [n, in] f32 → [n, out]: RMSNorm(h) @ W.T (rms_norm, then linear)."""
    return linear(lin, rms_norm(h, weight, eps))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [n, K] f32 → [n, K]: silu(gate) * up."""
    if not _triton(gate):
        return cpu.silu_mul(gate, up)
    from kernels import triton_norm

    return triton_norm.silu_mul(gate, up)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """x [n, K] f32 → [n, K]: the softmax of each row."""
    if not _triton(x):
        return cpu.softmax(x)
    from kernels import triton_norm

    return triton_norm.softmax(x)


def paged_attention(q, k_cache, v_cache, block_tables, tok_row, ctx_lens, scale: float):
    """q [T, H, D] f32 over the paged caches [num_blocks, block_size, KVH, D] → [T, H, D]:
    token t attends to the first ctx_lens[t] keys of stream tok_row[t] (block_tables [S, MB])."""
    if not _triton(q):
        return cpu.paged_attention(q, k_cache, v_cache, block_tables, tok_row, ctx_lens, scale)
    from kernels import triton_attention

    return triton_attention.paged_attention(q, k_cache, v_cache, block_tables, tok_row, ctx_lens,
                                            scale)


# ---- weight placement and fused ops (CUDA runs them as one kernel each; CPU keeps the ----------
# ---- separate ops, so its bits are exactly those of the unfused sequence) ---------------------
def prepare_linear(lin, device: str):
    """The Linear on `device`, in the storage that device's kernels read."""
    if not _triton(device):
        return lin.to(device)
    from kernels import triton_linear

    return triton_linear.prepare_linear(lin, device)


def prepare_experts(experts, device: str):
    """CUDA: the experts stacked for the grouped MoE kernels; CPU: None (per-expert Linears)."""
    if not _triton(device):
        return None
    from kernels import triton_moe

    return triton_moe.prepare_experts(experts, device)


def linear_residual(lin, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """x [n, in] f32, residual [n, out] f32 → [n, out]: residual + x @ W.T (CUDA: the add in
    the GEMM's epilogue)."""
    if not _triton(x):
        return residual + cpu.linear(lin, x)
    from kernels import triton_linear

    return triton_linear.linear(lin, x, residual=residual)


def qkv_rope_store(qkv, positions, cos, sin, q_norm, k_norm, eps, slots, k_cache, v_cache,
                   num_heads: int) -> torch.Tensor:
    """CUDA only: q/k norm + RoPE of fused qkv [T, (H + 2*KVH) * D], K/V written at slots [T];
    returns q [T, H, D]."""
    from kernels import triton_norm

    return triton_norm.qkv_rope_store(qkv, positions, cos, sin, q_norm, k_norm, eps, slots,
                                      k_cache, v_cache, num_heads)


def norm_moe(h: torch.Tensor, weight: torch.Tensor, eps: float, router, experts, top_k: int,
             norm_topk_prob: bool) -> torch.Tensor:
    """CUDA only: h [T, hidden] f32 → h + `moe` of RMSNorm(h) (rms_norm, then moe
    with h as the residual)."""
    return moe(rms_norm(h, weight, eps), router, experts, top_k, norm_topk_prob, residual=h)


def moe(x: torch.Tensor, router, experts, top_k: int, norm_topk_prob: bool,
        residual: torch.Tensor | None = None) -> torch.Tensor:
    """CUDA only: x [T, hidden] f32 → [T, hidden]: (residual +) the top-k mixture of stacked
    experts (prepare_experts)."""
    from kernels import triton_moe

    return triton_moe.moe(x, router, experts, top_k, norm_topk_prob, residual)
