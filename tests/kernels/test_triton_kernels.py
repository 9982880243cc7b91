"""Every Triton kernel under TRITON_INTERPRET=1 (CPU, numpy) at tiny shapes: against float64
references with NaN-poisoned outputs, and bitwise batch invariance (a row alone vs among others,
at other positions) for linear, attention and MoE. Ends with the fused CUDA forward of a tiny
qwen3_moe, interpreted, against the CPU engine: greedy tokens equal.

The GPU runs the same kernels at real shapes in tests/kernels/test_gpu.py.
"""

from __future__ import annotations

import os
import sys

import pytest

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported without TRITON_INTERPRET=1; run this file in its own process",
                allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels are then interpreted
pytest.importorskip("triton")

import torch  # noqa: E402

from kernels import cpu  # noqa: E402
from kernels import (moe_layout, q4_layout, triton_attention, triton_f16, triton_linear,  # noqa: E402
                     triton_moe, triton_moe_route, triton_norm, triton_q4)
from kernels.linear import Linear, quantize_q4, quantize_q8  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def fixed_order_dot():
    """The interpreter's tl.dot in one summation order, k ascending, whatever the operands'
    shapes: the MMA's order within a k step is the hardware's and does not follow the tile,
    and the tests here compare tiles of other shapes bit for bit. Triton's own dot is numpy's
    matmul, whose order is OpenBLAS's per CPU and shape (on AMD EPYC with AVX2 the swapped
    tile's transposed product then sums in another order than the decode tile's)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not (a.dtype == b.dtype == tl.float16):
            return plain(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = d.data.dtype
        # fp16 x fp16 products are exact in fp32; cumsum adds them in k order, one at a time
        prod = a.data.astype(acc)[..., :, :, None] * b.data.astype(acc)[..., None, :, :]
        total = np.cumsum(prod, axis=-2, dtype=acc)[..., -1, :]
        return interpreter.TensorHandle(total + d.data, d.dtype.scalar)

    plain = interpreter.InterpreterBuilder.create_dot
    interpreter.InterpreterBuilder.create_dot = dot
    yield
    interpreter.InterpreterBuilder.create_dot = plain


FORMATS = {"f32": Linear.dense, "q4": quantize_q4, "q8": quantize_q8}
TOL = {"f32": 1e-5, "q4": 5e-3, "q8": 5e-3}  # ‖out − ref‖ / ‖ref‖: exact fp32 dot vs fp16 operands


def nan(*shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "an output element is NaN/inf (unwritten or wrong)"
    return float((out.double() - ref).norm() / ref.norm())


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- linear -------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("n,k,m", [(48, 64, 1), (80, 160, 19)])
def test_linear_matches_float64_reference(fmt, n, k, m):
    g = gen(n * k + m)
    lin = triton_linear.to_gpu_format(FORMATS[fmt](torch.randn(n, k, generator=g)))
    x = torch.randn(m, k, generator=g)
    res = torch.randn(m, n, generator=g)
    out = triton_linear.linear(lin, x, nan(m, n))
    assert rel_err(out, lin.reference(x)) < TOL[fmt]
    out = triton_linear.linear(lin, x, nan(m, n), residual=res)
    assert rel_err(out, lin.reference(x) + res.double()) < TOL[fmt]


@pytest.mark.parametrize("n,k,m", [(48, 64, 1), (80, 160, 19), (72, 1024, 3)])
def test_q4_split_k_matches_float64_and_leaves_tickets_at_zero(n, k, m):
    """The re-packed q4 GEMM with its shape's K split (3 and 16 here, the last split of (80, 160)
    a partial k step): within the q4 bound, NaN never passes, counters reset for the next call."""
    g = gen(n + k + m)
    lin = triton_linear.to_gpu_format(quantize_q4(torch.randn(n, k, generator=g)))
    assert lin.split == {64: 1, 160: 3, 1024: 16}[k]
    x = torch.randn(m, k, generator=g)
    res = torch.randn(m, n, generator=g)
    for _ in range(2):
        out = triton_linear.linear(lin, x, nan(m, n), residual=res)
        assert rel_err(out, lin.reference(x) + res.double()) < TOL["q4"]
        assert lin.tickets is None or not lin.tickets.any()


def test_q4_repack_keeps_every_weight_and_the_split_ignores_the_batch():
    g = gen(9)
    base = quantize_q4(torch.randn(96, 256, generator=g))
    lin = triton_linear.to_gpu_format(base)
    assert torch.equal(lin.dequantize(), base.dequantize())
    ids = torch.tensor([5, 0, 95])
    assert torch.equal(lin.rows(ids), base.rows(ids))
    tile = q4_layout.LINEAR_TILE
    assert q4_layout.split_count(96, 256, tile) == 4 and q4_layout.split_count(151936, 2048, tile) == 1
    assert q4_layout.Q4Tile.parse(tile.name) == tile
    for bad in ("16x64w1", "16x64x100w1", "8x64x128w1"):
        with pytest.raises(ValueError):
            q4_layout.Q4Tile.parse(bad)


def test_q4_row_is_bitwise_independent_of_its_batch_with_split_k(monkeypatch):
    g = gen(10)
    lin = triton_linear.to_gpu_format(quantize_q4(torch.randn(72, 512, generator=g)))
    assert lin.split > 1
    row = torch.randn(1, 512, generator=g)
    alone = triton_linear.linear(lin, row, nan(1, 72))
    for batch, pos in ((1, 1), (20, 17)):
        others = torch.randn(batch, 512, generator=g)
        x = torch.cat([others[:pos], row, others[pos:]])
        assert torch.equal(triton_linear.linear(lin, x, nan(batch + 1, 72))[pos], alone[0])
    monkeypatch.setattr(q4_layout, "SPLIT_ROWS", 16)  # long prefills go several launches
    assert torch.equal(triton_linear.linear(lin, x, nan(batch + 1, 72))[pos], alone[0])


@pytest.mark.parametrize("n,k", [(72, 512), (80, 160)])
def test_q4_one_program_per_tile_gives_the_bits_of_the_split_programs(n, k, monkeypatch):
    """seq: a program runs its tile's S K-splits itself and sums them in split order (no
    partials in memory) — the bits of S programs and the ticketed sum, so many-row batches
    may take it while a lone row does not."""
    g = gen(n + k)
    lin = triton_linear.to_gpu_format(quantize_q4(torch.randn(n, k, generator=g)))
    assert lin.split > 1
    x = torch.randn(21, k, generator=g)
    res = torch.randn(21, n, generator=g)
    tile = q4_layout.LINEAR_TILE
    split = triton_q4.linear(lin, x, nan(21, n), res, tile=tile, seq=False)
    one = triton_q4.linear(lin, x, nan(21, n), res, tile=tile, seq=True)
    assert torch.equal(one, split) and not lin.tickets.any()
    assert rel_err(one, lin.reference(x) + res.double()) < TOL["q4"]
    assert triton_q4.plan(lin, 1) == (q4_layout.SWAP_TILE, False)  # a small weight: swapped
    monkeypatch.setattr(q4_layout, "SWAP_MIN_ROWS", None)
    assert triton_q4.plan(lin, 1) == (tile, False)
    assert triton_q4.plan(lin, q4_layout.SEQ_MIN_ROWS)[1]
    with pytest.raises(ValueError, match="split tile"):
        triton_q4.linear(lin, x, nan(21, n), tile=q4_layout.Q4Tile(nb=4))


@pytest.mark.parametrize("n,k,m", [(72, 160, 5), (96, 512, 70)])
def test_q4_swapped_tile_gives_the_decode_tile_bits(n, k, m, monkeypatch):
    """The weights as the MMA's A operand (SWAP_TILE, its tile computed transposed), split and
    seq, with a residual: the decode tile's bits here (the GPU test checks the MMAs' own) and
    the float64 reference within the q4 bound; the dispatch takes it from SWAP_MIN_ROWS."""
    g = gen(n + k + m)
    lin = triton_linear.to_gpu_format(quantize_q4(torch.randn(n, k, generator=g)))
    assert lin.split > 1
    x = torch.randn(m, k, generator=g)
    res = torch.randn(m, n, generator=g)
    ref = triton_q4.linear(lin, x, nan(m, n), res, tile=q4_layout.LINEAR_TILE, seq=False)
    for seq in (False, True):
        out = triton_q4.linear(lin, x, nan(m, n), res, tile=q4_layout.SWAP_TILE, seq=seq)
        assert torch.equal(out, ref), seq
    assert rel_err(ref, lin.reference(x) + res.double()) < TOL["q4"] and not lin.tickets.any()
    assert q4_layout.Q4Tile.parse(q4_layout.SWAP_TILE.name) == q4_layout.SWAP_TILE
    assert q4_layout.SWAP_TILE.name.endswith("t") and q4_layout.SWAP_TILE.swap
    monkeypatch.setattr(q4_layout, "SWAP_MIN_ROWS", 2)
    assert triton_q4.plan(lin, m)[0] == q4_layout.SWAP_TILE and triton_q4.plan(lin, 1)[0] == q4_layout.LINEAR_TILE
    assert torch.equal(triton_linear.linear(lin, x, nan(m, n), res), ref)
    monkeypatch.setattr(q4_layout, "SWAP_MAX_N", n)  # only weights with fewer outputs take it
    assert triton_q4.plan(lin, m)[0] == q4_layout.LINEAR_TILE


@pytest.mark.parametrize("n,k,m", [(128, 512, 5), (64, 256, 21)])
def test_q4_unmasked_k_loop_gives_the_masked_loops_bits(n, k, m, monkeypatch):
    """EVEN_STEPS: a weight that fills its tiles (`even`: whole k steps, N a multiple of BN)
    runs the K loop without k / column masks — the split programs, the seq programs and the
    swapped tile give the masked loop's bits; one that does not keeps the masks."""
    g = gen(n + k + m)
    lin = triton_linear.to_gpu_format(quantize_q4(torch.randn(n, k, generator=g)))
    tile = q4_layout.LINEAR_TILE
    assert lin.split > 1 and triton_q4.even(n, k, tile.bn, tile.nb)
    assert not triton_q4.even(80, 160, tile.bn, tile.nb) and not triton_q4.even(72, 512, tile.bn, tile.nb)
    x, res = torch.randn(m, k, generator=g), torch.randn(m, n, generator=g)
    asked = []
    real_even = triton_q4.even
    monkeypatch.setattr(triton_q4, "even", lambda *a: asked.append(a) or real_even(*a))
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(triton_q4, "EVEN_STEPS", on)
        outs[on] = [triton_q4.linear(lin, x, nan(m, n), res, tile=t, seq=seq)
                    for t, seq in ((tile, False), (tile, True), (q4_layout.SWAP_TILE, False))]
    assert (n, k, tile.bn, tile.nb) in asked  # the launch asked, with EVEN_STEPS on
    for a, b in zip(outs[False], outs[True]):
        assert torch.equal(a, b) and not a.isnan().any()
    assert rel_err(outs[True][0], lin.reference(x) + res.double()) < TOL["q4"] and not lin.tickets.any()


