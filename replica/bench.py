"""`fedserve bench engine`: decode throughput and TTFT per concurrency, optionally against
transformers on the same model in the same run. Prints a table and writes JSON."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass

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


def _prompts(n: int) -> list[str]:
    return [f"{PROMPTS[i % len(PROMPTS)]} (variant {i})" for i in range(n)]


def bench_fedserve(engine: Engine, streams: int, max_tokens: int) -> Row:
    """All streams submitted at once; tok/s = generated tokens / wall time until the last ends."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reqs = [Request(prompt=p, params=params) for p in _prompts(streams)]
    first: dict[str, float] = {}
    done = threading.Semaphore(0)
    tokens = [0]

    def sink(ev) -> None:
        if ev.token_ids and ev.request_id not in first:
            first[ev.request_id] = time.perf_counter()
        tokens[0] += len(ev.token_ids)
        if ev.finished:
            done.release()

    t0 = time.perf_counter()
    for r in reqs:
        engine.submit(r, sink)
    for _ in reqs:
        done.acquire()
    dt = time.perf_counter() - t0
    ttft = sum(first.values()) / len(first) - t0
    return Row("fedserve", streams, tokens[0], dt, tokens[0] / dt, ttft * 1e3)


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


def run(model: str, streams: list[int], max_tokens: int, compare: bool, json_path: str | None,
        engine_kwargs: dict | None = None) -> list[Row]:
    from replica.config import EngineConfig

    engine = Engine(EngineConfig(model=model, **(engine_kwargs or {})))
    try:
        bench_fedserve(engine, 1, 4)  # warm-up: kernel build, allocator
        rows = [bench_fedserve(engine, n, max_tokens) for n in streams]
    finally:
        engine.shutdown()
    if compare:
        rows += bench_transformers(model, streams, max_tokens)
    print(format_table(rows, synthetic=engine.model_config.synthetic, model=model))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"model": model, "synthetic": engine.model_config.synthetic,
                       "max_tokens": max_tokens, "rows": [asdict(r) for r in rows]}, f, indent=2)
    return rows


def format_table(rows: list[Row], synthetic: bool, model: str) -> str:
    label = f"{model}{' (SYNTHETIC weights)' if synthetic else ''}"
    lines = [f"engine benchmark: {label}",
             f"{'system':<13} {'streams':>7} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'TTFT ms':>8}"]
    base = {r.streams: r for r in rows if r.system == "transformers"}
    for r in rows:
        lines.append(f"{r.system:<13} {r.streams:>7} {r.tokens:>7} {r.seconds:>8.2f} "
                     f"{r.tok_per_s:>8.1f} {r.ttft_ms:>8.0f}")
    if base:
        lines.append("ratio fedserve/transformers (tok/s): " + ", ".join(
            f"{r.streams}: {r.tok_per_s / base[r.streams].tok_per_s:.2f}x"
            for r in rows if r.system == "fedserve" and r.streams in base))
    return "\n".join(lines)
