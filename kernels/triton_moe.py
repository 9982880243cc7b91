"""Mixture-of-experts in Triton: `moe` (the CUDA op of kernels/ops.py) routes (router GEMM,
then top-k), groups the assignments by expert (kernels/triton_moe_route.py), runs the grouped
expert GEMMs of this file over the tokens routed to each expert, then combines in rank order.

Program (slot, n-tile) of an expert kernel walks its slot's assignments BM rows at a time,
gathering the rows of x. q4 experts run the re-packed q4 GEMM (kernels/triton_q4.py) with a
fixed K split per expert shape: program (slot, n-tile, split) stores the partials of all the
slot's rows, and the last split program of (slot, n-tile) sums them in split order and runs the
epilogue (SiLU·up, or the down projection's store). From SEQ_MIN_TOKENS tokens one program
runs all S splits of its tile instead (`q4_splits`: the same bits, no partials in memory).
Up to DIRECT_MAX_TOKENS tokens the grouping is skipped: slot a is assignment a, its expert
read from the top-k ids (one row per program; the same bits, no align kernel). From
DENSE_MIN_TOKENS tokens (prefill) the experts are dequantized once per call and run on
many-warp fp16 tiles (kernels/triton_f16.py; the same bits again).
f32/q8 experts run the f32/q8 loop of kernels/triton_linear.py unsplit.

Batch invariance: a row's GEMM result depends only on its own x row and the expert's weights
(fixed tile config, a split count fixed by the expert's shape, rows of a tile never interact),
and the k contributions of a token are summed in rank order by the combine kernel — whatever
other tokens are routed where.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from kernels import q4_layout, triton_f16, triton_moe_route, triton_pdl, triton_q4
from kernels.linear import Linear
from kernels.moe_layout import StackedExperts, inter_dtype
from kernels.q4_layout import Q4Tile
from kernels.triton_linear import FMT_CODES, TileConfig, check_x, rows_times_w
from kernels.triton_moe_route import combine_block
from kernels.triton_pdl import globaltimer, pdl_wait, stamp_row
from kernels.triton_f16 import f16_splits
from kernels.triton_q4 import (prefetch_weights, q4_rows, q4_splits, split_load_sum, split_range,
                               split_release, split_store, split_ticket)

EXPERT_TILE = TileConfig(bm=16, bn=32, bk=128, warps=4, stages=2)  # f32/q8 experts
FMT_F16 = 3  # q4 experts dequantized once per call (kernels/triton_f16.py `dequantize`)
# from this many tokens on CUDA q4 experts are dequantized once per call into fp16 W.T and run
# on many-warp fp16 tiles (kernels/triton_f16.py): the same bits. None: off. (tile, FLAT of
# f16_splits: 0 a loop per split, u one loop over K with u k steps an iteration): gate_up
# 128 x 128 on 8 warps, a loop per split; down, whose K splits are 3 k steps each, 64 x 128 on
# 4 warps in one loop (H200, 4,096 tokens: 694 and 674 µs, GPU_NOTES v10; down with u = 3, a
# loop iteration per split, is unmeasured)
DENSE_MIN_TOKENS: int | None = 512
DENSE_GATE_UP = (Q4Tile(bm=128, bn=128, nb=2, warps=8, stages=4), 0)
DENSE_DOWN = (Q4Tile(bm=64, bn=128, nb=2, warps=4, stages=4), 1)
CHUNK_TOKENS = 512  # tokens per pass of split programs: bounds their split-K partials
# from this many tokens one program runs all K splits of its q4 expert tile (no partials in
# memory), and from WIDE_MIN_TOKENS the row tile widens: the same bits, so free thresholds
SEQ_MIN_TOKENS = 8
WIDE_MIN_TOKENS = 256
# up to this many tokens each assignment is its own slot (its expert read from the top-k ids):
# no grouping kernel, one dependent load less before the weights. A row's bits do not depend
# on which rows share its program, so the choice is free; an expert two tokens chose is then
# read twice (from L2 the second time, mostly). H200, experts alone: -28% at 1 token, -25% at
# 4, -10% at 8, +9% at 16 (GPU_NOTES v9)
DIRECT_MAX_TOKENS = 8
# grouped seq launches of up to this many tokens on CUDA run MID_TILE: 4 warps side by side on
# 256 outputs (each warp's 16 x 64 part is the decode tile's: the same bits on the MMA; the
# interpreter's numpy dot may move a last bit with the tile's width). H200, experts alone,
# against the one-warp tile: -11% at 9 tokens, -27% at 12, -15% at 16, -8% at 24, -2% at 32,
# even at 48-64 (GPU_NOTES v12). None: off
MID_TILE: Q4Tile | None = Q4Tile(bm=16, bn=256, nb=2, warps=4, stages=3)
MID_MAX_TOKENS = 32
# register cap of the one-program-per-tile (seq) expert kernels from MAXNREG_MIN_TOKENS tokens:
# 168 → 128 registers raises the one-warp programs an SM holds from 12 to 16 (shared memory
# allows 17), no spill in gate_up (Triton 3.9 offline). H200: experts -4% at 64 tokens, -5% at
# 16, +11% at 8; in an 8 x 512 prefill (wide tile) down -10% but gate_up +8%, so gate_up's wide
# tile runs uncapped (GPU_NOTES v9). Registers change no arithmetic, so no bit. None: off
SEQ_MAXNREG: int | None = 128
DOWN_MAXNREG: int | None = 128  # the down kernel's cap (offline at 128: 22 spill stores, 80 B)
MAXNREG_MIN_TOKENS = 16
# below SEQ_MIN_TOKENS direct tokens, gate_up, down and the combine in one launch
# (`_moe_fused_kernel`): programs claim work items in order — gate_up tiles, then down tiles,
# then combine blocks — and an item waits on counters for what it reads (a slot's merged
# gate_up tiles, a token's merged down tiles), so two kernel boundaries a layer go; each
# item runs the split programs' code, so the bits are the three kernels' (H100: equal, eager
# and in a graph with PDL). A first step of a persistent decode kernel (GPU_NOTES v16-v17),
# off: it loses. H100, context 128, 1 / 4 streams: 323.4 / 875.1 tok/s with the three
# kernels, 298.3 / 815.1 fused (GPU step 3.015 → 3.252 ms, +4.9 µs a layer); with claimed
# items (FUSED_STATIC off) 268.7 / 809.4. bench/moe_timeline.py: a slot's down items see
# their inputs 1.5-3.3 µs after its last gate_up tile (merge, release, poll); a bare flag costs
# 0.61 µs, a PDL kernel boundary 0.50-0.66 (bench/hop_latency.py)
FUSED = False
# the fused launch's program p runs item p (no claim counter: the hardware deals the items
# out evenly over the SMs; claims taken in arrival order piled gate_up tiles on some SMs,
# their last ending at 23 µs against 16) where the GPU holds all its programs at once (every
# wait then ends; `blocks_per_sm`); else items are claimed
FUSED_STATIC = True
# up to this many (direct) tokens on CUDA the experts run kernels/cuda_q4.py's CTA form
# (`experts_direct`: a CTA an assignment's column tile, its K splits a warp each, merged in
# shared memory; the direct split programs' bits), where it loads. H100, context 128, with the
# router's CTA form: 1 stream 373.4 → 379.1 tok/s; at 4 and 8 tokens it loses (939.4 / 1,443.6
# → 829.7 / 1,077.1 with 8; the MoE layer at 4 tokens 55.7 → 69.0 µs), so 1 (GPU_NOTES v18).
# None or 0: off (bench/ab_modes.py `ecudaN`)
CUDA_MAX_TOKENS: int | None = 1
# direct launches (up to DIRECT_MAX_TOKENS tokens) with PDL: before waiting on gate_up, each
# down program prefetches into L2 the first this-many 32-blocks of its expert's weight range
# (the expert read from the top-k ids, final by then: written two kernels back). A prefetch
# changes no arithmetic, so no bit. H100, engine, 1 / 8 streams at context 128: 318.0 / 1,372
# → 320.0 / 1,396 tok/s with 4 blocks (GPU step 3.086 → 3.050 ms), 16 blocks 316.5 / 1,365;
# gate_up guessing its expert from the router's logits as well (a rank-r top-k in its
# prologue) lost: 315.5 / 1,400 with 4 blocks, 305.3 / 1,325 with 16 (GPU_NOTES v16). None: off
PREFETCH_BLOCKS: int | None = 4
# q4 experts' intermediate silu(gate) * up in fp32 where the Triton expert kernels take it
# (not the CUDA one-token path, not the dense path): down rounds it to fp16 either way (round
# to nearest even, the value gate_up's fp16 store gave), so the same bits — and from an fp16
# input Triton's down copied x's A fragment into the MMA's registers before every MMA (sm_90
# SASS, Triton 3.6 and 3.9: a 64-key k step 481 → 438 instructions on the one-warp tile, 488
# → 408 on MID_TILE, 657 → 530 on the 32-row tile, 485 → 428 direct; the copies are
# IMAD.MOV.U32, 69-185 of them). The default since v32 (H100, with triton_q4.EVEN_STEPS: 64
# streams +2.3% at context 128, +0.7-1.6% at 2,048; the engine's bitwise sets 13/13 under both);
# False: fp16 everywhere (bench/ab_modes.py `nointer32`)
INTER_F32 = True


# ---- device code ------------------------------------------------------------------------------
@triton.jit
def _slot(meta_ptr, DIRECT: tl.constexpr):
    """(expert, count) of this program's slot; count 0 when the slot is unused. DIRECT: the
    slot is assignment a = program 0 itself, meta_ptr the ids [T*k]: expert ids[a], one row."""
    slot = tl.program_id(0)
    if DIRECT:
        return tl.load(meta_ptr + slot), 1
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
def _m_tiles(parallel: tl.constexpr, BM: tl.constexpr):
    """(first row, row step) of the slot's BM-row tiles this program finishes: all of them
    when grid axis 2 is the K split; else axis 2 deals the tiles out (a long prefill's busy
    expert runs on many programs, not one)."""
    if parallel:
        return 0, BM
    return tl.program_id(2) * BM, tl.num_programs(2) * BM


@triton.jit
def _slot_rows(arows, m0, count, BM: tl.constexpr, DIRECT: tl.constexpr):
    """Assignments m0 .. m0 + BM of the slot (valid where < count); DIRECT: the slot's one
    assignment, the program's own index."""
    valid = m0 + tl.arange(0, BM) < count
    if DIRECT:
        return tl.zeros((BM,), tl.int32) + tl.program_id(0), valid
    return tl.load(arows + m0 + tl.arange(0, BM), mask=valid, other=0), valid


