"""The q4 GEMM's split programs as a CUDA kernel (an experiment: not on the engine's path).

Triton cannot express the schedule the q4 GEMM at 1-16 rows wants (GPU_NOTES v14), so this is
the decode tile (kernels/triton_q4.py, LINEAR_TILE with parallel K splits) written in CUDA C++
with the same arithmetic, to be measured against it:

- x rounded to fp16 (round to nearest even), the weights `q * s + m` as one fp16 FMA
  (`__hfma2`, the HFMA2 Triton emits), the nibbles unpacked by the same PRMT/LOP3 sequence;
- `mma.sync.m16n8k16` (f16 x f16 + f32), x as A, the weight as B, k16 chunks in the same order
  (a 32-block's low nibbles, then its high ones, blocks ascending);
- the same split ranges (`q4_layout.split_count`), partials in `ws [S, rows, N]`, and the last
  program of a tile (a ticket) sums them in split order 0..S-1, then adds the residual.

So it should give the decode tile's bits (tests/kernels/test_cuda_q4.py checks that on a GPU).
What differs is the schedule: a warp takes 8, 16 or 32 columns of a split (Triton's tile: 64),
so at 1-16 rows more warps run (which columns share a warp changes no bit), and its weights go
from global memory straight into B fragments (a column's block is 16 contiguous bytes; a lane
needs bytes 2c, 2c+1, 2c+8, 2c+9 of it, c = lane % 4, for both of the block's k16 chunks),
either through a ring of `depth` register slots (loads of weights and x that many blocks ahead
of the MMAs) or (STREAM) with the warp's whole split streamed into shared memory by cp.async
first. Its own ticket counters (one a row tile and column tile) sit beside the weight. A third
form (SLICE, `q4_slice`) gives a CTA one column slice and all its splits: its warps dequantize
the slice's blocks into shared memory together, one warp a split runs that split's MMA chain in
the usual order, and the partials are summed in split order in shared memory (no ticket).

Measured on the H100 (GPU_NOTES v15): the same bits everywhere, but no faster than the Triton
tile at 1-8 rows of qkv and o (the chain of dependent MMAs and the split merge set the time,
not the bytes in flight); 32 columns a warp beat it on the lm_head (82.5% against 77% of
copy). So it stays an experiment: `triton_linear.CUDA_MAX_ROWS` routes rows to it (off), and
PROBES time its parts (loads alone, no merge, two accumulator chains). The SLICE form was
written after the device time of its session: its bits and speed are unmeasured.

Built at run time: NVRTC (found in the nvidia wheels beside torch, or pip's
nvidia-cuda-nvrtc-cu12) compiles the source to PTX for the device's compute capability, and
the driver loads the PTX (libcuda `cuModuleLoadData`). `ptx()` runs without a GPU.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import site
import weakref

import torch

from kernels import q4_layout
from kernels.q4_layout import LINEAR_TILE, Q4Linear

SOURCE = r"""
#include <cuda_fp16.h>

__device__ __forceinline__ unsigned half2_bits(__half2 h) { return *reinterpret_cast<unsigned*>(&h); }
__device__ __forceinline__ __half2 bits_half2(unsigned u) { return *reinterpret_cast<__half2*>(&u); }

// The two k16 B fragments (low nibbles: k = kb + j; high: k = kb + 16 + j) of one column's
// block, as fp16 q * s + m, from bytes b0 = 2c, b1 = 2c+1 (in word w0 at byte 2(c&1)) and
// b2 = 2c+8, b3 = 2c+9 (in w1): kernels/triton_q4.py `_nibbles_asm`, then one HFMA2 a pair.
__device__ __forceinline__ void dequant(unsigned w0, unsigned w1, unsigned sel, unsigned sm,
                                        unsigned lo[2], unsigned hi[2]) {
  unsigned t, u, l0, l1, h0, h1;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(t) : "r"(w0), "r"(w1), "r"(sel));  // b0 b2 b1 b3
  u = t >> 8;
  asm("lop3.b32 %0, %1, 0x000F000F, 0x64006400, 0xEA;" : "=r"(l0) : "r"(t));
  asm("lop3.b32 %0, %1, 0x000F000F, 0x64006400, 0xEA;" : "=r"(l1) : "r"(u));
  asm("lop3.b32 %0, %1, 0x00F000F0, 0x64006400, 0xEA;" : "=r"(h0) : "r"(t));
  asm("lop3.b32 %0, %1, 0x00F000F0, 0x64006400, 0xEA;" : "=r"(h1) : "r"(u));
  const unsigned c0 = 0x64006400u, c1 = 0x2C002C00u, c2 = 0xD400D400u;
  asm("sub.f16x2 %0, %0, %1;" : "+r"(l0) : "r"(c0));
  asm("sub.f16x2 %0, %0, %1;" : "+r"(l1) : "r"(c0));
  asm("fma.rn.f16x2 %0, %0, %1, %2;" : "+r"(h0) : "r"(c1), "r"(c2));
  asm("fma.rn.f16x2 %0, %0, %1, %2;" : "+r"(h1) : "r"(c1), "r"(c2));
  // (scale, scale) and (min, min): halves of one word, which the HFMA2 reads as operand
  // swizzles (H0_H0, H1_H1) rather than moved apart
  const __half2 pair = bits_half2(sm);
  const __half2 s2 = __low2half2(pair), m2 = __high2half2(pair);
  lo[0] = half2_bits(__hfma2(bits_half2(l0), s2, m2));
  lo[1] = half2_bits(__hfma2(bits_half2(l1), s2, m2));
  hi[0] = half2_bits(__hfma2(bits_half2(h0), s2, m2));
  hi[1] = half2_bits(__hfma2(bits_half2(h1), s2, m2));
}

