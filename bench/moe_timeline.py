"""The direct MoE layer at 1-7 tokens, three kernels against one fused launch
(`triton_moe.FUSED`) and against the CUDA CTA form of the experts (`triton_moe.CUDA_MAX_TOKENS`),
on the GPU: the layer's time in a CUDA graph of LAYERS layers (distinct
weights, more bytes than L2 holds; routing included, and timed alone), then the fused launch's
per-item timeline (`_moe_fused_kernel` TRACE): when items are claimed, when their inputs are
ready, when they end, by phase (gate_up, down, combine), relative to the launch's first entry.
Prints tables, writes JSON. Not a test.

    python -m bench.moe_timeline [--ts 1,4] [--layers 8] [--mode pdl_eprefetch8] [--claimed]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.ab_modes import apply
from bench.gpu_timeline import replay
from bench.kernel_bench import rand_q4, routed_tokens, time_ms
from kernels import moe_layout, triton_linear, triton_moe, triton_moe_route

PHASES = ("gate_up", "down", "combine")


def _layers(n: int, g: torch.Generator):
    router = triton_linear.to_gpu_format(rand_q4(128, 2048, g))
    layers = [moe_layout.StackedExperts.stack(
        tuple((rand_q4(1536, 2048, g), rand_q4(2048, 768, g)) for _ in range(128)))
        for _ in range(n)]
    return router, layers


def time_layers(router, layers, t: int, g) -> dict:
    """ms per layer: routing alone, the three kernels, fused, fused without down's prefetch."""
    x, ids, wts = routed_tokens(t, router, g)
    res = torch.randn_like(x)
    out = {"route": time_ms(lambda: [triton_moe_route.route(x, router, 8, True, ids, wts)
                                     for _ in layers], reps=4) / len(layers)}
    saved = triton_moe.FUSED, triton_moe.FUSED_STATIC, triton_moe.CUDA_MAX_TOKENS
    for name, knobs in (("3 kernels", (False, False, None)), ("fused claimed", (True, False, None)),
                        ("fused static", (True, True, None)),
                        ("CUDA CTA experts + combine", (False, False, 8))):
        triton_moe.FUSED, triton_moe.FUSED_STATIC, triton_moe.CUDA_MAX_TOKENS = knobs
        try:
            out[name] = time_ms(lambda: [triton_moe.moe(x, router, st, 8, True, res)
                                         for st in layers], reps=4) / len(layers)
        finally:
            triton_moe.FUSED, triton_moe.FUSED_STATIC, triton_moe.CUDA_MAX_TOKENS = saved
    return out


def timeline(router, layers, t: int, g, static: bool) -> list[dict]:
    """Per layer and phase: items, SMs, claim / ready / end times (µs from the launch's first
    entry: median, max) of one graph replay; static: FUSED_STATIC's persistent grid."""
    saved, triton_moe.FUSED_STATIC = triton_moe.FUSED_STATIC, static
    try:
        return _timeline(router, layers, t, g)
    finally:
        triton_moe.FUSED_STATIC = saved


def _timeline(router, layers, t: int, g) -> list[dict]:
    x, ids, wts = routed_tokens(t, router, g)
    res = torch.randn_like(x)
    n_gu, n_dn, n_cb = triton_moe.fused_items(t, 8, layers[0])
    traces = [torch.zeros(n_gu + n_dn + n_cb, 8, dtype=torch.int64, device="cuda")
              for _ in layers]

    def step():
        for st, tr in zip(layers, traces):
            triton_moe_route.route(x, router, 8, True, ids, wts)
            triton_moe._fused(x, ids, wts, st, res, trace=tr)

    replay(step, 3)
    rows, prev_end = [], None
    for layer, tr in enumerate(traces):
        tr = tr.cpu().double()
        t0 = float(tr[:, 3].min())
        end = float(tr[:, 2].max())
        bounds = (0, n_gu, n_gu + n_dn, n_gu + n_dn + n_cb)
        r = dict(t=t, layer=layer, span_us=(end - t0) / 1e3, items=tr.shape[0],
                 entry_spread_us=(float(tr[:, 3].max()) - t0) / 1e3,
                 gap_us=None if prev_end is None else (t0 - prev_end) / 1e3)
        for name, lo, hi in zip(PHASES, bounds, bounds[1:]):
            p = tr[lo:hi]
            stat = lambda v: (float(v.median()) / 1e3, float(v.max()) / 1e3)  # noqa: E731
            r[name] = dict(items=hi - lo, sms=int(p[:, 7].unique().numel()),
                           claimed=stat(p[:, 0] - t0), ready=stat(p[:, 1] - t0) if name != "gate_up"
                           else None, end=stat(p[:, 2] - t0), first_end=float(p[:, 2].min() - t0) / 1e3)
        rows.append(r)
        prev_end = end
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", default="1,4")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--mode", default="pdl", help="knobs to set first (bench/ab_modes.py)")
    ap.add_argument("--claimed", action="store_true",
                    help="the timeline of the claimed-item launch (default: FUSED_STATIC's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    apply(args.mode)
    g = torch.Generator("cuda").manual_seed(0)
    router, layers = _layers(args.layers, g)
    out = {"times": [], "timeline": []}
    for t in (int(v) for v in args.ts.split(",")):
        times = time_layers(router, layers, t, g)
        print(f"t={t}: µs a layer " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in times.items()),
              flush=True)
        out["times"].append(dict(t=t, **times))
        rows = timeline(router, layers, t, g, not args.claimed)
        print_timeline(t, not args.claimed, rows)
        out["timeline"] += [dict(r, static=not args.claimed) for r in rows]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def print_timeline(t: int, static: bool, rows: list[dict]) -> None:
    print(f"t={t} fused ({'static' if static else 'claimed'}) timeline, µs from the launch's "
          "first entry (median/max over items)")
    for r in rows[1:4]:
        gap = f"{r['gap_us']:.2f}" if r["gap_us"] is not None else "-"
        print(f"  layer {r['layer']}: span {r['span_us']:.2f}, gap {gap}, entries spread "
              f"{r['entry_spread_us']:.2f}")
        for name in PHASES:
            p = r[name]
            ready = f"ready {p['ready'][0]:6.2f}/{p['ready'][1]:6.2f} " if p["ready"] else " " * 20
            print(f"    {name:<8} {p['items']:>5} items {p['sms']:>3} SMs claimed "
                  f"{p['claimed'][0]:6.2f}/{p['claimed'][1]:6.2f} {ready}end "
                  f"{p['first_end']:6.2f}..{p['end'][0]:6.2f}/{p['end'][1]:6.2f}", flush=True)


if __name__ == "__main__":
    main()
