"""The MoE's route in CUDA (an experiment, off: `triton_moe_route.CUDA_ROUTE`): the top-k of a
row of router logits in one CTA, and at one token the router GEMM and that top-k in one launch.

Why: at one token the route is two dependent kernels, the router (8 CTAs of 16 columns) and
the top-k, and v22's ablations put the top-k's place on the chain at 2.7 µs a layer on the
H100 — for 128 logits. Here the router's 8 column-tile CTAs run as one **thread block cluster**:
each computes its 16 logits exactly as `cuda_q4.q4_cta` does (the same ring, the same split
order: the CTA form's bits), stores them into CTA 0's shared memory (distributed shared
memory), and after one cluster barrier CTA 0 ranks the 128 logits — no second launch, no
ticket, no global round trip between them.

The top-k's arithmetic is this file's own, the same at every token count (`topk_rows`: one
CTA a row, for every launch of more than one token), so a stream's ids and weights do not
depend on its batch:
  mx = the row's max (exact); e_i = expf(l_i - mx) (NVRTC's accurate expf);
  total = warp 0's sum — lane l adds e_l, e_{l+32}, ... in order, then a butterfly of 5
  (a NaN logit stays NaN and out of the sum);
  p_i = e_i / total; the top-k by p descending, ties to the lower id, NaN below every number
  (each expert's rank counted as the keys above its own: integers, so how many threads count
  changes nothing); wts = p / (the k picks' p summed in rank order) when normalized, else p.
The same picks as the Triton top-k (`_topk_kernel`) wherever the probabilities differ; the
weights may differ from its in the last bits (its sum runs in Triton's reduction order), which
is why the CUDA top-k, once on, runs at every token count.

Needs sm_90 (clusters); `fits` says where it runs. GPU tests: tests/kernels/test_gpu.py."""

from __future__ import annotations

import torch

from kernels import cuda_norm, cuda_q4
from kernels.q4_layout import Q4Linear