@triton.jit
def _prefetch_expert(w_ptr, s_ptr, expert, stride_we, stride_se, n0, N, K, S: tl.constexpr,
                     BK: tl.constexpr, BN: tl.constexpr, parallel: tl.constexpr,
                     BLOCKS: tl.constexpr):
    """Prefetch into L2 the q4 bytes and scales this program will read first (its split's
    range, or all of K) of `expert`'s rows n0 .. n0 + BN."""
    if parallel:
        k_lo, k_hi = split_range(K, tl.program_id(2), S, BK)
    else:
        k_lo, k_hi = 0, K
    e = expert.to(tl.int64)
    prefetch_weights(w_ptr + e * stride_we, s_ptr + e * stride_se, n0, N, k_lo, k_hi, BN, BLOCKS)


@triton.jit
def _silu_up_store(acc, inter_ptr, rows, valid, cols, stride_inter, I, BM: tl.constexpr,
                   BN: tl.constexpr):
    """inter[rows, cols] = silu(gate) * up from a gate_up tile [BM, BN] of interleaved gate/up
    columns (BN // 2 outputs cols), in inter's dtype."""
    g, u = tl.split(tl.reshape(acc, (BM, BN // 2, 2)))
    h = g / (1.0 + tl.exp(-g)) * u
    dst = inter_ptr + rows.to(tl.int64)[:, None] * stride_inter + cols[None, :]
    tl.store(dst, h.to(inter_ptr.dtype.element_ty), mask=valid[:, None] & (cols < I)[None, :])


@triton.jit
def _expert_all(x_ptr, rows, valid, stride_x, w_e, s_e, n0, n_mask, N, K, stride_w, stride_s,
                FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                S: tl.constexpr, ASM: tl.constexpr, FLAT: tl.constexpr, EVEN: tl.constexpr = False):
    """[BM, BN] = x[rows] @ W_e[n0 : n0 + BN].T over all of K, in one program: q4 runs its S
    splits and sums them in split order (the bits of the split programs), and so does the
    dequantized q4 (FMT_F16); f32/q8 all of K. EVEN: q4's K loop without k / column masks."""
    if FMT == 1:
        acc = q4_splits(x_ptr, rows, valid, stride_x, w_e, s_e, n0, n_mask, N, K, BM, BN, BK // 32,
                        S, ASM, False, EVEN)
    elif FMT == 3:  # q4 experts dequantized for this call (fp16 W.T), x in fp16: q4's bits
        acc = f16_splits(x_ptr, rows, valid, stride_x, w_e, n0, n_mask, N, K, BM, BN, BK, S, FLAT)
    else:
        acc = rows_times_w(x_ptr, rows, valid, stride_x, w_e, s_e, n0, n_mask, K, stride_w,
                           stride_s, tl.zeros((BM, BN), tl.float32), FMT, BN, BK)
    return acc


@triton.jit(do_not_specialize=["T", "TK"])
def _moe_gate_up_kernel(x_ptr, meta_ptr, arows_ptr, w_ptr, s_ptr, inter_ptr, ws_ptr, tickets_ptr,
                        T, TK, I, K, stride_x, stride_we, stride_w, stride_se, stride_s,
                        stride_inter, FMT: tl.constexpr, TOPK: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr, S: tl.constexpr, SEQ: tl.constexpr,
                        DIRECT: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
                        FLAT: tl.constexpr = 0, EVEN: tl.constexpr = False):
    """inter[a, j] = silu(x[t] . Wg[e, j]) * (x[t] . Wu[e, j]) for the slot's assignments a
    (t = a // k); the tile's BN interleaved gate/up rows give BN // 2 outputs j. With S > 1
    K splits run by S programs (not SEQ), partials go through ws [S, T*k, 2I] and the last
    split program finishes; SEQ: one program runs the S splits (the same bits)."""
    pdl_wait(PDL)
    expert, count = _slot(meta_ptr, DIRECT)
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
    parallel: tl.constexpr = S > 1 and not SEQ
    last = True
    if parallel:
        for m0 in range(0, count, BM):
            rows, valid = _slot_rows(arows, m0, count, BM, DIRECT)
            acc = q4_rows(x_ptr, rows // TOPK, valid, stride_x, w_e, s_e, pid_n * BN, n_mask,
                          2 * I, k_lo, k_hi, BM, BN, BK // 32, ASM, False, EVEN)  # S > 1: q4 only
            split_store(acc, ws_ptr, rows.to(tl.int64)[:, None] * (2 * I) + offs_n[None, :],
                        valid[:, None] & n_mask[None, :], split_stride)
        last = split_ticket(tickets_ptr, ticket, S)
    if last:
        m_lo, m_step = _m_tiles(parallel, BM)
        for m0 in range(m_lo, count, m_step):
            rows, valid = _slot_rows(arows, m0, count, BM, DIRECT)
            if parallel:
                acc = split_load_sum(ws_ptr, rows.to(tl.int64)[:, None] * (2 * I) + offs_n[None, :],
                                     valid[:, None] & n_mask[None, :], split_stride, S)
            else:
                acc = _expert_all(x_ptr, rows // TOPK, valid, stride_x, w_e, s_e, pid_n * BN,
                                  n_mask, 2 * I, K, stride_w, stride_s, FMT, BM, BN, BK, S, ASM, FLAT,
                                  EVEN)
            _silu_up_store(acc, inter_ptr, rows, valid, cols, stride_inter, I, BM, BN)
        if parallel:
            split_release(tickets_ptr, ticket)


@triton.jit(do_not_specialize=["T", "TK", "stride_y"])
def _moe_down_kernel(inter_ptr, meta_ptr, arows_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, tickets_ptr, T, TK,
                     N, K, stride_inter, stride_we, stride_w, stride_se, stride_s, stride_y,
                     FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     S: tl.constexpr, SEQ: tl.constexpr, DIRECT: tl.constexpr, ASM: tl.constexpr,
                     PDL: tl.constexpr, FLAT: tl.constexpr = 0, PREFETCH: tl.constexpr = 0,
                     EVEN: tl.constexpr = False):
    """y[a, n] = inter[a] . Wd[e, n] for the slot's assignments a (splits as in gate_up).
    PREFETCH (direct, PDL): blocks of the slot's expert's weights prefetched before the wait
    (the top-k ids are final by then: this kernel starts after gate_up's wait on the top-k)."""
    if PREFETCH > 0:
        expert = tl.load(meta_ptr + tl.program_id(0), cache_modifier=".cg")
        _prefetch_expert(w_ptr, s_ptr, expert, stride_we, stride_se, tl.program_id(1) * BN, N, K,
                         S, BK, BN, S > 1 and not SEQ, PREFETCH)
    pdl_wait(PDL)
    expert, count = _slot(meta_ptr, DIRECT)
    if count == 0:
        return
    pid_n = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    w_e, s_e, arows = _slot_ptrs(w_ptr, s_ptr, arows_ptr, expert, stride_we, stride_se, T)
    k_lo, k_hi = split_range(K, tl.program_id(2), S, BK)
    split_stride = TK.to(tl.int64) * N
    ticket = tl.program_id(0) * tl.num_programs(1) + pid_n
    parallel: tl.constexpr = S > 1 and not SEQ
    last = True
    if parallel:
        for m0 in range(0, count, BM):
            rows, valid = _slot_rows(arows, m0, count, BM, DIRECT)
            acc = q4_rows(inter_ptr, rows, valid, stride_inter, w_e, s_e, pid_n * BN, n_mask,
                          N, k_lo, k_hi, BM, BN, BK // 32, ASM, False, EVEN)  # S > 1: q4 only
            split_store(acc, ws_ptr, rows.to(tl.int64)[:, None] * N + offs_n[None, :],
                        valid[:, None] & n_mask[None, :], split_stride)
        last = split_ticket(tickets_ptr, ticket, S)
    if last:
        m_lo, m_step = _m_tiles(parallel, BM)
        for m0 in range(m_lo, count, m_step):
            rows, valid = _slot_rows(arows, m0, count, BM, DIRECT)
            offs = rows.to(tl.int64)[:, None] * N + offs_n[None, :]
            mask = valid[:, None] & n_mask[None, :]
            if parallel:
                acc = split_load_sum(ws_ptr, offs, mask, split_stride, S)
            else:
                acc = _expert_all(inter_ptr, rows, valid, stride_inter, w_e, s_e, pid_n * BN,
                                  n_mask, N, K, stride_w, stride_s, FMT, BM, BN, BK, S, ASM, FLAT,
                                  EVEN)
            tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_y + offs_n[None, :], acc, mask=mask)
        if parallel:
            split_release(tickets_ptr, ticket)


@triton.jit
def _backoff(v, ASM: tl.constexpr):
    """A pause between two polls of a counter (nanosleep on the GPU; nothing interpreted)."""
    if ASM:
        v = tl.inline_asm_elementwise(asm="nanosleep.u32 64;\nmov.u32 $0, $1;", constraints="=r,r",
                                      args=[v], dtype=tl.int32, is_pure=False, pack=1)
    return v


@triton.jit
def _wait_then_count(cnt_ptr, target, readers, ASM: tl.constexpr):
    """Poll the counter (volatile loads with a pause; atomics measured the same: GPU_NOTES
    v17) until it reaches target (its producers' count), then count this reader in (acq_rel: the reads
    that follow see what the producers wrote); the last of `readers` readers resets it to 0
    for the next launch."""
    seen = tl.load(cnt_ptr, volatile=True)
    while seen < target:
        seen = tl.load(cnt_ptr + _backoff(seen, ASM) * 0, volatile=True)
    if tl.atomic_add(cnt_ptr, 1, sem="acq_rel") == target + readers - 1:
        tl.atomic_xchg(cnt_ptr, 0)


@triton.jit
def _fused_gate_up(item, x_ptr, ids_ptr, gw_ptr, gs_ptr, inter_ptr, gws_ptr, gtk_ptr, ready_ptr,
                   TK, I, H, stride_x, stride_gwe, stride_gse, stride_inter, TOPK: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SG: tl.constexpr,
                   ASM: tl.constexpr):
    """Gate_up item (slot, n-tile, split): `_moe_gate_up_kernel`'s split program (parallel,
    DIRECT); the tile's merge counts itself in the slot's ready counter."""
    NGT = tl.cdiv(2 * I, BN)
    a = item // (NGT * SG)
    pid_n = (item // SG) % NGT
    sp = item % SG
    rows = tl.zeros((BM,), tl.int32) + a
    valid = tl.arange(0, BM) < 1
    e = tl.load(ids_ptr + a).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < 2 * I
    k_lo, k_hi = split_range(H, sp, SG, BK)
    split_stride = TK.to(tl.int64) * (2 * I)
    offs = rows.to(tl.int64)[:, None] * (2 * I) + offs_n[None, :]
    mask = valid[:, None] & n_mask[None, :]
    acc = q4_rows(x_ptr, rows // TOPK, valid, stride_x, gw_ptr + e * stride_gwe,
                  gs_ptr + e * stride_gse, pid_n * BN, n_mask, 2 * I, k_lo, k_hi, BM, BN,
                  BK // 32, ASM)
    tl.store(gws_ptr + sp * split_stride + offs, acc, mask=mask)
    ticket = a * NGT + pid_n
    if split_ticket(gtk_ptr, ticket, SG):
        acc = split_load_sum(gws_ptr, offs, mask, split_stride, SG)
        cols = pid_n * (BN // 2) + tl.arange(0, BN // 2)
        _silu_up_store(acc, inter_ptr, rows, valid, cols, stride_inter, I, BM, BN)
        split_release(gtk_ptr, ticket)
        tl.debug_barrier()  # the slot's inter stores before its count
        tl.atomic_add(ready_ptr + a, 1, sem="release")


@triton.jit
def _fused_down(item, ids_ptr, dw_ptr, ds_ptr, inter_ptr, y_ptr, dws_ptr, dtk_ptr, ready_ptr,
                done_ptr, TK, I, H, stride_dwe, stride_dse, stride_inter, stride_y, trace_ptr,
                row, TOPK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                SG: tl.constexpr, SD: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr,
                TRACE: tl.constexpr):
    """Down item (slot, n-tile, split), once its slot's gate_up tiles are merged:
    `_moe_down_kernel`'s split program; the tile's merge counts itself in the token's done
    counter."""
    NGT = tl.cdiv(2 * I, BN)
    NDT = tl.cdiv(H, BN)
    a = item // (NDT * SD)
    pid_n = (item // SD) % NDT
    sp = item % SD
    e = tl.load(ids_ptr + a).to(tl.int64)  # (the top-k's, final before this launch)
    k_lo, k_hi = split_range(I, sp, SD, BK)
    if PREFETCH > 0:  # the weights into L2 while the slot's gate_up tiles finish
        prefetch_weights(dw_ptr + e * stride_dwe, ds_ptr + e * stride_dse, pid_n * BN, H, k_lo,
                         k_hi, BN, PREFETCH)
    _wait_then_count(ready_ptr + a, NGT, NDT * SD, ASM)
    stamp_row(trace_ptr, row, 1, TRACE)
    rows = tl.zeros((BM,), tl.int32) + a
    valid = tl.arange(0, BM) < 1
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < H
    split_stride = TK.to(tl.int64) * H
    offs = rows.to(tl.int64)[:, None] * H + offs_n[None, :]
    mask = valid[:, None] & n_mask[None, :]
    acc = q4_rows(inter_ptr, rows, valid, stride_inter, dw_ptr + e * stride_dwe,
                  ds_ptr + e * stride_dse, pid_n * BN, n_mask, H, k_lo, k_hi, BM, BN, BK // 32, ASM)
    tl.store(dws_ptr + sp * split_stride + offs, acc, mask=mask)
    ticket = a * NDT + pid_n
    if split_ticket(dtk_ptr, ticket, SD):
        acc = split_load_sum(dws_ptr, offs, mask, split_stride, SD)
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_y + offs_n[None, :], acc, mask=mask)
        split_release(dtk_ptr, ticket)
        tl.debug_barrier()  # the y stores before the token's count
        tl.atomic_add(done_ptr + a // TOPK, 1, sem="release")


@triton.jit
def _fused_combine(item, wts_ptr, res_ptr, out_ptr, y_ptr, done_ptr, I, H, stride_y, stride_res,
                   stride_out, trace_ptr, row, TOPK: tl.constexpr, BN: tl.constexpr,
                   CB: tl.constexpr, HAS_RES: tl.constexpr, ASM: tl.constexpr,
                   TRACE: tl.constexpr):
    """Combine item (token, column block), once the token's k rows of y are merged:
    `_moe_combine_kernel`'s program (y read from L2: other programs wrote it)."""
    NDT = tl.cdiv(H, BN)
    NCB = tl.cdiv(H, CB)
    t = item // NCB
    _wait_then_count(done_ptr + t, TOPK * NDT, NCB, ASM)
    stamp_row(trace_ptr, row, 1, TRACE)
    combine_block(y_ptr, wts_ptr, res_ptr, out_ptr, t.to(tl.int64),
                  (item % NCB) * CB + tl.arange(0, CB), H, stride_y, stride_res, stride_out, TOPK,
                  HAS_RES, ".cg")


@triton.jit(do_not_specialize=["T", "TK"])
def _moe_fused_kernel(x_ptr, ids_ptr, wts_ptr, res_ptr, out_ptr, gw_ptr, gs_ptr, dw_ptr, ds_ptr,
                      inter_ptr, y_ptr, gws_ptr, dws_ptr, gtk_ptr, dtk_ptr, sync_ptr, T, TK, E, I, H,
                      stride_x, stride_gwe, stride_gse, stride_dwe, stride_dse, stride_inter,
                      stride_y, stride_res, stride_out, trace_ptr, TOPK: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SG: tl.constexpr,
                      SD: tl.constexpr, CB: tl.constexpr, HAS_RES: tl.constexpr,
                      ASM: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
                      STATIC: tl.constexpr = False, TRACE: tl.constexpr = False):
    """The direct q4 experts of TK = T * TOPK assignments (slot a = assignment a, expert
    ids[a]) and their combine, one launch: each program claims the next work item — (slot,
    gate_up n-tile, split) items first, then (slot, down n-tile, split), then (token, column
    block) — so an item's inputs come from items claimed before it, all held by running
    programs: the waits end. STATIC: program p runs item p instead (the host launches it so
    only where every program is resident at once). Every item runs its kernel's split-program
    steps (the combine and the SiLU·up epilogue through the same helpers; the GPU test
    compares the bits). sync: [0] the claim counter, [1 + a] slot a's merged gate_up tiles,
    [1 + E + t] token t's merged down tiles; each reset by its last user. TRACE: per item,
    trace[item] = (claimed, inputs ready, done, entered, SM at 7) in global ns
    (bench/moe_timeline.py)."""
    if TRACE:
        entered = globaltimer()
    pdl_wait(PDL)
    n_gu = TK * tl.cdiv(2 * I, BN) * SG
    n_dn = TK * tl.cdiv(H, BN) * SD
    total = n_gu + n_dn + T * tl.cdiv(H, CB)
    if STATIC:  # item = program: every program resident at once (the host checks)
        item = tl.program_id(0)
    else:
        item = tl.atomic_add(sync_ptr, 1, sem="acq_rel")
        if item == total - 1:  # all claimed: free for the next launch
            tl.atomic_xchg(sync_ptr, 0)
    stamp_row(trace_ptr, item, 0, TRACE)
    if TRACE:
        tl.store(trace_ptr + item.to(tl.int64) * 8 + 3, entered)
    if item < n_gu:
        _fused_gate_up(item, x_ptr, ids_ptr, gw_ptr, gs_ptr, inter_ptr, gws_ptr, gtk_ptr,
                       sync_ptr + 1, TK, I, H, stride_x, stride_gwe, stride_gse, stride_inter,
                       TOPK, BM, BN, BK, SG, ASM)
    elif item < n_gu + n_dn:
        _fused_down(item - n_gu, ids_ptr, dw_ptr, ds_ptr, inter_ptr, y_ptr, dws_ptr, dtk_ptr,
                    sync_ptr + 1, sync_ptr + 1 + E, TK, I, H, stride_dwe, stride_dse,
                    stride_inter, stride_y, trace_ptr, item, TOPK, BM, BN, BK, SG, SD, ASM,
                    PREFETCH, TRACE)
    else:
        _fused_combine(item - n_gu - n_dn, wts_ptr, res_ptr, out_ptr, y_ptr, sync_ptr + 1 + E, I,
                       H, stride_y, stride_res, stride_out, trace_ptr, item, TOPK, BN, CB,
                       HAS_RES, ASM, TRACE)
    stamp_row(trace_ptr, item, 2, TRACE)


def fused_fits(t: int, top_k: int, experts: StackedExperts) -> bool:
    """Whether `moe` runs its experts and combine as one launch (FUSED)."""
    return (FUSED and experts.fmt == "q4" and experts.sync is not None and 0 < t < SEQ_MIN_TOKENS
            and t <= DIRECT_MAX_TOKENS and t * top_k <= experts.num_experts
            and experts.gu_split > 1 and experts.down_split > 1)


FUSED_COMBINE_BLOCK = 256  # columns of a combine item


def fused_items(t: int, top_k: int, experts: StackedExperts) -> tuple[int, int, int]:
    """(gate_up, down, combine) work items of the fused launch for t tokens, in item order."""
    tk, bn = t * top_k, experts.tile.bn
    return (tk * triton.cdiv(2 * experts.inter, bn) * experts.gu_split,
            tk * triton.cdiv(experts.hidden, bn) * experts.down_split,
            t * triton.cdiv(experts.hidden, FUSED_COMBINE_BLOCK))


def _fused(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, experts: StackedExperts,
           residual: torch.Tensor | None, trace: torch.Tensor | None = None) -> torch.Tensor:
    """The direct experts and the combine of `moe` in one launch (`_moe_fused_kernel`);
    trace: int64 [>= items, 8], the items' time stamps (bench/moe_timeline.py)."""
    t, top_k = ids.shape
    tk, dev, tile = t * top_k, x.device, experts.tile
    check_x(x, experts.hidden)
    inter = torch.empty(tk, experts.inter, dtype=inter_dtype(experts), device=dev)
    y = torch.empty(tk, experts.hidden, dtype=torch.float32, device=dev)
    out = torch.empty(t, experts.hidden, dtype=torch.float32, device=dev)
    gws = torch.empty(experts.gu_split, tk, 2 * experts.inter, dtype=torch.float32, device=dev)
    dws = torch.empty(experts.down_split, tk, experts.hidden, dtype=torch.float32, device=dev)
    res = residual if residual is not None else out
    cb = FUSED_COMBINE_BLOCK
    items = sum(fused_items(t, top_k, experts))
    (gw, gs), (dw, ds) = experts.gu, experts.down
    args = (x, ids, wts, res, out, gw, gs, dw, ds, inter, y, gws, dws, experts.gu_tickets,
            experts.down_tickets, experts.sync, t, tk, experts.num_experts, experts.inter,
            experts.hidden, x.stride(0), gw.stride(0), gs.stride(0), dw.stride(0), ds.stride(0),
            inter.stride(0), y.stride(0), res.stride(0), out.stride(0),
            out if trace is None else trace)
    opts = dict(TOPK=top_k, TRACE=trace is not None, BM=tile.bm, BN=tile.bn, BK=tile.bk,
                SG=experts.gu_split, SD=experts.down_split, CB=cb, HAS_RES=residual is not None,
                ASM=triton_q4.use_asm(x),
                PREFETCH=(PREFETCH_BLOCKS or 0) if triton_q4.use_asm(x) else 0,
                num_warps=tile.warps, num_stages=tile.stages, **triton_pdl.launch(x))
    if FUSED_STATIC and x.is_cuda:  # item = program where the GPU holds them all at once
        opts["STATIC"] = items <= _resident_programs(args, dict(opts, STATIC=True), x.device)
    _moe_fused_kernel[(items,)](*args, **opts)
    return out


_RESIDENT: dict = {}


def _resident_programs(args: tuple, opts: dict, device: torch.device) -> int:
    """How many programs of `_moe_fused_kernel` (these constexprs) the device holds at once,
    from the compiled kernel's registers and shared memory: a launch whose item is its
    program may wait on items only resident programs run."""
    key = (device.index, tuple(sorted((k, v) for k, v in opts.items() if k != "launch_pdl")))
    if key not in _RESIDENT:
        kern = _moe_fused_kernel.warmup(*args, grid=(1,), **opts)
        kern._init_handles()  # loads the module: its register count
        props = torch.cuda.get_device_properties(device)
        _RESIDENT[key] = props.multi_processor_count * blocks_per_sm(
            kern.n_regs, kern.metadata.shared, opts["num_warps"],
            getattr(props, "regs_per_multiprocessor", 65536),
            getattr(props, "shared_memory_per_multiprocessor", 233472),
            getattr(props, "max_threads_per_multi_processor", 2048))
    return _RESIDENT[key]


def blocks_per_sm(regs: int, shared: int, warps: int, sm_regs: int = 65536,
                  sm_shared: int = 233472, sm_threads: int = 2048, max_blocks: int = 32) -> int:
    """Programs of `warps` warps an SM holds at once (Hopper's limits by default): registers
    go to a warp in 8s a thread from one of the SM's 4 schedulers' quarter of the file (219 a
    thread: 2 warps a quarter, 8 an SM, not 65,536 // 7,168 = 9: a looping form of the fused
    launch that counted on 9 hung on the H100); shared memory with the 1 KB the system
    reserves a program."""
    warp_regs = -(-max(regs, 1) // 8) * 8 * 32
    by_regs = 4 * ((sm_regs // 4) // warp_regs) // warps
    by_smem = sm_shared // (shared + 1024) if shared else max_blocks
    return max(0, min(by_regs, by_smem, sm_threads // (32 * warps), max_blocks))


# ---- host side --------------------------------------------------------------------------------
def _fused_topk(x: torch.Tensor, t: int, top_k: int, experts: StackedExperts, router: Linear) -> bool:
    """Whether one token's route and experts take cuda_q4's fused experts with the top-k
    folded in (FUSED_TOPK and FUSED_EXPERTS, where the CUDA one-token experts run)."""
    if not x.is_cuda or t != 1:
        return False
    from kernels import cuda_q4
    return (cuda_q4.FUSED_TOPK and cuda_q4.FUSED_EXPERTS and _cuda_direct(x, t, top_k, experts)
            and cuda_q4.fused_fits(experts, x, t) and router.out_features <= cuda_q4.TOPK_MAX_E
            and top_k <= cuda_q4.TOPK_MAX_K)


def moe(x: torch.Tensor, router: Linear, experts: StackedExperts, top_k: int,
        norm_topk_prob: bool, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, hidden] f32 (, residual [T, hidden] f32) → [T, hidden] f32: (residual +) the top-k
    mixture of the stacked experts for each row, the k outputs summed in rank order."""
    t, dev = x.shape[0], x.device
    ids = torch.empty(t, top_k, dtype=torch.int32, device=dev)  # [T, k]
    wts = torch.empty(t, top_k, dtype=torch.float32, device=dev)  # [T, k]
    fold = _fused_topk(x, t, top_k, experts, router)  # the fused experts rank the logits
    logits = torch.empty(t, router.out_features, dtype=torch.float32, device=dev) if fold else None
    triton_moe_route.route(x, router, top_k, norm_topk_prob, ids, wts, logits, logits_only=fold)
    if not fold and fused_fits(t, top_k, experts):
        return _fused(x, ids, wts, experts, residual)
    inter = torch.empty(t * top_k, experts.inter, dtype=moe_inter_dtype(x, t, top_k, experts),
                        device=dev)  # [T*k, I]
    y = torch.empty(t * top_k, experts.hidden, dtype=torch.float32, device=dev)  # [T*k, hidden]
    if fold:  # (ids and wts: its outputs)
        from kernels import cuda_q4
        cuda_q4.experts_fused(x, ids, experts, inter, y, logits=logits, wts=wts, norm=norm_topk_prob)
    else:
        experts_forward(x, ids, experts, inter, y)
    out = torch.empty(t, experts.hidden, dtype=torch.float32, device=dev)
    return triton_moe_route.combine(y, wts, out, residual)


def prepare_experts(experts: tuple[tuple[Linear, Linear], ...], device: str) -> StackedExperts:
    """The (gate_up [2I, hidden], down [hidden, I]) Linears of a layer's experts, stacked on
    `device` for `moe`."""
    return StackedExperts.stack(tuple((g.to(device), d.to(device)) for g, d in experts))


def experts_forward(x: torch.Tensor, ids: torch.Tensor, experts: StackedExperts,
                    inter: torch.Tensor, y: torch.Tensor, tile: TileConfig | Q4Tile | None = None,
                    seq: bool | None = None, dense: bool | None = None,
                    flat: int | None = None) -> None:
    """y [T*k, hidden] ← expert(ids[t, r]) applied to x[t], row a = t*k + r; inter [T*k, I]
    (float16 for q4/q8 experts: the down GEMM rounds it to fp16 anyway, so the bits are the
    same and its bytes half; q4 experts off the CUDA one-token and dense paths take float32
    too, the same bits: `moe_inter_dtype`). tile: the f32/q8 TileConfig, or a q4 Q4Tile with
    the BK the experts were stacked for (default: theirs, its rows widened to WIDE_TILE's from
    WIDE_MIN_TOKENS tokens); seq: whether one program runs all K splits of a q4 expert tile
    (default: from SEQ_MIN_TOKENS tokens; on CUDA grouped seq launches of up to MID_MAX_TOKENS
    tokens take MID_TILE). Neither changes a bit (kernels/triton_q4.py
    `plan`). Split programs take the tokens CHUNK_TOKENS per pass (their partials are
    bounded; a token's bits do not depend on its pass); otherwise all go in one pass.
    dense: q4 experts dequantized once into fp16 and run on many-warp tiles (default: on CUDA
    from DENSE_MIN_TOKENS tokens), the same bits; `tile` and flat (the one-loop form), when
    given, replace both kernels' DENSE_GATE_UP / DENSE_DOWN (bench variants)."""
    t, top_k = ids.shape
    if (tile is None and seq is None and dense is None and inter.dtype == torch.float16
            and inter.shape == (t * top_k, experts.inter) and y.shape == (t * top_k, experts.hidden)
            and _cuda_direct(x, t, top_k, experts)):
        from kernels import cuda_q4
        cuda_q4.experts_direct(x, ids, experts, inter, y)  # the direct split programs' bits
        return
    if dense is None:
        dense = _dense(x, t, experts)
    if dense:
        gu, down = DENSE_GATE_UP, DENSE_DOWN
        if tile is not None or flat is not None:
            gu = down = (tile or gu[0], int(flat or 0))
        _experts_f16(x, ids, experts, inter, y, gu, down)
        return
    if (inter.shape[0], y.shape[0]) != (t * top_k, t * top_k):
        raise ValueError("inter [T*k, I] and y [T*k, hidden] expected")
    seq = seq if seq is not None else t >= SEQ_MIN_TOKENS
    parallel = not seq and experts.gu_split * experts.down_split > 1
    step = CHUNK_TOKENS if parallel else max(t, 1)
    for t0 in range(0, max(t, 1), step):
        t1 = min(t, t0 + step)
        _experts_pass(x[t0:t1], ids[t0:t1], experts, inter[t0 * top_k:t1 * top_k],
                      y[t0 * top_k:t1 * top_k], tile, seq)


def _cuda_direct(x: torch.Tensor, t: int, top_k: int, experts: StackedExperts) -> bool:
    """Whether experts_forward's default route for t tokens is kernels/cuda_q4.py's CTA form."""
    if not (CUDA_MAX_TOKENS and 0 < t <= min(CUDA_MAX_TOKENS, DIRECT_MAX_TOKENS)
            and t * top_k <= experts.num_experts and x.is_cuda):
        return False
    from kernels import cuda_q4
    return cuda_q4.experts_fit(experts, x)


def _dense(x: torch.Tensor, t: int, experts: StackedExperts) -> bool:
    """Whether experts_forward's default route for t tokens is the dense path."""
    return (experts.fmt == "q4" and x.device.type == "cuda" and DENSE_MIN_TOKENS is not None
            and t >= DENSE_MIN_TOKENS and experts.hidden % DENSE_GATE_UP[0].bk == 0
            and experts.inter % DENSE_DOWN[0].bk == 0)


def moe_inter_dtype(x: torch.Tensor, t: int, top_k: int, experts: StackedExperts) -> torch.dtype:
    """The intermediate's dtype for experts_forward's default route at t tokens: float32 for q4
    experts on the Triton kernels when INTER_F32 (the same bits), else inter_dtype's."""
    if (INTER_F32 and experts.fmt == "q4" and not _cuda_direct(x, t, top_k, experts)
            and not _dense(x, t, experts)):
        return torch.float32
    return inter_dtype(experts)


def _experts_pass(x: torch.Tensor, ids: torch.Tensor, experts: StackedExperts,
                  inter: torch.Tensor, y: torch.Tensor, tile, seq: bool) -> None:
    t, top_k = ids.shape
    tk = t * top_k
    check_x(x, experts.hidden)
    if inter.shape != (tk, experts.inter) or y.shape != (tk, experts.hidden):
        raise ValueError("inter [T*k, I] and y [T*k, hidden] expected")
    if y.dtype != torch.float32 or not y.is_contiguous() or not inter.is_contiguous():
        raise ValueError("inter and y must be contiguous, y float32")
    q4_f32 = experts.fmt == "q4" and inter.dtype == torch.float32  # (moe_inter_dtype)
    if inter.dtype != inter_dtype(experts) and not q4_f32:
        raise ValueError(f"inter must be {inter_dtype(experts)} for {experts.fmt} experts"
                         + (" (or float32)" if experts.fmt == "q4" else ""))
    if tk == 0:
        return
    fmt = FMT_CODES[experts.fmt]
    direct = t <= DIRECT_MAX_TOKENS and tk <= experts.num_experts
    if experts.fmt == "q4":
        if tile is None and seq and not direct and MID_TILE is not None and x.is_cuda \
                and t <= MID_MAX_TOKENS and MID_TILE.nb == experts.tile.nb:
            tile = MID_TILE
        tile = tile or (replace(experts.tile, bm=q4_layout.WIDE_TILE.bm)
                        if t >= WIDE_MIN_TOKENS else experts.tile)
        if tile.nb != experts.tile.nb:  # the split ranges are counted in its k steps
            raise ValueError(f"q4 experts: tile {tile.name} does not match their split tile")
    else:
        tile = tile or EXPERT_TILE
    dev = x.device
    if direct:  # a slot per assignment, read from ids: no grouping kernel on the critical path
        if ids.dtype != torch.int32 or not ids.is_contiguous():
            raise ValueError("ids: expected contiguous int32 [T, k]")
        meta = arows = ids
        slots = tk
    else:
        meta, arows = triton_moe_route.align(ids, experts.num_experts)
        slots = arows.shape[0]
    asm = triton_q4.use_asm(x)
    unmasked = experts.fmt == "q4" and triton_q4.EVEN_STEPS  # (where the weights fill their tiles)

    def scratch(split: int, n: int, tickets):
        if split == 1 or seq:
            return y, y  # never touched
        return torch.empty(split, tk, n, dtype=torch.float32, device=dev), tickets

    def splits(split: int) -> int:  # programs per (slot, n-tile): K splits, or row tiles
        if not seq and split > 1:
            return split
        # about twice an expert's average row tiles: a busy expert's tiles are dealt out
        return triton.cdiv(2 * tk, experts.num_experts * tile.bm) if t >= WIDE_MIN_TOKENS else 1

    def strides(w, s):  # (expert, row) strides of the f32/q8 stacks; q4 kernels ignore the row ones
        return w.stride(0), w.stride(1), s.stride(0), s.stride(1) if s.dim() == 3 else 0

    launch = dict(BM=tile.bm, BN=tile.bn, BK=tile.bk, ASM=asm, num_warps=tile.warps,
                  num_stages=tile.stages, **triton_pdl.launch(x))
    down_launch = launch
    if seq and t >= MAXNREG_MIN_TOKENS and x.device.type == "cuda":
        if DOWN_MAXNREG:
            down_launch = dict(launch, maxnreg=DOWN_MAXNREG)
        if SEQ_MAXNREG and tile.bm < q4_layout.WIDE_TILE.bm:
            launch = dict(launch, maxnreg=SEQ_MAXNREG)
    w, s = experts.gu
    ws, tickets = scratch(experts.gu_split, 2 * experts.inter, experts.gu_tickets)
    _moe_gate_up_kernel[(slots, triton.cdiv(2 * experts.inter, tile.bn), splits(experts.gu_split))](
        x, meta, arows, w, s, inter, ws, tickets, t, tk, experts.inter, experts.hidden,
        x.stride(0), *strides(w, s), inter.stride(0), FMT=fmt, TOPK=top_k,
        S=experts.gu_split, SEQ=seq, DIRECT=direct,
        EVEN=unmasked and triton_q4.even(2 * experts.inter, experts.hidden, tile.bn, tile.nb), **launch)
    # down's first weight blocks into L2 while gate_up runs (direct, PDL, q4)
    prefetch = (PREFETCH_BLOCKS or 0) if direct and launch["PDL"] and experts.fmt == "q4" else 0
    w, s = experts.down
    ws, tickets = scratch(experts.down_split, experts.hidden, experts.down_tickets)
    _moe_down_kernel[(slots, triton.cdiv(experts.hidden, tile.bn), splits(experts.down_split))](
        inter, meta, arows, w, s, y, ws, tickets, t, tk, experts.hidden, experts.inter,
        inter.stride(0), *strides(w, s), y.stride(0), FMT=fmt, S=experts.down_split, SEQ=seq,
        DIRECT=direct, PREFETCH=prefetch,
        EVEN=unmasked and triton_q4.even(experts.hidden, experts.inter, tile.bn, tile.nb),
        **down_launch)


def _experts_f16(x: torch.Tensor, ids: torch.Tensor, experts: StackedExperts,
                 inter: torch.Tensor, y: torch.Tensor, gu_cfg: tuple[Q4Tile, int],
                 down_cfg: tuple[Q4Tile, int]) -> None:
    """experts_forward through each weight dequantized for this call (fp16 W.T of all experts,
    kernels/triton_f16.py `dequantize`) and x rounded to fp16 once: the seq programs' split
    ranges and merge order on many-warp tiles ((tile, FLAT) per kernel), so the q4 tiles'
    bits."""
    t, top_k = ids.shape
    tk = t * top_k
    check_x(x, experts.hidden)
    if experts.fmt != "q4" or any(c[0].nb != experts.tile.nb for c in (gu_cfg, down_cfg)):
        raise ValueError(f"dense experts: q4 experts and tiles with BK {experts.tile.bk}")
    if inter.shape != (tk, experts.inter) or y.shape != (tk, experts.hidden) \
            or inter.dtype != torch.float16 or y.dtype != torch.float32 \
            or not (inter.is_contiguous() and y.is_contiguous()):
        raise ValueError("contiguous inter [T*k, I] float16 and y [T*k, hidden] float32 expected")
    triton_f16.check_unroll(gu_cfg[1], experts.hidden, experts.gu_split, gu_cfg[0])
    triton_f16.check_unroll(down_cfg[1], experts.inter, experts.down_split, down_cfg[0])
    if tk == 0:
        return
    meta, arows = triton_moe_route.align(ids, experts.num_experts)
    x16 = x.to(torch.float16)

    def grid(n: int, tile: Q4Tile):  # (slot, n-tile, about twice an expert's average row tiles)
        return arows.shape[0], triton.cdiv(n, tile.bn), triton.cdiv(2 * tk, experts.num_experts * tile.bm)

    def launch(tile: Q4Tile, flat: int) -> dict:
        return dict(FMT=FMT_F16, BM=tile.bm, BN=tile.bn, BK=tile.bk, SEQ=True, DIRECT=False,
                    ASM=False, FLAT=flat, num_warps=tile.warps, num_stages=tile.stages,
                    **triton_pdl.launch(x))

    i, h = experts.inter, experts.hidden
    gu = triton_f16.dequantize(*experts.gu)  # [E, hidden, 2I]
    _moe_gate_up_kernel[grid(2 * i, gu_cfg[0])](
        x16, meta, arows, gu, gu, inter, y, y, t, tk, i, h, x16.stride(0), gu.stride(0), 0, 0, 0,
        inter.stride(0), TOPK=top_k, S=experts.gu_split, **launch(*gu_cfg))
    del gu  # its memory serves down's weights
    down = triton_f16.dequantize(*experts.down)  # [E, I, hidden]
    _moe_down_kernel[grid(h, down_cfg[0])](
        inter, meta, arows, down, down, y, y, y, t, tk, h, i, inter.stride(0), down.stride(0),
        0, 0, 0, y.stride(0), S=experts.down_split, **launch(*down_cfg))


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
