"""Programmatic dependent launch (Hopper and later) for the Triton kernels.

A decode step is a CUDA graph of ~12 small kernels per layer, each on the critical path of the
next. Launched with `launch_pdl`, a kernel may be scheduled while the previous one still runs:
it prefetches what no kernel writes (its weights, into L2), then `pdl_wait` blocks until the
previous grid has completed and its writes are visible, and only then reads anything a kernel
produced. Every kernel launched with PDL calls `pdl_wait` before its first such read, so the
stream order holds transitively (a kernel completes only after its predecessor did).
`pdl_wait` also lets the next kernel launch, after the wait: the look-ahead is one kernel.

The arithmetic is untouched, so the bits are those of a plain launch. The interpreter (CPU
tensors) and older GPUs get plain launches (PDL False: the calls compile away).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - then pdl() is always False
    gdc_launch_dependents = gdc_wait = None
try:  # stamp's clock and SM id (bench timelines only)
    from triton.language.extra.cuda import globaltimer, smid
except ImportError:  # pragma: no cover - then TRACE cannot compile; nothing else needs them
    globaltimer = smid = None

ENABLED = gdc_wait is not None  # a benchmark may switch it off to compare


def pdl(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with PDL (CUDA, compute capability >= 9)."""
    return ENABLED and t.device.type == "cuda" and _hopper_or_later(t.device.index)


@functools.cache
def _hopper_or_later(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


# Kernels that read inputs written two or more kernels back (the step's positions and slots)
# and constants (norm weights, RoPE tables) load them before `pdl_wait` — only the
# predecessor may still be running then (the look-ahead is one kernel: every kernel lets its
# dependents launch only after its own wait), so those inputs are final — and what the
# predecessor wrote after it: the same loads, so the same bits, with their latency under the
# predecessor's tail. Used by the RMSNorm (its weight) and the q/k norm + RoPE + KV store
# (positions, slots, tables, weights; the position → table load chain is what it shortens).
# The default since v21 (H100, with cuda_q4.EXPERT_EARLY: 1 stream +5.0% at context 128,
# +3.2% at 2,048); False: everything after the wait (bench/ab_modes.py `noearly`)
EARLY_INPUTS = True


def launch(t: torch.Tensor) -> dict:
    """The launch options and the PDL constexpr for a kernel working on t's device."""
    on = pdl(t)
    return dict(PDL=on, launch_pdl=on)


def early(t: torch.Tensor) -> bool:
    """EARLY for the kernels that take it: older inputs before the wait (EARLY_INPUTS, PDL)."""
    return EARLY_INPUTS and pdl(t)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the previous kernel in the stream to complete (its writes visible), then let
    the next one launch. Nothing a kernel wrote may be read before this."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, mask):
    """Prefetch the lines at ptrs (where mask) into L2; for data no kernel writes (weights)."""
    addr = tl.where(mask, ptrs.to(tl.int64), 0)
    tl.inline_asm_elementwise(
        asm="""
        {
        .reg .pred p;
        setp.ne.b64 p, $1, 0;
        @p prefetch.global.L2 [$1];
        mov.u32 $0, 0;
        }
        """,
        constraints="=r,l", args=[addr], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def stamp(trace_ptr, point: tl.constexpr, TRACE: tl.constexpr):
    """TRACE: store the global nanosecond timer at trace[program, point] (and the SM at
    trace[program, 7]) — a per-program timeline for bench/gpu_timeline.py; compiled out
    otherwise. Program = its linear index over the grid (axis 0 fastest)."""
    if TRACE:
        pid = (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) \
            + tl.program_id(0)
        stamp_row(trace_ptr, pid, point, TRACE)


@triton.jit
def stamp_row(trace_ptr, row, point: tl.constexpr, TRACE: tl.constexpr):
    """stamp at trace[row, point] for a row the kernel chooses (a claimed work item, say)."""
    if TRACE:
        at = trace_ptr + row.to(tl.int64) * 8
        tl.store(at + point, globaltimer())
        if point == 0:
            tl.store(at + 7, smid().to(tl.int64))

