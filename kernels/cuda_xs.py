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
max(16 MT x (per + 8) halves, 16 MT x 16 W floats), per = a split's K. Needs sm_90.

The MoE experts at 9-64 tokens (`experts_grouped`, an experiment, off:
`triton_moe.CUDA_XS_MAX_TOKENS`) are the same CTA over one slot of triton_moe's grouped path
(an expert and the assignments routed to it): the slot's rows gathered and staged 16 (or 32)
a pass, gate_up's epilogue silu(gate) * up into fp16 as the direct CTA form's, down's the
sums — that form's bits, and so the grouped split programs'. Why: at 64 tokens the one-warp
Triton expert programs dequantize each block for ~4 rows at 2.2 weights a warp instruction and
issue on 62-64% of cycles (v21 ncu, H200: gate_up 90.3 µs, down 55.5 a layer at 49-58% of
DRAM's peak); here a lane dequantizes 16 weights in 14 instructions (`dequant`) for all the
slot's rows.
A CTA runs `tiles` column tiles in turn on its staged rows (EXPERT_TILES). grid (N / (16 W
tiles), S, slots); the same cluster; shared memory: the staged rows, the partial tile (apart:
the rows stay for the next tile) and 16 MT ints."""

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

// The split's rows [0, R) of x as fp16 in xs [R][ld] (k = k_lo..), 4 at a time: src(r, k, dst)
// writes row r's x[k..k+3] (zeros for a row it has not)
template <typename Src>
__device__ __forceinline__ void xs_stage(__half* xs, int R, int ld, int k_lo, int k_hi, Src src) {
  const int q4 = (k_hi - k_lo) >> 2;
  for (int e = threadIdx.x; e < R * q4; e += blockDim.x) {
    const int r = e / q4, q = (e - r * q4) * 4;
    src(r, k_lo + q, xs + r * ld + q);
  }
}

// fp32 x rows rounded to fp16 (nearest even, as the CTA form's x_frag); row < 0: zeros
__device__ __forceinline__ void stage_f32(const float* row, __half* dst) {
  const float4 v = row ? __ldg(reinterpret_cast<const float4*>(row))
                       : make_float4(0.f, 0.f, 0.f, 0.f);
  *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(v.x, v.y);
  *reinterpret_cast<__half2*>(dst + 2) = __floats2half2_rn(v.z, v.w);
}

// fp16 x rows (the MoE's intermediate) copied as they are (the CTA form widens them exactly
// and x_frag rounds them back: the same halves)
__device__ __forceinline__ void stage_f16(const __half* row, __half* dst) {
  *reinterpret_cast<uint2*>(dst) = row ? __ldg(reinterpret_cast<const uint2*>(row)) : make_uint2(0u, 0u);
}

// acc = the split's blocks for the warp's 8 NT columns and the staged rows, through the ring of
// D register slots whose first D blocks' loads the caller issued (wb, sb past them)
template <int MT, int NT, int D>
__device__ __forceinline__ void xs_ring(float acc[MT][NT][4], const __half* xs, int ld, int lane,
                                        const unsigned char* wb, const unsigned* sb, long wstep,
                                        int N, int nb, unsigned sel, unsigned w0[D][NT],
                                        unsigned w1[D][NT], unsigned wsm[D][NT]) {
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
}

// The S split CTAs' partial tiles merged: each CTA writes its tile [16 MT][WC] into its shared
// memory at `part` (where it overlaps the staged x, every warp must be past its last
// ldmatrix: the first barrier), and after a cluster barrier CTA sp takes the elements sp,
// sp + S, ... (4 at a time) of rows below `rows`, sums the ranks' partials in split order
// 0..S-1 and hands each quad to epi(r, col0 + its column, v); a second barrier phase keeps
// every CTA (and its shared memory) until no rank reads it any more.
template <int MT, int NT, int S, typename Epi>
__device__ __forceinline__ void xs_merge(float acc[MT][NT][4], float* part, int col0, int rows,
                                         Epi epi) {
  constexpr int C = 8 * NT, R = 16 * MT;
  const int WC = (blockDim.x >> 5) * C, sp = blockIdx.y;
  const int lane = threadIdx.x & 31, c = lane & 3, g = lane >> 2, w = threadIdx.x >> 5;
  __syncthreads();
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
  const int quads = R * WC / 4;
  for (int e = sp + S * (int)threadIdx.x; e < quads; e += S * (int)blockDim.x) {
    const int r = (4 * e) / WC, cc = (4 * e) % WC;
    if (r >= rows) continue;
    float4 v = S > 1 ? load_rank(part + 4 * e, 0) : *reinterpret_cast<const float4*>(part + 4 * e);
#pragma unroll
    for (int q = 1; q < S; ++q) {
      const float4 p = load_rank(part + 4 * e, q);
      v.x = v.x + p.x; v.y = v.y + p.y; v.z = v.z + p.z; v.w = v.w + p.w;
    }
    epi(r, col0 + cc, v);
  }
  if (S > 1) {  // no CTA leaves (or stages over its partials) while another may still read them
    cluster_arrive();
    cluster_wait();
  } else {
    __syncthreads();
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
  const long wstep = (long)N * 16;
  const unsigned char* wb = qs + ((long)(k_lo >> 5) * N + n0 + g) * 16 + word;
  const unsigned* sb = sm + (long)(k_lo >> 5) * N + n0 + g;
#pragma unroll
  for (int j = 0; j < D; ++j) {  // the first D blocks' weights: before the wait (PDL)
    load_block<NT>(wb, sb, w0[j], w1[j], wsm[j]);
    wb += wstep; sb += N;
  }
  pdl_wait();
  xs_stage(xs, R, ld, k_lo, k_hi, [&](int r, int k, __half* dst) {  // rows past M: zeros
    stage_f32(m0 + r < M ? x + (long)(m0 + r) * stride_x + k : nullptr, dst);
  });
  __syncthreads();
  float acc[MT][NT][4];
  xs_ring<MT, NT, D>(acc, xs, ld, lane, wb, sb, wstep, N, (k_hi - k_lo) >> 5, sel, w0, w1, wsm);
  xs_merge<MT, NT, S>(acc, reinterpret_cast<float*>(smem), blockIdx.x * WC, M - m0,
                      [&](int r, long col, float4 v) {
    float* yr = y + (long)(m0 + r) * stride_y + col;
    if (has_res) {
      const float* rr = res + (long)(m0 + r) * stride_res + col;
      v.x = rr[0] + v.x; v.y = rr[1] + v.y; v.z = rr[2] + v.z; v.w = rr[3] + v.w;
    }
    yr[0] = v.x; yr[1] = v.y; yr[2] = v.z; yr[3] = v.w;
  });
}

// ---- the MoE experts at 9-64 tokens (triton_moe's grouped path): a CTA one slot (an expert
// and the assignments routed to it, from triton_moe_route.align's meta / arows), one K split
// and `tiles` column tiles of 16 W in turn; the slot's rows are staged as fp16 16 MT at a time
// (once for all the tiles) and each weight block is dequantized once for all of them; the split
// CTAs are one cluster, merged in split order. The next tile's first D weight blocks are loaded
// before a tile's merge. GATE_UP: x the tokens' fp32 rows (token a / topk of assignment a); the
// columns interleave gate and up, so a quad of columns gives inter[a, col / 2 ..+1] =
// silu(gate) * up in fp16 (q4_expert_cta's silu_mul). Else (down): x = inter[a] (fp16),
// y[a, col..] = the sums. GATE_UP waits first (align, its predecessor, wrote meta); down reads
// meta / arows (two kernels back, final by then) and its first weights before its wait. A slot
// past meta[0] leaves at once (the whole cluster: the slot is the cluster's). Shared memory:
// the staged rows [16 MT][per + 8] halves, the partial tile [16 MT][16 W] floats, 16 MT ints.
template <int MT, int NT, int D, int S, bool GATE_UP>
__device__ __forceinline__ void q4_xs_experts(const void* __restrict__ xv, const int* __restrict__ meta,
                                              const int* __restrict__ arows,
                                              const unsigned char* __restrict__ qs,
                                              const unsigned* __restrict__ sm, void* __restrict__ outv,
                                              int T, int N, int K, int stride_x, int stride_out,
                                              int topk, int tiles) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int C = 8 * NT, R = 16 * MT;
  const int W = blockDim.x >> 5, WC = W * C;
  const int lane = threadIdx.x & 31, c = lane & 3, g = lane >> 2, w = threadIdx.x >> 5;
  const int sp = blockIdx.y, slot = blockIdx.z, t0 = blockIdx.x * tiles;
  if (GATE_UP) pdl_wait();
  if (slot >= meta[0]) return;
  const long e = meta[1 + 2 * slot];
  const int count = meta[2 + 2 * slot];
  const int* mine = arows + (long)slot * T;
  const long per_expert = (long)(K >> 5) * N;  // an expert's blocks (and (scale, min) words)
  int k_lo, k_hi, word;
  unsigned sel;
  split_k(K, S, sp, k_lo, k_hi);
  lane_bytes(c, sel, word);
  const int per = ((K / 64 + S - 1) / S) * 64, ld = per + 8;
  __half* xs = reinterpret_cast<__half*>(smem);
  float* part = reinterpret_cast<float*>(smem + R * ld * 2);
  int* arow = reinterpret_cast<int*>(smem + R * ld * 2 + R * WC * 4);  // the pass's assignments
  const long wstep = (long)N * 16;
  // tile t's column base for this warp, and its first block's words
  const unsigned char* w_base =
      qs + (e * per_expert + (long)(k_lo >> 5) * N + g + w * C) * 16 + word;
  const unsigned* s_base = sm + e * per_expert + (long)(k_lo >> 5) * N + g + w * C;
  const int nb = (k_hi - k_lo) >> 5;
  unsigned w0[D][NT], w1[D][NT], wsm[D][NT];
  const unsigned char* wb = w_base + (long)t0 * WC * 16;
  const unsigned* sb = s_base + (long)t0 * WC;
#pragma unroll
  for (int j = 0; j < D; ++j) {
    load_block<NT>(wb, sb, w0[j], w1[j], wsm[j]);
    wb += wstep; sb += N;
  }
  if (!GATE_UP) pdl_wait();  // down: gate_up wrote inter
  for (int m0 = 0; m0 < count; m0 += R) {  // the slot's rows, R at a time
    for (int r = threadIdx.x; r < R; r += blockDim.x) arow[r] = m0 + r < count ? mine[m0 + r] : -1;
    __syncthreads();
    if constexpr (GATE_UP) {
      const float* x = reinterpret_cast<const float*>(xv);
      xs_stage(xs, R, ld, k_lo, k_hi, [&](int r, int k, __half* dst) {
        stage_f32(arow[r] >= 0 ? x + (long)(arow[r] / topk) * stride_x + k : nullptr, dst);
      });
    } else {
      const __half* x = reinterpret_cast<const __half*>(xv);
      xs_stage(xs, R, ld, k_lo, k_hi, [&](int r, int k, __half* dst) {
        stage_f16(arow[r] >= 0 ? x + (long)arow[r] * stride_x + k : nullptr, dst);
      });
    }
    __syncthreads();
    for (int t = 0; t < tiles; ++t) {
      float acc[MT][NT][4];
      xs_ring<MT, NT, D>(acc, xs, ld, lane, wb, sb, wstep, N, nb, sel, w0, w1, wsm);
      // the next tile's (or the next pass's first tile's) first D blocks, before the merge
      const int tn = t + 1 < tiles ? t0 + t + 1 : (m0 + R < count ? t0 : -1);
      if (tn >= 0) {
        wb = w_base + (long)tn * WC * 16;
        sb = s_base + (long)tn * WC;
#pragma unroll
        for (int j = 0; j < D; ++j) {
          load_block<NT>(wb, sb, w0[j], w1[j], wsm[j]);
          wb += wstep; sb += N;
        }
      }
      xs_merge<MT, NT, S>(acc, part, (t0 + t) * WC, count - m0, [&](int r, long col, float4 v) {
        const long a = arow[r];
        if constexpr (GATE_UP) {  // columns col, col + 1: gate j, up j (j = col / 2); + 2, + 3
          __half* o = reinterpret_cast<__half*>(outv) + a * stride_out + col / 2;
          *reinterpret_cast<__half2*>(o) = __halves2half2(__float2half_rn(silu_mul(v.x, v.y)),
                                                          __float2half_rn(silu_mul(v.z, v.w)));
        } else {
          float* yr = reinterpret_cast<float*>(outv) + a * stride_out + col;
          yr[0] = v.x; yr[1] = v.y; yr[2] = v.z; yr[3] = v.w;
        }
      });
    }
  }
}
"""
XS_ENTRIES = r"""
#define Q4_XS(MT, S, D) extern "C" __global__ void __cluster_dims__(1, S, 1) \
    __launch_bounds__(256, D == 2 ? 2 : 1) \
    q4_xs##MT##_2_s##S##_d##D(const float* x, const unsigned char* qs, const unsigned* sm, \
                              const float* res, float* y, int M, int N, int K, int stride_x, \
                              int stride_res, int stride_y, int has_res) { \
    q4_xs<MT, 2, D, S>(x, qs, sm, res, y, M, N, K, stride_x, stride_res, stride_y, has_res); }
#define Q4_XS_S(S) Q4_XS(1, S, 4) Q4_XS(2, S, 4) Q4_XS(4, S, 4) Q4_XS(1, S, 2) Q4_XS(2, S, 2) \
    Q4_XS(4, S, 2)
Q4_XS_S(1) Q4_XS_S(2) Q4_XS_S(4) Q4_XS_S(8)
"""
XE = r"""
#define Q4_XE(KIND, GU, MT, S, D) extern "C" __global__ void __cluster_dims__(1, S, 1) \
    __launch_bounds__(256, MT * D > 8 ? 1 : 2) q4_xe##KIND##MT##_s##S##_d##D( \
        const void* x, const int* meta, const int* arows, const unsigned char* qs, \
        const unsigned* sm, void* out, int T, int N, int K, int stride_x, int stride_out, \
        int topk, int tiles) { \
    q4_xs_experts<MT, 2, D, S, GU>(x, meta, arows, qs, sm, out, T, N, K, stride_x, stride_out, \
                                   topk, tiles); }
#define Q4_XE_D(KIND, GU, MT, S) Q4_XE(KIND, GU, MT, S, 2) Q4_XE(KIND, GU, MT, S, 4) \
    Q4_XE(KIND, GU, MT, S, 8)
#define Q4_XE_S(S) Q4_XE_D(gu, true, 1, S) Q4_XE_D(gu, true, 2, S) Q4_XE_D(dn, false, 1, S) \
    Q4_XE_D(dn, false, 2, S)
Q4_XE_S(1) Q4_XE_S(2) Q4_XE_S(4) Q4_XE_S(8)
"""
SPLITS = (1, 2, 4, 8)  # the weight's K splits the entries take (cluster sizes ≤ 8)
M_TILES = (1, 2, 4)  # m16 tiles a CTA: 16, 32 or 64 rows
ENTRIES = tuple(f"q4_xs{mt}_2_s{s}_d{d}".encode() for s in SPLITS for mt in M_TILES for d in (4, 2))
COLS = 16  # columns a warp (NT = 2)
WARPS = 8  # warps a CTA by default: 128 columns
MAX_ROWS = 64
MAX_SMEM = 200 * 1024
SOURCE = cuda_route.CLUSTER_DEVICE + XS + XS_ENTRIES
# the experts' entries (a module of their own, built on its first launch): gate_up / down, 16 or
# 32 rows a pass (MT), the split count, the ring depth
EXPERT_M_TILES = (1, 2)
EXPERT_DEPTHS = (2, 4, 8)
EXPERT_ENTRIES = tuple(f"q4_xe{kind}{mt}_s{s}_d{d}".encode() for s in SPLITS
                       for kind in ("gu", "dn") for mt in EXPERT_M_TILES for d in EXPERT_DEPTHS)
EXPERT_SOURCE = cuda_route.CLUSTER_DEVICE + XS + XE
EXPERT_ROWS = 16  # assignments a pass (MT = 1): 64 tokens' top-8 over 128 experts give ~4 a slot
EXPERT_DEPTH = 8  # blocks in flight a warp (the deepest dividing a split's blocks)
# column tiles (of 16 W) a CTA runs in turn on its staged rows (the most dividing N's, up to
# this): fewer, longer-lived CTAs, the wait, the slot's ids and the staging once for them all
EXPERT_TILES = 2


def ptx(arch: str = "compute_90", cache: bool = True, experts: bool = False) -> bytes:
    """XS (with cuda_q4's device code; experts: the experts' entries too) compiled by NVRTC
    for `arch` (sm_90 and later)."""
    return cuda_q4.ptx(arch, cache, part="xe" if experts else "xs",
                       entries=EXPERT_SOURCE if experts else SOURCE)


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


# ---- the MoE experts at 9-64 tokens -----------------------------------------------------------
@functools.cache
def experts_available(device: int) -> bool:
    """Whether the experts' entries load on `device` (built on the first ask)."""
    try:
        if not available(device):
            return False
        cuda_q4.module(device, "xe", EXPERT_SOURCE, EXPERT_ENTRIES)
    except (RuntimeError, OSError):
        return False
    return True


def _expert_plan(n: int, k: int, split: int, rows: int, depth: int,
                 tiles: int = 1) -> tuple[int, int, int, int]:
    """(m16 tiles a pass, ring depth, shared memory bytes, column tiles a CTA) of one expert
    GEMM [n, k] in `split` K splits: the deepest ring up to `depth` dividing the split's
    blocks; the staged rows, the partial tile and 16 MT ints; the most column tiles up to
    `tiles` dividing n's."""
    mt = rows // 16
    per = -(-k // 64 // split) * 64
    d = depth
    while (per // 32) % d:
        d //= 2
    t = max(v for v in range(1, tiles + 1) if (n // (COLS * WARPS)) % v == 0)
    return mt, d, 16 * mt * ((per + 8) * 2 + COLS * WARPS * 4 + 4), t


def experts_fit(experts, x: torch.Tensor, t: int) -> bool:
    """Whether `experts_grouped` takes these stacked q4 experts for t tokens of x: 9-64
    tokens, both GEMMs of N a multiple of 128 and K in 1, 2, 4 or 8 splits of whole k steps
    of 64 each, CUDA fp32 x
    whose rows float4 loads reach, sm_90 where the kernels load."""
    if experts.fmt != "q4" or not (8 < t <= MAX_ROWS) or not x.is_cuda \
            or x.dtype != torch.float32 or x.stride(1) != 1 or x.stride(0) % 4 \
            or x.data_ptr() % 16:
        return False
    i, h = experts.inter, experts.hidden
    (gw, gs), (dw, ds) = experts.gu, experts.down
    return (all(v.is_contiguous() for v in (gw, gs, dw, ds))
            and experts.tile is not None and experts.tile.bk == 64  # the splits' k steps
            and experts.gu_split in SPLITS and experts.down_split in SPLITS
            and (2 * i) % (COLS * WARPS) == 0 and h % (COLS * WARPS) == 0
            and h % (64 * experts.gu_split) == 0 and i % (64 * experts.down_split) == 0
            and max(_expert_plan(2 * i, h, experts.gu_split, EXPERT_ROWS, EXPERT_DEPTH)[2],
                    _expert_plan(h, i, experts.down_split, EXPERT_ROWS, EXPERT_DEPTH)[2]) <= MAX_SMEM
            and experts_available(x.device.index or 0))


def experts_grouped(x: torch.Tensor, meta: torch.Tensor, arows: torch.Tensor, top_k: int,
                    experts, inter: torch.Tensor, y: torch.Tensor, rows: int | None = None,
                    depth: int | None = None, tiles: int | None = None) -> None:
    """triton_moe's grouped q4 experts (`experts_fit` first): meta / arows from
    triton_moe_route.align of the [T, top_k] ids; inter [T*k, I] fp16 = silu(x W_gate.T) *
    (x W_up.T), then y [T*k, hidden] fp32 = inter W_down.T — each slot's rows staged once a
    pass, the weight's K splits one cluster merged in split order: the bits of the direct CTA
    form (q4_expert_cta) and of triton_moe's split programs, row for row. rows (16 or 32 a
    pass), depth and tiles (column tiles a CTA) change no bit."""
    rows, depth, tiles = rows or EXPERT_ROWS, depth or EXPERT_DEPTH, tiles or EXPERT_TILES
    if rows not in tuple(16 * m for m in EXPERT_M_TILES) or depth not in EXPERT_DEPTHS:
        raise ValueError("cuda_xs: experts take 16 or 32 rows a pass and a depth of 2, 4 or 8")
    if inter.dtype != torch.float16 or y.dtype != torch.float32 or not inter.is_contiguous() \
            or not y.is_contiguous() or meta.dtype != torch.int32 or arows.dtype != torch.int32 \
            or not arows.is_contiguous():
        raise ValueError("cuda_xs: inter fp16, y fp32, meta / arows int32, all contiguous")
    t = x.shape[0]
    slots = arows.shape[0]
    if inter.shape[0] != t * top_k or y.shape[0] != t * top_k or arows.shape[1] != t:
        raise ValueError("cuda_xs: inter and y [T*k, ...], arows [slots, T]")
    if slots == 0:
        return
    i, h = experts.inter, experts.hidden
    cuda, fns = cuda_q4.module(x.device.index or 0, "xe", EXPERT_SOURCE, EXPERT_ENTRIES)
    (gw, gs), (dw, ds) = experts.gu, experts.down
    for kind, src, w, s, dst, n, k, split in (("gu", x, gw, gs, inter, 2 * i, h, experts.gu_split),
                                               ("dn", inter, dw, ds, y, h, i, experts.down_split)):
        mt, d, smem, nt = _expert_plan(n, k, split, rows, depth, tiles)
        cuda_q4._launch(cuda, fns[f"q4_xe{kind}{mt}_s{split}_d{d}".encode()],
                        (n // (COLS * WARPS) // nt, split, slots), 32 * WARPS, smem,
                        (src, meta, arows, w, s.view(torch.int32), dst),
                        (t, n, k, src.stride(0), dst.stride(0), top_k, nt))
