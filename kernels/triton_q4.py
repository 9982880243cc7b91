"""The q4 GEMM y = x @ W.T in Triton, on weights re-packed at load (kernels/q4_layout.py) for
the tensor cores, with a fixed split of K per weight shape. kernels/triton_moe.py runs the same
tile loop (`q4_rows`) and split-K steps for the experts.

The layout lets Triton load the raw bytes straight into the MMA operand layout (through shared
memory, pipelined) and dequantize there: on the GPU, 4 bytes → 8 fp16 values by one PRMT, one
shift, four LOP3 (the nibble ORed into the mantissa of 1024.0) and four half2 ops (inline PTX,
`_nibbles_asm`); in the interpreter the same exact integers 0..15 by plain Triton (`nibbles`).
Either way the weight is then q * scale + min in fp16 by the same Triton line, so both paths
give the same bits.

Split-K: K is cut into S equal runs of whole k steps, S = `q4_layout.split_count(N, K, tile)`, a
function of the weight's shape and the tile only — never of the batch. Each program stores
its fp32 partial; the last of a tile's S programs to arrive (a ticket counter, reset by that
program) sums the S partials in split order 0..S-1 and runs the epilogue. Which program
sums changes from run to run, the order of the sum never does: bitwise batch-invariant.

Many rows (`plan`): one program runs all S splits of its tile itself, each from zero, and sums
them in the same order (`q4_splits`), and the row tile widens (32 rows, still one warp of
mma.m16n8k16 per 16 rows): the same bits per row, without S x rows x N partials in memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import q4_layout, triton_pdl
from kernels.q4_layout import LINEAR_TILE, Q4Linear, Q4Tile
from kernels.triton_pdl import pdl_wait, prefetch_l2, stamp

PREFETCH_BLOCKS = tl.constexpr(8)  # 32-blocks of K prefetched before waiting (GPU_NOTES v7)
# the q4 K loops of weights that fill their tiles (`even`) without the k / column masks: the
# same loads, so the same bits. sm_90 SASS (Triton 3.6, a 64-key step of the one-warp tile):
# the linear 418 → 399 instructions, the seq experts 437 → 409, MID_TILE 408 → 390, the
# direct experts 426 → 399 (gate_up; GPU_NOTES v30's table). The default since v32 (H100,
# with INTER_F32: 64 streams +2.3% at context 128, +0.7-1.6% at 2,048; one stream unchanged; the
# engine's bitwise sets 13/13 under both); False: masked (bench/ab_modes.py `noeven`)
EVEN_STEPS = True


# ---- device code ------------------------------------------------------------------------------
@triton.jit
def nibbles(byt):
    """uint8 [16, BN] → (low, high) nibbles as exact fp16 0..15 (plain Triton)."""
    lo = ((byt & 0xF).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    hi = ((byt >> 4).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    return lo, hi


@triton.jit
def _nibbles_asm(byt):
    """nibbles in PTX: 4 bytes b0..b3 → PRMT to b0 b2 b1 b3, then (t & 0x000F000F) | 1024.0
    gives half2 (1024 + lo(b0), 1024 + lo(b1)); the high nibbles land as 1024 + 16 q and are
    scaled back by an exact fma (x/16 - 64)."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t, u, c0, c1, c2;
        mov.b32 c0, 0x64006400;
        mov.b32 c1, 0x2C002C00;
        mov.b32 c2, 0xD400D400;
        prmt.b32 t, $4, 0, 0x3120;
        shr.b32 u, t, 8;
        lop3.b32 $0, t, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 $1, u, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 $2, t, 0x00F000F0, 0x64006400, 0xEA;
        lop3.b32 $3, u, 0x00F000F0, 0x64006400, 0xEA;
        sub.f16x2 $0, $0, c0;
        sub.f16x2 $1, $1, c0;
        fma.rn.f16x2 $2, $2, c1, c2;
        fma.rn.f16x2 $3, $3, c1, c2;
        }
        """,
        constraints="=r,=r,=r,=r,r", args=[byt], dtype=(tl.float16, tl.float16),
        is_pure=True, pack=4)


@triton.jit
def _dequant(byt, s, m, ASM: tl.constexpr):
    """Bytes of a 32-block → its (low, high) nibbles' fp16 weights q * s + m (s, m broadcast
    over the block's 16 bytes)."""
    if ASM:
        lo, hi = _nibbles_asm(byt)
    else:
        lo, hi = nibbles(byt)
    return lo * s + m, hi * s + m


