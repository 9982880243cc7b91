"""Row modes of the q4 GEMM and the MoE experts on the GPU: for each batch size, the decode
tile with its K splits in parallel programs, the same tile with all splits in one program
("seq"), wider row tiles (seq), and the weights dequantized once per call on many-warp fp16
tiles ("dense", the dequantize included) — time, bandwidth, TFLOP/s, and whether each gives the
reference mode's bits (a mode that does not may never be chosen by batch size). The "plan"
row is what the engine runs (kernels/triton_q4.py `plan`, kernels/triton_moe.py). Not a test.

    python -m bench.row_modes [--ms 1,8,64,256,1024,4096] [--tiles 32x64x64w1s3,64x64x64w4s3]
        [--ts 1,2,4,8,16,64,512] [--maxnreg 0,128,112] [--dense-tiles 128x128x64w8s3]
        [--kernels] [--dense-from 256] [--cuda] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from bench.gpu_profile import profile_calls
from bench.kernel_bench import copy_bandwidth, rand_q4, routed_tokens, timed
from kernels import cuda_q4, q4_layout, triton_f16, triton_linear, triton_moe, triton_q4
from kernels.moe_layout import StackedExperts
from kernels.q4_layout import Q4Tile

DEV = "cuda"
SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096), "router": (128, 2048), "lm_head": (151936, 2048)}


def _row(kernel, shape, m, mode, ms, nbytes, flops, copy_gbs, same) -> dict:
    gbs = nbytes / ms / 1e6
    r = dict(kernel=kernel, shape=shape, m=m, mode=mode, ms=ms, gbs=gbs,
             pct_copy=100 * gbs / copy_gbs, tflops=flops / ms / 1e9, bits_equal=same)
    print(f"{kernel:<8} {shape:<8} {m:>5} {mode:<22} {ms:>9.4f} ms {gbs:>7.0f} GB/s "
          f"{r['pct_copy']:>5.1f}% {r['tflops']:>7.1f} TFLOP/s  bits {'=' if same else 'DIFFER'}",
          flush=True)
    return r


# (columns a warp, blocks in flight) of the CUDA split programs timed with --cuda
CUDA_VARIANTS = ((16, 8), (32, 4), (16, cuda_q4.STREAM))
# (columns a warp, blocks in flight) of the CUDA CTA form (a CTA a column tile's splits) timed
# with --cuda up to 64 rows
CTA_VARIANTS = ((16, 8), (8, 8), (16, 4), (32, 4))
# (m16 feature tiles a warp, warps a CTA) of the CUDA swapped form timed with --cuda from 9 rows
SWAP_VARIANTS = ((1, 4), (2, 4), (1, 8), (2, 8))


def _roomy(lin: q4_layout.Q4Linear) -> q4_layout.Q4Linear:
    """lin with ticket counters for any row tile of 16+ rows and 16+ columns (repack sizes
    them for LINEAR_TILE), so every tile can run its split programs."""
    if lin.tickets is None:
        return lin
    n_tiles = -(-lin.out_features // 16)
    return replace(lin, tickets=torch.zeros(q4_layout.SPLIT_ROWS // 16 * n_tiles,
                                            dtype=torch.int32, device=lin.qs.device))


def linear_modes(copy_gbs: float, ms_list, tiles, dense_tiles, weights=("qkv", "o", "router"),
                 dense_from: int = 256, cuda: bool = False, cold: int = 0) -> list[dict]:
    """cold > 0: each timed call reads the next of that many copies of the weight (as the
    engine's layers do: at 128 MB or more, none is in L2 when its turn comes); bits are
    checked on the first copy."""
    g = torch.Generator(DEV).manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        if name not in weights:
            continue
        copies = [_roomy(q4_layout.repack(rand_q4(n, k, g))) for _ in range(max(cold, 1))]
        lin = copies[0]
        nbytes = lin.qs.nbytes + lin.sm.nbytes
        ms = timed(lambda: triton_f16.dequantize(lin.qs, lin.sm), "dequantize")
        rows.append(_row("dequant", name, 0, "fp16 W.T", ms, nbytes + 2 * n * k, 0, copy_gbs, True))
        for m in ms_list:
            x = torch.randn(m, k, generator=g, device=DEV)
            ref = triton_q4.linear(lin, x, torch.empty(m, n, device=DEV),
                                   tile=q4_layout.LINEAR_TILE, seq=False)
            # (label, keywords of triton_q4.linear; "f16": of triton_f16.linear; "plan": the
            # engine's dispatch, triton_linear.linear)
            modes = [("split", dict(tile=q4_layout.LINEAR_TILE, seq=False)),
                     ("seq", dict(tile=q4_layout.LINEAR_TILE, seq=True))]
            same_bk = [t for t in tiles if t.nb == q4_layout.LINEAR_TILE.nb]  # (the split's k steps)
            modes += [(f"{t.name} split", dict(tile=t, seq=False)) for t in same_bk]
            modes += [(f"{t.name} seq", dict(tile=t, seq=True)) for t in same_bk]
            modes += [(f"dense {t.name}{f' flat{u}' if u else ''}", dict(tile=t, flat=u, f16=1))
                      for t in dense_tiles for u in (0, 1, 2) if m >= dense_from]  # u k steps a loop
            if cuda:  # the split programs in CUDA C++ (kernels/cuda_q4.py, an experiment)
                modes += [(f"cuda split {c}c {'stream' if d == cuda_q4.STREAM else f'd{d}'}",
                           dict(cu=1, cols=c, depth=d)) for c, d in CUDA_VARIANTS if n % c == 0]
                if m <= 64:  # the splits in one CTA (16-row tiles a CTA each)
                    modes += [(f"cuda cta {c}c d{d}", dict(cu=1, cols=c, depth=d, cta=True))
                              for c, d in CTA_VARIANTS if n % c == 0 and cuda_q4.cta_takes(lin, c)]
                if m > 8:  # the weights as the MMA's A operand, x through shared memory
                    modes += [(f"cuda swap mt{mt} w{w}", dict(cu=2, mt=mt, warps=w))
                              for mt, w in SWAP_VARIANTS if n % (16 * mt * w) == 0]
                if m <= 8:  # what its loads alone / without the split merge take (wrong values)
                    modes += [(f"cuda probe {p.decode()}", dict(cu=1, cols=16, depth=cuda_q4.STREAM, probe=p))
                              for p in cuda_q4.PROBES]
            plan_tile, plan_seq = triton_q4.plan(lin, m)  # what the engine runs: 32s = 32 rows, seq
            dense = triton_f16.plan(lin, m, x)
            plan = f"dense {dense.name}" if dense else f"{plan_tile.bm}{'s' if plan_seq else 'p'}"
            modes.append((f"plan {plan}", dict(plan=1)))
            for label, kw in modes:
                out = torch.empty(m, n, device=DEV)
                f16, plan, cu = kw.pop("f16", 0), kw.pop("plan", 0), kw.pop("cu", 0)
                run = (triton_f16.linear if f16 else triton_linear.linear if plan
                       else cuda_q4.swap_linear if cu == 2
                       else cuda_q4.linear if cu else triton_q4.linear)
                if f16:
                    try:
                        triton_f16.check_unroll(kw.get("flat", 0), k, lin.split, kw["tile"])
                    except ValueError as e:
                        print(f"linear   {name:<8} {m:>5} {label:<22} skipped: {e}", flush=True)
                        continue
                turn = iter(range(1 << 30))
                fn = lambda: run(copies[next(turn) % len(copies)], x, out, **kw)  # noqa: E731
                ms = timed(fn, label)
                same = ms == ms and torch.equal(run(lin, x, out, **kw), ref)
                rows.append(_row("linear", name, m, label, ms, nbytes + 4 * m * (k + n),
                                 2 * m * n * k, copy_gbs, same))
    return rows


def moe_modes(copy_gbs: float, ts, tiles, maxnregs, dense_tiles, profile=False) -> list[dict]:
    g = torch.Generator(DEV).manual_seed(1)
    router = triton_linear.to_gpu_format(rand_q4(128, 2048, g))
    pairs = tuple((rand_q4(1536, 2048, g), rand_q4(2048, 768, g)) for _ in range(128))
    stacked = StackedExperts.stack(pairs)
    # a tile with another BK runs experts stacked with it (their split counts are counted in
    # its k steps; for these shapes they come out the same, so the bits should too)
    stacks = {stacked.tile.nb: stacked}
    for tl_, _ in tiles:
        if tl_.nb not in stacks:
            stacks[tl_.nb] = StackedExperts.stack(pairs, replace(stacked.tile, nb=tl_.nb))
    rows = []
    for t in ts:
        x, ids, _ = routed_tokens(t, router, g)
        nbytes = int(torch.unique(ids).numel()) * stacked.expert_nbytes()
        flops = 2 * t * 8 * 3 * 2048 * 768
        ref = None
        # (label, tile, seq, overrides of triton_moe's knobs for this mode)
        modes = [("split", stacked.tile, False, {})]
        if t <= triton_moe.DIRECT_MAX_TOKENS:  # the same, grouped by the align kernel first
            modes.append(("split grouped", stacked.tile, False, {"DIRECT_MAX_TOKENS": 0}))
        elif t <= 32:  # a slot per assignment instead of grouping, split and seq
            modes.append(("split direct", stacked.tile, False, {"DIRECT_MAX_TOKENS": t}))
            modes.append(("seq direct", stacked.tile, True, {"DIRECT_MAX_TOKENS": t}))
        modes += [(f"seq maxnreg {r or '-'}", stacked.tile, True,
                   {"SEQ_MAXNREG": r, "DOWN_MAXNREG": r}) for r in maxnregs]
        modes += [(f"{tl.name}{f'r{r}' if r else ''} seq", tl, True,
                   {"SEQ_MAXNREG": r, "DOWN_MAXNREG": r} if r else {}) for tl, r in tiles]
        modes += [(f"dense {tl.name}{' flat' if flat else ''}", tl, None, {"dense": True, "flat": flat})
                  for tl in dense_tiles for flat in (0, 1) if t >= 64]
        if t >= 64:  # k steps unrolled per loop iteration (3 = a split of down), 3 stages
            # (shared memory: 3 steps of a 64x128 tile x 4 stages would take 288 KB)
            gu3, down3 = (replace(c[0], stages=3) for c in (triton_moe.DENSE_GATE_UP,
                                                             triton_moe.DENSE_DOWN))
            modes.append(("dense gu 0, down flat3", None, None, {
                "dense": True, "DENSE_DOWN": (down3, 3)}))
            modes.append(("dense gu flat2, down flat3", None, None, {
                "dense": True, "DENSE_GATE_UP": (gu3, 2), "DENSE_DOWN": (down3, 3)}))
        modes.append(("plan", None, None, {}))
        for label, tile, seq, knobs in modes:
            inter = torch.empty(t * 8, 768, dtype=torch.float16, device=DEV)
            y = torch.empty(t * 8, 2048, device=DEV)
            kw = {k: knobs.pop(k) for k in ("dense", "flat") if k in knobs}
            default = {k: getattr(triton_moe, k) for k in knobs}
            for k, v in knobs.items():
                setattr(triton_moe, k, v)
            experts = stacks[tile.nb] if tile is not None else stacked
            fn = lambda: triton_moe.experts_forward(x, ids, experts, inter, y, tile, seq, **kw)  # noqa: E731
            ms = timed(fn, label)
            if profile and (label.startswith("dense") or label == "plan"):
                for name, (us, calls) in sorted(profile_calls(fn, 3).items(), key=lambda kv: -kv[1][0]):
                    print(f"    {us:>9.1f} µs {calls:>4.1f}x  {name[:80]}")
            for k, v in default.items():
                setattr(triton_moe, k, v)
            if ref is None:
                ref = y.clone()
            rows.append(_row("experts", "E128k8", t, label, ms, nbytes, flops, copy_gbs,
                             ms == ms and torch.equal(y, ref)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,8,64,256,1024,4096", help="rows of x (linear)")
    ap.add_argument("--ts", default="1,2,4,8,16,64,512", help="tokens (MoE experts, top-8)")
    ap.add_argument("--tiles", default="32x64x64w1s3,64x64x64w1s3,64x64x64w4s3,16x64x64w4s3t",
                    help="row tiles (BN and BK of the decode tile; a trailing t: the weights as "
                         "the MMA's A operand, linear only); a trailing rN caps the expert "
                         "kernels' registers at N for that tile")
    ap.add_argument("--maxnreg", default="0,128,112",
                    help="register caps of the seq expert kernels (0: the compiler's choice)")
    ap.add_argument("--dense-tiles", default="128x128x64w8s3,64x128x64w4s3",
                    help="many-warp fp16 tiles on the weights dequantized once (dense)")
    ap.add_argument("--kernels", action="store_true",
                    help="each dense expert mode's kernels, µs per call (torch.profiler)")
    ap.add_argument("--dense-from", type=int, default=256, help="rows from which dense modes run")
    ap.add_argument("--weights", default="qkv,o,router", help=f"linear weights, of {','.join(SHAPES)}")
    ap.add_argument("--cuda", action="store_true",
                    help="also the CUDA C++ forms (kernels/cuda_q4.py)")
    ap.add_argument("--cold", type=int, default=0,
                    help="linear: time over this many copies of each weight (none in L2)")
    ap.add_argument("--max-programs", type=int, default=None,
                    help="linear: weights split for this many programs (q4_layout.MAX_PROGRAMS; "
                         "other bits, for every path alike)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.max_programs:
        q4_layout.MAX_PROGRAMS = args.max_programs
    copy_gbs = copy_bandwidth()
    print(f"device copy: {copy_gbs:.0f} GB/s (read + write)", flush=True)
    # a tile may end in rN: the expert kernels' register cap for it (seq; e.g. 16x64x64w1s2r80)
    tiles = [(Q4Tile.parse(t.split("r")[0]), int(t.split("r")[1]) if "r" in t else 0)
             for t in args.tiles.split(",") if t]
    moe_tiles = [(t, r) for t, r in tiles if not t.swap]  # the expert kernels have no swapped form
    dense = [Q4Tile.parse(t) for t in args.dense_tiles.split(",") if t]
    rows = linear_modes(copy_gbs, [int(v) for v in args.ms.split(",") if v], [t for t, _ in tiles], dense,
                        args.weights.split(","), args.dense_from, args.cuda, args.cold)
    ts = [int(v) for v in args.ts.split(",") if v]
    if ts:  # --ts "": no MoE rows
        rows += moe_modes(copy_gbs, ts, moe_tiles,
                          [int(v) or None for v in args.maxnreg.split(",")], dense, args.kernels)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbs": copy_gbs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
