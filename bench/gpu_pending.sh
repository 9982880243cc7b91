#!/usr/bin/env bash
# The device measurements the last session built for and could not run (kernels/GPU_NOTES.md,
# "Left undone" item 0), as one device call that prints as it goes; every step has its own
# timeout so a hang costs that step only. Update it when the list changes.
# Usage (on the GPU machine, repo root):   OUT=/some/dir bash bench/gpu_pending.sh
# (MODES_SMALL= MODES_ROWS= MODES_ATTN= skip engine blocks; BITWISE_MODES adds the bitwise sets)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fedserve-gpu}
mkdir -p "$OUT"
stamp() { echo "=== $(date +%T) $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader

stamp "bits: the CTA experts, every cuda_q4 form against the decode tile, the head split, routed linears"
timeout 240 python -m pytest -q -n 0 tests/kernels/test_cuda_q4.py tests/kernels/test_gpu.py \
  -k "direct_experts or decode_tile_bits or routed or compiles or paged_attention_at_real" 2>&1 | tail -6

stamp "the MoE layer at 1 and 4 tokens: three kernels, fused, CUDA CTA experts"
timeout 120 python -m bench.moe_timeline --ts 1,4 --json "$OUT/moe_timeline.json" 2>&1 \
  | grep -v Warning | grep "µs a layer"

stamp "the CTA linear at 16-64 rows (and the router at 1-8)"
timeout 150 python -m bench.row_modes --ms 16,32,64 --ts "" --tiles "" --weights qkv,o --cuda \
  --cold 24 --json "$OUT/rows.json" 2>&1 | grep -v Warning | grep -v probe | grep -E "split |cta|plan"
timeout 90 python -m bench.row_modes --ms 1,8 --ts "" --tiles "" --weights router --cuda \
  --cold 24 2>&1 | grep -v Warning | grep -v probe | grep -E "split |cta|plan"

# the engine, side by side (1-8 streams: the experts, the router; 16-64: the linear's rows)
KERNEL_TESTS= BENCH= ENGINE_TESTS= TAIL=${TAIL:-6} T_ENGINE=${T_ENGINE:-90} \
  ENGINE_MODES="${MODES_SMALL-pdl pdl_ecuda8 pdl_ecuda8_edepth8 pdl_cudarouter pdl}" \
  CONTEXT=128 STREAMS=1,4,8 TAG=_small bash bench/gpu_ab.sh 2>&1 | grep -v "^context"
KERNEL_TESTS= BENCH= ENGINE_TESTS= TAIL=${TAIL:-6} T_ENGINE=${T_ENGINE:-90} \
  ENGINE_MODES="${MODES_ROWS-pdl pdl_cuda16 pdl_cuda64}" CONTEXT=128 STREAMS=16,32,64 \
  TAG=_rows bash bench/gpu_ab.sh 2>&1 | grep -v "^context"
KERNEL_TESTS= BENCH= ENGINE_TESTS= TAIL=${TAIL:-6} T_ENGINE=${T_ENGINE:-120} \
  ENGINE_MODES="${MODES_ATTN-pdl pdl_hsplit128 pdl_hsplit256}" CONTEXT=2048,8192 STREAMS=1,4,64 \
  TAG=_attn bash bench/gpu_ab.sh 2>&1 | grep -v "^context"
# BITWISE_MODES="pdl_ecuda8 ...": the engine's bitwise alone-vs-among sets under each (the
# judge before a mode becomes a default); none by default
for m in ${BITWISE_MODES-}; do
  KERNEL_TESTS= BENCH= ENGINE_TESTS=1 ENGINE_TEST_MODE=$m ENGINE_MODES="" T_ENGINE_TESTS=240 \
    bash bench/gpu_ab.sh 2>&1 | grep -v "^NVIDIA\|^torch" | tail -3
done
stamp done
