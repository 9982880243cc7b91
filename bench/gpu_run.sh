#!/usr/bin/env bash
# One device call: the kernels' GPU tests, the kernel benchmark (q4 tiles, MoE, paged attention
# over bf16 and fp32 KV), the engine's bitwise alone-vs-among-1..64 test, the engine benchmark.
# Usage (on the GPU machine, repo root):   OUT=/some/dir bash bench/gpu_run.sh
# Everything lands in $OUT (kernels.json, engine.json). Each step has its own time limit, so one
# failing or slow step still leaves the others' numbers.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fedserve-gpu}
mkdir -p "$OUT"
stamp() { echo "=== $(date +%T) $*"; }
MODEL=synthetic:qwen3-30b-a3b-int4
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader

stamp "kernel tests"
timeout "${T_TESTS:-240}" python -m pytest -q tests/kernels/test_gpu.py \
  -k "not engine and not stream_alone" 2>&1 | tail -30

stamp "kernel benchmark"
timeout "${T_BENCH:-240}" python -m bench.kernel_bench --ms "${BENCH_MS:-1,8,64}" \
  ${BENCH_ARGS:-} --json "$OUT/kernels.json"

if [ -n "${ENGINE_TESTS-1}" ]; then  # ENGINE_TESTS= (empty) skips it
  stamp "engine: a stream alone vs among 1..64 others, bitwise"
  timeout "${T_ENGINE_TESTS:-200}" python -m pytest -q tests/kernels/test_gpu.py \
    -k "engine or stream_alone" 2>&1 | tail -30
fi

if [ -n "${STREAMS-1,8,32,64}" ]; then  # STREAMS= (empty) skips it
  stamp "engine benchmark"
  timeout "${T_ENGINE:-150}" python -m cli bench engine --model $MODEL \
    --streams "${STREAMS:-1,8,32,64}" --max-tokens 64 --device cuda --json "$OUT/engine.json"
fi
stamp done
