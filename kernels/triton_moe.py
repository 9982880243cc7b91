"""Mixture-of-experts in Triton: router (GEMM + softmax + top-k + renorm) in one kernel, then
grouped expert GEMMs over the tokens routed to each expert, then a rank-ordered combine.

Assignment a = t * top_k + r is token t's rank-r choice. An align kernel (one program per
expert) gives each expert routed to a slot (in increasing expert id) and lists its assignments in
increasing a; program (slot, n-tile) of an expert kernel walks them BM rows at a time, gathering
the rows of x. No sort, no atomics, no host sync (the grids are CUDA-graph safe).

q4 experts run the re-packed q4 GEMM (kernels/triton_q4.py) with a fixed K split per expert
shape: program (slot, n-tile, split) stores the partials of all the slot's rows, and the last
split program of (slot, n-tile) sums them in split order and runs the epilogue (SiLU·up, or the
down projection's store). f32/q8 experts run the f32/q8 loop of triton_int4 unsplit.

Batch invariance: a row's GEMM result depends only on its own x row and the expert's weights
(fixed tile config, a split count fixed by the expert's shape, rows of a tile never interact),
and the k contributions of a token are summed in rank order by the combine kernel — whatever
other tokens are routed where.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import triton_q4
from kernels.linear import Linear
from kernels.triton_int4 import FMT_CODES, TileConfig, check_x, linear, rows_times_w, to_gpu_format, weight_args
from kernels.triton_q4 import (Q4Tile, q4_rows, split_count, split_load_sum, split_range,
                               split_release, split_store, split_ticket)

ROUTER_TILE = TileConfig(bm=16, bn=16, bk=256, warps=4, stages=2)  # f32/q8 routers: many programs
EXPERT_TILE = TileConfig(bm=16, bn=32, bk=128, warps=4, stages=2)  # f32/q8 experts
Q4_EXPERT_TILE = Q4Tile()
# q4 expert K splits are sized for one token's top-k (≈ 8 experts): n-tiles × splits ≤ this
EXPERT_PROGRAMS = 128
SCAN = 64  # assignments examined per step when grouping (fixed)
CHUNK_TOKENS = 512  # tokens per expert pass: bounds the split-K partials of a long prefill


@dataclass(frozen=True, eq=False)
class StackedExperts:
    """All experts of one layer stacked on a leading expert dim, in GPU storage.

    gate_up has its gate and up rows interleaved (row 2j = gate j, 2j + 1 = up j), so one GEMM
    tile yields both factors of silu(gate) * up. Per format, gu / down hold
      q4:  (qs [E, K/32, N, 16] uint8, sm [E, K/32, N, 2] fp16)  — triton_q4's layout
      q8:  (qs [E, N, K] int8, scale [E, N, K/32] fp16);   f32: (w [E, N, K], w)
    with N, K = 2*I, hidden for gu and hidden, I for down. q4 experts also carry their K split
    counts (by shape, for their tile) and the split programs' ticket counters, one per
    (slot, n-tile).
    """

    fmt: str
    num_experts: int
    hidden: int
    inter: int
    gu: tuple[torch.Tensor, torch.Tensor]
    down: tuple[torch.Tensor, torch.Tensor]
    gu_split: int = 1
    down_split: int = 1
    gu_tickets: torch.Tensor | None = None
    down_tickets: torch.Tensor | None = None
    tile: Q4Tile | None = None  # q4: the tile the splits and tickets were counted for

    @classmethod
    def stack(cls, experts: tuple[tuple[Linear, Linear], ...],
              tile: Q4Tile = Q4_EXPERT_TILE) -> "StackedExperts":
        fmt = experts[0][0].fmt
        if any(x.fmt != fmt for pair in experts for x in pair):
            raise ValueError("experts must share one weight format")
        g0, d0 = experts[0]
        if g0.out_features % 2 or d0.in_features * 2 != g0.out_features:
            raise ValueError("gate_up must be [2*I, hidden] and down [hidden, I]")
        e, hidden, inter = len(experts), g0.in_features, d0.in_features
        order = torch.stack([torch.arange(inter), torch.arange(inter) + inter], 1).reshape(-1)

        def st(lins: list[Linear]) -> tuple[torch.Tensor, torch.Tensor]:
            if fmt == "q4":
                parts = [triton_q4.repacked_arrays(x) for x in lins]
            else:
                parts = [weight_args(to_gpu_format(x))[:2] for x in lins]
            return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])

        gu = st([_select_rows(g, order.to(g.device)) for g, _ in experts])
        down = st([d for _, d in experts])
        if fmt != "q4":
            return cls(fmt, e, hidden, inter, gu, down)
        dev = gu[0].device
        gs = split_count(2 * inter, hidden, tile, EXPERT_PROGRAMS)
        ds = split_count(hidden, inter, tile, EXPERT_PROGRAMS)
        tickets = lambda n: torch.zeros(e * triton.cdiv(n, tile.bn), dtype=torch.int32, device=dev)  # noqa: E731
        return cls(fmt, e, hidden, inter, gu, down, gs, ds, tickets(2 * inter), tickets(hidden),
                   tile)

    @property
    def nbytes(self) -> int:
        seen = {t.data_ptr(): t for t in self.gu + self.down}
        return sum(t.numel() * t.element_size() for t in seen.values())

    def expert_nbytes(self) -> int:
        return self.nbytes // self.num_experts


def _select_rows(lin: Linear, order: torch.Tensor) -> Linear:
    """The Linear with its output rows in `order` (any storage format before GPU placement)."""
    if lin.fmt == "f32":
        return Linear.dense(lin.weight[order])
    if lin.fmt == "q8":
        return Linear.q8(lin.qs[order], lin.scale[order])
    return Linear.q4(lin.qs[order], lin.scale[order], lin.minv[order])


# ---- device code ------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["T"])
def _topk_kernel(logits_ptr, ids_ptr, wts_ptr, T, E, stride_l, TOPK: tl.constexpr,
                 NORM: tl.constexpr, BM: tl.constexpr, E_PAD: tl.constexpr):
    """Per row: softmax over E logits, the top-k in descending order (ties to the lower id),
    renormalized over the k when NORM (the sum in rank order)."""
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
                      E_PAD: tl.constexpr, SCAN: tl.constexpr):
    """Program e: if expert e is routed to, it is slot r = (number of active experts below e):
    meta[1 + 2r] = e, meta[2 + 2r] = its assignment count, rows[r, :count] = its assignments in
    increasing order; the last active expert writes meta[0] = number of active experts."""
    e = tl.program_id(0)
    ev = tl.arange(0, E_PAD)
    counts = tl.zeros((E_PAD,), tl.int32)
    for c0 in range(0, TK, SCAN):
        a = c0 + tl.arange(0, SCAN)
        ids = tl.load(ids_ptr + a, mask=a < TK, other=-1)
        counts += tl.sum((ids[None, :] == ev[:, None]).to(tl.int32), axis=1)
    mine = tl.sum(tl.where(ev == e, counts, 0), axis=0)
    if mine > 0:
        active = counts > 0
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


@triton.jit
def _slot(meta_ptr):
    """(expert, count) of this program's slot; count 0 when the slot is unused."""
    slot = tl.program_id(0)
    used = slot < tl.load(meta_ptr)
    expert = tl.load(meta_ptr + 1 + 2 * slot, mask=used, other=0)
    count = tl.load(meta_ptr + 2 + 2 * slot, mask=used, other=0)
    return expert, count