SMALL_DENSE = q4_layout.Q4Tile(bm=16, bn=32, nb=2, warps=4, stages=2)  # the interpreter's size


def test_q4_dequantize_gives_the_weight_the_q4_tile_multiplies():
    """fp16 W.T [K, N] (and a stack of experts [E, K, N]) from the re-packed q4 bytes: every
    element at its place, within fp16 rounding of q * scale + min (the kernel's own line)."""
    g = gen(21)
    lins = [triton_linear.to_gpu_format(quantize_q4(torch.randn(40, 96, generator=g)))
            for _ in range(3)]
    wt = triton_f16.dequantize(lins[0].qs, lins[0].sm)
    assert wt.dtype == torch.float16 and wt.shape == (96, 40)
    ref = lins[0].dequantize()
    torch.testing.assert_close(wt.float().T, ref, rtol=2e-3, atol=2e-3 * float(ref.abs().max()))
    stack = triton_f16.dequantize(torch.stack([x.qs for x in lins]), torch.stack([x.sm for x in lins]))
    assert stack.shape == (3, 96, 40) and torch.equal(stack[0], wt)
    assert torch.equal(stack[2], triton_f16.dequantize(lins[2].qs, lins[2].sm))


@pytest.mark.parametrize("n,k", [(72, 512), (80, 192), (72, 2048)])
def test_q4_dense_linear_matches_the_q4_tile(n, k):
    """The weight dequantized once and fp16 MMAs on a many-warp tile, with the q4 tile's split
    ranges and merge order: the q4 tile's values (its bits on the GPU, tests/kernels/
    test_gpu.py; the interpreter's numpy dot of K = 64 rounds otherwise than two of K = 16).
    The one-loop form (FLAT) gives the nested loops' bits."""
    g = gen(n + k + 1)
    lin = triton_linear.to_gpu_format(quantize_q4(torch.randn(n, k, generator=g)))
    assert lin.split > 1
    x = torch.randn(37, k, generator=g)
    res = torch.randn(37, n, generator=g)
    q4 = triton_q4.linear(lin, x, nan(37, n), res, tile=q4_layout.LINEAR_TILE, seq=True)
    nested = triton_f16.linear(lin, x, nan(37, n), res, tile=SMALL_DENSE)
    flat = triton_f16.linear(lin, x, nan(37, n), res, tile=SMALL_DENSE, flat=1)
    steps = k // (lin.split * SMALL_DENSE.bk)  # (72, 2048): 2 k steps a split
    unrolled = triton_f16.linear(lin, x, nan(37, n), res, tile=SMALL_DENSE, flat=steps)
    assert torch.equal(flat, nested) and torch.equal(unrolled, nested)
    with pytest.raises(ValueError, match="divide"):
        triton_f16.linear(lin, x, nan(37, n), res, tile=SMALL_DENSE, flat=steps + 1)
    with pytest.raises(ValueError, match="shared memory"):  # 8 stages of 128 x 128: 256 KB
        triton_f16.linear(lin, x, nan(37, n), res, tile=q4_layout.Q4Tile(128, 128, 2, 8, 8),
                          flat=1)
    assert rel_err(nested, q4.double()) < 1e-6
    assert rel_err(nested, lin.reference(x) + res.double()) < TOL["q4"]
    assert triton_f16.plan(lin, 1 << 20, x) is None  # CPU tensors: never chosen by the engine
    with pytest.raises(ValueError, match="split tile"):
        triton_f16.linear(lin, x, nan(37, n), tile=q4_layout.Q4Tile(nb=4, warps=4))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_linear_row_is_bitwise_independent_of_its_batch(fmt):
    g = gen(1)
    lin = triton_linear.to_gpu_format(FORMATS[fmt](torch.randn(40, 128, generator=g)))
    row = torch.randn(1, 128, generator=g)
    alone = triton_linear.linear(lin, row, nan(1, 40))
    for batch, pos in ((1, 1), (5, 2), (20, 17)):
        others = torch.randn(batch, 128, generator=g)
        x = torch.cat([others[:pos], row, others[pos:]])
        assert torch.equal(triton_linear.linear(lin, x, nan(batch + 1, 40))[pos], alone[0])


