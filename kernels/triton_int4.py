"""Weight-only GEMM y = x @ W.T (+ residual) for our storage formats, in Triton.

Formats (kernels/linear.py): f32 dense; q4 = packed nibbles in GGUF 32-block order with a
scale and a min per 32-block (w = scale * q + min; GPTQ and Q4_0/Q4_1 map onto it); q8 =
int8 with a scale per 32-block. On the GPU the q4/q8 scales and mins are kept in fp16 (GGUF's
own precision: exact for Q4_0/Q4_1/Q8_0 and GPTQ sym), see `GpuLinear`.

Arithmetic: q4/q8 weights are dequantized to fp16 in registers ((0x6400 | q) read as fp16 is
1024 + q, exact; then one fp16 q * scale + min), activations are rounded to fp16, and tl.dot
accumulates in fp32 on the tensor cores (two dots per k tile for q4: low and high nibbles). f32 weights use an exact fp32 dot (no tensor cores, input_precision="ieee").

Batch invariance: ONE tile configuration (BM, BN, BK, warps, stages) for every batch size, no
split-K, and the K loop runs in increasing k; an output row depends only on its input row and
W, whatever else shares its tile. Grid axis 0 is the M tile so that consecutive programs share
a weight tile in L2.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.linear import QBLOCK, Linear

FMT_F32, FMT_Q4, FMT_Q8 = 0, 1, 2
FMT_CODES = {"f32": FMT_F32, "q4": FMT_Q4, "q8": FMT_Q8}


@dataclass(frozen=True)
class TileConfig:
    """A kernel's tile shape and q4 inner loop. Fixed per kernel, never chosen from the batch
    size. elem: the q4 tile is dequantized by elementwise ops only (scales and mins loaded per
    element, no reshapes), so the compiler may convert the raw bytes to the dot-operand layout
    instead of the fp16 tile; swap: the weight tile is the dot's left operand ([BN, BK] x
    [BK, BM], the decode "swap AB" form: BN fills the MMA's M side, the few rows its N side)."""

    bm: int = 16
    bn: int = 64
    bk: int = 128
    warps: int = 4
    stages: int = 3
    elem: bool = False
    swap: bool = False
    prefetch: int = 2  # block loop: weight tiles loaded ahead of use (2 or 4)


    @classmethod
    def parse(cls, spec: str) -> "TileConfig":
        """"16x32x128w4" [+ "s2"] [+ "p4"] [+ ":elem" | ":swap"] → TileConfig (benchmarks,
        env); p is the block loop's prefetch depth."""
        shape, _, loop = spec.partition(":")
        if loop not in ("", "block", "elem", "swap"):
            raise ValueError(f"tile {spec!r}: the q4 loop must be block, elem or swap")
        try:
            dims, _, rest = shape.partition("w")
            rest, _, prefetch = rest.partition("p")
            warps, _, stages = rest.partition("s")
            bm, bn, bk = (int(v) for v in dims.split("x"))
            tile = cls(bm, bn, bk, int(warps), int(stages or 2), elem=loop in ("elem", "swap"),
                       swap=loop == "swap", prefetch=int(prefetch or 2))
        except ValueError as e:
            raise ValueError(f"tile {spec!r}: expected BMxBNxBKwW[sS][:loop], e.g. "
                             f"16x32x128w4:swap") from e
        if bk % 32 or min(bm, bn, bk) < 16:
            raise ValueError(f"tile {spec!r}: BM, BN, BK must be >= 16 and BK a multiple of 32")
        if tile.prefetch not in (2, 4) or (tile.prefetch != 2 and tile.elem):
            raise ValueError(f"tile {spec!r}: prefetch is 2 or 4 (4: block loop only)")
        return tile

    @property
    def name(self) -> str:
        loop = ":swap" if self.swap else ":elem" if self.elem else ""
        pf = f"p{self.prefetch}" if self.prefetch != 2 else ""
        return f"{self.bm}x{self.bn}x{self.bk}w{self.warps}s{self.stages}{pf}{loop}"


def tile_from_env(var: str, default: str) -> TileConfig:
    """A kernel's tile: fixed for the process (so per engine, never per batch), `default`
    unless the environment names another (benchmarks compare inner loops this way)."""
    return TileConfig.parse(os.environ.get(var) or default)


LINEAR_TILE = tile_from_env("FEDSERVE_LINEAR_TILE", "16x32x128w4s2")


