"""`fedserve bench engine`: decode throughput and TTFT per concurrency, optionally against
transformers on the same model in the same run. Prints a table and writes JSON.

On CUDA it also prints, per concurrency, ms per engine step, the GPU time of one decode step
(its CUDA graph replayed alone), the bytes a decode step must move (weights it touches + KV it
reads) and that as a % of the roofline given by a device copy measured in the same run."""

from __future__ import annotations

import gc
import json
import threading
import time
from dataclasses import asdict, dataclass

import torch

from replica.engine import Engine
from replica.request import Request
from replica.sampling import SamplingParams

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash map works, step by step.",
    "List some facts about the planet Mars.",
    "Describe the water cycle to a ten year old.",
    "What are the main causes of the French Revolution?",
    "Give me a recipe for a simple tomato soup.",
    "How do vaccines train the immune system?",
    "Summarize the plot of a heist movie you invent.",
]


@dataclass
class Row:
    system: str
    streams: int
    tokens: int
    seconds: float
    tok_per_s: float
    ttft_ms: float
    steps: int = 0
    ms_per_step: float = 0.0  # wall time per engine step (host + device)
    decode_ms_per_step: float = 0.0  # wall per step once every stream has its first token
    gpu_ms_per_step: float = 0.0  # one decode step's CUDA graph, replayed alone
    gb_per_step: float = 0.0  # bytes a decode step must move at this concurrency
    roofline_pct: float = 0.0  # (gb_per_step / gpu_ms_per_step) / measured copy bandwidth


def _prompts(n: int) -> list[str]:
    return [f"{PROMPTS[i % len(PROMPTS)]} (variant {i})" for i in range(n)]


def measure(engine: Engine, reqs: list[Request]) -> dict:
    """Submit every request at once and time them: TTFT (mean, max), the time until the last
    stream's first token (prefill), the steps and tokens after it (decode), and the whole run."""
    first: dict[str, float] = {}
    done = threading.Semaphore(0)
    tokens = [0, 0]  # all, and those after every stream had its first token
    mark = [0.0, 0]  # (time, engine steps) when the last stream got its first token
    ends: list[float] = []  # decode: when each step's first event came (one per step)

    def sink(ev) -> None:  # runs on the engine's thread, between steps
        now = time.perf_counter()
        tokens[0] += len(ev.token_ids)
        if ev.token_ids and ev.request_id not in first:
            first[ev.request_id] = now
            if len(first) == len(reqs):
                mark[0], mark[1] = now, engine.core.steps
        elif len(first) == len(reqs):
            tokens[1] += len(ev.token_ids)
            if len(ends) < engine.core.steps - mark[1]:
                ends.append(now)
        if ev.finished:
            done.release()

    pauses: list[tuple[float, float]] = []  # (start, seconds) of each garbage collection
    started = [0.0]

    def on_gc(phase, info) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((started[0], time.perf_counter() - started[0]))

    steps0 = engine.core.steps
    cuda = engine.config.cuda and torch.cuda.is_available()
    retries0 = torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else 0
    gc.callbacks.append(on_gc)
    t0 = time.perf_counter()
    try:
        for r in reqs:
            engine.submit(r, sink)
        for _ in reqs:
            done.acquire()
        end = time.perf_counter()
    finally:
        gc.callbacks.remove(on_gc)
    decode_gc = [d for t, d in pauses if t >= mark[0]]
    ttfts = [t - t0 for t in first.values()]
    gaps = [b - a for a, b in zip([mark[0]] + ends, ends + [end])]  # each decode step, and the
    # wait from the last step's first event to the end
    longest = max(range(len(gaps)), key=gaps.__getitem__, default=0)
    retries = (torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries0) if cuda else 0
    return {"seconds": end - t0, "steps": engine.core.steps - steps0, "tokens": tokens[0],
            "ttft": sum(ttfts) / len(ttfts), "ttft_max": max(ttfts), "prefill_s": mark[0] - t0,
            "decode_s": end - mark[0], "decode_steps": engine.core.steps - mark[1],
            "decode_tokens": tokens[1], "decode_step_ms_median": _median_gap_ms([mark[0]] + ends),
            "decode_gc_ms": 1e3 * sum(decode_gc), "decode_gc_max_ms": 1e3 * max(decode_gc, default=0.0),
            "decode_step_max_ms": 1e3 * gaps[longest] if gaps else 0.0,
            "decode_step_max_at": longest,  # its index among the decode phase's steps
            "alloc_retries": retries}  # CUDA allocator: frees-and-retries during the run


