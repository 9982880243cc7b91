"""`fedserve bench engine --context N,...`: prefill and decode at given prompt lengths.

For each context and concurrency, two phases on the same streams (ignore_eos; greedy unless
--temperature: then each stream samples, seeded by its index, top-p --top-p):
  prefill: every prompt of exactly `context` token ids submitted at once for one token, its
    KV kept under a session id: prefill tok/s (prompt tokens / time until the last first
    token) and TTFT;
  decode: the same prompts again under their sessions, so each recomputes one token and all
    start decoding together: decode tok/s and ms/step over the steps where every stream
    decodes, the bytes such a step must move (bench.decode_bytes: weights touched + KV read)
    and that as a % of the roofline given by a copy measured in the same run. On CUDA also
    the decode step's CUDA graph alone, on inputs of exactly `streams` x `context`.
The engine runs with its default config (its KV pool sized from the device); each row says
whether its streams fit the pool at once (if not, sessions are evicted and recomputed).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import torch

from bench.engine import copy_bandwidth, decode_bytes, measure
from replica.engine import Engine
from replica.request import Request
from replica.sampling import SamplingParams


@dataclass
class ContextRow:
    context: int
    streams: int
    prefill_tok_per_s: float
    ttft_ms: float  # mean over streams
    ttft_max_ms: float
    decode_tok_per_s: float
    ms_per_step: float  # decode: wall per step once every stream has its first token
    ms_per_step_median: float  # the same steps' median: a one-off stall does not move it
    gb_per_step: float
    roofline_pct: float  # of the wall step
    gpu_ms_per_step: float = 0.0  # CUDA: the decode step's graph replayed alone
    gpu_roofline_pct: float = 0.0
    fits: bool = True  # all streams' KV fit the pool at once (else they queue or preempt)
    decode_steps: int = 0
    decode_gc_ms: float = 0.0  # Python's garbage collections during the decode phase, all
    decode_gc_max_ms: float = 0.0  # and the longest
    decode_step_max_ms: float = 0.0  # the longest decode step
    decode_step_max_at: int = 0  # its index among the decode phase's steps
    alloc_retries: int = 0  # CUDA allocator frees-and-retries during the decode phase


def prompts_of(context: int, streams: int, vocab: int, seed: int = 0) -> list[tuple[int, ...]]:
    """`streams` distinct prompts of exactly `context` ids (byte-range ids where the vocab is a
    byte tokenizer's, so every id is an ordinary token)."""
    g = torch.Generator().manual_seed(seed + 1000 * context + streams)
    hi = min(vocab, 256) if vocab < 1024 else vocab - 512
    return [tuple(torch.randint(0, hi, (context,), generator=g).tolist()) for _ in range(streams)]


def requests(prompts: list[tuple[int, ...]], max_tokens: int, tag: str | None = None,
             temperature: float = 0.0, top_p: float = 1.0) -> list[Request]:
    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                              seed=i if temperature else None, ignore_eos=True)

    return [Request(prompt_token_ids=p, params=params(i),
                    session_id=None if tag is None else f"{tag}-{i}") for i, p in enumerate(prompts)]


