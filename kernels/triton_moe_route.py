"""The routing side of the Triton MoE (kernels/triton_moe.py runs the expert GEMMs between):
the router (GEMM, then softmax + top-k + renorm per row), the grouping of assignments by
expert, and the rank-ordered combine of the experts' outputs.

Assignment a = t * top_k + r is token t's rank-r choice. The align kernel (one program per
expert) gives each expert routed to a slot (in increasing expert id) and lists its assignments
in increasing a. No sort, no atomics, no host sync (the grids are CUDA-graph safe).

Batch invariance: top-k ties go to the lower expert id, and the k contributions of a token are
summed in rank order by the combine kernel — whatever other tokens are routed where.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import triton_pdl
from kernels.linear import Linear
from kernels.triton_linear import TileConfig, linear
from kernels.triton_pdl import pdl_wait

ROUTER_TILE = TileConfig(bm=16, bn=16, bk=256, warps=4, stages=2)  # f32/q8 routers: many programs
# assignments examined per step when grouping: the next power of two of T*k, within these
# bounds (a 4,096-token prefill step scanned 32K ids 256 at a time: 108 µs a layer on the
# H200); the lists come out the same whatever the step
SCAN_MIN, SCAN_MAX = 256, 4096


# ---- device code ------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["T"])
def _topk_kernel(logits_ptr, ids_ptr, wts_ptr, T, E, stride_l, TOPK: tl.constexpr,
                 NORM: tl.constexpr, BM: tl.constexpr, E_PAD: tl.constexpr,
                 PDL: tl.constexpr):
    """Per row: softmax over E logits, the top-k in descending order (ties to the lower id),
    renormalized over the k when NORM (the sum in rank order)."""
    pdl_wait(PDL)
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    m_mask = offs_m < T
    offs_e = tl.arange(0, E_PAD)
    e_mask = offs_e < E
    acc = tl.load(logits_ptr + offs_m[:, None] * stride_l + offs_e[None, :],
                  mask=m_mask[:, None] & e_mask[None, :], other=0.0)
    logits = tl.where(e_mask[None, :], acc, float("-inf"))
    p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    p = tl.where(e_mask[None, :], p, -1.0)  # probabilities are >= 0: padding never wins
    total = tl.zeros((BM,), tl.float32)
    if NORM:  # first pass: the sum of the top-k probabilities, in rank order
        q = p
        for j in tl.static_range(TOPK):
            best = tl.max(q, axis=1)
            idx = tl.min(tl.where(q == best[:, None], offs_e[None, :], E_PAD), axis=1)
            if j == 0:
                total = best
            else:
                total = total + best
            q = tl.where(offs_e[None, :] == idx[:, None], -2.0, q)
    rows = offs_m.to(tl.int64) * TOPK
    for j in tl.static_range(TOPK):  # ties go to the lower expert id
        best = tl.max(p, axis=1)
        idx = tl.min(tl.where(p == best[:, None], offs_e[None, :], E_PAD), axis=1)
        tl.store(ids_ptr + rows + j, idx.to(tl.int32), mask=m_mask)
        if NORM:
            best_w = best / total
        else:
            best_w = best
        tl.store(wts_ptr + rows + j, best_w, mask=m_mask)
        p = tl.where(offs_e[None, :] == idx[:, None], -2.0, p)


@triton.jit(do_not_specialize=["TK", "T"])
def _moe_align_kernel(ids_ptr, meta_ptr, rows_ptr, TK, T, TOPK: tl.constexpr,
                      E_PAD: tl.constexpr, SCAN: tl.constexpr,
                      PDL: tl.constexpr):
    """Program e: if expert e is routed to, it is slot r = (number of active experts below e):
    meta[1 + 2r] = e, meta[2 + 2r] = its assignment count, rows[r, :count] = its assignments in
    increasing order; the last active expert writes meta[0] = number of active experts."""
    pdl_wait(PDL)
    e = tl.program_id(0)
    ev = tl.arange(0, 2 * E_PAD)  # bins: the experts, then E_PAD.. for masked lanes
    counts = tl.zeros((2 * E_PAD,), tl.int32)
    for c0 in range(0, TK, SCAN):
        a = c0 + tl.arange(0, SCAN)
        counts += tl.histogram(tl.load(ids_ptr + a, mask=a < TK, other=E_PAD), 2 * E_PAD)
    mine = tl.sum(tl.where(ev == e, counts, 0), axis=0)
    if mine > 0:
        active = (counts > 0) & (ev < E_PAD)
        rank = tl.sum((active & (ev < e)).to(tl.int32), axis=0)
        n_active = tl.sum(active.to(tl.int32), axis=0)
        tl.store(meta_ptr + 1 + 2 * rank, e)
        tl.store(meta_ptr + 2 + 2 * rank, mine)
        if rank == n_active - 1:
            tl.store(meta_ptr, n_active)
        seen = tl.sum(tl.zeros((SCAN,), tl.int32), axis=0)
        for c0 in range(0, TK, SCAN):
            a = c0 + tl.arange(0, SCAN)
            match = tl.load(ids_ptr + a, mask=a < TK, other=-1) == e
            pos = tl.cumsum(match.to(tl.int32), axis=0) - 1 + seen
            tl.store(rows_ptr + rank.to(tl.int64) * T + pos, a, mask=match)
            seen += tl.sum(match.to(tl.int32), axis=0)


@triton.jit(do_not_specialize=["stride_y", "stride_res", "stride_out"])
def _moe_combine_kernel(y_ptr, wts_ptr, res_ptr, out_ptr, N, stride_y, stride_res, stride_out,
                        TOPK: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
    """out[t] = (res[t] +) sum_r w[t, r] * y[t*k + r], the sum in rank order."""
    pdl_wait(PDL)
    combine_block(y_ptr, wts_ptr, res_ptr, out_ptr, tl.program_id(0).to(tl.int64),
                  tl.program_id(1) * BLOCK + tl.arange(0, BLOCK), N, stride_y, stride_res,
                  stride_out, TOPK, HAS_RES, "")


@triton.jit
def combine_block(y_ptr, wts_ptr, res_ptr, out_ptr, t, n, N, stride_y, stride_res, stride_out,
                  TOPK: tl.constexpr, HAS_RES: tl.constexpr, Y_CACHE: tl.constexpr):
    """out[t, n] = (res[t, n] +) sum_r w[t, r] * y[t*k + r, n] in rank order, for the columns
    n (< N) of token t (int64); y loaded with cache modifier Y_CACHE (".cg" where other
    programs of the same launch wrote it)."""
    mask = n < N
    acc = tl.load(y_ptr + (t * TOPK) * stride_y + n, mask=mask, other=0.0,
                  cache_modifier=Y_CACHE) * tl.load(wts_ptr + t * TOPK)
    for r in tl.static_range(1, TOPK):
        w = tl.load(wts_ptr + t * TOPK + r)
        acc = acc + tl.load(y_ptr + (t * TOPK + r) * stride_y + n, mask=mask, other=0.0,
                            cache_modifier=Y_CACHE) * w
    if HAS_RES:
        acc = tl.load(res_ptr + t * stride_res + n, mask=mask, other=0.0) + acc
    tl.store(out_ptr + t * stride_out + n, acc, mask=mask)


# ---- host side --------------------------------------------------------------------------------
def route(x: torch.Tensor, router: Linear, top_k: int, norm_topk_prob: bool,
          ids: torch.Tensor, wts: torch.Tensor, logits: torch.Tensor | None = None,
          logits_only: bool = False) -> None:
    """x [T, hidden] f32, router [E, hidden] → ids [T, k] int32, wts [T, k] f32: the top-k of
    softmax(x @ router.T) in rank order (renormalized over the k when norm_topk_prob); on
    cuda_q4's CUDA top-k where cuda_q4.FUSED_TOPK (at every token count: its weights' bits
    are its own). logits_only: the router's logits into `logits` alone (the fused experts
    rank them)."""
    t = x.shape[0]
    e = router.out_features
    if ids.shape != (t, top_k) or ids.dtype != torch.int32 or not ids.is_contiguous():
        raise ValueError("ids: expected contiguous int32 [T, k]")
    if wts.shape != (t, top_k) or wts.dtype != torch.float32 or not wts.is_contiguous():
        raise ValueError("wts: expected contiguous float32 [T, k]")
    if not 0 < top_k <= e:
        raise ValueError(f"top_k {top_k} must be in 1..{e}")
    if t == 0:
        return
    if logits is None:
        logits = torch.empty(t, e, dtype=torch.float32, device=x.device)
    linear(router, x, logits, tile=None if router.fmt == "q4" else ROUTER_TILE)
    if logits_only:
        return
    if x.is_cuda:
        from kernels import cuda_q4
        if cuda_q4.FUSED_TOPK and cuda_q4.topk_fits(logits, top_k):
            cuda_q4.topk(logits, top_k, norm_topk_prob, ids, wts)
            return
    bm = 4
    _topk_kernel[(triton.cdiv(t, bm),)](logits, ids, wts, t, e, logits.stride(0), TOPK=top_k,
                                        NORM=norm_topk_prob, BM=bm,
                                        E_PAD=max(16, triton.next_power_of_2(e)), num_warps=2,
                                        **triton_pdl.launch(x))


def align(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] int32 → (meta [1 + 2*slots] int32, arows [slots, T] int32), slots =
    min(E, T*k): meta[0] = experts routed to; slot r's expert meta[1 + 2r], its assignment
    count meta[2 + 2r], and its assignments (increasing) arows[r, :count]."""
    t, top_k = ids.shape
    tk = t * top_k
    slots = min(num_experts, tk)  # at most this many experts are routed to
    meta = torch.empty(1 + 2 * slots, dtype=torch.int32, device=ids.device)
    arows = torch.empty(slots, t, dtype=torch.int32, device=ids.device)  # an expert: <= 1 per token
    _moe_align_kernel[(num_experts,)](
        ids, meta, arows, tk, t, TOPK=top_k, E_PAD=max(16, triton.next_power_of_2(num_experts)),
        SCAN=min(SCAN_MAX, max(SCAN_MIN, triton.next_power_of_2(tk))), num_warps=4,
        **triton_pdl.launch(ids))
    return meta, arows


def combine(y: torch.Tensor, wts: torch.Tensor, out: torch.Tensor,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """y [T*k, N] f32, wts [T, k] f32 (, residual [T, N] f32) → out [T, N] f32 =
    (residual +) sum over ranks r of wts[t, r] * y[t*k + r], in rank order."""
    t, top_k = wts.shape
    n = y.shape[1]
    if y.shape != (t * top_k, n) or out.shape != (t, n) or not y.is_contiguous():
        raise ValueError("combine: y [T*k, N] contiguous, out [T, N]")
    if residual is not None and residual.shape != out.shape:
        raise ValueError("combine: residual like out")
    if t:
        res = residual if residual is not None else out
        block = 256  # 8 programs a token at hidden 2048: a 64-token step is 512 programs
        _moe_combine_kernel[(t, triton.cdiv(n, block))](
            y, wts, res, out, n, y.stride(0), res.stride(0), out.stride(0), TOPK=top_k,
            HAS_RES=residual is not None, BLOCK=block, **triton_pdl.launch(y))
    return out