CLUSTER_DEVICE = r"""
// thread block clusters (sm_90): this CTA's rank, a barrier phase's halves, and a store into
// the same shared variable of the cluster's CTA 0
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
__device__ __forceinline__ void store_in_rank0(float* mine, float v) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(mine));
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, 0;" : "=r"(r) : "r"(a));
  asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(r), "f"(v) : "memory");
}

"""
ROUTE = r"""
#define TOPK_MAX_E 256
#define TOPK_MAX_K 32

// p >= 0 (or NaN) as an int that orders as p does; NaN below every number
__device__ __forceinline__ int prob_key(float p) {
  return p != p ? -1 : (p == 0.f ? 0 : __float_as_int(p));
}

// The top-k of the E logits sl (shared memory) into ids / wts (k each), by every thread of the
// CTA (blockDim a multiple of 32, >= E). sp, sk: E floats / ints; sel, sid: k; red: 1 (shared).
__device__ void topk_cta(const float* sl, int E, int k, int norm, float* sp, int* sk, float* sel,
                         int* sid, float* red, int* __restrict__ ids, float* __restrict__ wts) {
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
  if (tid < k) {
    float t = sel[0];
    for (int r = 1; r < k; ++r) t = t + sel[r];  // rank order
    ids[tid] = sid[tid];
    wts[tid] = norm ? sel[tid] / t : sel[tid];
  }
}

// grid (T); block 256: row t's top-k (after the PDL wait: the logits are the predecessor's)
extern "C" __global__ void __launch_bounds__(256) topk_rows(const float* __restrict__ logits,
                                                           int* __restrict__ ids,
                                                           float* __restrict__ wts, int E, int k,
                                                           int norm, int stride_l) {
  __shared__ float sl[TOPK_MAX_E], sp[TOPK_MAX_E], sel[TOPK_MAX_K], red[1];
  __shared__ int sk[TOPK_MAX_E], sid[TOPK_MAX_K];
  pdl_wait();
  const long t = blockIdx.x;
  for (int i = threadIdx.x; i < E; i += blockDim.x) sl[i] = logits[t * stride_l + i];
  __syncthreads();
  topk_cta(sl, E, k, norm, sp, sk, sel, sid, red, ids + t * k, wts + t * k);
}

// The end of a one-token route, after the CTA's cta_partials (phase 1 of the cluster barrier
// arrived before them): the CTA's 16 logits summed in split order 0..S-1, written to logits
// and into CTA 0's sl; then CTA 0 takes the top-k.
__device__ __forceinline__ void route_rank(const float* part, float* __restrict__ logits,
                                           int* __restrict__ ids, float* __restrict__ wts, int N,
                                           int S, int k, int norm) {
  __shared__ float sl[TOPK_MAX_E], sp[TOPK_MAX_E], sel[TOPK_MAX_K], red[1];
  __shared__ int sk[TOPK_MAX_E], sid[TOPK_MAX_K];
  constexpr int C = 16;
  const int n0 = blockIdx.x * C;
  cluster_wait();
  if (threadIdx.x < C) {
    const int e = threadIdx.x;
    float v = part[e];
    for (int q = 1; q < S; ++q) v = v + part[q * 16 * C + e];  // split order 0..S-1 (row 0)
    logits[n0 + e] = v;
    store_in_rank0(sl + n0 + e, v);
  }
  cluster_arrive();  // phase 2: the logits are in CTA 0's shared memory
  cluster_wait();
  if (cluster_rank() == 0) topk_cta(sl, N, k, norm, sp, sk, sel, sid, red, ids, wts);
}

// One token's route: grid (8) = one cluster, CTA c the router's columns 16c..16c+15 as q4_cta
// computes them for one row (S splits a warp each, block 32 S; dynamic shared memory S x 16 x
// 16 floats), written to logits and into CTA 0's sl; CTA 0 then takes the top-k.
template <int D>
__device__ __forceinline__ void q4_route(const float* __restrict__ x, const unsigned char* __restrict__ qs,
                                         const unsigned* __restrict__ sm, float* __restrict__ logits,
                                         int* __restrict__ ids, float* __restrict__ wts, int N, int K,
                                         int S, int k, int norm) {
  cluster_arrive();  // phase 1: every CTA of the cluster has started (before any remote store)
  route_rank(cta_partials<false, 2, D>(x, qs, sm, 1, N, K, 0, S), logits, ids, wts, N, S, k, norm);
}

// q4_route with the MoE's RMSNorm folded in (`norm_route`): x = rms_norm(h, nw) as
// kernels/cuda_norm.py computes it, each warp taking the row's 1 / rms itself once its ring's
// first weight loads are out and staging x of its own K range as fp16 in shared memory (as
// q4_ctan does); the cluster's CTA 0 also writes x (fp32, rms_rows's values) to xn for the
// experts. Dynamic shared memory S x 16 x 16 floats, then K halves.
template <int D, int KV>
__device__ __forceinline__ void q4_route_n(const float* __restrict__ h, const float* __restrict__ nw,
                                           const unsigned char* __restrict__ qs,
                                           const unsigned* __restrict__ sm, float* __restrict__ xn,
                                           float* __restrict__ logits, int* __restrict__ ids,
                                           float* __restrict__ wts, int N, int K, int S, int k,
                                           int norm, int eps_bits) {
  extern __shared__ __align__(16) unsigned char smem[];
  SharedHalf* xs = reinterpret_cast<SharedHalf*>(smem + S * 16 * 16 * sizeof(float));
  const int lane = threadIdx.x & 31;
  const bool writer = cluster_rank() == 0;
  int k_lo, k_hi;
  split_k(K, S, threadIdx.x >> 5, k_lo, k_hi);
  auto stage = [&]() {
    pdl_wait();
    const float inv = row_inv_rms_lean<KV>(h, lane, eps_bits);
    for (int q = k_lo + 4 * lane; q < k_hi; q += 128) {
      const float4 v = scaled(*reinterpret_cast<const float4*>(h + q), inv,
                              __ldg(reinterpret_cast<const float4*>(nw + q)));
      *reinterpret_cast<__half2*>(xs + q) = __floats2half2_rn(v.x, v.y);
      *reinterpret_cast<__half2*>(xs + q + 2) = __floats2half2_rn(v.z, v.w);
      if (writer) *reinterpret_cast<float4*>(xn + q) = v;
    }
    __syncwarp();
  };
  cluster_arrive();  // phase 1, as q4_route
  route_rank(cta_partials<false, 2, D>(static_cast<const SharedHalf*>(xs), qs, sm, 1, N, K, 0, S,
                                       stage), logits, ids, wts, N, S, k, norm);
}

#define Q4_ROUTE(D) extern "C" __global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(512, 1) \
    q4_route8_2_d##D(const float* x, const unsigned char* qs, const unsigned* sm, float* logits, \
                     int* ids, float* wts, int N, int K, int S, int k, int norm) { \
    q4_route<D>(x, qs, sm, logits, ids, wts, N, K, S, k, norm); }
Q4_ROUTE(2)  // (512 threads: 128 registers, the 2-deep ring of cuda_q4.CTAW_DEPTH)
#define Q4_ROUTE_N(D, KV) extern "C" __global__ void __cluster_dims__(8, 1, 1) \
    __launch_bounds__(512, 1) q4_route8_2_d##D##_k##KV(const float* h, const float* nw, \
    const unsigned char* qs, const unsigned* sm, float* xn, float* logits, int* ids, float* wts, \
    int N, int K, int S, int k, int norm, int eps_bits) { \
    q4_route_n<D, KV>(h, nw, qs, sm, xn, logits, ids, wts, N, K, S, k, norm, eps_bits); }
Q4_ROUTE_N(2, 4) Q4_ROUTE_N(2, 8) Q4_ROUTE_N(2, 16)
"""
ENTRIES = (b"topk_rows", b"q4_route8_2_d2") + tuple(f"q4_route8_2_d2_k{kv}".encode()
                                                    for kv in cuda_norm.WIDTHS)
