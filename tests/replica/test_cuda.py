"""The engine on CUDA at its defaults (skipped without a GPU): the KV pool sized from the device
in bf16, the tiled prefill past position 512, CUDA vs CPU greedy tokens, and a stream's bits
alone vs among 1..64 others at contexts 128 and 2,048.

Run on the GPU machine (every test here has "cuda" in its name):
    python -m pytest -q tests/replica -k cuda
"""

from __future__ import annotations

import gc
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from kernels import prefill  # noqa: E402
from replica.config import EngineConfig  # noqa: E402
from replica.core import EngineCore  # noqa: E402
from replica.kv import KVCache  # noqa: E402
from replica.models.synthetic import synthetic_model  # noqa: E402
from tests.replica.near_ties import assert_parts_only_at_near_ties  # noqa: E402
from tests.replica.schedules import StreamSpec, loaded, run_schedule, run_solo, small_core  # noqa: E402

SMALL = "small-qwen3-moe-q4"  # head_dim 128, GQA 4:1, q4 experts, 40,960 positions


def release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def greedy(preset: str, device: str, prompts, max_tokens: int, **kw) -> list[list[int]]:
    core = EngineCore(EngineConfig(model=f"synthetic:{preset}", device=device, block_size=16,
                                   num_kv_blocks=kw.pop("num_kv_blocks", 512), **kw),
                      loaded=loaded(preset))
    got, _ = run_schedule(core, [StreamSpec(p, max_tokens) for p in prompts], check_kv=False)
    del core
    release()
    return [got[i] for i in range(len(prompts))]


def test_cuda_default_pool_is_bf16_and_sized_from_free_memory():
    release()
    free0, _ = torch.cuda.mem_get_info()
    core = EngineCore(EngineConfig(model=f"synthetic:{SMALL}", device="cuda"))
    cfg = core.model_config
    assert core.kv.k[0].dtype == torch.bfloat16 and core.runner.fast_prefill
    per_block = KVCache.bytes_per_block(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim,
                                        torch.bfloat16)
    pool = core.pool.num_blocks * per_block
    assert 0.6 * free0 < pool <= 0.9 * free0, (pool, free0)
    assert core.stats()["kv_capacity_tokens"] == core.pool.num_blocks * 16
    assert torch.cuda.mem_get_info()[0] > 0.05 * free0  # headroom left for graphs and steps
    del core
    release()
    half = EngineCore(EngineConfig(model=f"synthetic:{SMALL}", device="cuda",
                                   gpu_memory_utilization=0.45))
    assert 0.25 * free0 < half.pool.num_blocks * per_block <= 0.45 * free0
    del half
    release()
    explicit = EngineCore(EngineConfig(model=f"synthetic:{SMALL}", device="cuda", num_kv_blocks=77))
    assert explicit.pool.num_blocks == 77
    del explicit
    release()


def test_cuda_matches_cpu_greedy_tokens_on_tiny_qwen3_moe():
    """fp32 pools and the paged kernel on both: the same tokens, as before bf16 existed."""
    prompts = [tuple(range(3 + i, 40 + 7 * i, 3)) for i in range(6)]
    cpu = greedy("tiny-qwen3-moe", "cpu", prompts, 24)
    assert greedy("tiny-qwen3-moe", "cuda", prompts, 24, kv_dtype="float32",
                  fast_prefill=False) == cpu


def test_cuda_bf16_defaults_follow_cpu_up_to_near_ties_on_tiny_qwen3_moe():
    """CUDA at its defaults (bf16 pool) against CPU on a bf16 pool: the same greedy tokens, but
    for a step where the CPU run was a near-tie (tests/replica/near_ties.py)."""
    prompts = [tuple(range(3 + i, 40 + 7 * i, 3)) for i in range(6)]
    cpu = greedy("tiny-qwen3-moe", "cpu", prompts, 24, kv_dtype="bfloat16")
    cuda = greedy("tiny-qwen3-moe", "cuda", prompts, 24)
    assert_parts_only_at_near_ties(loaded("tiny-qwen3-moe"), prompts, cpu, cuda,
                                   ref_kv_dtype=torch.bfloat16)


def test_cuda_tiled_prefill_of_long_prompts_follows_cpu_up_to_near_ties():
    """Prompts of 700-850 tokens (past MIN_POSITION: the tiled FlashAttention path, which also
    rounds q and the softmax weights to bf16) against the CPU's paged kernel on a bf16 pool:
    a near-tie here is a top-2 gap under 3% of the logit range."""
    g = torch.Generator().manual_seed(5)
    prompts = [tuple(torch.randint(0, 256, (700 + 50 * i,), generator=g).tolist()) for i in range(4)]
    calls = []
    attend = prefill.prefill_attention_batch
    prefill.prefill_attention_batch = lambda *a, **k: calls.append(1) or attend(*a, **k)
    try:
        cuda = greedy("tiny-qwen3-moe", "cuda", prompts, 24, num_kv_blocks=512)
    finally:
        prefill.prefill_attention_batch = attend
    assert calls, "the long prompts should have used the tiled prefill"
    cpu = greedy("tiny-qwen3-moe", "cpu", prompts, 24, kv_dtype="bfloat16")
    assert_parts_only_at_near_ties(loaded("tiny-qwen3-moe"), prompts, cpu, cuda, min_agree=0.5,
                                   tie=0.03, ref_kv_dtype=torch.bfloat16)


