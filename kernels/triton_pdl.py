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



# The next layer's attention weights (qkv and o: 11.8 MB a layer of the 30B-A3B) prefetched
# into L2 while this layer's bandwidth-light kernels run, so that qkv and o, latency-bound at
# one stream (v26: 5.9 and 5.2 µs for 2.2 and 1.7 µs of bytes at copy), read them from L2. A
# kernel of its own on the PDL chain (one boundary, ~0.6 µs): it issues its prefetches, then
# waits as every kernel does, so the stream order holds. Where the model places it: "attn"
# (after qkv / RoPE / store), "o" (after o, before the MoE), "end" (after the MoE, before the
# next layer's norm); None: no prefetch (the default until measured: GPU_NOTES v27).
# Prefetches change no value: the bits are those without.
L2_AHEAD: str | None = None
LINE = 128  # bytes a prefetch covers
_SEGMENTS = 4  # tensors one prefetch launch takes


@triton.jit
def _prefetch_kernel(t0, t1, t2, t3, c1, c2, c3, c4, log_ptr, LINES: tl.constexpr,
                     LOG: tl.constexpr, PDL: tl.constexpr):
    """Program p prefetches lines p * LINES ... of the tensors t0..t3 laid end to end (t_i's
    lines are [c_i, c_{i+1}) of c4 in all, c0 = 0); LOG: store the addresses at log[line]
    instead (the interpreter's check of the arithmetic). Then the PDL wait."""
    line = tl.program_id(0).to(tl.int64) * LINES + tl.arange(0, LINES)
    a = tl.where(line < c1, t0.to(tl.int64) + line * 128,
                 tl.where(line < c2, t1.to(tl.int64) + (line - c1) * 128,
                          tl.where(line < c3, t2.to(tl.int64) + (line - c2) * 128,
                                   t3.to(tl.int64) + (line - c3) * 128)))
    if LOG:
        tl.store(log_ptr + line, a, mask=line < c4)
    else:
        prefetch_l2(a, line < c4)
    pdl_wait(PDL)


def prefetch(tensors: list[torch.Tensor], log: torch.Tensor | None = None) -> None:
    """Prefetch the bytes of `tensors` (contiguous, on one CUDA device; at most 4) into L2 on
    the stream's PDL chain. log (int64 [lines], the interpreter's tests): the kernel stores
    each line's address there instead of prefetching."""
    if not tensors or len(tensors) > _SEGMENTS:
        raise ValueError(f"prefetch: 1 to {_SEGMENTS} tensors")
    if any(not t.is_contiguous() or t.device != tensors[0].device for t in tensors):
        raise ValueError("prefetch: contiguous tensors on one device")
    ends, n = [], 0
    for t in tensors:
        n += triton.cdiv(t.numel() * t.element_size(), LINE)
        ends.append(n)
    ts = list(tensors) + [tensors[-1]] * (_SEGMENTS - len(tensors))
    ends += [n] * (_SEGMENTS - len(tensors))
    if log is not None and (log.dtype != torch.int64 or log.numel() < n):
        raise ValueError(f"prefetch: log must be int64 with at least {n} entries")
    lines = 1024
    _prefetch_kernel[(triton.cdiv(n, lines),)](
        *ts, *ends, log if log is not None else ts[0], LINES=lines, LOG=log is not None,
        num_warps=4, **launch(ts[0]))
