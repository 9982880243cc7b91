"""Property: under random schedules (joins, finishes, cancellations, preemption, chunked
prefill), every stream's tokens are bitwise those of its solo run, and the KV of continuing
streams never changes across a step."""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replica.models.synthetic import synthetic_model
from tests.replica.schedules import StreamSpec, run_schedule, run_solo, small_core


@functools.lru_cache(maxsize=None)
def loaded(preset: str):
    if preset == "smollm2-135m":
        from replica.models.registry import resolve_model

        return resolve_model(preset)
    return synthetic_model(preset, seed=7)


@functools.lru_cache(maxsize=None)
def solo_core(preset: str):
    return small_core(loaded(preset), num_kv_blocks=256)


@functools.lru_cache(maxsize=4096)
def solo(preset: str, spec: StreamSpec) -> tuple[tuple[int, ...], tuple]:
    plain = StreamSpec(spec.prompt, spec.max_tokens, spec.temperature, spec.top_p, spec.top_k,
                       spec.seed)
    tokens, logits = run_solo(solo_core(preset), plain)
    return tuple(tokens), tuple(logits)


def stream_specs(vocab: int, greedy_share: int = 1):
    """greedy_share: greedy streams per sampled one, on average."""
    sampled = st.tuples(st.floats(0.3, 1.5), st.sampled_from([1.0, 0.9, 0.5]),
                        st.sampled_from([0, 5, 50]), st.integers(0, 2**31))
    return st.builds(
        lambda prompt, mt, samp, arrival, cancel: StreamSpec(
            tuple(prompt), mt, *(samp if samp else (0.0, 1.0, 0, None)), arrival, cancel),
        st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40),
        st.integers(1, 24),
        st.one_of(*[st.none()] * greedy_share, sampled),
        st.integers(0, 12),
        st.one_of(st.none(), st.none(), st.integers(0, 8)),
    )


def check(preset: str, specs, **core_kw) -> None:
    core = small_core(loaded(preset), **core_kw)
    got, logits = run_schedule(core, specs)
    for i, spec in enumerate(specs):
        ref, ref_logits = solo(preset, spec)
        if spec.cancel_after is None:
            assert tuple(got[i]) == ref, f"stream {i}: tokens differ from its solo run"
            assert tuple(logits[i]) == ref_logits, f"stream {i}: logit bits differ from solo"
        else:  # cancelled: whatever it produced is a prefix of the solo run
            assert tuple(got[i]) == ref[: len(got[i])], f"stream {i} (cancelled) diverged"
            assert tuple(logits[i]) == ref_logits[: len(logits[i])], f"stream {i} (cancelled)"
    core.check_integrity()
    assert core.pool.num_free == core.pool.num_blocks  # no session ids: nothing retained


SCHEDULE = st.lists(stream_specs(320), min_size=12, max_size=16)
KNOBS = dict(num_kv_blocks=st.integers(17, 64), max_batch_tokens=st.integers(4, 48),
             max_running_streams=st.integers(1, 16))


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(specs=SCHEDULE, **KNOBS)
def test_random_schedules_tiny_llama(specs, num_kv_blocks, max_batch_tokens, max_running_streams):
    check("tiny-llama", specs, num_kv_blocks=num_kv_blocks, max_batch_tokens=max_batch_tokens,
          max_running_streams=max_running_streams)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(specs=st.lists(stream_specs(320, greedy_share=6), min_size=12, max_size=16), **KNOBS)
def test_random_schedules_tiny_llama_lookahead(specs, num_kv_blocks, max_batch_tokens,
                                               max_running_streams):
    """With lookahead (decode steps launched before the step before has returned its tokens,
    fed on the device; only while every running stream is greedy) against solo runs without
    it."""
    check("tiny-llama", specs, num_kv_blocks=num_kv_blocks, max_batch_tokens=max_batch_tokens,
          max_running_streams=max_running_streams, lookahead=True)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(specs=SCHEDULE, **KNOBS)
def test_random_schedules_tiny_moe(specs, num_kv_blocks, max_batch_tokens, max_running_streams):
    check("tiny-qwen3-moe", specs, num_kv_blocks=num_kv_blocks, max_batch_tokens=max_batch_tokens,
          max_running_streams=max_running_streams)


def test_preemption_happens_and_is_harmless():
    """A pool too small for all streams at once forces preemption; outputs are unchanged."""
    specs = [StreamSpec(tuple(range(i, i + 30)), 10, arrival=0) for i in range(12)]
    core = small_core(loaded("tiny-llama"), num_kv_blocks=24, max_batch_tokens=64)
    got, logits = run_schedule(core, specs)
    assert core.scheduler.num_preemptions > 0
    for i, spec in enumerate(specs):
        assert (tuple(got[i]), tuple(logits[i])) == solo("tiny-llama", spec)


@pytest.mark.slow
@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(specs=st.lists(stream_specs(49152), min_size=12, max_size=12),
       max_batch_tokens=st.integers(8, 64))
def test_random_schedules_real_model(specs, max_batch_tokens):
    """The embedded SmolLM2 under random schedules: logits bits equal to solo runs."""
    specs = [StreamSpec(s.prompt[:16], min(s.max_tokens, 6), s.temperature, s.top_p, s.top_k,
                        s.seed, s.arrival, s.cancel_after) for s in specs]
    check("smollm2-135m", specs, num_kv_blocks=96, max_batch_tokens=max_batch_tokens,
          max_running_streams=12)
