"""Where the x-staged kernels (kernels/cuda_xs.py) differ from the programs whose bits they
must give, when they do: for each case, whether the bits are equal, how many outputs were
left unwritten (the outputs start as NaN), how many rows and columns differ, the largest
difference, the relative error against a float64 reference, and the first differing place.
A device call that finds a bit test failing prints this beside it, so the next change does
not need another call to learn what kind of failure it was. Not a test.

    python -m bench.xs_diag [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.kernel_bench import rand_q4, routed_tokens
from kernels import cuda_xs, triton_linear, triton_moe, triton_moe_route, triton_q4
from kernels.moe_layout import StackedExperts

DEV = "cuda"


def compare(label: str, got: torch.Tensor, want: torch.Tensor, exact: torch.Tensor) -> dict:
    """One case's line: got against want (the bits' judge) and exact (float64)."""
    unwritten = int(torch.isnan(got).sum()) - int(torch.isnan(want).sum())
    g, w = got.double(), want.double()
    diff = (g - w).abs()
    bad = (diff.nan_to_num(float("inf")) != 0) & ~(torch.isnan(g) & torch.isnan(w))
    both = bad & torch.isfinite(diff)
    rows = bad.any(1).nonzero().flatten().tolist()
    cols = bad.any(0).nonzero().flatten().tolist()
    first = tuple(bad.nonzero()[0].tolist()) if rows else None
    finite = torch.isfinite(g)
    rel = float(((g - exact).abs()[finite].norm() / exact[finite].norm().clamp_min(1e-30))) \
        if finite.any() else float("nan")
    row = {"case": label, "equal": bool(torch.equal(got, want)), "unwritten": unwritten,
           "rows_off": len(rows), "cols_off": len(cols),
           "max_diff": float(diff[both].max()) if both.any() else 0.0, "rel_err": rel,
           "first": first, "rows": rows[:8]}
    print(f"{label:<44} {'equal' if row['equal'] else 'DIFFER':<7} unwritten {unwritten:>7} "
          f"rows {len(rows):>4} cols {len(cols):>5} max {row['max_diff']:.3g} rel {rel:.3g} "
          f"first {first} rows {rows[:8]}", flush=True)
    return row


def linear_cases(g: torch.Generator) -> list[dict]:
    out = []
    for name, (n, k) in (("qkv", (5120, 2048)), ("o", (2048, 4096)), ("router", (128, 2048))):
        base = rand_q4(n, k, g)
        w = base.dequantize().double()
        lin = triton_linear.to_gpu_format(base)
        x = torch.randn(64, k, generator=g, device=DEV)
        res = torch.randn(64, n, generator=g, device=DEV)
        for rows in (9, 16, 17, 40, 64):
            xr = x[:rows]
            if not cuda_xs.fits(lin, xr, torch.empty(rows, n, device=DEV)):
                print(f"xs {name} {rows}: not taken (fits says no)", flush=True)
                continue
            want = triton_q4.linear(lin, xr, torch.full((rows, n), float("nan"), device=DEV),
                                    residual=res[:rows])
            got = cuda_xs.linear(lin, xr, torch.full((rows, n), float("nan"), device=DEV),
                                 residual=res[:rows])
            exact = res[:rows].double() + xr.double() @ w.T
            out.append(compare(f"xs {name} s{lin.split} rows {rows}", got, want, exact))
    return out


def expert_cases(g: torch.Generator) -> list[dict]:
    router = triton_linear.to_gpu_format(rand_q4(128, 2048, g))
    pairs = tuple((rand_q4(1536, 2048, g), rand_q4(2048, 768, g)) for _ in range(128))
    stacked = StackedExperts.stack(pairs)
    out = []
    for t, rows, depth, tiles in ((9, 16, 8, 1), (16, 16, 8, 2), (64, 16, 8, 2), (64, 32, 4, 3),
                                  (64, 16, 2, 1)):
        x, ids, _ = routed_tokens(t, router, g)
        ids = ids.to(torch.int32).contiguous()
        if not cuda_xs.experts_fit(stacked, x, t):
            print(f"xe {t}: not taken (experts_fit says no)", flush=True)
            continue
        want_i = torch.full((t * 8, 768), float("nan"), device=DEV).half()
        want_y = torch.full((t * 8, 2048), float("nan"), device=DEV)
        triton_moe.experts_forward(x, ids, stacked, want_i, want_y)
        meta, arows = triton_moe_route.align(ids, 128)
        got_i, got_y = torch.full_like(want_i, float("nan")), torch.full_like(want_y, float("nan"))
        cuda_xs.experts_grouped(x, meta, arows, 8, stacked, got_i, got_y, rows, depth, tiles)
        tag = f"t{t} r{rows} d{depth} t{tiles} (slots {int(meta[0])})"
        out.append(compare(f"xe gate_up {tag}", got_i.float(), want_i.float(), want_i.double()))
        out.append(compare(f"xe down {tag}", got_y, want_y, want_y.double()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    a = ap.parse_args()
    g = torch.Generator(DEV).manual_seed(11)
    rows = []
    for part in (linear_cases, expert_cases):
        try:
            rows += part(g)
        except Exception as e:  # a launch error names itself; the other part still runs
            print(f"{part.__name__}: {type(e).__name__}: {e}", flush=True)
            torch.cuda.synchronize()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
