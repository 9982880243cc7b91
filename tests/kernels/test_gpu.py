"""The CUDA path on a GPU (skipped elsewhere): every Triton kernel at real shapes vs float64
references with poisoned outputs, the engine on CUDA vs on CPU (greedy tokens), and batch
invariance on the GPU — a stream alone vs among 1..64 others, bitwise equal logits, through
CUDA-graph buckets and eager steps alike.

Run on the GPU machine in its own process (tests/kernels/test_triton_kernels.py interprets the
same kernels and must not share a process with compiled ones):
    python -m pytest tests/kernels/test_gpu.py -q
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from kernels import (cpu, moe_layout, q4_layout, triton_attention, triton_f16, triton_linear,  # noqa: E402
                     triton_moe, triton_moe_route, triton_norm, triton_pdl, triton_q4)
from kernels.linear import Linear, quantize_q8  # noqa: E402
from tests.replica.schedules import StreamSpec, loaded, run_schedule, run_solo, small_core  # noqa: E402

DEV = "cuda"
TOL = {"f32": 1e-5, "q4": 5e-3, "q8": 5e-3}


def nan(*shape):
    return torch.full(shape, float("nan"), device=DEV)


def rel_err(out, ref) -> float:
    assert torch.isfinite(out).all(), "an output element is NaN/inf (unwritten or wrong)"
    return float((out.double() - ref).norm() / ref.norm())


def rand_q4(n: int, k: int, g: torch.Generator, gpu_format: bool = True) -> Linear:
    """Random nibbles, fp16 scales, mins = -8 * scale (Q4_0-like)."""
    qs = torch.randint(0, 256, (n, k // 2), generator=g, device=DEV, dtype=torch.uint8)
    scale = (torch.rand(n, k // 32, generator=g, device=DEV) + 0.5).half().float() * k ** -0.5 / 4
    lin = Linear.q4(qs, scale, -8 * scale)
    return triton_linear.to_gpu_format(lin) if gpu_format else lin


def weight(fmt: str, n: int, k: int, g: torch.Generator) -> Linear:
    if fmt == "q4":
        return rand_q4(n, k, g)
    w = torch.randn(n, k, generator=g, device=DEV) * k ** -0.5
    return Linear.dense(w) if fmt == "f32" else triton_linear.to_gpu_format(quantize_q8(w))


# ---- kernels at real shapes -------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["q4", "q8", "f32"])
@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096), (151936 // 8, 2048)])
def test_linear_at_real_shapes(fmt, n, k):
    g = torch.Generator(DEV).manual_seed(n + k)
    lin = weight(fmt, n, k, g)
    for m in (1, 7, 64, 200):
        x = torch.randn(m, k, generator=g, device=DEV)
        res = torch.randn(m, n, generator=g, device=DEV)
        out = triton_linear.linear(lin, x, nan(m, n), residual=res)
        assert rel_err(out, lin.reference(x) + res.double()) < TOL[fmt], m


@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096), (2048, 768)])
def test_q4_inline_ptx_dequant_gives_the_plain_triton_bits(n, k):
    """The inline-PTX nibble unpack (GPU only) against the plain-Triton one the interpreter
    tests: bitwise the same GEMM output, with each shape's split-K."""
    g = torch.Generator(DEV).manual_seed(n + k)
    lin = rand_q4(n, k, g)
    for m in (1, 37):
        x = torch.randn(m, k, generator=g, device=DEV)
        fast = triton_q4.linear(lin, x, nan(m, n), asm=True)
        plain = triton_q4.linear(lin, x, nan(m, n), asm=False)
        assert torch.equal(fast, plain), (m, lin.split)
        assert rel_err(fast, lin.reference(x)) < TOL["q4"]
        assert not lin.tickets.any()


