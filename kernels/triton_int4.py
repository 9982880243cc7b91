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

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.linear import QBLOCK, Linear

FMT_F32, FMT_Q4, FMT_Q8 = 0, 1, 2
FMT_CODES = {"f32": FMT_F32, "q4": FMT_Q4, "q8": FMT_Q8}


@dataclass(frozen=True)
class TileConfig:
    """A kernel's tile shape. Fixed per kernel, never chosen from the batch size."""

    bm: int = 16
    bn: int = 64
    bk: int = 128
    warps: int = 4
    stages: int = 3


LINEAR_TILE = TileConfig(bm=16, bn=32, bk=128, warps=4, stages=2)


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
def _rows_times_w(x_ptr, x_rows, row_mask, stride_x, w_ptr, s_ptr, m_ptr, n0, n_mask,
                  K, stride_w, stride_s, acc, FMT: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr):
    """acc[BM, BN] += x[x_rows, :K] @ W[n0 : n0 + BN, :K].T over k tiles in increasing order.

    x_rows [BM] are row indices (a gather: MoE tiles use it); rows with row_mask False read 0,
    and so do columns past K. n0 is the tile's first weight row; n_mask [BN] its valid rows.
    x may be float32 or float16 (q4/q8 round it to fp16 either way: the same bits).
    Tiles are prefetched by hand (weights two ahead, activations one): Triton's pipeliner only
    prefetches loads that feed a dot directly, and a dequantized tile does not.
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
    for k0 in range(0, K, BK):
        w, s, m = w_a, s_a, m_a
        w_a, s_a, m_a = w_b, s_b, m_b
        w_b, s_b, m_b = _load_w(w_ptr, s_ptr, m_ptr, n_loc, n_mask, k0 + 2 * BK, K, stride_w,
                                stride_s, FMT, BN, BK)
        x_lo, x_hi = x_lo_n, x_hi_n
        x_lo_n, x_hi_n = _load_x(x_ptr, xr, row_mask, k0 + BK, K, FMT, BK)
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


@triton.jit(do_not_specialize=["M", "stride_x", "stride_res", "stride_y"])
def _linear_kernel(x_ptr, w_ptr, s_ptr, m_ptr, res_ptr, y_ptr, M, N, K, stride_x, stride_w,
                   stride_s, stride_res, stride_y, FMT: tl.constexpr, HAS_RES: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc = _rows_times_w(x_ptr, offs_m, m_mask, stride_x, w_ptr, s_ptr, m_ptr, pid_n * BN, n_mask,
                        K, stride_w, stride_s, acc, FMT, BN, BK)
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
                         num_warps=tile.warps, num_stages=tile.stages)
    return out
