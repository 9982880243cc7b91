"""kernels/prefill.py against its float64 reference, and its invariance: a chunk's rows are
bitwise the same however the prompt is cut into chunks and whatever the pool holds elsewhere.
CPU always; CUDA (FlashAttention on a bf16 pool) where there is a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels.prefill import prefill_attention, prefill_attention_batch, prefill_reference

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# (pool dtype, tolerance on the relative error against float64)
DTYPES = {"cpu": [(torch.float32, 1e-5), (torch.bfloat16, 1e-5)],
          "cuda": [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)]}


def setup(device, dtype, h=8, kvh=2, d=16, bs=16, nb=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(nb, bs, kvh, d, generator=g).to(device, dtype)
    vc = torch.randn(nb, bs, kvh, d, generator=g).to(device, dtype)
    table = torch.randperm(nb, generator=g)[:80].to(torch.int32).to(device)
    return g, kc, vc, table


def rel_err(out, ref) -> float:
    assert torch.isfinite(out).all()
    return float((out.cpu().double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("start,n,piece", [(0, 1, 64), (0, 200, 64), (37, 300, 64), (511, 2, 256),
                                           (100, 700, 256), (5, 64, 64)])
def test_matches_the_float64_reference(device, start, n, piece):
    for dtype, tol in DTYPES[device]:
        g, kc, vc, table = setup(device, dtype)
        q = torch.randn(n, 8, 16, generator=g).to(kc.device)
        out = prefill_attention(q, kc, vc, table, start, 0.25, piece=piece)
        assert out.shape == q.shape and out.dtype == torch.float32
        assert rel_err(out, prefill_reference(q, kc, vc, table, start, 0.25)) < tol, dtype


@pytest.mark.parametrize("device", DEVICES)
def test_rows_are_bitwise_the_same_however_the_prompt_is_chunked(device):
    for dtype, _ in DTYPES[device]:
        g, kc, vc, table = setup(device, dtype, seed=1)
        start, n = 29, 1000
        q = torch.randn(n, 8, 16, generator=g).to(kc.device)
        whole = prefill_attention(q, kc, vc, table, start, 0.25)
        for cuts in ([1], [255, 256], [227, 483, 999], [100, 101, 102, 600], list(range(64, 1000, 64))):
            bounds = [0] + cuts + [n]
            parts = [prefill_attention(q[a:b], kc, vc, table, start + a, 0.25)
                     for a, b in zip(bounds, bounds[1:])]
            assert torch.equal(torch.cat(parts), whole), (dtype, cuts)


@pytest.mark.parametrize("device", DEVICES)
def test_keys_past_the_chunk_and_other_blocks_are_never_read(device):
    """NaN everywhere the stream's keys are not: the output stays finite and unchanged."""
    for dtype, _ in DTYPES[device]:
        g, kc, vc, table = setup(device, dtype, seed=2)
        start, n, bs = 40, 300, kc.shape[1]
        q = torch.randn(n, 8, 16, generator=g).to(kc.device)
        clean = prefill_attention(q, kc, vc, table, start, 0.25)
        end = start + n
        poisoned = [kc.clone(), vc.clone()]
        own = set(table[: -(-end // bs)].tolist())
        for t in poisoned:
            for b in range(t.shape[0]):
                if b not in own:
                    t[b] = float("nan")
            last = int(table[(end - 1) // bs])
            t[last, (end - 1) % bs + 1:] = float("nan")  # the last block past the chunk
        assert torch.equal(prefill_attention(q, *poisoned, table, start, 0.25), clean)


def test_rejects_bad_shapes():
    g, kc, vc, table = setup("cpu", torch.float32)
    with pytest.raises(ValueError):
        prefill_attention(torch.randn(4, 8, 8), kc, vc, table, 0, 0.25)  # head dim
    with pytest.raises(ValueError):
        prefill_attention(torch.randn(4, 8, 16), kc, vc, table[:1], 20, 0.25)  # table too short
    with pytest.raises(ValueError):
        prefill_attention(torch.randn(4, 8, 16).double(), kc, vc, table, 0, 0.25)


# ---- a step's spans together (prefill_attention_batch) ------------------------------------------
def batch_setup(device, dtype, seed=3, h=8, d=16):
    """Five streams' tables over one pool and a step's spans (row, n, start, table row): long
    and short chunks, a one-token one, a chunk inside one piece and one across several."""
    g, kc, vc, _ = setup(device, dtype, seed=seed, nb=400)
    tables = torch.stack([torch.randperm(400, generator=g)[:80] for _ in range(5)]).to(
        torch.int32).to(kc.device)
    chunks = [(300, 700), (1000, 1), (256, 256), (37, 900), (700, 90)]  # (start, n)
    spans, row = [], 0
    for t, (start, n) in enumerate(chunks):
        spans.append((row, n, start, t))
        row += n
    q = torch.randn(row, h, d, generator=g).to(kc.device)
    return q, kc, vc, tables, spans


def run_batch(q, kc, vc, tables, spans, varlen=None, max_keys=1 << 20):
    out = torch.full_like(q, float("nan"))
    prefill_attention_batch(q, kc, vc, tables, spans, 0.25, out, max_keys, varlen=varlen)
    return out


# CPU: packed calls (varlen=True) run the CUDA path's packing with a per-piece stand-in for the
# kernel, so they must give the per-stream path's bits exactly; CUDA: the real varlen kernel
VARLEN = [("cpu", True), ("cpu", False)] + ([("cuda", None), ("cuda", False)]
                                             if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device,varlen", VARLEN)
def test_batch_matches_the_float64_reference(device, varlen):
    for dtype, tol in DTYPES[device]:
        q, kc, vc, tables, spans = batch_setup(device, dtype)
        out = run_batch(q, kc, vc, tables, spans, varlen)
        for row, n, start, t in spans:
            ref = prefill_reference(q[row: row + n], kc, vc, tables[t], start, 0.25)
            assert rel_err(out[row: row + n], ref) < tol, (dtype, start, n)


def test_cpu_packing_gives_the_per_stream_bits():
    for dtype, _ in DTYPES["cpu"]:
        q, kc, vc, tables, spans = batch_setup("cpu", dtype)
        assert torch.equal(run_batch(q, kc, vc, tables, spans, True),
                           run_batch(q, kc, vc, tables, spans, False))


@pytest.mark.parametrize("device,varlen", VARLEN)
def test_a_spans_rows_do_not_depend_on_the_other_spans(device, varlen):
    """Alone, with the others in another order, and in calls cut by a small key budget:
    bitwise the same rows (the engine's invariance, in the packed form too)."""
    for dtype, _ in DTYPES[device]:
        q, kc, vc, tables, spans = batch_setup(device, dtype, seed=4)
        together = run_batch(q, kc, vc, tables, spans, varlen)
        reordered = run_batch(q, kc, vc, tables, spans[::-1], varlen)
        budget = run_batch(q, kc, vc, tables, spans, varlen, max_keys=1500)  # a call per span or two
        assert torch.equal(together, reordered) and torch.equal(together, budget), dtype
        for sp in spans:
            row, n = sp[0], sp[1]
            alone = run_batch(q, kc, vc, tables, [sp], varlen)
            assert torch.equal(alone[row: row + n], together[row: row + n]), (dtype, sp)


@pytest.mark.parametrize("device,varlen", VARLEN)
def test_packed_rows_are_bitwise_the_same_however_the_prompt_is_chunked(device, varlen):
    for dtype, _ in DTYPES[device]:
        q, kc, vc, tables, _ = batch_setup(device, dtype, seed=5)
        start, n = 29, 1000
        q = q[:n]
        whole = run_batch(q, kc, vc, tables, [(0, n, start, 2)], varlen)
        for cuts in ([1], [255, 256], [227, 483, 999], list(range(64, 1000, 64))):
            bounds = [0] + cuts + [n]
            # every piece of the cut prompt in one step, as spans of one call
            spans = [(a, b - a, start + a, 2) for a, b in zip(bounds, bounds[1:])]
            assert torch.equal(run_batch(q, kc, vc, tables, spans, varlen), whole), (dtype, cuts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_varlen_at_the_30b_attention_shape_keeps_a_rows_bits():
    """32 query heads over 4 KV heads, head dim 128, bf16: the shapes whose split-K plan
    FlashAttention's fixed-length form changes with the call; the packed form must not."""
    g, kc, vc, _ = setup("cuda", torch.bfloat16, h=32, kvh=4, d=128, nb=1200, seed=6)
    tables = torch.stack([torch.randperm(1200, generator=g)[:450] for _ in range(3)]).to(
        torch.int32).cuda()
    chunks = [(6581, 1), (4096, 1024), (0, 6581)]
    spans, row = [], 0
    for t, (start, n) in enumerate(chunks):
        spans.append((row, n, start, t))
        row += n
    q = torch.randn(row, 32, 128, generator=g).cuda()
    together = run_batch(q, kc, vc, tables, spans, max_keys=1 << 20)
    assert torch.isfinite(together).all()
    for sp in spans:
        alone = run_batch(q, kc, vc, tables, [sp])
        assert torch.equal(alone[sp[0]: sp[0] + sp[1]], together[sp[0]: sp[0] + sp[1]]), sp