@pytest.mark.parametrize("fmt", ["q4", "f32"])
def test_linear_rows_bitwise_alone_vs_among_64(fmt):
    g = torch.Generator(DEV).manual_seed(1)
    lin = weight(fmt, 5120, 2048, g)
    x = torch.randn(64, 2048, generator=g, device=DEV)
    full = triton_linear.linear(lin, x, nan(64, 5120))
    for m in (1, 2, 17, 33, 63):
        part = triton_linear.linear(lin, x[-m:].contiguous(), nan(m, 5120))
        assert torch.equal(part, full[-m:]), m


def test_norms_rope_and_softmax_at_real_shapes():
    g = torch.Generator(DEV).manual_seed(2)
    x = torch.randn(64, 2048, generator=g, device=DEV) * 4
    w = torch.randn(2048, generator=g, device=DEV)
    assert rel_err(triton_norm.rms_norm(x, w, 1e-6, nan(64, 2048)), cpu.rms_norm_reference(x, w, 1e-6)) < 1e-6
    gu = torch.randn(64, 1536, generator=g, device=DEV) * 3
    out = triton_norm.silu_mul(gu[:, :768], gu[:, 768:], nan(64, 768))
    gd, ud = gu[:, :768].double(), gu[:, 768:].double()
    assert rel_err(out, gd * torch.sigmoid(gd) * ud) < 1e-6
    logits = torch.randn(4, 151936, generator=g, device=DEV) * 3
    assert rel_err(triton_norm.softmax(logits, nan(4, 151936)), torch.softmax(logits.double(), -1)) < 1e-5
    t, h, kvh, d = 64, 32, 4, 128
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g, device=DEV)
    pos = torch.randint(0, 4000, (t,), generator=g, device=DEV)
    ang = torch.randn(4096, d, generator=g, device=DEV) * 3
    cos, sin = ang.cos(), ang.sin()
    qn, kn = torch.randn(d, generator=g, device=DEV), torch.randn(d, generator=g, device=DEV)
    slots = torch.randperm(256 * 16, generator=g, device=DEV)[:t]
    rq, rk, rv = triton_norm.qkv_rope_reference(qkv, pos, cos, sin, qn, kn, 1e-6, h, kvh)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 4e-3)):
        kc, vc = nan(256, 16, kvh, d).to(dtype), nan(256, 16, kvh, d).to(dtype)
        q = triton_norm.qkv_rope_store(qkv, pos, cos, sin, qn, kn, 1e-6, slots, kc, vc, h,
                                       nan(t, h, d))
        assert rel_err(q, rq) < 1e-6
        assert rel_err(kc.view(-1, kvh, d)[slots].float(), rk) < tol
        assert torch.equal(vc.view(-1, kvh, d)[slots], rv.float().to(dtype))  # rounded to nearest
        # triton_pdl.EARLY_INPUTS (older inputs before the wait): the same bits
        early = triton_pdl.EARLY_INPUTS
        try:
            triton_pdl.EARLY_INPUTS = True
            kc2, vc2 = nan(256, 16, kvh, d).to(dtype), nan(256, 16, kvh, d).to(dtype)
            q2 = triton_norm.qkv_rope_store(qkv, pos, cos, sin, qn, kn, 1e-6, slots, kc2, vc2, h,
                                            nan(t, h, d))
            y2 = triton_norm.rms_norm(x, w, 1e-6, nan(64, 2048))
        finally:
            triton_pdl.EARLY_INPUTS = early
        assert torch.equal(q2, q) and torch.equal(y2, triton_norm.rms_norm(x, w, 1e-6, nan(64, 2048)))
        assert torch.equal(kc2.nan_to_num(7.0), kc.nan_to_num(7.0)) and torch.equal(vc2.nan_to_num(7.0), vc.nan_to_num(7.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_at_real_shapes_and_bitwise_alone(dtype):
    g = torch.Generator(DEV).manual_seed(3)
    h, kvh, d, bs, nb = 32, 4, 128, 16, 1024
    kc = torch.randn(nb, bs, kvh, d, generator=g, device=DEV).to(dtype)
    vc = torch.randn(nb, bs, kvh, d, generator=g, device=DEV).to(dtype)
    ctx = torch.tensor([1, 17, 300, 512, 513, 1500, 2047, 900], dtype=torch.int32, device=DEV)
    t = ctx.numel()
    tables = torch.randperm(nb, generator=g, device=DEV)[: t * 128].view(t, 128).to(torch.int32).contiguous()
    rows = torch.arange(t, dtype=torch.int32, device=DEV)
    q = torch.randn(t, h, d, generator=g, device=DEV)
    out = triton_attention.paged_attention(q, kc, vc, tables, rows, ctx, d ** -0.5, nan(t, h, d))
    ref = cpu.paged_attention_reference(q.cpu(), kc.cpu(), vc.cpu(), tables.cpu(), rows.cpu(),
                                        ctx.cpu(), d ** -0.5)
    assert rel_err(out.cpu(), ref) < (1e-5 if dtype == torch.float32 else 3e-5)
    for i in (0, 5, 6):  # alone, with a wider table (more, empty, splits in the grid)
        wide = torch.cat([tables[i:i + 1], torch.zeros(1, 40, dtype=torch.int32, device=DEV)], 1)
        alone = triton_attention.paged_attention(q[i:i + 1].contiguous(), kc, vc, wide.contiguous(),
                                                 torch.zeros(1, dtype=torch.int32, device=DEV),
                                                 ctx[i:i + 1].contiguous(), d ** -0.5, nan(1, h, d))
        assert torch.equal(alone[0], out[i]), i
        for hs in (2, 8):  # a kv head's 8 query heads over 2 or 8 programs: the same bits
            split = triton_attention.paged_attention(
                q[i:i + 1].contiguous(), kc, vc, wide.contiguous(),
                torch.zeros(1, dtype=torch.int32, device=DEV), ctx[i:i + 1].contiguous(),
                d ** -0.5, nan(1, h, d), head_split=hs)
            assert torch.equal(split[0], out[i]), (i, hs)
    # the split's K / V prefetched into L2 before the wait (by default in one-token launches,
    # as the loop above ran them): no arithmetic, so the bits — at every token count, and
    # without it in a one-token launch
    prefetch = triton_attention.PREFETCH_KV
    try:
        triton_attention.PREFETCH_KV = 1 << 30
        again = triton_attention.paged_attention(q, kc, vc, tables, rows, ctx, d ** -0.5, nan(t, h, d))
        triton_attention.PREFETCH_KV = None
        alone = triton_attention.paged_attention(q[5:6].contiguous(), kc, vc, tables[5:6].contiguous(),
                                                 torch.zeros(1, dtype=torch.int32, device=DEV),
                                                 ctx[5:6].contiguous(), d ** -0.5, nan(1, h, d))
    finally:
        triton_attention.PREFETCH_KV = prefetch
    assert torch.equal(again, out) and torch.equal(alone[0], out[5])
    # the time stamps (bench/attn_timeline.py): the same bits, every program's in order
    programs = t * kvh * -(-128 * bs // triton_attention.SPLIT)
    trace = torch.zeros(programs, 8, dtype=torch.int64, device=DEV)
    traced = triton_attention.paged_attention(q, kc, vc, tables, rows, ctx, d ** -0.5,
                                              nan(t, h, d), trace=trace)
    assert torch.equal(traced, out)
    trace = trace.cpu()
    assert bool((trace[:, 0] > 0).all()) and bool((trace[:, 2] >= trace[:, 0]).all())
    ran = trace[:, 5] > 0  # the programs whose split has keys: one a kv head per SPLIT keys
    assert int(ran.sum()) == sum(-(-int(c) // triton_attention.SPLIT) for c in ctx) * kvh
    assert bool((trace[ran, 2:6].diff(dim=1) >= 0).all())


@functools.lru_cache(maxsize=1)
def real_moe():
    g = torch.Generator(DEV).manual_seed(4)
    router = rand_q4(128, 2048, g)
    experts = tuple((rand_q4(1536, 2048, g, False), rand_q4(2048, 768, g, False)) for _ in range(128))
    return router, experts, moe_layout.StackedExperts.stack(experts)


def _moe(x, router, stacked):
    t = x.shape[0]
    ids = torch.full((t, 8), -5, dtype=torch.int32, device=DEV)
    wts = nan(t, 8)
    triton_moe_route.route(x, router, 8, True, ids, wts)
    inter, y = nan(t * 8, 768).half(), nan(t * 8, 2048)
    triton_moe.experts_forward(x, ids, stacked, inter, y)
    return ids, wts, triton_moe_route.combine(y, wts, nan(t, 2048))


def test_moe_at_real_shapes_and_bitwise_alone_vs_among_64():
    router, experts, stacked = real_moe()
    g = torch.Generator(DEV).manual_seed(5)
    x = torch.randn(64, 2048, generator=g, device=DEV)
    ids, wts, out = _moe(x, router, stacked)
    rids, rw, rout = triton_moe.moe_reference(x[:16], router, experts, 8, True)
    same = (ids[:16].long() == rids).all(1)  # a near-tie can pick another expert: compare the rest
    assert same.sum() >= 14
    assert rel_err(out[:16][same], rout[same]) < 5e-3
    for m in (1, 5, 40):
        assert torch.equal(_moe(x[-m:].contiguous(), router, stacked)[2], out[-m:]), m
    assert not stacked.gu_tickets.any() and not stacked.down_tickets.any()


def test_long_prefills_split_into_launches_change_no_bits(monkeypatch):
    """Split programs take SPLIT_ROWS rows per launch and the experts' CHUNK_TOKENS tokens per
    pass (bounded partials): a row's bits are those of one launch (of the one-program splits,
    for the experts at 100 tokens)."""
    router, experts, stacked = real_moe()
    g = torch.Generator(DEV).manual_seed(6)
    x = torch.randn(100, 2048, generator=g, device=DEV)
    lin = rand_q4(5120, 2048, g)
    whole_lin = triton_linear.linear(lin, x, nan(100, 5120))
    whole_moe = _moe(x, router, stacked)[2]
    monkeypatch.setattr(q4_layout, "SPLIT_ROWS", 32)
    monkeypatch.setattr(triton_moe, "CHUNK_TOKENS", 24)
    monkeypatch.setattr(triton_moe, "SEQ_MIN_TOKENS", 1 << 30)
    assert torch.equal(triton_linear.linear(lin, x, nan(100, 5120)), whole_lin)
    assert torch.equal(_moe(x, router, stacked)[2], whole_moe)


@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096), (128, 2048), (151936 // 8, 2048)])
def test_wide_row_tiles_and_one_program_splits_give_the_decode_tile_bits(n, k):
    """Many rows take the wide row tile and run a tile's K splits in one program; every row
    keeps the bits of the decode tile with its S split programs (the same MMAs per row, the
    same split ranges, the same merge order), so the engine may choose by batch size."""
    g = torch.Generator(DEV).manual_seed(n * 3 + k)
    lin = rand_q4(n, k, g)
    x = torch.randn(300, k, generator=g, device=DEV)
    res = torch.randn(300, n, generator=g, device=DEV)
    ref = triton_q4.linear(lin, x, nan(300, n), res, tile=q4_layout.LINEAR_TILE, seq=False)
    for tile, seq in ((q4_layout.LINEAR_TILE, True), (q4_layout.WIDE_TILE, True),
                      (q4_layout.WIDE_TILE, False), (None, None)):
        out = triton_q4.linear(lin, x, nan(300, n), res, tile=tile, seq=seq)
        assert torch.equal(out, ref), (lin.split, tile, seq)
    assert rel_err(ref, lin.reference(x) + res.double()) < TOL["q4"]
    assert lin.tickets is None or not lin.tickets.any()


@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096), (128, 2048), (151936 // 8, 2048)])
def test_the_swapped_tile_gives_the_decode_tile_bits(n, k, monkeypatch):
    """The weights as the MMA's A operand (q4_layout.SWAP_TILE and its narrower forms; on
    Hopper wgmma with the dequantized weights in registers): the same k16 products summed in
    the same order, so every row keeps the decode tile's bits, split or seq, at any row count;
    with SWAP_MIN_ROWS set the engine's dispatch takes it for weights below SWAP_MAX_N outputs."""
    g = torch.Generator(DEV).manual_seed(n * 7 + k)
    lin = rand_q4(n, k, g)
    for m in (1, 16, 64, 200):
        x = torch.randn(m, k, generator=g, device=DEV)
        res = torch.randn(m, n, generator=g, device=DEV)
        ref = triton_q4.linear(lin, x, nan(m, n), res, tile=q4_layout.LINEAR_TILE, seq=False)
        for bm in (16, 32, 64):
            for seq in (False, True):
                tile = dataclasses.replace(q4_layout.SWAP_TILE, bm=bm)
                out = triton_q4.linear(lin, x, nan(m, n), res, tile=tile, seq=seq)
                assert torch.equal(out, ref), (m, tile.name, seq)
        monkeypatch.setattr(q4_layout, "SWAP_MIN_ROWS", 2)
        monkeypatch.setattr(q4_layout, "SWAP_MAX_N", n + 1)
        assert triton_q4.plan(lin, m)[0] == (q4_layout.SWAP_TILE if m >= 2 else q4_layout.LINEAR_TILE)
        assert torch.equal(triton_linear.linear(lin, x, nan(m, n), res), ref)
        monkeypatch.setattr(q4_layout, "SWAP_MIN_ROWS", None)
    assert lin.tickets is None or not lin.tickets.any()


def test_moe_wide_tiles_and_one_program_splits_give_the_split_programs_bits():
    router, experts, stacked = real_moe()
    g = torch.Generator(DEV).manual_seed(9)
    x = torch.randn(300, 2048, generator=g, device=DEV)
    ids, wts = torch.full((300, 8), -5, dtype=torch.int32, device=DEV), nan(300, 8)
    triton_moe_route.route(x, router, 8, True, ids, wts)
    wide = q4_layout.Q4Tile(bm=q4_layout.WIDE_TILE.bm)
    outs = []
    for tile, seq in ((stacked.tile, False), (stacked.tile, True), (wide, True), (None, None)):
        inter, y = nan(2400, 768).half(), nan(2400, 2048)
        triton_moe.experts_forward(x, ids, stacked, inter, y, tile=tile, seq=seq)
        outs.append((inter, y))
    for inter, y in outs[1:]:
        assert torch.equal(inter, outs[0][0]) and torch.equal(y, outs[0][1])
    assert not stacked.gu_tickets.any() and not stacked.down_tickets.any()


DENSE_TILES = (q4_layout.DENSE_TILE, q4_layout.DENSE_WIDE_TILE)


@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096), (128, 2048)])
def test_dense_linear_gives_the_decode_tile_bits(n, k):
    """Many rows run the weight dequantized once (fp16 W.T) on a many-warp fp16 tile (wgmma):
    every row keeps the q4 tile's bits (the same fp16 weights, k steps, split ranges and merge
    order), in the nested and the one-loop form, so the engine may choose it by batch size."""
    g = torch.Generator(DEV).manual_seed(n * 5 + k)
    lin = rand_q4(n, k, g)
    m = q4_layout.DENSE_WIDE_ROWS + 77
    x = torch.randn(m, k, generator=g, device=DEV)
    res = torch.randn(m, n, generator=g, device=DEV)
    ref = triton_q4.linear(lin, x, nan(m, n), res, tile=q4_layout.WIDE_TILE, seq=True)
    assert triton_f16.plan(lin, m, x) == (q4_layout.DENSE_WIDE_TILE if n >= q4_layout.DENSE_MIN_N
                                          else None)
    assert torch.equal(triton_linear.linear(lin, x, nan(m, n), res), ref)  # the default takes it
    # flat 2: two k steps an iteration (every split here has 2k), on 3 stages (shared memory)
    forms = [(tile, flat) for tile in DENSE_TILES for flat in (0, 1)]
    forms.append((dataclasses.replace(q4_layout.DENSE_WIDE_TILE, stages=3), 2))
    for tile, flat in forms:
        out = triton_f16.linear(lin, x, nan(m, n), res, tile=tile, flat=flat)
        assert torch.equal(out, ref), (tile, flat)
    assert rel_err(ref, lin.reference(x) + res.double()) < TOL["q4"]


def test_moe_dense_experts_give_the_split_programs_bits(monkeypatch):
    """Many tokens run the experts dequantized once per call on a many-warp fp16 tile: the
    bits of the q4 expert programs, and the default takes it from DENSE_MIN_TOKENS."""
    router, experts, stacked = real_moe()
    g = torch.Generator(DEV).manual_seed(11)
    t = triton_moe.DENSE_MIN_TOKENS + 88
    x = torch.randn(t, 2048, generator=g, device=DEV)
    ids, wts = torch.full((t, 8), -5, dtype=torch.int32, device=DEV), nan(t, 8)
    triton_moe_route.route(x, router, 8, True, ids, wts)
    outs = []
    runs = [dict(tile=stacked.tile, seq=True), dict(), dict(dense=False)]
    runs += [dict(dense=True, tile=tile, flat=flat) for tile in DENSE_TILES for flat in (0, 1)]
    runs.append(dict(unrolled=True))  # k steps unrolled: gate_up 2 an iteration, down 3 (a split)
    for kw in runs:
        inter, y = nan(8 * t, 768).half(), nan(8 * t, 2048)
        if kw.get("unrolled"):
            gu, down = (dataclasses.replace(c[0], stages=3)
                        for c in (triton_moe.DENSE_GATE_UP, triton_moe.DENSE_DOWN))
            monkeypatch.setattr(triton_moe, "DENSE_GATE_UP", (gu, 2))
            monkeypatch.setattr(triton_moe, "DENSE_DOWN", (down, 3))
            triton_moe.experts_forward(x, ids, stacked, inter, y)
        else:
            triton_moe.experts_forward(x, ids, stacked, inter, y, **kw)
        outs.append((inter, y))
    assert torch.isfinite(outs[0][1]).all()
    for kw, (inter, y) in zip(runs[1:], outs[1:]):
        assert torch.equal(inter, outs[0][0]) and torch.equal(y, outs[0][1]), kw


def test_moe_direct_slots_give_the_grouped_bits(monkeypatch):
    """A few tokens run a slot per assignment (expert read from the ids, no grouping kernel):
    the grouped launch's bits, tokens sharing experts included."""
    router, experts, stacked = real_moe()
    g = torch.Generator(DEV).manual_seed(10)
    for t in (1, 2, 4):
        x = torch.randn(t, 2048, generator=g, device=DEV)
        ids = torch.stack([torch.randperm(128, generator=g, device=DEV)[:8] for _ in range(t)])
        if t > 1:
            ids[1, :4] = ids[0, 4:]  # token 1 shares four experts with token 0
        ids = ids.to(torch.int32)
        outs = []
        for direct_max in (triton_moe.DIRECT_MAX_TOKENS, 0):
            monkeypatch.setattr(triton_moe, "DIRECT_MAX_TOKENS", direct_max)
            inter, y = nan(8 * t, 768).half(), nan(8 * t, 2048)
            triton_moe.experts_forward(x, ids, stacked, inter, y)
            outs.append((inter, y))
        assert torch.isfinite(outs[0][1]).all()
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), t
    assert not stacked.gu_tickets.any() and not stacked.down_tickets.any()


def test_the_fp32_intermediate_and_the_unmasked_k_loops_give_the_same_bits(monkeypatch):
    """triton_moe.INTER_F32 and triton_q4.EVEN_STEPS at the 30B shapes: the Triton expert kernels
    with the intermediate in float32 (moe's allocation) and their K loops unmasked give the
    float16 intermediate's and the masked loops' bits — the direct split programs (2-8
    tokens), MID_TILE (9-32) and the one-warp seq tile (33+), through moe with the combine —
    and a token alone (the CUDA one-token path, fp16) its bits among 64; the q4 linear's
    Triton tiles at 16 / 64 rows (qkv, o, the router, split and seq) unmasked as masked."""
    router, experts, stacked = real_moe()
    g = torch.Generator(DEV).manual_seed(12)
    x = torch.randn(64, 2048, generator=g, device=DEV)
    for t in (2, 16, 64):
        ids, wts = torch.full((t, 8), -5, dtype=torch.int32, device=DEV), nan(t, 8)
        triton_moe_route.route(x[:t], router, 8, True, ids, wts)
        i16, y16 = nan(8 * t, 768).half(), nan(8 * t, 2048)
        monkeypatch.setattr(triton_q4, "EVEN_STEPS", False)
        triton_moe.experts_forward(x[:t], ids, stacked, i16, y16)
        i32, y32 = nan(8 * t, 768), nan(8 * t, 2048)
        monkeypatch.setattr(triton_q4, "EVEN_STEPS", True)
        triton_moe.experts_forward(x[:t], ids, stacked, i32, y32)
        assert torch.equal(i32.half(), i16) and torch.equal(y32, y16) and torch.isfinite(y32).all(), t
    for n, k in ((5120, 2048), (2048, 4096), (128, 2048)):
        lin = rand_q4(n, k, g)
        xs = torch.randn(64, k, generator=g, device=DEV)
        for m in (16, 64):
            outs = []
            for on in (False, True):
                monkeypatch.setattr(triton_q4, "EVEN_STEPS", on)
                outs.append(triton_linear.linear(lin, xs[:m], nan(m, n)))
            assert torch.equal(outs[0], outs[1]) and torch.isfinite(outs[1]).all(), (n, m)
    monkeypatch.setattr(triton_moe, "INTER_F32", True)
    assert triton_moe.moe_inter_dtype(x, 64, 8, stacked) == torch.float32
    among = triton_moe.moe(x, router, stacked, 8, True)
    for m in (1, 5):
        assert torch.equal(triton_moe.moe(x[-m:].contiguous(), router, stacked, 8, True), among[-m:]), m
    monkeypatch.setattr(triton_moe, "INTER_F32", False)
    assert torch.equal(triton_moe.moe(x, router, stacked, 8, True), among)


def test_pdl_launches_change_no_bits_in_a_graph(monkeypatch):
    """Programmatic dependent launch (each kernel waits on the previous one, weights prefetched
    into L2 before the wait) changes no bit: a layer's chain of kernels captured in a CUDA
    graph, against plain eager launches."""
    router, experts, stacked = real_moe()
    g = torch.Generator(DEV).manual_seed(8)
    x = torch.randn(64, 2048, generator=g, device=DEV)
    w = torch.randn(2048, generator=g, device=DEV)
    qkv, o = rand_q4(5120, 2048, g), rand_q4(2048, 4096, g)

    def chain(x):  # norm → linear (split 8) → linear (split 16) with residual → MoE
        h = triton_linear.linear(qkv, triton_norm.rms_norm(x, w, 1e-6))
        h = triton_linear.linear(o, h[:, :4096].contiguous(), residual=x)  # [T, 2048]
        return triton_moe.moe(triton_norm.rms_norm(h, w, 1e-6), router, stacked, 8, True, h)

    monkeypatch.setattr(triton_pdl, "ENABLED", False)
    plain = {m: chain(x[:m].contiguous()) for m in (1, 64)}
    monkeypatch.setattr(triton_pdl, "ENABLED", True)
    for m in (1, 64):
        xs = x[:m].contiguous()
        chain(xs)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(xs)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, plain[m]), m
    assert not stacked.gu_tickets.any() and not stacked.down_tickets.any()


