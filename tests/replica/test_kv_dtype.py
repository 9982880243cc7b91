"""The KV pool's dtype: bf16 (the CUDA default) against fp32 (the CPU default) on the CPU path,
where a bf16 pool is read through an exact upcast of the blocks a step names."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from replica.config import EngineConfig
from replica.errors import InvalidRequestError
from replica.models.hf_loader import load_hf_dir
from replica.models.synthetic import synthetic_model
from tests.replica.near_ties import all_logits, assert_parts_only_at_near_ties
from tests.replica.schedules import StreamSpec, run_schedule, run_solo, small_core
from tests.replica.test_invariance import KNOBS, SCHEDULE
from tests.replica.tiny_models import make_tiny_llama, make_tiny_qwen3, make_tiny_qwen3_moe

BUILDERS = {"llama": make_tiny_llama, "qwen3": make_tiny_qwen3, "qwen3_moe": make_tiny_qwen3_moe}


@functools.lru_cache(maxsize=None)
def tiny(name: str):
    if name.startswith("synthetic:"):
        return synthetic_model(name.removeprefix("synthetic:"), seed=7)
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp(prefix=f"fedserve-{name}-"))
    return load_hf_dir(BUILDERS[name](path / name).path)


def greedy_tokens(loaded, kv_dtype: str, prompts) -> list[list[int]]:
    core = small_core(loaded, kv_dtype=kv_dtype, num_kv_blocks=256, block_size=16,
                      max_batch_tokens=64, poison_freed_kv=False)
    specs = [StreamSpec(p, 64) for p in prompts]
    got, _ = run_schedule(core, specs, check_kv=False)
    assert core.kv.k[0].dtype == getattr(torch, kv_dtype)
    return [got[i] for i in range(len(specs))]


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_moe", "synthetic:tiny-llama",
                                  "synthetic:tiny-qwen3-moe"])
def test_bf16_kv_gives_the_greedy_tokens_of_fp32_kv_over_64_steps(name):
    """Greedy runs of 64 steps on a bf16 and an fp32 pool give the same tokens. Random tiny
    models have near-ties (top-2 logits 1e-4 apart, against bf16's ~1e-3 perturbation), so a
    run may part at a step where the fp32 run itself was a near-tie — its top-2 gap under 1% of
    the logit range, or, for MoE, a router whose k-th and (k+1)-th experts were as close — and
    nowhere else; and most (60%) of the steps must agree."""
    loaded = tiny(name)
    cfg = loaded.config
    prompts = [tuple((7 * i + 3 * j) % cfg.vocab_size for j in range(5 + 9 * i)) for i in range(4)]
    fp32 = greedy_tokens(loaded, "float32", prompts)
    bf16 = greedy_tokens(loaded, "bfloat16", prompts)
    assert all(len(t) == 64 for t in fp32)
    assert_parts_only_at_near_ties(loaded, prompts, fp32, bf16)
    for prompt, b in zip(prompts, bf16):  # and the bf16 run is what a bf16 prefill predicts
        logits, _ = all_logits(loaded, list(prompt) + b[:-1], torch.bfloat16)
        assert logits[len(prompt) - 1:].argmax(-1).tolist() == b


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(specs=SCHEDULE, **KNOBS)
def test_bf16_kv_is_batch_invariant_bitwise(specs, num_kv_blocks, max_batch_tokens,
                                            max_running_streams):
    """Random schedules on a bf16 pool: every stream's tokens and logit bits equal its solo run
    on a bf16 pool (the upcast copy is per block, never mixing streams)."""
    loaded = tiny("synthetic:tiny-llama")
    core = small_core(loaded, kv_dtype="bfloat16", num_kv_blocks=num_kv_blocks,
                      max_batch_tokens=max_batch_tokens, max_running_streams=max_running_streams)
    got, logits = run_schedule(core, specs)
    for i, spec in enumerate(specs):
        plain = StreamSpec(spec.prompt, spec.max_tokens, spec.temperature, spec.top_p, spec.top_k,
                           spec.seed)
        ref_tokens, ref_logits = run_solo(small_core(loaded, kv_dtype="bfloat16",
                                                     num_kv_blocks=256), plain)
        n = len(got[i])
        assert got[i] == ref_tokens[:n] and logits[i] == ref_logits[: len(logits[i])], i
        if spec.cancel_after is None:
            assert got[i] == ref_tokens
    core.check_integrity()


def test_kv_dtype_defaults_by_device_and_rejects_unknown_names():
    assert EngineConfig().kv_torch_dtype == torch.float32
    assert EngineConfig(device="cuda").kv_torch_dtype == torch.bfloat16
    assert EngineConfig(device="cuda:0", kv_dtype="float32").kv_torch_dtype == torch.float32
    assert EngineConfig(kv_dtype="bfloat16").kv_torch_dtype == torch.bfloat16
    with pytest.raises(InvalidRequestError):
        EngineConfig(kv_dtype="float16")
