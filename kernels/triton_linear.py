"""Weight-only GEMM y = x @ W.T (+ residual) for our storage formats, in Triton: the CUDA
linear op of kernels/ops.py for every format (`linear`, `prepare_linear`), and the f32/q8
kernel (q4 has its own, kernels/triton_q4.py).

Formats (kernels/linear.py): f32 dense; q4 = packed nibbles with a scale and a min per
32-block (re-packed at load, see kernels/q4_layout.py); q8 = int8 with a scale per 32-block, its scales
kept in fp16 on the GPU (GGUF's own precision: exact for Q8_0), see `GpuLinear`.

Arithmetic: q8 weights are dequantized to fp16 in registers (one fp16 q * scale), activations
are rounded to fp16, and tl.dot accumulates in fp32 on the tensor cores. f32 weights use an
exact fp32 dot (no tensor cores, input_precision="ieee").

Batch invariance: ONE tile configuration (BM, BN, BK, warps, stages) for every batch size, no
split-K here, and the K loop runs in increasing k; an output row depends only on its input row
and W, whatever else shares its tile. Grid axis 0 is the M tile so that consecutive programs
share a weight tile in L2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import q4_layout, triton_f16, triton_pdl, triton_q4
from kernels.linear import QBLOCK, Linear
from kernels.q4_layout import Q4Linear, Q4Tile
from kernels.triton_pdl import pdl_wait

FMT_F32, FMT_Q4, FMT_Q8 = 0, 1, 2
FMT_CODES = {"f32": FMT_F32, "q4": FMT_Q4, "q8": FMT_Q8}
# q4 calls of up to this many rows on kernels/cuda_q4.py (the decode tile's bits; its CTA form
# by default: a CTA a column tile's K splits, merged in shared memory), for weights of
# SWAP_MAX_N to CUDA_MAX_N outputs (qkv, o) whose shape it takes, where NVRTC and the CUDA
# headers are installed (else the Triton tile, the same bits). H100, context 128, 1 / 8
# streams: 319.7 / 1,382.3 → 360.5 / 1,420.9 tok/s (GPU step 3.050 → 2.703 ms); context 2,048
# 273.7 / 1,183.6 → 293.2 / 1,214.2 (GPU_NOTES v17). None: off (bench/ab_modes.py `cudaN`)
CUDA_MAX_ROWS: int | None = 8
CUDA_MAX_N = 16384
# ... and from this many outputs (None: SWAP_MAX_N, leaving the router's 128 to the swapped
# Triton tile — the same bits). 1: the router too, on the CTA form's 16-split entries (3.3
# against 5.9 µs at 1 row, 3.7 against 7.1 at 8); H100, context 128, 1 / 4 / 8 streams 365.4 /
# 939.4 / 1,443.6 → 373.3 / 941.3 / 1,442.4 tok/s (GPU_NOTES v18; bench/ab_modes.py
# `tritonrouter` puts it back)
CUDA_MIN_N: int | None = 1
# q4 calls of this many rows or more (below the dense path's) on cuda_q4's swapped form (the
# weights as the MMA's A operand, each dequantized once for all rows), for weights of
# SWAP_MAX_N outputs or more: an experiment (bench/ab_modes.py `cswN`), off by default
CUDA_SWAP_MIN_ROWS: int | None = None


@dataclass(frozen=True)
class TileConfig:
    """The f32/q8 kernel's tile. Fixed per kernel, never chosen from the batch size."""

    bm: int = 16
    bn: int = 32
    bk: int = 128
    warps: int = 4
    stages: int = 2


LINEAR_TILE = TileConfig()


