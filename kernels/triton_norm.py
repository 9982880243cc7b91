"""Row-local elementwise kernels in Triton: RMSNorm, SiLU·mul, softmax, and the fused
q/k-norm + RoPE + KV-cache write of attention's inputs.

Each program owns whole rows and reduces them in one fixed order (a block-shaped tree, or fixed
chunks in increasing order), so a row's bits never depend on the other rows of the call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import triton_pdl
from kernels.triton_pdl import pdl_wait

SOFTMAX_CHUNK = 4096  # elements per step of the chunked softmax (fixed)
ROPE_HEADS = 8  # query heads a qkv_rope_store program norms and rotates (a head's bits: its own)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, K, stride_x, stride_y, eps, BLOCK: tl.constexpr,
                     PDL: tl.constexpr, EARLY: tl.constexpr = False):
    """EARLY: the weight (no kernel writes it) loaded before the wait (triton_pdl.EARLY_INPUTS)."""
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK)
    mask = k < K
    if EARLY:
        w = tl.load(w_ptr + k, mask=mask, other=0.0)
    pdl_wait(PDL)
    x = tl.load(x_ptr + row * stride_x + k, mask=mask, other=0.0)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps)
    if not EARLY:
        w = tl.load(w_ptr + k, mask=mask, other=0.0)
    tl.store(y_ptr + row * stride_y + k, x * inv * w, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] f32, weight [K] f32 → out [..., K] f32: RMSNorm over the last dim (out is
    allocated when not given)."""
    k = x.shape[-1]
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.shape != (k,):
        raise ValueError("rms_norm: x [..., K] float32, weight [K] float32")
    if x.dim() == 2 and x.stride(1) == 1:
        rows = x  # [R, K], row-strided views read in place
    else:
        rows = x.reshape(-1, k) if x.is_contiguous() else x.contiguous().reshape(-1, k)
    if out is None:
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if out.shape != x.shape or not out.is_contiguous():
        raise ValueError("rms_norm: out must be contiguous, shaped like x")
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, k, rows.stride(0), k, eps,
                                           BLOCK=triton.next_power_of_2(k),
                                           num_warps=4 if k <= 4096 else 8,
                                           EARLY=triton_pdl.early(x), **triton_pdl.launch(x))
    return out


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, K, stride_g, stride_u, stride_y, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = k < K
    g = tl.load(g_ptr + row * stride_g + k, mask=mask, other=0.0)
    u = tl.load(u_ptr + row * stride_u + k, mask=mask, other=0.0)
    tl.store(y_ptr + row * stride_y + k, g / (1.0 + tl.exp(-g)) * u, mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate, up [n, K] f32 (rows contiguous, row-strided views allowed) → out [n, K] f32 =
    silu(gate) * up (allocated when not given)."""
    n, k = gate.shape
    if out is None:
        out = torch.empty(n, k, dtype=torch.float32, device=gate.device)
    for t, name in ((gate, "gate"), (up, "up"), (out, "out")):
        if t.shape != (n, k) or t.dtype != torch.float32 or t.stride(1) != 1:
            raise ValueError(f"silu_mul: {name} must be float32 [n, K] with contiguous rows")
    if n:
        block = 1024
        _silu_mul_kernel[(n, triton.cdiv(k, block))](gate, up, out, k, gate.stride(0), up.stride(0),
                                                     out.stride(0), BLOCK=block,
                                                     **triton_pdl.launch(gate))
    return out


@triton.jit
def _softmax_kernel(x_ptr, y_ptr, K, stride_x, stride_y, CHUNK: tl.constexpr,
                    PDL: tl.constexpr):
    """Two passes over fixed chunks in increasing order: max and sum, then normalize."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNK)
    mx = tl.full((CHUNK,), float("-inf"), tl.float32)
    for k0 in range(0, K, CHUNK):
        x = tl.load(x_ptr + row * stride_x + k0 + c, mask=k0 + c < K, other=float("-inf"))
        mx = tl.maximum(mx, x)
    m = tl.max(mx, axis=0)
    acc = tl.zeros((CHUNK,), tl.float32)
    for k0 in range(0, K, CHUNK):
        x = tl.load(x_ptr + row * stride_x + k0 + c, mask=k0 + c < K, other=float("-inf"))
        acc += tl.exp(x - m)
    inv = 1.0 / tl.sum(acc, axis=0)
    for k0 in range(0, K, CHUNK):
        x = tl.load(x_ptr + row * stride_x + k0 + c, mask=k0 + c < K, other=float("-inf"))
        tl.store(y_ptr + row * stride_y + k0 + c, tl.exp(x - m) * inv, mask=k0 + c < K)


def softmax(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, K] f32 → out [n, K] f32, the softmax of each row (allocated when not given)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    n, k = x.shape
    if out is None:
        out = torch.empty(n, k, dtype=torch.float32, device=x.device)
    if x.dtype != torch.float32 or x.stride(1) != 1 or out.shape != x.shape:
        raise ValueError("softmax: x [n, K] float32 with contiguous rows")
    if n:
        chunk = min(SOFTMAX_CHUNK, triton.next_power_of_2(k))
        _softmax_kernel[(n,)](x, out, k, x.stride(0), out.stride(0), CHUNK=chunk,
                              **triton_pdl.launch(x))
    return out


@triton.jit
def _norm_rope(a, b, wa, wb, ca, cb, sa, sb, eps, D: tl.constexpr, HAS_NORM: tl.constexpr):
    """Heads [R, D/2] (first halves a, second halves b): each normed over its D (HAS_NORM;
    the norm weight's halves wa, wb), then rotate-half RoPE by the token's cos/sin halves
    [D/2]."""
    if HAS_NORM:
        inv = 1.0 / tl.sqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / D + eps)
        a = a * inv[:, None] * wa[None, :]
        b = b * inv[:, None] * wb[None, :]
    return a * ca[None, :] - b * sa[None, :], b * cb[None, :] + a * sb[None, :]


