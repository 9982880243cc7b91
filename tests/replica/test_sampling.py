"""The samplers: `sample` (one row on the host, the reference) draws from the distribution its
parameters describe; `pick` (a step's rows at once, on the logits' device: the engine's path)
gives `sample`'s token for every row, and a row's token does not depend on the other rows."""

from __future__ import annotations

import math
import random

import pytest
import torch

from replica.sampling import PREFIX, SamplingParams, _draw, _sorted_prefix, pick, sample, uniform

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def filtered(logits: list[float], p: SamplingParams) -> list[float]:
    """The distribution `p` describes, computed independently: softmax at the temperature, the
    top_k most likely, then the smallest most-likely prefix whose mass reaches top_p,
    renormalized (ties: the lower token id counts as more likely)."""
    m = max(logits)
    w = [math.exp((x - m) / p.temperature) for x in logits]
    z = sum(w)
    probs = [x / z for x in w]
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    if p.top_k > 0:
        order = order[: p.top_k]
    kept, mass = [], 0.0
    for i in order:
        kept.append(i)
        mass += probs[i]
        if mass >= p.top_p:
            break
    total = sum(probs[i] for i in kept)
    return [probs[i] / total if i in kept else 0.0 for i in range(len(probs))]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=3),
    SamplingParams(temperature=0.5, seed=4),
    SamplingParams(temperature=1.5, top_k=3, seed=5),
    SamplingParams(temperature=1.0, top_p=0.7, seed=6),
    SamplingParams(temperature=0.8, top_k=4, top_p=0.9, seed=7),
])
def test_sample_draws_from_the_distribution_its_parameters_describe(params):
    logits = [2.0, 1.5, 1.5, 0.3, -0.4, -1.0, -3.0]
    want = filtered(logits, params)
    n = 6000
    counts = [0] * len(logits)
    row = torch.tensor(logits)
    for position in range(n):
        counts[sample(row, params, position)] += 1
    for tok, (c, q) in enumerate(zip(counts, want)):
        if q == 0.0:
            assert c == 0, (tok, counts, want)  # cut by top-k / top-p: never drawn
        else:
            sigma = math.sqrt(n * q * (1 - q))
            assert abs(c - n * q) <= 4.5 * sigma + 1, (tok, counts, [round(n * x) for x in want])


def test_the_draw_depends_on_seed_and_position_only():
    assert uniform(11, 5) == uniform(11, 5)
    draws = {uniform(11, p) for p in range(200)} | {uniform(12, p) for p in range(200)}
    assert len(draws) == 400 and all(0.0 <= u < 1.0 for u in draws)


