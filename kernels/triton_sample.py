"""The draw of sampled tokens from rows already sorted (replica/sampling.py `pick` on the GPU).

`draw` takes each sampled row's logits sorted most likely first (a stable sort: ties by token
id) and finds, in one program per row, what `replica.sampling.sample` finds with a float64
softmax, a cumulative sum over the whole vocabulary and two searches: the top-k / top-p cut and
the inverse CDF at the row's uniform draw. Here the softmax's denominator is one pass over the
row, and the cumulative mass is scanned in blocks only as far as the cut (a few blocks for a
peaked row, the whole row without a cut): no [rows, vocab] float64 tensors are written.

A program reads its own row only and sums it in one fixed order (blocks in increasing order,
a block by tl.cumsum), so a row's token never depends on the other rows of the call. Against
`sample` the masses may differ in their last bits (another summation order), so the token may
differ only where the draw or the cut falls within rounding of a boundary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # vocabulary entries a program scans per step


@triton.jit
def _block_cum(vals_ptr, i0, V, top, temp, z, carry, BLOCK: tl.constexpr):
    """Block i0 of a sorted row → (its offsets, the cumulative masses up to each entry [BLOCK]
    fp64: carry plus the block's own, which entries lie inside the row)."""
    offs = i0 + tl.arange(0, BLOCK)
    inside = offs < V
    v = tl.load(vals_ptr + offs, mask=inside, other=0.0).to(tl.float64)
    p = tl.where(inside, tl.exp(v / temp - top / temp) / z, 0.0)
    return offs, tl.cumsum(p, 0) + carry, inside


@triton.jit
def _draw_kernel(vals_ptr, ids_ptr, temp_ptr, keep_ptr, top_p_ptr, u_ptr, out_ptr, V,
                 stride_v, stride_i, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    vals = vals_ptr + row * stride_v
    temp = tl.load(temp_ptr + row)  # fp64
    top_p = tl.load(top_p_ptr + row)  # fp64; 1: no top-p cut (the mass may round to >= 1
    top_p = tl.where(top_p < 1.0, top_p, float("inf"))  # before the last entry: never reached)
    u = tl.load(u_ptr + row)  # fp64 in [0, 1)
    top = tl.load(vals).to(tl.float64)  # the row's largest logit

    # the softmax's denominator: every entry, blocks in increasing order
    acc = tl.zeros((BLOCK,), dtype=tl.float64)
    for i0 in range(0, V, BLOCK):
        offs = i0 + tl.arange(0, BLOCK)
        v = tl.load(vals + offs, mask=offs < V, other=0.0).to(tl.float64)
        acc += tl.where(offs < V, tl.exp(v / temp - top / temp), 0.0)
    z = tl.sum(acc, 0)

    # the cut: keep = min(top-k, the smallest prefix whose mass reaches top_p), and its mass
    keep = tl.load(keep_ptr + row)  # int64: top-k, or V
    total = tl.full((), 0.0, tl.float64)
    carry = tl.full((), 0.0, tl.float64)
    i0 = 0
    while i0 < keep:
        offs, cum, inside = _block_cum(vals, i0, V, top, temp, z, carry, BLOCK)
        reach = tl.min(tl.where(inside & (cum >= top_p), offs, V), 0)  # V: none here
        keep = tl.minimum(keep, reach + 1)
        last = keep - 1
        total = tl.where((last >= i0) & (last < i0 + BLOCK),
                         tl.sum(tl.where(offs == last, cum, 0.0), 0), total)
        carry = tl.max(tl.where(inside, cum, 0.0), 0)  # the block's last cumulative mass
        i0 += BLOCK

    # the inverse CDF: the first entry whose cumulative mass exceeds u * total (at most keep - 1)
    target = u * total
    at = keep - 1
    carry = tl.full((), 0.0, tl.float64)
    i0 = 0
    while i0 <= at:
        offs, cum, inside = _block_cum(vals, i0, V, top, temp, z, carry, BLOCK)
        at = tl.minimum(at, tl.min(tl.where(inside & (cum > target), offs, V), 0))
        carry = tl.max(tl.where(inside, cum, 0.0), 0)
        i0 += BLOCK
    tl.store(out_ptr + row, tl.load(ids_ptr + row * stride_i + at))


def draw(vals: torch.Tensor, ids: torch.Tensor, temperature: torch.Tensor, keep: torch.Tensor,
         top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """vals [N, V] fp32: each row's logits sorted most likely first; ids [N, V] int64: their
    token ids; temperature, top_p, u [N] fp64 (top_p 1: no cut; u in [0, 1): the row's draw);
    keep [N] int64 (the row's top-k, or V) → [N] int64 tokens."""
    n, v = vals.shape
    if (vals.dtype != torch.float32 or ids.dtype != torch.int64 or ids.shape != vals.shape
            or vals.stride(1) != 1 or ids.stride(1) != 1):
        raise ValueError("draw: vals [N, V] float32 and ids [N, V] int64, rows contiguous")
    for t, dt in ((temperature, torch.float64), (top_p, torch.float64), (u, torch.float64),
                  (keep, torch.int64)):
        if t.shape != (n,) or t.dtype != dt:
            raise ValueError("draw: temperature, top_p, u [N] float64 and keep [N] int64")
    out = torch.empty(n, dtype=torch.int64, device=vals.device)
    if n:
        _draw_kernel[(n,)](vals, ids, temperature.contiguous(), keep.contiguous(),
                           top_p.contiguous(), u.contiguous(), out, v, vals.stride(0),
                           ids.stride(0), BLOCK=BLOCK, num_warps=8)
    return out
