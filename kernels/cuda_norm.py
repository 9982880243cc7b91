"""RMSNorm in CUDA with one fixed reduction order (an experiment, off: `triton_norm.CUDA_NORM`).

Why: v22's ablations put each RMSNorm at ~1.0 µs of a one-token step's chain (97 a step), and
the way to take it off the chain is to fold it into the next kernel's CTAs (qkv's, the
router's: each warp the row's sum of squares, then x scaled as the ring loads it). A fold
must give the norm's bits at every row count, so the norm needs an order a CUDA warp can
repeat anywhere — which Triton's `tl.sum` (its layout's tree) is not. This is that order, as
a kernel for every row count; measured alone first (`cudanorm`), then folded.

The order: a warp a row; lane l adds x[4l + 128i + j]^2 for i ascending, j = 0..3 (fmaf, from
0), then a butterfly over the 32 lanes (xor 16, 8, 4, 2, 1: every lane ends with the same
sum); inv = 1 / sqrtf(s / K + eps) (IEEE division and square root); y = (x * inv) * w. K =
512, 1,024 or 2,048 (4, 8 or 16 float4 a lane); the weight is loaded before the PDL wait.
Rows 16-byte aligned load float4s, others scalars: the same values in the same order.

The fold (`norm_linear`, `triton_norm.FOLD_NORM`): the attention's norm and qkv at one row in
one launch of cuda_q4's CTA form, each warp taking the row's 1 / rms in this order and staging
its own K range of x_n (fp16, as the CTA form rounds x) in shared memory for its ring."""

from __future__ import annotations

import struct

import torch

from kernels import cuda_q4
from kernels.q4_layout import Q4Linear