__device__ __forceinline__ void mma(float d[4], const unsigned a[4], const unsigned b[2]) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
               "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// x for the block at kb, raw: row r0's pairs (k = kb + 2c, 2c+1; + 8; + 16; + 24) in p[0..3]
// and, ROWS16, row r0 + 8's in p[4..7]; rows past M read 0. (Loaded with the block's weights,
// D blocks ahead, so no x load sits in the MMA chain.)
template <bool ROWS16>
__device__ __forceinline__ void load_x(const float* x0, const float* x1, bool v0, bool v1,
                                       int kb, int c, float2 p[ROWS16 ? 8 : 4]) {
#pragma unroll
  for (int h = 0; h < 4; ++h)
    p[h] = v0 ? __ldg(reinterpret_cast<const float2*>(x0 + kb + 2 * c + 8 * h)) : make_float2(0.f, 0.f);
  if (ROWS16) {
#pragma unroll
    for (int h = 0; h < 4; ++h)
      p[4 + h] = v1 ? __ldg(reinterpret_cast<const float2*>(x1 + kb + 2 * c + 8 * h)) : make_float2(0.f, 0.f);
  }
}

// The A fragment of the k16 chunk `chunk` (0: k = kb..kb+15, 1: kb+16..kb+31) from load_x's
// pairs: rows r0 (a0a1, a4a5) and r0 + 8 (a2a3, a6a7), k = 2c, 2c+1 and 2c+8, 2c+9, rounded to
// fp16 (nearest even); rows 8-15 are 0 unless ROWS16.
template <bool ROWS16>
__device__ __forceinline__ void x_frag(const float2* p, int chunk, unsigned a[4]) {
  a[0] = half2_bits(__floats2half2_rn(p[2 * chunk].x, p[2 * chunk].y));
  a[2] = half2_bits(__floats2half2_rn(p[2 * chunk + 1].x, p[2 * chunk + 1].y));
  if (ROWS16) {
    a[1] = half2_bits(__floats2half2_rn(p[4 + 2 * chunk].x, p[4 + 2 * chunk].y));
    a[3] = half2_bits(__floats2half2_rn(p[5 + 2 * chunk].x, p[5 + 2 * chunk].y));
  } else {
    a[1] = a[3] = 0u;
  }
}

// The words lane (g, c) needs of one block for columns col + 8i, i < NT: bytes 2c, 2c+1 (w0)
// and 2c+8, 2c+9 (w1) of each column's 16, and its (scale, min) pair (s); wb and sb point at
// the lane's word and pair of the block's column col.
template <int NT>
__device__ __forceinline__ void load_block(const unsigned char* wb, const unsigned* sb,
                                           unsigned w0[NT], unsigned w1[NT], unsigned s[NT]) {
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    w0[i] = __ldg(reinterpret_cast<const unsigned*>(wb + i * 128));
    w1[i] = __ldg(reinterpret_cast<const unsigned*>(wb + i * 128 + 8));
    s[i] = __ldg(sb + i * 8);
  }
}

// acc += the block at kb: its low-nibble k16 chunk, then its high one, for the NT n8 tiles.
template <bool ROWS16, int NT>
__device__ __forceinline__ void block_mma(float acc[NT][4], const float2* p, unsigned sel,
                                          const unsigned w0[NT], const unsigned w1[NT],
                                          const unsigned s[NT]) {
  unsigned a_lo[4], a_hi[4];
  x_frag<ROWS16>(p, 0, a_lo);
  x_frag<ROWS16>(p, 1, a_hi);
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    unsigned lo[2], hi[2];
    dequant(w0[i], w1[i], sel, s[i], lo, hi);
    mma(acc[i], a_lo, lo);
    mma(acc[i], a_hi, hi);
  }
}