def test_gpu_storage_is_exact_for_fp16_scales():
    """GGUF-like scales (fp16 values) survive the fp16 GPU storage bit for bit."""
    for quant in (quantize_q4, quantize_q8):
        lin = quant(torch.randn(32, 64, generator=gen(2)))  # scales/mins fp16-representable
        assert torch.equal(triton_linear.to_gpu_format(lin).dequantize(), lin.dequantize())


# ---- norms ----------------------------------------------------------------------------------------
def test_rms_norm_silu_mul_softmax_match_float64():
    g = gen(3)
    x = torch.randn(5, 96, generator=g) * 3
    w = torch.randn(96, generator=g)
    out = triton_norm.rms_norm(x, w, 1e-6, nan(5, 96))
    assert rel_err(out, cpu.rms_norm_reference(x, w, 1e-6)) < 1e-6
    gu = torch.randn(4, 200, generator=g) * 4
    out = triton_norm.silu_mul(gu[:, :100], gu[:, 100:], nan(4, 100))
    gd, ud = gu[:, :100].double(), gu[:, 100:].double()
    assert rel_err(out, gd * torch.sigmoid(gd) * ud) < 1e-6
    logits = torch.randn(3, 70, generator=g) * 5
    out = triton_norm.softmax(logits, nan(3, 70))
    assert rel_err(out, torch.softmax(logits.double(), -1)) < 1e-6


@pytest.mark.parametrize("qk_norm", [True, False])
def test_early_inputs_change_no_output_of_the_norm_and_rope_kernels(monkeypatch, qk_norm):
    """triton_pdl.EARLY_INPUTS moves loads before the PDL wait and nothing else: the RMSNorm
    and the q/k norm + RoPE + KV store give the same bits with and without it (the interpreter
    runs the EARLY code path; the wait itself is compiled away there)."""
    from kernels import triton_pdl

    g = gen(19)
    h, kvh, t, d, nb, bs = 9, 3, 3, 16, 4, 4
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g)
    positions = torch.tensor([0, 5, 9])
    ang = torch.randn(12, d, generator=g)
    qn, kn = (torch.randn(d, generator=g), torch.randn(d, generator=g)) if qk_norm else (None, None)
    x, w = torch.randn(5, 96, generator=g), torch.randn(96, generator=g)
    outs = []
    for early in (False, True):
        monkeypatch.setattr(triton_pdl, "early", lambda _t, on=early: on)
        kc, vc = nan(nb, bs, kvh, d), nan(nb, bs, kvh, d)
        q = triton_norm.qkv_rope_store(qkv, positions, ang.cos(), ang.sin(), qn, kn, 1e-6,
                                       torch.tensor([3, 9, -1]), kc, vc, h, nan(t, h, d))
        outs.append((q, kc, vc, triton_norm.rms_norm(x, w, 1e-6, nan(5, 96))))
    for a, b in zip(*outs):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


