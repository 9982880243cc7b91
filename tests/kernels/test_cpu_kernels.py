"""CPU kernels vs float64 references, and bitwise batch invariance by construction."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu
from kernels.linear import Linear, quantize_q4, quantize_q8, from_gguf

FORMATS = {
    "f32": lambda w: Linear.dense(w),
    "q4": quantize_q4,
    "q8": quantize_q8,
}


def _poisoned(shape):
    return torch.full(shape, float("nan"))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("n,k,batch", [(8, 64, 1), (36, 96, 5), (130, 576, 17), (7, 32, 70)])
def test_linear_matches_float64_reference(fmt, n, k, batch):
    g = torch.Generator().manual_seed(n * k + batch)
    lin = FORMATS[fmt](torch.randn(n, k, generator=g))
    x = torch.randn(batch, k, generator=g)
    y = cpu.linear(lin, x)
    ref = lin.reference(x)
    assert y.shape == (batch, n) and torch.isfinite(y).all()
    err = (y.double() - ref).abs().max() / ref.abs().max()
    assert err < 1e-5, err


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_linear_row_is_bitwise_independent_of_its_batch(fmt):
    """A row alone, among 1..80 others, at any position: the same bits."""
    g = torch.Generator().manual_seed(1)
    lin = FORMATS[fmt](torch.randn(50, 192, generator=g))
    row = torch.randn(1, 192, generator=g)
    alone = cpu.linear(lin, row)
    for batch in (2, 3, 15, 16, 17, 63, 64, 65, 80):
        others = torch.randn(batch, 192, generator=g)
        pos = batch // 2
        x = torch.cat([others[:pos], row, others[pos:]])
        assert torch.equal(cpu.linear(lin, x)[pos], alone[0]), f"batch {batch}"


def test_row_bits_never_depend_on_batch_size_1_to_32():
    """Why the kernels exist: torch's BLAS row bits change with the batch here (measured: every
    batch size 2..64 for 576x576); ours never do."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(576, 576, generator=g)
    xs = torch.randn(32, 576, generator=g)
    lin = Linear.dense(w)
    ours = [torch.equal(cpu.linear(lin, xs[:b])[0], cpu.linear(lin, xs[:1])[0]) for b in range(1, 33)]
    assert all(ours)