@triton.jit
def _slot_ptrs(w_ptr, s_ptr, arows_ptr, expert, stride_we, stride_se, T):
    """The expert's weight and scale bases, and this slot's assignment list."""
    e = expert.to(tl.int64)
    arows = arows_ptr + tl.program_id(0).to(tl.int64) * T
    return w_ptr + e * stride_we, s_ptr + e * stride_se, arows


@triton.jit
def _slot_rows(arows, m0, count, BM: tl.constexpr):
    """Assignments m0 .. m0 + BM of the slot (valid where < count)."""
    valid = m0 + tl.arange(0, BM) < count
    return tl.load(arows + m0 + tl.arange(0, BM), mask=valid, other=0), valid


@triton.jit
def _expert_rows(x_ptr, rows, valid, stride_x, w_e, s_e, n0, n_mask, N, K, k_lo, k_hi, stride_w,
                 stride_s, FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, ASM: tl.constexpr):
    """[BM, BN] = x[rows] @ W_e[n0 : n0 + BN].T over k in [k_lo, k_hi) (f32/q8: all of K)."""
    if FMT == 1:
        acc = q4_rows(x_ptr, rows, valid, stride_x, w_e, s_e, n0, n_mask, N, k_lo, k_hi, BM, BN,
                      BK // 32, ASM)
    else:
        acc = rows_times_w(x_ptr, rows, valid, stride_x, w_e, s_e, n0, n_mask, K, stride_w,
                           stride_s, tl.zeros((BM, BN), tl.float32), FMT, BN, BK)
    return acc


@triton.jit(do_not_specialize=["T", "TK"])
def _moe_gate_up_kernel(x_ptr, meta_ptr, arows_ptr, w_ptr, s_ptr, inter_ptr, ws_ptr, tickets_ptr,
                        T, TK, I, K, stride_x, stride_we, stride_w, stride_se, stride_s,
                        stride_inter, FMT: tl.constexpr, TOPK: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr, S: tl.constexpr, ASM: tl.constexpr):
    """inter[a, j] = silu(x[t] . Wg[e, j]) * (x[t] . Wu[e, j]) for the slot's assignments a
    (t = a // k); the tile's BN interleaved gate/up rows give BN // 2 outputs j. With S > 1
    K splits, partials go through ws [S, T*k, 2I] and the last split program finishes."""
    expert, count = _slot(meta_ptr)
    if count == 0:
        return
    pid_n = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < 2 * I
    cols = pid_n * (BN // 2) + tl.arange(0, BN // 2)
    w_e, s_e, arows = _slot_ptrs(w_ptr, s_ptr, arows_ptr, expert, stride_we, stride_se, T)
    k_lo, k_hi = split_range(K, tl.program_id(2), S, BK)
    split_stride = TK.to(tl.int64) * (2 * I)
    ticket = tl.program_id(0) * tl.num_programs(1) + pid_n
    last = True
    if S > 1:
        for m0 in range(0, count, BM):
            rows, valid = _slot_rows(arows, m0, count, BM)
            acc = _expert_rows(x_ptr, rows // TOPK, valid, stride_x, w_e, s_e, pid_n * BN, n_mask,
                               2 * I, K, k_lo, k_hi, stride_w, stride_s, FMT, BM, BN, BK, ASM)
            split_store(acc, ws_ptr, rows.to(tl.int64)[:, None] * (2 * I) + offs_n[None, :],
                        valid[:, None] & n_mask[None, :], split_stride)
        last = split_ticket(tickets_ptr, ticket, S)
    if last:
        for m0 in range(0, count, BM):
            rows, valid = _slot_rows(arows, m0, count, BM)
            if S > 1:
                acc = split_load_sum(ws_ptr, rows.to(tl.int64)[:, None] * (2 * I) + offs_n[None, :],
                                     valid[:, None] & n_mask[None, :], split_stride, S)
            else:
                acc = _expert_rows(x_ptr, rows // TOPK, valid, stride_x, w_e, s_e, pid_n * BN,
                                   n_mask, 2 * I, K, 0, K, stride_w, stride_s, FMT, BM, BN, BK, ASM)
            g, u = tl.split(tl.reshape(acc, (BM, BN // 2, 2)))
            h = g / (1.0 + tl.exp(-g)) * u
            dst = inter_ptr + rows.to(tl.int64)[:, None] * stride_inter + cols[None, :]
            tl.store(dst, h.to(inter_ptr.dtype.element_ty), mask=valid[:, None] & (cols < I)[None, :])
        if S > 1:
            split_release(tickets_ptr, ticket)


@triton.jit(do_not_specialize=["T", "TK", "stride_y"])
def _moe_down_kernel(inter_ptr, meta_ptr, arows_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, tickets_ptr, T, TK,
                     N, K, stride_inter, stride_we, stride_w, stride_se, stride_s, stride_y,
                     FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     S: tl.constexpr, ASM: tl.constexpr):
    """y[a, n] = inter[a] . Wd[e, n] for the slot's assignments a (splits as in gate_up)."""
    expert, count = _slot(meta_ptr)
    if count == 0:
        return
    pid_n = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    w_e, s_e, arows = _slot_ptrs(w_ptr, s_ptr, arows_ptr, expert, stride_we, stride_se, T)
    k_lo, k_hi = split_range(K, tl.program_id(2), S, BK)
    split_stride = TK.to(tl.int64) * N
    ticket = tl.program_id(0) * tl.num_programs(1) + pid_n
    last = True
    if S > 1:
        for m0 in range(0, count, BM):
            rows, valid = _slot_rows(arows, m0, count, BM)
            acc = _expert_rows(inter_ptr, rows, valid, stride_inter, w_e, s_e, pid_n * BN, n_mask,
                               N, K, k_lo, k_hi, stride_w, stride_s, FMT, BM, BN, BK, ASM)
            split_store(acc, ws_ptr, rows.to(tl.int64)[:, None] * N + offs_n[None, :],
                        valid[:, None] & n_mask[None, :], split_stride)
        last = split_ticket(tickets_ptr, ticket, S)
    if last:
        for m0 in range(0, count, BM):
            rows, valid = _slot_rows(arows, m0, count, BM)
            offs = rows.to(tl.int64)[:, None] * N + offs_n[None, :]
            mask = valid[:, None] & n_mask[None, :]
            if S > 1:
                acc = split_load_sum(ws_ptr, offs, mask, split_stride, S)
            else:
                acc = _expert_rows(inter_ptr, rows, valid, stride_inter, w_e, s_e, pid_n * BN,
                                   n_mask, N, K, 0, K, stride_w, stride_s, FMT, BM, BN, BK, ASM)
            tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_y + offs_n[None, :], acc, mask=mask)
        if S > 1:
            split_release(tickets_ptr, ticket)


@triton.jit(do_not_specialize=["stride_y", "stride_res", "stride_out"])
def _moe_combine_kernel(y_ptr, wts_ptr, res_ptr, out_ptr, N, stride_y, stride_res, stride_out,
                        TOPK: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = (res[t] +) sum_r w[t, r] * y[t*k + r], the sum in rank order."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = n < N
    acc = tl.load(y_ptr + (t * TOPK) * stride_y + n, mask=mask, other=0.0) * tl.load(wts_ptr + t * TOPK)
    for r in tl.static_range(1, TOPK):
        w = tl.load(wts_ptr + t * TOPK + r)
        acc = acc + tl.load(y_ptr + (t * TOPK + r) * stride_y + n, mask=mask, other=0.0) * w
    if HAS_RES:
        acc = tl.load(res_ptr + t * stride_res + n, mask=mask, other=0.0) + acc
    tl.store(out_ptr + t * stride_out + n, acc, mask=mask)


# ---- host side --------------------------------------------------------------------------------
def route(x: torch.Tensor, router: Linear, top_k: int, norm_topk_prob: bool,
          ids: torch.Tensor, wts: torch.Tensor, logits: torch.Tensor | None = None) -> None:
    """ids [T, k] int32, wts [T, k] float32 ← top-k of softmax(x @ router.T), rank order."""
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
    bm = 4
    _topk_kernel[(triton.cdiv(t, bm),)](logits, ids, wts, t, e, logits.stride(0), TOPK=top_k,
                                        NORM=norm_topk_prob, BM=bm,
                                        E_PAD=max(16, triton.next_power_of_2(e)), num_warps=2)


def experts_forward(x: torch.Tensor, ids: torch.Tensor, experts: StackedExperts,
                    inter: torch.Tensor, y: torch.Tensor, tile: TileConfig | None = None) -> None:
    """y [T*k, hidden] ← expert(ids[t, r]) applied to x[t], row a = t*k + r; inter [T*k, I]
    (float16 for q4/q8 experts: the down GEMM rounds it to fp16 anyway, so the bits are the
    same and its bytes half). q4 experts run the tile they were stacked for; tile is the
    f32/q8 one. Tokens go CHUNK_TOKENS per pass (a token's bits do not depend on its pass)."""
    t, top_k = ids.shape
    if (inter.shape[0], y.shape[0]) != (t * top_k, t * top_k):
        raise ValueError("inter [T*k, I] and y [T*k, hidden] expected")
    for t0 in range(0, max(t, 1), CHUNK_TOKENS):
        t1 = min(t, t0 + CHUNK_TOKENS)
        _experts_pass(x[t0:t1], ids[t0:t1], experts, inter[t0 * top_k:t1 * top_k],
                      y[t0 * top_k:t1 * top_k], tile)


def _experts_pass(x: torch.Tensor, ids: torch.Tensor, experts: StackedExperts,
                  inter: torch.Tensor, y: torch.Tensor, tile: TileConfig | None) -> None:
    t, top_k = ids.shape
    tk = t * top_k
    check_x(x, experts.hidden)
    if inter.shape != (tk, experts.inter) or y.shape != (tk, experts.hidden):
        raise ValueError("inter [T*k, I] and y [T*k, hidden] expected")
    if y.dtype != torch.float32 or not y.is_contiguous() or not inter.is_contiguous():
        raise ValueError("inter and y must be contiguous, y float32")
    if inter.dtype != inter_dtype(experts):
        raise ValueError(f"inter must be {inter_dtype(experts)} for {experts.fmt} experts")
    if tk == 0:
        return
    tile = experts.tile if experts.fmt == "q4" else tile or EXPERT_TILE
    fmt = FMT_CODES[experts.fmt]
    dev = x.device
    slots = min(experts.num_experts, tk)  # at most this many experts are routed to
    meta = torch.empty(1 + 2 * slots, dtype=torch.int32, device=dev)
    arows = torch.empty(slots, t, dtype=torch.int32, device=dev)  # an expert: <= 1 per token
    _moe_align_kernel[(experts.num_experts,)](
        ids, meta, arows, tk, t, TOPK=top_k, E_PAD=max(16, triton.next_power_of_2(experts.num_experts)),
        SCAN=SCAN, num_warps=4)
    asm = triton_q4.use_asm(x)

    def scratch(split: int, n: int, tickets):
        if split == 1:
            return y, y  # never touched
        return torch.empty(split, tk, n, dtype=torch.float32, device=dev), tickets

    def strides(w, s):  # (expert, row) strides of the f32/q8 stacks; q4 kernels ignore the row ones
        return w.stride(0), w.stride(1), s.stride(0), s.stride(1) if s.dim() == 3 else 0

    launch = dict(BM=tile.bm, BN=tile.bn, BK=tile.bk, ASM=asm, num_warps=tile.warps,
                  num_stages=tile.stages)
    w, s = experts.gu
    ws, tickets = scratch(experts.gu_split, 2 * experts.inter, experts.gu_tickets)
    _moe_gate_up_kernel[(slots, triton.cdiv(2 * experts.inter, tile.bn), experts.gu_split)](
        x, meta, arows, w, s, inter, ws, tickets, t, tk, experts.inter, experts.hidden,
        x.stride(0), *strides(w, s), inter.stride(0), FMT=fmt, TOPK=top_k,
        S=experts.gu_split, **launch)
    w, s = experts.down
    ws, tickets = scratch(experts.down_split, experts.hidden, experts.down_tickets)
    _moe_down_kernel[(slots, triton.cdiv(experts.hidden, tile.bn), experts.down_split)](
        inter, meta, arows, w, s, y, ws, tickets, t, tk, experts.hidden, experts.inter,
        inter.stride(0), *strides(w, s), y.stride(0), FMT=fmt, S=experts.down_split, **launch)


def inter_dtype(experts: StackedExperts) -> torch.dtype:
    return torch.float32 if experts.fmt == "f32" else torch.float16


def combine(y: torch.Tensor, wts: torch.Tensor, out: torch.Tensor,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, hidden] = (residual +) sum over ranks of wts[t, r] * y[t*k + r]."""
    t, top_k = wts.shape
    n = y.shape[1]
    if y.shape != (t * top_k, n) or out.shape != (t, n) or not y.is_contiguous():
        raise ValueError("combine: y [T*k, N] contiguous, out [T, N]")
    if residual is not None and residual.shape != out.shape:
        raise ValueError("combine: residual like out")
    if t:
        res = residual if residual is not None else out
        block = 1024
        _moe_combine_kernel[(t, triton.cdiv(n, block))](
            y, wts, res, out, n, y.stride(0), res.stride(0), out.stride(0), TOPK=top_k,
            HAS_RES=residual is not None, BLOCK=block)
    return out


# ---- float64 reference (tests) ----------------------------------------------------------------
def moe_reference(x: torch.Tensor, router: Linear, experts: tuple[tuple[Linear, Linear], ...],
                  top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [T, k], weights [T, k], out [T, hidden]) in float64 from the dequantized weights."""
    xd = x.double()
    probs = torch.softmax(router.reference(x), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(xd)
    for t in range(x.shape[0]):
        for r in range(top_k):
            gu, down = experts[int(ids[t, r])]
            h = gu.dequantize().double() @ xd[t]
            i = h.shape[0] // 2
            act = h[:i] * torch.sigmoid(h[:i]) * h[i:]
            out[t] += w[t, r] * (down.dequantize().double() @ act)
    return ids, w, out
