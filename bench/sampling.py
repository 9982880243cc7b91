"""A step's token picks side by side: `replica.sampling.pick` (all sampled rows at once, where
the logits are: the engine's path) against `sample` row by row on the host (the reference, and
what the engine ran before), at real vocabularies (SmolLM2 49,152; Qwen3 151,936). On CUDA the
row-by-row column includes each row's copy to the host, as the engine paid it. Both give the
same tokens on CPU (checked here, and in tests/replica/test_sampling.py); this measures only
time. On a device pick is one sort of the sampled rows' logits and the draw kernel
(kernels/triton_sample.py); --parts times the two apart. Prints a table and writes JSON. Not a
test.

    python -m bench.sampling [--device cpu|cuda] [--vocab 49152,151936] [--rows 1,8,64] [--parts]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from replica.sampling import SamplingParams, pick, sample

PARAMS = SamplingParams(temperature=0.8, top_p=0.9, seed=1)  # a chat client's usual settings


def ms_per_call(fn, sync, budget_s: float = 0.5) -> float:
    fn()
    sync()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < budget_s or n < 2:
        fn()
        n += 1
    sync()
    return (time.perf_counter() - t0) / n * 1e3


def parts(logits: torch.Tensor, sync) -> dict:
    """ms of pick's parts on these rows (all sampled at PARAMS): the stable sort of the logits,
    the draw on the sorted rows (on a device: kernels/triton_sample.py), and for comparison a
    top-1,024 candidate set (what could replace the sort only with a fallback for rows whose cut
    lies beyond it)."""
    n, v = logits.shape
    vals, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
    f64 = lambda x: torch.full((n,), x, dtype=torch.float64, device=logits.device)  # noqa: E731
    keep = torch.full((n,), v, dtype=torch.int64, device=logits.device)
    u = torch.linspace(0.01, 0.99, n, dtype=torch.float64, device=logits.device)
    ops = {"sort_f32": lambda: torch.sort(logits, dim=-1, descending=True, stable=True),
           "topk_f32_1024": lambda: torch.topk(logits, min(1024, v))}
    if logits.device.type != "cpu":
        from kernels import triton_sample

        ops["draw"] = lambda: triton_sample.draw(vals, ids, f64(PARAMS.temperature), keep, f64(PARAMS.top_p), u)
    return {name: ms_per_call(fn, sync, 0.05) for name, fn in ops.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vocab", default="49152,151936")
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--parts", action="store_true", help="also time pick's parts (ms)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    results = []
    print(f"token picks on {dev}: temperature {PARAMS.temperature}, top-p {PARAMS.top_p}; "
          f"ms per step (all rows sampled)")
    print("same: pick gives sample's tokens (on CUDA its masses are summed in another order)")
    print(f"{'vocab':>7} {'rows':>5} {'pick ms':>8} {'row by row ms':>13} {'ratio':>6} {'same':>5}")
    for v in (int(x) for x in args.vocab.split(",")):
        for n in (int(x) for x in args.rows.split(",")):
            logits = (torch.randn(n, v, generator=g) * 3).to(dev)
            argmax = torch.argmax(logits, dim=-1)
            rows = [(i, PARAMS, 100 + i) for i in range(n)]
            want = [sample(logits[i].cpu(), PARAMS, 100 + i) for i in range(n)]
            slow = ms_per_call(lambda: [sample(logits[i].cpu(), PARAMS, 100 + i) for i in range(n)], sync)
            fast = ms_per_call(lambda: pick(logits, argmax, rows), sync)
            row = dict(device=str(dev), vocab=v, rows=n, row_by_row_ms=slow, pick_ms=fast,
                       same_tokens=pick(logits, argmax, rows).tolist() == want)
            results.append(row)
            print(f"{v:>7} {n:>5} {fast:>8.2f} {slow:>13.2f} {slow / fast:>6.1f} {str(row['same_tokens']):>5}")
            if args.parts:
                row["parts_ms"] = parts(logits, sync)
                print("        parts ms: " + ", ".join(f"{k} {ms:.3f}" for k, ms in row["parts_ms"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