@pytest.mark.parametrize("qk_norm,kv_dtype,h,kvh", [(True, torch.float32, 4, 2),
                                                    (False, torch.float32, 4, 2),
                                                    (True, torch.bfloat16, 4, 2),
                                                    (True, torch.float32, 9, 3)])
def test_qkv_rope_store_matches_reference_and_writes_only_its_slots(qk_norm, kv_dtype, h, kvh):
    """(9, 3): SmolLM2's head counts: two programs of query heads, the second with one live
    row, and three key heads padded to four."""
    g = gen(4)
    t, d, nb, bs = 3, 16, 4, 4
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g)
    positions = torch.tensor([0, 5, 9])
    ang = torch.randn(12, d, generator=g)
    cos, sin = ang.cos(), ang.sin()
    qn, kn = (torch.randn(d, generator=g), torch.randn(d, generator=g)) if qk_norm else (None, None)
    slots = torch.tensor([3, 9, -1])  # the last token is padding: it writes nothing
    kc, vc = nan(nb, bs, kvh, d, dtype=kv_dtype), nan(nb, bs, kvh, d, dtype=kv_dtype)
    q = triton_norm.qkv_rope_store(qkv, positions, cos, sin, qn, kn, 1e-6, slots, kc, vc, h,
                                   nan(t, h, d))
    rq, rk, rv = triton_norm.qkv_rope_reference(qkv, positions, cos, sin, qn, kn, 1e-6, h, kvh)
    assert rel_err(q, rq) < 1e-6
    flat_k, flat_v = kc.view(-1, kvh, d), vc.view(-1, kvh, d)
    # bf16: 8 significant bits (the interpreter truncates; the GPU rounds to nearest, and
    # tests/kernels/test_gpu.py checks V bit for bit there)
    tol = 1e-6 if kv_dtype == torch.float32 else 8e-3
    assert rel_err(flat_k[[3, 9]].float(), rk[:2]) < tol
    assert rel_err(flat_v[[3, 9]].float(), rv[:2]) < tol
    untouched = [i for i in range(nb * bs) if i not in (3, 9)]
    assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all()


# ---- attention ------------------------------------------------------------------------------------
def _paged_setup(g, h=4, kvh=2, d=16, nb=52, bs=4, rows=3, mb=16, dtype=torch.float32):
    kc = torch.randn(nb, bs, kvh, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, kvh, d, generator=g).to(dtype)
    tables = torch.randperm(nb, generator=g)[: rows * mb].view(rows, mb).to(torch.int32).contiguous()
    return kc, vc, tables


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_float64_with_splits_and_padding(kv_dtype):
    g = gen(5)
    kc, vc, tables = _paged_setup(g, dtype=kv_dtype)
    tok_row = torch.tensor([0, 0, 1, 2, 1], dtype=torch.int32)
    ctx = torch.tensor([1, 7, 64, 45, 0], dtype=torch.int32)  # 45, 64 > split 32; 45 < 64 < split 64 * 2
    q = torch.randn(5, 4, 16, generator=g)
    split = 32 if kv_dtype == torch.float32 else 64
    out = triton_attention.paged_attention(q, kc, vc, tables, tok_row, ctx, 0.3, nan(5, 4, 16),
                                           split=split)
    ref = cpu.paged_attention_reference(q[:4], kc, vc, tables, tok_row[:4], ctx[:4], 0.3)
    assert rel_err(out[:4], ref) < (1e-6 if kv_dtype == torch.float32 else 2e-5)
    assert torch.equal(out[4], torch.zeros(4, 16))  # padding token (ctx 0): defined zeros


def test_the_attention_probes_run_and_the_table_free_one_keeps_the_bits(monkeypatch):
    """triton_attention.PROBE (bench only, bench/attn_timeline.py): every probe runs; 4 (the
    blocks computed, not read) gives the kernel's bits where the table is the identity, and a
    probe that drops a dot gives other values (so the probes do leave their part out)."""
    g = gen(26)
    kc, vc, _ = _paged_setup(g, dtype=torch.bfloat16)
    tables = torch.arange(48, dtype=torch.int32).view(3, 16)
    tok_row = torch.tensor([0, 1, 2], dtype=torch.int32)
    ctx = torch.tensor([64, 33, 7], dtype=torch.int32)
    q = torch.randn(3, 4, 16, generator=g)
    out = {}
    for probe in (0, 1, 2, 3, 4):
        monkeypatch.setattr(triton_attention, "PROBE", probe)
        out[probe] = triton_attention.paged_attention(q, kc, vc, tables, tok_row, ctx, 0.3,
                                                      nan(3, 4, 16), split=64)
        assert torch.isfinite(out[probe]).all(), probe
    assert torch.equal(out[4], out[0])
    assert not torch.allclose(out[1], out[0]) and not torch.allclose(out[2], out[0])