@dataclass(frozen=True, eq=False)
class GpuLinear(Linear):
    """A Linear in GPU storage: q4/q8 scale (and min) as fp16 [out, in//32]; f32 unchanged."""

    def __post_init__(self) -> None:
        o, i = self.out_features, self.in_features
        if self.fmt == "f32" or i % QBLOCK:
            raise ValueError("GpuLinear holds q4/q8 weights with in_features % 32 == 0")
        want = {"scale": (o, i // QBLOCK)}
        if self.fmt == "q4":
            want.update(qs=(o, i // 2), minv=(o, i // QBLOCK))
        else:
            want.update(qs=(o, i))
        for name, shape in want.items():
            t = getattr(self, name)
            dtype = torch.float16 if name != "qs" else (torch.uint8 if self.fmt == "q4" else torch.int8)
            if t is None or tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"GpuLinear.{name}: expected contiguous {shape} {dtype}")

    def to(self, device: torch.device | str) -> "GpuLinear":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return GpuLinear(self.fmt, self.out_features, self.in_features, None, mv(self.qs),
                         mv(self.scale), mv(self.minv))


def _fp16(t: torch.Tensor, name: str) -> torch.Tensor:
    h = t.to(torch.float16).contiguous()
    if not torch.isfinite(h).all():
        raise ValueError(f"{name} does not fit fp16 (|value| > 65504)")
    return h


def to_gpu_format(lin: Linear) -> Linear:
    """The storage the kernels read: q4/q8 → GpuLinear (fp16 scales); f32 stays as it is."""
    if lin.fmt == "f32" or isinstance(lin, GpuLinear):
        return lin
    minv = _fp16(lin.minv, "minv") if lin.fmt == "q4" else None
    return GpuLinear(lin.fmt, lin.out_features, lin.in_features, None, lin.qs.contiguous(),
                     _fp16(lin.scale, "scale"), minv)


# ---- device code ------------------------------------------------------------------------------
@triton.jit
def _load_w(w_ptr, s_ptr, m_ptr, n_loc, n_mask, k0, K, stride_w, stride_s, FMT: tl.constexpr,
            BN: tl.constexpr, BK: tl.constexpr):
    """The raw weight tile at k0 — q4: bytes [BN, BK//2]; q8: int8 [BN, BK]; f32 [BN, BK] —
    and its scales and mins [BN, BK//32] (zeros where the format has none). Nothing past K
    or past the valid rows is read. Pointers are at the tile's first row."""
    b = tl.arange(0, BK // 32)
    c = tl.arange(0, BK // 2)
    k = k0 + tl.arange(0, BK)
    smask = n_mask[:, None] & ((k0 // 32 + b) < K // 32)[None, :]
    bmask = n_mask[:, None] & ((k0 // 2 + c) < K // 2)[None, :]
    kmask = n_mask[:, None] & (k < K)[None, :]
    sidx = n_loc[:, None] * stride_s + (k0 // 32 + b)[None, :]
    if FMT == 1:
        mask = bmask
        w = tl.load(w_ptr + n_loc[:, None] * stride_w + (k0 // 2 + c)[None, :], mask=mask, other=0)
        s = tl.load(s_ptr + sidx, mask=smask, other=0.0)
        m = tl.load(m_ptr + sidx, mask=smask, other=0.0)
    else:
        w = tl.load(w_ptr + n_loc[:, None] * stride_w + k[None, :], mask=kmask, other=0)
        if FMT == 2:
            s = tl.load(s_ptr + sidx, mask=smask, other=0.0)
        else:
            s = tl.zeros((BN, BK // 32), tl.float16)
        m = tl.zeros((BN, BK // 32), tl.float16)
    return w, s, m


@triton.jit
def _load_x(x_ptr, xr, row_mask, k0, K, FMT: tl.constexpr, BK: tl.constexpr):
    """Activation tile at k0; xr [BM, 1] are row offsets. q4: the two halves [BM, BK//2]
    matching _dequant_q4's columns; otherwise ([BM, BK], the same tile as a stand-in)."""
    if FMT == 1:
        c = tl.arange(0, BK // 2)
        kl = k0 + (c // 16) * 32 + c % 16
        xm = row_mask[:, None] & (kl < K)[None, :]
        lo = tl.load(x_ptr + xr + kl[None, :], mask=xm, other=0.0)
        hi = tl.load(x_ptr + xr + (kl + 16)[None, :], mask=xm, other=0.0)
    else:
        k = k0 + tl.arange(0, BK)
        lo = tl.load(x_ptr + xr + k[None, :], mask=row_mask[:, None] & (k < K)[None, :], other=0.0)
        hi = lo
    return lo, hi


@triton.jit
def _dequant_q4(p, s, m, BN: tl.constexpr, BK: tl.constexpr):
    """q4 bytes [BN, BK//2] → two fp16 halves [BN, BK//2]: column c holds element
    (c//16)*32 + c%16 of the tile (low nibble) and that + 16 (high nibble): the GGUF order.
    (0x6400 | q) read as fp16 is exactly 1024 + q; then one fp16 q * scale + min."""
    lo = ((p & 0xF).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    hi = ((p >> 4).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    s3 = s[:, :, None]  # [BN, BK//32, 1]
    m3 = m[:, :, None]
    lo = tl.reshape(tl.reshape(lo, (BN, BK // 32, 16)) * s3 + m3, (BN, BK // 2))
    hi = tl.reshape(tl.reshape(hi, (BN, BK // 32, 16)) * s3 + m3, (BN, BK // 2))
    return lo, hi


@triton.jit
def _load_w_elem(w_ptr, s_ptr, m_ptr, n_loc, n_mask, k0, K, stride_w, stride_s,
                 BN: tl.constexpr, BK: tl.constexpr):
    """q4 tile at k0 for the elementwise dequant: bytes [BN, BK//2] and the scale and min of
    each byte's 32-block, also [BN, BK//2] (a gather whose 16 equal addresses per block a
    thread loads once). Column c holds elements (c//16)*32 + c%16 (low nibble) and +16 (high)."""
    c = tl.arange(0, BK // 2)
    mask = n_mask[:, None] & ((k0 // 2 + c) < K // 2)[None, :]
    w = tl.load(w_ptr + n_loc[:, None] * stride_w + (k0 // 2 + c)[None, :], mask=mask, other=0)
    sidx = n_loc[:, None] * stride_s + (k0 // 32 + c // 16)[None, :]
    s = tl.load(s_ptr + sidx, mask=mask, other=0.0)
    m = tl.load(m_ptr + sidx, mask=mask, other=0.0)
    return w, s, m


@triton.jit
def _q4_elem(p, s, m):
    """Elementwise q4 dequant of bytes p [BN, BK//2] with per-element scale/min → (low, high)
    fp16 tiles, the columns of _load_w_elem. The same fp16 arithmetic as _dequant_q4."""
    lo = ((p & 0xF).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    hi = ((p >> 4).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    return lo * s + m, hi * s + m


@triton.jit
def _rows_times_w_q4_elem(x_ptr, x_rows, row_mask, stride_x, w_ptr, s_ptr, m_ptr, n0, n_mask,
                          K, stride_w, stride_s, BM: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr, SWAP: tl.constexpr):
    """x[x_rows, :K] @ W[n0 : n0 + BN, :K].T → [BM, BN] fp32 for q4 by the elementwise dequant
    (TileConfig.elem); k tiles in increasing order, weights prefetched two ahead. SWAP computes
    the transposed product W x^T on the MMA and transposes once at the end: a row's sum is the
    same dot of its own inputs either way round, so invariance holds alike."""
    xr = x_rows[:, None] * stride_x
    n_loc = tl.arange(0, BN)
    w_ptr += tl.cast(n0, tl.int64) * stride_w
    s_ptr += tl.cast(n0, tl.int64) * stride_s
    m_ptr += tl.cast(n0, tl.int64) * stride_s
    w_a, s_a, m_a = _load_w_elem(w_ptr, s_ptr, m_ptr, n_loc, n_mask, 0, K, stride_w, stride_s, BN, BK)
    w_b, s_b, m_b = _load_w_elem(w_ptr, s_ptr, m_ptr, n_loc, n_mask, BK, K, stride_w, stride_s, BN, BK)
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        w, s, m = w_a, s_a, m_a
        w_a, s_a, m_a = w_b, s_b, m_b
        w_b, s_b, m_b = _load_w_elem(w_ptr, s_ptr, m_ptr, n_loc, n_mask, k0 + 2 * BK, K,
                                     stride_w, stride_s, BN, BK)
        x_lo, x_hi = _load_x(x_ptr, xr, row_mask, k0, K, 1, BK)
        w_lo, w_hi = _q4_elem(w, s, m)
        if SWAP:
            acc = tl.dot(w_lo, tl.trans(x_lo.to(tl.float16)), acc)
            acc = tl.dot(w_hi, tl.trans(x_hi.to(tl.float16)), acc)
        else:
            acc = tl.dot(x_lo.to(tl.float16), tl.trans(w_lo), acc)
            acc = tl.dot(x_hi.to(tl.float16), tl.trans(w_hi), acc)
    if SWAP:
        return tl.trans(acc)
    else:
        return acc


@triton.jit
def _rows_times_w(x_ptr, x_rows, row_mask, stride_x, w_ptr, s_ptr, m_ptr, n0, n_mask,
                  K, stride_w, stride_s, acc, FMT: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, ELEM: tl.constexpr = False, SWAP: tl.constexpr = False,
                  PF: tl.constexpr = 2):
    """acc[BM, BN] += x[x_rows, :K] @ W[n0 : n0 + BN, :K].T; ELEM/SWAP pick the q4 inner loop
    (TileConfig), other formats have one."""
    if ELEM and FMT == 1:
        acc = acc + _rows_times_w_q4_elem(x_ptr, x_rows, row_mask, stride_x, w_ptr, s_ptr, m_ptr,
                                          n0, n_mask, K, stride_w, stride_s, acc.shape[0], BN,
                                          BK, SWAP)
    else:
        acc = _rows_times_w_block(x_ptr, x_rows, row_mask, stride_x, w_ptr, s_ptr, m_ptr, n0,
                                  n_mask, K, stride_w, stride_s, acc, FMT, BN, BK, PF)
    return acc


@triton.jit
def _tile_dot(acc, w, s, m, x_lo, x_hi, FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """acc += one k tile's x @ W.T, from the raw tile _load_w gave (the block loop)."""
    if FMT == 1:
        w_lo, w_hi = _dequant_q4(w, s, m, BN, BK)
        acc = tl.dot(x_lo.to(tl.float16), tl.trans(w_lo), acc)
        acc = tl.dot(x_hi.to(tl.float16), tl.trans(w_hi), acc)
    elif FMT == 2:
        wq = tl.reshape(tl.reshape(w.to(tl.float16), (BN, BK // 32, 32)) * s[:, :, None],
                        (BN, BK))
        acc = tl.dot(x_lo.to(tl.float16), tl.trans(wq), acc)
    else:
        acc = tl.dot(x_lo.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
    return acc


@triton.jit
def _rows_times_w_block(x_ptr, x_rows, row_mask, stride_x, w_ptr, s_ptr, m_ptr, n0, n_mask,
                        K, stride_w, stride_s, acc, FMT: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, PF: tl.constexpr = 2):
    """acc[BM, BN] += x[x_rows, :K] @ W[n0 : n0 + BN, :K].T over k tiles in increasing order.

    x_rows [BM] are row indices (a gather: MoE tiles use it); rows with row_mask False read 0,
    and so do columns past K. n0 is the tile's first weight row; n_mask [BN] its valid rows.
    x may be float32 or float16 (q4/q8 round it to fp16 either way: the same bits).
    Tiles are prefetched by hand (weights PF = 2 or 4 ahead, activations one): Triton's
    pipeliner only prefetches loads that feed a dot directly, and a dequantized tile does not.
    The depth changes when bytes are requested, never the arithmetic: same bits for any PF.
    """
    xr = x_rows[:, None] * stride_x  # int32: activations are far below 2**31 elements
    n_loc = tl.arange(0, BN)
    w_ptr += tl.cast(n0, tl.int64) * stride_w  # 64-bit once per tile, 32-bit offsets inside it
    s_ptr += tl.cast(n0, tl.int64) * stride_s
    m_ptr += tl.cast(n0, tl.int64) * stride_s
    w_a, s_a, m_a = _load_w(w_ptr, s_ptr, m_ptr, n_loc, n_mask, 0, K, stride_w, stride_s,
                            FMT, BN, BK)
    w_b, s_b, m_b = _load_w(w_ptr, s_ptr, m_ptr, n_loc, n_mask, BK, K, stride_w, stride_s,
                            FMT, BN, BK)
    x_lo_n, x_hi_n = _load_x(x_ptr, xr, row_mask, 0, K, FMT, BK)
    if PF == 4:
        w_c, s_c, m_c = _load_w(w_ptr, s_ptr, m_ptr, n_loc, n_mask, 2 * BK, K, stride_w,
                                stride_s, FMT, BN, BK)
        w_d, s_d, m_d = _load_w(w_ptr, s_ptr, m_ptr, n_loc, n_mask, 3 * BK, K, stride_w,
                                stride_s, FMT, BN, BK)
        for k0 in range(0, K, BK):
            w, s, m = w_a, s_a, m_a
            w_a, s_a, m_a = w_b, s_b, m_b
            w_b, s_b, m_b = w_c, s_c, m_c
            w_c, s_c, m_c = w_d, s_d, m_d
            w_d, s_d, m_d = _load_w(w_ptr, s_ptr, m_ptr, n_loc, n_mask, k0 + 4 * BK, K,
                                    stride_w, stride_s, FMT, BN, BK)
            x_lo, x_hi = x_lo_n, x_hi_n
            x_lo_n, x_hi_n = _load_x(x_ptr, xr, row_mask, k0 + BK, K, FMT, BK)
            acc = _tile_dot(acc, w, s, m, x_lo, x_hi, FMT, BN, BK)
    else:
        for k0 in range(0, K, BK):
            w, s, m = w_a, s_a, m_a
            w_a, s_a, m_a = w_b, s_b, m_b
            w_b, s_b, m_b = _load_w(w_ptr, s_ptr, m_ptr, n_loc, n_mask, k0 + 2 * BK, K,
                                    stride_w, stride_s, FMT, BN, BK)
            x_lo, x_hi = x_lo_n, x_hi_n
            x_lo_n, x_hi_n = _load_x(x_ptr, xr, row_mask, k0 + BK, K, FMT, BK)
            acc = _tile_dot(acc, w, s, m, x_lo, x_hi, FMT, BN, BK)
    return acc


@triton.jit(do_not_specialize=["M", "stride_x", "stride_res", "stride_y"])
def _linear_kernel(x_ptr, w_ptr, s_ptr, m_ptr, res_ptr, y_ptr, M, N, K, stride_x, stride_w,
                   stride_s, stride_res, stride_y, FMT: tl.constexpr, HAS_RES: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ELEM: tl.constexpr,
                   SWAP: tl.constexpr, PF: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc = _rows_times_w(x_ptr, offs_m, m_mask, stride_x, w_ptr, s_ptr, m_ptr, pid_n * BN, n_mask,
                        K, stride_w, stride_s, acc, FMT, BN, BK, ELEM, SWAP, PF)
    mask = m_mask[:, None] & n_mask[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    if HAS_RES:
        acc = tl.load(res_ptr + rows * stride_res + offs_n[None, :], mask=mask, other=0.0) + acc
    tl.store(y_ptr + rows * stride_y + offs_n[None, :], acc, mask=mask)


# ---- host side --------------------------------------------------------------------------------
def weight_args(lin: Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """(w, scale, min, stride_w, stride_s) for the kernels; absent tensors are stand-ins."""
    if lin.fmt == "f32":
        w = lin.weight
        if w.stride(1) != 1:
            raise ValueError("f32 weight rows must be contiguous")
        return w, w, w, w.stride(0), 0
    if not isinstance(lin, GpuLinear):
        raise TypeError("q4/q8 weights must be in GPU storage (kernels.triton_int4.to_gpu_format)")
    minv = lin.minv if lin.minv is not None else lin.scale
    return lin.qs, lin.scale, minv, lin.qs.stride(0), lin.scale.stride(0)


def check_x(x: torch.Tensor, k: int, name: str = "x") -> None:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"{name}: expected float32 [n, {k}] with contiguous rows, got "
                         f"{x.dtype} {tuple(x.shape)} strides {x.stride()}")


def linear(lin: Linear, x: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None,
           tile: TileConfig = LINEAR_TILE) -> torch.Tensor:
    """out[n, out_features] = x @ W.T (+ residual), all float32; returns out."""
    n, k = x.shape[0], lin.in_features
    check_x(x, k)
    if out.shape != (n, lin.out_features) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError("out: expected float32 [n, out_features] with contiguous rows")
    if residual is not None and (residual.shape != out.shape or residual.dtype != torch.float32
                                 or residual.stride(1) != 1):
        raise ValueError("residual: expected float32 [n, out_features] with contiguous rows")
    if n == 0:
        return out
    w, s, m, sw, ss = weight_args(lin)
    res = residual if residual is not None else out
    grid = (triton.cdiv(n, tile.bm), triton.cdiv(lin.out_features, tile.bn))
    _linear_kernel[grid](x, w, s, m, res, out, n, lin.out_features, k, x.stride(0), sw, ss,
                         res.stride(0), out.stride(0), FMT=FMT_CODES[lin.fmt],
                         HAS_RES=residual is not None, BM=tile.bm, BN=tile.bn, BK=tile.bk,
                         ELEM=tile.elem, SWAP=tile.swap, PF=tile.prefetch,
                         num_warps=tile.warps, num_stages=tile.stages)
    return out
