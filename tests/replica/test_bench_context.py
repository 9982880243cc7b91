"""`fedserve bench engine --context`: runs on CPU at tiny sizes with the default model and the
default engine config, and reports every column for each (context, concurrency)."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.engine_context import prompts_of


def test_bench_by_context_on_cpu_with_the_default_model(tmp_path):
    path = tmp_path / "bench.json"
    out = subprocess.run([sys.executable, "-m", "cli", "bench", "engine", "--context",
                          "32", "--streams", "1,2", "--max-tokens", "4", "--json", str(path)],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    for word in ("prefill tok/s", "TTFT", "decode tok/s", "ms/step", "GB/step", "%roofline",
                 "KV pool:"):
        assert word in out.stdout, word
    data = json.loads(path.read_text())
    assert data["model"] == "smollm2-135m" and data["device"] == "cpu" and data["copy_gb_per_s"] > 0
    assert data["kv_dtype"] == "float32" and data["kv_capacity_tokens"] > 0
    assert data["warm_buckets"] is False  # the engine's own policy unless --warm-buckets
    assert data["temperature"] == 0.0 and "greedy" in out.stdout  # unless --temperature
    rows = data["rows"]
    assert [(r["context"], r["streams"]) for r in rows] == [(32, 1), (32, 2)]
    for r in rows:
        assert r["fits"] and r["prefill_tok_per_s"] > 0 and r["ttft_ms"] > 0
        # decode: resumed from the retained prefill, every stream decodes from the first step
        assert r["decode_tok_per_s"] > 0 and r["ms_per_step"] > 0 and r["decode_steps"] == 3
        # the median step is a step's length: three alike steps, so near their mean (a gap
        # measured inside one step, or across two, would fall outside)
        assert r["ms_per_step"] / 3 < r["ms_per_step_median"] < 2 * r["ms_per_step"]
        assert 0 < r["gb_per_step"] < 1 and r["roofline_pct"] > 0


def test_bench_by_context_samples_with_temperature(tmp_path):
    path = tmp_path / "bench.json"
    out = subprocess.run([sys.executable, "-m", "cli", "bench", "engine", "--context", "16",
                          "--streams", "2", "--max-tokens", "3", "--temperature", "0.8",
                          "--top-p", "0.9", "--json", str(path)],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    assert "sampled: temperature 0.8, top-p 0.9" in out.stdout
    data = json.loads(path.read_text())
    assert (data["temperature"], data["top_p"]) == (0.8, 0.9)
    assert [r["decode_steps"] for r in data["rows"]] == [2]


def test_prompts_have_the_exact_context_and_differ():
    ps = prompts_of(100, 3, 49152)
    assert [len(p) for p in ps] == [100] * 3 and len(set(ps)) == 3
    assert max(max(p) for p in prompts_of(50, 2, 320)) < 256  # byte tokenizer: plain bytes
