"""The q4 GEMM for many rows: each weight dequantized once per call into fp16 W.T, then fp16
MMAs on a many-warp tile (wgmma on Hopper) instead of the one-warp q4 tile that dequantizes in
its loop (kernels/triton_q4.py). Prefill-sized batches are compute-bound, and there the one-warp
tile's mma.sync ran at ~120-185 TFLOP/s (GPU_NOTES v8).

The bits are the q4 tile's: `dequantize` computes each weight by the q4 tile's own line
(q * scale + min in fp16, one fused multiply-add on the GPU), x is rounded to fp16 as the q4
tile rounds it, and `f16_splits` runs the same K split ranges, k steps in increasing order (a
dot of BK = 64 is four MMAs of K = 16 chained in k order, as the q4 tile's two per 32-block)
and the same split-order merge. So the engine may choose it by batch size (`plan`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import q4_layout, triton_pdl
from kernels.q4_layout import LINEAR_TILE, Q4Linear, Q4Tile
from kernels.triton_pdl import pdl_wait
from kernels.triton_q4 import nibbles, output_tile, split_range

DEQUANT_BN = 128  # rows a dequantize program writes (16 KB of fp16 per 32-block)


# ---- device code ------------------------------------------------------------------------------
@triton.jit
def _dequant_kernel(qs_ptr, sm_ptr, out_ptr, N, K, BN: tl.constexpr, PDL: tl.constexpr):
    """out[e, 32 b + j, n] = W_e[n, 32 b + j]: program (b, n-tile, e) dequantizes 32-block b of
    BN rows by _q4_step's own line (q * scale + min in fp16), so the values are the ones the q4
    tile multiplies. It reads weights only, so it loads before its PDL wait; it stores after
    it (out may be memory the previous kernel still reads, freed to the allocator)."""
    blk = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    e = tl.program_id(2).to(tl.int64)
    n_mask = n < N
    j = tl.arange(0, 16)
    at = e * (K // 32) + blk
    byt = tl.load(qs_ptr + at * N * 16 + n[None, :] * 16 + j[:, None], mask=n_mask[None, :], other=0)
    s, m = tl.split(tl.load(sm_ptr + at * N * 2 + n[:, None] * 2 + tl.arange(0, 2)[None, :],
                            mask=n_mask[:, None], other=0.0))
    lo, hi = nibbles(byt)
    lo = lo * s[None, :] + m[None, :]  # [16, BN]: k = 32 b + j
    hi = hi * s[None, :] + m[None, :]  # k = 32 b + 16 + j
    dst = out_ptr + e * K * N + (blk * 32 + j)[:, None] * N + n[None, :]
    pdl_wait(PDL)
    tl.store(dst, lo, mask=n_mask[None, :])
    tl.store(dst + 16 * N, hi, mask=n_mask[None, :])


@triton.jit
def f16_splits(x_ptr, x_rows, row_mask, stride_x, wt_ptr, n0, n_mask, N, K, BM: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr, S: tl.constexpr, FLAT: tl.constexpr = 0):
    """q4_splits on the weight dequantized once (wt: fp16 W.T [K, N], `dequantize`) with x in
    fp16: the same split ranges, k steps in increasing order (a BK dot is BK/16 MMAs of K = 16
    chained in k order, as _q4_step's two per 32-block) and merge order, so on the GPU the
    same bits per row. FLAT = u >= 1: one loop over all of K, u k steps unrolled per iteration
    (u divides a split's k steps; u = all of them: the loop runs over the splits), each split's
    partial folded in at its edge (K is whole splits: split_count divides the k steps); 0: a
    loop per split."""
    kk = tl.arange(0, BK)
    xr = x_ptr + x_rows.to(tl.int64)[:, None] * stride_x + kk[None, :]
    wr = wt_ptr + kk[:, None] * N + (n0 + tl.arange(0, BN))[None, :]
    total = tl.zeros((BM, BN), dtype=tl.float32)
    if FLAT:
        per = tl.cdiv(tl.cdiv(K, BK), S) * BK
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK * FLAT):
            for u in tl.static_range(FLAT):
                a = tl.load(xr + k0 + u * BK, mask=row_mask[:, None], other=0.0)
                b = tl.load(wr + (k0 + u * BK) * N, mask=n_mask[None, :], other=0.0)
                acc = tl.dot(a, b, acc)
            edge = (k0 + BK * FLAT) % per == 0
            total = tl.where(edge, tl.where(k0 < per, acc, total + acc), total)
            acc = tl.where(edge, 0.0, acc)
    else:
        for sp in range(S):
            k_lo, k_hi = split_range(K, sp, S, BK)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(k_lo, k_hi, BK):
                a = tl.load(xr + k0, mask=row_mask[:, None], other=0.0)
                b = tl.load(wr + k0 * N, mask=n_mask[None, :], other=0.0)
                acc = tl.dot(a, b, acc)
            total = tl.where(sp == 0, acc, total + acc)  # p0 exactly, then + p1, + p2, ...
    return total


@triton.jit(do_not_specialize=["M", "stride_res", "stride_y"])
def _f16_linear_kernel(x_ptr, wt_ptr, res_ptr, y_ptr, M, N, K, stride_x, stride_res, stride_y,
                       HAS_RES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, S: tl.constexpr, FLAT: tl.constexpr, PDL: tl.constexpr):
    """y = x16 @ wt (+ res): the q4 linear's SEQ program on the dequantized weight."""
    pdl_wait(PDL)
    pid_m, pid_n, offs_m, offs_n, m_mask, n_mask = output_tile(M, N, BM, BN)
    acc = f16_splits(x_ptr, offs_m, m_mask, stride_x, wt_ptr, pid_n * BN, n_mask, N, K, BM, BN,
                     BK, S, FLAT)
    rows = offs_m.to(tl.int64)[:, None]
    mask = m_mask[:, None] & n_mask[None, :]
    if HAS_RES:
        acc = tl.load(res_ptr + rows * stride_res + offs_n[None, :], mask=mask, other=0.0) + acc
    tl.store(y_ptr + rows * stride_y + offs_n[None, :], acc, mask=mask)


# ---- host side --------------------------------------------------------------------------------
def dequantize(qs: torch.Tensor, sm: torch.Tensor) -> torch.Tensor:
    """fp16 W.T [..., K, N] of q4 weights qs [..., K/32, N, 16] / sm [..., K/32, N, 2] (one
    weight, or a stack of experts): exactly the fp16 values the q4 tile multiplies."""
    *lead, nblk, n, _ = qs.shape
    out = torch.empty(*lead, nblk * 32, n, dtype=torch.float16, device=qs.device)
    stack = out.numel() // (nblk * 32 * n)
    if qs.numel() >= 2 ** 31 or not (qs.is_contiguous() and sm.is_contiguous()):
        raise ValueError("dequantize: contiguous qs/sm with 32-bit offsets inside one weight")
    _dequant_kernel[(nblk, triton.cdiv(n, DEQUANT_BN), stack)](
        qs, sm, out, n, nblk * 32, BN=DEQUANT_BN, num_warps=4, **triton_pdl.launch(qs))
    return out


SHARED_BYTES = 227 * 1024  # shared memory a program may take (H100/H200)


def check_unroll(flat: int, k: int, split: int, tile: Q4Tile) -> None:
    """flat (f16_splits' FLAT) must divide the k steps of a split, and the pipeline's stages of
    flat k steps of x and W tiles (fp16) must fit in shared memory."""
    steps = k // (split * tile.bk)
    if flat < 0 or (flat and steps % flat):
        raise ValueError(f"flat {flat}: must divide a split's {steps} k steps")
    need = tile.stages * max(flat, 1) * (tile.bm + tile.bn) * tile.bk * 2
    if need > SHARED_BYTES:
        raise ValueError(f"flat {flat} on {tile.name}: {need // 1024} KB of shared memory")


def plan(lin: Q4Linear, rows: int, x: torch.Tensor) -> Q4Tile | None:
    """The dense tile for `rows` rows of x through lin, or None: the q4 tiles (CPU tensors,
    too few rows, a narrow weight). Every choice gives the same bits."""
    if (x.device.type != "cuda" or q4_layout.DENSE_MIN_ROWS is None
            or rows < q4_layout.DENSE_MIN_ROWS or lin.out_features < q4_layout.DENSE_MIN_N
            or lin.in_features % LINEAR_TILE.bk):
        return None
    return q4_layout.DENSE_WIDE_TILE if rows >= q4_layout.DENSE_WIDE_ROWS else q4_layout.DENSE_TILE


def linear(lin: Q4Linear, x: torch.Tensor, out: torch.Tensor,
           residual: torch.Tensor | None = None, tile: Q4Tile | None = None,
           flat: int = 0) -> torch.Tensor:
    """kernels/triton_q4.py `linear` through the weight dequantized once (fp16 W.T) and a
    many-warp fp16 tile (default: `plan`'s, or DENSE_TILE): the bits of the q4 tiles.
    x [n, K] float32, rounded to fp16 once (as the q4 tile rounds it); flat: the one-loop
    split form, its k steps unrolled this many per iteration (`f16_splits`; slower here, the
    MoE down projection takes it)."""
    tile = tile or plan(lin, x.shape[0], x) or q4_layout.DENSE_TILE
    if tile.nb != LINEAR_TILE.nb:
        raise ValueError(f"q4 linear: tile {tile.name} does not match the split tile {LINEAR_TILE.name}")
    n, big_n, k = x.shape[0], lin.out_features, lin.in_features
    check_unroll(flat, k, lin.split, tile)
    wt = dequantize(lin.qs, lin.sm)
    x16 = x.to(torch.float16)
    res = residual if residual is not None else out
    _f16_linear_kernel[(triton.cdiv(n, tile.bm), triton.cdiv(big_n, tile.bn))](
        x16, wt, res, out, n, big_n, k, x16.stride(0), res.stride(0), out.stride(0),
        HAS_RES=residual is not None, BM=tile.bm, BN=tile.bn, BK=tile.bk, S=lin.split,
        FLAT=flat, num_warps=tile.warps, num_stages=tile.stages, **triton_pdl.launch(x))
    return out
