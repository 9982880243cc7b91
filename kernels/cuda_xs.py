"""The q4 linear at 9-64 rows with x staged once a CTA (an experiment, off:
`triton_linear.CUDA_XS_MAX_ROWS`).

Why: at 64 rows (a 64-stream decode step) qkv and o run as one-warp Triton programs of 16 rows,
each row tile dequantizing the weight again (2.2 weights a warp instruction): 19.2 / 15.3 µs
on the H200 (v21, ncu) for 11.8 MB of weights, ~3 µs at copy — ~1.4 ms of a 10 ms step above
their bytes. The CUDA CTA form (kernels/cuda_q4.py) dequantizes a block once for 16 rows
only, and a 16-column CTA that loaded 64 rows of x itself would read x from L2 ~320 times a
call. Here a CTA stages its K split of x for up to 64 rows once, as fp16 in shared memory,
and each of its warps runs the CTA form's weight ring over 16 columns, dequantizing each block
once for all the rows (the A fragments by ldmatrix from the staged rows).

Bits: the CTA form's. A warp's accumulators take the same k16 chunks in the same order (a
block's low-nibble chunk, then its high one, blocks ascending) with the same fp16 weights and
the same fp16 x (x_frag's round-to-nearest of the same fp32 values); the splits are the
weight's (q4_layout: whole k steps of 64), each its own CTA, and the S CTAs of a column tile
are one thread block cluster that sums their partials in split order 0..S-1 through
distributed shared memory, then adds the residual (`res + v`) — q4_cta's merge. So a row's
bits are those of the decode tile at every row count, which the GPU tests check.

grid (N / (16 W), S, cdiv(M, 16 MT)); block 32 W; cluster (1, S, 1); dynamic shared memory
max(16 MT x (per + 8) halves, 16 MT x 16 W floats), per = a split's K. Needs sm_90."""

from __future__ import annotations

import functools

import torch

from kernels import cuda_q4, cuda_route
from kernels.q4_layout import Q4Linear

