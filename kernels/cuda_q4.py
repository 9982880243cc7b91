"""The q4 GEMM's split programs as CUDA kernels; the engine's path for qkv and o at 1-8 rows
(`triton_linear.CUDA_MAX_ROWS`) in the CTA form, where NVRTC and the CUDA headers are found.

Triton cannot express the schedule the q4 GEMM at 1-16 rows wants (GPU_NOTES v14), so this is
the decode tile (kernels/triton_q4.py, LINEAR_TILE with parallel K splits) written in CUDA C++
with the same arithmetic:

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
first. Its own ticket counters (one a row tile and column tile) sit beside the weight.

The CTA form (`CTA`, on by default; `q4_cta`): a CTA takes one column tile's S splits, a warp
each, and sums their partials in split order 0..S-1 through shared memory — no ticket, no
partials in global memory, so no global round trip between a split's end and the merge. Same
arithmetic, same order: the decode tile's bits (tests on the H100, S = 1-8, 1-40 rows). H100,
cold weights, 1 row: qkv 11.1 → 7.7 µs, o 8.1 → 5.8 µs against the Triton tile (GPU_NOTES v17).
At <= 8 rows its warps may instead stream their whole splits into shared memory, the copies
issued before the PDL wait (`CTA_STREAM`, off; `cta_streams`): the same MMAs in the same order.

A second form (`swap_linear`, `q4_swap`) swaps the MMA's operands for 9-255 rows: the weights
as A (a warp's 16 or 32 features, each weight dequantized once), x as B for all of the CTA's
16-64 tokens, from shared memory (a 4-stage cp.async ring of x and the weight bytes, x rounded
to fp16 once a round, ldmatrix), the same split ranges and ticket merge.

Measured on the H100 (GPU_NOTES v15, v16): every form gives the decode tile's bits — the
swapped one too, so mma.sync sums a k16 chunk the same way with its operands exchanged — but
none is faster where the engine needs it: at 1-8 rows of qkv and o the chain of dependent MMAs
and the split merge set the time (not the bytes in flight); 32 columns a warp beat the Triton
tile on the lm_head (82.5% against 77% of copy); the swapped form loses 1.3-2.8x at 16-128
rows of qkv and o (a reading, not measured: each CTA stages its split's whole x, 42 MB of L2
reads for qkv at 64 rows) and wins only on the lm_head (16 rows: 86 against 102 µs). Those stay
experiments (`CTA` off, `triton_linear.CUDA_SWAP_MIN_ROWS`); PROBES time the split programs'
parts (loads alone, no merge, two accumulator chains).

At <= 8 rows the CTA forms can also run with the MMA's operands swapped in registers
(`SWAP_REGS`, on; `block_mma_sw`): the weights as A (16 columns an MMA, no zero rows), x as
B — the same products in the same order, half the MMAs (GPU_NOTES v28; measured in v29).

Launched (`PDL`, on by default) with programmatic dependent launch where the Triton kernels
are (kernels/triton_pdl.py): a kernel is scheduled while its predecessor ends, issues its
ring's first weight loads (no kernel writes the weights), and only then waits (`pdl_wait`)
for what the predecessor wrote; the launch changes no arithmetic, so no bit. H100, context
128, 1 / 4 / 8 streams: 387.9 / 959.3 / 1,454.2 → 408.2 / 996.3 / 1,502.6 tok/s (GPU_NOTES
v19).

Built at run time: NVRTC (found in the nvidia wheels beside torch, or pip's
nvidia-cuda-nvrtc-cu12) compiles the source to PTX for the device's compute capability, and
the driver loads the PTX (libcuda `cuModuleLoadData`). `ptx()` runs without a GPU. Two
modules: CORE, the kernels the engine launches (2.0 MB of PTX: NVRTC 2.8 s, ptxas 2.0 s on a
2-core CPU), built at load; EXTRA, the forms only the benches and tests run (4.4 MB: 7.5 s and
12.6 s), built on the first launch of one of them — a fresh machine's first load no longer
compiles them.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import os
import site
import threading
import warnings
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

// Programmatic dependent launch (sm_90+; kernels/triton_pdl.py): wait until the previous
// kernel in the stream has completed and its writes are visible, then let the next one be
// scheduled. Nothing a kernel wrote may be read before this; the weights may (no kernel writes
// them). A no-op for a plain launch, and compiled out before sm_90.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
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

// load_x for fp16 x (the MoE's intermediate): the same pairs, widened exactly to fp32 (x_frag
// rounds them back to the same fp16 values)
template <bool ROWS16>
__device__ __forceinline__ void load_x(const __half* x0, const __half* x1, bool v0, bool v1,
                                       int kb, int c, float2 p[ROWS16 ? 8 : 4]) {
#pragma unroll
  for (int h = 0; h < 4; ++h)
    p[h] = v0 ? __half22float2(__ldg(reinterpret_cast<const __half2*>(x0 + kb + 2 * c + 8 * h)))
              : make_float2(0.f, 0.f);
  if (ROWS16) {
#pragma unroll
    for (int h = 0; h < 4; ++h)
      p[4 + h] = v1 ? __half22float2(__ldg(reinterpret_cast<const __half2*>(x1 + kb + 2 * c + 8 * h)))
                    : make_float2(0.f, 0.f);
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

// block_mma with the operands swapped (SW; rows of x <= 8, NT even): the weights as A, the 16
// columns of n8 tiles i, i + 1 as its rows g, g + 8 (the fragments `dequant` gives, no zero
// registers), x as B, its row g as column g (the pairs x_frag puts in a0 / a2). Each output is
// the same 16 products of a k16 chunk in the same order (the GPU measured the swapped form's bits
// equal, GPU_NOTES v15-v16), with half the MMAs. acc[i / 2] holds (column 8i + g, rows 2c, 2c+1)
// and (column 8i + 8 + g, rows 2c, 2c+1).
template <int NT>
__device__ __forceinline__ void block_mma_sw(float acc[NT][4], const float2* p, unsigned sel,
                                             const unsigned w0[NT], const unsigned w1[NT],
                                             const unsigned s[NT]) {
  static_assert(NT % 2 == 0, "the swapped registers take n8 tiles in pairs");
  const unsigned b_lo[2] = {half2_bits(__floats2half2_rn(p[0].x, p[0].y)),
                            half2_bits(__floats2half2_rn(p[1].x, p[1].y))};
  const unsigned b_hi[2] = {half2_bits(__floats2half2_rn(p[2].x, p[2].y)),
                            half2_bits(__floats2half2_rn(p[3].x, p[3].y))};
#pragma unroll
  for (int i = 0; i < NT; i += 2) {
    unsigned lo0[2], hi0[2], lo1[2], hi1[2];
    dequant(w0[i], w1[i], sel, s[i], lo0, hi0);
    dequant(w0[i + 1], w1[i + 1], sel, s[i + 1], lo1, hi1);
    const unsigned a_lo[4] = {lo0[0], lo1[0], lo0[1], lo1[1]};
    const unsigned a_hi[4] = {hi0[0], hi1[0], hi0[1], hi1[1]};
    mma(acc[i / 2], a_lo, b_lo);
    mma(acc[i / 2], a_hi, b_hi);
  }
}

// block_mma, or (SW) block_mma_sw
template <bool ROWS16, int NT, bool SW>
__device__ __forceinline__ void block_any(float acc[NT][4], const float2* p, unsigned sel,
                                          const unsigned w0[NT], const unsigned w1[NT],
                                          const unsigned s[NT]) {
  if constexpr (SW) {
    static_assert(!ROWS16, "the swapped registers take <= 8 rows");
    block_mma_sw<NT>(acc, p, sel, w0, w1, s);
  } else {
    block_mma<ROWS16, NT>(acc, p, sel, w0, w1, s);
  }
}

// split sp's K range [k_lo, k_hi) of S splits: whole k steps of 64, as q4_layout.split_count
// and the Triton programs cut them
__device__ __forceinline__ void split_k(int K, int S, int sp, int& k_lo, int& k_hi) {
  const int per = ((K / 64 + S - 1) / S) * 64;
  k_lo = sp * per;
  k_hi = min(k_lo + per, K);
}

// lane c's PRMT selector and the byte offset of the word holding bytes 2c, 2c+1 of a block
__device__ __forceinline__ void lane_bytes(int c, unsigned& sel, int& word) {
  sel = (c & 1) ? 0x7362u : 0x5140u;
  word = (c >> 1) * 4;
}

// acc += the split [k_lo, k_hi) of the 8 NT columns from n0, its blocks through a ring of D
// register slots: D blocks' loads (weights and x) in flight ahead of the MMAs, which take the
// blocks in ascending order. nb % D == 0 (the host picks D); the last round only computes.
// SW: the MMAs with swapped operands (block_mma_sw).
template <bool ROWS16, int NT, int D, bool SW = false, typename XT>
__device__ __forceinline__ void ring_acc(float acc[NT][4], const unsigned char* __restrict__ qs,
                                         const unsigned* __restrict__ sm, const XT* x0,
                                         const XT* x1, bool v0, bool v1, int N, int k_lo,
                                         int k_hi, int n0, int g, int c, int word, unsigned sel) {
  unsigned w0[D][NT], w1[D][NT], wsm[D][NT];
  float2 xp[D][ROWS16 ? 8 : 4];
  const int nb = (k_hi - k_lo) >> 5;
  const long wstep = (long)N * 16;  // bytes from a column's block to its next block
  const unsigned char* wb = qs + ((long)(k_lo >> 5) * N + n0 + g) * 16 + word;
  const unsigned* sb = sm + (long)(k_lo >> 5) * N + n0 + g;
  const XT* xa = x0 + k_lo;
  const XT* xb = x1 + k_lo;
#pragma unroll
  for (int j = 0; j < D; ++j) {  // the first D blocks' weights: before the wait (PDL)
    load_block<NT>(wb, sb, w0[j], w1[j], wsm[j]);
    wb += wstep; sb += N;
  }
  pdl_wait();
#pragma unroll
  for (int j = 0; j < D; ++j) {  // their x: a kernel wrote it
    load_x<ROWS16>(xa, xb, v0, v1, 0, c, xp[j]);
    xa += 32; xb += 32;
  }
  for (int r = D; r < nb; r += D) {
#pragma unroll
    for (int j = 0; j < D; ++j) {
      block_any<ROWS16, NT, SW>(acc, xp[j], sel, w0[j], w1[j], wsm[j]);
      load_block<NT>(wb, sb, w0[j], w1[j], wsm[j]);
      load_x<ROWS16>(xa, xb, v0, v1, 0, c, xp[j]);
      wb += wstep; sb += N; xa += 32; xb += 32;
    }
  }
#pragma unroll
  for (int j = 0; j < D; ++j) block_any<ROWS16, NT, SW>(acc, xp[j], sel, w0[j], w1[j], wsm[j]);
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(d), "l"(src) : "memory");
}

// A split streamed whole into shared memory: stream_issue has the warp issue cp.async for all
// of the split's blocks at once (GR commit groups of nb / GR blocks: GR = 4, or 3, 2, 1 where
// nb / 4 is not a multiple of 4) into sq (nb x 8 NT x 20 bytes: the nibbles, then the scale
// pairs), so every byte of it is in flight together; stream_compute then computes each group
// as it lands, x (fp32, the MoE's fp16 intermediate, or that in shared memory: SHalf) through
// a 4-slot register ring — ring_acc's MMAs in ring_acc's order, so its bits. nb % 4 == 0.
// `later`: the commit groups this warp issued after this split's (they may stay in flight).
__device__ __forceinline__ int stream_groups(int nb) {
  const int quads = nb >> 2;
  return quads % 4 == 0 ? 4 : quads % 3 == 0 ? 3 : quads % 2 == 0 ? 2 : 1;
}

template <int NT>
__device__ __forceinline__ void stream_issue(unsigned char* sq, const unsigned char* __restrict__ qs,
                                             const unsigned* __restrict__ sm, int N, int k_lo,
                                             int k_hi, int n0) {
  constexpr int QB = NT * 8 * 16, SB = NT * 8 * 4, CH = (QB + SB) / 16;  // bytes, 16 B chunks a block
  const int lane = threadIdx.x & 31;
  const int nb = (k_hi - k_lo) >> 5, gr = stream_groups(nb), per_group = nb / gr;
  unsigned char* ss = sq + nb * QB;
  const unsigned char* gq = qs + ((long)(k_lo >> 5) * N + n0) * 16;
  const unsigned char* gs = reinterpret_cast<const unsigned char*>(sm + (long)(k_lo >> 5) * N + n0);
  for (int grp = 0; grp < gr; ++grp) {
    for (int i = lane; i < per_group * CH; i += 32) {
      const int b = grp * per_group + i / CH, ch = i % CH;
      if (ch < QB / 16)
        cp_async16(sq + b * QB + ch * 16, gq + (long)b * N * 16 + ch * 16);
      else
        cp_async16(ss + b * SB + (ch - QB / 16) * 16, gs + (long)b * N * 4 + (ch - QB / 16) * 16);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
}

// cp.async.wait_group takes its count as an immediate
__device__ __forceinline__ void wait_groups(int pending) {
  switch (pending) {
    case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
    case 4: asm volatile("cp.async.wait_group 4;" ::: "memory"); break;
    case 5: asm volatile("cp.async.wait_group 5;" ::: "memory"); break;
    case 6: asm volatile("cp.async.wait_group 6;" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 7;" ::: "memory"); break;
  }
}

struct SHalf { unsigned short bits; };  // an fp16 value in shared memory (load_x: no __ldg)

template <bool ROWS16>
__device__ __forceinline__ void load_x(const SHalf* x0, const SHalf* x1, bool v0, bool v1,
                                       int kb, int c, float2 p[ROWS16 ? 8 : 4]) {
  static_assert(!ROWS16, "one row");
#pragma unroll
  for (int h = 0; h < 4; ++h)
    p[h] = v0 ? __half22float2(*reinterpret_cast<const __half2*>(x0 + kb + 2 * c + 8 * h))
              : make_float2(0.f, 0.f);
}

template <bool ROWS16, int NT, int P = 0, bool SW = false, typename XT = float>
__device__ __forceinline__ void stream_compute(float acc[NT][4], const unsigned char* sq,
                                               const XT* x0, const XT* x1, bool v0, bool v1,
                                               int k_lo, int k_hi, int g, int c, int word,
                                               unsigned sel, int later = 0) {
  static_assert(!(SW && P), "the probes take x as A");
  constexpr int QB = NT * 8 * 16, SB = NT * 8 * 4;
  const int nb = (k_hi - k_lo) >> 5, gr = stream_groups(nb), per_group = nb / gr;
  const unsigned char* ss = sq + nb * QB;
  float2 xp[4][ROWS16 ? 8 : 4];
  float acc2[NT][4] = {};
  const XT* xa = x0 + k_lo;
  const XT* xb = x1 + k_lo;
#pragma unroll
  for (int j = 0; j < 4; ++j) load_x<ROWS16>(xa, xb, v0, v1, 32 * j, c, xp[j]);
  for (int grp = 0; grp < gr; ++grp) {
    wait_groups(gr - 1 - grp + later);  // this group's blocks have landed
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
          block_any<ROWS16, NT, SW>(acc, xp[j], sel, w0, w1, s);
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

// acc += the same split streamed whole into this warp's part of shared memory from byte `off`
// (stream_issue, then stream_compute). EARLY: the copies issued before the PDL wait (they are
// weights: no kernel writes them), x after it (the CTA form; the split programs wait first).
// SW: block_mma_sw (P 0 only).
template <bool ROWS16, int NT, int P = 0, bool SW = false, bool EARLY = false, typename XT = float>
__device__ __forceinline__ void stream_acc(float acc[NT][4], const unsigned char* __restrict__ qs,
                                           const unsigned* __restrict__ sm, const XT* x0,
                                           const XT* x1, bool v0, bool v1, int N, int k_lo,
                                           int k_hi, int n0, int g, int c, int word, unsigned sel,
                                           int off = 0) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int nb = (k_hi - k_lo) >> 5;
  unsigned char* sq = smem + off + (threadIdx.x >> 5) * nb * (NT * 8 * 20);  // this warp's part
  stream_issue<NT>(sq, qs, sm, N, k_lo, k_hi, n0);
  if constexpr (EARLY) pdl_wait();
  stream_compute<ROWS16, NT, P, SW>(acc, sq, x0, x1, v0, v1, k_lo, k_hi, g, c, word, sel);
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
  pdl_wait();
  const int lane = threadIdx.x & 31, c = lane & 3, g = lane >> 2;
  const int n_tiles = N / (8 * NT);
  const int tile = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (tile >= n_tiles) return;
  const int n0 = tile * 8 * NT, m0 = blockIdx.z * 16, sp = blockIdx.y;
  int k_lo, k_hi, word;
  unsigned sel;
  split_k(K, S, sp, k_lo, k_hi);
  lane_bytes(c, sel, word);
  const int r0 = m0 + g, r1 = m0 + g + 8;
  const bool v0 = r0 < M, v1 = r1 < M;
  const float* x0 = x + (long)(v0 ? r0 : 0) * stride_x;
  const float* x1 = x + (long)(v1 ? r1 : 0) * stride_x;
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

// ---- the swapped form: the weights as the MMA's A operand (16 features a warp's m16 tile, MT
// of them), x as B from shared memory, so a warp dequantizes each weight once for all the
// launch's tokens (8 NG of them a CTA) — what the row-tile forms repeat per 16 rows.

__device__ __forceinline__ void ldsm_x4(unsigned r[4], const __half* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}

__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, int bytes) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(d), "l"(src), "r"(bytes) : "memory");
}

// grid (N / F, S, cdiv(M, T)), F = 16 MT W features and T = 8 NG tokens a CTA; block 32 W. Warp
// w: features f0 = blockIdx.x F + 16 MT w .. + 16 MT, tokens t0 = blockIdx.z T .. + T, K split
// blockIdx.y. The split's blocks go by rounds of RB = 2 through an NS = 4 stage cp.async ring
// in shared memory (a stage: x [T][32 RB] fp32, rows past M zero-filled; the CTA's weight bytes
// [RB][F][16]; their (scale, min) words [RB][F]); each round the CTA rounds its stage's x to
// fp16 (nearest even, as the row-tile forms round) into a [T][32 RB + 8] tile (rows padded by
// 16 bytes: ldmatrix's eight rows on distinct banks), then each warp dequantizes its features'
// blocks once and runs them against all T tokens. Per accumulator the k16 chunks in the decode
// tile's order (blocks ascending, a block's low nibbles then its high ones), the same split
// ranges, the partials summed in split order 0..S-1 by the last CTA of a (token tile, feature
// slice) (a ticket), then the residual: the decode tile's bits (measured on the H100, v16).
template <int MT, int NG, int W>
__device__ __forceinline__ void q4_swap(const float* __restrict__ x, const unsigned char* __restrict__ qs,
                                        const unsigned* __restrict__ sm, const float* __restrict__ res,
                                        float* __restrict__ y, float* __restrict__ ws,
                                        int* __restrict__ tickets, int M, int N, int K, int stride_x,
                                        int stride_res, int stride_y, int S, int has_res) {
  constexpr int RB = 2, NS = 4, T = 8 * NG, KR = 32 * RB, LD = KR + 8, F = 16 * MT * W;
  constexpr int XB = T * KR * 4, QB = RB * F * 16, SB = RB * F * 4, STAGE = XB + QB + SB;
  constexpr int XCH = XB / 16, QCH = QB / 16, CH = (XB + QB + SB) / 16, THREADS = 32 * W;
  pdl_wait();
  extern __shared__ __align__(16) unsigned char smem[];
  __half* xh = reinterpret_cast<__half*>(smem + NS * STAGE);  // [T][LD]
  int* flag = reinterpret_cast<int*>(smem + NS * STAGE + T * LD * 2);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, c = lane & 3, g = lane >> 2;
  const int fc = blockIdx.x * F, fw = warp * 16 * MT, f0 = fc + fw;
  const int t0 = blockIdx.z * T, sp = blockIdx.y;
  int k_lo, k_hi;
  split_k(K, S, sp, k_lo, k_hi);
  const int rounds = (k_hi - k_lo) / KR;
  const unsigned char* smb = reinterpret_cast<const unsigned char*>(sm);
  // stage r's copies into slot r % NS: one commit group (empty past the split's end)
  auto issue = [&](int r) {
    if (r < rounds) {
      unsigned char* st = smem + (r % NS) * STAGE;
      const int kb0 = k_lo + r * KR, blk0 = kb0 >> 5;
      for (int i = threadIdx.x; i < CH; i += THREADS) {
        if (i < XCH) {
          const int row = i / (KR / 4), c4 = i % (KR / 4), t = t0 + row;
          cp_async16_zfill(st + i * 16, x + (long)(t < M ? t : 0) * stride_x + kb0 + 4 * c4, t < M ? 16 : 0);
        } else if (i < XCH + QCH) {
          const int j = i - XCH, b = j / F, f = j % F;
          cp_async16(st + i * 16, qs + ((long)(blk0 + b) * N + fc + f) * 16);
        } else {
          const int j = i - XCH - QCH, b = j / (F / 4), q = j % (F / 4);
          cp_async16(st + i * 16, smb + ((long)(blk0 + b) * N + fc) * 4 + q * 16);
        }
      }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
#pragma unroll
  for (int st = 0; st < NS - 1; ++st) issue(st);
  unsigned sel;
  int word;
  lane_bytes(c, sel, word);
  float acc[MT][NG][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < NG; ++n) acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.f;
  const __half* xl = xh + (lane & 7) * LD + 8 * (lane >> 3);  // this lane's ldmatrix row
  for (int r = 0; r < rounds; ++r) {
    asm volatile("cp.async.wait_group %0;" :: "n"(NS - 2) : "memory");  // stage r: this thread's
    __syncthreads();  // ... and every thread's; round r - 1 computed by all
    issue(r + NS - 1);  // into slot (r - 1) % NS, free now
    const unsigned char* st = smem + (r % NS) * STAGE;
    const float4* xf = reinterpret_cast<const float4*>(st);
#pragma unroll
    for (int q = 0; q < T * KR / 4 / THREADS; ++q) {
      const int i = threadIdx.x + q * THREADS, row = i / (KR / 4), c4 = i % (KR / 4);
      const float4 v = xf[i];
      uint2 h;
      h.x = half2_bits(__floats2half2_rn(v.x, v.y));
      h.y = half2_bits(__floats2half2_rn(v.z, v.w));
      *reinterpret_cast<uint2*>(xh + row * LD + 4 * c4) = h;
    }
    __syncthreads();
    const unsigned char* wq = st + XB;
    const unsigned* wsm = reinterpret_cast<const unsigned*>(st + XB + QB);
#pragma unroll
    for (int j = 0; j < RB; ++j) {
      unsigned a_lo[MT][4], a_hi[MT][4];
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        unsigned lo0[2], hi0[2], lo1[2], hi1[2];
        const int fa = j * F + fw + 16 * m + g, fb = fa + 8;  // features g and g + 8
        dequant(*reinterpret_cast<const unsigned*>(wq + fa * 16 + word),
                *reinterpret_cast<const unsigned*>(wq + fa * 16 + word + 8), sel, wsm[fa], lo0, hi0);
        dequant(*reinterpret_cast<const unsigned*>(wq + fb * 16 + word),
                *reinterpret_cast<const unsigned*>(wq + fb * 16 + word + 8), sel, wsm[fb], lo1, hi1);
        a_lo[m][0] = lo0[0]; a_lo[m][1] = lo1[0]; a_lo[m][2] = lo0[1]; a_lo[m][3] = lo1[1];
        a_hi[m][0] = hi0[0]; a_hi[m][1] = hi1[0]; a_hi[m][2] = hi0[1]; a_hi[m][3] = hi1[1];
      }
#pragma unroll
      for (int n = 0; n < NG; ++n) {
        unsigned b[4];  // tokens 8n + g, k = 2c, 2c+1 / + 8 of the low chunk, then the high one
        ldsm_x4(b, xl + 8 * n * LD + 32 * j);
        const unsigned b_lo[2] = {b[0], b[1]}, b_hi[2] = {b[2], b[3]};
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          mma(acc[m][n], a_lo[m], b_lo);
          mma(acc[m][n], a_hi[m], b_hi);
        }
      }
    }
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  // acc[m][n][e]: feature f0 + 16m + g + 8 (e >> 1), token t0 + 8n + 2c + (e & 1)
  if (S > 1) {
    const long split_stride = (long)M * N;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int n = 0; n < NG; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = t0 + 8 * n + 2 * c + (e & 1), f = f0 + 16 * m + g + 8 * (e >> 1);
          if (t < M) ws[sp * split_stride + (long)t * N + f] = acc[m][n][e];
        }
    __threadfence();
    __syncthreads();
    const int ticket = blockIdx.z * gridDim.x + blockIdx.x;
    if (threadIdx.x == 0) *flag = atomicAdd(tickets + ticket, 1) == S - 1;
    __syncthreads();
    if (!*flag) return;
    __threadfence();
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int n = 0; n < NG; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = t0 + 8 * n + 2 * c + (e & 1), f = f0 + 16 * m + g + 8 * (e >> 1);
          if (t >= M) continue;
          float v = __ldcg(ws + (long)t * N + f);
          for (int q = 1; q < S; ++q) v = v + __ldcg(ws + q * split_stride + (long)t * N + f);
          acc[m][n][e] = v;  // split order 0..S-1: the fixed merge order
        }
    if (threadIdx.x == 0) atomicExch(tickets + ticket, 0);
  }
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < NG; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = t0 + 8 * n + 2 * c + (e & 1), f = f0 + 16 * m + g + 8 * (e >> 1);
        if (t < M) y[(long)t * stride_y + f] = has_res ? res[(long)t * stride_res + f] + acc[m][n][e]
                                                       : acc[m][n][e];
      }
}

// ---- the CTA form: a CTA one (row tile, column tile), warp w its split w (S warps), each
// warp's split run as q4_split runs it (the register ring), then the S partials summed in split
// order 0..S-1 through shared memory (no ticket, no partials in global memory) and the residual
// added: q4_split's arithmetic in q4_split's order, so its bits. grid (N / (8 NT), 1,
// cdiv(M, 16)); block 32 S; dynamic shared memory S x 16 x 8 NT floats.
// (cta_partials: up to the split partials in shared memory, after the CTA's barrier; SW: the
// swapped registers, block_mma_sw. D 0: each warp's split streamed whole into shared memory
// behind the partials, S x nb x 8 NT x 20 bytes more, its copies issued before the PDL wait —
// stream_acc's arithmetic is ring_acc's, so the same bits)
template <bool ROWS16, int NT, int D, bool SW = false>
__device__ __forceinline__ float* cta_partials(const float* __restrict__ x,
                                               const unsigned char* __restrict__ qs,
                                               const unsigned* __restrict__ sm, int M, int N,
                                               int K, int stride_x, int S) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int C = 8 * NT;
  float* part = reinterpret_cast<float*>(smem);  // [S][16][C]
  const int lane = threadIdx.x & 31, c = lane & 3, g = lane >> 2, sp = threadIdx.x >> 5;
  const int n0 = blockIdx.x * C, m0 = blockIdx.z * 16;
  int k_lo, k_hi, word;
  unsigned sel;
  split_k(K, S, sp, k_lo, k_hi);
  lane_bytes(c, sel, word);
  const int r0 = m0 + g, r1 = m0 + g + 8;
  const bool v0 = r0 < M, v1 = r1 < M;
  const float* x0 = x + (long)(v0 ? r0 : 0) * stride_x;
  const float* x1 = x + (long)(v1 ? r1 : 0) * stride_x;
  float acc[NT][4];
#pragma unroll
  for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  if constexpr (D == 0)
    stream_acc<ROWS16, NT, 0, SW, true>(acc, qs, sm, x0, x1, v0, v1, N, k_lo, k_hi, n0, g, c,
                                        word, sel, S * 16 * C * 4);
  else
    ring_acc<ROWS16, NT, D, SW>(acc, qs, sm, x0, x1, v0, v1, N, k_lo, k_hi, n0, g, c, word, sel);
  float* mine = part + sp * 16 * C;
  if constexpr (SW) {  // rows 2c, 2c + 1 of columns 8i + g and 8i + 8 + g
#pragma unroll
    for (int i = 0; i < NT; i += 2) {
      mine[2 * c * C + 8 * i + g] = acc[i / 2][0];
      mine[(2 * c + 1) * C + 8 * i + g] = acc[i / 2][1];
      mine[2 * c * C + 8 * i + 8 + g] = acc[i / 2][2];
      mine[(2 * c + 1) * C + 8 * i + 8 + g] = acc[i / 2][3];
    }
  } else {
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const int cc = 8 * i + 2 * c;
      *reinterpret_cast<float2*>(mine + g * C + cc) = make_float2(acc[i][0], acc[i][1]);
      *reinterpret_cast<float2*>(mine + (g + 8) * C + cc) = make_float2(acc[i][2], acc[i][3]);
    }
  }
  __syncthreads();
  return part;
}

template <bool ROWS16, int NT, int D, bool SW = false>
__device__ __forceinline__ void q4_cta(const float* __restrict__ x, const unsigned char* __restrict__ qs,
                                       const unsigned* __restrict__ sm, const float* __restrict__ res,
                                       float* __restrict__ y, int M, int N, int K, int stride_x,
                                       int stride_res, int stride_y, int S, int has_res) {
  constexpr int C = 8 * NT;
  const float* part = cta_partials<ROWS16, NT, D, SW>(x, qs, sm, M, N, K, stride_x, S);
  const int n0 = blockIdx.x * C, m0 = blockIdx.z * 16;
  for (int e = threadIdx.x; e < 16 * C; e += blockDim.x) {
    const int r = m0 + e / C;
    if (r >= M) continue;
    float v = part[e];
    for (int q = 1; q < S; ++q) v = v + part[q * 16 * C + e];  // split order 0..S-1
    const long cc = n0 + e % C;
    y[(long)r * stride_y + cc] = has_res ? res[(long)r * stride_res + cc] + v : v;
  }
}

// ---- the direct MoE experts in the CTA form (triton_moe's direct split programs, 1-8 tokens):
// a CTA one assignment a (its token t = a / topk, its expert ids[a]) and one column tile of
// 8 NT columns, warp w its K split w; the partials summed in split order through shared memory.
// GATE_UP: x the token's fp32 row; the tile's columns interleave gate and up (stacking order),
// so output j = column pair j: inter[a, j] = silu(gate) * up in fp16 through the PTX Triton
// emits for `_silu_up_store` (0 - g, x log2 e, ex2.approx, + 1, div.full, x up, cvt.rn).
// Else (down): x = inter[a] (fp16), y[a, n] = the sum. grid (N / (8 NT), T topk); block 32 S;
// shared memory S x 8 NT floats.
__device__ __forceinline__ float silu_mul(float g, float u) {
  float r;
  asm("{\n .reg .f32 t, e, d, q;\n sub.f32 t, 0f00000000, %1;\n mul.f32 t, t, 0f3FB8AA3B;\n"
      " ex2.approx.f32 e, t;\n add.f32 d, e, 0f3F800000;\n div.full.f32 q, %1, d;\n"
      " mul.f32 %0, q, %2;\n}" : "=f"(r) : "f"(g), "f"(u));
  return r;
}

template <int NT, int D, bool GATE_UP, bool SW = false>
__device__ __forceinline__ void q4_expert_cta(const void* __restrict__ xv, const int* __restrict__ ids,
                                              const unsigned char* __restrict__ qs,
                                              const unsigned* __restrict__ sm, void* __restrict__ outv,
                                              int N, int K, int stride_x, int stride_out, int S,
                                              int topk, int early) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int C = 8 * NT;
  float* part = reinterpret_cast<float*>(smem);  // [S][C]: row 0 of each split's partial
  const int lane = threadIdx.x & 31, c = lane & 3, g = lane >> 2, sp = threadIdx.x >> 5;
  const int a = blockIdx.y, n0 = blockIdx.x * C;
  const long per_expert = (long)(K >> 5) * N;  // an expert's blocks (and (scale, min) words)
  int k_lo, k_hi, word;
  unsigned sel;
  split_k(K, S, sp, k_lo, k_hi);
  // ids: the top-k's — gate_up's predecessor, so after the wait; down (early: EXPERT_EARLY) reads
  // them before it, two kernels on (final then: only the predecessor may still run), and its
  // ring's first weight loads go out before the wait too (ring_acc waits after them)
  if (!early) pdl_wait();
  const long e = ids[a];
  const unsigned char* qe = qs + e * per_expert * 16;
  const unsigned* se = sm + e * per_expert;
  lane_bytes(c, sel, word);
  const bool v0 = g == 0;  // one row: the assignment's
  float acc[NT][4];
#pragma unroll
  for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  if constexpr (GATE_UP) {
    const float* x0 = reinterpret_cast<const float*>(xv) + (long)(a / topk) * stride_x;
    if constexpr (D == 0)  // (EXPERT_STREAM: the split streamed whole, behind the partials)
      stream_acc<false, NT, 0, SW>(acc, qe, se, x0, x0, v0, false, N, k_lo, k_hi, n0, g, c,
                                   word, sel, S * C * 4);
    else
      ring_acc<false, NT, D, SW>(acc, qe, se, x0, x0, v0, false, N, k_lo, k_hi, n0, g, c, word, sel);
  } else {
    const __half* x0 = reinterpret_cast<const __half*>(xv) + (long)a * stride_x;
    if constexpr (D == 0)  // (DOWN_STREAM: the split streamed whole, its copies before the wait)
      stream_acc<false, NT, 0, SW, true>(acc, qe, se, x0, x0, v0, false, N, k_lo, k_hi, n0, g,
                                         c, word, sel, S * C * 4);
    else
      ring_acc<false, NT, D, SW>(acc, qe, se, x0, x0, v0, false, N, k_lo, k_hi, n0, g, c, word, sel);
  }
  if constexpr (SW) {  // (swapped registers: row 0 of columns 8i + g and 8i + 8 + g)
    if (c == 0) {
#pragma unroll
      for (int i = 0; i < NT; i += 2) {
        part[sp * C + 8 * i + g] = acc[i / 2][0];
        part[sp * C + 8 * i + 8 + g] = acc[i / 2][2];
      }
    }
  } else if (g == 0) {
#pragma unroll
    for (int i = 0; i < NT; ++i)
      *reinterpret_cast<float2*>(part + sp * C + 8 * i + 2 * c) = make_float2(acc[i][0], acc[i][1]);
  }
  __syncthreads();
  if constexpr (GATE_UP) {
    for (int j = threadIdx.x; j < C / 2; j += blockDim.x) {
      float gt = part[2 * j], up = part[2 * j + 1];
      for (int q = 1; q < S; ++q) {  // split order 0..S-1
        gt = gt + part[q * C + 2 * j];
        up = up + part[q * C + 2 * j + 1];
      }
      reinterpret_cast<__half*>(outv)[(long)a * stride_out + n0 / 2 + j] = __float2half_rn(silu_mul(gt, up));
    }
  } else {
    for (int j = threadIdx.x; j < C; j += blockDim.x) {
      float v = part[j];
      for (int q = 1; q < S; ++q) v = v + part[q * C + j];
      reinterpret_cast<float*>(outv)[(long)a * stride_out + n0 + j] = v;
    }
  }
}

// ---- the CUDA top-k (FUSED_TOPK: at every token count, so the fused experts may rank one
// token's logits themselves and give the same ids and weights): softmax over a row's E logits,
// the top-k by probability descending (ties to the lower id, NaN below every number), the
// weights renormalized over the k when `norm`. Its arithmetic is its own, in one fixed order
// whatever the CTA's size: mx = the max (exact); e_i = expf(l_i - mx); total = warp 0's sum
// (lane l adds e_l, e_{l+32}, ... in order, then a butterfly of 5); p_i = e_i / total; each
// expert's rank counted as the keys above its own (integers); wts = p / (the k picks' p summed
// in rank order) or p. The same picks as the Triton top-k wherever the probabilities differ,
// not its weights' last bits (its sums run in Triton's order).
#define TOPK_MAX_E 256
#define TOPK_MAX_K 32

// p >= 0 (or NaN) as an int that orders as p does; NaN below every number
__device__ __forceinline__ int prob_key(float p) {
  return p != p ? -1 : (p == 0.f ? 0 : __float_as_int(p));
}

// The top-k of the E logits sl (shared memory) into sid / sel (k each, shared) and, where ids
// is not null, ids / wts; by every thread of the CTA (blockDim a multiple of 32, >= E). sp,
// sk: E floats / ints; red: 1 (shared).
__device__ __forceinline__ void topk_cta(const float* sl, int E, int k, int norm, float* sp,
                                         int* sk, float* sel, int* sid, float* red,
                                         int* __restrict__ ids, float* __restrict__ wts) {
  const int tid = threadIdx.x, lane = tid & 31;
  if (tid < 32) {  // max, exponentials and their sum: warp 0, one fixed order
    float m = __int_as_float(0xff800000);  // -inf
    for (int i = lane; i < E; i += 32) m = fmaxf(m, sl[i]);
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float s = 0.f;
    for (int i = lane; i < E; i += 32) {  // a NaN logit: NaN, kept out of the sum (ranks last)
      const float l = sl[i], e = l != l ? l : expf(l - m);
      sp[i] = e;
      s += l != l ? 0.f : e;
    }
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) red[0] = s;
  }
  __syncthreads();
  const float total = red[0];
  for (int i = tid; i < E; i += blockDim.x) {
    const float p = sp[i] / total;
    sp[i] = p;
    sk[i] = prob_key(p);
  }
  __syncthreads();
  // expert i's rank: the keys above its own (ties: lower ids first), counted by h threads of
  // one warp over E / h keys each, then summed across them
  int h = 1;
  while (h < 32 && 2 * h * E <= (int)blockDim.x) h *= 2;
  const int i = tid / h, q = tid % h, per = (E + h - 1) / h;
  int above = 0;
  if (i < E) {
    const int ki = sk[i];
    const int j1 = min(E, (q + 1) * per);
    for (int j = q * per; j < j1; ++j) {
      const int kj = sk[j];
      above += (kj > ki) | ((kj == ki) & (j < i));
    }
  }
  for (int o = 1; o < h; o <<= 1) above += __shfl_xor_sync(0xffffffffu, above, o);
  if (i < E && q == 0 && above < k) {
    sel[above] = sp[i];
    sid[above] = i;
  }
  __syncthreads();
  if (ids != nullptr && tid < k) {
    float t = sel[0];
    for (int r = 1; r < k; ++r) t = t + sel[r];  // rank order
    ids[tid] = sid[tid];
    wts[tid] = norm ? sel[tid] / t : sel[tid];
  }
}

// The top-k of one logits row (global memory, read after the caller's PDL wait) by the whole
// CTA, in its own shared memory; ids / wts written where not null. Returns the picks' ids
// (shared memory, rank order).
__device__ __forceinline__ const int* topk_row(const float* __restrict__ row, int E, int k, int norm,
                                               int* __restrict__ ids, float* __restrict__ wts) {
  __shared__ float sl[TOPK_MAX_E], sp[TOPK_MAX_E], sel[TOPK_MAX_K], red[1];
  __shared__ int sk[TOPK_MAX_E], sid[TOPK_MAX_K];
  for (int i = threadIdx.x; i < E; i += blockDim.x) sl[i] = row[i];
  __syncthreads();
  topk_cta(sl, E, k, norm, sp, sk, sel, sid, red, ids, wts);
  return sid;
}

// grid (T); block 256: row t's top-k (after the PDL wait: the logits are the predecessor's)
#define TOPK_ROWS extern "C" __global__ void __launch_bounds__(256) topk_rows( \
    const float* __restrict__ logits, int* __restrict__ ids, float* __restrict__ wts, int E, \
    int k, int norm, int stride_l) { \
  pdl_wait(); \
  const long t = blockIdx.x; \
  topk_row(logits + t * stride_l, E, k, norm, ids + t * k, wts + t * k); }

// ---- the one-token experts fused (FUSED_EXPERTS): gate_up and down of an assignment a in
// one launch, its CTAs one thread block cluster of CS (16 warps each). CTA r takes gate_up's
// column tiles r TG .. r TG + TG - 1 (TG = 2I / (8 NT CS)) and down's r TD .. (TD = H / (8 NT
// CS)); warp w gate_up's (tile w / Sg, split w % Sg) and down's (tile w / Sd, split w % Sd),
// both splits streamed whole into shared memory at the start (once the top-k's ids are read:
// the predecessor's), so every weight byte of the CTA is in flight at once. gate_up's
// partials merged in split order give the CTA's TG x 4 NT intermediate values (silu_mul,
// rounded to fp16: q4_expert_cta's), which it also stores to inter; after the cluster's
// barrier each CTA gathers the assignment's whole intermediate from the cluster's shared
// memory (ld.shared::cluster) and runs down on it: q4_expert_cta's arithmetic, streamed or
// ring (the same MMAs in the same order), so the same bits. grid (CS, T topk); block 512;
// shared memory: fused_smem (the host's `_fused_smem`).
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ float4 ld_cluster16(const void* p, unsigned rank) {
  unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p)), r;
  float4 v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(r) : "memory");
  return v;
}

__device__ __forceinline__ int align16(int b) { return (b + 15) & ~15; }

// TOPK: ids is the top-k's output, not its input: each CTA ranks its token's logits row itself
// (topk_cta, after the PDL wait: the router's), and the token's first assignment's CTA 0
// writes ids and wts (for the combine).
template <int NT, int CS, bool TOPK = false>
__device__ __forceinline__ void q4_expert_fused(const float* __restrict__ x, int* __restrict__ ids,
                                                const unsigned char* __restrict__ gq,
                                                const unsigned* __restrict__ gs,
                                                const unsigned char* __restrict__ dq,
                                                const unsigned* __restrict__ ds,
                                                __half* __restrict__ inter, float* __restrict__ y,
                                                int H, int I, int stride_x, int Sg, int Sd, int topk,
                                                const float* __restrict__ logits = nullptr,
                                                float* __restrict__ wts = nullptr, int E = 0,
                                                int norm = 0, int stride_l = 0) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int C = 8 * NT;
  const int TG = 2 * I / (C * CS), TD = H / (C * CS), IL = TG * C / 2;  // IL: this CTA's values
  const int lane = threadIdx.x & 31, c = lane & 3, g = lane >> 2, w = threadIdx.x >> 5;
  const int a = blockIdx.y, r = static_cast<int>(cluster_rank());
  const int nbg = H / 32 / Sg, nbd = I / 32 / Sd;  // blocks a split (the host: whole groups of 4)
  float* part_gu = reinterpret_cast<float*>(smem);   // [TG][Sg][C]
  float* part_dn = part_gu + TG * Sg * C;             // [TD][Sd][C]
  SHalf* xin = reinterpret_cast<SHalf*>(part_dn + TD * Sd * C);  // [I]: the whole intermediate
  __half* mine = reinterpret_cast<__half*>(xin + I);             // [IL]: this CTA's part of it
  unsigned char* sgu = smem + align16((TG * Sg + TD * Sd) * C * 4 + 2 * I + 2 * IL);
  unsigned char* sdn = sgu + TG * Sg * nbg * C * 20;
  const bool gu_task = w < TG * Sg, dn_task = w < TD * Sd;
  const int gt = w / Sg, gsp = w % Sg, dt = w / Sd, dsp = w % Sd;
  int glo, ghi, dlo, dhi, word;
  unsigned sel;
  split_k(H, Sg, gsp, glo, ghi);
  split_k(I, Sd, dsp, dlo, dhi);
  lane_bytes(c, sel, word);
  pdl_wait();  // ids: the top-k's (TOPK: the router's logits)
  long e;
  if constexpr (TOPK) {
    const long t = a / topk;
    const bool writer = r == 0 && a % topk == 0;
    e = topk_row(logits + t * stride_l, E, topk, norm, writer ? ids + t * topk : nullptr,
                 writer ? wts + t * topk : nullptr)[a % topk];
  } else {
    e = ids[a];
  }
  const int gn0 = (r * TG + gt) * C, dn0 = (r * TD + dt) * C;
  unsigned char* my_gu = sgu + w * nbg * C * 20;
  unsigned char* my_dn = sdn + w * nbd * C * 20;
  if (gu_task)
    stream_issue<NT>(my_gu, gq + e * (long)(H >> 5) * (2 * I) * 16, gs + e * (long)(H >> 5) * (2 * I),
                     2 * I, glo, ghi, gn0);
  if (dn_task)
    stream_issue<NT>(my_dn, dq + e * (long)(I >> 5) * H * 16, ds + e * (long)(I >> 5) * H, H, dlo,
                     dhi, dn0);
  const bool v0 = g == 0;  // one row: the assignment's
  float acc[NT][4];
  if (gu_task) {
#pragma unroll
    for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    const float* x0 = x + (long)(a / topk) * stride_x;
    stream_compute<false, NT, 0, true>(acc, my_gu, x0, x0, v0, false, glo, ghi, g, c, word, sel,
                                       dn_task ? stream_groups(nbd) : 0);
    float* pp = part_gu + (gt * Sg + gsp) * C;
    if (c == 0) {  // (swapped registers: row 0 of columns 8i + g and 8i + 8 + g)
#pragma unroll
      for (int i = 0; i < NT; i += 2) {
        pp[8 * i + g] = acc[i / 2][0];
        pp[8 * i + 8 + g] = acc[i / 2][2];
      }
    }
  }
  __syncthreads();
  for (int j = threadIdx.x; j < IL; j += blockDim.x) {
    const float* pp = part_gu + (j / (C / 2)) * Sg * C;
    const int jj = j % (C / 2);
    float gv = pp[2 * jj], up = pp[2 * jj + 1];
    for (int q = 1; q < Sg; ++q) {  // split order 0..S-1
      gv = gv + pp[q * C + 2 * jj];
      up = up + pp[q * C + 2 * jj + 1];
    }
    const __half v = __float2half_rn(silu_mul(gv, up));
    mine[j] = v;
    inter[(long)a * I + r * IL + j] = v;
  }
  cluster_arrive();  // every CTA's part of the intermediate is in its shared memory
  cluster_wait();
  for (int i = threadIdx.x; i < I / 8; i += blockDim.x) {  // 16 bytes (8 values) a load
    const int q = i / (IL / 8), o = i % (IL / 8);
    *reinterpret_cast<float4*>(xin + 8 * i) = ld_cluster16(mine + 8 * o, q);
  }
  cluster_arrive();  // (this CTA has read the others' shared memory: they may leave)
  __syncthreads();
  if (dn_task) {
#pragma unroll
    for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    stream_compute<false, NT, 0, true>(acc, my_dn, xin, xin, v0, false, dlo, dhi, g, c, word, sel);
    float* pp = part_dn + (dt * Sd + dsp) * C;
    if (c == 0) {
#pragma unroll
      for (int i = 0; i < NT; i += 2) {
        pp[8 * i + g] = acc[i / 2][0];
        pp[8 * i + 8 + g] = acc[i / 2][2];
      }
    }
  }
  __syncthreads();
  for (int j = threadIdx.x; j < TD * C; j += blockDim.x) {
    const float* pp = part_dn + (j / C) * Sd * C;
    float v = pp[j % C];
    for (int q = 1; q < Sd; ++q) v = v + pp[q * C + j % C];
    y[(long)a * H + r * TD * C + j] = v;
  }
  cluster_wait();  // no CTA leaves while another may still read its shared memory
}

#define Q4_EFUSED(NT, CS) extern "C" __global__ void __cluster_dims__(CS, 1, 1) \
    __launch_bounds__(512, 1) q4_efused##CS##_##NT(const float* x, int* ids, \
    const unsigned char* gq, const unsigned* gs, const unsigned char* dq, const unsigned* ds, \
    __half* inter, float* y, int H, int I, int stride_x, int Sg, int Sd, int topk) { \
    q4_expert_fused<NT, CS>(x, ids, gq, gs, dq, ds, inter, y, H, I, stride_x, Sg, Sd, topk); }
// ... ranking the token's logits itself (FUSED_TOPK): q4_efusedk{CS}_{NT}
#define Q4_EFUSEDK(NT, CS) extern "C" __global__ void __cluster_dims__(CS, 1, 1) \
    __launch_bounds__(512, 1) q4_efusedk##CS##_##NT(const float* x, int* ids, \
    const unsigned char* gq, const unsigned* gs, const unsigned char* dq, const unsigned* ds, \
    __half* inter, float* y, const float* logits, float* wts, int H, int I, int stride_x, \
    int Sg, int Sd, int topk, int E, int norm, int stride_l) { \
    q4_expert_fused<NT, CS, true>(x, ids, gq, gs, dq, ds, inter, y, H, I, stride_x, Sg, Sd, topk, \
                                  logits, wts, E, norm, stride_l); }

#define Q4_EXPERT(KIND, GU, NT, D) extern "C" __global__ void __launch_bounds__(256, 1) \
    q4_e##KIND##NT##_d##D(const void* x, const int* ids, const unsigned char* qs, \
                          const unsigned* sm, void* out, int N, int K, int stride_x, \
                          int stride_out, int S, int topk, int early) { \
    q4_expert_cta<NT, D, GU>(x, ids, qs, sm, out, N, K, stride_x, stride_out, S, topk, \
                             GU ? 0 : early); }
// the same with the swapped registers (SW, block_mma_sw): q4_es{KIND}{NT}_d{D}, NT even
#define Q4_EXPERT_SW(KIND, GU, NT, D) extern "C" __global__ void __launch_bounds__(256, 1) \
    q4_es##KIND##NT##_d##D(const void* x, const int* ids, const unsigned char* qs, \
                           const unsigned* sm, void* out, int N, int K, int stride_x, \
                           int stride_out, int S, int topk, int early) { \
    q4_expert_cta<NT, D, GU, true>(x, ids, qs, sm, out, N, K, stride_x, stride_out, S, topk, \
                                   GU ? 0 : early); }

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
// the swapped form (q4_swap): entries q4_swap{MT}_{NG}_w{W}
#define Q4_SWAP(MT, NG, W) extern "C" __global__ void __launch_bounds__(32 * W, 1) \
    q4_swap##MT##_##NG##_w##W(Q4_ARGS) { q4_swap<MT, NG, W>(Q4_PASS); }
// the CTA form (q4_cta): entries q4_cta{ROWS}_{NT}_d{D}; up to 8 splits, 256 threads a CTA (at
// 512 the 128-register cap spills the 16-column rings)
#define Q4_CTA(ROWS, NT, D) extern "C" __global__ void __launch_bounds__(256, 1) \
    q4_cta##ROWS##_##NT##_d##D(Q4_ARGS) { \
    q4_cta<ROWS == 16, NT, D>(x, qs, sm, res, y, M, N, K, stride_x, stride_res, stride_y, S, has_res); }
// the CTA form at <= 8 rows with the swapped registers (SW, block_mma_sw): q4_ctas8_{NT}_d{D},
// NT even, and the 512-thread q4_ctaws8_{NT}_d{D}
#define Q4_CTAS(NT, D) extern "C" __global__ void __launch_bounds__(256, 1) \
    q4_ctas8_##NT##_d##D(Q4_ARGS) { \
    q4_cta<false, NT, D, true>(x, qs, sm, res, y, M, N, K, stride_x, stride_res, stride_y, S, has_res); }
#define Q4_CTAWS(NT, D) extern "C" __global__ void __launch_bounds__(512, 1) \
    q4_ctaws8_##NT##_d##D(Q4_ARGS) { \
    q4_cta<false, NT, D, true>(x, qs, sm, res, y, M, N, K, stride_x, stride_res, stride_y, S, has_res); }
// 9-16 splits (the router's 16): 512 threads a CTA, the rings that fit 128 registers unspilled
#define Q4_CTAW(ROWS, NT, D) extern "C" __global__ void __launch_bounds__(512, 1) \
    q4_ctaw##ROWS##_##NT##_d##D(Q4_ARGS) { \
    q4_cta<ROWS == 16, NT, D>(x, qs, sm, res, y, M, N, K, stride_x, stride_res, stride_y, S, has_res); }
"""
# Two modules of SOURCE's kernels: CORE, what the engine launches (the CTA forms of the linear
# and of the one-token experts), loaded with the kernels; EXTRA, the forms the benches and tests
# compare (the split programs with their ticket merge, streamed splits, probes, the swapped
# form, the CTA forms with x as A that SWAP_REGS replaces: most of the PTX), compiled and
# loaded on their first launch only.
# the CTA forms at <= 8 rows with the swapped registers (SWAP_REGS, the default since v29; the
# one-row experts and the linear): (columns a warp, depth), and the 512-thread linear at 16
# columns, depth 2; the forms they replace (x as A) are in EXTRA, for `noswregs`
SW_FORMS = tuple((cols, d) for cols in (16, 32) for d in (2, 4, 8) if cols * d <= 128)
CORE = r"""
Q4_EXPERT(gu, true, 1, 2) Q4_EXPERT(gu, true, 1, 4) Q4_EXPERT(gu, true, 1, 8)
Q4_EXPERT(dn, false, 1, 2) Q4_EXPERT(dn, false, 1, 4) Q4_EXPERT(dn, false, 1, 8)
Q4_CTA(8, 1, 2) Q4_CTA(8, 1, 4) Q4_CTA(8, 1, 8) Q4_CTA(16, 1, 2) Q4_CTA(16, 1, 4) Q4_CTA(16, 2, 2)
Q4_CTA(16, 2, 4) Q4_CTA(16, 4, 2) Q4_CTA(16, 4, 4)
Q4_CTAW(8, 1, 2) Q4_CTAW(8, 1, 4) Q4_CTAW(8, 1, 8) Q4_CTAW(16, 1, 2) Q4_CTAW(16, 1, 4)
Q4_CTAW(16, 2, 2) Q4_CTAWS(2, 2)
"""
CORE += "".join(f"Q4_EXPERT_SW(gu, true, {c // 8}, {d}) Q4_EXPERT_SW(dn, false, {c // 8}, {d}) "
                f"Q4_CTAS({c // 8}, {d})\n" for c, d in SW_FORMS)