def others(n: int, context: int, vocab: int) -> list[StreamSpec]:
    g = torch.Generator().manual_seed(n + context)
    out = []
    for _ in range(n):
        length = int(torch.randint(context // 2, context * 3 // 2 + 1, (1,), generator=g))
        out.append(StreamSpec(tuple(torch.randint(0, min(vocab, 256), (length,), generator=g).tolist()),
                              int(torch.randint(1, 12, (1,), generator=g)),
                              arrival=int(torch.randint(0, 4, (1,), generator=g))))
    return out


@pytest.mark.parametrize("preset", [SMALL, "qwen3-30b-a3b-int4"])
@pytest.mark.parametrize("context", [128, 2048])
def test_cuda_stream_alone_vs_among_1_to_64_others_bitwise(preset, context):
    """Default numerics (bf16 pool, tiled prefill from MIN_POSITION, step budget 8192, CUDA graphs): the
    stream's tokens and logit bits are the same alone and among 1, 7, 31, 64 others whose
    prompts chunk the steps differently. One engine core serves every run (its blocks are
    reused in another order each time, freed ones NaN-poisoned). At 2,048 the stream samples
    (its token drawn on the device, replica/sampling.pick, among rows that do not)."""
    kw = dict(device="cuda", block_size=16, num_kv_blocks=65 * (context * 3 // 2 + 32) // 16 + 64,
              max_running_streams=65, max_batch_tokens=None, poison_freed_kv=True)
    g = torch.Generator().manual_seed(context)
    sampled = dict(temperature=0.8, top_p=0.9, seed=3) if context == 2048 else {}
    spec = StreamSpec(tuple(torch.randint(0, 256, (context,), generator=g).tolist()), 10, **sampled)
    calls = []
    attend = prefill.prefill_attention_batch
    prefill.prefill_attention_batch = lambda *a, **k: calls.append(1) or attend(*a, **k)
    core = small_core(loaded(preset, "cuda"), **kw)  # the loader's copy freed once it is built
    try:
        solo_tokens, solo_logits = run_solo(core, spec)
        assert len(solo_logits) == 10
        for n in (1, 7, 31, 64):
            specs = others(n, context, core.model_config.vocab_size)
            specs.insert(n // 2, StreamSpec(spec.prompt, spec.max_tokens, arrival=1, **sampled))
            tokens, logits = run_schedule(core, specs, check_kv=False)
            assert tokens[n // 2] == solo_tokens, n
            assert logits[n // 2] == solo_logits, f"{n} others: logit bits differ from the solo run"
            assert core.pool.num_free == core.pool.num_blocks
        assert core.runner.graphs.captured, "decode steps should have used CUDA graphs"
    finally:
        prefill.prefill_attention_batch = attend
        del core
        release()
    assert bool(calls) == (context > prefill.MIN_POSITION)


def test_cuda_lookahead_gives_the_plain_tokens_and_logit_bits():
    """On CUDA a decode step is launched before the step before has returned its tokens (the
    default): its tokens are fed on the device into the graph's inputs. Streams that join,
    finish at different lengths and are cancelled get the tokens and logit bits of a run
    without lookahead, and steps really ran ahead; a third of them sample (their tokens drawn
    on the device feed the steps ahead as greedy ones do)."""
    model = loaded(SMALL, "cuda")
    g = torch.Generator().manual_seed(5)
    specs = [StreamSpec(tuple(torch.randint(0, 256, (int(n),), generator=g).tolist()), int(m),
                        arrival=int(a), cancel_after=c,
                        **(dict(temperature=0.9, top_k=40, seed=i) if i % 3 == 1 else {}))
             for i, (n, m, a, c) in enumerate(zip(torch.randint(20, 300, (12,), generator=g),
                                                  torch.randint(3, 40, (12,), generator=g),
                                                  torch.randint(0, 6, (12,), generator=g),
                                                  [None] * 10 + [9, 20]))]
    runs, ahead = [], []
    for lookahead in (False, True):
        core = small_core(model, device="cuda", block_size=16, num_kv_blocks=512,
                          max_running_streams=16, max_batch_tokens=None, lookahead=lookahead)
        launch, fed = core.runner.launch, []
        core.runner.launch = lambda record, feed=None: fed.append(feed is not None) or launch(record, feed)
        runs.append(run_schedule(core, specs))
        ahead.append(sum(fed))
        assert core.pool.num_free == core.pool.num_blocks
        del core
        release()
    assert runs[1] == runs[0]
    assert ahead[0] == 0 and ahead[1] >= 20


def test_cuda_synthetic_30b_draws_on_the_device_in_seconds_and_deterministically():
    release()
    t0 = time.perf_counter()
    core = EngineCore(EngineConfig(model="synthetic:qwen3-30b-a3b-int4", device="cuda",
                                   num_kv_blocks=64))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    print(f"synthetic:qwen3-30b-a3b-int4 on cuda: engine core built in {seconds:.1f} s")
    assert seconds <= 30
    del core
    release()
    a, b = synthetic_model(SMALL, seed=3, device="cuda"), synthetic_model(SMALL, seed=3, device="cuda")
    c = synthetic_model(SMALL, seed=4, device="cuda")
    wa, wb, wc = (m.weights.layers[1].experts[5].down for m in (a, b, c))
    assert wa.qs.device.type == "cuda"
    assert torch.equal(wa.qs, wb.qs) and torch.equal(wa.scale, wb.scale)
    assert not torch.equal(wa.qs, wc.qs)
