"""ModelRunner's outputs: every sampling chunk gets its token where the logits are (argmax, first
index on ties, for greedy streams; the seeded draw for the others), equal to the host reference
sampler's on the same row, and every row reads back the same bits."""

from __future__ import annotations

import pytest
import torch

from replica.models.synthetic import synthetic_model
from replica.request import Request
from replica.runner import HostRows
from replica.sampling import SamplingParams, sample
from tests.replica.schedules import small_core

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def mixed_step(device: str):
    core = small_core(synthetic_model("tiny-llama", seed=3, device=device), device=device)
    params = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0.8, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=1.2, top_k=5, seed=5, ignore_eos=True)]
    for i, p in enumerate(params):
        req = Request(prompt_token_ids=(3 + i, 9, 4 + i), params=p, request_id=f"r{i}")
        core.add(core.prepare(req), lambda ev: None)
    seen = []
    collect = core.runner.collect

    def logged(launched):
        record = launched.record
        out = collect(launched)
        # before the step appends tokens: which chunks sample, and each stream's next position
        samples = [(c.samples, c.stream.num_tokens) for c in record.chunks]
        seen.append((record, samples, out, {r: out.logits[r].clone() for r in out.logits}))
        return out

    core.runner.collect = logged
    while core.has_work:
        core.step()
    return seen


@pytest.mark.parametrize("device", DEVICES)
def test_tokens_come_from_the_runner_and_match_the_host_sampler(device):
    seen = mixed_step(device)
    assert len(seen) >= 4
    greedy_picks = sampled_rows = 0
    for record, samples, out, rows in seen:
        assert isinstance(out.logits, HostRows)
        for r, chunk in enumerate(record.chunks):
            if not samples[r][0]:
                assert r not in out.logits and r not in out.tokens
                continue
            assert r in out.logits
            row = rows[r]
            assert row.device.type == "cpu" and row.shape == (320,) and torch.isfinite(row).all()
            params = chunk.stream.params
            if params.greedy:
                greedy_picks += 1
                assert out.tokens[r] == int(torch.argmax(row))
            else:
                sampled_rows += 1
            # the draw is the one for the stream's next position, which the step appends
            assert chunk.end == samples[r][1]
            assert out.tokens[r] == sample(row, params, chunk.end)
    assert greedy_picks >= 8 and sampled_rows >= 8


def test_host_rows_fetches_only_what_is_read():
    dev = torch.arange(12, dtype=torch.float32).view(3, 4)
    rows = HostRows(dev, {0: 2, 5: 0})
    assert 5 in rows and 0 in rows and 1 not in rows and len(rows) == 2 and sorted(rows) == [0, 5]
    assert rows[0].tolist() == [8.0, 9.0, 10.0, 11.0] and rows[5].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert rows[0] is rows[0]  # read once, kept: not copied again
    with pytest.raises(KeyError):
        rows[1]


def test_step_token_budget_defaults_by_device_and_obeys_an_explicit_one():
    from replica.config import EngineConfig
    from replica.errors import InvalidRequestError

    assert EngineConfig().batch_tokens == 256
    assert EngineConfig(device="cuda").batch_tokens == 8192
    assert EngineConfig(device="cuda:1", max_batch_tokens=64).batch_tokens == 64
    with pytest.raises(InvalidRequestError):
        EngineConfig(max_batch_tokens=0)
    core = small_core(synthetic_model("tiny-llama", seed=3), max_batch_tokens=None)
    assert core.scheduler.max_batch_tokens == 256


def test_block_tables_convert_only_new_blocks_and_follow_replaced_lists():
    from replica.runner import BlockTables
    from replica.stream import Stream

    s = Stream("a", [1], SamplingParams())
    tables = BlockTables()
    s.block_table = [3, 4]
    first = tables.get(s)
    assert first.tolist() == [3, 4] and first.dtype == torch.int32
    assert tables.get(s) is first  # unchanged: no conversion
    s.block_table = s.block_table + [9]  # grown, as the scheduler grows it
    assert tables.get(s).tolist() == [3, 4, 9]
    s.block_table = [7]  # preempted and readmitted elsewhere
    assert tables.get(s).tolist() == [7]
    s.block_table = [7, 2, 8]
    assert tables.get(s).tolist() == [7, 2, 8]
    s.block_table = [5, 2, 8, 1]  # same length prefix, other blocks
    assert tables.get(s).tolist() == [5, 2, 8, 1]
