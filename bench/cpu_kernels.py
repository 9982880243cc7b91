"""CPU linear kernels side by side: the library as built on this machine (on AVX2: the
intrinsics tile) against the portable vector tile (-DFS_GENERIC_TILES), at the embedded
SmolLM2-135M's shapes and formats (q4 layers, the q8 tied embedding as lm_head), 1 / 4 / 64 rows. Both compute the same bits (checked here
and in tests/kernels/test_cpu_kernels.py); this measures only speed. Prints a table and writes
JSON. Not a test.

    python -m bench.cpu_kernels [--json out.json] [--rows 1,4,64]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kernels import cpu
from kernels.linear import quantize_q4, quantize_q8

SHAPES = {"qkv q4 960x576": (960, 576, quantize_q4), "gate_up q4 3072x576": (3072, 576, quantize_q4),
          "down q4 576x1536": (576, 1536, quantize_q4), "lm_head q8 49152x576": (49152, 576, quantize_q8)}


def ms_per_call(fn, budget_s: float = 0.5) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < budget_s or n < 3:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--rows", default="1,4,64")
    args = ap.parse_args()
    generic = cpu.build_library(("FS_GENERIC_TILES",))
    g = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'shape':<22} {'rows':>4} {'built ms':>9} {'generic ms':>10} {'speedup':>8} {'GFLOP/s':>8}")
    for name, (n, k, quantize) in SHAPES.items():
        lin = quantize(torch.randn(n, k, generator=g))
        for m in (int(v) for v in args.rows.split(",")):
            x = torch.randn(m, k, generator=g)
            assert torch.equal(cpu.linear(lin, x), cpu.linear(lin, x, lib=generic)), name
            built = ms_per_call(lambda: cpu.linear(lin, x))
            portable = ms_per_call(lambda: cpu.linear(lin, x, lib=generic))
            r = dict(shape=name, rows=m, built_ms=built, generic_ms=portable,
                     speedup=portable / built, gflops=2 * m * n * k / built / 1e6)
            rows.append(r)
            print(f"{name:<22} {m:>4} {built:>9.3f} {portable:>10.3f} {r['speedup']:>7.1f}x "
                  f"{r['gflops']:>8.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
