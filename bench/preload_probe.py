"""What a one-row q4 GEMV costs on the one-token chain when its CTAs fetch their whole weight
slice into shared memory before the PDL wait, against the engine's CTA form (kernels/
cuda_q4.py `linear`). A chain of `--phases` GEMVs alternating 2,048 → 4,096 and 4,096 → 2,048
(o-like and its transpose), one row, captured in a CUDA graph; µs a phase.

The probe kernel (`pre_gemv`, bench only: its sums are fp16 products added in fp32 per block,
not the engine's bits) is a CTA of 256 threads a column tile over the whole K: it issues
cp.async for the tile's weights and scales (40 KB at these shapes), then `griddepcontrol.wait`
and only then reads x. Two triggers: `launch_dependents` after the wait (the engine's
look-ahead of one kernel) or before it (`early`: the next kernels may be scheduled at once,
as deep as the SMs' shared memory holds them, each fetching its weights while the chain runs).
The engine's kernels keep their weights in register rings, so the next kernel's CTAs are
resident, and fetching, only as the current one's leave. Three more rows take parts out (timing
only): the dot products, the weight loads, both (what is left: the boundary, x, the merge and
the store).

With --experts, one token's MoE experts a layer (8 of the 30B's experts): the engine's two
launches against cuda_q4's fused cluster launch (FUSED_EXPERTS).

    python -m bench.preload_probe [--phases 48] [--replays 200] [--experts] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json

import torch

SOURCE = r"""
#include <cuda_fp16.h>

__device__ __forceinline__ void cp16(void* dst, const void* src) {
  unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(d), "l"(src) : "memory");
}

// out[c0 .. c0 + COLS) = x . W[c0 + c, :] for one row; qs [K/32, N, 16] uint8, sm [K/32, N]
// (scale, min) fp16 pairs (kernels/q4_layout.py). 256 threads; dynamic shared memory:
// nb * COLS * 20 bytes of weights, K fp16 of x, 256 floats of partials.
template <int COLS>
__device__ void pre_gemv(const float* __restrict__ x, const uint4* __restrict__ qs,
                         const unsigned* __restrict__ sm, float* __restrict__ out, int N, int K,
                         int flags) {
  // flags: 1 launch_dependents before the wait; 2 no weight loads; 4 no dequantize / dot
  const int early = flags & 1, loads = !(flags & 2), dots = !(flags & 4);
  extern __shared__ uint4 smem[];
  const int nb = K / 32, c0 = blockIdx.x * COLS, t = threadIdx.x;
  uint4* wq = smem;                                                  // [nb][COLS]
  unsigned* wsm = reinterpret_cast<unsigned*>(wq + nb * COLS);       // [nb][COLS]
  __half2* xp = reinterpret_cast<__half2*>(wsm + nb * COLS);         // [nb][16] pairs
  float* red = reinterpret_cast<float*>(xp + K / 2);                 // [256]
  for (int i = t; loads && i < nb * COLS; i += 256)
    cp16(wq + i, qs + (size_t)(i / COLS) * N + c0 + i % COLS);
  for (int i = t; loads && i < nb * COLS / 4; i += 256)
    cp16(wsm + 4 * i, sm + (size_t)(i / (COLS / 4)) * N + c0 + 4 * (i % (COLS / 4)));
  asm volatile("cp.async.commit_group;" ::: "memory");
#if __CUDA_ARCH__ >= 900
  if (early) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (!early) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  // x as fp16 pairs in the nibbles' order: word w of a block, group g: (x[e], x[e + 2]),
  // e = 4w + (g & 1) + 16 (g >> 1)
  for (int p = t; p < K / 2; p += 256) {
    int b = p / 16, r = p % 16, e = b * 32 + 4 * (r / 4) + (r & 1) + 16 * ((r & 3) >> 1);
    xp[p] = __floats2half2_rn(x[e], x[e + 2]);
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();
  const int col = t % COLS, part = t / COLS, parts = 256 / COLS;
  float acc = 0.f;
  const __half2 k1024 = __floats2half2_rn(1024.f, 1024.f);
  for (int b = part; dots && b < nb; b += parts) {
    uint4 q = wq[b * COLS + col];
    unsigned s = wsm[b * COLS + col];
    __half2 sc = __half2half2(__ushort_as_half((unsigned short)(s & 0xffff)));
    __half2 mn = __half2half2(__ushort_as_half((unsigned short)(s >> 16)));
    const unsigned w[4] = {q.x, q.y, q.z, q.w};
    __half2 a = __floats2half2_rn(0.f, 0.f);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        unsigned sh = (g & 1) * 8 + (g >> 1) * 4;
        unsigned h = ((w[i] >> sh) & 0x000F000Fu) | 0x64006400u;
        __half2 v = __hsub2(*reinterpret_cast<__half2*>(&h), k1024);
        a = __hfma2(__hfma2(v, sc, mn), xp[b * 16 + 4 * i + g], a);
      }
    }
    float2 f = __half22float2(a);
    acc += f.x + f.y;
  }
  red[t] = acc;
  __syncthreads();
  if (t < COLS) {
    float y = 0.f;
    for (int p = 0; p < parts; ++p) y += red[p * COLS + t];
    out[c0 + t] = y;
  }
}

