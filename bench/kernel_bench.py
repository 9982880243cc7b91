"""Kernel benchmark on the GPU: achieved bandwidth of each kernel family at the shapes of
synthetic:qwen3-30b-a3b-int4, against a device copy measured in the same run: the q4 GEMM for
a few tiles (each with its own split-K counts), the MoE layer, paged attention over bf16 and
fp32 KV at 2K-32K contexts; the v5 kernels' numbers beside them. Prints tables and writes
JSON. Not a test.

    python -m bench.kernel_bench [--json out.json] [--ms 1,8,64] [--tiles 16x64x128w1s3,...]
        [--linear-variants 512,512:nopdl] [--moe-variants 128,128:nopdl,64]
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass

import torch
import triton

from kernels import (moe_layout, q4_layout, triton_attention, triton_linear, triton_moe,
                     triton_moe_route, triton_pdl, triton_q4)
from kernels.linear import Linear

DEV = "cuda"
Q4_TILES = ("16x64x64w1s3", "16x64x128w1s3", "16x64x64w1s4")  # the first is the engine's
ATTN_CASES = ((1, 128), (64, 128), (1, 2048), (64, 2048), (8, 8192), (1, 32768), (16, 32768))
# the previous engine kernels (v5: fixed 16x32x128w4 tile, no split-K, KV fp32), same bench,
# from kernels/GPU_NOTES.md: (kernel, shape, M) -> GB/s
V5_GBS = {("linear_q4", "qkv", 1): 410, ("linear_q4", "qkv", 64): 208, ("linear_q4", "o", 1): 227,
          ("linear_q4", "o", 64): 176, ("linear_q4", "lm_head", 1): 1005,
          ("linear_q4", "lm_head", 64): 244, ("moe", "E128 k8", 1): 474, ("moe", "E128 k8", 64): 801}


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
    from bench.engine import copy_bandwidth as measure

    return measure(DEV)


def rand_q4(n: int, k: int, g) -> Linear:
    """Random nibbles, fp16 scales, mins = -8 * scale (Q4_0-like), in load (GGUF) order."""
    qs = torch.randint(0, 256, (n, k // 2), generator=g, device=DEV, dtype=torch.uint8)
    scale = (torch.rand(n, k // 32, generator=g, device=DEV) + 0.5).half().float() * k ** -0.5 / 4
    return Linear.q4(qs, scale, -8 * scale)


def timed(fn, name: str) -> float:
    """time_ms, or NaN (reported) when a variant fails to compile or run: one bad variant
    must not cost the rest of a device run."""
    try:
        return time_ms(fn)
    except Exception as e:  # noqa: BLE001 - reported and the run goes on
        print(f"variant {name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return float("nan")


@dataclass(frozen=True)
class Variant:
    """One launch configuration to time: "PROGRAMS[:nopdl]", e.g. "512:nopdl" — the split-K
    program target (q4_layout.split_count; for the MoE, per expert) and plain launches instead
    of programmatic dependent launch. (GPU_NOTES v7 also lists register caps and a MoE
    down-weight prefetch, measured and removed.)"""

    programs: int
    pdl: bool = True

    @classmethod
    def parse(cls, spec: str) -> "Variant":
        head, *flags = spec.split(":")
        return cls(int(head), "nopdl" not in flags)

    def apply(self) -> str:
        """Set the launch switch for this variant; its label."""
        triton_pdl.ENABLED = self.pdl
        return "pdl" if self.pdl else "nopdl"


def reset_switches() -> None:
    Variant(0).apply()


def bench_linear(copy_gbs: float, ms_list, tiles, variants) -> list[dict]:
    g = torch.Generator(DEV).manual_seed(0)
    shapes = {"qkv": (5120, 2048), "o": (2048, 4096), "lm_head": (151936, 2048)}
    rows = []
    for name, (n, k) in shapes.items():
        base = [rand_q4(n, k, g)]
        copies = max(1, (256 << 20) // (n * k * 5 // 8))  # rotate weights so L2 (60 MB) cannot hold them
        base += [rand_q4(n, k, g) for _ in range(copies - 1)]
        for (tname, tile), var in itertools.product(tiles.items(), variants):
            lins = [q4_layout.repack(b, tile, var.programs) for b in base]
            nbytes = lins[0].qs.nbytes + lins[0].sm.nbytes
            state = {"i": 0}
            variant = f"{tname} S={lins[0].split} {var.apply()}"

            def nxt():
                state["i"] = (state["i"] + 1) % len(lins)
                return lins[state["i"]]

            for m in ms_list:
                x = torch.randn(m, k, generator=g, device=DEV)
                out = torch.empty(m, n, device=DEV)
                ms = timed(lambda: triton_q4.linear(nxt(), x, out, tile=tile), variant)
                gbs = nbytes / ms / 1e6
                rows.append(dict(kernel="linear_q4", shape=name, m=m, variant=variant,
                                 ms=ms, gbs=gbs, pct_copy=100 * gbs / copy_gbs,
                                 v5_gbs=V5_GBS.get(("linear_q4", name, m))))
            print(format_rows(rows[-len(ms_list):], header=False), flush=True)
            reset_switches()
            del lins
        del base
        torch.cuda.empty_cache()
    return rows


def bench_moe(copy_gbs: float, ts, tiles, variants) -> list[dict]:
    g = torch.Generator(DEV).manual_seed(1)
    router = triton_linear.to_gpu_format(rand_q4(128, 2048, g))
    experts = [tuple((rand_q4(1536, 2048, g), rand_q4(2048, 768, g)) for _ in range(128))
               for _ in range(2)]
    rows = []
    targets = sorted({v.programs for v in variants})  # one stacking per split-K target
    for (tname, tile), programs in itertools.product(tiles.items(), targets):
        layers = [moe_layout.StackedExperts.stack(e, tile, programs) for e in experts]
        for var in (v for v in variants if v.programs == programs):
            rows += _bench_moe_tile(copy_gbs, ts, router, layers, g, var.apply())
            print(format_rows(rows[-2 * len(ts):], header=False), flush=True)
            reset_switches()
        del layers
        torch.cuda.empty_cache()
    return rows


def routed_tokens(t: int, router, g) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """t random tokens of the 30B preset's MoE layer and their top-8 routing:
    (x [t, 2048], ids [t, 8] int32, wts [t, 8])."""
    x = torch.randn(t, 2048, generator=g, device=DEV)
    ids = torch.empty(t, 8, dtype=torch.int32, device=DEV)
    wts = torch.empty(t, 8, device=DEV)
    triton_moe_route.route(x, router, 8, True, ids, wts)
    return x, ids, wts


def _bench_moe_tile(copy_gbs: float, ts, router, layers, g, mode: str) -> list[dict]:
    rows = []
    for t in ts:
        x, ids, wts = routed_tokens(t, router, g)
        touched = int(torch.unique(ids).numel())
        router_bytes = router.qs.nbytes + router.sm.nbytes
        nbytes = touched * layers[0].expert_nbytes() + router_bytes
        state = {"i": 0}

        def lay():
            state["i"] ^= 1
            return layers[state["i"]]

        ms = time_ms(lambda: triton_moe_route.route(x, router, 8, True, ids, wts))
        rows.append(dict(kernel="moe_route", shape="128x2048", m=t, variant=f"q4 {mode}", ms=ms,
                         gbs=router_bytes / ms / 1e6, pct_copy=100 * router_bytes / ms / 1e6 / copy_gbs))

        ms = timed(lambda: triton_moe.moe(x, router, lay(), 8, True), "moe")
        gbs = nbytes / ms / 1e6
        st = layers[0]
        rows.append(dict(kernel="moe", shape=f"E128 k8 touched={touched}", m=t,
                         variant=f"{st.tile.name} S={st.gu_split}/{st.down_split} {mode}",
                         ms=ms, gbs=gbs, pct_copy=100 * gbs / copy_gbs,
                         v5_gbs=V5_GBS.get(("moe", "E128 k8", t))))
    return rows


def bench_attention(copy_gbs: float, dtypes=(torch.bfloat16, torch.float32),
                    splits=(512, 256), launches=()) -> list[dict]:
    """splits: keys a split, timed in this order; launches: extra (warps, stages) of the split
    kernel, bf16 and the default split (triton_attention.SPLIT, which must then be the last
    of splits: the bits column compares against its output), each with a bits column against
    the default launch."""
    g = torch.Generator(DEV).manual_seed(2)
    h, kvh, d, bs = 32, 4, 128, 16
    rows = []
    for dtype in dtypes:
        for t, ctx_len in ATTN_CASES:
            mb = triton.cdiv(ctx_len, bs)
            nb = t * mb
            kc = torch.randn(nb, bs, kvh, d, generator=g, device=DEV).to(dtype)
            vc = torch.randn(nb, bs, kvh, d, generator=g, device=DEV).to(dtype)
            tables = torch.randperm(nb, generator=g, device=DEV).view(t, mb).to(torch.int32).contiguous()
            rows_t = torch.arange(t, dtype=torch.int32, device=DEV)
            ctx = torch.full((t,), ctx_len, dtype=torch.int32, device=DEV)
            q = torch.randn(t, h, d, generator=g, device=DEV)
            out = torch.empty_like(q)
            nbytes = 2 * kc.numel() * kc.element_size()
            for split in splits if dtype == torch.bfloat16 else splits[:1]:
                ms = timed(lambda: triton_attention.paged_attention(
                    q, kc, vc, tables, rows_t, ctx, d ** -0.5, out, split=split), "attention")
                rows.append(dict(kernel="paged_attention", shape=f"ctx={ctx_len} {str(dtype)[6:]}",
                                 m=t, variant=f"split{split}", ms=ms, gbs=nbytes / ms / 1e6,
                                 pct_copy=100 * nbytes / ms / 1e6 / copy_gbs))
            ref = out.clone()
            for launch in launches if dtype == torch.bfloat16 else ():
                default = triton_attention.WARPS, triton_attention.STAGES
                triton_attention.WARPS, triton_attention.STAGES = launch
                out.fill_(float("nan"))
                ms = timed(lambda: triton_attention.paged_attention(
                    q, kc, vc, tables, rows_t, ctx, d ** -0.5, out), "attention")
                same = torch.equal(out, ref)
                triton_attention.WARPS, triton_attention.STAGES = default
                rows.append(dict(kernel="paged_attention", shape=f"ctx={ctx_len} {str(dtype)[6:]}",
                                 m=t, variant=f"w{launch[0]}s{launch[1]} bits{'=' if same else '!'}",
                                 ms=ms, gbs=nbytes / ms / 1e6,
                                 pct_copy=100 * nbytes / ms / 1e6 / copy_gbs))
            del kc, vc
        torch.cuda.empty_cache()
    return rows


def format_rows(rows: list[dict], header: bool = True) -> str:
    lines = [f"{'kernel':<16} {'shape':<24} {'M':>4} {'variant':<22} {'ms':>8} {'GB/s':>7} "
             f"{'%copy':>6} {'v5 GB/s':>8}"] if header else []
    for r in rows:
        v5 = r.get("v5_gbs")
        lines.append(f"{r['kernel']:<16} {r['shape']:<24} {r['m']:>4} {r['variant']:<22} "
                     f"{r['ms']:>8.4f} {r['gbs']:>7.0f} {r['pct_copy']:>6.1f} "
                     f"{'' if v5 is None else v5:>8}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--ms", default="1,8,32,64", help="batch sizes (rows / tokens)")
    ap.add_argument("--tiles", default=",".join(Q4_TILES), help="q4 tile specs to compare")
    ap.add_argument("--no-attention", action="store_true")
    ap.add_argument("--attention-only", action="store_true")
    ap.add_argument("--attention-launches", default="",
                    help="split-kernel launches to compare, WARPS:STAGES,... e.g. 8:2,4:3")
    ap.add_argument("--linear-variants", default=str(q4_layout.MAX_PROGRAMS),
                    help="q4 linear launch variants, PROGRAMS[:nopdl],... (see Variant)")
    ap.add_argument("--moe-variants", default=str(moe_layout.EXPERT_PROGRAMS),
                    help="MoE launch variants, PROGRAMS[:nopdl],...")
    args = ap.parse_args()
    ms_list = tuple(int(v) for v in args.ms.split(","))
    copy_gbs = copy_bandwidth()
    print(f"device copy: {copy_gbs:.0f} GB/s (read + write)", flush=True)
    tiles = {t: q4_layout.Q4Tile.parse(t) for t in args.tiles.split(",")}
    launches = [tuple(int(v) for v in spec.split(":")) for spec in args.attention_launches.split(",")
                if spec]
    rows = [] if args.no_attention else bench_attention(
        copy_gbs, dtypes=(torch.bfloat16,) if launches else (torch.bfloat16, torch.float32),
        splits=(triton_attention.SPLIT,) if launches else (512, 256), launches=launches)
    print(format_rows(rows), flush=True)
    if args.attention_only:
        return
    variants = lambda spec: [Variant.parse(v) for v in spec.split(",")]  # noqa: E731
    rows_l = bench_linear(copy_gbs, ms_list, tiles, variants(args.linear_variants))
    print(format_rows(rows_l), flush=True)
    rows_m = bench_moe(copy_gbs, ms_list, tiles, variants(args.moe_variants))
    print(format_rows(rows_m), flush=True)
    rows += rows_l + rows_m
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbs": copy_gbs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