def test_paged_attention_token_is_bitwise_independent_of_batch_and_table_width():
    g = gen(6)
    kc, vc, tables = _paged_setup(g)
    q = torch.randn(4, 4, 16, generator=g)
    ctx = torch.tensor([61, 5, 40, 9], dtype=torch.int32)
    rows = torch.tensor([2, 0, 1, 0], dtype=torch.int32)
    alone = triton_attention.paged_attention(q[:1], kc, vc, tables[2:3].contiguous(),
                                             torch.zeros(1, dtype=torch.int32), ctx[:1], 0.3,
                                             nan(1, 4, 16), split=32)
    wide = torch.cat([tables, torch.zeros(3, 16, dtype=torch.int32)], 1).contiguous()  # more splits
    for tab in (tables, wide):
        out = triton_attention.paged_attention(q, kc, vc, tab, rows, ctx, 0.3, nan(4, 4, 16),
                                               split=32)
        assert torch.equal(out[0], alone[0])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_bits_do_not_depend_on_how_a_kv_heads_query_heads_are_dealt(kv_dtype):
    """head_split (HEAD_SPLIT_PROGRAMS): a kv head's 4 query heads over 1, 2 or 4 programs —
    a head is one row of the score tile and every reduction is per row, so the same bits."""
    g = gen(16)
    kc, vc, tables = _paged_setup(g, h=8, kvh=2, dtype=kv_dtype)
    tok_row = torch.tensor([0, 2, 1], dtype=torch.int32)
    ctx = torch.tensor([61, 5, 64], dtype=torch.int32)
    q = torch.randn(3, 8, 16, generator=g)
    split = 32 if kv_dtype == torch.float32 else 64
    want = triton_attention.paged_attention(q, kc, vc, tables, tok_row, ctx, 0.3, nan(3, 8, 16),
                                            split=split, head_split=1)
    for hs in (2, 4):
        got = triton_attention.paged_attention(q, kc, vc, tables, tok_row, ctx, 0.3,
                                               nan(3, 8, 16), split=split, head_split=hs)
        assert torch.equal(got, want), hs
    with pytest.raises(ValueError, match="must divide"):
        triton_attention.paged_attention(q, kc, vc, tables, tok_row, ctx, 0.3, split=split,
                                         head_split=3)
    assert [triton_attention.head_splits(p, 8) for p in (4, 100, 200)] == [1, 1, 1]  # off


def test_head_splits_double_until_the_launch_has_its_programs(monkeypatch):
    monkeypatch.setattr(triton_attention, "HEAD_SPLIT_PROGRAMS", 128)
    assert [triton_attention.head_splits(p, 8) for p in (4, 16, 40, 64, 128, 500)] == [8, 8, 4, 2, 1, 1]
    assert triton_attention.head_splits(4, 6) == 2  # a divisor of the group


# ---- MoE ------------------------------------------------------------------------------------------
def _moe_setup(fmt, g, e=8, hidden=64, inter=32):
    mk = FORMATS[fmt]
    router = triton_linear.to_gpu_format(mk(torch.randn(e, hidden, generator=g)))
    experts = tuple((mk(torch.randn(2 * inter, hidden, generator=g) / 8),
                     mk(torch.randn(hidden, inter, generator=g) / 6)) for _ in range(e))
    return router, experts, moe_layout.StackedExperts.stack(experts)


def _routed(g, size, t):
    """q4 experts (hidden = inter = size), t random tokens and their top-2 routing:
    (router, experts, stacked, x, ids, wts)."""
    router, experts, stacked = _moe_setup("q4", g, hidden=size, inter=size)
    x = torch.randn(t, size, generator=g)
    ids, wts = torch.full((t, 2), -5, dtype=torch.int32), nan(t, 2)
    triton_moe_route.route(x, router, 2, True, ids, wts)
    return router, experts, stacked, x, ids, wts


def _moe(x, router, stacked, top_k, residual=None, tile=None):
    t = x.shape[0]
    ids, wts = torch.full((t, top_k), -5, dtype=torch.int32), nan(t, top_k)
    triton_moe_route.route(x, router, top_k, True, ids, wts)
    inter = nan(t * top_k, stacked.inter).to(moe_layout.inter_dtype(stacked))
    y = nan(t * top_k, stacked.hidden)
    triton_moe.experts_forward(x, ids, stacked, inter, y, tile=tile)
    return ids, wts, triton_moe_route.combine(y, wts, nan(t, stacked.hidden), residual)


@pytest.mark.parametrize("fmt,hidden,inter", [("f32", 64, 32), ("q4", 64, 32), ("q4", 256, 256)])
def test_moe_matches_float64_reference(fmt, hidden, inter):
    """(q4, 256, 256): gate_up and down both split K in four."""
    g = gen(7)
    router, experts, stacked = _moe_setup(fmt, g, hidden=hidden, inter=inter)
    assert (stacked.gu_split, stacked.down_split) == ((4, 4) if inter == 256 else (1, 1))
    x = torch.randn(6, hidden, generator=g)
    res = torch.randn(6, hidden, generator=g)
    ids, wts, out = _moe(x, router, stacked, 2, res)
    rids, rw, rout = triton_moe.moe_reference(x, router, experts, 2, True)
    assert torch.equal(ids, rids.to(torch.int32))
    assert rel_err(wts, rw) < TOL[fmt] and rel_err(out - res, rout) < TOL[fmt]
    if stacked.gu_tickets is not None:
        assert not stacked.gu_tickets.any() and not stacked.down_tickets.any()


@pytest.mark.parametrize("t", [3, 12])  # the direct split programs; the grouped seq programs
def test_the_fp32_intermediate_and_the_unmasked_k_loop_give_the_experts_bits(t, monkeypatch):
    """experts_forward with the intermediate in float32 (triton_moe.INTER_F32's route) and the
    K loops unmasked (triton_q4.EVEN_STEPS: gate_up 256 x 128 and down 128 x 128 fill their
    tiles; K split in two) against the fp16 intermediate and the masked loops: gate_up's fp32
    values round (nearest even) to the fp16 ones, and y is bitwise the same. moe_inter_dtype
    picks float32 for q4 experts off the CUDA one-token and dense paths when INTER_F32 is on."""
    g = gen(11)
    router, experts, stacked = _moe_setup("q4", g, hidden=128, inter=128)
    assert (stacked.gu_split, stacked.down_split) == (2, 2)
    x = torch.randn(t, 128, generator=g)
    ids, wts = torch.full((t, 2), -5, dtype=torch.int32), nan(t, 2)
    triton_moe_route.route(x, router, 2, True, ids, wts)
    i16, y16 = nan(2 * t, 128).to(torch.float16), nan(2 * t, 128)
    triton_moe.experts_forward(x, ids, stacked, i16, y16)
    asked = []
    real_even = triton_q4.even
    monkeypatch.setattr(triton_q4, "even", lambda *a: asked.append(a[:2]) or real_even(*a))
    monkeypatch.setattr(triton_q4, "EVEN_STEPS", True)
    i32, y32 = nan(2 * t, 128), nan(2 * t, 128)
    triton_moe.experts_forward(x, ids, stacked, i32, y32)
    assert sorted(asked) == [(128, 128), (256, 128)]  # the launches asked
    assert torch.equal(i32.to(torch.float16), i16) and not torch.equal(i32, i16.float())
    assert torch.equal(y32, y16) and not y32.isnan().any()
    monkeypatch.setattr(triton_moe, "INTER_F32", True)
    assert triton_moe.moe_inter_dtype(x, t, 2, stacked) == torch.float32
    monkeypatch.setattr(triton_moe, "INTER_F32", False)
    assert triton_moe.moe_inter_dtype(x, t, 2, stacked) == torch.float16
    _, _, f32_stacked = _moe_setup("f32", g)
    assert triton_moe.moe_inter_dtype(x, t, 2, f32_stacked) == torch.float32
    with pytest.raises(ValueError, match="float16 for q8"):
        _, _, q8_stacked = _moe_setup("q8", g)
        triton_moe.experts_forward(torch.randn(t, 64, generator=g), ids, q8_stacked,
                                   nan(2 * t, 32), nan(2 * t, 64))