def _median_gap_ms(times: list[float]) -> float:
    """Median of the gaps between consecutive times, in ms (0.0 for fewer than two): the
    typical decode step, which a one-off stall (a capture, a collection) does not move."""
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    return gaps[len(gaps) // 2] * 1e3 if gaps else 0.0


def bench_fedserve(engine: Engine, streams: int, max_tokens: int) -> Row:
    """All streams submitted at once; tok/s = generated tokens / wall time until the last ends."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    m = measure(engine, [Request(prompt=p, params=params) for p in _prompts(streams)])
    dt, steps = m["seconds"], m["steps"]
    decode_ms = m["decode_s"] / m["decode_steps"] * 1e3 if m["decode_steps"] else 0.0
    return Row("fedserve", streams, m["tokens"], dt, m["tokens"] / dt, m["ttft"] * 1e3, steps,
               dt / max(steps, 1) * 1e3, decode_ms)


def bench_transformers(model_spec: str, streams_list: list[int], max_tokens: int) -> list[Row]:
    """transformers on the same GGUF (dequantized to fp32 by transformers), greedy, batched."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from replica.models.registry import embedded_gguf_path

    if model_spec != "smollm2-135m" and not model_spec.endswith(".gguf"):
        path, kwargs = model_spec, {}
    else:
        gguf = embedded_gguf_path() if model_spec == "smollm2-135m" else model_spec
        path, kwargs = str(gguf.parent), {"gguf_file": gguf.name}
    tok = AutoTokenizer.from_pretrained(path, **kwargs)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()
    rows = []
    for n in streams_list:
        enc = tok(_prompts(n), return_tensors="pt", padding=True)
        with torch.inference_mode():
            t0 = time.perf_counter()
            model.generate(**enc, max_new_tokens=1, do_sample=False, pad_token_id=tok.pad_token_id)
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = model.generate(**enc, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=tok.pad_token_id)
            dt = time.perf_counter() - t0
        generated = (out.shape[1] - enc["input_ids"].shape[1]) * n
        rows.append(Row("transformers", n, generated, dt, generated / dt, ttft * 1e3))
    return rows


def copy_bandwidth(device: str) -> float:
    """GB/s of a device-to-device copy (2 GiB on CUDA, 256 MiB on CPU), bytes read + written
    (median of 10)."""
    import torch

    cuda = device != "cpu"
    src = torch.empty((1 << 29) if cuda else (1 << 26), dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append((time.perf_counter() - t0) * 1e3)
    return 2 * src.numel() * 4 / sorted(times[2:])[5] / 1e6


def decode_bytes(engine: Engine, streams: int, avg_ctx: float) -> int:
    """Bytes one decode step of `streams` streams must move: every weight it touches once
    (experts: the expected number touched under uniform routing) plus the KV it reads."""
    model, cfg = engine.core.model, engine.model_config
    total = model.lm_head.nbytes + model.final_norm.numel() * 4
    for layer in model.layers:
        vecs = [v for v in (layer.attn_norm, layer.mlp_norm, layer.q_norm, layer.k_norm) if v is not None]
        total += layer.qkv.nbytes + layer.o.nbytes + sum(v.numel() * 4 for v in vecs)
        if layer.router is None:
            total += layer.gate_up.nbytes + layer.down.nbytes
            continue
        e, k = cfg.num_experts, cfg.num_experts_per_tok
        touched = e * (1 - (1 - k / e) ** streams)
        per_expert = (layer.moe.expert_nbytes() if layer.moe is not None else
                      layer.experts[0][0].nbytes + layer.experts[0][1].nbytes)
        total += layer.router.nbytes + int(touched * per_expert)
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * engine.core.kv.k[0].element_size()
    return int(total + streams * avg_ctx * kv_per_token)


def annotate_gpu(engine: Engine, row: Row, max_tokens: int, copy_gbs: float) -> None:
    """Fill the GPU columns of a fedserve row measured at row.streams concurrent streams."""
    graphs = engine.core.runner.graphs
    key = graphs.key_for(row.streams) if graphs is not None else None
    prompt_len = sum(len(engine.tokenizer.encode(p)) for p in _prompts(row.streams)) / row.streams
    row.gb_per_step = decode_bytes(engine, row.streams, prompt_len + max_tokens / 2) / 1e9
    if key is not None and key in graphs.captured:
        row.gpu_ms_per_step = engine.run_on_loop(lambda: graphs.time_replay(key), timeout=600)
        row.roofline_pct = 100 * row.gb_per_step / (row.gpu_ms_per_step / 1e3) / copy_gbs


def run(model: str, streams: list[int], max_tokens: int, compare: bool, json_path: str | None,
        engine_kwargs: dict | None = None) -> list[Row]:
    from replica.config import EngineConfig

    kwargs = dict(engine_kwargs or {})
    cuda = kwargs.get("device", "cpu") != "cpu"
    if max(streams) > EngineConfig.max_running_streams:
        kwargs["max_running_streams"] = max(streams)
    engine = Engine(EngineConfig(model=model, **kwargs))  # default pool: sized from the device
    copy_gbs = None
    try:
        if cuda:
            copy_gbs = copy_bandwidth(kwargs["device"])
            for n in streams:  # capture the CUDA graphs each run meets before timing it
                bench_fedserve(engine, n, max_tokens)
        else:
            bench_fedserve(engine, 1, 4)  # warm-up: kernel build, allocator
        rows = []
        for n in streams:
            row = bench_fedserve(engine, n, max_tokens)
            if cuda:
                annotate_gpu(engine, row, max_tokens, copy_gbs)
            rows.append(row)
    finally:
        engine.shutdown()
    if compare:
        rows += bench_transformers(model, streams, max_tokens)
    print(format_table(rows, synthetic=engine.model_config.synthetic, model=model, copy_gbs=copy_gbs))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"model": model, "synthetic": engine.model_config.synthetic,
                       "max_tokens": max_tokens, "copy_gb_per_s": copy_gbs,
                       "rows": [asdict(r) for r in rows]}, f, indent=2)
    return rows


