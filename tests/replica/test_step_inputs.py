"""A step's host-side inputs, against plain loops that fill them one element at a time: the
decode graph's staging (replica/graphs.py, CPU tensors standing in for its pinned buffers),
the block tables stacked for a step, and the eager runner's ForwardBatch."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import prefill
from replica.graphs import DecodeGraphs, stage_decode
from replica.models.synthetic import synthetic_model
from replica.request import Request
from replica.sampling import SamplingParams
from replica.scheduler import Chunk, StepRecord
from replica.step_inputs import BlockTables, int_tensor
from replica.stream import Stream
from tests.replica.schedules import small_core

BS = 4


def decode_stream(rng: random.Random, name: str) -> Stream:
    """A stream about to decode: its last token has no KV yet, its table covers it."""
    prompt = [rng.randrange(320) for _ in range(rng.randint(1, 30))]
    out = [rng.randrange(320) for _ in range(rng.randint(0, 30))]
    s = Stream(name, prompt, SamplingParams(), output_ids=out)
    blocks = -(-s.num_tokens // BS) + rng.randint(0, 2)
    s.block_table = rng.sample(range(500), blocks)
    s.num_computed = s.num_tokens - 1
    return s


def plain_staging(record: StepRecord, b: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What _Graph.load staged before it was vectorized, element by element."""
    ints = torch.zeros(3, b, dtype=torch.int64)
    ints[2] = -1
    ctx = torch.zeros(b + b * w, dtype=torch.int32)
    for i, c in enumerate(record.chunks):
        s, p = c.stream, c.start
        ints[0, i] = s.tokens[p]
        ints[1, i] = p
        ints[2, i] = s.block_table[p // BS] * BS + p % BS
        ctx[i] = p + 1
        for j, block in enumerate(s.block_table):
            ctx[b + i * w + j] = block
    return ints, ctx


def test_decode_staging_equals_a_plain_loop_across_steps_buckets_and_table_changes():
    rng = random.Random(7)
    tables = BlockTables()
    streams = [decode_stream(rng, f"s{i}") for i in range(40)]
    buffers: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for step in range(60):
        batch = rng.sample(streams, rng.randint(1, len(streams)))
        record = StepRecord(tuple(Chunk(s, s.num_tokens - 1, s.num_tokens) for s in batch), ())
        b, w = DecodeGraphs.key_for(len(batch), max(len(s.block_table) for s in batch))
        if (b, w) not in buffers:  # garbage first: staging must write every element
            buffers[b, w] = (torch.randint(-9, 9, (3, b), dtype=torch.int64),
                             torch.randint(-9, 9, (b + b * w,), dtype=torch.int32))
        ints, ctx = buffers[b, w]
        stage_decode(record, BS, tables, ints, ctx)
        want_ints, want_ctx = plain_staging(record, b, w)
        assert torch.equal(ints, want_ints) and torch.equal(ctx, want_ctx), step
        for s in rng.sample(streams, 8):  # decode a token; grow, or replace, some tables
            s.output_ids.append(rng.randrange(320))
            s.num_computed += 1
            if rng.random() < 0.2:  # preempted and readmitted: another list, other blocks
                s.block_table = rng.sample(range(500), -(-s.num_tokens // BS))
            elif len(s.block_table) * BS < s.num_tokens or rng.random() < 0.1:
                s.block_table = s.block_table + [rng.randrange(500, 700)]
    assert len(buffers) >= 3  # several batch buckets


def test_stacked_tables_are_zero_padded_and_follow_each_change():
    tables = BlockTables()
    a = Stream("a", [1], SamplingParams(), block_table=[3, 4])
    b = Stream("b", [1], SamplingParams(), block_table=[9])
    assert tables.stack([a, b], 3).tolist() == [[3, 4, 0], [9, 0, 0]]
    assert tables.stack([b, a], 2).tolist() == [[9, 0], [3, 4]]
    assert tables.stack([a], 3).dtype == torch.int32
    assert tables.padded(a, 3) is tables.padded(a, 3)  # unchanged: no conversion
    a.block_table = a.block_table + [7]  # grown
    b.block_table = [5, 6]  # replaced
    out = torch.full((2, 4), -1, dtype=torch.int32)
    assert tables.stack([a, b], 4, out=out) is out
    assert out.tolist() == [[3, 4, 7, 0], [5, 6, 0, 0]]
    assert tables.get(a).tolist() == [3, 4, 7]
    with pytest.raises(ValueError):
        tables.padded(a, 2)


def test_int_tensor_keeps_values_and_dtype():
    t = int_tensor([3, -1, 2**40], torch.int64)
    assert t.dtype == torch.int64 and t.tolist() == [3, -1, 2**40]
    t = int_tensor([7, 0], torch.int32)
    assert t.dtype == torch.int32 and t.tolist() == [7, 0]
    assert int_tensor([], torch.int64).shape == (0,)


def plain_batch(record: StepRecord, bs: int, fast_prefill: bool) -> dict[str, list]:
    """The eager ForwardBatch's fields, from the chunks one token at a time."""
    f: dict[str, list] = {k: [] for k in ("token_ids", "positions", "slots", "tok_row",
                                          "ctx_lens", "logit_rows", "paged_rows")}
    width = max(len(c.stream.block_table) for c in record.chunks)
    f["block_tables"] = [c.stream.block_table + [0] * (width - len(c.stream.block_table))
                         for c in record.chunks]
    prefill_rows = []
    for r, c in enumerate(record.chunks):
        s = c.stream
        for p in range(c.start, c.end):
            tiled = fast_prefill and prefill.MIN_POSITION <= p < len(s.prompt_ids)
            (prefill_rows if tiled else f["paged_rows"]).append(len(f["token_ids"]))
            f["token_ids"].append(s.tokens[p])
            f["positions"].append(p)
            f["slots"].append(s.block_table[p // bs] * bs + p % bs)
            f["tok_row"].append(r)
            f["ctx_lens"].append(p + 1)
        if c.samples:
            f["logit_rows"].append(len(f["token_ids"]) - 1)
    if not prefill_rows:
        f["paged_rows"] = None
    return f


@pytest.mark.parametrize("fast_prefill", [False, True])
def test_eager_batch_equals_a_plain_loop(monkeypatch, fast_prefill):
    monkeypatch.setattr(prefill, "MIN_POSITION", 12)
    core = small_core(synthetic_model("tiny-llama", seed=3), fast_prefill=fast_prefill,
                      max_batch_tokens=64, num_kv_blocks=128)
    rng = random.Random(5)
    for i in range(6):  # prompts of different lengths: prefill chunks and decodes share steps
        ids = tuple(rng.randrange(320) for _ in range(rng.randint(3, 40)))
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        core.add(core.prepare(Request(prompt_token_ids=ids, params=params, request_id=f"r{i}")),
                 lambda ev: None)
    build, checked = core.runner.build, []

    def checked_build(record, feed_ids=None):  # (lookahead is off on CPU: never fed)
        batch, sample_chunks, hidden = build(record, feed_ids)
        want = plain_batch(record, core.config.block_size, fast_prefill)
        for name, value in want.items():
            got = getattr(batch, name)
            assert (got is None) if value is None else got.tolist() == value, name
        if want["paged_rows"] is not None:
            rows = want["paged_rows"]
            assert batch.paged_tok_row.tolist() == [want["tok_row"][i] for i in rows]
            assert batch.paged_ctx_lens.tolist() == [want["ctx_lens"][i] for i in rows]
        assert batch.tok_row.dtype == batch.ctx_lens.dtype == batch.block_tables.dtype == torch.int32
        checked.append(record)
        return batch, sample_chunks, hidden

    core.runner.build = checked_build
    while core.has_work:
        core.step()
    assert len(checked) > 6
    assert any(len(r.chunks) > 1 and any(c.end - c.start > 1 for c in r.chunks) for r in checked)
