"""A target for Nsight Compute (ncu): the engine's decode kernels at their shapes, a few plain
launches each — the q4 linear (qkv, o) at --ms rows (optionally also kernels/cuda_q4.py's
variants) and the MoE experts at --ts tokens. The first pass compiles and warms, the second
is the one to read. On the GPU machine, bench/ncu_probe.sh runs ncu over it and prints each
kernel's duration, occupancy, issue activity, DRAM / SM throughput and top stall reasons:

    OUT=dir PROBE_ARGS="--ms 1 --ts none --cuda 16x8" bash bench/ncu_probe.sh"""

from __future__ import annotations

import argparse

import torch

from bench.kernel_bench import rand_q4, routed_tokens
from kernels import cuda_q4, q4_layout, triton_linear, triton_moe
from kernels.moe_layout import StackedExperts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,64", help="rows of x for the q4 linears")
    ap.add_argument("--ts", default="1,64", help="tokens for the experts ('none': no experts)")
    ap.add_argument("--cuda", default="",
                    help="kernels/cuda_q4.py variants too: COLSxDEPTH,... (DEPTH 2-8, stream)")
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",") if v]
    g = torch.Generator("cuda").manual_seed(0)
    lins = [q4_layout.repack(rand_q4(n, k, g)) for n, k in ((5120, 2048), (2048, 4096))]
    router = triton_linear.to_gpu_format(rand_q4(128, 2048, g))
    stacked = StackedExperts.stack(tuple((rand_q4(1536, 2048, g), rand_q4(2048, 768, g))
                                         for _ in range(128)))
    routed = {int(t): routed_tokens(int(t), router, g) for t in args.ts.split(",") if t.isdigit()}
    forms = {"stream": cuda_q4.STREAM}
    variants = []  # (cols, depth)
    for spec in filter(None, args.cuda.split(",")):
        cols, depth = spec.split("x")
        variants.append((int(cols), forms[depth] if depth in forms else int(depth)))
    for _ in range(2):  # warm, then the pass to read
        for m in ms:
            for lin in lins:
                x = torch.randn(m, lin.in_features, generator=g, device="cuda")
                triton_linear.linear(lin, x, torch.empty(m, lin.out_features, device="cuda"))
                for cols, depth in variants:
                    cuda_q4.linear(lin, x, torch.empty(m, lin.out_features, device="cuda"),
                                   cols=cols, depth=depth)
        for t, (x, ids, _) in routed.items():
            inter = torch.empty(t * 8, 768, dtype=torch.float16, device="cuda")
            y = torch.empty(t * 8, 2048, device="cuda")
            triton_moe.experts_forward(x, ids, stacked, inter, y)
        torch.cuda.synchronize()
    print("ncu probe done", flush=True)


if __name__ == "__main__":
    main()