@triton.jit
def _q4_step(acc, xr, row_mask, w_tile, sm_tile, n_mask, N, k0, k_hi, NB: tl.constexpr,
             ASM: tl.constexpr, EVEN: tl.constexpr = False):
    """acc += the k step [k0, k0 + 32 NB) (the part below k_hi) of x @ W.T, block by block:
    xr [BM, 1] row pointers of x, w_tile [16, BN] / sm_tile [BN, 2] block 0's bytes / scales.
    EVEN: every block below k_hi and every column valid (the K split of whole steps, N a
    multiple of BN): the weight loads unmasked, x masked by row only — the same values."""
    j = tl.arange(0, 16)
    for b in tl.static_range(NB):
        kb = k0 + 32 * b
        blk = kb // 32
        if EVEN:
            byt = tl.load(w_tile + blk * (N * 16))
            s, m = tl.split(tl.load(sm_tile + blk * (N * 2)))
            xm = row_mask[:, None] & (j >= 0)[None, :]  # (j >= 0: all true, the [BM, 16] shape)
        else:
            live = (kb + j) < k_hi  # [16]: all true or all false (k_hi is a block edge)
            byt = tl.load(w_tile + blk * (N * 16), mask=n_mask[None, :] & live[:, None], other=0)
            s, m = tl.split(tl.load(sm_tile + blk * (N * 2),
                                    mask=n_mask[:, None] & (kb + tl.arange(0, 2) * 0 < k_hi)[None, :],
                                    other=0.0))
            xm = row_mask[:, None] & live[None, :]
        lo, hi = _dequant(byt, s[None, :], m[None, :], ASM)  # [16, BN]: k = kb + j, kb + 16 + j
        x_lo = tl.load(xr + (kb + j)[None, :], mask=xm, other=0.0).to(tl.float16)
        x_hi = tl.load(xr + (kb + 16 + j)[None, :], mask=xm, other=0.0).to(tl.float16)
        acc = tl.dot(x_lo, lo, acc)
        acc = tl.dot(x_hi, hi, acc)
    return acc


@triton.jit
def _q4_step_t(acc, xr, row_mask, w_tile, sm_tile, n_mask, N, k0, k_hi, NB: tl.constexpr,
               ASM: tl.constexpr, EVEN: tl.constexpr = False):
    """_q4_step with the weights as the MMA's A operand: acc [BN, BM] += W[:, k step] @ x[:, k
    step].T; xr [1, BM] row pointers of x, w_tile [BN, 16] / sm_tile [BN, 2] block 0's bytes /
    scales. The same fp16 weights and x, the same k16 products summed in the same k order."""
    j = tl.arange(0, 16)
    for b in tl.static_range(NB):
        kb = k0 + 32 * b
        blk = kb // 32
        if EVEN:
            byt = tl.load(w_tile + blk * (N * 16))
            s, m = tl.split(tl.load(sm_tile + blk * (N * 2)))
            xm = (j >= 0)[:, None] & row_mask[None, :]  # (all true in k: the [16, BM] shape)
        else:
            live = (kb + j) < k_hi  # [16]: all true or all false (k_hi is a block edge)
            byt = tl.load(w_tile + blk * (N * 16), mask=n_mask[:, None] & live[None, :], other=0)
            s, m = tl.split(tl.load(sm_tile + blk * (N * 2),
                                    mask=n_mask[:, None] & (kb + tl.arange(0, 2) * 0 < k_hi)[None, :],
                                    other=0.0))
            xm = live[:, None] & row_mask[None, :]
        lo, hi = _dequant(byt, s[:, None], m[:, None], ASM)  # [BN, 16]: k = kb + j, kb + 16 + j
        x_lo = tl.load(xr + (kb + j)[:, None], mask=xm, other=0.0).to(tl.float16)  # [16, BM]
        x_hi = tl.load(xr + (kb + 16 + j)[:, None], mask=xm, other=0.0).to(tl.float16)
        acc = tl.dot(lo, x_lo, acc)
        acc = tl.dot(hi, x_hi, acc)
    return acc


