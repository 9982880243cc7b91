"""Where a q4 GEMM's time goes inside the kernel, per program: each program of the q4 linear
kernel stamps the global timer at entry, after the PDL wait, after its K loop, after its
split-K ticket (the last program: after summing the partials) and at its end
(`TRACE`, kernels/triton_pdl.py `stamp`). The launches run as in a decode step: a CUDA graph
of LAYERS x (qkv, o + residual, router) at M rows, distinct weights per layer (more bytes than
L2 holds), programmatic dependent launch as the engine has it. Prints, per weight, the phase
times across programs (median and max, µs) and the kernel's span; writes JSON. Not a test.

    python -m bench.gpu_timeline [--ms 1,64] [--layers 8] [--no-pdl] [--max-programs 512]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.kernel_bench import rand_q4
from kernels import q4_layout, triton_pdl, triton_q4

SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096), "router": (128, 2048)}
PHASES = ("entry skew", "wait", "K loop", "ticket+sum", "epilogue")


def _stats(v: torch.Tensor) -> tuple[float, float]:
    v = v.double() / 1e3  # ns → µs
    return float(v.median()), float(v.max())


def replay(step, times: int = 5) -> None:
    """step() once eagerly (compiles), then captured into a CUDA graph and replayed `times`
    times, synchronized: the traces hold the last replay's stamps."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(times):
        graph.replay()
    torch.cuda.synchronize()


def run(m: int, layers: int, g: torch.Generator) -> list[dict]:
    dev = "cuda"
    lins = [{name: q4_layout.repack(rand_q4(n, k, g)) for name, (n, k) in SHAPES.items()}
            for _ in range(layers)]
    x = torch.randn(m, 2048, generator=g, device=dev)
    a = torch.randn(m, 4096, generator=g, device=dev)
    outs = {name: torch.empty(m, n, device=dev) for name, (n, _) in SHAPES.items()}
    res = torch.empty(m, 2048, device=dev)
    # room for any grid of these shapes (16-row tiles x 64 columns x 16 splits at most); the
    # rows a launch's programs did not stamp stay zero and are dropped below
    traces = [{name: torch.zeros(-(-m // 16) * -(-n // 64) * q4_layout.MAX_SPLIT, 8,
                                 dtype=torch.int64, device=dev)
               for name, (n, _) in SHAPES.items()} for _ in lins]

    def step() -> None:
        for ls, tr in zip(lins, traces):
            triton_q4.linear(ls["qkv"], x, outs["qkv"], trace=tr["qkv"])
            triton_q4.linear(ls["o"], a, outs["o"], residual=res, trace=tr["o"])
            triton_q4.linear(ls["router"], x, outs["router"], trace=tr["router"])

    replay(step)
    rows, prev_end = [], None
    for layer, tr in enumerate(traces):
        for name in SHAPES:
            t = tr[name].cpu()
            t = t[t[:, 0] > 0]  # the launch's programs
            t0 = int(t[:, 0].min())
            end = int(t[:, 4].max())
            last = t[:, 3] > 0  # the programs that summed the partials (split weights)
            r = dict(m=m, layer=layer, weight=name, programs=t.shape[0],
                     sms=int(t[:, 7].unique().numel()), span_us=(end - t0) / 1e3,
                     gap_us=None if prev_end is None else (int(t[:, 1].min()) - prev_end) / 1e3)
            r["entry skew"] = _stats(t[:, 0] - t0)
            r["wait"] = _stats(t[:, 1] - t[:, 0])
            r["K loop"] = _stats(t[:, 2] - t[:, 1]) if int(t[:, 2].min()) > 0 else (0.0, 0.0)
            r["ticket+sum"] = _stats(t[last, 3] - t[last, 2]) if last.any() else (0.0, 0.0)
            r["ticket (not last)"] = _stats(t[~last, 4] - t[~last, 2]) if (~last).any() \
                and int(t[:, 2].min()) > 0 else (0.0, 0.0)
            r["epilogue"] = _stats(t[last, 4] - t[last, 3]) if last.any() else (0.0, 0.0)
            rows.append(r)
            prev_end = end
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,64")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--no-pdl", action="store_true")
    ap.add_argument("--max-programs", type=int, default=None,
                    help="re-split the weights for this many programs at M = 1 "
                         "(q4_layout.MAX_PROGRAMS; the split changes the bits)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.no_pdl:
        triton_pdl.ENABLED = False
    if args.max_programs:
        q4_layout.MAX_PROGRAMS = args.max_programs
    g = torch.Generator("cuda").manual_seed(0)
    out = []
    cols = PHASES + ("ticket (not last)",)
    print(f"MAX_PROGRAMS {q4_layout.MAX_PROGRAMS}; PDL {'off' if args.no_pdl else 'on'}; µs, median/max over programs; gap: from the "
          f"previous kernel's last end to this kernel's first program past the wait")
    print(f"{'M':>4} {'weight':<7} {'progs':>5} {'SMs':>4} {'span':>6} {'gap':>6} "
          + " ".join(f"{c:>17}" for c in cols))
    for m in (int(v) for v in args.ms.split(",")):
        rows = run(m, args.layers, g)
        for r in rows[3:]:  # layer 0's first kernels wait on the graph's start
            gap = f"{r['gap_us']:6.2f}" if r["gap_us"] is not None else "     -"
            print(f"{m:>4} {r['weight']:<7} {r['programs']:>5} {r['sms']:>4} {r['span_us']:6.2f} {gap} "
                  + " ".join(f"{r[c][0]:8.2f}/{r[c][1]:8.2f}" for c in cols), flush=True)
        out += rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