# the order's device functions, shared with kernels/cuda_route.py's fold of the MoE's norm
NORM_DEVICE = r"""
// The row's 1 / rms in this file's order (module doc), its KV float4s a lane left in xv: lane l
// holds x[4l + 128i + j]. Every lane of the warp returns the same value.
template <int KV>
__device__ __forceinline__ float row_inv_rms(const float* __restrict__ xr, int lane, int eps_bits,
                                             int vec, float4 xv[KV]) {
#pragma unroll
  for (int i = 0; i < KV; ++i) {
    const int k = 4 * lane + 128 * i;
    xv[i] = vec ? *reinterpret_cast<const float4*>(xr + k)
                : make_float4(xr[k], xr[k + 1], xr[k + 2], xr[k + 3]);
  }
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < KV; ++i) {
    s = fmaf(xv[i].x, xv[i].x, s);
    s = fmaf(xv[i].y, xv[i].y, s);
    s = fmaf(xv[i].z, xv[i].z, s);
    s = fmaf(xv[i].w, xv[i].w, s);
  }
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return 1.f / sqrtf(s / (float)(128 * KV) + __int_as_float(eps_bits));
}

// row_inv_rms's value without keeping the row: the same loads and fmaf order, one float4 live
template <int KV>
__device__ __forceinline__ float row_inv_rms_lean(const float* __restrict__ xr, int lane, int eps_bits) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < KV; ++i) {
    const float4 v = *reinterpret_cast<const float4*>(xr + 4 * lane + 128 * i);
    s = fmaf(v.x, v.x, s);
    s = fmaf(v.y, v.y, s);
    s = fmaf(v.z, v.z, s);
    s = fmaf(v.w, v.w, s);
  }
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return 1.f / sqrtf(s / (float)(128 * KV) + __int_as_float(eps_bits));
}

// (x * inv) * w, element by element (no contraction)
__device__ __forceinline__ float4 scaled(float4 x, float inv, float4 w) {
  return make_float4(__fmul_rn(__fmul_rn(x.x, inv), w.x), __fmul_rn(__fmul_rn(x.y, inv), w.y),
                     __fmul_rn(__fmul_rn(x.z, inv), w.z), __fmul_rn(__fmul_rn(x.w, inv), w.w));
}
"""
NORM = NORM_DEVICE + r"""

template <int KV>
__device__ __forceinline__ void rms_rows(const float* __restrict__ x, const float* __restrict__ w,
                                         float* __restrict__ y, int R, int stride_x, int stride_y,
                                         int eps_bits, int vec) {
  const int lane = threadIdx.x & 31;
  const long r = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  float4 wv[KV], xv[KV];
#pragma unroll
  for (int i = 0; i < KV; ++i) wv[i] = __ldg(reinterpret_cast<const float4*>(w) + lane + 32 * i);
  pdl_wait();
  if (r >= R) return;
  const float inv = row_inv_rms<KV>(x + r * stride_x, lane, eps_bits, vec, xv);
  float* yr = y + r * stride_y;
#pragma unroll
  for (int i = 0; i < KV; ++i) {
    const int k = 4 * lane + 128 * i;
    const float4 v = scaled(xv[i], inv, wv[i]);
    if (vec) {
      *reinterpret_cast<float4*>(yr + k) = v;
    } else {
      yr[k] = v.x; yr[k + 1] = v.y; yr[k + 2] = v.z; yr[k + 3] = v.w;
    }
  }
}

// grid cdiv(R, 4); block 128 (a warp a row)
#define RMS_ROWS(KV) extern "C" __global__ void __launch_bounds__(128) rms_rows##KV( \
    const float* x, const float* w, float* y, int R, int stride_x, int stride_y, int eps_bits, \
    int vec) { rms_rows<KV>(x, w, y, R, stride_x, stride_y, eps_bits, vec); }
RMS_ROWS(4) RMS_ROWS(8) RMS_ROWS(16)

// The norm folded into the q4 CTA form at one row (`norm_linear`): y [1, N] = rms_norm(h, w) @
// W.T with rms_rows's x_n and q4_cta's arithmetic, so their bits. Each warp (split sp), once
// its ring's first weight loads are out, waits, takes the row's 1 / rms itself (the whole row,
// this file's order), and stages x_n of its own K range as fp16 in shared memory — the value
// q4_cta's x_frag would round rms_rows's output to — from which its ring then reads x. No CTA
// barrier before the merge: a warp reads only what it wrote. grid (N / 16); block 32 S;
// dynamic shared memory S x 16 x 16 floats, then K halves.
template <int D, int KV>
__device__ __forceinline__ void q4_ctan(const float* __restrict__ h, const float* __restrict__ w,
                                        const unsigned char* __restrict__ qs,
                                        const unsigned* __restrict__ sm, float* __restrict__ y,
                                        int N, int K, int S, int eps_bits) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int C = 16;
  SharedHalf* xs = reinterpret_cast<SharedHalf*>(smem + S * 16 * C * sizeof(float));
  const int lane = threadIdx.x & 31;
  int k_lo, k_hi;
  split_k(K, S, threadIdx.x >> 5, k_lo, k_hi);
  auto stage = [&]() {
    pdl_wait();
    float4 xv[KV];
    const float inv = row_inv_rms<KV>(h, lane, eps_bits, 1, xv);
#pragma unroll
    for (int i = 0; i < KV; ++i) {
      const int k = 4 * lane + 128 * i;
      if (k >= k_lo && k < k_hi) {
        const float4 v = scaled(xv[i], inv, __ldg(reinterpret_cast<const float4*>(w + k)));
        *reinterpret_cast<__half2*>(xs + k) = __floats2half2_rn(v.x, v.y);
        *reinterpret_cast<__half2*>(xs + k + 2) = __floats2half2_rn(v.z, v.w);
      }
    }
    __syncwarp();
  };
  const float* part = cta_partials<false, 2, D>(static_cast<const SharedHalf*>(xs), qs, sm, 1, N,
                                                K, 0, S, stage);
  const int n0 = blockIdx.x * C;
  for (int e = threadIdx.x; e < C; e += blockDim.x) {
    float v = part[e];
    for (int q = 1; q < S; ++q) v = v + part[q * 16 * C + e];  // split order 0..S-1 (row 0)
    y[n0 + e] = v;
  }
}

#define Q4_CTAN(D, KV) extern "C" __global__ void __launch_bounds__(256, 1) q4_ctan8_2_d##D##_k##KV( \
    const float* h, const float* w, const unsigned char* qs, const unsigned* sm, float* y, int N, \
    int K, int S, int eps_bits) { q4_ctan<D, KV>(h, w, qs, sm, y, N, K, S, eps_bits); }
Q4_CTAN(2, 4) Q4_CTAN(4, 4) Q4_CTAN(8, 4) Q4_CTAN(2, 8) Q4_CTAN(4, 8) Q4_CTAN(8, 8)
Q4_CTAN(2, 16) Q4_CTAN(4, 16) Q4_CTAN(8, 16)
"""
WIDTHS = (4, 8, 16)  # float4s a lane: K = 128 x these
ENTRIES = tuple(f"rms_rows{kv}".encode() for kv in WIDTHS) + tuple(
    f"q4_ctan8_2_d{d}_k{kv}".encode() for d in (2, 4, 8) for kv in WIDTHS)