EXTRA = r"""
Q4_ROWS(8) Q4_ROWS(16) Q4_ENTRY(8, 1, 8) Q4_ENTRY(8, 2, 8)  // (16 rows at depth 8 spill)
// depth 0: the split streamed whole into shared memory (stream_acc)
Q4_ENTRY(8, 1, 0) Q4_ENTRY(8, 2, 0) Q4_ENTRY(8, 4, 0) Q4_ENTRY(16, 1, 0) Q4_ENTRY(16, 2, 0) Q4_ENTRY(16, 4, 0)
// the CTA form at <= 8 rows with each warp's split streamed whole before the wait (CTA_STREAM)
Q4_CTA(8, 1, 0) Q4_CTA(8, 2, 0) Q4_CTA(8, 4, 0) Q4_CTAS(2, 0) Q4_CTAS(4, 0)
// the one-token gate_up with each warp's split streamed whole (EXPERT_STREAM)
Q4_EXPERT(gu, true, 1, 0) Q4_EXPERT(gu, true, 2, 0) Q4_EXPERT(gu, true, 4, 0) Q4_EXPERT_SW(gu, true, 2, 0)
Q4_EXPERT_SW(gu, true, 4, 0)
// the one-token experts fused in a cluster of 16 CTAs (FUSED_EXPERTS; 4: the emulator's tests)
Q4_EFUSED(2, 16) Q4_EFUSED(2, 4) Q4_EFUSEDK(2, 16) Q4_EFUSEDK(2, 4) TOPK_ROWS
// ... and the one-token down the same way, its copies before the wait (DOWN_STREAM)
Q4_EXPERT(dn, false, 1, 0) Q4_EXPERT(dn, false, 2, 0) Q4_EXPERT(dn, false, 4, 0) Q4_EXPERT_SW(dn, false, 2, 0)
Q4_EXPERT_SW(dn, false, 4, 0)
// probes (bench only, wrong values): P 1 the streamed loads alone (no MMAs, no merge), P 2 without the
// split merge (every split writes y), P 3 two accumulator chains (even / odd blocks)
extern "C" __global__ void q4_probe1(Q4_ARGS) { q4_split<false, 2, 0, 1>(Q4_PASS); }
extern "C" __global__ void q4_probe2(Q4_ARGS) { q4_split<false, 2, 0, 2>(Q4_PASS); }
extern "C" __global__ void q4_probe3(Q4_ARGS) { q4_split<false, 2, 0, 3>(Q4_PASS); }
"""
# the swapped form's (MT, NG, W) instances
SWAP_FORMS = tuple((mt, ng, w) for mt in (1, 2) for ng in (2, 4, 8) for w in (4, 8))
EXTRA += "".join(f"Q4_SWAP({mt}, {ng}, {w})\n" for mt, ng, w in SWAP_FORMS)
EXTRA += "".join(f"Q4_EXPERT(gu, true, {c // 8}, {d}) Q4_EXPERT(dn, false, {c // 8}, {d}) "
                 f"Q4_CTA(8, {c // 8}, {d})\n" for c, d in SW_FORMS) + "Q4_CTAW(8, 2, 2)\n"