@pytest.mark.parametrize("hidden,inter", [(64, 32), (256, 256)])
def test_moe_token_is_bitwise_independent_of_its_batch(hidden, inter, monkeypatch):
    """(256, 256): both expert GEMMs split K in four."""
    g = gen(8)
    router, experts, stacked = _moe_setup("q4", g, hidden=hidden, inter=inter)
    row = torch.randn(1, hidden, generator=g)
    alone = _moe(row, router, stacked, 2)[2]
    # 21 tokens: some expert gets 2 tiles. (256, 256): the row first in its experts' tiles, as
    # alone (numpy's BLAS, the interpreter's dot, can move a last bit with a row's position;
    # the GPU test checks every position on the MMA)
    cases = ((3, 1), (20, 20)) if inter == 32 else ((20, 0),)
    for batch, pos in cases:
        others = torch.randn(batch, hidden, generator=g)
        x = torch.cat([others[:pos], row, others[pos:]])
        ids, wts, out = _moe(x, router, stacked, 2)
        assert torch.equal(out[pos], alone[0])
    rids, rw, rout = triton_moe.moe_reference(x, router, experts, 2, True)
    assert rel_err(out, rout) < TOL["q4"]
    if inter == 32:  # long prefills go through the experts in several passes (the same bits
        # on the GPU, tests/kernels/test_gpu.py; numpy's BLAS here may move a last bit with a
        # row's position in its tile)
        monkeypatch.setattr(triton_moe, "CHUNK_TOKENS", 8)
        monkeypatch.setattr(triton_moe, "SEQ_MIN_TOKENS", 1 << 30)  # split programs chunk
        assert rel_err(_moe(x, router, stacked, 2)[2], out.double()) < 1e-6


def test_moe_one_program_per_expert_tile_gives_the_bits_of_the_split_programs(monkeypatch):
    """Both q4 expert GEMMs split K in four; seq runs the four splits in one program: the
    same bits, which lets a big batch take it while a lone token keeps the split programs.
    Long prefills also deal an expert's row tiles out to several programs: the same bits."""
    t = 48
    router, experts, stacked, x, ids, wts = _routed(gen(11), 256, t)
    assert (stacked.gu_split, stacked.down_split) == (4, 4)
    assert torch.bincount(ids.flatten().long()).max() > 16  # an expert has two row tiles

    def run(seq):
        inter, y = nan(2 * t, 256).to(torch.float16), nan(2 * t, 256)
        triton_moe.experts_forward(x, ids, stacked, inter, y, seq=seq)
        assert not stacked.gu_tickets.any() and not stacked.down_tickets.any()
        return inter, y

    split = run(False)
    monkeypatch.setattr(triton_moe, "WIDE_MIN_TOKENS", 16)  # the tiles dealt out ...
    monkeypatch.setattr(q4_layout, "WIDE_TILE", q4_layout.Q4Tile())  # ... 16 rows each
    inter, y = run(True)  # (one program per tile without dealing: the batch-invariance test)
    assert torch.equal(inter, split[0]) and torch.equal(y, split[1])
    assert torch.isfinite(y).all()


def test_the_expert_splits_follow_the_program_count_read_at_the_stacking(monkeypatch):
    """moe_layout.EXPERT_PROGRAMS is read when a layer's experts are stacked (bench/ab_modes.py
    `eprogN` sets it before the engine loads): the most K splits with n-tiles x splits within
    it; the linear's program count does not enter."""
    _, experts, stacked = _moe_setup("q4", gen(3), e=2, hidden=512, inter=64)
    assert (stacked.gu_split, stacked.down_split) == (8, 1)  # 2 n-tiles x 8 of 8 k steps; 1 k step
    monkeypatch.setattr(moe_layout, "EXPERT_PROGRAMS", 4)
    monkeypatch.setattr(q4_layout, "MAX_PROGRAMS", 1 << 20)
    fewer = moe_layout.StackedExperts.stack(experts)
    assert (fewer.gu_split, fewer.down_split) == (2, 1)
    monkeypatch.setattr(moe_layout, "GU_PROGRAMS", 8)  # gate_up's own count: 4 splits
    assert moe_layout.StackedExperts.stack(experts).gu_split == 4
    assert moe_layout.StackedExperts.stack(experts, programs=4).gu_split == 2  # given: both


