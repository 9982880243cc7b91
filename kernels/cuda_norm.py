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
Rows 16-byte aligned load float4s, others scalars: the same values in the same order."""

from __future__ import annotations

import struct

import torch

from kernels import cuda_q4

NORM = r"""
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
  const float* xr = x + r * stride_x;
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
  const float inv = 1.f / sqrtf(s / (float)(128 * KV) + __int_as_float(eps_bits));
  float* yr = y + r * stride_y;
#pragma unroll
  for (int i = 0; i < KV; ++i) {
    const int k = 4 * lane + 128 * i;
    const float4 v = make_float4(__fmul_rn(__fmul_rn(xv[i].x, inv), wv[i].x),
                                 __fmul_rn(__fmul_rn(xv[i].y, inv), wv[i].y),
                                 __fmul_rn(__fmul_rn(xv[i].z, inv), wv[i].z),
                                 __fmul_rn(__fmul_rn(xv[i].w, inv), wv[i].w));
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
"""
WIDTHS = (4, 8, 16)  # float4s a lane: K = 128 x these
ENTRIES = tuple(f"rms_rows{kv}".encode() for kv in WIDTHS)
ROWS_A_CTA = 4


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
        eps_bits = struct.unpack("<i", struct.pack("<f", eps))[0]
        cuda_q4._launch(cuda, fns[f"rms_rows{k // 128}".encode()], (-(-r // ROWS_A_CTA), 1, 1),
                        32 * ROWS_A_CTA, 0, (rows, weight, out),
                        (r, rows.stride(0), out.stride(0), eps_bits, vec))
    return out