@triton.jit
def _rope_inputs(pos_ptr, cos_ptr, sin_ptr, w_ptr, slot_ptr, t, stride_cs, D: tl.constexpr,
                 HAS_NORM: tl.constexpr):
    """What a qkv_rope_store program reads that the qkv GEMM before it does not write: the
    token's cos / sin halves at its position, its norm weight's halves (w_ptr: q's or k's;
    zeros without a norm) and its slot."""
    half = tl.arange(0, D // 2)
    p = tl.load(pos_ptr + t)
    ca = tl.load(cos_ptr + p * stride_cs + half)
    cb = tl.load(cos_ptr + p * stride_cs + D // 2 + half)
    sa = tl.load(sin_ptr + p * stride_cs + half)
    sb = tl.load(sin_ptr + p * stride_cs + D // 2 + half)
    if HAS_NORM:
        wa = tl.load(w_ptr + half)
        wb = tl.load(w_ptr + D // 2 + half)
    else:
        wa = tl.zeros((D // 2,), tl.float32)
        wb = wa
    return ca, cb, sa, sb, wa, wb, tl.load(slot_ptr + t)


@triton.jit
def _qkv_rope_store_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, slot_ptr,
                           q_ptr, kc_ptr, vc_ptr, stride_qkv, stride_cs, eps,
                           H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
                           HG: tl.constexpr, KVH_PAD: tl.constexpr, HAS_NORM: tl.constexpr,
                           PDL: tl.constexpr, EARLY: tl.constexpr = False):
    """Program (token, g): query heads g*HG .. g*HG + HG - 1 (→ q), or, for the last g, the
    token's KVH key heads (→ k cache) and its value heads (→ v cache). Each head is normed over
    D and rotated alone (a [heads, D/2] tile, one row a head), so its bits do not depend on
    which heads share its program. A program per head was 147K one-warp programs for a
    4,096-token step (194 µs a layer on the H200); this is 5 a token. EARLY: the inputs the
    qkv GEMM does not write (`_rope_inputs`) loaded before the wait (triton_pdl.EARLY_INPUTS)."""
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    half = tl.arange(0, D // 2)
    is_q = g * HG < H
    w_ptr = tl.where(is_q, qn_ptr, kn_ptr)
    if EARLY:
        ca, cb, sa, sb, wa, wb, slot = _rope_inputs(pos_ptr, cos_ptr, sin_ptr, w_ptr, slot_ptr, t,
                                                    stride_cs, D, HAS_NORM)
    pdl_wait(PDL)
    if not EARLY:
        ca, cb, sa, sb, wa, wb, slot = _rope_inputs(pos_ptr, cos_ptr, sin_ptr, w_ptr, slot_ptr, t,
                                                    stride_cs, D, HAS_NORM)
    base = qkv_ptr + t * stride_qkv
    if is_q:
        hh = g * HG + tl.arange(0, HG)
        live = (hh < H)[:, None]
        src = base + hh[:, None] * D + half[None, :]
        a = tl.load(src, mask=live, other=0.0)
        b = tl.load(src + D // 2, mask=live, other=0.0)
        ra, rb = _norm_rope(a, b, wa, wb, ca, cb, sa, sb, eps, D, HAS_NORM)
        out = q_ptr + (t * H + hh)[:, None] * D + half[None, :]
        tl.store(out, ra, mask=live)
        tl.store(out + D // 2, rb, mask=live)
    else:
        if slot >= 0:  # padding tokens (slot -1) write nothing
            j = tl.arange(0, KVH_PAD)
            live = (j < KVH)[:, None]
            src = base + (H + j)[:, None] * D + half[None, :]
            a = tl.load(src, mask=live, other=0.0)
            b = tl.load(src + D // 2, mask=live, other=0.0)
            ra, rb = _norm_rope(a, b, wa, wb, ca, cb, sa, sb, eps, D, HAS_NORM)
            dst = (slot * KVH + j)[:, None] * D + half[None, :]
            kv_ty = kc_ptr.dtype.element_ty  # float32 or bfloat16 (rounded to nearest)
            tl.store(kc_ptr + dst, ra.to(kv_ty), mask=live)
            tl.store(kc_ptr + dst + D // 2, rb.to(kv_ty), mask=live)
            d = tl.arange(0, D)
            v = tl.load(base + (H + KVH + j)[:, None] * D + d[None, :], mask=live, other=0.0)
            tl.store(vc_ptr + (slot * KVH + j)[:, None] * D + d[None, :], v.to(kv_ty), mask=live)


def qkv_rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                   eps: float, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   num_heads: int, q_out: torch.Tensor | None = None) -> torch.Tensor:
    """From fused qkv [T, (H + 2*KVH) * D] f32: q_out [T, H, D] f32 (normed, roped; allocated
    when not given); k (normed, roped) and v written to the caches [num_blocks, block_size, KVH,
    D] (float32, or bfloat16: rounded to nearest) at flat slots [T] int64 (-1: skip).
    positions [T]; cos/sin [max_position, D]; q_norm/k_norm [D] or both None."""
    t = qkv.shape[0]
    nb, bs, kvh, d = k_cache.shape
    h = num_heads
    if q_out is None:
        q_out = torch.empty(t, h, d, dtype=torch.float32, device=qkv.device)
    if d & (d - 1) or d < 4:
        raise ValueError(f"head_dim {d} must be a power of two")
    if qkv.dtype != torch.float32 or qkv.stride(1) != 1 or qkv.shape[1] != (h + 2 * kvh) * d:
        raise ValueError("qkv: expected float32 [T, (H + 2*KVH) * D] with contiguous rows")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape
            and k_cache.dtype in (torch.float32, torch.bfloat16) and v_cache.dtype == k_cache.dtype):
        raise ValueError("caches: expected contiguous float32 or bfloat16 [num_blocks, block_size, "
                         "KVH, D], both of one dtype")
    if q_out.shape != (t, h, d) or not q_out.is_contiguous():
        raise ValueError("q_out: expected contiguous [T, H, D]")
    if positions.shape != (t,) or slots.shape != (t,) or slots.dtype != torch.int64:
        raise ValueError("positions [T] and slots [T] int64 expected")
    if cos.shape != sin.shape or cos.shape[1] != d or cos.stride(1) != 1 or cos.stride() != sin.stride():
        raise ValueError("cos/sin: expected [max_position, D] with equal strides")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together")
    if t:
        qn = q_norm if q_norm is not None else cos
        kn = k_norm if k_norm is not None else cos
        _qkv_rope_store_kernel[(t, triton.cdiv(h, ROPE_HEADS) + 1)](
            qkv, positions, cos, sin, qn, kn, slots, q_out, k_cache, v_cache, qkv.stride(0),
            cos.stride(0), eps, H=h, KVH=kvh, D=d, HG=ROPE_HEADS, KVH_PAD=triton.next_power_of_2(kvh),
            HAS_NORM=q_norm is not None, num_warps=1, EARLY=triton_pdl.early(qkv),
            **triton_pdl.launch(qkv))
    return q_out


# ---- float64 reference (tests) ----------------------------------------------------------------
def qkv_rope_reference(qkv, positions, cos, sin, q_norm, k_norm, eps, num_heads, kv_heads):
    """(q [T, H, D], k [T, KVH, D], v [T, KVH, D]) in float64, as the CPU forward computes them."""
    t = qkv.shape[0]
    d = cos.shape[1]
    x = qkv.double()
    q = x[:, : num_heads * d].reshape(t, num_heads, d)
    k = x[:, num_heads * d: (num_heads + kv_heads) * d].reshape(t, kv_heads, d)
    v = x[:, (num_heads + kv_heads) * d:].reshape(t, kv_heads, d)

    def norm(y, w):
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * w.double()

    if q_norm is not None:
        q, k = norm(q, q_norm), norm(k, k_norm)
    c, s = cos[positions].double()[:, None, :], sin[positions].double()[:, None, :]

    def rope(y):
        rot = torch.cat([-y[..., d // 2:], y[..., : d // 2]], dim=-1)
        return y * c + rot * s

    return rope(q), rope(k), v