PARTS = ("core", "extra")


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


def ptx(arch: str = "compute_90", cache: bool = True, part: str = "core") -> bytes:
    """SOURCE with part's kernels (CORE or EXTRA) compiled by NVRTC for `arch` (no GPU needed;
    2.8 s for the core, 7.5 s for the rest on a 2-core CPU), kept in CACHE_DIR under a hash of
    the source, the arch, the options and the NVRTC library, so later processes load it at
    once (cache False: compile anyway, keep nothing)."""
    source = SOURCE + {"core": CORE, "extra": EXTRA}[part]
    key = hashlib.sha256("\0".join((source, arch, " ".join(_OPTIONS), _find("libnvrtc.so*[0-9]")
                                     or "", _find("cuda_fp16.h") or "")).encode()).hexdigest()
    cache = cache and CACHE_DIR is not None
    path = os.path.join(CACHE_DIR or "", f"cuda_q4-{key[:24]}.ptx")
    if cache and os.path.exists(path):
        with open(path, "rb") as f:
            return f.read()
    code = _compile(arch, source)
    if cache:
        try:  # written whole or not at all (another process may be writing the same file)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(code)
            os.replace(tmp, path)
        except OSError:  # a read-only home: compile every time
            pass
    return code


_OPTIONS = ("-default-device", "-std=c++17")


