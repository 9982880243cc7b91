"""The paged decode attention as a CUDA kernel (`attn_decode`, SOURCE): the split programs of
kernels/triton_attention.py (program: token, kv head, split; a token's single split writes its
output, more write partials for the Triton merge kernel) over a bf16 KV pool, head_dim 128, at
most 8 query heads a kv head. Its source is compiled into kernels/cuda_q4.py's extra module
(NVRTC, loaded on first use) and launched by that module's launcher, so tests/kernels/cuda_emu.py
runs it on the CPU as it runs the q4 kernels. triton_attention.CUDA_ATTENTION routes to it (off).
"""

from __future__ import annotations

import struct

import torch

SOURCE = r"""
// Program (token t, kv head, split) as the Triton split programs: the split's keys for the kv
// head's query heads (at most 8), head_dim 128. The keys go in 16-key chunks, chunk i to warp
// i % W (W = 4 or 8 warps a CTA); each warp keeps a running max, sum and accumulator a head,
// the next chunk's loads in flight, and the W are merged in warp order at the end: every order
// is fixed by the split, W and the token's context alone, so a token's bits do not depend on
// its batch. Both products run transposed, so the heads are the MMA's n (8, none padded):
// S^T = K q^T (m: 16 keys, k: d) and out^T = V^T P^T (m: d, k: keys).
// S^T: lane (g, j) loads keys g and g + 8 whole (16 bytes at d = 32c + 8j, c = 0..3) and k runs
// over d permuted so one load gives the A fragments of two k16 steps (step 2c + h: k = 2j, 2j+1
// <-> d = 32c + 8j + 4h + 0, 1; k = 2j+8, 2j+9 <-> + 2, 3; q's B fragments alike). q (fp32) and
// p enter as a bf16 high part and a bf16 remainder, an MMA each, as in the Triton kernel. P^T's
// B fragments come through a warp's shared-memory tile. out^T: lane (g, j) loads keys 2j, 2j+1,
// 2j+8, 2j+9 at d = 8g.. and 64 + 8g.., paired by PRMT: row g of m-tile mt is d = 8g + mt, row
// g + 8 is 64 + 8g + mt; the accumulators hold heads 2j, 2j+1 at those d.
__device__ __forceinline__ unsigned bf16x2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ float bf16_lo(unsigned u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf16_hi(unsigned u) { return __uint_as_float(u & 0xFFFF0000u); }
// (lo, hi) as the bf16 pair of their high parts (h) and of their remainders (r)
__device__ __forceinline__ void split_bf16(float lo, float hi, unsigned& h, unsigned& r) {
  h = bf16x2(lo, hi);
  r = bf16x2(lo - bf16_lo(h), hi - bf16_hi(h));
}
__device__ __forceinline__ void mma_bf16(float d[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

// a chunk's K and V as the two products read them (zeros past the context: p is 0 there, and
// 0 x a stale NaN is not): K keys c0 + g, c0 + g + 8 whole; V keys c0 + 2j, 2j+1, 2j+8, 2j+9 at
// d 8g.. and 64 + 8g... A chunk starts at a multiple of 16 keys and a block holds 16 or more
// (attention_fits), so its keys share one block: one table load a chunk.
__device__ __forceinline__ void attn_chunk(const unsigned short* __restrict__ kc,
                                           const unsigned short* __restrict__ vc,
                                           const int* __restrict__ bt, long long row, int stride_bt,
                                           int bs_log2, int bs_mask, int KVH, int kvh,
                                           int block_elems, int c0, int hi, int g, int j,
                                           uint4 kv[2][4], uint4 vv[4][2]) {
  const int blk = c0 < hi ? bt[row * stride_bt + (c0 >> bs_log2)] : 0;
  const size_t base = (size_t)blk * block_elems + ((((c0 & bs_mask) * KVH + kvh) << 7));
  const int key_elems = KVH << 7;  // from one key's row to the next's
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int n = g + 8 * r;  // the key, from c0
    if (c0 + n < hi) {
      const unsigned short* p = kc + base + n * key_elems + 8 * j;
#pragma unroll
      for (int c = 0; c < 4; ++c) kv[r][c] = __ldg(reinterpret_cast<const uint4*>(p + 32 * c));
    } else {
#pragma unroll
      for (int c = 0; c < 4; ++c) kv[r][c] = make_uint4(0u, 0u, 0u, 0u);
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int n = 2 * j + (i & 1) + 8 * (i >> 1);
    if (c0 + n < hi) {
      const unsigned short* p = vc + base + n * key_elems + 8 * g;
      vv[i][0] = __ldg(reinterpret_cast<const uint4*>(p));
      vv[i][1] = __ldg(reinterpret_cast<const uint4*>(p + 64));
    } else {
      vv[i][0] = vv[i][1] = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

template <int W>
__device__ __forceinline__ void attn_decode_impl(
    const float* __restrict__ q, const unsigned short* __restrict__ kc,
    const unsigned short* __restrict__ vc, const int* __restrict__ bt, const int* __restrict__ rows,
    const int* __restrict__ ctxs, float* __restrict__ out, float* __restrict__ pacc,
    float* __restrict__ pml, int stride_bt, int max_splits, int H, int KVH, int bs_log2, int SPLIT,
    int group, int scale_bits, int prefetch) {
  __shared__ float merge_m[W][8], merge_l[W][8], merge_f[W][8], merge_acc[W][8][128], ptile[W][16][8];
  const int t = blockIdx.x, kvh = blockIdx.y, sp = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, j = lane % 4;
  // the context, the row and its table are the step's inputs (final before the previous kernel
  // ran: triton_pdl.EARLY_INPUTS), so with `prefetch` (launches of one token) the split's K and
  // V rows (two 128-byte lines a key each) go into L2 before the wait, as in the Triton kernel
  const int ctx = ctxs[t], bs_mask = (1 << bs_log2) - 1;  // (blocks of 2^bs_log2 keys)
  const long long row = rows[t];
  if (prefetch) {
    const int end = min(sp * SPLIT + SPLIT, ctx);
    for (int i = sp * SPLIT + threadIdx.x / 4; i < end; i += 8 * W) {
      const int blk = bt[row * stride_bt + (i >> bs_log2)];
      const size_t off = (size_t)blk * (KVH << (bs_log2 + 7)) + (((i & bs_mask) * KVH + kvh) << 7)
          + 64 * (threadIdx.x % 2);
      const unsigned short* p = (threadIdx.x % 4 < 2 ? kc : vc) + off;
      asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
    }
  }
  pdl_wait();
  const size_t head0 = (size_t)t * H + (size_t)kvh * group;  // the kv head's first query head
  if (ctx == 0) {  // a padding token: defined zeros, nothing read
    if (sp == 0)
      for (int i = threadIdx.x; i < group * 128; i += 32 * W) out[head0 * 128 + i] = 0.f;
    return;
  }
  const int n_splits = (ctx + SPLIT - 1) / SPLIT;
  if (sp >= n_splits) return;
  const float scale = __int_as_float(scale_bits);
  const int block_elems = KVH << (bs_log2 + 7);  // a pool block's elements (K or V)
  const int lo = sp * SPLIT, hi = min(lo + SPLIT, ctx);
  // q^T's B fragments, head g: k-step s = 2c + h, b0 = d 32c + 8j + 4h + (0, 1), b1 = + (2, 3)
  unsigned qh[8][2], qr[8][2];
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (g < group)
      v = __ldg(reinterpret_cast<const float4*>(q + (head0 + g) * 128 + 32 * (s / 2) + 8 * j + 4 * (s % 2)));
    split_bf16(v.x * scale, v.y * scale, qh[s][0], qr[s][0]);
    split_bf16(v.z * scale, v.w * scale, qh[s][1], qr[s][1]);
  }
  // heads 2j, 2j+1: running max and sum; acc[mt]: (d 8g + mt: 2j, 2j+1; d 64 + 8g + mt: 2j, 2j+1)
  float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f}, acc[8][4];
#pragma unroll
  for (int mt = 0; mt < 8; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
  // chunk c0's K / V in kv / vv while the next chunk's loads are in flight (nkv / nvv)
  uint4 kv[2][4], vv[4][2];
  attn_chunk(kc, vc, bt, row, stride_bt, bs_log2, bs_mask, KVH, kvh, block_elems, lo + 16 * warp,
             hi, g, j, kv, vv);
  for (int c0 = lo + 16 * warp; c0 < hi; c0 += 16 * W) {
    uint4 nkv[2][4], nvv[4][2];
    attn_chunk(kc, vc, bt, row, stride_bt, bs_log2, bs_mask, KVH, kvh, block_elems, c0 + 16 * W, hi,
               g, j, nkv, nvv);
    // S^T [keys g, g+8; heads 2j, 2j+1]: the high parts' chain and the remainders', then summed
    float sh[4] = {0.f, 0.f, 0.f, 0.f}, sr[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      const int c = s / 2, w0 = 2 * (s % 2);
      const unsigned a0 = word(kv[0][c], w0), a1 = word(kv[1][c], w0);
      const unsigned a2 = word(kv[0][c], w0 + 1), a3 = word(kv[1][c], w0 + 1);
      mma_bf16(sh, a0, a1, a2, a3, qh[s][0], qh[s][1]);
      mma_bf16(sr, a0, a1, a2, a3, qr[s][0], qr[s][1]);
    }
    float sc[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) sc[e] = c0 + g + 8 * (e / 2) < hi ? sh[e] + sr[e] : neg_inf();
    float alpha[2], p[4];
#pragma unroll
    for (int e = 0; e < 2; ++e) {  // head 2j + e: max and sum over the chunk's 16 keys
      float mx = fmaxf(sc[e], sc[e + 2]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
      const float m_new = fmaxf(m[e], mx);  // finite: key c0 is in the context
      alpha[e] = __expf(m[e] - m_new);
      p[e] = __expf(sc[e] - m_new);
      p[e + 2] = __expf(sc[e + 2] - m_new);
      float ps = p[e] + p[e + 2];
      ps += __shfl_xor_sync(0xffffffffu, ps, 4);
      ps += __shfl_xor_sync(0xffffffffu, ps, 8);
      ps += __shfl_xor_sync(0xffffffffu, ps, 16);
      l[e] = l[e] * alpha[e] + ps;
      m[e] = m_new;
    }
    // P^T's B fragments (keys 2j, 2j+1 / 2j+8, 2j+9; head g) through the warp's tile
    float (*pt)[8] = ptile[warp];
    pt[g][2 * j] = p[0]; pt[g][2 * j + 1] = p[1]; pt[g + 8][2 * j] = p[2]; pt[g + 8][2 * j + 1] = p[3];
    __syncwarp();
    unsigned bh0, br0, bh1, br1;
    split_bf16(pt[2 * j][g], pt[2 * j + 1][g], bh0, br0);
    split_bf16(pt[2 * j + 8][g], pt[2 * j + 9][g], bh1, br1);
    __syncwarp();
#pragma unroll
    for (int mt = 0; mt < 8; ++mt) {
      acc[mt][0] *= alpha[0]; acc[mt][1] *= alpha[1]; acc[mt][2] *= alpha[0]; acc[mt][3] *= alpha[1];
      const unsigned sel = (mt % 2) ? 0x7632u : 0x5410u;
      const int w = mt / 2;
      unsigned a0, a1, a2, a3;
      asm("prmt.b32 %0, %1, %2, %3;" : "=r"(a0) : "r"(word(vv[0][0], w)), "r"(word(vv[1][0], w)), "r"(sel));
      asm("prmt.b32 %0, %1, %2, %3;" : "=r"(a1) : "r"(word(vv[0][1], w)), "r"(word(vv[1][1], w)), "r"(sel));
      asm("prmt.b32 %0, %1, %2, %3;" : "=r"(a2) : "r"(word(vv[2][0], w)), "r"(word(vv[3][0], w)), "r"(sel));
      asm("prmt.b32 %0, %1, %2, %3;" : "=r"(a3) : "r"(word(vv[2][1], w)), "r"(word(vv[3][1], w)), "r"(sel));
      mma_bf16(acc[mt], a0, a1, a2, a3, bh0, bh1);
      mma_bf16(acc[mt], a0, a1, a2, a3, br0, br1);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) kv[r][c] = nkv[r][c];
#pragma unroll
    for (int i = 0; i < 4; ++i) { vv[i][0] = nvv[i][0]; vv[i][1] = nvv[i][1]; }
  }
  // the warps' states merged in warp order (heads < group)
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int h = 2 * j + e;
    if (h < group) {
      if (g == 0) { merge_m[warp][h] = m[e]; merge_l[warp][h] = l[e]; }
#pragma unroll
      for (int mt = 0; mt < 8; ++mt) {
        merge_acc[warp][h][8 * g + mt] = acc[mt][e];
        merge_acc[warp][h][64 + 8 * g + mt] = acc[mt][e + 2];
      }
    }
  }
  __syncthreads();
  if (threadIdx.x < group) {  // a head's max over the warps, their factors and the sum
    const int h = threadIdx.x;
    float mm = merge_m[0][h];
    for (int w = 1; w < W; ++w) mm = fmaxf(mm, merge_m[w][h]);
    float ls = 0.f;
    for (int w = 0; w < W; ++w) {
      const float f = __expf(merge_m[w][h] - mm);
      merge_f[w][h] = f;
      ls += merge_l[w][h] * f;
    }
    merge_m[0][h] = mm;  // (read below, after the barrier)
    merge_l[0][h] = ls;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < group * 128; i += 32 * W) {
    const int h = i / 128, d = i % 128;
    float a = 0.f;
    for (int w = 0; w < W; ++w) a += merge_acc[w][h][d] * merge_f[w][h];
    if (n_splits == 1) {
      out[(head0 + h) * 128 + d] = a / merge_l[0][h];
    } else {
      const size_t part = (head0 + h) * max_splits + sp;
      pacc[part * 128 + d] = a;
      if (d == 0) { pml[part * 2] = merge_m[0][h]; pml[part * 2 + 1] = merge_l[0][h]; }
    }
  }
}
#define ATTN_ARGS const float* __restrict__ q, const unsigned short* __restrict__ kc, \
    const unsigned short* __restrict__ vc, const int* __restrict__ bt, const int* __restrict__ rows, \
    const int* __restrict__ ctxs, float* __restrict__ out, float* __restrict__ pacc, \
    float* __restrict__ pml, int stride_bt, int max_splits, int H, int KVH, int bs_log2, int SPLIT, \
    int group, int scale_bits, int prefetch
#define ATTN_PASS q, kc, vc, bt, rows, ctxs, out, pacc, pml, stride_bt, max_splits, H, KVH, bs_log2, \
    SPLIT, group, scale_bits, prefetch
// entries: 4 warps a CTA (attn_decode) and 8 (attn_decode_w8): other bits (the chunks' dealing)
extern "C" __global__ void __launch_bounds__(128) attn_decode(ATTN_ARGS) { attn_decode_impl<4>(ATTN_PASS); }
extern "C" __global__ void __launch_bounds__(256) attn_decode_w8(ATTN_ARGS) { attn_decode_impl<8>(ATTN_PASS); }
"""
# its entries in the extra module: 4 warps a CTA, and 8
ENTRIES = (b"attn_decode", b"attn_decode_w8")


