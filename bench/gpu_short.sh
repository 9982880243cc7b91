#!/usr/bin/env bash
# A short device call for a session left with little device time (~4-5 minutes): the x-staged
# experts' variants alone at 64 tokens (timing and bits against the split programs), where
# and how the x-staged kernels differ from their judges (bench/xs_diag.py), the
# engine at 128 x 64 streams (the defaults beside the x-staged linear + experts and the
# experts alone), then the x-staged forms' GPU bit tests. Printing as it goes; each step has
# its own timeout.
# Usage (on the GPU machine, repo root):   OUT=/some/dir bash bench/gpu_short.sh
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fedserve-gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
echo "=== $(date +%T) the experts alone at 64 tokens (cuda xe) beside the plan, with their bits"
timeout 60 python -m bench.row_modes --ms "" --ts 64 --tiles "" --maxnreg 0 --dense-tiles "" --cuda \
  --json "$OUT/row_modes_xe.json" 2>&1 | grep -E "copy|experts|rror"
echo "=== $(date +%T) the x-staged linear and experts against their judges, case by case"
timeout 90 python -m bench.xs_diag --json "$OUT/xs_diag.json" 2>&1 | grep -v Warning
KERNEL_TESTS= BENCH= ENGINE_TESTS= TAIL=3 T_ENGINE=100 CONTEXT=128 STREAMS=64 TAG=_short \
  ENGINE_MODES="${MODES:-pdl pdl_xs64_xe64 pdl_xe64}" bash bench/gpu_ab.sh 2>&1 | grep -v "^context\|^KV pool"
echo "=== $(date +%T) bits: the x-staged linear and experts"
timeout 120 python -m pytest -q -n 0 tests/kernels/test_gpu.py -k "x_staged" 2>&1 | tail -4