def test_moe_dense_experts_match_the_q4_tile(monkeypatch):
    """q4 experts dequantized once per call, run on a many-warp fp16 tile with the q4 splits
    (gate_up and down split K in two): the q4 seq programs' values (bits on the GPU), the
    one-loop form the nested loops' bits, and the float64 reference."""
    t = 24
    router, experts, stacked, x, ids, wts = _routed(gen(13), 128, t)
    assert (stacked.gu_split, stacked.down_split) == (2, 2)

    def run(**kw):
        inter, y = nan(2 * t, 128).to(torch.float16), nan(2 * t, 128)
        triton_moe.experts_forward(x, ids, stacked, inter, y, **kw)
        return inter, y

    q4 = run(seq=True)
    nested = run(dense=True, tile=SMALL_DENSE)
    flat = run(dense=True, tile=SMALL_DENSE, flat=1)
    assert torch.equal(flat[0], nested[0]) and torch.equal(flat[1], nested[1])
    assert torch.isfinite(nested[1]).all()
    # the default's per-kernel forms (gate_up a loop per split, down one loop), small tiles
    monkeypatch.setattr(triton_moe, "DENSE_GATE_UP", (SMALL_DENSE, 0))
    monkeypatch.setattr(triton_moe, "DENSE_DOWN", (SMALL_DENSE, 1))
    default = run(dense=True)
    assert torch.equal(default[0], nested[0]) and torch.equal(default[1], nested[1])
    assert rel_err(nested[1], q4[1].double()) < 1e-3  # inter is fp16: a last bit moves rows
    out = triton_moe_route.combine(nested[1], wts, nan(t, 128), None)
    rout = triton_moe.moe_reference(x, router, experts, 2, True)[2]
    assert rel_err(out, rout) < TOL["q4"]
    with pytest.raises(ValueError, match="BK"):
        run(dense=True, tile=q4_layout.Q4Tile(nb=4, warps=4))


@pytest.mark.parametrize("scan", [None, 32])
def test_align_lists_each_experts_assignments_in_order(scan, monkeypatch):
    """The grouping: active experts in increasing id get slots 0, 1, ..., each with its count
    and its assignments in increasing order — the same whether the ids are scanned in one
    step (the default: T*k rounded up to a power of two) or in many (scan 32)."""
    if scan:
        monkeypatch.setattr(triton_moe_route, "SCAN_MIN", scan)
        monkeypatch.setattr(triton_moe_route, "SCAN_MAX", scan)
    g = gen(30)
    # experts 12..15 are never routed to, and 3 only by the last token
    pool = torch.tensor([e for e in range(12) if e != 3])
    ids = torch.stack([pool[torch.randperm(11, generator=g)[:3]] for _ in range(50)])
    ids[-1] = torch.tensor([3, 0, 1])
    ids = ids.to(torch.int32)
    meta, arows = triton_moe_route.align(ids, 16)
    flat = ids.flatten()
    experts = torch.unique(flat)
    assert int(meta[0]) == len(experts) and experts.max() < 12 and 3 in experts.tolist()
    for r, e in enumerate(experts.tolist()):
        where = torch.nonzero(flat == e).flatten().to(torch.int32)
        assert (int(meta[1 + 2 * r]), int(meta[2 + 2 * r])) == (e, len(where))
        assert torch.equal(arows[r, :len(where)], where)


