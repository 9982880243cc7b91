"""The persistent chain against the per-op launches, on the GPU: P q4 linears in a row at 1-8
rows (x → y_0 → y_1 ..., alternately 2,048 → 4,096 and 4,096 → 2,048 features: o's shape and
one as heavy the other way; every phase its own weights, 226 MB in all at P = 48, so none is in
L2 when its turn comes) — as the engine runs them today (cuda_q4.linear's CTA form a launch
each, PDL, in a CUDA graph) and as one persistent launch (cuda_q4.chain: each CTA streams
its next phase's weights into shared memory while the phase before finishes, the phases
ordered by counters in global memory). Prints µs a phase, the weight bandwidth, its share of
a device copy and whether the two give the same bits in every phase. What a kernel boundary
costs on the one-token chain, and what keeping the weights in flight across it buys — the
question before a persistent kernel a layer (kernels/GPU_NOTES.md v26, Next 1). Two chains:
weights streamed into shared memory a phase ahead, or today's register ring (its first blocks'
weights before the wait) — each with its probes: counters polled without the sleep, and no
waits at all (wrong values: the phases' own cost). Not a test.

    python -m bench.chain_probe [--phases 48] [--rows 1,8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.kernel_bench import copy_bandwidth, rand_q4, time_ms
from kernels import cuda_q4, q4_layout
from kernels.linear import Linear

DEV = "cuda"
SHAPES = ((4096, 2048), (2048, 4096))  # (out, in), alternating


def _centred(lin: Linear) -> Linear:
    """lin's nibbles centred on zero (min -7.5 scales, rounded to fp16 as stored): a chain of 48
    of rand_q4's (min -8 scales) grows its mean ~5x a phase and overflows fp16 by phase 8."""
    return Linear.q4(lin.qs, lin.scale, (-7.5 * lin.scale).half().float())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phases", type=int, default=48)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--json")
    a = ap.parse_args()
    copy_gbs = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbs:.0f} GB/s", flush=True)
    g = torch.Generator(DEV).manual_seed(0)
    lins = [q4_layout.repack(_centred(rand_q4(*SHAPES[p % 2], g))) for p in range(a.phases)]
    nbytes = sum(lin.qs.nbytes + lin.sm.nbytes for lin in lins)
    print(f"{a.phases} phases, splits {sorted({lin.split for lin in lins})}, "
          f"{nbytes / 1e6:.0f} MB of weights", flush=True)
    rows = []
    for m in (int(r) for r in a.rows.split(",")):
        x = torch.randn(m, SHAPES[0][1], generator=g, device=DEV)
        per_op = [torch.empty(m, lin.out_features, device=DEV) for lin in lins]
        chained = [torch.empty(m, lin.out_features, device=DEV) for lin in lins]
        desc = cuda_q4.chain_desc(lins, chained)
        done = torch.zeros(len(lins), dtype=torch.int32, device=DEV)

        def ops():
            prev = x
            for lin, y in zip(lins, per_op):
                prev = cuda_q4.linear(lin, prev, y)

        def chain(probe=0, ring=False):
            done.zero_()
            cuda_q4.chain(lins, x, desc, done, probe, ring)

        found = {}
        for name, fn in (("per-op (CTA form, PDL)", ops),
                         ("chain (shared memory)", chain),
                         ("  shared: polls unslept", lambda: chain(1)),
                         ("  shared: no waits (wrong)", lambda: chain(2)),
                         ("chain (register ring)", lambda: chain(0, True)),
                         ("  ring: polls unslept", lambda: chain(1, True)),
                         ("  ring: no waits (wrong)", lambda: chain(2, True))):
            try:
                found[name] = time_ms(fn, reps=5, iters=15)
            except Exception as e:  # noqa: BLE001 - reported, the others go on
                print(f"{name} at {m} rows failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        ops()
        same = True
        for ring in (False, True):  # each chain's bits against the per-op path's, every phase
            for y in chained:
                y.fill_(float("nan"))
            chain(0, ring)
            torch.cuda.synchronize()
            same = same and all(torch.equal(u, v) and bool(u.isfinite().all())
                                for u, v in zip(per_op, chained))
        for name, ms in found.items():
            us = 1e3 * ms / len(lins)
            gbs = nbytes / ms / 1e6
            print(f"{m:>2} rows  {name:<27} {us:>7.2f} µs a phase  {gbs:>6.0f} GB/s  "
                  f"{100 * gbs / copy_gbs:>5.1f}% of copy", flush=True)
            rows.append(dict(rows=m, mode=name.strip(), us_per_phase=us, gbs=gbs,
                             pct_copy=100 * gbs / copy_gbs, bits_equal=same))
        print(f"{m:>2} rows  both chains: the per-op path's finite bits in every phase: "
              f"{'yes' if same else 'NO'} "
              f"(last |y| max {per_op[-1].abs().max().item():.3g})", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_gbs=copy_gbs, rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