@triton.jit
def _q4_ptrs(x_ptr, x_rows, stride_x, w_ptr, sm_ptr, n0, BN: tl.constexpr):
    """(x row pointers [BM, 1], block 0's bytes [16, BN] k-major, its (scale, min) [BN, 2])."""
    n = n0 + tl.arange(0, BN)
    xr = x_ptr + x_rows[:, None] * stride_x
    w_tile = w_ptr + n[None, :] * 16 + tl.arange(0, 16)[:, None]
    sm_tile = sm_ptr + n[:, None] * 2 + tl.arange(0, 2)[None, :]
    return xr, w_tile, sm_tile


@triton.jit
def q4_rows(x_ptr, x_rows, row_mask, stride_x, w_ptr, sm_ptr, n0, n_mask, N, k_lo, k_hi,
            BM: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, ASM: tl.constexpr,
            SWAP: tl.constexpr = False, EVEN: tl.constexpr = False):
    """acc [BM, BN] fp32 = x[x_rows, k_lo:k_hi] @ W[n0 : n0 + BN, k_lo:k_hi].T, k in increasing
    order. x_rows [BM] are row indices (MoE gathers), masked rows read 0; x is float32 or
    float16 (rounded to fp16 either way). w_ptr/sm_ptr point at one weight's qs/sm.
    SWAP: the weights as the MMA's A operand, and acc is the transpose, [BN, BM]. EVEN: the
    k range whole k steps and N a multiple of BN (`even`): no k / column masks."""
    if SWAP:
        n = n0 + tl.arange(0, BN)
        xr = x_ptr + x_rows[None, :] * stride_x  # [1, BM]
        w_tile = w_ptr + n[:, None] * 16 + tl.arange(0, 16)[None, :]  # [BN, 16]
        sm_tile = sm_ptr + n[:, None] * 2 + tl.arange(0, 2)[None, :]
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, 32 * NB):
            acc = _q4_step_t(acc, xr, row_mask, w_tile, sm_tile, n_mask, N, k0, k_hi, NB, ASM, EVEN)
    else:
        xr, w_tile, sm_tile = _q4_ptrs(x_ptr, x_rows, stride_x, w_ptr, sm_ptr, n0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, 32 * NB):
            acc = _q4_step(acc, xr, row_mask, w_tile, sm_tile, n_mask, N, k0, k_hi, NB, ASM, EVEN)
    return acc


@triton.jit
def q4_splits(x_ptr, x_rows, row_mask, stride_x, w_ptr, sm_ptr, n0, n_mask, N, K,
              BM: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, S: tl.constexpr,
              ASM: tl.constexpr, SWAP: tl.constexpr = False, EVEN: tl.constexpr = False):
    """acc [BM, BN] fp32 = x[x_rows] @ W[n0 : n0 + BN].T over all of K, computed as the S split
    programs compute it (each split's partial from zero over its k range), the partials summed
    in split order 0..S-1 as split_load_sum does: the bits of the split-K path from one program,
    with no partials in memory and no ticket (S = 1: one pass over K). A loop per split: one
    loop over all of K (partials folded at the split edges) took more registers and measured
    12-30% slower at 8-64 tokens (GPU_NOTES v8). SWAP: as q4_rows, [BN, BM]."""
    if SWAP:
        total = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        total = tl.zeros((BM, BN), dtype=tl.float32)
    for sp in range(S):
        k_lo, k_hi = split_range(K, sp, S, 32 * NB)
        part = q4_rows(x_ptr, x_rows, row_mask, stride_x, w_ptr, sm_ptr, n0, n_mask, N, k_lo,
                       k_hi, BM, BN, NB, ASM, SWAP, EVEN)
        total = tl.where(sp == 0, part, total + part)  # p0 exactly, then + p1, + p2, ...
    return total


