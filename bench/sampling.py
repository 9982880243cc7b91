"""A step's token picks side by side: `replica.sampling.pick` (all sampled rows at once, where
the logits are: the engine's path) against `sample` row by row on the host (the reference, and
what the engine ran before), at real vocabularies (SmolLM2 49,152; Qwen3 151,936). On CUDA the
row-by-row column includes each row's copy to the host, as the engine paid it. Both give the
same tokens on CPU (checked here, and in tests/replica/test_sampling.py); this measures only
time. On a device pick is also timed with the draw kernel (replica/sampling.py DRAW_KERNEL,
kernels/triton_sample.py): the "kernel ms" column. Prints a table and writes JSON. Not a test.

    python -m bench.sampling [--device cpu|cuda] [--vocab 49152,151936] [--rows 1,8,64] [--parts]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from replica import sampling
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


def packed_keys(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] fp32 → [N, V] int64 keys ordered as `sample` orders tokens: the logit's
    order-preserving bits above the complement of the token id (unique keys, ties by id)."""
    bits = (logits + 0.0).contiguous().view(torch.int32).to(torch.int64)  # + 0.0: -0.0 → 0.0
    key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    ids = torch.arange(logits.shape[1], device=logits.device)
    return (key << 32) | (0xFFFFFFFF - ids)


def parts(logits: torch.Tensor, sync) -> dict:
    """ms of pick's parts, and of candidate sets that could replace its sort (GPU_NOTES Left
    undone 4), on these rows."""
    probs = torch.softmax(logits.double() / PARAMS.temperature, dim=-1)
    keys = packed_keys(logits)
    ops = {"softmax_f64": lambda: torch.softmax(logits.double() / PARAMS.temperature, dim=-1),
           "sort_f32": lambda: torch.sort(logits, dim=-1, descending=True, stable=True),
           "sort_f64": lambda: torch.sort(probs, dim=-1, descending=True, stable=True),
           "cumsum_f64": lambda: torch.cumsum(probs, dim=-1),
           "topk_f32_1024": lambda: torch.topk(logits, min(1024, logits.shape[1])),
           "packed_keys": lambda: packed_keys(logits),
           "topk_packed_64": lambda: torch.topk(keys, min(64, logits.shape[1])),
           "topk_packed_1024": lambda: torch.topk(keys, min(1024, logits.shape[1]))}
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
    kernel = dev.type != "cpu"  # on a device also pick with the draw kernel (DRAW_KERNEL)
    print(f"{'vocab':>7} {'rows':>5} {'pick ms':>8} {'row by row ms':>13} {'ratio':>6} {'same':>5}"
          + (f" {'kernel ms':>9} {'same':>5}" if kernel else ""))
    for v in (int(x) for x in args.vocab.split(",")):
        for n in (int(x) for x in args.rows.split(",")):
            logits = (torch.randn(n, v, generator=g) * 3).to(dev)
            argmax = torch.argmax(logits, dim=-1)
            rows = [(i, PARAMS, 100 + i) for i in range(n)]
            want = [sample(logits[i].cpu(), PARAMS, 100 + i) for i in range(n)]
            slow = ms_per_call(lambda: [sample(logits[i].cpu(), PARAMS, 100 + i) for i in range(n)], sync)
            row = dict(device=str(dev), vocab=v, rows=n, row_by_row_ms=slow)
            default = sampling.DRAW_KERNEL
            for on in (False, True) if kernel else (False,):
                sampling.DRAW_KERNEL = on
                key = "kernel" if on else "pick"
                row[f"{key}_ms"] = ms_per_call(lambda: pick(logits, argmax, rows), sync)
                row[f"{key}_same_tokens"] = pick(logits, argmax, rows).tolist() == want
            sampling.DRAW_KERNEL = default
            row["same_tokens"] = row["pick_same_tokens"]
            results.append(row)
            print(f"{v:>7} {n:>5} {row['pick_ms']:>8.2f} {slow:>13.2f} {slow / row['pick_ms']:>6.1f} "
                  f"{str(row['same_tokens']):>5}"
                  + (f" {row['kernel_ms']:>9.2f} {str(row['kernel_same_tokens']):>5}" if kernel else ""))
            if args.parts:
                row["parts_ms"] = parts(logits, sync)
                print("        parts ms: " + ", ".join(f"{k} {ms:.3f}" for k, ms in row["parts_ms"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
