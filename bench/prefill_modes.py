"""Prefill attention call forms on the GPU, at the 30B preset's attention shape (32 query heads,
4 KV heads, head dim 128, bf16): the time of a step's chunks, the kernels each form launches,
and whether a row's bits depend on what else is in the call (they may not: that is the
engine's invariance).

Forms, for a step's chunks (each: a stream's positions [start, start + n) over its keys):
  pieces   kernels.prefill today: a FlashAttention call per PIECE-query piece per stream
  region   one call per stream over the chunk's PIECE-aligned region (FlashAttention picks
           its K split from the call's shape: the bits check says whether that moves a row)
  varlen   one call for all streams' regions, packed, with cumulative lengths

Bits: every stream's rows again from calls holding other things (the region: one piece wider
or narrower; varlen: the stream alone, and with the other streams in another order), compared
with torch.equal. Not a test (a test asserts; this measures):

    python -m bench.prefill_modes [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from kernels.prefill import PIECE

H, KVH, D = 32, 4, 128
SCALE = D ** -0.5
# (label, [(start, n), ...]): chunks of one engine step
SCENARIOS = [
    ("8 x 1,024 late", [(4096 + 137 * i, 1024) for i in range(8)]),
    ("6,581 + 1,611 first", [(0, 6581), (0, 1611)]),
    ("2 x 4,096 late", [(4096, 2485), (2485, 4096)]),
    ("1 x 300 at 6,000", [(6000, 300)]),
    ("8 x 1 at 6,581", [(6581 + i, 1) for i in range(8)]),
]


def _sdpa(q, k, v):
    """[Lq, H, D], [Lk, KVH, D] → [Lq, H, D]: causal aligned to the last key."""
    o = torch.ops.aten._scaled_dot_product_flash_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], 0.0, True,
        False, scale=SCALE)[0]
    return o[0].transpose(0, 1)


def region_of(start: int, n: int, extra: int = 0) -> tuple[int, int]:
    """PIECE-aligned [lo, hi) of a chunk's queries, `extra` pieces earlier (clamped at 0)."""
    first, last = start // PIECE, (start + n - 1) // PIECE
    return max(0, first - extra) * PIECE, (last + 1) * PIECE


def pieces(qs, ks, vs, chunks):
    outs = []
    for q, k, v, (start, n) in zip(qs, ks, vs, chunks):
        out = torch.empty(n, H, D, dtype=q.dtype, device=q.device)
        lo0, hi0 = region_of(start, n)
        for lo in range(lo0, hi0, PIECE):
            o = _sdpa(q[lo: lo + PIECE], k[: lo + PIECE], v[: lo + PIECE])
            a, b = max(start, lo), min(start + n, lo + PIECE)
            out[a - start: b - start] = o[a - lo: b - lo]
        outs.append(out)
    return outs


def region(qs, ks, vs, chunks, extra=0):
    outs = []
    for q, k, v, (start, n) in zip(qs, ks, vs, chunks):
        lo, hi = region_of(start, n, extra)
        outs.append(_sdpa(q[lo:hi], k[:hi], v[:hi])[start - lo: start - lo + n])
    return outs


def varlen(qs, ks, vs, chunks, order=None):
    order = list(range(len(chunks))) if order is None else order
    regions = [region_of(*chunks[i]) for i in order]
    q = torch.cat([qs[i][lo:hi] for i, (lo, hi) in zip(order, regions)])
    k = torch.cat([ks[i][:hi] for i, (lo, hi) in zip(order, regions)])
    v = torch.cat([vs[i][:hi] for i, (lo, hi) in zip(order, regions)])
    lq = [hi - lo for lo, hi in regions]
    lk = [hi for lo, hi in regions]
    dev = q.device
    cq = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    ck = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    o = torch.ops.aten._flash_attention_forward(q, k, v, cq, ck, max(lq), max(lk), 0.0, True,
                                                False, scale=SCALE)[0]
    outs = [None] * len(chunks)
    off = 0
    for i, (lo, hi) in zip(order, regions):
        start, n = chunks[i]
        outs[i] = o[off + start - lo: off + start - lo + n]
        off += hi - lo
    return outs


def timed(fn, iters=10) -> float:
    fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def kernels_of(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = sorted({e.key for e in prof.key_averages() if e.device_type.name == "CUDA"})
    return [n[:70] for n in names if "flash" in n.lower() or "combine" in n.lower()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    print("torch", torch.__version__, "SMs", torch.cuda.get_device_properties(0).multi_processor_count)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for label, chunks in SCENARIOS:
        ends = [region_of(s, n)[1] for s, n in chunks]
        qs = [torch.randn(e, H, D, device="cuda", generator=g).to(torch.bfloat16) for e in ends]
        ks = [torch.randn(e, KVH, D, device="cuda", generator=g).to(torch.bfloat16) for e in ends]
        vs = [torch.randn(e, KVH, D, device="cuda", generator=g).to(torch.bfloat16) for e in ends]
        ref = pieces(qs, ks, vs, chunks)
        flops = sum(4 * n * (s + n / 2) * H * D for s, n in chunks)
        forms = {"pieces": lambda: pieces(qs, ks, vs, chunks),
                 "region": lambda: region(qs, ks, vs, chunks),
                 "varlen": lambda: varlen(qs, ks, vs, chunks)}
        for name, fn in forms.items():
            try:
                ms = timed(fn)
                outs = fn()
            except RuntimeError as e:
                print(f"{label:<22} {name:<7} failed: {str(e).splitlines()[0][:100]}")
                continue
            err = max(float((o.float() - r.float()).abs().max()) for o, r in zip(outs, ref))
            bits = {}
            if name == "region":
                for extra in (1, 2):
                    other = region(qs, ks, vs, chunks, extra)
                    bits[f"wider{extra}"] = all(torch.equal(a, b) for a, b in zip(outs, other))
            if name == "varlen":
                alone = [varlen([q], [k], [v], [c])[0] for q, k, v, c in zip(qs, ks, vs, chunks)]
                bits["alone"] = all(torch.equal(a, b) for a, b in zip(outs, alone))
                rev = varlen(qs, ks, vs, chunks, order=list(reversed(range(len(chunks)))))
                bits["reordered"] = all(torch.equal(a, b) for a, b in zip(outs, rev))
                reg = region(qs, ks, vs, chunks)
                bits["=region"] = all(torch.equal(a, b) for a, b in zip(outs, reg))
            row = dict(scenario=label, form=name, ms=ms, tflops=flops / ms / 1e9,
                       max_diff_vs_pieces=err, bits=bits, kernels=kernels_of(fn))
            rows.append(row)
            print(f"{label:<22} {name:<7} {ms:8.3f} ms {row['tflops']:6.0f} TFLOP/s "
                  f"|diff| {err:.2e} bits {bits} kernels {row['kernels']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