// acc += the split [k_lo, k_hi) of the 8 NT columns from n0, its blocks through a ring of D
// register slots: D blocks' loads (weights and x) in flight ahead of the MMAs, which take the
// blocks in ascending order. nb % D == 0 (the host picks D); the last round only computes.
template <bool ROWS16, int NT, int D>
__device__ __forceinline__ void ring_acc(float acc[NT][4], const unsigned char* __restrict__ qs,
                                         const unsigned* __restrict__ sm, const float* x0,
                                         const float* x1, bool v0, bool v1, int N, int k_lo,
                                         int k_hi, int n0, int g, int c, int word, unsigned sel) {
  unsigned w0[D][NT], w1[D][NT], wsm[D][NT];
  float2 xp[D][ROWS16 ? 8 : 4];
  const int nb = (k_hi - k_lo) >> 5;
  const long wstep = (long)N * 16;  // bytes from a column's block to its next block
  const unsigned char* wb = qs + ((long)(k_lo >> 5) * N + n0 + g) * 16 + word;
  const unsigned* sb = sm + (long)(k_lo >> 5) * N + n0 + g;
  const float* xa = x0 + k_lo;
  const float* xb = x1 + k_lo;
#pragma unroll
  for (int j = 0; j < D; ++j) {
    load_block<NT>(wb, sb, w0[j], w1[j], wsm[j]);
    load_x<ROWS16>(xa, xb, v0, v1, 0, c, xp[j]);
    wb += wstep; sb += N; xa += 32; xb += 32;
  }
  for (int r = D; r < nb; r += D) {
#pragma unroll
    for (int j = 0; j < D; ++j) {
      block_mma<ROWS16, NT>(acc, xp[j], sel, w0[j], w1[j], wsm[j]);
      load_block<NT>(wb, sb, w0[j], w1[j], wsm[j]);
      load_x<ROWS16>(xa, xb, v0, v1, 0, c, xp[j]);
      wb += wstep; sb += N; xa += 32; xb += 32;
    }
  }
#pragma unroll
  for (int j = 0; j < D; ++j) block_mma<ROWS16, NT>(acc, xp[j], sel, w0[j], w1[j], wsm[j]);
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(d), "l"(src) : "memory");
}

// acc += the same split, its weights streamed whole into shared memory first: the warp issues
// cp.async for all its blocks at once (4 commit groups of nb / 4 blocks), so every byte of the
// split is in flight together, then computes each group as it lands (x through a 4-slot
// register ring). Shared memory: nb x 8 NT x 20 bytes a warp (one warp a CTA). nb % 16 == 0.
template <bool ROWS16, int NT, int P = 0>
__device__ __forceinline__ void stream_acc(float acc[NT][4], const unsigned char* __restrict__ qs,
                                           const unsigned* __restrict__ sm, const float* x0,
                                           const float* x1, bool v0, bool v1, int N, int k_lo,
                                           int k_hi, int n0, int g, int c, int word, unsigned sel) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int QB = NT * 8 * 16, SB = NT * 8 * 4, CH = (QB + SB) / 16;  // bytes, 16 B chunks a block
  const int lane = threadIdx.x & 31;
  const int nb = (k_hi - k_lo) >> 5, per_group = nb >> 2;
  unsigned char* sq = smem + (threadIdx.x >> 5) * nb * (QB + SB);  // this warp's part
  unsigned char* ss = sq + nb * QB;
  const unsigned char* gq = qs + ((long)(k_lo >> 5) * N + n0) * 16;
  const unsigned char* gs = reinterpret_cast<const unsigned char*>(sm + (long)(k_lo >> 5) * N + n0);
#pragma unroll
  for (int grp = 0; grp < 4; ++grp) {
    for (int i = lane; i < per_group * CH; i += 32) {
      const int b = grp * per_group + i / CH, ch = i % CH;
      if (ch < QB / 16)
        cp_async16(sq + b * QB + ch * 16, gq + (long)b * N * 16 + ch * 16);
      else
        cp_async16(ss + b * SB + (ch - QB / 16) * 16, gs + (long)b * N * 4 + (ch - QB / 16) * 16);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  float2 xp[4][ROWS16 ? 8 : 4];
  float acc2[NT][4] = {};
  const float* xa = x0 + k_lo;
  const float* xb = x1 + k_lo;
#pragma unroll
  for (int j = 0; j < 4; ++j) load_x<ROWS16>(xa, xb, v0, v1, 32 * j, c, xp[j]);
#pragma unroll
  for (int grp = 0; grp < 4; ++grp) {
    if (grp == 0) asm volatile("cp.async.wait_group 3;" ::: "memory");
    if (grp == 1) asm volatile("cp.async.wait_group 2;" ::: "memory");
    if (grp == 2) asm volatile("cp.async.wait_group 1;" ::: "memory");
    if (grp == 3) asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncwarp();
    for (int b0 = grp * per_group; b0 < (grp + 1) * per_group; b0 += 4) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int b = b0 + j;
        unsigned w0[NT], w1[NT], s[NT];
#pragma unroll
        for (int i = 0; i < NT; ++i) {
          w0[i] = *reinterpret_cast<const unsigned*>(sq + b * QB + (g + 8 * i) * 16 + word);
          w1[i] = *reinterpret_cast<const unsigned*>(sq + b * QB + (g + 8 * i) * 16 + word + 8);
          s[i] = *reinterpret_cast<const unsigned*>(ss + b * SB + (g + 8 * i) * 4);
        }
        if constexpr (P == 1)  // probe: the loads alone
          acc[0][0] += __uint_as_float((w0[0] ^ w1[NT - 1] ^ s[0]) & 0x3FFFFFu);
        else if (P == 3 && (j & 1))  // probe: odd blocks on a second accumulator chain
          block_mma<ROWS16, NT>(acc2, xp[j], sel, w0, w1, s);
        else
          block_mma<ROWS16, NT>(acc, xp[j], sel, w0, w1, s);
        if (b + 4 < nb) load_x<ROWS16>(xa, xb, v0, v1, 32 * (b + 4), c, xp[j]);
      }
    }
  }
  if constexpr (P == 3) {
#pragma unroll
    for (int i = 0; i < NT; ++i)
      for (int e = 0; e < 4; ++e) acc[i][e] += acc2[i][e];
  }
}

