"""What one dependency costs on the GPU, the two ways a decode step can carry it: a kernel
boundary (a chain of near-empty kernels in a CUDA graph, with and without programmatic
dependent launch, 1 or 132 programs each) and a flag handed between two programs of one
launch (a ping-pong through global memory: release add, then polls by volatile loads or by
atomics). The persistent decode kernel's budget (kernels/GPU_NOTES.md) counts on the second
being well under the first. Prints a table, writes JSON. Not a test.

    python -m bench.hop_latency [--rounds 2000] [--chain 400] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from bench.prefill_modes import timed
from kernels import triton_pdl
from kernels.triton_pdl import pdl_wait


@triton.jit
def _noop_kernel(ptr, PDL: tl.constexpr):
    pdl_wait(PDL)
    tl.store(ptr + tl.program_id(0), 1)


@triton.jit
def _ping_pong_kernel(flags_ptr, rounds, ATOMIC_POLL: tl.constexpr):
    """Programs 0 and 1 take turns: program p waits until flag[1 - p] (its own cache line)
    reaches its round, then advances flag[p]; 2 x rounds hand-overs in all."""
    p = tl.program_id(0)
    mine = flags_ptr + p * 32
    theirs = flags_ptr + (1 - p) * 32
    for r in range(rounds):
        want = r + p  # program 0 goes first
        if ATOMIC_POLL:
            seen = tl.atomic_add(theirs, 0, sem="acquire")
            while seen < want:
                seen = tl.atomic_add(theirs, 0, sem="acquire")
        else:
            seen = tl.load(theirs, volatile=True)
            while seen < want:
                seen = tl.load(theirs + seen * 0, volatile=True)
            tl.atomic_add(theirs, 0, sem="acquire")  # orders what follows after the flag
        tl.atomic_add(mine, 1, sem="release")


def kernel_chain(n: int, programs: int, pdl: bool) -> float:
    """µs a kernel in a graph of n near-empty kernels of `programs` programs."""
    buf = torch.zeros(programs, dtype=torch.int32, device="cuda")
    opts = dict(PDL=pdl, launch_pdl=pdl)
    _noop_kernel[(programs,)](buf, **opts)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            _noop_kernel[(programs,)](buf, **opts)
    return timed(graph.replay) * 1e3 / n


def ping_pong(rounds: int, atomic_poll: bool) -> float:
    """µs a hand-over between two programs of one launch."""
    flags = torch.zeros(64, dtype=torch.int32, device="cuda")

    def run():
        flags.zero_()
        _ping_pong_kernel[(2,)](flags, rounds, ATOMIC_POLL=atomic_poll)

    ms = timed(run)
    assert int(flags[0]) == rounds and int(flags[32]) == rounds
    return ms * 1e3 / (2 * rounds)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--chain", type=int, default=400)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for programs in (1, sms):
        for pdl in (False, True) if triton_pdl.pdl(torch.empty(0, device="cuda")) else (False,):
            rows.append(dict(way=f"kernel boundary, {programs} programs, {'PDL' if pdl else 'plain'}",
                             us=kernel_chain(args.chain, programs, pdl)))
            print(f"{rows[-1]['way']:<44} {rows[-1]['us']:7.3f} µs", flush=True)
    for atomic_poll in (False, True):
        rows.append(dict(way=f"flag hand-over, {'atomic' if atomic_poll else 'volatile'} polls",
                         us=ping_pong(args.rounds, atomic_poll)))
        print(f"{rows[-1]['way']:<44} {rows[-1]['us']:7.3f} µs", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