def cases(seed: int):
    """Random steps: (logits [R, V], rows to sample: (row, params, position)); some with long
    runs of tied logits, some rows left greedy."""
    rng = random.Random(seed)
    for trial in range(40):
        v = rng.choice([7, 50, 320, 4096])
        r = rng.randint(1, 9)
        gen = torch.Generator().manual_seed(seed * 1000 + trial)
        logits = torch.randn(r, v, generator=gen) * rng.choice([0.1, 1.0, 5.0])
        if trial % 5 == 0:
            logits[:, : v // 2] = logits[0, 0]
        rows = [(i, SamplingParams(temperature=rng.choice([0.3, 0.8, 1.0, 2.5]),
                                   top_p=rng.choice([1.0, 0.9, 0.5, 0.05]),
                                   top_k=rng.choice([0, 0, 1, 5, 100]), seed=rng.randint(0, 2**40)),
                 rng.randint(0, 5000))
                for i in range(r) if rng.random() > 0.3]
        yield logits, rows


@pytest.mark.parametrize("device", DEVICES)
def test_pick_gives_each_row_its_own_token_among_any_rows(device):
    checked = 0
    for logits, rows in cases(1):
        logits = logits.to(device)
        argmax = torch.argmax(logits, dim=-1)
        got = pick(logits, argmax, rows)
        assert got.device == logits.device and got.dtype == torch.int64
        got = got.tolist()
        sampled = {i for i, _, _ in rows}
        for i in range(logits.shape[0]):
            if i not in sampled:
                assert got[i] == int(argmax[i])  # greedy rows keep the argmax
        for i, p, pos in rows:
            alone = pick(logits[i:i + 1], argmax[i:i + 1], [(0, p, pos)]).item()
            assert got[i] == alone  # the same token alone as among the others
            # the reference, row by row (on CUDA the draw kernel sums the masses in another
            # order: the same token unless a draw falls within rounding of a boundary)
            assert got[i] == sample(logits[i].cpu(), p, pos)
            checked += 1
    assert checked > 100


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_1_gives_the_greedy_token_even_where_probabilities_round_equal(device):
    # 1e-30 and 2e-30 (and 0, -1e-30) differ as float32 logits but not as float64 probabilities
    logits = torch.tensor([[0.0, 1e-30, 2e-30, -1e-30, -5.0],
                           [-1e-30, 0.0, 0.0, 1e-30, 1e-30],   # a true tie at the top: lower id
                           [3.0, 3.0, 1.0, 2.0, 0.5]]).to(device)
    argmax = torch.argmax(logits, dim=-1)
    assert argmax.tolist() == [2, 3, 0]
    for temperature in (0.3, 1.0, 2.5):
        params = SamplingParams(temperature=temperature, top_k=1, seed=9)
        rows = [(r, params, pos) for r in range(3) for pos in (r,)]
        assert pick(logits, argmax, rows).tolist() == argmax.tolist()
        for r in range(3):
            assert sample(logits[r].cpu(), params, 40 + r) == int(argmax[r])


def test_the_cpu_path_sorts_only_the_prefix_its_cut_reads_and_gives_samples_tokens():
    wide = torch.randn(5000, generator=torch.Generator().manual_seed(2)) * 2.0  # a wide nucleus
    ties = torch.tensor([3.0, 2.0, 2.0, 2.0, 2.0] + [0.0] * 95)  # a tie across the top-k cut
    for logits, params, prefix in [
        (wide, SamplingParams(temperature=1.0, top_p=0.9, seed=1), (PREFIX + 1, 5000)),  # grown, not whole
        (ties, SamplingParams(temperature=1.0, top_k=3, seed=2), (5, 6)),  # the tie taken whole
        (wide, SamplingParams(temperature=0.7, seed=3), (5000, 5001)),  # no cut: the whole order
    ]:
        probs = torch.softmax(logits.to(torch.float64) / params.temperature, dim=-1)
        head, ids, cum = _sorted_prefix(logits, probs, params)
        assert prefix[0] <= ids.numel() < prefix[1]
        full, order = torch.sort(probs, descending=True, stable=True)  # these probs never tie apart
        n = ids.numel()
        assert torch.equal(ids, order[:n]) and torch.equal(head, full[:n])  # the order's own prefix
        assert torch.equal(cum, torch.cumsum(full, dim=-1)[:n])  # and its mass, bit for bit
        drawn = [_draw(logits, params, pos) for pos in range(300)]
        assert drawn == [sample(logits, params, pos) for pos in range(300)]
        if params.top_k == 3:
            assert set(drawn) == {0, 1, 2}  # of the tied four, the lower ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pick_never_waits_for_the_device():
    """pick runs while a step (and, with lookahead, the one before) is in flight: nothing in it
    may synchronize the host with the device."""
    pick(torch.randn(2, 64, device="cuda"), torch.zeros(2, dtype=torch.int64, device="cuda"),
         [(0, SamplingParams(temperature=1.0, seed=0), 0)])  # first use (a kernel's compile) first
    logits = torch.randn(6, 4096, device="cuda")
    argmax = torch.argmax(logits, dim=-1)
    rows = [(1, SamplingParams(temperature=0.7, top_p=0.9, seed=1), 5),
            (4, SamplingParams(temperature=1.3, top_k=20, seed=2), 9)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        picks = pick(logits, argmax, rows)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert picks.tolist()[0] == int(argmax[0])


def test_the_sampling_bench_prints_and_writes_the_same_tokens(tmp_path):
    import json
    import subprocess
    import sys

    path = tmp_path / "sampling.json"
    out = subprocess.run([sys.executable, "-m", "bench.sampling", "--vocab", "320", "--rows", "1,3",
                          "--parts", "--json", str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "row by row ms" in out.stdout and "sort_f32" in out.stdout
    rows = json.loads(path.read_text())
    assert [(r["vocab"], r["rows"]) for r in rows] == [(320, 1), (320, 3)]
    assert all(r["same_tokens"] and r["pick_ms"] > 0 and r["row_by_row_ms"] > 0 for r in rows)
    assert all(ms > 0 for r in rows for ms in r["parts_ms"].values())
