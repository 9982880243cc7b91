#!/usr/bin/env bash
# The second device call after bench/gpu_short.sh, on the same warm machine (~5-6 minutes): the
# engine's bitwise alone-vs-among-1..64 sets and CUDA tests under an x-staged mode (the judge
# before it may become a default), then that mode beside the defaults at 2,048 x 64, then the
# issue's no-thrash row (64 streams x 144 new tokens from context 128, the defaults), then the
# one-stream modes built since v22 at 128 x 1 (timing only). Printing as it goes.
# Usage (on the GPU machine, repo root):   MODE=pdl_xs64_xe64 OUT=/some/dir bash bench/gpu_next.sh
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fedserve-gpu}
MODE=${MODE:-pdl_xs64_xe64}
mkdir -p "$OUT"
KERNEL_TESTS= BENCH= ENGINE_TESTS=1 ENGINE_TEST_MODE=$MODE ENGINE_MODES="" T_ENGINE_TESTS=200 \
  bash bench/gpu_ab.sh 2>&1 | grep -v "^NVIDIA\|^torch" | tail -4
KERNEL_TESTS= BENCH= ENGINE_TESTS= TAIL=3 T_ENGINE=120 CONTEXT=2048 STREAMS=64 TAG=_next \
  ENGINE_MODES="pdl $MODE" bash bench/gpu_ab.sh 2>&1 | grep -v "^context\|^KV pool\|^NVIDIA\|^torch"
KERNEL_TESTS= BENCH= ENGINE_TESTS= TAIL=3 T_ENGINE=120 MAX_TOKENS=144 ENGINE_MODES="pdl" CONTEXT=128 \
  STREAMS=64 TAG=_t144 bash bench/gpu_ab.sh 2>&1 | grep -v "^KV pool\|^NVIDIA\|^torch"
KERNEL_TESTS= BENCH= ENGINE_TESTS= TAIL=2 T_ENGINE=90 CONTEXT=128 STREAMS=1 TAG=_one \
  ENGINE_MODES="${ONE_MODES-pdl pdl_clusterroute_normfold pdl_normfold pdl_clusterroute pdl_cudanorm pdl_fillcols}" \
  bash bench/gpu_ab.sh 2>&1 | grep -v "^context\|^KV pool\|^NVIDIA\|^torch"