extern "C" __global__ void __launch_bounds__(256) pre_gemv16(const float* x, const uint4* qs,
    const unsigned* sm, float* out, int N, int K, int flags) { pre_gemv<16>(x, qs, sm, out, N, K, flags); }
extern "C" __global__ void __launch_bounds__(256) pre_gemv32(const float* x, const uint4* qs,
    const unsigned* sm, float* out, int N, int K, int flags) { pre_gemv<32>(x, qs, sm, out, N, K, flags); }
"""

_MOD: dict = {}


def _fns():
    from kernels import cuda_q4

    if not _MOD:
        cuda, _ = cuda_q4._functions(torch.cuda.current_device())
        major, minor = torch.cuda.get_device_capability()
        code = cuda_q4._compile(f"compute_{major}{minor}", SOURCE)
        mod = ctypes.c_void_p()
        if cuda.cuModuleLoadData(ctypes.byref(mod), code):
            raise RuntimeError("preload_probe: the driver could not load the module")
        for name in (b"pre_gemv16", b"pre_gemv32"):
            fn = ctypes.c_void_p()
            if cuda.cuModuleGetFunction(ctypes.byref(fn), mod, name):
                raise RuntimeError(f"preload_probe: no kernel {name.decode()}")
            _MOD[name] = fn
        _MOD["cuda"] = cuda
    return _MOD


def pre_linear(lin, x: torch.Tensor, out: torch.Tensor, flags: int = 0) -> torch.Tensor:
    """out [1, N] = x [1, K] @ W.T by the probe kernel (fp16 products: not the engine's bits);
    flags: 1 launch_dependents before the wait; 2 no weight loads, 4 no dot products (timing
    only: wrong values)."""
    from kernels import cuda_q4

    fns = _fns()
    n, k = lin.out_features, lin.in_features
    cols = 32 if n >= 4096 else 16
    smem = k // 32 * cols * 20 + k * 2 + 256 * 4
    cuda_q4._launch(fns["cuda"], fns[f"pre_gemv{cols}".encode()], (n // cols, 1, 1), 256, smem,
                    (x, lin.qs, lin.sm.view(torch.int32), out), (n, k, flags))
    return out


def chain_us(step, phases: int, replays: int) -> float:
    """µs a phase of `step` captured `phases` times in one graph."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / replays / phases)
    return best


def main() -> None:
    from bench.kernel_bench import rand_q4
    from kernels import cuda_q4, q4_layout

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phases", type=int, default=48)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--json", default="")
    ap.add_argument("--experts", action="store_true",
                    help="also one token's experts: two launches against the fused cluster launch")
    args = ap.parse_args()
    g = torch.Generator("cuda").manual_seed(0)
    shapes = [(4096, 2048), (2048, 4096)]
    lins = [q4_layout.repack(rand_q4(*shapes[i % 2], g)) for i in range(args.phases)]
    x0 = torch.randn(1, 2048, generator=g, device="cuda")
    bufs = [torch.empty(1, lin.out_features, device="cuda") for lin in lins]
    # the probe kernel against the dequantized weights (fp16 products: ~1e-3 relative)
    for lin in lins[:2]:
        xin = torch.randn(1, lin.in_features, generator=g, device="cuda")
        got = pre_linear(lin, xin, torch.empty(1, lin.out_features, device="cuda"))
        want = xin @ lin.dequantize().T
        rel = float((got - want).abs().max() / want.abs().max())
        print(f"pre_gemv {lin.out_features}x{lin.in_features}: max error {rel:.2e} of the largest output")
        assert rel < 2e-2, rel

    def engine():
        x = x0
        for lin, out in zip(lins, bufs):
            x = cuda_q4.linear(lin, x, out)

    def pre(flags: int):
        def step():
            x = x0
            for lin, out in zip(lins, bufs):
                x = pre_linear(lin, x, out, flags)
        return step

    rows = []
    mb = sum(lin.qs.numel() + lin.sm.numel() * 2 for lin in lins) / len(lins) / 1e6
    print(f"{args.phases} phases, {mb:.2f} MB a phase, one row; µs a phase (best of 3 x {args.replays} replays)")
    for name, step in (("engine CTA form (PDL)", engine), ("preload, trigger after the wait", pre(0)),
                       ("preload, trigger first (early)", pre(1)),
                       ("preload, no dot products", pre(4)), ("preload, no weight loads", pre(2)),
                       ("neither: x, merge, store", pre(6)), ("engine CTA form again", engine)):
        us = chain_us(step, args.phases, args.replays)
        rows.append({"variant": name, "us_per_phase": us, "tb_per_s": mb / us})
        print(f"{name:34s} {us:7.2f} µs  {mb / us:5.2f} TB/s", flush=True)
    expert_rows = experts_chain(args.phases, args.replays) if args.experts else []
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"phases": args.phases, "mb_per_phase": mb, "rows": rows,
                       "experts": expert_rows}, f, indent=1)