def bench_context(engine: Engine, context: int, streams: int, max_tokens: int, copy_gbs: float,
                  warm_buckets: bool = False, sampling: dict | None = None) -> ContextRow:
    prompts = prompts_of(context, streams, engine.model_config.vocab_size)
    graphs = engine.core.runner.graphs
    bs = engine.config.block_size
    if graphs is not None and warm_buckets:  # bench-only (--warm-buckets): capture every batch
        # bucket up to `streams` before timing (the streams join, and finish, a few steps apart:
        # the tail steps run smaller buckets). Off, the engine's own policy runs, as a user gets
        # it: a missed bucket replays a larger captured graph, then is captured when idle. On
        # the engine's thread (CUDA work must not race the loop's)
        widths = {-(-(ctx + 1) // bs) for ctx in range(context, context + max_tokens + 1, bs)}
        buckets = sorted({graphs.key_for(n)[0] for n in range(1, streams + 1)})
        engine.run_on_loop(lambda: [graphs.warm(b, w) for b in buckets for w in sorted(widths)],
                           timeout=600)
    tag = f"bench-{context}-{streams}"
    pre = measure(engine, requests(prompts, 1, tag, **(sampling or {})))
    dec = measure(engine, requests(prompts, max_tokens, tag, **(sampling or {})))
    core = engine.core
    engine.run_on_loop(lambda: [core.sessions.drop(k) for k in core.sessions.keys()])
    steps = max(dec["decode_steps"], 1)
    ms = dec["decode_s"] / steps * 1e3
    gb = decode_bytes(engine, streams, context + max_tokens / 2) / 1e9
    row = ContextRow(context, streams, streams * context / pre["prefill_s"], pre["ttft"] * 1e3,
                     pre["ttft_max"] * 1e3,
                     dec["decode_tokens"] / dec["decode_s"] if dec["decode_s"] else 0.0,
                     ms, dec["decode_step_ms_median"], gb, 100 * gb / (ms / 1e3) / copy_gbs if ms else 0.0,
                     fits=streams * (context + max_tokens) <= engine.kv_capacity_tokens,
                     decode_steps=dec["decode_steps"], decode_gc_ms=dec["decode_gc_ms"],
                     decode_gc_max_ms=dec["decode_gc_max_ms"],
                     decode_step_max_ms=dec["decode_step_max_ms"],
                     decode_step_max_at=dec["decode_step_max_at"], alloc_retries=dec["alloc_retries"])
    if graphs is not None:
        row.gpu_ms_per_step = engine.run_on_loop(
            lambda: graphs.time_decode(streams, context + max_tokens // 2), timeout=600)
        row.gpu_roofline_pct = 100 * gb / (row.gpu_ms_per_step / 1e3) / copy_gbs
    return row


def run(model: str, contexts: list[int], streams: list[int], max_tokens: int,
        json_path: str | None, engine_kwargs: dict | None = None,
        warm_buckets: bool = False, temperature: float = 0.0, top_p: float = 1.0
        ) -> list[ContextRow]:
    from replica.config import EngineConfig

    kwargs = dict(engine_kwargs or {})
    if max(streams) > EngineConfig.max_running_streams:
        kwargs["max_running_streams"] = max(streams)
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model=model, **kwargs))
    load_s = time.perf_counter() - t0
    device = engine.config.device
    try:
        copy_gbs = copy_bandwidth(device)
        sampling = dict(temperature=temperature, top_p=top_p)
        # one short run first, sampled as the rows are: the kernels' first-use compiles untimed
        measure(engine, requests(prompts_of(min(contexts), 1, engine.model_config.vocab_size,
                                            seed=1), 4, **sampling))
        rows = [bench_context(engine, c, n, max_tokens, copy_gbs, warm_buckets, sampling)
                for c in contexts for n in streams]
    finally:
        engine.shutdown()
    print(format_table(rows, engine, model, copy_gbs, load_s, temperature, top_p))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"model": model, "synthetic": engine.model_config.synthetic,
                       "device": device, "max_tokens": max_tokens, "copy_gb_per_s": copy_gbs,
                       "load_s": load_s, "kv_capacity_tokens": engine.kv_capacity_tokens,
                       "warm_buckets": warm_buckets, "temperature": temperature, "top_p": top_p,
                       "kv_dtype": str(engine.config.kv_torch_dtype).removeprefix("torch."),
                       "rows": [asdict(r) for r in rows]}, f, indent=2)
    return rows


def format_table(rows: list[ContextRow], engine: Engine, model: str, copy_gbs: float,
                 load_s: float, temperature: float = 0.0, top_p: float = 1.0) -> str:
    cfg = engine.config
    label = f"{model}{' (SYNTHETIC weights)' if engine.model_config.synthetic else ''}"
    lines = [f"engine benchmark by context: {label} on {cfg.device}, loaded in {load_s:.1f} s",
             f"KV pool: {engine.kv_capacity_tokens:,} tokens "
             f"({str(cfg.kv_torch_dtype).removeprefix('torch.')}); measured copy "
             f"{copy_gbs:.0f} GB/s (read + write); prefill: all prompts at once; decode: the "
             f"same streams resumed from their retained KV, every stream decoding; GB/step: "
             f"weights a decode step touches + KV it reads; GPU: the decode graph alone at "
             f"streams x context; * = the streams did not fit the pool at once; "
             + (f"sampled: temperature {temperature}, top-p {top_p}" if temperature else "greedy")]
    head = (f"{'context':>7} {'streams':>7} {'prefill tok/s':>13} {'TTFT ms':>8} {'TTFT max':>8} "
            f"{'decode tok/s':>12} {'ms/step':>8} {'median':>7} {'GC ms':>6} {'GB/step':>8} "
            f"{'%roofline':>9}")
    gpu = any(r.gpu_ms_per_step for r in rows)
    if gpu:
        head += f" {'GPU ms/step':>11} {'GPU %roof':>9}"
    lines.append(head)
    for r in rows:
        line = (f"{r.context:>7} {r.streams:>6}{'*' if not r.fits else ' '} "
                f"{r.prefill_tok_per_s:>13.0f} {r.ttft_ms:>8.0f} {r.ttft_max_ms:>8.0f} "
                f"{r.decode_tok_per_s:>12.1f} {r.ms_per_step:>8.2f} {r.ms_per_step_median:>7.2f} "
                f"{r.decode_gc_ms:>6.1f} {r.gb_per_step:>8.3f} "
                f"{r.roofline_pct:>9.2f}")
        if gpu:
            line += f" {r.gpu_ms_per_step:>11.3f} {r.gpu_roofline_pct:>9.1f}"
        lines.append(line)
    for r in rows:  # a one-off stall: where it was
        if r.decode_step_max_ms > 3 * r.ms_per_step_median > 0:
            lines.append(f"stall at {r.context} x {r.streams}: the longest decode step "
                         f"{r.decode_step_max_ms:.1f} ms (step {r.decode_step_max_at} of "
                         f"{r.decode_steps}); allocator retries {r.alloc_retries}")
    return "\n".join(lines)