@triton.jit
def split_range(K, sp, S: tl.constexpr, BK: tl.constexpr):
    """[k_lo, k_hi) of split sp: S equal runs of whole k steps."""
    per = tl.cdiv(tl.cdiv(K, BK), S) * BK
    k_lo = sp * per
    return k_lo, tl.minimum(k_lo + per, K)


@triton.jit
def split_store(acc, ws_ptr, offs, mask, split_stride):
    """This program's split-K partial [BM, BN] → ws[split] + offs (ws: [S, rows, N] fp32)."""
    tl.store(ws_ptr + tl.program_id(2) * split_stride + offs, acc, mask=mask)


@triton.jit
def split_ticket(tickets_ptr, ticket, S: tl.constexpr):
    """True for the last of a tile's S programs to get here, after all S stored partials."""
    tl.debug_barrier()  # every thread's partial is written before the ticket is taken
    return tl.atomic_add(tickets_ptr + ticket, 1, sem="acq_rel") == S - 1


@triton.jit
def split_load_sum(ws_ptr, offs, mask, split_stride, S: tl.constexpr):
    """Sum of the S partials at offs, in split order 0..S-1 (the fixed merge order)."""
    total = tl.load(ws_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, S):
        total += tl.load(ws_ptr + s * split_stride + offs, mask=mask, other=0.0,
                         cache_modifier=".cg")
    return total


@triton.jit
def split_release(tickets_ptr, ticket):
    """The summing program resets the tile's counter for the next launch."""
    tl.atomic_xchg(tickets_ptr + ticket, 0)