def test_moe_direct_slots_give_the_grouped_bits(monkeypatch):
    """Up to DIRECT_MAX_TOKENS tokens every assignment is its own slot (its expert read from the
    ids, no grouping kernel): the bits of the grouped launch, also when tokens share an expert
    (which the grouped launch runs as one slot of several rows)."""
    g = gen(12)
    router, experts, stacked = _moe_setup("q4", g, hidden=256, inter=256)
    x = torch.randn(3, 256, generator=g)
    ids = torch.tensor([[1, 5], [5, 2], [1, 7]], dtype=torch.int32)

    def run():
        inter, y = nan(6, 256).to(torch.float16), nan(6, 256)
        triton_moe.experts_forward(x, ids, stacked, inter, y)
        assert not stacked.gu_tickets.any() and not stacked.down_tickets.any()
        return inter, y

    assert triton_moe.DIRECT_MAX_TOKENS >= 3
    direct = run()
    monkeypatch.setattr(triton_moe, "DIRECT_MAX_TOKENS", 0)
    grouped = run()
    assert torch.isfinite(direct[1]).all()
    assert torch.equal(direct[0], grouped[0]) and torch.equal(direct[1], grouped[1])
    ref = torch.stack([experts[int(e)][1].reference(torch.nn.functional.silu(
        (h := experts[int(e)][0].reference(x[a // 2: a // 2 + 1]))[:, :256]) * h[:, 256:])[0]
        for a, e in enumerate(ids.flatten())])
    assert rel_err(direct[1], ref) < TOL["q4"]


# ---- the draw of sampled tokens -----------------------------------------------------------------
def test_draw_gives_samples_token_for_each_row_alone_or_among_others():
    """kernels/triton_sample.py `draw` on rows sorted as replica/sampling.py `pick` sorts them:
    the token `sample` draws from the unsorted row (top-k, top-p, temperature, ties and long
    tied runs, cuts inside and across scan blocks), and a row's token is the same alone."""
    import random

    from kernels import triton_sample
    from replica.sampling import SamplingParams, sample, uniform

    f64 = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731
    rng, checked = random.Random(1), 0
    for trial in range(24):
        v = rng.choice([7, 50, 320, 4096, 5000])  # 4096 and 5000: two and three scan blocks
        g = torch.Generator().manual_seed(trial)
        logits = torch.randn(rng.randint(1, 5), v, generator=g) * rng.choice([0.1, 1.0, 5.0])
        if trial % 5 == 0:
            logits[:, : v // 2] = logits[0, 0]
        params = [SamplingParams(temperature=rng.choice([0.3, 0.8, 1.0, 2.5]),
                                 top_p=rng.choice([1.0, 0.9, 0.5, 0.05, 0.999]),
                                 top_k=rng.choice([0, 0, 1, 5, 100, 3000]), seed=rng.randint(0, 2**40))
                  for _ in logits]
        pos = [rng.randint(0, 5000) for _ in logits]
        vals, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
        args = (f64([p.temperature for p in params]),
                torch.tensor([min(v, p.top_k) if p.top_k > 0 else v for p in params]),
                f64([p.top_p for p in params]), f64([uniform(p.seed, q) for p, q in zip(params, pos)]))
        got = triton_sample.draw(vals, ids, *args).tolist()
        assert got == [sample(row, p, q) for row, p, q in zip(logits, params, pos)], trial
        for i in range(len(got)):
            alone = triton_sample.draw(vals[i:i + 1], ids[i:i + 1], *(a[i:i + 1] for a in args))
            assert alone.item() == got[i]
        checked += len(got)
    assert checked > 50
    # a mass that reaches top_p exactly: the cut keeps that prefix (two equal halves, top-p 0.5)
    half = torch.tensor([[1.0, 1.0]]).expand(20, 2).contiguous()
    vals, ids = torch.sort(half, dim=-1, descending=True, stable=True)
    args = (f64([1.0] * 20), torch.full((20,), 2), f64([0.5] * 20), f64([uniform(9, q) for q in range(20)]))
    assert triton_sample.draw(vals, ids, *args).tolist() == [0] * 20 == [
        sample(half[0], SamplingParams(temperature=1.0, top_p=0.5, seed=9), q) for q in range(20)]
    with pytest.raises(ValueError, match="float32"):
        triton_sample.draw(vals.double(), ids, *args)
    with pytest.raises(ValueError, match="keep"):
        triton_sample.draw(vals, ids, args[0], args[1].int(), *args[2:])


def test_picks_device_path_gives_samples_tokens():
    """replica/sampling.py `pick`'s device path (`_pick_sorted`: every sampled row from one sort,
    drawn by the kernel) run here on CPU tensors: `sample`'s token for every sampled row, the
    argmax for the others, at random temperatures, top-k / top-p cuts and tied runs."""
    import random

    from replica.sampling import SamplingParams, _pick_sorted, sample

    rng, checked = random.Random(4), 0
    for trial in range(12):
        r, v = rng.randint(1, 6), rng.choice([50, 300, 4100])
        logits = torch.randn(r, v, generator=torch.Generator().manual_seed(trial)) * rng.choice([0.1, 1.0, 5.0])
        if trial % 4 == 0:
            logits[:, : v // 2] = logits[0, 0]
        rows = [(i, SamplingParams(temperature=rng.choice([0.3, 0.8, 2.5]), top_p=rng.choice([1.0, 0.9, 0.05]),
                                   top_k=rng.choice([0, 1, 5, 100]), seed=rng.randint(0, 2**40)),
                 rng.randint(0, 5000)) for i in range(r) if rng.random() > 0.3]
        argmax = torch.argmax(logits, dim=-1)
        got = _pick_sorted(logits, argmax, rows).tolist() if rows else argmax.tolist()
        want = argmax.tolist()
        for i, p, pos in rows:
            want[i] = sample(logits[i], p, pos)
            checked += 1
        assert got == want, trial
    assert checked > 20


# ---- the fused CUDA forward, interpreted, vs the CPU engine ----------------------------------------
def test_fused_forward_greedy_tokens_equal_cpu_engine(monkeypatch):
    from kernels import ops
    from replica.core import EngineCore
    from replica.config import EngineConfig
    from replica.models.synthetic import synthetic_model
    from replica.request import Request
    from replica.sampling import SamplingParams

    loaded = synthetic_model("tiny-qwen3-moe", seed=3)
    cfg = dict(model=loaded.config.name, block_size=4, num_kv_blocks=32, max_batch_tokens=16)
    req = lambda: Request(prompt_token_ids=(5, 17, 99, 3, 250, 42, 7),  # noqa: E731
                          params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))

    def run(core):
        events = []
        core.add(core.prepare(req()), events.append)
        while core.has_work:
            core.step()
        return [t for ev in events for t in ev.token_ids]

    want = run(EngineCore(EngineConfig(**cfg), loaded=loaded))
    monkeypatch.setattr(ops, "_triton", lambda where: True)  # CPU tensors → the Triton kernels
    core = EngineCore(EngineConfig(**cfg), loaded=loaded)
    core.model.fused = True
    assert core.model.layers[0].moe is not None
    assert run(core) == want


def test_the_fused_direct_moe_gives_the_three_kernels_bits(monkeypatch):
    """FUSED: gate_up, down and the combine of 1-7 direct tokens in one launch (work items
    claimed in order, waits on counters) — the bits of the three kernels, every counter back at
    zero after each launch (the next launch starts clean)."""
    g = gen(13)
    router, experts, stacked = _moe_setup("q4", g, hidden=256, inter=256)
    assert (stacked.gu_split, stacked.down_split) == (4, 4)
    fused = triton_moe._fused
    for t in (1, 3):
        x = torch.randn(t, 256, generator=g)
        res = torch.randn(t, 256, generator=g)
        want = triton_moe.moe(x, router, stacked, 2, True, res)
        monkeypatch.setattr(triton_moe, "FUSED", True)
        calls = []
        monkeypatch.setattr(triton_moe, "_fused", lambda *a: calls.append(1) or fused(*a))
        got = triton_moe.moe(x, router, stacked, 2, True, res)
        monkeypatch.setattr(triton_moe, "FUSED", False)
        assert calls and torch.equal(got, want), t
        assert not stacked.sync.any() and not stacked.gu_tickets.any() and not stacked.down_tickets.any()


def test_blocks_per_sm_counts_the_register_file_by_quarters():
    """The fused launch's residency check (STATIC: item = program): Hopper's limits. The
    fused kernel compiled at 124 registers fits 16 one-warp programs an SM (ncu read 16 for
    the expert kernels at 128); at 219 a quarter of the file holds 2 warps, so 8, not the
    9 a whole-file division gives; shared memory and threads bound the others."""
    assert triton_moe.blocks_per_sm(124, 13312, 1) == 16
    assert triton_moe.blocks_per_sm(219, 13312, 1) == 8
    assert triton_moe.blocks_per_sm(128, 13312, 4) == 4
    assert triton_moe.blocks_per_sm(32, 100_000, 1) == 2  # 233,472 // 101,024
    assert triton_moe.blocks_per_sm(16, 0, 1) == 32  # the per-SM program limit
    assert triton_moe.blocks_per_sm(16, 0, 32) == 2  # 2,048 threads
    assert triton_moe.blocks_per_sm(255, 0, 32) == 0  # cannot launch: STATIC never taken