# ---- the engine on CUDA -------------------------------------------------------------------------
def test_engine_cuda_matches_cpu_greedy_tokens():
    from replica.core import EngineCore
    from replica.config import EngineConfig

    specs = [StreamSpec(tuple(range(3 + i, 40 + 7 * i, 3)), 24) for i in range(6)]
    got = {}
    for dev in ("cpu", "cuda"):
        core = EngineCore(EngineConfig(model="synthetic:tiny-qwen3-moe", device=dev,
                                       num_kv_blocks=256, block_size=16), loaded=loaded("tiny-qwen3-moe"))
        got[dev] = run_schedule(core, specs, check_kv=False)[0]
    assert got["cpu"] == got["cuda"]


def _others(n: int, vocab: int) -> list[StreamSpec]:
    g = torch.Generator().manual_seed(n)
    return [StreamSpec(tuple(torch.randint(0, min(vocab, 256), (int(torch.randint(1, 30, (1,), generator=g)),),
                                           generator=g).tolist()),
                       int(torch.randint(1, 12, (1,), generator=g)),
                       arrival=int(torch.randint(0, 4, (1,), generator=g)))
            for _ in range(n)]


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "qwen3-30b-a3b-int4"])
def test_stream_alone_vs_among_1_to_64_others_bitwise(preset):
    model = loaded(preset, "cuda")
    kw = dict(device="cuda", num_kv_blocks=2048, block_size=16, max_running_streams=65,
              max_batch_tokens=256, poison_freed_kv=True)
    spec = StreamSpec((11, 22, 33, 44, 55, 66, 77, 88, 99), 10)
    solo_tokens, solo_logits = run_solo(small_core(model, **kw), spec)
    assert len(solo_logits) == 10
    for n in (1, 7, 31, 64):
        core = small_core(model, **kw)
        specs = _others(n, model.config.vocab_size)
        specs.insert(n // 2, StreamSpec(spec.prompt, spec.max_tokens, arrival=1))
        tokens, logits = run_schedule(core, specs, check_kv=False)
        assert tokens[n // 2] == solo_tokens, n
        assert logits[n // 2] == solo_logits, f"{n} others: logit bits differ from the solo run"
        assert core.runner.graphs._graphs, "decode steps should have used CUDA graphs"


def test_the_fused_direct_moe_gives_the_three_kernels_bits(monkeypatch):
    """triton_moe.FUSED: gate_up, down and the combine of 1-7 direct tokens as one launch of
    claimed work items, eager and in a CUDA graph with PDL: the three kernels' bits; every
    counter back at zero."""
    router, experts, stacked = real_moe()
    g = torch.Generator(DEV).manual_seed(10)
    for t in (1, 4, 7):
        x = torch.randn(t, 2048, generator=g, device=DEV)
        h = torch.randn(t, 2048, generator=g, device=DEV)
        want = triton_moe.moe(x, router, stacked, 8, True, h)
        monkeypatch.setattr(triton_moe, "FUSED", True)
        assert triton_moe.fused_fits(t, 8, stacked)
        assert torch.equal(triton_moe.moe(x, router, stacked, 8, True, h), want), t
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = triton_moe.moe(x, router, stacked, 8, True, h)
        for _ in range(3):
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want), t
        monkeypatch.setattr(triton_moe, "FUSED", False)
        assert not stacked.sync.any() and not stacked.gu_tickets.any() and not stacked.down_tickets.any()