@triton.jit
def output_tile(M, N, BM: tl.constexpr, BN: tl.constexpr):
    """This program's output tile of a GEMM grid (axis 0: row tiles, axis 1: column tiles):
    (pid_m, pid_n, rows [BM], columns [BN], row mask, column mask)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    return pid_m, pid_n, offs_m, offs_n, offs_m < M, offs_n < N


@triton.jit
def prefetch_weights(w_ptr, sm_ptr, n0, N, k_lo, k_hi, BN: tl.constexpr, BLOCKS: tl.constexpr):
    """Prefetch into L2 the q4 bytes and scales of rows n0 .. n0 + BN for the first BLOCKS
    32-blocks of k in [k_lo, k_hi): enough to cover the loop's start (its pipeline streams
    the rest; prefetching a long unsplit K, the lm_head's, measured 25% slower)."""
    lines = tl.arange(0, BN * 16 // 128)  # a block's BN*16 bytes of these rows: 128-byte lines
    sm_lines = tl.arange(0, BN * 4 // 128)  # its BN (scale, min) fp16 pairs
    for blk in range(k_lo // 32, tl.minimum(k_hi // 32, k_lo // 32 + BLOCKS)):
        prefetch_l2(w_ptr + blk * (N * 16) + n0 * 16 + lines * 128, n0 * 16 + lines * 128 < N * 16)
        prefetch_l2(sm_ptr + blk * (N * 2) + n0 * 2 + sm_lines * 64, n0 * 2 + sm_lines * 64 < N * 2)


@triton.jit(do_not_specialize=["M", "stride_res", "stride_y"])
def _q4_linear_kernel(x_ptr, w_ptr, sm_ptr, res_ptr, y_ptr, ws_ptr, tickets_ptr, trace_ptr, M, N,
                      K, stride_x, stride_res, stride_y, HAS_RES: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, NB: tl.constexpr, S: tl.constexpr, SEQ: tl.constexpr,
                      ASM: tl.constexpr, PDL: tl.constexpr, TRACE: tl.constexpr = False,
                      SWAP: tl.constexpr = False, EVEN: tl.constexpr = False):
    """SEQ: each program runs all S splits of its tile itself (q4_splits); else program
    (row tile, n-tile, split) runs one split and the last to arrive sums the S partials.
    SWAP: the weights as the MMA's A operand (the tile is computed transposed, [BN, BM]).
    TRACE: time stamps at entry, after the wait, after the K loop, after the ticket (and the
    partials' sum), at the end (kernels/triton_pdl.py `stamp`)."""
    stamp(trace_ptr, 0, TRACE)
    pid_m, pid_n, offs_m, offs_n, m_mask, n_mask = output_tile(M, N, BM, BN)
    k_lo, k_hi = split_range(K, tl.program_id(2), S, 32 * NB)
    if SEQ:
        k_lo, k_hi = 0, K
    if PDL:  # the weights stream into L2 while the previous kernel finishes
        if pid_m == 0:
            prefetch_weights(w_ptr, sm_ptr, pid_n * BN, N, k_lo, k_hi, BN, PREFETCH_BLOCKS)
    pdl_wait(PDL)
    stamp(trace_ptr, 1, TRACE)
    if SWAP:  # (row, column) of each accumulator element, in the accumulator's [BN, BM] shape
        mask = n_mask[:, None] & m_mask[None, :]
        rows = offs_m.to(tl.int64)[None, :]
        cols = offs_n[:, None]
    else:
        mask = m_mask[:, None] & n_mask[None, :]
        rows = offs_m.to(tl.int64)[:, None]
        cols = offs_n[None, :]
    last = True
    if SEQ:
        acc = q4_splits(x_ptr, offs_m, m_mask, stride_x, w_ptr, sm_ptr, pid_n * BN, n_mask, N, K,
                        BM, BN, NB, S, ASM, SWAP, EVEN)
    else:
        acc = q4_rows(x_ptr, offs_m, m_mask, stride_x, w_ptr, sm_ptr, pid_n * BN, n_mask, N,
                      k_lo, k_hi, BM, BN, NB, ASM, SWAP, EVEN)
        stamp(trace_ptr, 2, TRACE)
        offs = rows * N + cols
        split_stride = M.to(tl.int64) * N
        ticket = pid_m * tl.num_programs(1) + pid_n
        if S > 1:
            split_store(acc, ws_ptr, offs, mask, split_stride)
            last = split_ticket(tickets_ptr, ticket, S)
            if last:
                acc = split_load_sum(ws_ptr, offs, mask, split_stride, S)
                split_release(tickets_ptr, ticket)
            stamp(trace_ptr, 3, TRACE)
    if last:
        if HAS_RES:
            acc = tl.load(res_ptr + rows * stride_res + cols, mask=mask, other=0.0) + acc
        tl.store(y_ptr + rows * stride_y + cols, acc, mask=mask)
    stamp(trace_ptr, 4, TRACE)


# ---- host side --------------------------------------------------------------------------------
def even(n: int, k: int, bn: int, nb: int) -> bool:
    """Whether a q4 weight of n outputs and k inputs fills its tiles (BN columns, 32 NB keys a
    step) exactly: every K split (split_range: whole k steps) and every column tile in range,
    so the K loop needs no k or column masks (the EVEN constexpr)."""
    return n % bn == 0 and k % (32 * nb) == 0


def use_asm(t: torch.Tensor) -> bool:
    """Inline PTX on CUDA tensors; plain Triton where the interpreter runs (CPU tensors)."""
    return t.device.type == "cuda"


def plan(lin: Q4Linear, rows: int) -> tuple[Q4Tile, bool]:
    """(tile, seq) for `rows` rows of x through lin: SEQ_MIN_ROWS rows or more run each tile's
    K splits in one program (no partials in memory), WIDE_MIN_ROWS or more the wide row tile,
    and a small weight's split programs the swapped tile from SWAP_MIN_ROWS. All give every
    row the bits of the decode tile with parallel splits (the same MMA products per row, the
    same split ranges and merge order), so the choice may follow the batch."""
    seq = lin.split > 1 and rows >= q4_layout.SEQ_MIN_ROWS
    if (q4_layout.SWAP_MIN_ROWS is not None and q4_layout.SWAP_MIN_ROWS <= rows
            < q4_layout.SEQ_MIN_ROWS and lin.out_features < q4_layout.SWAP_MAX_N):
        return q4_layout.SWAP_TILE, seq
    return (q4_layout.WIDE_TILE if rows >= q4_layout.WIDE_MIN_ROWS else LINEAR_TILE), seq


def linear(lin: Q4Linear, x: torch.Tensor, out: torch.Tensor,
           residual: torch.Tensor | None = None, tile: Q4Tile | None = None,
           asm: bool | None = None, seq: bool | None = None,
           trace: torch.Tensor | None = None) -> torch.Tensor:
    """out [n, N] = x @ W.T (+ residual); x [n, K] float32 with contiguous rows; returns out.
    tile / seq: the row tile and whether a program runs all K splits (default: `plan`); the
    tile's BK must be the one the weight's split was counted in (LINEAR_TILE's).
    Rows go MAX_ROWS (parallel split programs: SPLIT_ROWS) per launch; a row's bits do not
    depend on which launch it is in.
    asm: the inline-PTX dequant (default: on CUDA); False runs the plain-Triton one (tests).
    trace: int64 [>= programs, 8], per-program time stamps (bench/gpu_timeline.py; one launch)."""
    asm = use_asm(x) if asm is None else asm
    n, big_n, k = x.shape[0], lin.out_features, lin.in_features
    auto_tile, auto_seq = plan(lin, n)
    tile = auto_tile if tile is None else tile
    seq = auto_seq if seq is None else seq and lin.split > 1
    if tile.nb != LINEAR_TILE.nb:  # the split ranges are counted in its k steps
        raise ValueError(f"q4 linear: tile {tile.name} does not match the split tile {LINEAR_TILE.name}")
    parallel = lin.split > 1 and not seq
    step = q4_layout.SPLIT_ROWS if parallel else q4_layout.MAX_ROWS
    if parallel and (lin.tickets is None or lin.tickets.numel() < step // tile.bm
                     * triton.cdiv(big_n, tile.bn)):
        raise ValueError("q4 linear: tickets sized for another tile")
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        xs, ys = x[r0:r1], out[r0:r1]
        res = residual[r0:r1] if residual is not None else ys
        ws = (torch.empty(lin.split, r1 - r0, big_n, dtype=torch.float32, device=x.device)
              if parallel else ys)
        grid = (triton.cdiv(r1 - r0, tile.bm), triton.cdiv(big_n, tile.bn), lin.split if parallel else 1)
        _q4_linear_kernel[grid](
            xs, lin.qs, lin.sm, res, ys, ws, lin.tickets if parallel else ys,
            ys if trace is None else trace, r1 - r0, big_n, k, xs.stride(0), res.stride(0),
            ys.stride(0), HAS_RES=residual is not None, BM=tile.bm, BN=tile.bn, NB=tile.nb,
            S=lin.split, SEQ=seq, ASM=asm, TRACE=trace is not None, SWAP=tile.swap,
            EVEN=EVEN_STEPS and even(big_n, k, tile.bn, tile.nb),
            num_warps=tile.warps, num_stages=tile.stages, **triton_pdl.launch(x))
    return out