SOURCE = cuda_norm.NORM_DEVICE + CLUSTER_DEVICE + ROUTE  # (the norm's order for the fold)
MAX_E, MAX_K = 256, 32  # TOPK_MAX_E, TOPK_MAX_K
CLUSTER = 8  # the route kernel's CTAs: the router's column tiles of 16 (128 experts)
_UNAVAILABLE: dict = {}


def ptx(arch: str = "compute_90", cache: bool = True) -> bytes:
    """ROUTE (with cuda_q4's device code) compiled by NVRTC for `arch` (sm_90 and later)."""
    return cuda_q4.ptx(arch, cache, part="route", entries=SOURCE)


def _functions(device: int) -> tuple:
    """(libcuda, {entry: function}) of the route module on `device`."""
    return cuda_q4.module(device, "route", SOURCE, ENTRIES)


def available(device: int) -> bool:
    """Whether the route kernels load on `device` (sm_90 and later; cuda_q4's requirements)."""
    if device in _UNAVAILABLE:
        return False
    try:
        if torch.cuda.get_device_capability(device) < (9, 0) or not cuda_q4.available(device):
            raise RuntimeError("needs sm_90 and cuda_q4")
        _functions(device)
    except (RuntimeError, OSError) as e:
        _UNAVAILABLE[device] = str(e)
        return False
    return True


def topk_fits(logits: torch.Tensor, top_k: int) -> bool:
    """Whether `topk` takes these logits [T, E] (on a device where the kernels load)."""
    return (logits.is_cuda and logits.dtype == torch.float32 and logits.stride(1) == 1
            and logits.shape[1] <= MAX_E and 0 < top_k <= min(MAX_K, logits.shape[1])
            and available(logits.device.index or 0))


def topk(logits: torch.Tensor, top_k: int, norm: bool, ids: torch.Tensor,
         wts: torch.Tensor) -> None:
    """ids [T, k] int32, wts [T, k] f32 ← the top-k of each row of logits [T, E] (module doc)."""
    t, e = logits.shape
    if t:
        cuda, fns = _functions(logits.device.index or 0)
        cuda_q4._launch(cuda, fns[b"topk_rows"], (t, 1, 1), 256, 0, (logits, ids, wts),
                        (e, top_k, int(norm), logits.stride(0)))


def route_fits(x: torch.Tensor, router, top_k: int) -> bool:
    """Whether `route` takes this one-token x and router: a q4 weight of CLUSTER x 16 outputs
    in 4-16 K splits (a CTA of at least as many threads as experts), on a device where the
    kernels load."""
    return (x.shape[0] == 1 and isinstance(router, Q4Linear)
            and router.out_features == CLUSTER * 16 and 1 < router.split <= cuda_q4.CTA_MAX_SPLIT
            and 32 * router.split >= router.out_features  # (CTA 0's threads rank an expert each)
            and router.in_features % 64 == 0 and 0 < top_k <= MAX_K and x.is_cuda
            and x.dtype == torch.float32 and x.stride(1) == 1 and x.data_ptr() % 8 == 0
            and available(x.device.index or 0))


def route(x: torch.Tensor, router, logits: torch.Tensor, top_k: int, norm: bool,
          ids: torch.Tensor, wts: torch.Tensor) -> None:
    """One token: logits [1, E] = x @ router.T (the CTA form's bits) and ids / wts its top-k
    (`topk`'s arithmetic), one cluster launch."""
    cuda, fns = _functions(x.device.index or 0)
    s = router.split
    cuda_q4._launch(cuda, fns[b"q4_route8_2_d2"], (CLUSTER, 1, 1), 32 * s,
                    s * 16 * 16 * 4, (x, router.qs, router.sm.view(torch.int32), logits, ids, wts),
                    (router.out_features, router.in_features, s, top_k, int(norm)))


def norm_route_fits(h: torch.Tensor, weight: torch.Tensor, router, top_k: int) -> bool:
    """Whether `norm_route` takes this one-token h, the norm's weight and the router: `route`'s
    and the CUDA norm's conditions (K one of 128 x cuda_norm.WIDTHS, aligned rows)."""
    return (route_fits(h, router, top_k) and cuda_norm.fits(h, weight)
            and h.data_ptr() % 16 == 0 and router.in_features == h.shape[1])


def norm_route(h: torch.Tensor, weight: torch.Tensor, eps: float, router, xn: torch.Tensor,
               logits: torch.Tensor, top_k: int, norm: bool, ids: torch.Tensor,
               wts: torch.Tensor) -> None:
    """One token: xn [1, K] = rms_norm(h, weight) (cuda_norm's bits), logits, ids and wts as
    `route` gives them for xn — one cluster launch (`q4_route_n`)."""
    cuda, fns = _functions(h.device.index or 0)
    s, k = router.split, router.in_features
    cuda_q4._launch(cuda, fns[f"q4_route8_2_d2_k{k // 128}".encode()], (CLUSTER, 1, 1), 32 * s,
                    s * 16 * 16 * 4 + k * 2,
                    (h, weight, router.qs, router.sm.view(torch.int32), xn, logits, ids, wts),
                    (router.out_features, k, s, top_k, int(norm), cuda_norm._bits(eps)))
