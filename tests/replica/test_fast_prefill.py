"""The tiled prefill path in the engine (kernels/prefill.py), run on CPU with small pieces: a
stream's bits do not depend on its batch, its chunking, preemption or where its tokens came
from, and the runner sends exactly the prompt tokens past MIN_POSITION down that path."""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import prefill
from replica.models.synthetic import synthetic_model
from replica.scheduler import Chunk
from replica.stream import Stream
from replica.sampling import SamplingParams
from tests.replica.schedules import StreamSpec, run_schedule, run_solo, small_core
from tests.replica.test_invariance import stream_specs

PIECE, MIN_POSITION = 8, 12  # small, so that prompts of a few dozen tokens cross pieces


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    monkeypatch.setattr(prefill, "PIECE", PIECE)
    monkeypatch.setattr(prefill, "MIN_POSITION", MIN_POSITION)


@functools.lru_cache(maxsize=None)
def loaded(preset: str):
    return synthetic_model(preset, seed=11)


def core(preset: str, **kw):
    kw.setdefault("num_kv_blocks", 256)
    return small_core(loaded(preset), fast_prefill=True, **kw)


@functools.lru_cache(maxsize=1024)
def solo(preset: str, spec: StreamSpec):
    plain = StreamSpec(spec.prompt, spec.max_tokens, spec.temperature, spec.top_p, spec.top_k,
                       spec.seed)
    tokens, logits = run_solo(core(preset), plain)
    return tuple(tokens), tuple(logits)


def check(preset: str, specs, **kw) -> None:
    c = core(preset, **kw)
    got, logits = run_schedule(c, specs)
    for i, spec in enumerate(specs):
        ref, ref_logits = solo(preset, spec)
        n = len(got[i])
        assert tuple(got[i]) == ref[:n] and tuple(logits[i]) == ref_logits[: len(logits[i])], i
        if spec.cancel_after is None:
            assert tuple(got[i]) == ref, f"stream {i}: tokens differ from its solo run"
    c.check_integrity()


LONG = st.lists(stream_specs(320), min_size=6, max_size=10).map(
    lambda specs: [StreamSpec(s.prompt * 3, s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed,
                              s.arrival, s.cancel_after) for s in specs])


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(specs=LONG, num_kv_blocks=st.integers(40, 96), max_batch_tokens=st.integers(4, 48),
       max_running_streams=st.integers(1, 10))
def test_random_schedules_with_tiled_prefill_equal_solo_runs_bitwise(
        specs, num_kv_blocks, max_batch_tokens, max_running_streams):
    check("tiny-llama", specs, num_kv_blocks=num_kv_blocks, max_batch_tokens=max_batch_tokens,
          max_running_streams=max_running_streams)


def test_moe_and_preemption_with_tiled_prefill():
    specs = [StreamSpec(tuple(range(i, i + 40)), 30, arrival=i % 3) for i in range(6)]
    c = core("tiny-qwen3-moe", num_kv_blocks=30, max_batch_tokens=64)
    got, logits = run_schedule(c, specs)
    assert c.scheduler.num_preemptions > 0
    for i, spec in enumerate(specs):
        assert (tuple(got[i]), tuple(logits[i])) == solo("tiny-qwen3-moe", spec), i


def test_only_prompt_tokens_past_min_position_take_the_tiled_path():
    c = core("tiny-llama")
    s = Stream("r", list(range(30)), SamplingParams(), output_ids=[1, 2, 3])
    rng = c.runner.prefill_range
    assert rng(Chunk(s, 0, 12)) is None  # all below MIN_POSITION
    assert rng(Chunk(s, 5, 20)) == (12, 20)
    assert rng(Chunk(s, 20, 33)) == (20, 30)  # the resumed/decoded tokens stay paged
    assert rng(Chunk(s, 30, 33)) is None
    assert small_core(loaded("tiny-llama")).runner.prefill_range(Chunk(s, 5, 20)) is None  # CPU default


def test_tiled_prefill_changes_the_numbers_only_slightly():
    """Same model, same prompt: the tiled path and the paged kernel agree to float32 rounding."""
    spec = StreamSpec(tuple(range(3, 60)), 1)
    fast = run_solo(core("tiny-llama"), spec)
    paged = run_solo(small_core(loaded("tiny-llama"), num_kv_blocks=256), spec)
    assert fast[0] == paged[0]