XS = r"""
__device__ __forceinline__ void ldmatrix_x4(unsigned a[4], const __half* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(s));
}

__device__ __forceinline__ float4 load_rank(const float* mine, unsigned rank) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(mine));
  unsigned r;
  float4 v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(r) : "memory");
  return v;
}

// acc[mt][i] += the block's two k16 chunks for m16 tile mt (rows 16 mt.. of the staged x, its
// columns kb..kb+31: ldmatrix of the low chunk, then the high one) and n8 tile i
template <int MT, int NT>
__device__ __forceinline__ void xs_block(float acc[MT][NT][4], const __half* xrow, int ld,
                                         unsigned sel, const unsigned w0[NT], const unsigned w1[NT],
                                         const unsigned s[NT]) {
  unsigned lo[NT][2], hi[NT][2];
#pragma unroll
  for (int i = 0; i < NT; ++i) dequant(w0[i], w1[i], sel, s[i], lo[i], hi[i]);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    unsigned a[4];
    ldmatrix_x4(a, xrow + mt * 16 * ld);
#pragma unroll
    for (int i = 0; i < NT; ++i) mma(acc[mt][i], a, lo[i]);
    ldmatrix_x4(a, xrow + mt * 16 * ld + 16);
#pragma unroll
    for (int i = 0; i < NT; ++i) mma(acc[mt][i], a, hi[i]);
  }
}

template <int MT, int NT, int D, int S>
__device__ __forceinline__ void q4_xs(const float* __restrict__ x, const unsigned char* __restrict__ qs,
                                      const unsigned* __restrict__ sm, const float* __restrict__ res,
                                      float* __restrict__ y, int M, int N, int K, int stride_x,
                                      int stride_res, int stride_y, int has_res) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int C = 8 * NT, R = 16 * MT;
  const int W = blockDim.x >> 5, WC = W * C;
  const int lane = threadIdx.x & 31, c = lane & 3, g = lane >> 2, w = threadIdx.x >> 5;
  const int sp = blockIdx.y, n0 = blockIdx.x * WC + w * C, m0 = blockIdx.z * R;
  int k_lo, k_hi, word;
  unsigned sel;
  split_k(K, S, sp, k_lo, k_hi);
  lane_bytes(c, sel, word);
  const int per = ((K / 64 + S - 1) / S) * 64, ld = per + 8;  // halves a staged row
  __half* xs = reinterpret_cast<__half*>(smem);  // [R][ld]: rows m0.., k = k_lo..
  unsigned w0[D][NT], w1[D][NT], wsm[D][NT];
  const int nb = (k_hi - k_lo) >> 5;
  const long wstep = (long)N * 16;
  const unsigned char* wb = qs + ((long)(k_lo >> 5) * N + n0 + g) * 16 + word;
  const unsigned* sb = sm + (long)(k_lo >> 5) * N + n0 + g;
#pragma unroll
  for (int j = 0; j < D; ++j) {  // the first D blocks' weights: before the wait (PDL)
    load_block<NT>(wb, sb, w0[j], w1[j], wsm[j]);
    wb += wstep; sb += N;
  }
  pdl_wait();
  {  // x rows m0.. of the split as fp16 (nearest even; rows past M are 0), float4 loads
    const int q4 = (k_hi - k_lo) >> 2;
    for (int e = threadIdx.x; e < R * q4; e += blockDim.x) {
      const int r = e / q4, q = (e - r * q4) * 4;
      const float4 v = m0 + r < M
          ? __ldg(reinterpret_cast<const float4*>(x + (long)(m0 + r) * stride_x + k_lo + q))
          : make_float4(0.f, 0.f, 0.f, 0.f);
      *reinterpret_cast<__half2*>(xs + r * ld + q) = __floats2half2_rn(v.x, v.y);
      *reinterpret_cast<__half2*>(xs + r * ld + q + 2) = __floats2half2_rn(v.z, v.w);
    }
  }
  __syncthreads();
  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < NT; ++i) acc[mt][i][0] = acc[mt][i][1] = acc[mt][i][2] = acc[mt][i][3] = 0.f;
  // lane l's ldmatrix row: (l & 7) + 8 ((l >> 3) & 1), column 8 (l >> 4) of each chunk
  const __half* xrow = xs + ((lane & 7) + 8 * ((lane >> 3) & 1)) * ld + 8 * (lane >> 4);
  for (int r = D; r < nb; r += D) {
#pragma unroll
    for (int j = 0; j < D; ++j) {
      xs_block<MT, NT>(acc, xrow, ld, sel, w0[j], w1[j], wsm[j]);
      load_block<NT>(wb, sb, w0[j], w1[j], wsm[j]);
      wb += wstep; sb += N; xrow += 32;
    }
  }
#pragma unroll
  for (int j = 0; j < D; ++j) {
    xs_block<MT, NT>(acc, xrow, ld, sel, w0[j], w1[j], wsm[j]);
    xrow += 32;
  }
  __syncthreads();  // every warp is past its last ldmatrix: the partials reuse the space
  float* part = reinterpret_cast<float*>(smem);  // [R][WC]: this split's partial tile
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const int cc = w * C + 8 * i + 2 * c, r0 = mt * 16 + g;
      *reinterpret_cast<float2*>(part + r0 * WC + cc) = make_float2(acc[mt][i][0], acc[mt][i][1]);
      *reinterpret_cast<float2*>(part + (r0 + 8) * WC + cc) = make_float2(acc[mt][i][2], acc[mt][i][3]);
    }
  if (S > 1) {
    cluster_arrive();  // the S partial tiles are in their CTAs' shared memory
    cluster_wait();
  } else {
    __syncthreads();
  }
  // this CTA (rank sp) writes the elements sp, sp + S, ... of the tile (4 at a time): the S
  // partials summed in split order, then the residual added
  const int quads = R * WC / 4;
  for (int e = sp + S * (int)threadIdx.x; e < quads; e += S * (int)blockDim.x) {
    const int r = (4 * e) / WC, cc = (4 * e) % WC;
    if (m0 + r >= M) continue;
    float4 v = S > 1 ? load_rank(part + 4 * e, 0) : *reinterpret_cast<const float4*>(part + 4 * e);
#pragma unroll
    for (int q = 1; q < S; ++q) {
      const float4 p = load_rank(part + 4 * e, q);
      v.x = v.x + p.x; v.y = v.y + p.y; v.z = v.z + p.z; v.w = v.w + p.w;
    }
    const long col = (long)blockIdx.x * WC + cc;
    float* yr = y + (long)(m0 + r) * stride_y + col;
    if (has_res) {
      const float* rr = res + (long)(m0 + r) * stride_res + col;
      v.x = rr[0] + v.x; v.y = rr[1] + v.y; v.z = rr[2] + v.z; v.w = rr[3] + v.w;
    }
    yr[0] = v.x; yr[1] = v.y; yr[2] = v.z; yr[3] = v.w;
  }
  if (S > 1) {  // no CTA leaves while another may still read its partials
    cluster_arrive();
    cluster_wait();
  }
}

#define Q4_XS(MT, S, D) extern "C" __global__ void __cluster_dims__(1, S, 1) __launch_bounds__(256, 1) \
    q4_xs##MT##_2_s##S##_d##D(const float* x, const unsigned char* qs, const unsigned* sm, \
                              const float* res, float* y, int M, int N, int K, int stride_x, \
                              int stride_res, int stride_y, int has_res) { \
    q4_xs<MT, 2, D, S>(x, qs, sm, res, y, M, N, K, stride_x, stride_res, stride_y, has_res); }
#define Q4_XS_S(S) Q4_XS(1, S, 4) Q4_XS(2, S, 4) Q4_XS(4, S, 4) Q4_XS(1, S, 2) Q4_XS(2, S, 2) \
    Q4_XS(4, S, 2)
Q4_XS_S(1) Q4_XS_S(2) Q4_XS_S(4) Q4_XS_S(8)
"""
SPLITS = (1, 2, 4, 8)  # the weight's K splits the entries take (cluster sizes ≤ 8)
M_TILES = (1, 2, 4)  # m16 tiles a CTA: 16, 32 or 64 rows
ENTRIES = tuple(f"q4_xs{mt}_2_s{s}_d{d}".encode() for s in SPLITS for mt in M_TILES for d in (4, 2))
COLS = 16  # columns a warp (NT = 2)
WARPS = 8  # warps a CTA by default: 128 columns
MAX_ROWS = 64
MAX_SMEM = 200 * 1024
SOURCE = cuda_route.CLUSTER_DEVICE + XS