// One CTA a column slice (8 NT columns, rows m0..m0+15), every K split of it inside: the slice's
// raw bytes stream into shared memory by cp.async in 4 rounds (a round: R = nbs / 4 blocks of
// each split, one commit group); in each round all W warps dequantize the round's blocks into
// B fragments and round x into A fragments (shared memory), then warp s < S runs split s's MMA
// chain over them — the split's blocks in ascending order, as the decode tile — and at the end
// warp 0 sums the S partials in split order 0..S-1 (the ticket merge's order) in shared memory.
// So the dequant work of a chain is spread over the CTA's warps while each chain keeps its
// order, and no partial goes through global memory. W >= S; nbs (blocks a split) % 4 == 0.
template <bool ROWS16, int NT>
__device__ __forceinline__ void q4_slice(const float* __restrict__ x, const unsigned char* __restrict__ qs,
                                         const unsigned* __restrict__ sm, const float* __restrict__ res,
                                         float* __restrict__ y, int M, int N, int K, int stride_x,
                                         int stride_res, int stride_y, int S, int has_res) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int QB = NT * 8 * 16, SB = NT * 8 * 4, CH = (QB + SB) / 16, XW = ROWS16 ? 2 : 1;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, W = blockDim.x >> 5;
  const int c = lane & 3, g = lane >> 2;
  const int n0 = blockIdx.x * 8 * NT, m0 = blockIdx.z * 16;
  const int NB = K >> 5, nbs = NB / S, R = nbs >> 2;
  unsigned char* sq = smem;                                        // [NB][QB] raw nibbles
  unsigned char* ss = sq + NB * QB;                                // [NB][SB] (scale, min)
  uint4* frag = reinterpret_cast<uint4*>(ss + NB * SB);            // [S][R][NT][32] B fragments
  uint4* xf = frag + S * R * NT * 32;                              // [S][R][XW][32] A fragments
  float4* part = reinterpret_cast<float4*>(xf + S * R * XW * 32);  // [S][NT][32] partials
  const unsigned char* gq = qs + (long)n0 * 16;
  const unsigned char* gs = reinterpret_cast<const unsigned char*>(sm + n0);
#pragma unroll
  for (int r = 0; r < 4; ++r) {  // round r's blocks of every split: one commit group
    for (int i = threadIdx.x; i < S * R * CH; i += blockDim.x) {
      const int sj = i / CH, ch = i % CH;
      const int b = (sj / R) * nbs + r * R + sj % R;
      if (ch < QB / 16)
        cp_async16(sq + b * QB + ch * 16, gq + (long)b * N * 16 + ch * 16);
      else
        cp_async16(ss + b * SB + (ch - QB / 16) * 16, gs + (long)b * N * 4 + (ch - QB / 16) * 16);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  const int r0 = m0 + g, r1 = m0 + g + 8;
  const bool v0 = r0 < M, v1 = r1 < M;
  const float* x0 = x + (long)(v0 ? r0 : 0) * stride_x;
  const float* x1 = x + (long)(v1 ? r1 : 0) * stride_x;
  const unsigned sel = (c & 1) ? 0x7362u : 0x5140u;
  const int word = (c >> 1) * 4;
  float acc[NT][4];
#pragma unroll
  for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    // x of this warp's A-fragment items (item sj = warp + q W, q < 4: S R <= 4 W, the host
    // sees to it), loaded before the wait so that their latency overlaps the weights'
    float2 px[4][ROWS16 ? 8 : 4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int sj = warp + q * W;
      if (sj < S * R) load_x<ROWS16>(x0, x1, v0, v1, ((sj / R) * nbs + r * R + sj % R) << 5, c, px[q]);
    }
    if (r == 0) asm volatile("cp.async.wait_group 3;" ::: "memory");
    if (r == 1) asm volatile("cp.async.wait_group 2;" ::: "memory");
    if (r == 2) asm volatile("cp.async.wait_group 1;" ::: "memory");
    if (r == 3) asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();  // every thread's copies of round r have landed
    // produce: the round's S R NT B fragments, a warp an item, then this warp's A fragments
    for (int it = warp; it < S * R * NT; it += W) {
      const int sj = it / NT, i = it % NT;
      const int b = (sj / R) * nbs + r * R + sj % R;
      const unsigned w0 = *reinterpret_cast<const unsigned*>(sq + b * QB + (g + 8 * i) * 16 + word);
      const unsigned w1 = *reinterpret_cast<const unsigned*>(sq + b * QB + (g + 8 * i) * 16 + word + 8);
      const unsigned sc = *reinterpret_cast<const unsigned*>(ss + b * SB + (g + 8 * i) * 4);
      unsigned lo[2], hi[2];
      dequant(w0, w1, sel, sc, lo, hi);
      frag[(sj * NT + i) * 32 + lane] = make_uint4(lo[0], lo[1], hi[0], hi[1]);
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int sj = warp + q * W;
      if (sj < S * R) {
        unsigned a_lo[4], a_hi[4];
        x_frag<ROWS16>(px[q], 0, a_lo);
        x_frag<ROWS16>(px[q], 1, a_hi);
        xf[(sj * XW) * 32 + lane] = make_uint4(a_lo[0], a_lo[2], a_hi[0], a_hi[2]);
        if (ROWS16) xf[(sj * XW + 1) * 32 + lane] = make_uint4(a_lo[1], a_lo[3], a_hi[1], a_hi[3]);
      }
    }
    __syncthreads();
    if (warp < S) {  // consume: split `warp`'s chain over its R blocks of this round
      for (int j = 0; j < R; ++j) {
        const int sj = warp * R + j;
        const uint4 xa = xf[(sj * XW) * 32 + lane];
        uint4 xb = make_uint4(0u, 0u, 0u, 0u);
        if (ROWS16) xb = xf[(sj * XW + 1) * 32 + lane];
        const unsigned a_lo[4] = {xa.x, xb.x, xa.y, xb.y}, a_hi[4] = {xa.z, xb.z, xa.w, xb.w};
#pragma unroll
        for (int i = 0; i < NT; ++i) {
          const uint4 f = frag[(sj * NT + i) * 32 + lane];
          const unsigned lo[2] = {f.x, f.y}, hi[2] = {f.z, f.w};
          mma(acc[i], a_lo, lo);
          mma(acc[i], a_hi, hi);
        }
      }
    }
    __syncthreads();  // the next round overwrites frag and xf
  }
  if (warp < S) {
#pragma unroll
    for (int i = 0; i < NT; ++i)
      part[(warp * NT + i) * 32 + lane] = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
  }
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int i = 0; i < NT; ++i) {  // split order 0..S-1: the ticket merge's order
    float4 t = part[i * 32 + lane];
    for (int q = 1; q < S; ++q) {
      const float4 p = part[(q * NT + i) * 32 + lane];
      t = make_float4(t.x + p.x, t.y + p.y, t.z + p.z, t.w + p.w);
    }
    const int cc = n0 + 8 * i + 2 * c;
    if (v0) {
      float2 o = make_float2(t.x, t.y);
      if (has_res) {
        const float2 rr = *reinterpret_cast<const float2*>(res + (long)r0 * stride_res + cc);
        o = make_float2(rr.x + o.x, rr.y + o.y);
      }
      *reinterpret_cast<float2*>(y + (long)r0 * stride_y + cc) = o;
    }
    if (v1) {
      float2 o = make_float2(t.z, t.w);
      if (has_res) {
        const float2 rr = *reinterpret_cast<const float2*>(res + (long)r1 * stride_res + cc);
        o = make_float2(rr.x + o.x, rr.y + o.y);
      }
      *reinterpret_cast<float2*>(y + (long)r1 * stride_y + cc) = o;
    }
  }
}