ROWS_A_CTA = 4


def _bits(eps: float) -> int:
    """eps as the int32 of its float32 bits (the kernels take ints)."""
    return struct.unpack("<i", struct.pack("<f", eps))[0]


def ptx(arch: str = "compute_90", cache: bool = True) -> bytes:
    """NORM (with cuda_q4's device code) compiled by NVRTC for `arch`."""
    return cuda_q4.ptx(arch, cache, part="norm", entries=NORM)


def fits(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` takes rows [R, K] (and the weight): K one of 128 x WIDTHS, float32,
    on a device where cuda_q4's kernels load."""
    k = rows.shape[-1]
    return (rows.is_cuda and rows.dim() == 2 and rows.dtype == torch.float32
            and rows.stride(1) == 1 and k % 128 == 0 and k // 128 in WIDTHS
            and weight.is_contiguous() and weight.data_ptr() % 16 == 0
            and cuda_q4.available(rows.device.index or 0))


def rms_norm(rows: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> torch.Tensor:
    """out [R, K] (rows contiguous) = RMSNorm of rows [R, K] (module doc's order)."""
    r, k = rows.shape
    if r:
        vec = int(rows.data_ptr() % 16 == 0 and rows.stride(0) % 4 == 0
                  and out.data_ptr() % 16 == 0 and out.stride(0) % 4 == 0)
        cuda, fns = cuda_q4.module(rows.device.index or 0, "norm", NORM, ENTRIES)
        cuda_q4._launch(cuda, fns[f"rms_rows{k // 128}".encode()], (-(-r // ROWS_A_CTA), 1, 1),
                        32 * ROWS_A_CTA, 0, (rows, weight, out),
                        (r, rows.stride(0), out.stride(0), _bits(eps), vec))
    return out


def fold_fits(lin, h: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `norm_linear` takes one row h [1, K] and the q4 weight lin: the CTA form's
    256-thread entries at 16 columns a warp, K one of 128 x WIDTHS, aligned rows."""
    return (isinstance(lin, Q4Linear) and h.shape[0] == 1 and fits(h, weight)
            and h.data_ptr() % 16 == 0 and lin.in_features == h.shape[1]
            and lin.out_features % 16 == 0 and 1 <= lin.split <= cuda_q4.CTA_SPLITS_256)


def norm_linear(lin, h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[1, N] = rms_norm(h, weight) @ W.T in one launch (`q4_ctan`): the bits of `rms_norm`
    then cuda_q4's CTA form."""
    n, k = lin.out_features, lin.in_features
    out = torch.empty(1, n, dtype=torch.float32, device=h.device)
    _, depth = cuda_q4._cta_plan(lin, 8, 16, cuda_q4.DEPTH or 8, False)  # (no streamed form)
    cuda, fns = cuda_q4.module(h.device.index or 0, "norm", NORM, ENTRIES)
    cuda_q4._launch(cuda, fns[f"q4_ctan8_2_d{depth}_k{k // 128}".encode()], (n // 16, 1, 1),
                    32 * lin.split, lin.split * 16 * 16 * 4 + k * 2,
                    (h, weight, lin.qs, lin.sm.view(torch.int32), out), (n, k, lin.split, _bits(eps)))
    return out