def profile_steps(model: str, streams: int, max_tokens: int, device: str = "cpu",
                  top: int = 30) -> None:
    """cProfile of EngineCore.step driven on this thread (after a warm-up run that builds the
    kernels and captures the graphs): where a step's host time goes, by function."""
    import cProfile
    import pstats

    from replica.config import EngineConfig
    from replica.core import EngineCore

    core = EngineCore(EngineConfig(model=model, device=device,
                                   max_running_streams=max(64, streams)))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def run(tag: str) -> None:
        for i, p in enumerate(_prompts(streams)):
            req = Request(prompt=p, params=params, request_id=f"{tag}-{i}")
            core.add(core.prepare(req), lambda ev: None)
        while core.has_work:
            core.step()

    run("warm")
    prof = cProfile.Profile()
    steps0, t0 = core.steps, time.perf_counter()
    prof.enable()
    run("timed")
    prof.disable()
    dt = time.perf_counter() - t0
    print(f"{streams} streams x {max_tokens} tokens: {core.steps - steps0} steps, "
          f"{dt / (core.steps - steps0) * 1e3:.2f} ms/step (profiled)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def format_table(rows: list[Row], synthetic: bool, model: str, copy_gbs: float | None = None) -> str:
    label = f"{model}{' (SYNTHETIC weights)' if synthetic else ''}"
    lines = [f"engine benchmark: {label}"]
    gpu = copy_gbs is not None
    if gpu:
        lines.append(f"measured device copy: {copy_gbs:.0f} GB/s (read + write); GB/step = weights "
                     f"a decode step touches (experts: expected under uniform routing) + KV read; "
                     f"tok/s and ms/step: whole runs (prefill included); decode ms: wall per "
                     f"step once every stream decodes; GPU ms/step and decode tok/s: one decode "
                     f"step's CUDA graph replayed alone")
    head = f"{'system':<13} {'streams':>7} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'TTFT ms':>8}"
    if gpu:
        head += (f" {'ms/step':>8} {'decode ms':>9} {'GPU ms/step':>11} {'decode tok/s':>12} "
                 f"{'GB/step':>8} {'%roofline':>9}")
    lines.append(head)
    base = {r.streams: r for r in rows if r.system == "transformers"}
    for r in rows:
        line = (f"{r.system:<13} {r.streams:>7} {r.tokens:>7} {r.seconds:>8.2f} "
                f"{r.tok_per_s:>8.1f} {r.ttft_ms:>8.0f}")
        if gpu and r.system == "fedserve":
            dec = r.streams * 1e3 / r.gpu_ms_per_step if r.gpu_ms_per_step else 0.0
            line += (f" {r.ms_per_step:>8.2f} {r.decode_ms_per_step:>9.2f} "
                     f"{r.gpu_ms_per_step:>11.3f} {dec:>12.0f} {r.gb_per_step:>8.2f} "
                     f"{r.roofline_pct:>9.1f}")
        lines.append(line)
    if base:
        lines.append("ratio fedserve/transformers (tok/s): " + ", ".join(
            f"{r.streams}: {r.tok_per_s / base[r.streams].tok_per_s:.2f}x"
            for r in rows if r.system == "fedserve" and r.streams in base))
    return "\n".join(lines)
