"""Paged attention over block tables, in Triton: every query token attends to the first
ctx_lens[t] keys of its own stream (decode: one token per stream; prefill chunks: several
tokens of a stream, each with its own causal length), reading K/V from the paged pool.

Split-KV with a FIXED split size in tokens (SPLIT): program (token, kv head, split) handles keys
[split*SPLIT, min((split+1)*SPLIT, ctx)) in tiles of BLOCK_N, with all the query heads of that kv
head in one tile (GQA). A token whose context fits one split writes its output directly; longer
ones write partials, merged by a second kernel in split order. How a token's keys are cut
depends only on its own ctx_len, never on the batch, the grid, or the block-table width, so a
stream's bits are the same alone, batched, padded into a CUDA-graph bucket, or prefilled in
chunks.

KV dtype: float32 or bfloat16 caches (bf16 on CUDA halves the bytes a decode step reads); the
arithmetic is fp32 either way. fp32 K/V: scores and the weighted sum are fp32-accurate (tf32x3:
three tf32 tensor-core products). bf16 K/V are exact in bf16, so only q and p need splitting:
each is a bf16 high part plus a bf16 remainder (16 significant bits together), two bf16 MMAs
with fp32 accumulation per product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import triton_pdl
from kernels.triton_pdl import pdl_wait, prefetch_l2, stamp

# keys per split (fixed: a property of the kernel, not of the batch). 256 since v29 (H100, one
# process a mode, against 512: 2,048 x 1 +8.3 to +9.5%, 2,048 x 8 +1.4%, 8,192 x 1 +3.0%;
# 2,048 x 64 -1.1 to -2.8%, 8,192 x 8 -1.7%; context 128 unchanged): one stream's keys over
# twice the programs, the merge's cost at many streams
SPLIT = 256
BLOCK_N = 32  # keys per inner tile (fp32 K/V); SPLIT % BLOCK_N == 0
# keys per inner tile of bf16 K/V (a split of fewer keys takes its whole split as the tile).
# 128 with 4 warps and 2 stages (before: 64, 8 warps, 3 stages; other bits, the same at every
# batch): H100, greedy, tok/s — context 128 x 1 stream 415.0 → 425.1, 2,048 x 1 345.6 →
# 368.6, 8,192 x 1 316.2 → 336.2, 2,048 x 64 3,953.6 → 3,956.9, 128 x 64 5,656.3 → 5,631.8;
# the engine's bitwise alone-vs-among sets 13/13 (GPU_NOTES v20)
BLOCK_N_BF16 = 128
PRECISION = "tf32x3"  # fp32-accurate dots on the tensor cores (three tf32 products)
# launch of the split kernel. STAGES: Triton's software pipeline streams the key tiles through
# shared memory (cp.async): against the next tile's loads issued by hand into registers, the
# same bits and 1.2-1.4x the bandwidth at 2K-32K contexts on the H200 (GPU_NOTES v9; 3 stages
# of 128-key tiles measured as 2). WARPS sets the score tile's layout, so its row reductions:
# another WARPS gives other bits (2 warps: 2,048 x 1 310.9 tok/s against 4's 372.7, v20)
WARPS, STAGES = 4, 2
# few programs (one stream, say): a kv head's query heads are dealt over up to GROUP programs
# (HS) until the launch has this many programs. Each row of the score tile is one query head
# and every reduction is per row, on the same [GROUP_PAD, BLOCK_N] tile, so a head's bits do
# not depend on which heads share its program: the split may follow the batch (unlike SPLIT).
# None: off (unmeasured; bench/ab_modes.py `hsplitN`)
HEAD_SPLIT_PROGRAMS: int | None = None
# under PDL, before its wait, each split program prefetches into L2 the K and V rows of its
# split (the block table, the token's row and context length are the step's inputs; a row the
# previous kernel is still writing may be fetched early — only a prefetch: the loads after the
# wait read it). No arithmetic changes, so no bit, and it may follow the batch: on for launches
# of up to this many query tokens. H100, tok/s (GPU_NOTES v19): 2,048 keys x 1 stream 330.4 →
# 345.5 (twice), 8,192 x 1 and 2,048 x 4 flat, 2,048 x 64 4,007 → 3,636 (the prefetches of
# many programs contend with their loads). None: off (bench/ab_modes.py `nokvpf`; `kvpf`: on
# at every token count)
PREFETCH_KV: int | None = 1
# bench only (bench/attn_timeline.py --probe): what the key loop's parts cost, by leaving
# parts out — wrong values except 4. 1: the K / V loads and the softmax, no dots; 2: the QK
# dot, no PV dot; 3: each dot one bf16 MMA (q and p's high parts only); 4: the keys' blocks
# taken as row * table stride + position // block size, no block-table load (right where the
# table is that identity, as attn_timeline's). 0: the kernel.
PROBE = 0


@triton.jit
def _kv_tile(k_ptr, v_ptr, bt_ptr, row, stride_bt, start, hi, kvh, KVH: tl.constexpr,
             D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, PROBE: tl.constexpr = 0):
    """K and V [BLOCK_N, D] of positions start.. (masked at hi), through the block table."""
    pos = start + tl.arange(0, BLOCK_N)
    valid = pos < hi
    if PROBE == 4:  # bench only: the identity table, not read
        blk = row * stride_bt + pos // BS
    else:
        blk = tl.load(bt_ptr + row * stride_bt + pos // BS, mask=valid, other=0).to(tl.int64)
    off = ((blk * BS + pos % BS) * KVH + kvh)[:, None] * D + tl.arange(0, D)[None, :]
    k = tl.load(k_ptr + off, mask=valid[:, None], other=0.0)
    v = tl.load(v_ptr + off, mask=valid[:, None], other=0.0)
    return k, v, valid


@triton.jit
def _prefetch_kv(k_ptr, v_ptr, bt_ptr, row_ptr, ctx_ptr, t, kvh, sp, stride_bt,
                 KVH: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, SPLIT: tl.constexpr,
                 LINES: tl.constexpr):
    """The K and V rows (LINES 128-byte lines a key) of keys [sp*SPLIT, (sp+1)*SPLIT) of token
    t's stream for kv head kvh, into L2: one block-table read for the split, then the lines."""
    ctx = tl.load(ctx_ptr + t)
    row = tl.load(row_ptr + t).to(tl.int64)
    pos = sp * SPLIT + tl.arange(0, SPLIT)
    valid = pos < ctx
    blk = tl.load(bt_ptr + row * stride_bt + pos // BS, mask=valid, other=0).to(tl.int64)
    off = ((blk * BS + pos % BS) * KVH + kvh)[:, None] * D \
        + (tl.arange(0, LINES) * (D // LINES))[None, :]
    prefetch_l2(k_ptr + off, valid[:, None])
    prefetch_l2(v_ptr + off, valid[:, None])


@triton.jit
def _dot_f32(a, b, PREC: tl.constexpr, MMA: tl.constexpr, PROBE: tl.constexpr = 0):
    """a @ b in fp32 with a float32. b float32: tf32x3 (PREC); b bfloat16 (exact in bf16): a
    as bf16 high part + bf16 remainder, two bf16 MMAs (MMA; the interpreter's bf16 dot is
    broken, so there the split parts meet b upcast in an fp32 dot: the same products)."""
    if b.dtype == tl.bfloat16:
        a_hi = a.to(tl.bfloat16)
        a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
        if MMA:
            if PROBE == 3:  # bench only: the high part alone
                return tl.dot(a_hi, b)
            return tl.dot(a_lo, b, tl.dot(a_hi, b))
        else:
            bf = b.to(tl.float32)
            return tl.dot(a_lo.to(tl.float32), bf, tl.dot(a_hi.to(tl.float32), bf,
                                                         input_precision="ieee"),
                          input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit(do_not_specialize=["stride_bt", "max_splits"])
def _attn_split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, row_ptr, ctx_ptr, out_ptr, pacc_ptr, pml_ptr,
                       trace_ptr, stride_bt, max_splits, scale,
                       H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                       GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, SPLIT: tl.constexpr,
                       BLOCK_N: tl.constexpr, PREC: tl.constexpr, MMA: tl.constexpr,
                       PDL: tl.constexpr, HS: tl.constexpr = 1, LINES: tl.constexpr = 0,
                       TRACE: tl.constexpr = False, PROBE: tl.constexpr = 0):
    """Program (token, kv head x HS, split): the split's keys for GROUP // HS query heads of
    the kv head (HS > 1: its heads dealt over HS programs; the same bits a head). LINES > 0
    (PDL only): the split's K / V rows prefetched into L2 before the wait. TRACE: time stamps
    (bench/attn_timeline.py) at entry, after the prefetch, after the wait, before the key
    loop, after it and at the end; a program with no keys stamps entry to wait only."""
    stamp(trace_ptr, 0, TRACE)
    t = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1) // HS
    sp = tl.program_id(2)
    if PDL and LINES > 0:
        _prefetch_kv(k_ptr, v_ptr, bt_ptr, row_ptr, ctx_ptr, t, kvh, sp, stride_bt, KVH, D, BS,
                     SPLIT, LINES)
    stamp(trace_ptr, 1, TRACE)
    pdl_wait(PDL)
    stamp(trace_ptr, 2, TRACE)
    ctx = tl.load(ctx_ptr + t)
    n_splits = tl.cdiv(ctx, SPLIT)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    heads = kvh * GROUP + (tl.program_id(1) % HS) * (GROUP // HS) + g  # [GROUP_PAD]
    g_mask = g < GROUP // HS
    out_rows = out_ptr + (t * H + heads)[:, None] * D + d[None, :]
    if ctx == 0:  # padding token: defined output, nothing read
        if sp == 0:
            tl.store(out_rows, tl.zeros((GROUP_PAD, D), tl.float32), mask=g_mask[:, None])
        return
    if sp >= n_splits:
        return
    q = tl.load(q_ptr + (t * H + heads)[:, None] * D + d[None, :], mask=g_mask[:, None], other=0.0)
    q = q * scale
    row = tl.load(row_ptr + t).to(tl.int64)
    m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, D), tl.float32)
    lo = sp * SPLIT
    hi = tl.minimum(lo + SPLIT, ctx)
    stamp(trace_ptr, 3, TRACE)
    for start in range(lo, hi, BLOCK_N):  # pipelined: later tiles' loads are in flight
        k, v, valid = _kv_tile(k_ptr, v_ptr, bt_ptr, row, stride_bt, start, hi, kvh, KVH, D, BS,
                               BLOCK_N, PROBE)
        if PROBE == 1:  # bench only: no QK dot
            s = tl.zeros((GROUP_PAD, BLOCK_N), tl.float32) + tl.sum(k.to(tl.float32), axis=1)[None, :]
        else:
            s = _dot_f32(q, tl.trans(k), PREC, MMA, PROBE)  # [GROUP_PAD, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if PROBE == 1 or PROBE == 2:  # bench only: no PV dot
            acc = acc * alpha[:, None] + tl.sum(p, axis=1)[:, None] * tl.sum(v.to(tl.float32), axis=0)[None, :]
        else:
            acc = acc * alpha[:, None] + _dot_f32(p, v, PREC, MMA, PROBE)
        m_i = m_new
    stamp(trace_ptr, 4, TRACE)
    if n_splits == 1:
        tl.store(out_rows, acc / l_i[:, None], mask=g_mask[:, None])
    else:
        part = (t * H + heads) * max_splits + sp  # [GROUP_PAD]
        tl.store(pacc_ptr + part[:, None] * D + d[None, :], acc, mask=g_mask[:, None])
        tl.store(pml_ptr + part * 2, m_i, mask=g_mask)
        tl.store(pml_ptr + part * 2 + 1, l_i, mask=g_mask)
    stamp(trace_ptr, 5, TRACE)


@triton.jit(do_not_specialize=["max_splits"])
def _attn_merge_kernel(ctx_ptr, out_ptr, pacc_ptr, pml_ptr, max_splits,
                       H: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr,
                       PDL: tl.constexpr):
    """Program (token, head): combine the token's splits in increasing split order."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    n_splits = tl.cdiv(tl.load(ctx_ptr + t), SPLIT)
    if n_splits <= 1:
        return
    base = (t * H + h) * max_splits
    m = tl.load(pml_ptr + base * 2)
    for s in range(1, n_splits):
        m = tl.maximum(m, tl.load(pml_ptr + (base + s) * 2))
    d = tl.arange(0, D)
    acc = tl.zeros((D,), tl.float32)
    l_sum = 0.0
    for s in range(0, n_splits):
        w = tl.exp(tl.load(pml_ptr + (base + s) * 2) - m)
        l_sum = l_sum + tl.load(pml_ptr + (base + s) * 2 + 1) * w
        acc = acc + tl.load(pacc_ptr + (base + s) * D + d) * w
    tl.store(out_ptr + (t * H + h) * D + d, acc / l_sum)


def head_splits(programs: int, group: int) -> int:
    """HS for a launch of `programs` (token, kv head, split) programs: doubled while the launch
    has fewer than HEAD_SPLIT_PROGRAMS programs and HS still divides the group; 1 when off."""
    hs = 1
    while HEAD_SPLIT_PROGRAMS and programs * hs < HEAD_SPLIT_PROGRAMS and group % (2 * hs) == 0:
        hs *= 2
    return hs


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, tok_row: torch.Tensor, ctx_lens: torch.Tensor,
                    scale: float, out: torch.Tensor | None = None,
                    split: int | None = None, head_split: int | None = None,
                    trace: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] f32; caches [num_blocks, block_size, KVH, D] f32 or bf16; block_tables
    [S, MB] int32; tok_row/ctx_lens [T] int32 → out [T, H, D] f32 (allocated when not given):
    token t attends to the first ctx_lens[t] keys of stream tok_row[t]. No host sync: the
    grid's split count comes from the table width (MB * block_size keys at most). split: keys
    per split (default SPLIT, read at the call); head_split: programs a kv head's query heads
    are dealt over (default `head_splits`; any divisor of the group gives the same bits).
    trace: int64 [>= split programs, 8], their time stamps (bench/attn_timeline.py)."""
    split = split or SPLIT
    if q.dtype == torch.float32 and not q.is_contiguous():
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    t, h, d = q.shape
    nb, bs, kvh, d2 = k_cache.shape
    if d2 != d or d & (d - 1) or h % kvh or v_cache.shape != k_cache.shape:
        raise ValueError("paged_attention: inconsistent q/cache shapes (head_dim a power of two)")
    for ten, name in ((q, "q"), (out, "out")):
        if ten.dtype != torch.float32 or not ten.is_contiguous():
            raise ValueError(f"paged_attention: {name} must be contiguous float32")
    if (k_cache.dtype not in (torch.float32, torch.bfloat16) or v_cache.dtype != k_cache.dtype
            or not k_cache.is_contiguous() or not v_cache.is_contiguous()):
        raise ValueError("paged_attention: k_cache/v_cache must be contiguous, both float32 or "
                         "both bfloat16")
    for ten, name in ((block_tables, "block_tables"), (tok_row, "tok_row"), (ctx_lens, "ctx_lens")):
        if ten.dtype != torch.int32 or not ten.is_contiguous():
            raise ValueError(f"paged_attention: {name} must be contiguous int32")
    if tok_row.shape != (t,) or ctx_lens.shape != (t,) or block_tables.dim() != 2 or out.shape != q.shape:
        raise ValueError("paged_attention: tok_row/ctx_lens [T], block_tables [S, MB], out like q")
    block_n = min(BLOCK_N_BF16 if k_cache.dtype == torch.bfloat16 else BLOCK_N, split)
    if split % block_n:
        raise ValueError(f"split {split} must be a multiple of {block_n}")
    if t == 0:
        return out
    group = h // kvh
    max_splits = max(1, triton.cdiv(block_tables.shape[1] * bs, split))
    if max_splits > 1:
        pacc = torch.empty(t, h, max_splits, d, dtype=torch.float32, device=q.device)
        pml = torch.empty(t, h, max_splits, 2, dtype=torch.float32, device=q.device)
    else:
        pacc = pml = out  # never touched: every token has one split
    hs = head_splits(t * kvh * max_splits, group) if head_split is None else head_split
    if group % hs:
        raise ValueError(f"head_split {hs} must divide the {group} query heads a kv head")
    prefetch = bool(PREFETCH_KV and t <= PREFETCH_KV)
    _attn_split_kernel[(t, kvh * hs, max_splits)](
        q, k_cache, v_cache, block_tables, tok_row, ctx_lens, out, pacc, pml,
        out if trace is None else trace, block_tables.stride(0), max_splits, scale, H=h, KVH=kvh,
        D=d, BS=bs, GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), SPLIT=split, BLOCK_N=block_n,
        PREC=PRECISION, MMA=q.device.type == "cuda", HS=hs, TRACE=trace is not None, PROBE=PROBE,
        LINES=max(1, d * k_cache.element_size() // 128) if prefetch else 0,
        num_warps=WARPS, num_stages=STAGES, **triton_pdl.launch(q))
    if max_splits > 1:
        _attn_merge_kernel[(t, h)](ctx_lens, out, pacc, pml, max_splits, H=h, D=d, SPLIT=split,
                                   **triton_pdl.launch(q))
    return out