// grid (cdiv(N / (8 NT), warps), S, cdiv(M, 16)); block warps * 32. Warp w: the 8 NT columns
// from n0 = (blockIdx.x * warps + w) * 8 NT, rows m0 = blockIdx.z * 16 .. + 16, K split
// blockIdx.y; tickets: one a (row tile, column tile). N % (8 NT) == 0, K % 64 == 0 (the host
// checks). ROWS16: the launch has more than 8 rows.
template <bool ROWS16, int NT, int D, int P = 0>
__device__ __forceinline__ void q4_split(const float* __restrict__ x, const unsigned char* __restrict__ qs,
                                         const unsigned* __restrict__ sm, const float* __restrict__ res,
                                         float* __restrict__ y, float* __restrict__ ws,
                                         int* __restrict__ tickets, int M, int N, int K, int stride_x,
                                         int stride_res, int stride_y, int S, int has_res) {
  const int lane = threadIdx.x & 31, c = lane & 3, g = lane >> 2;
  const int n_tiles = N / (8 * NT);
  const int tile = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (tile >= n_tiles) return;
  const int n0 = tile * 8 * NT, m0 = blockIdx.z * 16, sp = blockIdx.y;
  const int per = ((K / 64 + S - 1) / S) * 64;
  const int k_lo = sp * per, k_hi = min(k_lo + per, K);
  const int r0 = m0 + g, r1 = m0 + g + 8;
  const bool v0 = r0 < M, v1 = r1 < M;
  const float* x0 = x + (long)(v0 ? r0 : 0) * stride_x;
  const float* x1 = x + (long)(v1 ? r1 : 0) * stride_x;
  const unsigned sel = (c & 1) ? 0x7362u : 0x5140u;
  const int word = (c >> 1) * 4;  // byte offset of the word holding bytes 2c, 2c+1
  float acc[NT][4];
#pragma unroll
  for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  if constexpr (D == 0)
    stream_acc<ROWS16, NT, P>(acc, qs, sm, x0, x1, v0, v1, N, k_lo, k_hi, n0, g, c, word, sel);
  else
    ring_acc<ROWS16, NT, D>(acc, qs, sm, x0, x1, v0, v1, N, k_lo, k_hi, n0, g, c, word, sel);
  // acc[i]: rows r0 (0, 1) and r1 (2, 3), columns n0 + 8i + 2c, + 1
  if (S > 1 && (P == 0 || P == 3)) {
    const long split_stride = (long)M * N;
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const int cc = n0 + 8 * i + 2 * c;
      if (v0) *reinterpret_cast<float2*>(ws + sp * split_stride + (long)r0 * N + cc) = make_float2(acc[i][0], acc[i][1]);
      if (v1) *reinterpret_cast<float2*>(ws + sp * split_stride + (long)r1 * N + cc) = make_float2(acc[i][2], acc[i][3]);
    }
    __threadfence();
    __syncwarp();
    int last = 0;
    if (lane == 0) last = atomicAdd(tickets + blockIdx.z * n_tiles + tile, 1) == S - 1;
    last = __shfl_sync(0xffffffffu, last, 0);
    if (!last) return;
    __threadfence();
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const int cc = n0 + 8 * i + 2 * c;
      float2 t0 = make_float2(0.f, 0.f), t1 = make_float2(0.f, 0.f);
      for (int q = 0; q < S; ++q) {  // split order 0..S-1: the fixed merge order
        if (v0) {
          float2 p = __ldcg(reinterpret_cast<const float2*>(ws + q * split_stride + (long)r0 * N + cc));
          t0 = q == 0 ? p : make_float2(t0.x + p.x, t0.y + p.y);
        }
        if (v1) {
          float2 p = __ldcg(reinterpret_cast<const float2*>(ws + q * split_stride + (long)r1 * N + cc));
          t1 = q == 0 ? p : make_float2(t1.x + p.x, t1.y + p.y);
        }
      }
      acc[i][0] = t0.x; acc[i][1] = t0.y; acc[i][2] = t1.x; acc[i][3] = t1.y;
    }
    if (lane == 0) atomicExch(tickets + blockIdx.z * n_tiles + tile, 0);
  }
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    const int cc = n0 + 8 * i + 2 * c;
    if (v0) {
      float2 o = make_float2(acc[i][0], acc[i][1]);
      if (has_res) {
        float2 r = *reinterpret_cast<const float2*>(res + (long)r0 * stride_res + cc);
        o = make_float2(r.x + o.x, r.y + o.y);
      }
      *reinterpret_cast<float2*>(y + (long)r0 * stride_y + cc) = o;
    }
    if (v1) {
      float2 o = make_float2(acc[i][2], acc[i][3]);
      if (has_res) {
        float2 r = *reinterpret_cast<const float2*>(res + (long)r1 * stride_res + cc);
        o = make_float2(r.x + o.x, r.y + o.y);
      }
      *reinterpret_cast<float2*>(y + (long)r1 * stride_y + cc) = o;
    }
  }
}

