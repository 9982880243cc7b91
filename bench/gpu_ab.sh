#!/usr/bin/env bash
# One device call comparing kernel variants: the kernels' GPU tests (PREFILL_TESTS=1: also the
# prefill attention's), the kernel benchmark over
# launch variants (bench/kernel_bench.py: split-K program targets, programmatic dependent launch
# on/off), optionally the row modes (ROW_MODES=1) and a kernel profile of engine steps
# (PROFILE=1), the engine's bitwise tests, then the engine benchmark once per mode, each in its
# own process.
# Usage (on the GPU machine, repo root):   OUT=/some/dir bash bench/gpu_ab.sh
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fedserve-gpu}
mkdir -p "$OUT"
stamp() { echo "=== $(date +%T) $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

if [ -n "${KERNEL_TESTS-1}" ]; then
  stamp "kernel tests"
  timeout "${T_TESTS:-200}" python -m pytest -q -n 0 -x tests/kernels/test_gpu.py \
    -k "${KERNEL_K:-not engine and not stream_alone}" 2>&1 | tail -15
fi

if [ -n "${PREFILL_TESTS-}" ]; then  # tests/kernels/test_prefill.py on CUDA
  stamp "prefill attention tests"
  timeout "${T_TESTS:-200}" python -m pytest -q -n 0 tests/kernels/test_prefill.py 2>&1 | tail -8
fi

if [ -n "${BENCH-1}" ]; then
  stamp "kernel benchmark"
  timeout "${T_BENCH:-200}" python -m bench.kernel_bench --ms "${BENCH_MS:-1,8,64}" --no-attention \
    --linear-variants "${LINEAR_VARIANTS:-512,512:nopdl}" \
    --moe-variants "${MOE_VARIANTS:-128,128:nopdl}" \
    --tiles "${TILES:-16x64x64w1s3}" --json "$OUT/kernels.json" 2>&1 | grep -v Warning
fi

if [ -n "${ROW_MODES-}" ]; then  # bench/row_modes.py: split / seq / wide row tiles, bits
  stamp "row modes"
  timeout "${T_ROWS:-240}" python -m bench.row_modes --tiles "${ROW_TILES:-32x64x64w1s3,32x32x64w1s3,64x64x64w4s3,128x64x64w4s3}" \
    ${ROW_ARGS-} --json "$OUT/row_modes.json" 2>&1 | grep -v Warning
fi

if [ -n "${PROFILE-}" ]; then  # bench/gpu_profile.py: kernel times of prefill and decode steps
  stamp "step profile"
  timeout "${T_PROFILE:-200}" python -m bench.gpu_profile ${PROFILE_ARGS-} --json "$OUT/profile.json" 2>&1 | grep -v Warning
fi

if [ -n "${TIMELINE-}" ]; then  # bench/gpu_timeline.py: per-program phase times of the q4 GEMM
  stamp "q4 GEMM timelines"
  timeout "${T_TIMELINE:-120}" python -m bench.gpu_timeline ${TIMELINE_ARGS-} --json "$OUT/timeline.json" 2>&1 | grep -v Warning
  if [ -n "${TIMELINE_NOPDL-1}" ]; then  # also with plain launches (TIMELINE_NOPDL= skips)
    timeout "${T_TIMELINE:-120}" python -m bench.gpu_timeline ${TIMELINE_ARGS-} --no-pdl --json "$OUT/timeline_nopdl.json" 2>&1 | grep -v Warning
  fi
fi

if [ -n "${STEP_GAPS-}" ]; then  # bench/step_gaps.py: host time between decode steps, by phase
  stamp "host time between decode steps"
  timeout "${T_GAPS:-150}" python -m bench.step_gaps ${GAPS_ARGS-} --json "$OUT/step_gaps.json" 2>&1 | grep -v Warning
fi

if [ -n "${ENGINE_TESTS-1}" ]; then
  stamp "engine: a stream alone vs among 1..64 others, bitwise; CUDA engine tests"
  # ENGINE_TEST_MODE: run them with a mode's knobs set (bench/ab_modes.py), e.g. novarlen
  timeout "${T_ENGINE_TESTS:-300}" python -c "
import sys, pytest
from bench.ab_modes import apply
apply('${ENGINE_TEST_MODE:-pdl}')
sys.exit(pytest.main(['-q', '-n', '0', 'tests/kernels/test_gpu.py', 'tests/replica/test_cuda.py',
                      '-k', 'engine or stream_alone or cuda']))
" 2>&1 | tail -15
fi

# WARM_BUCKETS=1: the bench captures every decode graph bucket before timing (bench-only)
# TEMPERATURE=0.8: every stream samples (seeded; TOP_P, default 1.0), its token picked on the GPU
for mode in ${ENGINE_MODES-pdl nopdl}; do  # nopdl: plain launches; splitrows: v7's row modes
  stamp "engine benchmark, $mode"
  timeout "${T_ENGINE:-200}" python -c "
import sys
from bench.ab_modes import apply
apply('$mode')
from cli.main import main
sys.exit(main(['bench', 'engine', '--model', 'synthetic:qwen3-30b-a3b-int4', '--device', 'cuda',
               '--context', '${CONTEXT:-128,2048}', '--streams', '${STREAMS:-1,64}',
               '--max-tokens', '${MAX_TOKENS:-64}', '--json', '$OUT/engine_$mode${TAG-}.json']
              + (['--warm-buckets'] if '${WARM_BUCKETS-}' else [])
              + ['--temperature', '${TEMPERATURE:-0}', '--top-p', '${TOP_P:-1.0}']))
" 2>&1 | grep -v Warning | tail -${TAIL:-16}
done
stamp done
