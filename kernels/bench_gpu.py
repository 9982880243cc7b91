"""Kernel benchmark on the GPU: achieved bandwidth of each kernel family at the shapes of
synthetic:qwen3-30b-a3b-int4, against a device copy measured in the same run, for the fixed
(invariant) tile configs and for non-invariant variants (best tile per batch size; split-K
with atomics). Prints tables and writes JSON. Not a test.

    python -m kernels.bench_gpu [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from kernels import triton_attention, triton_int4, triton_moe
from kernels.linear import Linear
from kernels.triton_int4 import FMT_CODES, TileConfig, _rows_times_w, weight_args

DEV = "cuda"
TILES = ("16x16x128w4", "16x32x128w4", "16x64x128w8", "16x16x256w4",  # the block loop (v2/v4)
         "16x32x128w4:elem", "16x32x128w4:swap", "16x64x128w4:swap", "16x64x64w4s3:swap",
         "64x64x128w4:swap")
MOE_TILES = ("16x32x128w4", "16x64x128w8", "16x32x128w4:elem", "16x32x128w4:swap",
             "16x64x128w4:swap")


def time_ms(fn, reps: int = 20, iters: int = 15) -> float:
    """Median ms per call of fn, from replays of a CUDA graph of `reps` back-to-back calls
    (the engine replays graphs too; timing launches from Python would time the launcher)."""
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / reps)
    return sorted(ts)[len(ts) // 2]


def copy_bandwidth() -> float:
    """GB/s of a 2 GiB device copy, bytes read + written (the engine benchmark's measure)."""
    from replica.bench import copy_bandwidth as measure

    return measure(DEV)


def rand_q4(n: int, k: int, g) -> Linear:
    qs = torch.randint(0, 256, (n, k // 2), generator=g, device=DEV, dtype=torch.uint8)
    scale = (torch.rand(n, k // 32, generator=g, device=DEV) + 0.5) * k ** -0.5 / 4
    return triton_int4.to_gpu_format(Linear.q4(qs, scale, -8 * scale))


@triton.jit
def _linear_splitk_kernel(x_ptr, w_ptr, s_ptr, m_ptr, y_ptr, M, N, K, stride_x, stride_w,
                          stride_s, stride_y, FMT: tl.constexpr, SPLIT_K: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Non-invariant reference: K cut into SPLIT_K pieces summed by atomics (order varies)."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    kk = K // SPLIT_K
    k_lo = pid_k * kk
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc = _rows_times_w(x_ptr + k_lo, offs_m, offs_m < M, stride_x, w_ptr + k_lo // 2,
                        s_ptr + k_lo // 32, m_ptr + k_lo // 32, pid_n * BN, offs_n < N, kk, stride_w,
                        stride_s, acc, FMT, BN, BK)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.atomic_add(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], acc, mask=mask)


def linear_splitk(lin: Linear, x: torch.Tensor, out: torch.Tensor, split: int,
                  tile: TileConfig) -> torch.Tensor:
    w, s, m, sw, ss = weight_args(lin)
    out.zero_()
    n = x.shape[0]
    grid = (triton.cdiv(n, tile.bm), triton.cdiv(lin.out_features, tile.bn), split)
    _linear_splitk_kernel[grid](x, w, s, m, out, n, lin.out_features, lin.in_features, x.stride(0),
                                sw, ss, out.stride(0), FMT=FMT_CODES[lin.fmt], SPLIT_K=split,
                                BM=tile.bm, BN=tile.bn, BK=tile.bk, num_warps=tile.warps,
                                num_stages=tile.stages)
    return out


def timed(fn, name: str) -> float:
    """time_ms, or NaN (reported) when a variant fails to compile or run: one bad variant
    must not cost the rest of a device run."""
    try:
        return time_ms(fn)
    except Exception as e:  # noqa: BLE001 - reported and the run goes on
        print(f"variant {name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return float("nan")


def bench_linear(copy_gbs: float, ms_list, tiles, splitk: bool = True) -> list[dict]:
    g = torch.Generator(DEV).manual_seed(0)
    shapes = {"qkv": (5120, 2048), "o": (2048, 4096), "lm_head": (151936, 2048)}
    rows = []
    for name, (n, k) in shapes.items():
        one = rand_q4(n, k, g)
        copies = max(1, (256 << 20) // one.nbytes)  # rotate weights so L2 (60 MB) cannot hold them
        lins = [one] + [rand_q4(n, k, g) for _ in range(copies - 1)]
        for m in ms_list:
            x = torch.randn(m, k, generator=g, device=DEV)
            out = torch.empty(m, n, device=DEV)
            state = {"i": 0}

            def nxt():
                state["i"] = (state["i"] + 1) % len(lins)
                return lins[state["i"]]

            for tname, tile in tiles.items():
                ms = timed(lambda: triton_int4.linear(nxt(), x, out, tile=tile), tname)
                gbs = one.nbytes / ms / 1e6
                rows.append(dict(kernel="linear_q4", shape=name, m=m, variant=tname, ms=ms,
                                 gbs=gbs, pct_copy=100 * gbs / copy_gbs))
            for split in (2, 4) if splitk else ():
                tile = triton_int4.LINEAR_TILE
                if k % (split * tile.bk):
                    continue
                ms = time_ms(lambda: linear_splitk(nxt(), x, out, split, tile))
                gbs = one.nbytes / ms / 1e6
                rows.append(dict(kernel="linear_q4", shape=name, m=m, variant=f"splitk{split}*",
                                 ms=ms, gbs=gbs, pct_copy=100 * gbs / copy_gbs))
        del lins
        torch.cuda.empty_cache()
    return rows


def bench_moe(copy_gbs: float, ts, tiles) -> list[dict]:
    g = torch.Generator(DEV).manual_seed(1)
    router = rand_q4(128, 2048, g)
    layers = [triton_moe.StackedExperts.stack(tuple((rand_q4(1536, 2048, g), rand_q4(2048, 768, g))
                                                    for _ in range(128))) for _ in range(2)]
    rows = []
    for t in ts:
        x = torch.randn(t, 2048, generator=g, device=DEV)
        ids = torch.empty(t, 8, dtype=torch.int32, device=DEV)
        wts = torch.empty(t, 8, device=DEV)
        triton_moe.route(x, router, 8, True, ids, wts)
        touched = int(torch.unique(ids).numel())
        inter = torch.empty(t * 8, 768, device=DEV, dtype=torch.float16)
        y = torch.empty(t * 8, 2048, device=DEV)
        out = torch.empty(t, 2048, device=DEV)
        nbytes = touched * layers[0].expert_nbytes() + router.nbytes
        state = {"i": 0}

        def lay():
            state["i"] ^= 1
            return layers[state["i"]]

        ms = time_ms(lambda: triton_moe.route(x, router, 8, True, ids, wts))
        rows.append(dict(kernel="moe_route", shape="128x2048", m=t, variant="fixed", ms=ms,
                         gbs=router.nbytes / ms / 1e6, pct_copy=100 * router.nbytes / ms / 1e6 / copy_gbs))
        for tname, tile in tiles.items():
            def full():
                triton_moe.route(x, router, 8, True, ids, wts)
                triton_moe.experts_forward(x, ids, lay(), inter, y, tile=tile)
                triton_moe.combine(y, wts, out)
            ms = timed(full, tname)
            gbs = nbytes / ms / 1e6
            rows.append(dict(kernel="moe", shape=f"E128 k8 touched={touched}", m=t, variant=tname,
                             ms=ms, gbs=gbs, pct_copy=100 * gbs / copy_gbs))
    return rows


def bench_attention(copy_gbs: float) -> list[dict]:
    g = torch.Generator(DEV).manual_seed(2)
    h, kvh, d, bs = 32, 4, 128, 16
    rows = []
    for t, ctx_len in ((1, 128), (64, 128), (64, 1024), (8, 8192)):
        mb = triton.cdiv(ctx_len, bs)
        nb = t * mb
        kc = torch.randn(nb, bs, kvh, d, generator=g, device=DEV)
        vc = torch.randn_like(kc)
        tables = torch.randperm(nb, generator=g, device=DEV).view(t, mb).to(torch.int32).contiguous()
        rows_t = torch.arange(t, dtype=torch.int32, device=DEV)
        ctx = torch.full((t,), ctx_len, dtype=torch.int32, device=DEV)
        q = torch.randn(t, h, d, generator=g, device=DEV)
        out = torch.empty_like(q)
        ms = time_ms(lambda: triton_attention.paged_attention(q, kc, vc, tables, rows_t, ctx,
                                                               d ** -0.5, out))
        nbytes = 2 * kc.numel() * 4
        rows.append(dict(kernel="paged_attention", shape=f"ctx={ctx_len}", m=t, variant="split512",
                         ms=ms, gbs=nbytes / ms / 1e6, pct_copy=100 * nbytes / ms / 1e6 / copy_gbs))
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'kernel':<16} {'shape':<24} {'M':>4} {'variant':<20} {'ms':>8} {'GB/s':>7} {'%copy':>6}"]
    for r in rows:
        lines.append(f"{r['kernel']:<16} {r['shape']:<24} {r['m']:>4} {r['variant']:<20} "
                     f"{r['ms']:>8.4f} {r['gbs']:>7.0f} {r['pct_copy']:>6.1f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="the engine's tiles only")
    ap.add_argument("--ms", default="1,8,32,64", help="batch sizes (rows / tokens)")
    ap.add_argument("--tiles", default=",".join(TILES), help="linear tile specs to compare")
    ap.add_argument("--moe-tiles", default=",".join(MOE_TILES), help="expert tile specs")
    ap.add_argument("--no-splitk", action="store_true", help="skip the split-K references")
    ap.add_argument("--no-attention", action="store_true")
    args = ap.parse_args()
    ms_list = tuple(int(v) for v in args.ms.split(","))
    copy_gbs = copy_bandwidth()
    print(f"device copy: {copy_gbs:.0f} GB/s (read + write)", flush=True)
    if args.quick:
        tiles = {"fixed": triton_int4.LINEAR_TILE}
        moe_tiles = {"fixed": triton_moe.EXPERT_TILE}
    else:
        tiles = {t: triton_int4.TileConfig.parse(t) for t in args.tiles.split(",")}
        moe_tiles = {t: triton_int4.TileConfig.parse(t) for t in args.moe_tiles.split(",")}
    rows = [] if args.no_attention else bench_attention(copy_gbs)
    print(format_rows(rows), flush=True)
    rows_l = bench_linear(copy_gbs, ms_list, tiles, splitk=not args.no_splitk)
    print(format_rows(rows_l), flush=True)
    rows_m = bench_moe(copy_gbs, ms_list, moe_tiles)
    print(format_rows(rows_m), flush=True)
    rows += rows_l + rows_m
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbs": copy_gbs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