#define Q4_ARGS const float* __restrict__ x, const unsigned char* __restrict__ qs, \
    const unsigned* __restrict__ sm, const float* __restrict__ res, float* __restrict__ y, \
    float* __restrict__ ws, int* __restrict__ tickets, int M, int N, int K, int stride_x, \
    int stride_res, int stride_y, int S, int has_res
#define Q4_PASS x, qs, sm, res, y, ws, tickets, M, N, K, stride_x, stride_res, stride_y, S, has_res
#define Q4_ENTRY(ROWS, NT, D) extern "C" __global__ void q4_split##ROWS##_##NT##_d##D(Q4_ARGS) { \
    q4_split<ROWS == 16, NT, D>(Q4_PASS); }
// (NT x D ≤ 16: the ring's registers without spills)
#define Q4_ROWS(ROWS) Q4_ENTRY(ROWS, 1, 2) Q4_ENTRY(ROWS, 1, 4) Q4_ENTRY(ROWS, 2, 2) \
    Q4_ENTRY(ROWS, 2, 4) Q4_ENTRY(ROWS, 4, 2) Q4_ENTRY(ROWS, 4, 4)
Q4_ROWS(8) Q4_ROWS(16) Q4_ENTRY(8, 1, 8) Q4_ENTRY(8, 2, 8)  // (16 rows at depth 8 spill)
// probes (bench only, wrong values): P 1 the streamed loads alone (no MMAs, no merge), P 2 without the
// split merge (every split writes y), P 3 two accumulator chains (even / odd blocks)
extern "C" __global__ void q4_probe1(Q4_ARGS) { q4_split<false, 2, 0, 1>(Q4_PASS); }
extern "C" __global__ void q4_probe2(Q4_ARGS) { q4_split<false, 2, 0, 2>(Q4_PASS); }
extern "C" __global__ void q4_probe3(Q4_ARGS) { q4_split<false, 2, 0, 3>(Q4_PASS); }
// a CTA a column slice, every split inside (q4_slice): entries q4_slice{ROWS}_{NT}
#define Q4_SLICE(ROWS, NT) extern "C" __global__ void q4_slice##ROWS##_##NT(Q4_ARGS) { \
    q4_slice<ROWS == 16, NT>(x, qs, sm, res, y, M, N, K, stride_x, stride_res, stride_y, S, has_res); }