def test_gguf_q4_0_maps_exactly():
    g = torch.Generator().manual_seed(3)
    n, k = 4, 64
    d = (torch.rand(n, k // 32, generator=g) + 0.1).half()
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    blk = q.view(n, k // 32, 32)
    packed = (blk[..., :16] | (blk[..., 16:] << 4))
    raw = torch.cat([d.view(torch.uint8).view(n, k // 32, 2), packed], dim=-1).reshape(n, -1)
    lin = from_gguf("Q4_0", raw.numpy(), n, k)
    expect = d.float().repeat_interleave(32, 1) * (q.float() - 8)
    assert torch.equal(lin.dequantize(), expect)


def test_rms_norm_and_silu_mul_and_softmax():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 64, generator=g)
    w = torch.randn(64, generator=g)
    y = cpu.rms_norm(x, w, 1e-5)
    assert torch.allclose(y.double(), cpu.rms_norm_reference(x, w, 1e-5), atol=1e-6, rtol=1e-5)
    assert torch.equal(cpu.rms_norm(x[3:4], w, 1e-5)[0], y[3])
    gu = torch.randn(5, 2, 48, generator=g)
    out = cpu.silu_mul(gu[:, 0], gu[:, 1])
    ref = torch.nn.functional.silu(gu[:, 0].double()) * gu[:, 1].double()
    assert torch.allclose(out.double(), ref, atol=1e-6, rtol=1e-5)
    s = cpu.softmax(x)
    assert torch.allclose(s.double(), torch.softmax(x.double(), -1), atol=1e-7)
    assert torch.equal(cpu.softmax(x[2:3])[0], s[2])


def _random_paged(g, streams, h, kvh, d, bs, nblocks):
    kc = torch.randn(nblocks, bs, kvh, d, generator=g)
    vc = torch.randn(nblocks, bs, kvh, d, generator=g)
    perm = torch.randperm(nblocks, generator=g).to(torch.int32)
    mb = nblocks // streams
    tables = perm[: streams * mb].view(streams, mb).contiguous()
    return kc, vc, tables, mb * bs


@pytest.mark.parametrize("h,kvh,d", [(4, 2, 16), (9, 3, 64), (8, 8, 32)])
def test_paged_attention_matches_reference(h, kvh, d):
    g = torch.Generator().manual_seed(h * d)
    kc, vc, tables, cap = _random_paged(g, 3, h, kvh, d, bs=4, nblocks=30)
    t = 11
    tok_row = torch.randint(0, 3, (t,), generator=g, dtype=torch.int32)
    ctx = torch.randint(1, cap + 1, (t,), generator=g, dtype=torch.int32)
    q = torch.randn(t, h, d, generator=g)
    out = cpu.paged_attention(q, kc, vc, tables, tok_row, ctx, d ** -0.5)
    ref = cpu.paged_attention_reference(q, kc, vc, tables, tok_row, ctx, d ** -0.5)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max() < 1e-5


def test_paged_attention_token_is_bitwise_independent_of_others():
    g = torch.Generator().manual_seed(5)
    kc, vc, tables, cap = _random_paged(g, 4, 9, 3, 64, bs=16, nblocks=40)
    q = torch.randn(1, 9, 64, generator=g)
    one = lambda qq, rows, ctx: cpu.paged_attention(qq, kc, vc, tables, rows, ctx, 0.125)  # noqa
    alone = one(q, torch.tensor([2], dtype=torch.int32), torch.tensor([77], dtype=torch.int32))
    for t in (2, 7, 33):
        qs = torch.randn(t, 9, 64, generator=g)
        qs[t // 2] = q[0]
        rows = torch.randint(0, 4, (t,), generator=g, dtype=torch.int32)
        rows[t // 2] = 2
        ctx = torch.randint(1, cap, (t,), generator=g, dtype=torch.int32)
        ctx[t // 2] = 77
        assert torch.equal(one(qs, rows, ctx)[t // 2], alone[0])


def test_bad_inputs_raise():
    lin = quantize_q4(torch.randn(8, 64))
    with pytest.raises(ValueError):
        cpu.linear(lin, torch.randn(2, 32))
    with pytest.raises(TypeError):
        cpu.linear(lin, torch.randn(2, 64, dtype=torch.float64))
    with pytest.raises(ValueError):
        Linear("q4", 8, 48, qs=torch.zeros(8, 24, dtype=torch.uint8),
               scale=torch.zeros(8, 1), minv=torch.zeros(8, 1))


def test_every_tile_path_gives_the_same_bits():
    """The library as built here (on AVX2 machines: the intrinsics tile) against the same source
    built with only the generic vector tile (-DFS_GENERIC_TILES): every result bit equal, for
    each format, batch sizes that use the 4-row and 1-row tiles, and N not a multiple of 4."""
    generic = cpu.build_library(("FS_GENERIC_TILES",))
    g = torch.Generator().manual_seed(5)
    for fmt, make in FORMATS.items():
        for n, k in ((7, 64), (37, 96), (130, 576)):
            lin = make(torch.randn(n, k, generator=g))
            for batch in (1, 3, 4, 9):
                x = torch.randn(batch, k, generator=g)
                want = cpu.linear(lin, x, lib=generic)
                got = cpu.linear(lin, x)
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (fmt, n, k, batch)


def test_torch_on_one_thread_keeps_the_kernels_team_and_restores_torch():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with cpu.torch_on_one_thread():
            assert torch.get_num_threads() == 1
            assert cpu._threads(1 << 30) == 2 and cpu._threads(1) == 1
            with cpu.torch_on_one_thread():  # nested: no change
                assert torch.get_num_threads() == 1 and cpu._threads(1 << 30) == 2
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2 and cpu._threads(1 << 30) == 2
        with pytest.raises(RuntimeError):
            with cpu.torch_on_one_thread():
                raise RuntimeError("a failing step")
        assert torch.get_num_threads() == 2 and cpu._team is None
    finally:
        torch.set_num_threads(before)