def experts_chain(layers: int, replays: int) -> list[dict]:
    """One token's experts (top-8 of 8 stacked experts of the 30B's shape, a stack a layer)
    `layers` times in a graph, each layer's x the previous one's first expert row: the
    engine's two launches (gate_up, down) against the fused cluster launch
    (cuda_q4.experts_fused) and the two launches with gate_up's / down's splits streamed
    (EXPERT_STREAM / DOWN_STREAM); µs a layer, each variant's rows (every layer's) against the first's."""
    from bench.kernel_bench import rand_q4
    from kernels import cuda_q4, moe_layout

    hidden, inter = 2048, 768
    g = torch.Generator("cuda").manual_seed(1)
    stacks = [moe_layout.StackedExperts.stack(tuple((rand_q4(2 * inter, hidden, g), rand_q4(hidden, inter, g))
                                                    for _ in range(8)))
              for _ in range(layers)]
    st = stacks[0]
    print(f"experts: splits gate_up {st.gu_split} / down {st.down_split}; fused takes them: "
          f"{cuda_q4._fused_shape(st, cuda_q4.FUSED_CLUSTER) is not None}; "
          f"clusters of {cuda_q4.FUSED_CLUSTER} resident at once: {cuda_q4.fused_clusters(st)}", flush=True)
    ids = torch.arange(8, device="cuda", dtype=torch.int32).view(1, 8)
    x0 = torch.randn(1, hidden, generator=g, device="cuda")
    inters = [torch.empty(8, inter, device="cuda", dtype=torch.float16) for _ in stacks]
    ys = [torch.empty(8, hidden, device="cuda") for _ in stacks]

    def chain(fused: bool):
        def step():
            x = x0
            for s, i, y in zip(stacks, inters, ys):
                (cuda_q4.experts_fused if fused else cuda_q4.experts_direct)(x, ids, s, i, y)
                x = y[:1]
        return step

    rows, outs = [], []
    mb = sum(t.numel() * t.element_size() for t in (*st.gu, *st.down)) / 1e6
    knobs = ("EXPERT_STREAM", "DOWN_STREAM")
    for name, fused, streamed in (("two launches (engine)", False, (False, False)),
                                  ("fused cluster launch", True, (False, False)),
                                  ("two launches, gate_up streamed", False, (True, False)),
                                  ("two launches, down streamed", False, (False, True)),
                                  ("two launches, both streamed", False, (True, True)),
                                  ("two launches again", False, (False, False))):
        saved = [getattr(cuda_q4, k) for k in knobs]
        for k, v in zip(knobs, streamed):
            setattr(cuda_q4, k, v)
        try:
            us = chain_us(chain(fused), layers, replays)
        except RuntimeError as err:  # (a cluster the device cannot place)
            print(f"{name:34s} failed: {err}", flush=True)
            continue
        finally:
            for k, v in zip(knobs, saved):
                setattr(cuda_q4, k, v)
        outs.append(torch.cat(ys))  # (every layer's: the last ones' values may have decayed)
        rows.append({"variant": name, "us_per_layer": us, "tb_per_s": mb / us,
                     "bits_equal_first": torch.equal(outs[-1], outs[0])})
        print(f"{name:34s} {us:7.2f} µs a layer  {mb / us:5.2f} TB/s  bits as the first: "
              f"{rows[-1]['bits_equal_first']}", flush=True)
    return rows


if __name__ == "__main__":
    main()
