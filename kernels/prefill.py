"""Prefill attention: one stream's prompt chunk against its paged context, tiled.

The paged decode kernel (triton_attention.py) runs a program per query token that reads all of
that token's keys: right for decode, but a prompt of n tokens then reads O(n²) keys. Here a
chunk's queries attend in PIECES of PIECE positions with FlashAttention (torch SDPA; on CPU,
SDPA's own kernels as the reference path), each piece reading its keys once.

Batch and chunk invariance. Pieces are aligned to absolute positions: piece p holds the queries
of positions [p*PIECE, (p+1)*PIECE) and attends to keys [0, (p+1)*PIECE), lower-right causal.
The rows of a piece that this chunk does not own (earlier positions, or later ones not yet
known) are zero queries whose outputs are dropped; keys past the chunk's last token are zeros,
and every row masks them anyway. So each SDPA call has a shape set by the piece index alone —
one kernel, one split plan — and a row's result depends only on its own query and its own
stream's keys: never on the other streams of the step (each stream is its own call) nor on
where the scheduler cut the prompt into chunks.

On CUDA (VARLEN) a step's chunks go together instead: each chunk's PIECE-aligned region of
queries and its keys, packed with the other streams' into variable-length FlashAttention calls
(prefill_attention_batch). That kernel has no K split, and each sequence's query blocks start
at its region's start, a multiple of PIECE: a row's query block, key blocks and their order
are again functions of its absolute position alone, whatever else the call holds.

The engine sends a prompt token here only when its position is at least MIN_POSITION: shorter
contexts stay on the paged kernel, whose bits decode shares (runner.py, Chunk rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PIECE = 256  # query positions per attention call (fixed: a property of the path, not the batch)
MIN_POSITION = 256  # prompt positions below this attend through the paged kernel (GPU_NOTES v8)
# CUDA, 16-bit pools: a step's spans go to FlashAttention's variable-length form, many streams'
# regions packed in one call (prefill_attention_batch). Its kernel never splits K (torch 2.11 on
# the H200, bench/prefill_modes.py), so a row's query block, its key blocks and their order
# follow from its absolute position alone: the bits of a row are the same alone, packed with any
# other streams in any order, and however the prompt was cut (the same invariance as the pieces,
# other bits). False: a call per piece per stream, as before (GPU_NOTES v11).
VARLEN = True


def compute_dtype(cache_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """FlashAttention needs 16-bit inputs: on CUDA a bf16/fp16 pool is read as it is; the CPU
    reference path (and an fp32 pool) computes in fp32."""
    if device.type == "cuda" and cache_dtype in (torch.bfloat16, torch.float16):
        return cache_dtype
    return torch.float32


def gather_context(k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, end: int,
                   length: int, dtype: torch.dtype, out: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions [0, end) of one stream, zero-padded to `length` ≥ end:
    [length, KVH, D] each, in `dtype` (into `out`, two such contiguous tensors, when given).
    table [≥ ceil(end / block_size)] int32 block ids."""
    nb, bs, kvh, d = k_cache.shape
    used = -(-end // bs)
    blocks = table[:used].to(torch.int64)
    bufs = out or [torch.empty(length, kvh, d, dtype=dtype, device=k_cache.device) for _ in range(2)]
    out = []
    for cache, buf in zip((k_cache, v_cache), bufs):
        if cache.dtype == dtype and used * bs <= length:  # gathered straight into place
            torch.index_select(cache, 0, blocks, out=buf[:used * bs].view(used, bs, kvh, d))
        else:
            buf[:end] = cache.index_select(0, blocks).view(-1, kvh, d)[:end]
        buf[end:] = 0  # the last block's slots past the chunk, and the padding
        out.append(buf)
    return out[0], out[1]


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      table: torch.Tensor, start: int, scale: float,
                      piece: int | None = None) -> torch.Tensor:
    """Causal attention of q [n, H, D] (fp32; positions start .. start+n-1 of one stream,
    whose K/V are in the caches already) over that stream's keys → [n, H, D] fp32.

    k_cache/v_cache [num_blocks, block_size, KVH, D] (fp32, bf16 or fp16); table [MB] int32,
    the stream's block table (on the caches' device). start is a host int: no host sync."""
    piece = piece or PIECE
    n, h, d = q.shape
    nb, bs, kvh, d2 = k_cache.shape
    if d2 != d or h % kvh or v_cache.shape != k_cache.shape or q.dtype != torch.float32:
        raise ValueError("prefill_attention: q [n, H, D] float32 and caches [NB, BS, KVH, D]")
    if table.dim() != 1 or table.dtype != torch.int32 or table.numel() * bs < start + n:
        raise ValueError("prefill_attention: table must be int32 [MB] covering start + n keys")
    out = torch.empty_like(q)
    if n == 0:
        return out
    end = start + n
    first, last = _region(start, n, piece)
    dtype = compute_dtype(k_cache.dtype, q.device)
    keys, values = gather_context(k_cache, v_cache, table, end, last, dtype)
    # queries of every piece this chunk touches, zeros where it owns no token
    qbuf = torch.zeros(last - first, h, d, dtype=dtype, device=q.device)
    qbuf[start - first: end - first] = q
    for lo in range(first, last, piece):
        qp = qbuf[lo - first: lo - first + piece]  # [PIECE, H, D]
        o = attend(qp, keys[: lo + piece], values[: lo + piece], scale)  # [PIECE, H, D]
        a, b = max(start, lo), min(end, lo + piece)
        out[a - start: b - start] = o[a - lo: b - lo]
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Lq, H, D], k/v [Lk, KVH, D] (Lk ≥ Lq), query i at key position Lk - Lq + i → [Lq, H, D]."""
    qt, kt, vt = (x.unsqueeze(0).transpose(1, 2) for x in (q, k, v))  # [1, heads, L, D]
    if q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16):
        return _flash(qt, kt, vt, scale)[0].transpose(0, 1)
    # imported here: torch.nn.attention pulls in torch._dynamo, which imports Triton, and a
    # process that imported Triton without TRITON_INTERPRET can no longer interpret kernels
    from torch.nn.attention.bias import causal_lower_right

    lq, lk = q.shape[0], k.shape[0]
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=causal_lower_right(lq, lk),
                                       scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return o[0].transpose(0, 1)  # [Lq, H, D]


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """FlashAttention-2 forward, causal aligned to the last key (its meaning of is_causal when
    Lq < Lk), KV heads shared by query groups natively. [1, H, Lq, D] out."""
    try:
        return torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=scale)[0]
    except RuntimeError:  # a build without native grouped KV heads: expand them
        group = q.shape[1] // k.shape[1]
        if group == 1:
            raise
        k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
        return torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=scale)[0]


def prefill_attention_batch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            tables: torch.Tensor, spans, scale: float, out: torch.Tensor,
                            max_keys: int, varlen: bool | None = None) -> None:
    """prefill_attention for several streams' chunks of one step: spans are (row, n, start,
    table_row): rows [row, row + n) of q [T, H, D] fp32 are positions start .. start+n-1 of the
    stream whose block table is tables[table_row]; their outputs go to out[row: row + n].

    varlen (default: VARLEN, on CUDA with a 16-bit pool): each span's PIECE-aligned region of queries, and its
    keys [0, region end), are packed with the other spans' into one variable-length
    FlashAttention call, as many spans a call as fit `max_keys` packed keys and T + 2 * PIECE
    packed queries (a span always fits alone): the buffers stay within what one stream's call
    needs. Otherwise a prefill_attention call per span."""
    if varlen is None:
        varlen = VARLEN and compute_dtype(k_cache.dtype, q.device) != torch.float32
    if not varlen:
        for row, n, start, t in spans:
            out[row: row + n] = prefill_attention(q[row: row + n], k_cache, v_cache, tables[t],
                                                  start, scale)
        return
    max_queries = q.shape[0] + 2 * PIECE
    group: list[tuple[int, int, int, int]] = []
    rows = keys = 0
    for sp in spans:
        lo, hi = _region(sp[2], sp[1])
        if group and (rows + hi - lo > max_queries or keys + hi > max_keys):
            _varlen_group(q, k_cache, v_cache, tables, group, scale, out)
            group, rows, keys = [], 0, 0
        group.append(sp)
        rows, keys = rows + hi - lo, keys + hi
    if group:
        _varlen_group(q, k_cache, v_cache, tables, group, scale, out)


def _region(start: int, n: int, piece: int = PIECE) -> tuple[int, int]:
    """[lo, hi): the piece-aligned positions a chunk of n tokens from `start` touches."""
    return start // piece * piece, ((start + n - 1) // piece + 1) * piece


def _varlen_group(q, k_cache, v_cache, tables, spans, scale, out) -> None:
    """One variable-length call for `spans` (see prefill_attention_batch)."""
    kvh, d = k_cache.shape[2:]
    dtype = compute_dtype(k_cache.dtype, q.device)
    regions = [_region(start, n) for _, n, start, _ in spans]
    lq = [hi - lo for lo, hi in regions]
    lk = [hi for _, hi in regions]
    qbuf = torch.zeros(sum(lq), q.shape[1], d, dtype=dtype, device=q.device)
    kbuf = torch.empty(sum(lk), kvh, d, dtype=dtype, device=q.device)
    vbuf = torch.empty_like(kbuf)
    qo = ko = 0
    for (row, n, start, t), (lo, hi) in zip(spans, regions):
        qbuf[qo + start - lo: qo + start - lo + n] = q[row: row + n]
        gather_context(k_cache, v_cache, tables[t], start + n, hi, dtype,
                       out=(kbuf[ko: ko + hi], vbuf[ko: ko + hi]))
        qo, ko = qo + hi - lo, ko + hi
    o = _attend_varlen(qbuf, kbuf, vbuf, lq, lk, scale)
    qo = 0
    for (row, n, start, _), (lo, hi) in zip(spans, regions):
        out[row: row + n] = o[qo + start - lo: qo + start - lo + n]
        qo += hi - lo


def _attend_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lq: list[int],
                   lk: list[int], scale: float) -> torch.Tensor:
    """Packed sequences: q [sum lq, H, D], k/v [sum lk, KVH, D]; sequence i's queries attend
    causally aligned to its last key → [sum lq, H, D]. CUDA 16-bit: FlashAttention's
    variable-length kernel (grouped KV heads native); elsewhere (tests of the packing) each
    sequence's PIECE-query pieces in turn, prefill_attention's own calls (the same bits)."""
    if q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16):
        cq = torch.tensor([0] + lq, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(q.device)
        ck = torch.tensor([0] + lk, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(q.device)
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cq, ck, max(lq), max(lk), 0.0, True, False, scale=scale)[0]
    outs, qo, ko = [], 0, 0
    for a, b in zip(lq, lk):  # queries at key positions b - a .. b - 1, a multiple of PIECE
        for p in range(0, a, PIECE):
            end = ko + b - a + p + PIECE
            outs.append(attend(q[qo + p: qo + p + PIECE], k[ko: end], v[ko: end], scale))
        qo, ko = qo + a, ko + b
    return torch.cat(outs)


# ---- float64 reference (tests) -----------------------------------------------------------------
def prefill_reference(q, k_cache, v_cache, table, start, scale):
    """float64: query i (position start + i) over keys [0, start + i] of the stream."""
    n, h, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    end = start + n
    pos = torch.arange(end)
    blocks = table.cpu().long()[pos // bs]
    k = k_cache.cpu()[blocks, pos % bs].double().repeat_interleave(h // kvh, dim=1)  # [end, H, D]
    v = v_cache.cpu()[blocks, pos % bs].double().repeat_interleave(h // kvh, dim=1)
    s = torch.einsum("nhd,khd->hnk", q.cpu().double(), k) * scale  # [H, n, end]
    mask = pos[None, :] > (start + torch.arange(n))[:, None]  # [n, end]
    p = torch.softmax(s.masked_fill(mask[None], float("-inf")), dim=-1)
    return torch.einsum("hnk,khd->nhd", p, v)
