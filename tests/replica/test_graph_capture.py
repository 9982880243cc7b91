"""Which decode graph a step replays (replica/graphs.py): its own once captured; before that,
the smallest captured graph that holds it (more rows, a wider table: padding, the same bits),
for CAPTURE_AFTER steps, so the tail of a burst — streams finishing a few steps apart, a new
bucket each step — stops no step for a capture; then its own is captured. An idle engine
captures the graphs that steps ran padded, the most used first. The capture and the replay are
CUDA's (stand-ins here; tests/kernels/test_gpu.py and tests/replica/test_cuda.py run them)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from replica import graphs
from replica.config import EngineConfig
from replica.core import EngineCore
from replica.sampling import SamplingParams
from replica.scheduler import Chunk, StepRecord
from replica.stream import Stream


def decode_step(streams: int, blocks: int) -> StepRecord:
    chunks = []
    for i in range(streams):
        s = Stream(f"r{i}", [1, 2, 3], SamplingParams(temperature=0.0))
        s.block_table = list(range(blocks))
        chunks.append(Chunk(s, 2, 3))
    return StepRecord(tuple(chunks), ())


@pytest.fixture
def dg(monkeypatch):
    made, loads = [], []

    class Graph:  # stands in for the captured graph: records captures and what it is given
        def __init__(self, model, kv, batch, width, device):
            made.append((batch, width))
            self.key = (batch, width)
            self.graph = SimpleNamespace(replay=lambda: None)
            self.logits = self.argmax = None

        def load(self, record, block_size, tables, feed_ids=None):
            loads.append((self.key, len(record.chunks)))

    monkeypatch.setattr(graphs, "_Graph", Graph)
    d = graphs.DecodeGraphs(SimpleNamespace(device="cpu"), SimpleNamespace(block_size=16))
    d.made, d.loads = made, loads
    return d


def test_a_step_runs_padded_in_a_captured_graph_until_its_own_is_captured(dg):
    big = decode_step(60, 20)  # (64, 32)
    dg.launch(big)
    assert dg.made == [(64, 32)]  # nothing captured held it: captured at once
    tail = decode_step(10, 18)  # (12, 32): held by (64, 32)
    for _ in range(graphs.CAPTURE_AFTER):
        dg.launch(tail)
    assert dg.made == [(64, 32)]
    assert dg.loads[1:] == [((64, 32), 10)] * graphs.CAPTURE_AFTER
    dg.launch(tail)  # its CAPTURE_AFTER + 1st step: its own graph, from now on
    dg.launch(tail)
    assert dg.made == [(64, 32), (12, 32)] and dg.loads[-2:] == [((12, 32), 10)] * 2
    wider = decode_step(3, 40)  # (4, 64): no captured graph is that wide
    dg.launch(wider)
    assert dg.made[-1] == (4, 64)


def test_the_smallest_holder_is_chosen_and_idle_time_captures_the_most_used_first(dg):
    for streams, blocks in ((64, 20), (16, 20), (64, 100)):  # (64, 32), (16, 32), (64, 128)
        dg.warm(streams, blocks)
    a, b = decode_step(10, 18), decode_step(40, 18)  # (12, 32) → (16, 32); (40, 32) → (64, 32)
    dg.launch(a)
    dg.launch(b)
    dg.launch(b)
    assert [k for k, _ in dg.loads] == [(16, 32), (64, 32), (64, 32)]
    assert dg.capture_missed() and dg.made[-1] == (40, 32)  # missed twice
    assert dg.capture_missed() and dg.made[-1] == (12, 32)
    assert not dg.capture_missed()
    dg.launch(a)
    assert dg.loads[-1] == ((12, 32), 10)


def test_the_narrowest_width_is_captured_with_the_next_so_crossing_it_stops_nothing(dg):
    """The narrowest table bucket (one attention split: no merge kernel) and the next are
    captured together: streams crossing MIN_GRAPH_BLOCKS blocks find their graph ready."""
    narrow, wide = graphs.MIN_GRAPH_BLOCKS, 2 * graphs.MIN_GRAPH_BLOCKS
    dg.launch(decode_step(3, narrow - 4))
    assert dg.made == [(4, narrow), (4, wide)] and dg.loads == [((4, narrow), 3)]
    dg.launch(decode_step(3, narrow + 1))  # its own graph, captured already
    assert dg.made == [(4, narrow), (4, wide)] and dg.loads[-1] == ((4, wide), 3)
    dg.launch(decode_step(3, wide + 1))  # a wider one alone
    assert dg.made[2:] == [(4, 2 * wide)]
    dg.warm(10, 1)
    assert dg.made[3:] == [(12, narrow), (12, wide)]


def test_an_idle_cpu_engine_has_nothing_to_capture():
    core = EngineCore(EngineConfig(model="synthetic:tiny-llama"))
    assert core.runner.graphs is None and core.idle() is False