# attn_decode's warps a CTA, 4 or 8 (the chunks' dealing over the warps and their merge: other
# bits, so one choice for every batch; bench/ab_modes.py `cudaattn8`)
ATTN_WARPS = 4


def attention_fits(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `attention` takes these operands: bf16 caches on CUDA, head_dim 128, at most 8
    query heads a kv head, blocks of a power of two keys, 16 or more (a 16-key chunk in one
    block), and the kernels load there."""
    t, h, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    if not (q.is_cuda and k_cache.dtype == torch.bfloat16 and d == 128 and h % kvh == 0
            and h // kvh <= 8 and bs >= 16 and bs & (bs - 1) == 0):
        return False
    from kernels import cuda_q4  # (its launcher and module; it imports this file's SOURCE)

    return cuda_q4.available(q.device.index or 0)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              block_tables: torch.Tensor, tok_row: torch.Tensor, ctx_lens: torch.Tensor,
              scale: float, out: torch.Tensor, pacc: torch.Tensor, pml: torch.Tensor,
              max_splits: int, split: int, prefetch: bool) -> None:
    """The split programs of kernels/triton_attention.py's paged attention as the CUDA kernel
    `attn_decode` (SOURCE): a token's single split writes out, more write their partials
    (pacc, pml) for the attention's merge kernel. Operands as paged_attention checks them, and
    attention_fits; prefetch: the splits' K / V into L2 before the PDL wait."""
    t, h, _ = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    if split % 16 or bs < 16 or bs & (bs - 1):
        raise ValueError(f"cuda attention: split {split} a multiple of 16 keys, blocks of 2^n >= 16 "
                         f"keys (not {bs})")
    from kernels import cuda_q4

    cuda, fns = cuda_q4._functions(q.device.index or 0)
    scale_bits = struct.unpack("<i", struct.pack("<f", scale))[0]
    if ATTN_WARPS not in (4, 8):
        raise ValueError(f"cuda attention: {ATTN_WARPS} warps a CTA (4 or 8)")
    entry = b"attn_decode" if ATTN_WARPS == 4 else b"attn_decode_w8"
    cuda_q4._launch(cuda, fns[entry], (t, kvh, max_splits), 32 * ATTN_WARPS, 0,
                    (q, k_cache, v_cache, block_tables, tok_row, ctx_lens, out, pacc, pml),
                    (block_tables.stride(0), max_splits, h, kvh, bs.bit_length() - 1, split,
                     h // kvh, scale_bits, int(prefetch)))
