"""The `fedserve` command line, run as a newcomer would (subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def fedserve(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_generate_chat_answers():
    out = fedserve("generate", "--chat", "What is the capital of France?", "--max-tokens", "32")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


@pytest.mark.slow
def test_bench_engine_prints_table_and_writes_json(tmp_path):
    path = tmp_path / "bench.json"
    out = fedserve("bench", "engine", "--streams", "1,2", "--max-tokens", "4", "--json", str(path))
    assert out.returncode == 0, out.stderr
    assert "tok/s" in out.stdout and "TTFT" in out.stdout
    data = json.loads(path.read_text())
    assert [r["streams"] for r in data["rows"]] == [1, 2]
    assert all(r["tokens"] == 4 * r["streams"] and r["tok_per_s"] > 0 for r in data["rows"])


def test_bench_engine_profile_reports_steps_and_the_step_function():
    out = fedserve("bench", "engine", "--model", "synthetic:tiny-llama", "--streams", "1,3",
                   "--max-tokens", "5", "--profile")
    assert out.returncode == 0, out.stderr
    assert "3 streams x 5 tokens: 5 steps" in out.stdout
    assert "core.py" in out.stdout and "(step)" in out.stdout


def test_generate_rejects_bad_values_with_a_clear_message():
    out = fedserve("generate", "hi", "--max-tokens", "0", "--model", "synthetic:tiny-llama")
    assert out.returncode == 2
    assert "max_tokens" in out.stderr and "Traceback" not in out.stderr


def test_unknown_model_is_a_clear_error():
    out = fedserve("generate", "hi", "--model", "no-such-model")
    assert out.returncode == 2 and "no-such-model" in out.stderr and "Traceback" not in out.stderr


def test_up_refuses_a_public_address_without_api_keys():
    out = fedserve("up", "--host", "0.0.0.0", "--port", "1")
    assert out.returncode == 2 and "without API keys" in out.stderr and "Traceback" not in out.stderr
    short = fedserve("up", "--host", "0.0.0.0", "--api-key", "short")
    assert short.returncode == 2 and "api_keys" in short.stderr
