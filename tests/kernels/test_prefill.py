"""kernels/prefill.py against its float64 reference, and its invariance: a chunk's rows are
bitwise the same however the prompt is cut into chunks and whatever the pool holds elsewhere.
CPU always; CUDA (FlashAttention on a bf16 pool) where there is a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels import prefill
from kernels.prefill import prefill_attention, prefill_reference

# CUDA also with the whole chunk in one FlashAttention call (prefill.WHOLE_CHUNK)
DEVICES = ["cpu"] + (["cuda", "cuda-whole"] if torch.cuda.is_available() else [])
# (pool dtype, tolerance on the relative error against float64)
DTYPES = {"cpu": [(torch.float32, 1e-5), (torch.bfloat16, 1e-5)],
          "cuda": [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)]}
DTYPES["cuda-whole"] = DTYPES["cuda"]


@pytest.fixture(autouse=True)
def whole_chunk(request, monkeypatch):
    """"cuda-whole": the chunk's region in one call, K split off (skipped where this torch's
    FlashAttention cannot turn it off)."""
    device = request.node.callspec.params.get("device") if hasattr(request.node, "callspec") else None
    if device == "cuda-whole":
        if not prefill.whole_chunk_supported():
            pytest.skip("this torch's FlashAttention has no num_splits")
        monkeypatch.setattr(prefill, "WHOLE_CHUNK", True)


def setup(device, dtype, h=8, kvh=2, d=16, bs=16, nb=96, seed=0):
    device = device.split("-")[0]
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