Q4_SLICE(8, 1) Q4_SLICE(8, 2) Q4_SLICE(8, 4) Q4_SLICE(16, 1) Q4_SLICE(16, 2) Q4_SLICE(16, 4)
// depth 0: the split streamed whole into shared memory (stream_acc)
Q4_ENTRY(8, 1, 0) Q4_ENTRY(8, 2, 0) Q4_ENTRY(8, 4, 0) Q4_ENTRY(16, 1, 0) Q4_ENTRY(16, 2, 0) Q4_ENTRY(16, 4, 0)
"""


def _find(pattern: str) -> str | None:
    """The first file matching pattern under an nvidia/ wheel directory of site-packages
    (torch's CUDA wheels, or pip's nvidia-cuda-* wheels)."""
    for root in site.getsitepackages() + [site.getusersitepackages()]:
        hits = sorted(glob.glob(os.path.join(root, "nvidia", "**", pattern), recursive=True))
        if hits:
            return hits[0]
    return None


@functools.cache
def _nvrtc() -> ctypes.CDLL:
    lib = _find("libnvrtc.so*[0-9]")
    if lib is None:
        raise RuntimeError("cuda_q4: NVRTC not found (pip install nvidia-cuda-nvrtc-cu12)")
    return ctypes.CDLL(lib)


def ptx(arch: str = "compute_90") -> bytes:
    """SOURCE compiled by NVRTC for `arch` (no GPU needed)."""
    header = _find("cuda_fp16.h")
    if header is None:
        raise RuntimeError("cuda_q4: cuda_fp16.h not found (pip install nvidia-cuda-runtime-cu12)")
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), SOURCE.encode(), b"cuda_q4.cu", 0, None, None):
        raise RuntimeError("cuda_q4: nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}".encode(), b"-default-device", b"-std=c++17",
            f"-I{os.path.dirname(header)}".encode()]
    try:
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        if rc:
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"cuda_q4: NVRTC: {log.value.decode(errors='replace')[:2000]}")
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        out = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, out)
        return out.value
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


# kernel entries: rows of a launch up to 8 / up to 16 a row tile, x columns a warp (8 NT)
ENTRIES = tuple(f"q4_split{rows}_{cols // 8}_d{d}".encode()
                for rows in (8, 16) for cols in (8, 16, 32) for d in (0, 2, 4, 8)
                if cols * d <= 128 and (d < 8 or rows == 8))
ENTRIES += tuple(f"q4_slice{rows}_{cols // 8}".encode() for rows in (8, 16) for cols in (8, 16, 32))
STREAM, SLICE = 0, -1  # depths that name the other forms: the split streamed; a CTA a column slice
PROBES = (b"q4_probe1", b"q4_probe2", b"q4_probe3")  # bench only: 16 columns, <= 8 rows, streamed
COLS = 16  # columns a warp by default (the fastest at 1-8 rows of qkv, GPU_NOTES v15)
DEPTH = 8  # blocks a warp keeps in flight (register ring slots), or STREAM / SLICE
_BIG_SMEM: set = set()  # kernels given more than 48 KB of dynamic shared memory
_TICKETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Q4Linear → {cols: tickets}


@functools.cache
def _functions(device: int) -> tuple[ctypes.CDLL, dict]:
    """(libcuda, {entry: function}) loaded into torch's context on `device`."""
    major, minor = torch.cuda.get_device_capability(device)
    code = ptx(f"compute_{major}{minor}")
    torch.zeros(1, device=f"cuda:{device}")  # torch's primary context is current
    cuda = ctypes.CDLL("libcuda.so.1")
    mod = ctypes.c_void_p()
    if cuda.cuModuleLoadData(ctypes.byref(mod), code):
        raise RuntimeError("cuda_q4: the driver could not load the module")
    fns = {}
    for name in ENTRIES + PROBES:
        fns[name] = ctypes.c_void_p()
        if cuda.cuModuleGetFunction(ctypes.byref(fns[name]), mod, name):
            raise RuntimeError(f"cuda_q4: no kernel {name.decode()}")
    return cuda, fns


def _tickets(lin: Q4Linear, cols: int) -> torch.Tensor:
    """The ticket counters of lin's split programs for column tiles of `cols` (zero between
    launches: the last program of a tile resets its own), one a (row tile, column tile)."""
    per = _TICKETS.setdefault(lin, {})
    if cols not in per:
        per[cols] = torch.zeros(q4_layout.SPLIT_ROWS // 16 * (lin.out_features // cols),
                                dtype=torch.int32, device=lin.qs.device)
    return per[cols]


