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