def ptx(arch: str = "compute_90", cache: bool = True) -> bytes:
    """XS (with cuda_q4's device code) compiled by NVRTC for `arch` (sm_90 and later)."""
    return cuda_q4.ptx(arch, cache, part="xs", entries=SOURCE)


def _functions(device: int) -> tuple:
    return cuda_q4.module(device, "xs", SOURCE, ENTRIES)


@functools.cache
def available(device: int) -> bool:
    """Whether the xs kernels load on `device` (sm_90 and later, where cuda_q4's do): built
    and loaded on the first ask (NVRTC: ~4 s, then cached on disk)."""
    try:
        if torch.cuda.get_device_capability(device) < (9, 0) or not cuda_q4.available(device):
            return False
        _functions(device)
    except (RuntimeError, OSError):
        return False
    return True


def _plan(lin: Q4Linear, rows: int, warps: int) -> tuple[int, int, int]:
    """(m16 tiles a CTA, ring depth, shared memory bytes) for `rows` rows of x through lin at
    `warps` warps a CTA: the fewest m16 tiles that hold the rows, halved while the staged
    split exceeds MAX_SMEM (more row CTAs, each dequantizing the weight again). The depth
    changes no bit: 2 at 64 rows (126 registers against 152 at 4, so two 256-thread CTAs an
    SM: qkv's 160 CTAs in one wave on 132 SMs), else 4 where a split's blocks come in fours."""
    per = lin.in_features // lin.split  # (q4_layout: the splits divide the k steps evenly)
    mt = next(m for m in M_TILES if 16 * m >= min(rows, 16 * M_TILES[-1]))
    while mt > M_TILES[0] and 16 * mt * (per + 8) * 2 > MAX_SMEM:
        mt //= 2
    depth = 4 if (per // 32) % 4 == 0 and mt < 4 else 2
    return mt, depth, max(16 * mt * (per + 8) * 2, 16 * mt * COLS * warps * 4)


def fits(lin, x: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether `linear` takes these operands: 9-64 rows, a q4 weight of N a multiple of 128, K
    of 64 and 1, 2, 4 or 8 splits; CUDA float32 rows aligned for float4 loads; the staged
    split within MAX_SMEM; sm_90 (clusters) where cuda_q4's kernels load."""
    if not (isinstance(lin, Q4Linear) and 8 < x.shape[0] <= MAX_ROWS and lin.split in SPLITS
            and lin.out_features % (COLS * WARPS) == 0 and lin.in_features % 64 == 0
            and x.is_cuda and x.dtype == torch.float32 and x.stride(1) == 1
            and x.stride(0) % 4 == 0 and x.data_ptr() % 16 == 0):
        return False
    for t in (out,) + ((residual,) if residual is not None else ()):
        if not (t.is_cuda and t.dtype == torch.float32 and t.stride(1) == 1):
            return False
    return _plan(lin, x.shape[0], WARPS)[2] <= MAX_SMEM and available(x.device.index or 0)


def linear(lin: Q4Linear, x: torch.Tensor, out: torch.Tensor,
           residual: torch.Tensor | None = None, warps: int | None = None,
           depth: int | None = None) -> torch.Tensor:
    """out [n, N] = x @ W.T (+ residual), the CTA form's bits (module doc); `fits` first.
    warps (a CTA: 16 columns each, dividing N / 16) and depth (2 or 4) change no bit."""
    n, big_n, k = x.shape[0], lin.out_features, lin.in_features
    warps = warps or WARPS
    mt, auto, smem = _plan(lin, n, warps)
    depth = depth or auto
    if warps not in (2, 4, 8) or big_n % (COLS * warps) or depth not in (2, 4) \
            or (k // lin.split // 32) % depth:
        raise ValueError("cuda_xs: 2, 4 or 8 warps of 16 columns dividing N; depth 2 or 4 "
                         "dividing a split's blocks")
    cuda, fns = _functions(x.device.index or 0)
    res = residual if residual is not None else out
    s = lin.split
    cuda_q4._launch(cuda, fns[f"q4_xs{mt}_2_s{s}_d{depth}".encode()],
                    (big_n // (COLS * warps), s, -(-n // (16 * mt))), 32 * warps, smem,
                    (x, lin.qs, lin.sm.view(torch.int32), res, out),
                    (n, big_n, k, x.stride(0), res.stride(0), out.stride(0),
                     int(residual is not None)))
    return out