def linear(lin: Q4Linear, x: torch.Tensor, out: torch.Tensor,
           residual: torch.Tensor | None = None, cols: int | None = None, warps: int = 1,
           depth: int | None = None, probe: bytes | None = None) -> torch.Tensor:
    """out [n, N] = x @ W.T (+ residual), as kernels/triton_q4.py `linear` with LINEAR_TILE and
    parallel splits computes it; x [n, K] float32 contiguous rows, CUDA tensors; N a multiple
    of `cols` (8, 16 or 32 columns a warp; `warps` warps a CTA), K of 64; `depth` (2, 4 or 8)
    blocks of weights and x in flight a warp, STREAM: the warp's whole split streamed into
    shared memory at once, or SLICE: a CTA a column slice, every split inside (q4_slice).
    probe: a PROBES kernel to launch instead (bench only: wrong values)."""
    n, big_n, k = x.shape[0], lin.out_features, lin.in_features
    cols, depth = cols or COLS, DEPTH if depth is None else depth
    for t in (x, out) + ((residual,) if residual is not None else ()):
        if not t.is_cuda or t.dtype != torch.float32 or t.stride(1) != 1 or t.stride(0) % 2:
            raise ValueError("cuda_q4: x, out and residual must be CUDA float32 with contiguous, "
                             "even-strided rows")
    if cols not in (8, 16, 32) or big_n % cols or k % 64 or LINEAR_TILE.bk != 64 \
            or depth not in (SLICE, STREAM, 2, 4, 8) or cols * depth > 128:
        raise ValueError("cuda_q4: cols 8, 16 or 32 dividing N; K a multiple of 64; depth 2, 4 "
                         "or 8 (cols x depth ≤ 128), STREAM or SLICE")
    if depth == SLICE:
        return _slice_linear(lin, x, out, residual, cols, warps)
    blocks = -(-k // 64 // lin.split) * 2  # a split's blocks (whole k steps of 64)
    smem = 0
    if depth == STREAM:  # the split streamed into shared memory: whole groups of 4 blocks
        smem = blocks * cols * 20 * warps
        if blocks % 16 or smem > 48 * 1024:
            raise ValueError(f"cuda_q4: a streamed split needs a multiple of 16 blocks and ≤ 48 "
                             f"KB (here {blocks} blocks, {smem} bytes)")
    while depth and (blocks % depth or (depth == 8 and n > 8)):  # whole rounds; 16-row tiles ≤ 4
        depth //= 2
    cuda, fns = _functions(x.device.index or 0)
    sm = lin.sm.view(torch.int32)  # (scale, min) fp16 pairs as one word a column
    tickets = _tickets(lin, cols) if lin.split > 1 else sm
    for r0 in range(0, n, q4_layout.SPLIT_ROWS):
        r1 = min(n, r0 + q4_layout.SPLIT_ROWS)
        xs, ys = x[r0:r1], out[r0:r1]
        res = residual[r0:r1] if residual is not None else ys
        ws = (torch.empty(lin.split, r1 - r0, big_n, dtype=torch.float32, device=x.device)
              if lin.split > 1 else ys)
        grid = (-(-(big_n // cols) // warps), lin.split, -(-(r1 - r0) // 16))
        fn = fns[probe or f"q4_split{16 if r1 - r0 > 8 else 8}_{cols // 8}_d{depth}".encode()]
        _launch(cuda, fn, grid, warps * 32, smem, (xs, lin.qs, sm, res, ys, ws, tickets),
                (r1 - r0, big_n, k, xs.stride(0), res.stride(0), ys.stride(0), lin.split,
                 int(residual is not None)))
    return out


def _launch(cuda: ctypes.CDLL, fn: ctypes.c_void_p, grid: tuple[int, int, int], threads: int,
            smem: int, tensors: tuple, ints: tuple) -> None:
    """fn<<<grid, threads, smem>>> on torch's current stream with Q4_ARGS (the tensors'
    addresses, then the ints); above 48 KB of dynamic shared memory the kernel is opted in
    first (once a size)."""
    if smem > 48 * 1024 and (fn.value, smem) not in _BIG_SMEM:
        # (attribute 8: CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)
        if smem > 227 * 1024 or cuda.cuFuncSetAttribute(fn, 8, smem):
            raise ValueError(f"cuda_q4: {smem} bytes of shared memory: more than the device gives")
        _BIG_SMEM.add((fn.value, smem))
    args = [ctypes.c_void_p(t.data_ptr()) for t in tensors] + [ctypes.c_int(v) for v in ints]
    argv = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p)
                                           for a in args])
    stream = ctypes.c_void_p(torch.cuda.current_stream(tensors[0].device).cuda_stream)
    if cuda.cuLaunchKernel(fn, *grid, threads, 1, 1, smem, stream, argv, None):
        raise RuntimeError("cuda_q4: launch failed")


def _slice_linear(lin: Q4Linear, x: torch.Tensor, out: torch.Tensor,
                  residual: torch.Tensor | None, cols: int, warps: int) -> torch.Tensor:
    """`linear` in the q4_slice form: a CTA a column slice of `cols` columns and 16 rows, every
    K split inside, merged in shared memory; max(S, warps or 4, S R / 4) warps (a split's
    chain each, and at most 4 A-fragment items each a round)."""
    n, big_n, k = x.shape[0], lin.out_features, lin.in_features
    s = lin.split
    nbs = k // 32 // s  # blocks a split
    if (k // 64) % s or nbs % 4:
        raise ValueError(f"cuda_q4: the slice form needs whole splits of 4k blocks ({nbs} a split)")
    w = max(s, warps if warps > 1 else 4, -(-s * (nbs // 4) // 4))
    if w > 32:
        raise ValueError(f"cuda_q4: the slice form would need {w} warps a CTA")
    cuda, fns = _functions(x.device.index or 0)
    sm = lin.sm.view(torch.int32)
    for r0 in range(0, n, q4_layout.SPLIT_ROWS):
        r1 = min(n, r0 + q4_layout.SPLIT_ROWS)
        xs, ys = x[r0:r1], out[r0:r1]
        res = residual[r0:r1] if residual is not None else ys
        xw = 2 if r1 - r0 > 8 else 1
        nt, rnd = cols // 8, nbs // 4
        smem = k // 32 * cols * 20 + s * rnd * nt * 512 + s * rnd * xw * 512 + s * nt * 512
        grid = (big_n // cols, 1, -(-(r1 - r0) // 16))
        _launch(cuda, fns[f"q4_slice{8 * xw}_{nt}".encode()], grid, w * 32, smem,
                (xs, lin.qs, sm, res, ys, ys, ys),  # (no partials, no tickets)
                (r1 - r0, big_n, k, xs.stride(0), res.stride(0), ys.stride(0), s,
                 int(residual is not None)))
    return out
