"""Where the paged decode attention's time goes inside the kernel, per program: each split
program stamps the global timer at entry, after its K / V prefetch, after the PDL wait, before
its key loop (context, q and the token's row loaded), after the loop and at its end (`TRACE`,
kernels/triton_attention.py). The launches run as in a decode step: a CUDA graph of LAYERS x
(q, attention, o + residual) with programmatic dependent launch, distinct weights and KV
pools per layer (more bytes than L2 holds), bf16 K / V, 16-key blocks, each token its own
stream with a block table of its own context (the table at least 32 blocks wide, as the
engine's first graph bucket). Prints, per context and token count, the phase times across the
attention's programs (median / max, µs), its span, and the gaps on the chain: from qkv's last
program end to the attention's first program past its wait, and from the attention's last end
to o's first program past its wait. Writes JSON. Not a test.

    python -m bench.attn_timeline [--contexts 128,2048,8192] [--tokens 1,8,64] [--layers 8]
        [--no-pdl] [--probes 0,1,2,3,4] [--json out.json]

--probes: the kernel again with parts of its key loop left out (`triton_attention.PROBE`,
wrong values except 4): 1 no dots, 2 no PV dot, 3 one MMA a dot, 4 no block-table load.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from bench.gpu_timeline import _stats, replay
from bench.kernel_bench import rand_q4
from kernels import q4_layout, triton_attention, triton_pdl, triton_q4

H, KVH, D, HIDDEN, BS = 32, 4, 128, 2048, 16  # the 30B-A3B preset's attention
PHASES = ("entry skew", "prefetch", "wait", "setup", "key loop", "store")
TABLE_MIN = 32  # blocks: the engine's first graph bucket


def _traces(n: int) -> torch.Tensor:
    return torch.zeros(n, 8, dtype=torch.int64, device="cuda")


def run(ctx: int, tokens: int, layers: int, g: torch.Generator) -> list[dict]:
    dev = "cuda"
    width = max(TABLE_MIN, -(-ctx // BS))
    qkv_n = H * D  # the q rows of qkv only: the attention takes q contiguous, with no copy
    blocks = tokens * width
    lays = []
    for _ in range(layers):
        kc = torch.randn(blocks, BS, KVH, D, generator=g, device=dev).to(torch.bfloat16)
        lays.append(dict(qkv=q4_layout.repack(rand_q4(qkv_n, HIDDEN, g)),
                         o=q4_layout.repack(rand_q4(HIDDEN, H * D, g)),
                         k=kc, v=torch.randn_like(kc, dtype=torch.float32).to(torch.bfloat16)))
    tables = torch.arange(blocks, dtype=torch.int32, device=dev).view(tokens, width)
    rows = torch.arange(tokens, dtype=torch.int32, device=dev)
    ctx_lens = torch.full((tokens,), ctx, dtype=torch.int32, device=dev)
    x = torch.randn(tokens, HIDDEN, generator=g, device=dev)
    qkv = torch.empty(tokens, qkv_n, device=dev)
    att = torch.empty(tokens, H, D, device=dev)
    y = torch.empty(tokens, HIDDEN, device=dev)
    splits = -(-width * BS // triton_attention.SPLIT)
    programs = tokens * KVH * splits
    big = -(-tokens // 16) * -(-qkv_n // 64) * q4_layout.MAX_SPLIT  # any q4 grid of these shapes
    traces = [dict(qkv=_traces(big), attn=_traces(programs), o=_traces(big)) for _ in lays]

    def step() -> None:
        for lay, tr in zip(lays, traces):
            triton_q4.linear(lay["qkv"], x, qkv, trace=tr["qkv"])
            triton_attention.paged_attention(qkv.view(tokens, H, D), lay["k"], lay["v"], tables,
                                             rows, ctx_lens, D ** -0.5, att, trace=tr["attn"])
            triton_q4.linear(lay["o"], att.view(tokens, H * D), y, residual=x, trace=tr["o"])

    replay(step)
    out = []
    for layer, tr in enumerate(traces[1:], 1):  # layer 0's first kernel waits on the graph start
        q4 = {k: tr[k].cpu() for k in ("qkv", "o")}
        q4 = {k: v[v[:, 0] > 0] for k, v in q4.items()}
        t = tr["attn"].cpu()
        t = t[t[:, 0] > 0]
        full = t[:, 5] > 0  # programs that ran keys
        t0, end = int(t[:, 0].min()), int(t[full, 5].max())
        r = dict(context=ctx, tokens=tokens, layer=layer, programs=int(t.shape[0]),
                 working=int(full.sum()), span_us=(end - t0) / 1e3,
                 gap_in_us=(int(t[:, 2].min()) - int(q4["qkv"][:, 4].max())) / 1e3,
                 gap_out_us=(int(q4["o"][:, 1].min()) - end) / 1e3)
        r["entry skew"] = _stats(t[:, 0] - t0)
        r["prefetch"] = _stats(t[:, 1] - t[:, 0])
        r["wait"] = _stats(t[:, 2] - t[:, 1])
        w = t[full]
        r["setup"] = _stats(w[:, 3] - w[:, 2])
        r["key loop"] = _stats(w[:, 4] - w[:, 3])
        r["store"] = _stats(w[:, 5] - w[:, 4])
        out.append(r)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="128,2048,8192")
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--no-pdl", action="store_true")
    ap.add_argument("--probes", default="0", help="triton_attention.PROBE values, in turn")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.no_pdl:
        triton_pdl.ENABLED = False
    g = torch.Generator("cuda").manual_seed(0)
    print(f"paged attention, bf16 K/V, SPLIT {triton_attention.SPLIT}, "
          f"{triton_attention.BLOCK_N_BF16}-key tiles, PDL {'off' if args.no_pdl else 'on'}; "
          "µs, median/max over programs (setup..store: programs with keys); gap in: q's last "
          "end to the first program past its wait; gap out: the last end to o's first past "
          "its wait")
    print(f"{'probe':>5} {'ctx':>6} {'T':>3} {'progs':>5} {'span':>6} {'gap in':>6} {'gap out':>7} "
          + " ".join(f"{c:>15}" for c in PHASES), flush=True)
    rows = []
    for probe, ctx, tokens in itertools.product((int(v) for v in args.probes.split(",")),
                                                (int(v) for v in args.contexts.split(",")),
                                                [int(v) for v in args.tokens.split(",")]):
        triton_attention.PROBE = probe
        try:
            got = run(ctx, tokens, args.layers, g)
        except torch.cuda.OutOfMemoryError as e:  # one size must not cost the rest
            print(f"{probe:>5} {ctx:>6} {tokens:>3} out of memory: {e}", flush=True)
            continue
        for r in got:
            r["probe"] = probe
            print(f"{probe:>5} {ctx:>6} {tokens:>3} {r['programs']:>5} {r['span_us']:6.2f} "
                  f"{r['gap_in_us']:6.2f} {r['gap_out_us']:7.2f} "
                  + " ".join(f"{r[c][0]:7.2f}/{r[c][1]:7.2f}" for c in PHASES), flush=True)
        rows += got
        torch.cuda.empty_cache()
    triton_attention.PROBE = 0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