@dataclass(frozen=True, eq=False)
class GpuLinear(Linear):
    """A q8 Linear in GPU storage: qs [out, in] int8, scale fp16 [out, in//32]."""

    def __post_init__(self) -> None:
        o, i = self.out_features, self.in_features
        if self.fmt != "q8" or i % QBLOCK:
            raise ValueError("GpuLinear holds q8 weights with in_features % 32 == 0")
        for name, shape, dtype in (("qs", (o, i), torch.int8), ("scale", (o, i // QBLOCK), torch.float16)):
            t = getattr(self, name)
            if t is None or tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"GpuLinear.{name}: expected contiguous {shape} {dtype}")

    def to(self, device: torch.device | str) -> "GpuLinear":
        return GpuLinear(self.fmt, self.out_features, self.in_features, None, self.qs.to(device),
                         self.scale.to(device))


def prepare_linear(lin: Linear, device: str) -> Linear:
    """The Linear on `device`, in the storage the kernels read (to_gpu_format). The first q4
    weight that `linear` would route to kernels/cuda_q4.py builds and loads its kernels here,
    at load time (NVRTC: seconds, cached on disk), not in the first request's step."""
    out = to_gpu_format(lin.to(device))
    if isinstance(out, Q4Linear) and _cuda_rows(out) and out.qs.is_cuda:
        from kernels import cuda_q4
        cuda_q4.available(out.qs.device.index or 0)
    return out


def _cuda_rows(lin: Q4Linear) -> bool:
    """Whether `linear` sends lin's calls of up to CUDA_MAX_ROWS rows to cuda_q4."""
    lo = q4_layout.SWAP_MAX_N if CUDA_MIN_N is None else CUDA_MIN_N
    return bool(CUDA_MAX_ROWS) and lo <= lin.out_features <= CUDA_MAX_N


def cuda_routed(lin: Q4Linear, x: torch.Tensor, out: torch.Tensor,
                residual: torch.Tensor | None = None) -> bool:
    """Whether `linear` (no tile given) sends this q4 call to kernels/cuda_q4.py."""
    n = x.shape[0]
    if not (x.is_cuda and _cuda_rows(lin) and n <= CUDA_MAX_ROWS) or triton_f16.plan(lin, n, x):
        return False
    from kernels import cuda_q4
    return cuda_q4.fits(lin, x, out, residual)


def to_gpu_format(lin: Linear) -> Linear:
    """The storage the kernels read: q4 → q4_layout.Q4Linear (re-packed, fp16 scale/min);
    q8 → GpuLinear (fp16 scales); f32 stays as it is."""
    if lin.fmt == "f32" or isinstance(lin, (GpuLinear, Q4Linear)):
        return lin
    if lin.fmt == "q4":
        return q4_layout.repack(lin)
    scale = lin.scale.to(torch.float16).contiguous()
    if not torch.isfinite(scale).all():
        raise ValueError("q8 scale does not fit fp16 (|value| > 65504)")
    return GpuLinear(lin.fmt, lin.out_features, lin.in_features, None, lin.qs.contiguous(), scale)


# ---- device code (f32 and q8) -------------------------------------------------------------------
@triton.jit
def _load_w(w_ptr, s_ptr, n_loc, n_mask, k0, K, stride_w, stride_s, FMT: tl.constexpr,
            BN: tl.constexpr, BK: tl.constexpr):
    """The raw weight tile at k0 — q8: int8 [BN, BK]; f32 [BN, BK] — and its scales
    [BN, BK//32] (zeros for f32). Nothing past K or past the valid rows is read. Pointers are
    at the tile's first row."""
    b = tl.arange(0, BK // 32)
    k = k0 + tl.arange(0, BK)
    kmask = n_mask[:, None] & (k < K)[None, :]
    w = tl.load(w_ptr + n_loc[:, None] * stride_w + k[None, :], mask=kmask, other=0)
    if FMT == 2:
        smask = n_mask[:, None] & ((k0 // 32 + b) < K // 32)[None, :]
        s = tl.load(s_ptr + n_loc[:, None] * stride_s + (k0 // 32 + b)[None, :], mask=smask,
                    other=0.0)
    else:
        s = tl.zeros((BN, BK // 32), tl.float16)
    return w, s


@triton.jit
def _load_x(x_ptr, xr, row_mask, k0, K, BK: tl.constexpr):
    """Activation tile [BM, BK] at k0; xr [BM, 1] are row offsets."""
    k = k0 + tl.arange(0, BK)
    return tl.load(x_ptr + xr + k[None, :], mask=row_mask[:, None] & (k < K)[None, :], other=0.0)


@triton.jit
def _tile_dot(acc, w, s, x, FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """acc += one k tile's x @ W.T, from the raw tile _load_w gave."""
    if FMT == 2:
        wq = tl.reshape(tl.reshape(w.to(tl.float16), (BN, BK // 32, 32)) * s[:, :, None],
                        (BN, BK))
        acc = tl.dot(x.to(tl.float16), tl.trans(wq), acc)
    else:
        acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
    return acc


@triton.jit
def rows_times_w(x_ptr, x_rows, row_mask, stride_x, w_ptr, s_ptr, n0, n_mask, K, stride_w,
                 stride_s, acc, FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """acc[BM, BN] += x[x_rows, :K] @ W[n0 : n0 + BN, :K].T over k tiles in increasing order
    (f32 and q8 weights).

    x_rows [BM] are row indices (a gather: MoE tiles use it); rows with row_mask False read 0,
    and so do columns past K. n0 is the tile's first weight row; n_mask [BN] its valid rows.
    x may be float32 or float16 (q8 rounds it to fp16 either way: the same bits).
    Tiles are prefetched by hand (weights two ahead, activations one): Triton's pipeliner only
    prefetches loads that feed a dot directly, and a dequantized tile does not.
    """
    xr = x_rows[:, None] * stride_x  # int32: activations are far below 2**31 elements
    n_loc = tl.arange(0, BN)
    w_ptr += tl.cast(n0, tl.int64) * stride_w  # 64-bit once per tile, 32-bit offsets inside it
    s_ptr += tl.cast(n0, tl.int64) * stride_s
    w_a, s_a = _load_w(w_ptr, s_ptr, n_loc, n_mask, 0, K, stride_w, stride_s, FMT, BN, BK)
    w_b, s_b = _load_w(w_ptr, s_ptr, n_loc, n_mask, BK, K, stride_w, stride_s, FMT, BN, BK)
    x_n = _load_x(x_ptr, xr, row_mask, 0, K, BK)
    for k0 in range(0, K, BK):
        w, s = w_a, s_a
        w_a, s_a = w_b, s_b
        w_b, s_b = _load_w(w_ptr, s_ptr, n_loc, n_mask, k0 + 2 * BK, K, stride_w, stride_s, FMT,
                           BN, BK)
        x = x_n
        x_n = _load_x(x_ptr, xr, row_mask, k0 + BK, K, BK)
        acc = _tile_dot(acc, w, s, x, FMT, BN, BK)
    return acc


@triton.jit(do_not_specialize=["M", "stride_x", "stride_res", "stride_y"])
def _linear_kernel(x_ptr, w_ptr, s_ptr, res_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_s,
                   stride_res, stride_y, FMT: tl.constexpr, HAS_RES: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   PDL: tl.constexpr):
    pdl_wait(PDL)
    pid_m, pid_n, offs_m, offs_n, m_mask, n_mask = triton_q4.output_tile(M, N, BM, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc = rows_times_w(x_ptr, offs_m, m_mask, stride_x, w_ptr, s_ptr, pid_n * BN, n_mask, K,
                       stride_w, stride_s, acc, FMT, BN, BK)
    mask = m_mask[:, None] & n_mask[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    if HAS_RES:
        acc = tl.load(res_ptr + rows * stride_res + offs_n[None, :], mask=mask, other=0.0) + acc
    tl.store(y_ptr + rows * stride_y + offs_n[None, :], acc, mask=mask)


# ---- host side --------------------------------------------------------------------------------
def weight_args(lin: Linear) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(w, scale, stride_w, stride_s) of an f32 or q8 weight; absent tensors are stand-ins."""
    if lin.fmt == "f32":
        w = lin.weight
        if w.stride(1) != 1:
            raise ValueError("f32 weight rows must be contiguous")
        return w, w, w.stride(0), 0
    if not isinstance(lin, GpuLinear):
        raise TypeError("q8 weights must be in GPU storage (kernels.triton_linear.to_gpu_format)")
    return lin.qs, lin.scale, lin.qs.stride(0), lin.scale.stride(0)


def check_x(x: torch.Tensor, k: int, name: str = "x") -> None:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"{name}: expected float32 [n, {k}] with contiguous rows, got "
                         f"{x.dtype} {tuple(x.shape)} strides {x.stride()}")


def linear(lin: Linear, x: torch.Tensor, out: torch.Tensor | None = None,
           residual: torch.Tensor | None = None,
           tile: TileConfig | Q4Tile | None = None) -> torch.Tensor:
    """x [n, K] f32 → out [n, N] f32 = x @ W.T (+ residual [n, N] f32), N, K = the weight's
    out/in features; out is allocated when not given. Each row is computed alone
    (batch-invariant). q4 weights go to triton_q4 (tile: a Q4Tile; many rows without a tile
    to triton_f16, the same bits), f32/q8 to this file's kernel (tile: a TileConfig)."""
    if x.dim() == 2 and x.stride(-1) != 1:
        x = x.contiguous()
    n, k = x.shape[0], lin.in_features
    check_x(x, k)
    if out is None:
        out = torch.empty(n, lin.out_features, dtype=torch.float32, device=x.device)
    if out.shape != (n, lin.out_features) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError("out: expected float32 [n, out_features] with contiguous rows")
    if residual is not None and (residual.shape != out.shape or residual.dtype != torch.float32
                                 or residual.stride(1) != 1):
        raise ValueError("residual: expected float32 [n, out_features] with contiguous rows")
    if n == 0:
        return out
    if lin.fmt == "q4":
        if not isinstance(lin, Q4Linear):
            raise TypeError("q4 weights must be in GPU storage (kernels.triton_linear.to_gpu_format)")
        if tile is None and (dense := triton_f16.plan(lin, n, x)):  # dequantized once, fp16
            return triton_f16.linear(lin, x, out, residual, dense)
        if tile is None and cuda_routed(lin, x, out, residual):
            from kernels import cuda_q4
            return cuda_q4.linear(lin, x, out, residual)
        if (tile is None and CUDA_SWAP_MIN_ROWS and n >= CUDA_SWAP_MIN_ROWS and x.is_cuda
                and lin.out_features >= q4_layout.SWAP_MAX_N):
            from kernels import cuda_q4
            if cuda_q4.swap_fits(lin, x):
                return cuda_q4.swap_linear(lin, x, out, residual)
        return triton_q4.linear(lin, x, out, residual, tile)
    tile = tile or LINEAR_TILE
    w, s, sw, ss = weight_args(lin)
    res = residual if residual is not None else out
    grid = (triton.cdiv(n, tile.bm), triton.cdiv(lin.out_features, tile.bn))
    _linear_kernel[grid](x, w, s, res, out, n, lin.out_features, k, x.stride(0), sw, ss,
                         res.stride(0), out.stride(0), FMT=FMT_CODES[lin.fmt],
                         HAS_RES=residual is not None, BM=tile.bm, BN=tile.bn, BK=tile.bk,
                         num_warps=tile.warps, num_stages=tile.stages, **triton_pdl.launch(x))
    return out