# where compiled PTX is kept (None: nowhere, every process compiles)
CACHE_DIR: str | None = os.path.join(os.path.expanduser("~"), ".cache", "fedserve")


def _compile(arch: str, source: str) -> bytes:
    header = _find("cuda_fp16.h")
    if header is None:
        raise RuntimeError("cuda_q4: cuda_fp16.h not found (pip install nvidia-cuda-runtime-cu12)")
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"cuda_q4.cu", 0, None, None):
        raise RuntimeError("cuda_q4: nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in _OPTIONS),
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


# the kernel entries of the experts' and the linear's CTA forms (rows of a launch up to 8 / up to
# 16 a row tile, x columns a warp = 8 NT): (kind, columns, depth), (rows, columns, depth)
_EXPERT_FORMS = tuple((kind, cols, d) for kind in ("gu", "dn") for cols in (8, 16, 32)
                      for d in (2, 4, 8) if cols * d <= 128)
# the 512-thread CTA form for 9-16 splits: (rows, columns a warp) → the deepest ring it has
CTAW_DEPTH = {(8, 8): 8, (8, 16): 2, (16, 8): 4, (16, 16): 2}
_CTAW_FORMS = tuple((rows, cols, d) for (rows, cols), top in CTAW_DEPTH.items()
                    for d in (2, 4, 8) if d <= top)
_CTA_FORMS = tuple((rows, cols, d) for rows in (8, 16) for cols in (8, 16, 32) for d in (2, 4, 8)
                   if cols * d <= 128 and (d < 8 or rows == 8))


def _cta_entries(swapped: bool) -> tuple:
    """The CTA forms' entries: at <= 8 rows and more than 8 columns a warp the swapped
    registers' ("s", SW_FORMS) if `swapped`, else x as A's; every other form by its one name."""
    def sw(rows: int, cols: int) -> str:
        return "s" if swapped and rows == 8 and cols > 8 else ""
    return (tuple(f"q4_e{sw(8, c)}{kind}{c // 8}_d{d}".encode() for kind, c, d in _EXPERT_FORMS)
            + tuple(f"q4_ctaw{sw(r, c)}{r}_{c // 8}_d{d}".encode() for r, c, d in _CTAW_FORMS)
            + tuple(f"q4_cta{sw(r, c)}{r}_{c // 8}_d{d}".encode() for r, c, d in _CTA_FORMS))


# the core module's: the swapped registers where they apply (the engine's forms)
ENTRIES = _cta_entries(True)
# the extra module's: the split programs (depth 0: streamed), the swapped form, the probes and
# the CTA forms the swapped registers replace
PROBES = (b"q4_probe1", b"q4_probe2", b"q4_probe3")  # bench only: 16 columns, <= 8 rows, streamed
EXTRA_ENTRIES = tuple(f"q4_split{rows}_{cols // 8}_d{d}".encode()
                      for rows in (8, 16) for cols in (8, 16, 32) for d in (0, 2, 4, 8)
                      if cols * d <= 128 and (d < 8 or rows == 8))
EXTRA_ENTRIES += tuple(f"q4_swap{mt}_{ng}_w{w}".encode() for mt, ng, w in SWAP_FORMS) + PROBES
EXTRA_ENTRIES += tuple(e for e in _cta_entries(False) if e not in ENTRIES)
EXTRA_ENTRIES += tuple(f"q4_{kind}{sw}8_{c // 8}_d0".encode() if kind == "cta"
                       else f"q4_e{sw}{kind}{c // 8}_d0".encode()
                       for kind in ("cta", "gu", "dn") for c in (8, 16, 32)
                       for sw in ("", "s") if not (sw and c == 8))
EXTRA_ENTRIES += (b"q4_efused16_2", b"q4_efused4_2", b"q4_efusedk16_2", b"q4_efusedk4_2", b"topk_rows")
STREAM = 0  # the depth that names the other form: the warp's split streamed into shared memory
COLS = 16  # columns a warp by default (the fastest at 1-8 rows of qkv, GPU_NOTES v15)
DEPTH = 8  # blocks a warp keeps in flight (register ring slots), or STREAM
# 8 columns a warp for a weight whose 16-column CTAs would not fill the SMs (o at 2,048
# outputs: 128 CTAs of 8 splits, 1 an SM at 150 registers; at 8 columns 256 CTAs at ~115, 2
# an SM, twice the warps in flight). Columns a warp change no bit. The default since v26
# (H100, 128 x 1: +1.0% over three runs in v25, +0.9-2.0% over three in v26; 64 streams
# unchanged; the engine's bitwise sets pass); False: COLS everywhere (bench/ab_modes.py
# `nofillcols`)
FILL_COLS = True
# the CTA form (q4_cta: a CTA's warps run a column tile's splits, merged in shared memory)
# instead of split programs with a ticket merge in global memory, where the weight is split
CTA = True
CTA_SPLITS_256 = 8  # its warps a CTA: 256 threads (q4_cta, q4_expert_cta) up to 8 splits,
CTA_MAX_SPLIT = 16  # 512 (q4_ctaw) up to 16
EXPERT_MAX_SPLIT = CTA_SPLITS_256  # the experts' CTA form: 256-thread entries only
# at depth 8 a split of fewer blocks runs depth 4: H100, cold, o (16 blocks a split) 1 / 8 rows
# 6.1 / 8.3 µs at depth 8, 5.8 / 7.2 at 4; qkv (32 blocks) 7.7 / 9.4 at 8, 8.1 / 9.7 at 4
CTA_DEEP_BLOCKS = 32
SWAP_MT = 2  # the swapped form: m16 feature tiles a warp
SWAP_WARPS = 4  # ... and warps a CTA
EXPERT_COLS = 16  # the direct experts' CTA form: columns a warp
EXPERT_DEPTH = 4  # ... and blocks in flight (register ring slots; fewer where a split needs)
# down reads its expert ids (the top-k's, two kernels back) and issues its ring's first weight
# loads before the PDL wait, as the linear's CTA form does its weights: the expert id and the
# first blocks' DRAM round trips under gate_up's tail; the same loads, so the same bits. The
# default since v21 (with triton_pdl.EARLY_INPUTS: above); False: after the wait
# (bench/ab_modes.py `noeidsfirst`)
EXPERT_EARLY = True
# the CTA forms at <= 8 rows (the linear at 16 / 32 columns a warp, the one-row experts) with
# the MMA's operands swapped (block_mma_sw): the weights as A, 16 columns an MMA with no zero
# registers, x as B, half the MMAs: the same products in the same order, so the same bits (the
# engine's bitwise sets pass under it, v29). The default since v29 (H100, one stream: -0.4 to
# +0.9% at context 128, +1.1-1.4% at 2,048; 64 streams unchanged); False: x as A (bench/ab_modes.py `noswregs`; those entries
# are in the extra module)
SWAP_REGS = True
# the one-token gate_up (q4_e{s}gu{NT}_d0) with each warp's whole split streamed into shared
# memory (after the wait: its expert comes from the top-k, its predecessor), every byte of it
# in flight at once instead of EXPERT_DEPTH blocks a warp; down keeps its ring (its splits are
# not whole groups of 16 blocks at the 30B shape). The same MMAs in the same order, so the
# same bits. Off until measured (bench/ab_modes.py `estream`)
EXPERT_STREAM = False
# the one-token down (q4_e{s}dn{NT}_d0) the same way, its copies issued before the PDL wait
# (down reads its expert ids there, EXPERT_EARLY): all of its split's weights in flight under
# gate_up's tail instead of its ring's first EXPERT_DEPTH blocks (the 30B: 2 splits of 12
# blocks, 3 commit groups). The same MMAs in the same order, so the same bits. Off until
# measured (bench/ab_modes.py `dstream`)
DOWN_STREAM = False
# one token's experts (gate_up, then down) in one launch (q4_efused{CS}_2: an assignment a
# thread block cluster of FUSED_CLUSTER CTAs, 16 columns a warp, every weight byte of the CTA
# streamed into shared memory at once, the intermediate handed over through the cluster's
# shared memory): one kernel boundary fewer a layer. The same MMAs in the same order, so the
# same bits. Off until measured (bench/ab_modes.py `efused`)
FUSED_EXPERTS = False
FUSED_CLUSTER = 16
# the MoE's top-k on this module's CUDA top-k (topk_rows) at every token count and, with
# FUSED_EXPERTS, one token's top-k inside the fused experts (q4_efusedk{CS}_2: each CTA ranks
# the router's logits itself): one kernel boundary fewer again. Its weights are not the Triton
# top-k's bits, so it runs at every token count or not at all. Off until measured
# (bench/ab_modes.py `efusedk`)
FUSED_TOPK = False
_NONPORTABLE: set = set()  # kernels allowed clusters of more than 8 CTAs
# the CTA form at <= 8 rows with each warp's whole split streamed into shared memory, its
# copies issued before the PDL wait (q4_cta{s}8_{NT}_d0, where `cta_streams`), instead of the
# register ring's first D blocks: every weight byte of the kernel in flight while its
# predecessor ends. The same arithmetic in the same order, so the same bits. A one-row probe
# of the idea (bench/preload_probe.py, H100) ran a phase in 4.53 µs against the CTA form's
# 5.13 (GPU_NOTES v32). Off until measured in the engine (bench/ab_modes.py `cstream`)
CTA_STREAM = False
_BIG_SMEM: set = set()  # kernels given more than 48 KB of dynamic shared memory
_TICKETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Q4Linear → {key: tickets}


def _load(cuda: ctypes.CDLL, device: int, part: str, names: tuple) -> dict:
    """{entry: function} of part's module, loaded into torch's context on `device`."""
    major, minor = torch.cuda.get_device_capability(device)
    code = ptx(f"compute_{major}{minor}", part=part)
    mod = ctypes.c_void_p()
    with torch.cuda.device(device):  # the device's primary context current on this thread
        torch.zeros(1, device=f"cuda:{device}")
        if cuda.cuModuleLoadData(ctypes.byref(mod), code):
            raise RuntimeError(f"cuda_q4: the driver could not load the {part} module")
    fns = {}
    for name in names:
        fns[name] = ctypes.c_void_p()
        if cuda.cuModuleGetFunction(ctypes.byref(fns[name]), mod, name):
            raise RuntimeError(f"cuda_q4: no kernel {name.decode()}")
    return fns


class _Functions(dict):
    """The core module's functions; an EXTRA entry's first lookup loads the extra module."""

    def __init__(self, cuda: ctypes.CDLL, device: int) -> None:
        super().__init__(_load(cuda, device, "core", ENTRIES))
        self.cuda, self.device = cuda, device

    def __missing__(self, name: bytes) -> ctypes.c_void_p:
        if name not in EXTRA_ENTRIES:
            raise KeyError(name)
        with _EXTRA_LOCK:
            if name not in self:
                self.update(_load(self.cuda, self.device, "extra", EXTRA_ENTRIES))
        return dict.__getitem__(self, name)


_EXTRA_LOCK = threading.Lock()


@functools.cache
def _functions(device: int) -> tuple[ctypes.CDLL, dict]:
    """(libcuda, {entry: function}) loaded into torch's context on `device` (the core module
    now, the extra one on its first use)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    return cuda, _Functions(cuda, device)


_UNAVAILABLE: dict = {}  # device → why the kernels could not be built or loaded there


def available(device: int) -> bool:
    """Whether the kernels load on `device` (NVRTC, the CUDA headers and the driver): tried
    once a device; where not, one warning says why and the callers keep to Triton."""
    if device in _UNAVAILABLE:
        return False
    try:
        _functions(device)
    except (RuntimeError, OSError) as e:
        _UNAVAILABLE[device] = str(e)
        warnings.warn(f"cuda_q4 unavailable on cuda:{device} ({e}); the Triton q4 tile runs "
                      "instead (the same bits)", RuntimeWarning, stacklevel=2)
        return False
    return True


def fits(lin: Q4Linear, x: torch.Tensor, out: torch.Tensor,
         residual: torch.Tensor | None = None) -> bool:
    """Whether `linear` takes these operands at the defaults (COLS, DEPTH, CTA) and its
    kernels load on x's device."""
    ok = (lin.out_features % COLS == 0 and lin.in_features % 64 == 0 and LINEAR_TILE.bk == 64
          and COLS * max(DEPTH, 1) <= 128)  # (splits the CTA form lacks: the split programs)
    for t in (x, out) + ((residual,) if residual is not None else ()):
        ok = ok and t.is_cuda and t.dtype == torch.float32 and t.stride(1) == 1 \
            and t.stride(0) % 2 == 0
    return ok and available(x.device.index or 0)


def _tickets(lin: Q4Linear, cols: int) -> torch.Tensor:
    """The ticket counters of lin's split programs for column tiles of `cols` (zero between
    launches: the last program of a tile resets its own), one a (row tile of 16 or more rows,
    column tile)."""
    per = _TICKETS.setdefault(lin, {})
    if cols not in per:
        per[cols] = torch.zeros(q4_layout.SPLIT_ROWS // 16 * (lin.out_features // cols),
                                dtype=torch.int32, device=lin.qs.device)
    return per[cols]


def linear(lin: Q4Linear, x: torch.Tensor, out: torch.Tensor,
           residual: torch.Tensor | None = None, cols: int | None = None, warps: int = 1,
           depth: int | None = None, probe: bytes | None = None,
           cta: bool | None = None) -> torch.Tensor:
    """out [n, N] = x @ W.T (+ residual), as kernels/triton_q4.py `linear` with LINEAR_TILE and
    parallel splits computes it; x [n, K] float32 contiguous rows, CUDA tensors; N a multiple
    of `cols` (8, 16 or 32 columns a warp; `warps` warps a CTA), K of 64; `depth` (2, 4 or 8)
    blocks of weights and x in flight a warp, STREAM: the warp's whole split streamed into
    shared memory at once.
    probe: a PROBES kernel to launch instead (bench only: wrong values). cta (default CTA):
    the CTA form where it applies (a ring depth, ≤ CTA_MAX_SPLIT splits), a CTA the splits of
    a column tile (`warps` ignored); cta=True with depth STREAM: the CTA form with each warp's
    split streamed into shared memory before the PDL wait (`cta_streams`; the default where
    CTA_STREAM and no depth is asked)."""
    n, big_n, k = x.shape[0], lin.out_features, lin.in_features
    chosen, cta_asked = depth is not None, cta is True
    if cols is None and FILL_COLS and big_n % 8 == 0 and x.is_cuda and big_n // COLS < _sm_count(x.device.index or 0):
        cols = 8
    cols, depth = cols or COLS, DEPTH if depth is None else depth
    cta = CTA if cta is None else cta
    if cta and probe is None and cta_takes(lin, cols):
        if not chosen and CTA_STREAM and cta_streams(lin, n, cols):
            return _cta_linear(lin, x, out, residual, cols, STREAM, True)
        if depth != STREAM or (cta_asked and cta_streams(lin, n, cols)):
            return _cta_linear(lin, x, out, residual, cols, depth, chosen)
    _check(x, out, residual)
    if cols not in (8, 16, 32) or big_n % cols or k % 64 or LINEAR_TILE.bk != 64 \
            or depth not in (STREAM, 2, 4, 8) or cols * depth > 128:
        raise ValueError("cuda_q4: cols 8, 16 or 32 dividing N; K a multiple of 64; depth 2, 4 "
                         "or 8 (cols x depth ≤ 128), or STREAM")
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


@functools.cache
def _sm_count(device: int) -> int:
    """The device's SM count."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def cta_takes(lin: Q4Linear, cols: int) -> bool:
    """Whether the CTA form has entries for lin's split count at `cols` columns a warp."""
    return lin.split <= CTA_SPLITS_256 or (lin.split <= CTA_MAX_SPLIT and cols in (8, 16))


def cta_streams(lin: Q4Linear, rows: int, cols: int) -> bool:
    """Whether the streamed CTA form (depth STREAM: q4_cta{s}8_{NT}_d0) takes lin at `rows`
    rows and `cols` columns a warp: at most 8 rows and CTA_SPLITS_256 splits, every split whole
    groups of 16 blocks, its shared memory within the device's 227 KB."""
    s, k = lin.split, lin.in_features
    blocks = k // 32 // s
    return (0 < rows <= 8 and s <= CTA_SPLITS_256 and cols in (8, 16, 32) and k % (64 * s) == 0
            and blocks % 16 == 0 and _stream_smem(s, blocks, cols) <= 227 * 1024)


def _stream_smem(splits: int, blocks: int, cols: int, rows: int = 16) -> int:
    """Dynamic shared memory of a streamed CTA form: the split partials (`rows` rows: 16 for
    the linear, 1 for the one-token experts), then each warp's blocks (16 bytes of nibbles
    and a 4-byte scale pair a column)."""
    return splits * rows * cols * 4 + splits * blocks * cols * 20


def _cta_linear(lin: Q4Linear, x: torch.Tensor, out: torch.Tensor,
                residual: torch.Tensor | None, cols: int, depth: int,
                chosen: bool = False) -> torch.Tensor:
    """`linear` in the CTA form (q4_cta); depth (unless chosen by the caller) 4 for splits
    of fewer than CTA_DEEP_BLOCKS blocks; STREAM: each warp's split streamed whole before the
    wait, where `cta_streams` (else the ring's default depth)."""
    n, big_n, k = x.shape[0], lin.out_features, lin.in_features
    _check(x, out, residual)
    stream = depth == STREAM and cta_streams(lin, n, cols) and big_n % cols == 0 \
        and LINEAR_TILE.bk == 64
    if depth == STREAM and not stream:
        depth, chosen = DEPTH, False
    if not stream and (cols not in (8, 16, 32) or big_n % cols or k % 64 or LINEAR_TILE.bk != 64
                       or depth not in (2, 4, 8) or cols * depth > 128 or not cta_takes(lin, cols)):
        raise ValueError("cuda_q4: the CTA form needs cols 8, 16 or 32 dividing N, K a multiple "
                         f"of 64, depth 2, 4 or 8 (cols x depth ≤ 128), ≤ {CTA_MAX_SPLIT} splits "
                         "(above 8: 8 or 16 cols)")
    cuda, fns = _functions(x.device.index or 0)
    sm = lin.sm.view(torch.int32)
    rows = 16 if n > 8 else 8
    res = residual if residual is not None else out
    sw = "s" if SWAP_REGS and rows == 8 and cols > 8 else ""  # (wide: 16 columns, depth 2)
    if stream:  # (8 rows)
        name, smem = f"q4_cta{sw}8_{cols // 8}_d0", _stream_smem(lin.split, k // 32 // lin.split, cols)
    else:
        wide, depth = _cta_plan(lin, rows, cols, depth, chosen)
        name = f"q4_cta{'w' if wide else ''}{sw}{rows}_{cols // 8}_d{depth}"
        smem = lin.split * 16 * cols * 4
    _launch(cuda, fns[name.encode()], (big_n // cols, 1, -(-n // 16)), 32 * lin.split, smem,
            (x, lin.qs, sm, res, out, out, sm),
            (n, big_n, k, x.stride(0), res.stride(0), out.stride(0), lin.split,
             int(residual is not None)))
    return out


def _cta_plan(lin: Q4Linear, rows: int, cols: int, depth: int, chosen: bool) -> tuple[bool, int]:
    """(wide, depth) of the CTA form's entry for lin at row tiles of `rows`: 512 threads above
    CTA_SPLITS_256 splits (fewer registers, so shallower rings); depth (unless chosen by the
    caller) 4 for splits of fewer than CTA_DEEP_BLOCKS blocks, then halved to whole rounds
    (16-row tiles ≤ 4). The depth changes no bit."""
    blocks = -(-lin.in_features // 64 // lin.split) * 2
    if not chosen and depth == 8 and blocks < CTA_DEEP_BLOCKS:
        depth = 4
    wide = lin.split > CTA_SPLITS_256
    if wide:
        depth = min(depth, CTAW_DEPTH[(rows, cols)])
    while blocks % depth or (depth == 8 and rows > 8):
        depth //= 2
    return wide, depth


def experts_fit(experts, x: torch.Tensor) -> bool:
    """Whether `experts_direct` takes these stacked experts (kernels/moe_layout.py) and x at
    EXPERT_COLS and its kernels load on x's device."""
    if experts.fmt != "q4" or not x.is_cuda or x.dtype != torch.float32 or x.stride(1) != 1 \
            or x.stride(0) % 2:
        return False
    i, h = experts.inter, experts.hidden
    (gw, gs), (dw, ds) = experts.gu, experts.down
    whole = all(t.is_contiguous() for t in (gw, gs, dw, ds))
    return (whole and max(experts.gu_split, experts.down_split) <= EXPERT_MAX_SPLIT
            and (2 * i) % EXPERT_COLS == 0 and h % EXPERT_COLS == 0 and h % 64 == 0
            and i % 64 == 0 and LINEAR_TILE.bk == 64 and available(x.device.index or 0))


def experts_direct(x: torch.Tensor, ids: torch.Tensor, experts, inter: torch.Tensor,
                   y: torch.Tensor, cols: int | None = None, depth: int | None = None) -> None:
    """triton_moe's direct q4 experts (a slot per assignment) in the CTA form (q4_expert_cta):
    inter [T*k, I] fp16 = silu(x W_gate.T) * (x W_up.T), then y [T*k, hidden] = inter W_down.T,
    each (assignment, column tile) a CTA of the weight's K splits, merged in split order —
    the direct split programs' bits. x [T, hidden] fp32; ids [T, k] int32 contiguous.
    depth STREAM: each kernel's splits streamed whole into shared memory where they are whole
    groups of 4 blocks and split K evenly; by default gate_up's where EXPERT_STREAM, down's
    where DOWN_STREAM, the others on EXPERT_DEPTH's ring."""
    if FUSED_EXPERTS and cols is None and depth is None and fused_fits(experts, x, ids.shape[0]):
        return experts_fused(x, ids, experts, inter, y)
    cols = cols or EXPERT_COLS
    streams = {"gu": depth == STREAM or (depth is None and EXPERT_STREAM),
               "dn": depth == STREAM or (depth is None and DOWN_STREAM)}
    depth = EXPERT_DEPTH if depth == STREAM else depth or EXPERT_DEPTH
    if cols not in (8, 16, 32) or depth not in (2, 4, 8) or cols * depth > 128:
        raise ValueError("cuda_q4: expert cols 8, 16 or 32 and depth 2, 4 or 8 (cols x depth ≤ 128), "
                         "or STREAM")
    _check_experts(ids, inter, y)
    t, top_k = ids.shape
    if t * top_k == 0:
        return
    i, h = experts.inter, experts.hidden
    cuda, fns = _functions(x.device.index or 0)
    (gw, gs), (dw, ds) = experts.gu, experts.down
    for kind, src, w, s, dst, n, k, split in (("gu", x, gw, gs, inter, 2 * i, h, experts.gu_split),
                                               ("dn", inter, dw, ds, y, h, i, experts.down_split)):
        blocks = -(-k // 64 // split) * 2
        d = depth
        while blocks % d:
            d //= 2
        sw = "s" if SWAP_REGS and cols > 8 else ""
        smem = split * cols * 4
        if streams[kind] and k % (64 * split) == 0 and blocks % 4 == 0 \
                and _stream_smem(split, blocks, cols, rows=1) <= 227 * 1024:
            d, smem = STREAM, _stream_smem(split, blocks, cols, rows=1)
        _launch(cuda, fns[f"q4_e{sw}{kind}{cols // 8}_d{d}".encode()], (n // cols, t * top_k, 1),
                32 * split, smem, (src, ids, w, s.view(torch.int32), dst),
                (n, k, src.stride(0), dst.stride(0), split, top_k, int(EXPERT_EARLY)))


def _fused_shape(experts, cs: int) -> tuple[int, int, int] | None:
    """(gate_up tiles, down tiles, warps) of a CTA of q4_efused{cs}_2 for these experts, or
    None where it does not take them: whole 16-column tiles a CTA, a warp a (tile, split) of
    each kernel (at most 16), splits of whole groups of 4 blocks, the intermediate's share of
    a CTA whole 16-byte chunks, its shared memory within 227 KB."""
    c, h, i = 16, experts.hidden, experts.inter
    sg, sd = experts.gu_split, experts.down_split
    if (2 * i) % (c * cs) or h % (c * cs) or h % (64 * sg) or i % (64 * sd):
        return None
    tg, td = 2 * i // (c * cs), h // (c * cs)
    warps = max(tg * sg, td * sd)
    if warps > 16 or (h // 32 // sg) % 4 or (i // 32 // sd) % 4 or (tg * c // 2) % 8:
        return None
    return (tg, td, warps) if _fused_smem(experts, cs) <= 227 * 1024 else None


def _fused_smem(experts, cs: int) -> int:
    """q4_expert_fused's dynamic shared memory: the split partials, the intermediate (whole,
    and the CTA's part), then each gate_up and down task's streamed split."""
    c, h, i = 16, experts.hidden, experts.inter
    sg, sd = experts.gu_split, experts.down_split
    tg, td = 2 * i // (c * cs), h // (c * cs)
    head = -(-((tg * sg + td * sd) * c * 4 + 2 * i + tg * c) // 16) * 16
    return head + tg * sg * (h // 32 // sg) * c * 20 + td * sd * (i // 32 // sd) * c * 20


def fused_fits(experts, x: torch.Tensor, t: int) -> bool:
    """Whether experts_fused takes one token of x for these experts (after experts_fit)."""
    return t == 1 and _fused_shape(experts, FUSED_CLUSTER) is not None


TOPK_MAX_E, TOPK_MAX_K = 256, 32  # (the source's)


def fused_clusters(experts, device: int = 0, cs: int | None = None) -> int:
    """How many clusters of q4_efused{cs}_2 (at these experts' shared memory and threads) the
    device holds at once (cuOccupancyMaxActiveClusters; 0 where it cannot say or the fused
    experts do not take them, a negative CUresult where it failed); one token's experts take
    top-k of them."""
    cs = cs or FUSED_CLUSTER
    shape = _fused_shape(experts, cs)
    if shape is None:
        return 0
    cuda, fns = _functions(device)
    fn = fns[f"q4_efused{cs}_2".encode()]
    smem = _fused_smem(experts, cs)
    if cuda.cuFuncSetAttribute(fn, 8, smem) or (cs > 8 and cuda.cuFuncSetAttribute(fn, 14, 1)):
        return 0
    _BIG_SMEM.add((fn.value, smem))
    cfg = _LaunchConfig((ctypes.c_uint * 3)(cs, 8, 1), (ctypes.c_uint * 3)(32 * shape[2], 1, 1),
                        smem, None, None, 0)
    n = ctypes.c_int(0)
    if not hasattr(cuda, "cuOccupancyMaxActiveClusters"):  # (CUDA 12+)
        return 0
    failed = cuda.cuOccupancyMaxActiveClusters(ctypes.byref(n), fn, ctypes.byref(cfg))
    return -int(failed) if failed else n.value


def topk_fits(logits: torch.Tensor, top_k: int) -> bool:
    """Whether `topk` takes these logits [T, E] (on a device where the kernels load)."""
    return (logits.is_cuda and logits.dtype == torch.float32 and logits.stride(1) == 1
            and logits.shape[1] <= TOPK_MAX_E and 0 < top_k <= min(TOPK_MAX_K, logits.shape[1])
            and available(logits.device.index or 0))


def topk(logits: torch.Tensor, top_k: int, norm: bool, ids: torch.Tensor,
         wts: torch.Tensor) -> None:
    """ids [T, k] int32, wts [T, k] f32 ← the top-k of each row of logits [T, E] by the CUDA
    top-k (topk_cta: FUSED_TOPK's arithmetic), one CTA a row."""
    t, e = logits.shape
    if t:
        cuda, fns = _functions(logits.device.index or 0)
        _launch(cuda, fns[b"topk_rows"], (t, 1, 1), 256, 0, (logits, ids, wts),
                (e, top_k, int(norm), logits.stride(0)))


def experts_fused(x: torch.Tensor, ids: torch.Tensor, experts, inter: torch.Tensor,
                  y: torch.Tensor, cluster: int | None = None, logits: torch.Tensor | None = None,
                  wts: torch.Tensor | None = None, norm: bool = False) -> None:
    """experts_direct's inter and y for x's tokens in one launch (q4_expert_fused): an
    assignment a cluster of `cluster` CTAs; the same bits. With logits [T, E] (and wts [T, k]):
    ids and wts are outputs, the top-k of the logits as `topk` gives them (q4_efusedk)."""
    cs = cluster or FUSED_CLUSTER
    shape = _fused_shape(experts, cs)
    if shape is None:
        raise ValueError(f"cuda_q4: the fused experts do not take these experts in clusters of {cs}")
    _check_experts(ids, inter, y)
    t, top_k = ids.shape
    if t * top_k == 0:
        return
    cuda, fns = _functions(x.device.index or 0)
    fn = fns[f"q4_efused{'k' if logits is not None else ''}{cs}_2".encode()]
    if cs > 8 and cuda is not None and fn.value not in _NONPORTABLE:
        # (attribute 14: CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED)
        if cuda.cuFuncSetAttribute(fn, 14, 1):
            raise ValueError(f"cuda_q4: clusters of {cs} CTAs: the device does not allow them")
        _NONPORTABLE.add(fn.value)
    (gw, gs), (dw, ds) = experts.gu, experts.down
    tensors = (x, ids, gw, gs.view(torch.int32), dw, ds.view(torch.int32), inter, y)
    ints = (experts.hidden, experts.inter, x.stride(0), experts.gu_split, experts.down_split, top_k)
    if logits is not None:
        if wts is None or wts.shape != ids.shape or not wts.is_contiguous() or logits.shape[0] != t \
                or not 0 < logits.shape[1] <= min(TOPK_MAX_E, 32 * shape[2]) or top_k > TOPK_MAX_K:
            raise ValueError("cuda_q4: the fused top-k needs logits [T, E ≤ 256 and ≤ the CTA's "
                             "threads], wts like ids")
        tensors += (logits, wts)
        ints += (logits.shape[1], int(norm), logits.stride(0))
    _launch(cuda, fn, (cs, t * top_k, 1), 32 * shape[2], _fused_smem(experts, cs), tensors, ints)


def _check_experts(ids: torch.Tensor, inter: torch.Tensor, y: torch.Tensor) -> None:
    if ids.dtype != torch.int32 or not ids.is_contiguous() or inter.dtype != torch.float16 \
            or not inter.is_contiguous() or y.dtype != torch.float32 or not y.is_contiguous():
        raise ValueError("cuda_q4: ids int32, inter fp16 and y fp32, all contiguous")


def _check(x: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None) -> None:
    for t in (x, out) + ((residual,) if residual is not None else ()):
        if not t.is_cuda or t.dtype != torch.float32 or t.stride(1) != 1 or t.stride(0) % 2:
            raise ValueError("cuda_q4: x, out and residual must be CUDA float32 with contiguous, "
                             "even-strided rows")


class _LaunchAttr(ctypes.Structure):  # CUlaunchAttribute: an id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("num_attrs", ctypes.c_uint)]


_PDL_ATTR = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
# launch with programmatic dependent launch where triton_pdl does (Hopper and later): each
# kernel loads its first ring blocks of weights before `pdl_wait`, so they are in flight while
# the previous kernel ends, and the next kernel may be scheduled once every CTA has waited.
# H100, context 128, 1 / 4 / 8 streams: +5.2 / +3.9 / +3.3% tok/s; the engine's bitwise sets
# 13/13 with it (GPU_NOTES v19; bench/ab_modes.py `nocudapdl`: plain launches)
PDL = True


def _launch(cuda: ctypes.CDLL, fn: ctypes.c_void_p, grid: tuple[int, int, int], threads: int,
            smem: int, tensors: tuple, ints: tuple) -> None:
    """fn<<<grid, threads, smem>>> on torch's current stream with the tensors' addresses,
    then the ints (Q4_ARGS for most entries), with PDL where `PDL` and kernels/triton_pdl.py
    allow; above 48 KB of dynamic shared memory the kernel is opted in first (once a size)."""
    if smem > 48 * 1024 and (fn.value, smem) not in _BIG_SMEM:
        # (attribute 8: CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)
        if smem > 227 * 1024 or cuda.cuFuncSetAttribute(fn, 8, smem):
            raise ValueError(f"cuda_q4: {smem} bytes of shared memory: more than the device gives")
        _BIG_SMEM.add((fn.value, smem))
    args = [ctypes.c_void_p(t.data_ptr()) for t in tensors] + [ctypes.c_int(v) for v in ints]
    argv = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p)
                                           for a in args])
    from kernels import triton_pdl  # (here: importing triton at module import would keep the
    # interpreter tests from setting TRITON_INTERPRET first in a process that imported this)
    dev = tensors[0].device
    stream = ctypes.c_void_p(torch.cuda.current_stream(dev).cuda_stream)
    with torch.cuda.device(dev):  # the module's context current (a replica on cuda:1, say)
        if PDL and triton_pdl.pdl(tensors[0]) and hasattr(cuda, "cuLaunchKernelEx"):  # (CUDA 12+)
            attr = _LaunchAttr(id=_PDL_ATTR, value=1)
            cfg = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(threads, 1, 1),
                                smem, stream, ctypes.pointer(attr), 1)
            failed = cuda.cuLaunchKernelEx(ctypes.byref(cfg), fn, argv, None)
        else:
            failed = cuda.cuLaunchKernel(fn, *grid, threads, 1, 1, smem, stream, argv, None)
        if failed:
            raise RuntimeError(f"cuda_q4: launch failed (CUresult {failed})")


def swap_fits(lin: Q4Linear, x: torch.Tensor) -> bool:
    """Whether swap_linear takes lin and x at the default SWAP_MT and SWAP_WARPS."""
    return (lin.out_features % (16 * SWAP_MT * SWAP_WARPS) == 0 and lin.in_features % 64 == 0
            and x.data_ptr() % 16 == 0 and x.stride(0) % 4 == 0)


def swap_linear(lin: Q4Linear, x: torch.Tensor, out: torch.Tensor,
                residual: torch.Tensor | None = None, mt: int | None = None,
                warps: int | None = None) -> torch.Tensor:
    """`linear` in the swapped form (q4_swap): a warp takes 16 mt features (the weights as the
    MMA's A operand, each dequantized once) for 16, 32 or 64 tokens of x (B, through shared
    memory), a CTA `warps` such warps and one K split; the split partials merged as `linear`
    merges them. x 16-byte aligned with rows a multiple of 4 floats apart."""
    n, big_n, k = x.shape[0], lin.out_features, lin.in_features
    mt, warps = mt or SWAP_MT, warps or SWAP_WARPS
    feats = 16 * mt * warps
    _check(x, out, residual)
    if x.data_ptr() % 16 or x.stride(0) % 4:
        raise ValueError("cuda_q4: the swapped form reads x as float4s (16-byte aligned rows)")
    if mt not in (1, 2) or warps not in (4, 8) or big_n % feats or k % 64 or LINEAR_TILE.bk != 64:
        raise ValueError(f"cuda_q4: the swapped form needs mt 1 or 2, 4 or 8 warps, N a multiple "
                         f"of {feats} and K of 64")
    ng = 2 if n <= 16 else 4 if n <= 32 else 8  # (a launch of SPLIT_ROWS rows at most)
    cuda, fns = _functions(x.device.index or 0)
    sm = lin.sm.view(torch.int32)
    tickets = _tickets(lin, feats) if lin.split > 1 else sm
    for r0 in range(0, n, q4_layout.SPLIT_ROWS):
        r1 = min(n, r0 + q4_layout.SPLIT_ROWS)
        xs, ys = x[r0:r1], out[r0:r1]
        res = residual[r0:r1] if residual is not None else ys
        rows = r1 - r0
        ws = (torch.empty(lin.split, rows, big_n, dtype=torch.float32, device=x.device)
              if lin.split > 1 else ys)
        t = 8 * ng  # tokens a CTA; a stage: x [t][64] fp32, the weights' bytes and scales
        smem = 4 * (t * 64 * 4 + 2 * feats * 20) + t * 72 * 2 + 16
        grid = (big_n // feats, lin.split, -(-rows // t))
        _launch(cuda, fns[f"q4_swap{mt}_{ng}_w{warps}".encode()], grid, warps * 32, smem,
                (xs, lin.qs, sm, res, ys, ws, tickets),
                (rows, big_n, k, xs.stride(0), res.stride(0), ys.stride(0), lin.split,
                 int(residual is not None)))
    return out
