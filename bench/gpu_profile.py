"""Where a GPU step's time goes, by kernel: torch.profiler (CUPTI) over engine steps run eagerly
(decode graphs off, so every launch is its own event) on synthetic:qwen3-30b-a3b-int4 with the
default EngineConfig — a prefill step of PROMPTS x PROMPT_LEN tokens, and decode steps at 1 and
64 streams. Prints, per scenario, each kernel's µs per step, calls and share; writes JSON. The
kernel times are the GPU's own; the eager launch gaps between them are not in the shares.

    python -m bench.gpu_profile [--prompts 8 --prompt-len 512] [--prefill-step 1] [--no-pdl]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from replica.config import EngineConfig
from replica.core import EngineCore
from replica.request import Request
from replica.sampling import SamplingParams


def _add(core: EngineCore, n: int, length: int, max_tokens: int, tag: str) -> None:
    g = torch.Generator().manual_seed(n * 7919 + length)
    vocab = core.model_config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(n):
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        core.add(core.prepare(Request(prompt_token_ids=ids, params=params,
                                      request_id=f"{tag}-{i}")), lambda ev: None)


def _profile(core: EngineCore, steps: int) -> dict[str, tuple[float, int]]:
    """kernel name → (µs per step, calls per step) over `steps` steps."""
    return profile_calls(core.step, steps, core.config.cuda)


def profile_calls(fn, steps: int, cuda: bool = True) -> dict[str, tuple[float, int]]:
    """kernel name → (µs per call, launches per call) of fn() over `steps` calls."""
    acts = [torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", 0) if cuda else evt.self_cpu_time_total
        if us > 0:
            out[evt.key][0] += us / steps
            out[evt.key][1] += evt.count / steps
    return {k: (v[0], v[1]) for k, v in out.items()}


def _report(name: str, kernels: dict[str, tuple[float, int]], tokens: int) -> dict:
    total = sum(us for us, _ in kernels.values())
    print(f"\n== {name}: {total / 1e3:.3f} ms of kernels per step, {tokens} tokens per step", flush=True)
    for k, (us, calls) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:25]:
        print(f"  {us:>10.1f} µs {calls:>7.1f} calls {100 * us / total:>5.1f}%  {k[:90]}")
    return {"scenario": name, "kernel_ms": total / 1e3, "tokens": tokens,
            "kernels": {k: {"us": us, "calls": c} for k, (us, c) in kernels.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="synthetic:qwen3-30b-a3b-int4")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (CPU ops, not kernels)")
    ap.add_argument("--prefill-step", type=int, default=1,
                    help="profile this step of the prefill (later steps: longer contexts)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-pdl", action="store_true",
                    help="plain launches: each kernel's time is its own, without the wait for "
                         "its predecessor that programmatic dependent launch puts inside it")
    args = ap.parse_args()
    if args.no_pdl:
        from kernels import triton_pdl
        triton_pdl.ENABLED = False
    core = EngineCore(EngineConfig(model=args.model, device=args.device))
    core.runner.graphs = None  # eager: each kernel is its own profiler event
    results = []
    _add(core, 2, 64, 4, "warm")  # compile the kernels outside the profile
    while core.has_work:
        core.step()
    _add(core, args.prompts, args.prompt_len, 2, "prefill")
    for _ in range(args.prefill_step - 1):  # a later chunk: its prompts attend to more context
        core.step()
    tokens = min(args.prompts * args.prompt_len, core.config.batch_tokens)
    results.append(_report(f"prefill {args.prompts} x {args.prompt_len}, step {args.prefill_step}",
                           _profile(core, 1), tokens))
    while core.has_work:
        core.step()
    for streams in (1, 64):
        _add(core, streams, 128, 40, f"decode{streams}")
        while any(s.num_computed < len(s.prompt_ids) for s in core.scheduler.running) \
                or core.scheduler.waiting:
            core.step()
        core.step()
        results.append(_report(f"decode {streams} streams, ctx ~130", _profile(core, 5), streams))
        while core.has_work:
            core.step()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
