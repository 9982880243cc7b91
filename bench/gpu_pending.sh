#!/usr/bin/env bash
# The device measurements the last session built for and could not run (kernels/GPU_NOTES.md,
# "Left undone" item 0), as one device call that prints as it goes; every step has its own
# timeout so a hang costs that step only. Update it when the list changes.
# Usage (on the GPU machine, repo root):   OUT=/some/dir bash bench/gpu_pending.sh
# (MODES_SMALL= MODES_BIG= MODES_ATTN= skip engine blocks; BITWISE_MODES adds the bitwise sets)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fedserve-gpu}
mkdir -p "$OUT"
stamp() { echo "=== $(date +%T) $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader

stamp "bits: cuda_q4 (PDL chain in a graph, L2 prefetch, the CUDA top-k, the fused route, staged x), the MoE"
timeout 240 python -m pytest -q -n 0 tests/kernels/test_cuda_q4.py 2>&1 | tail -6
timeout 150 python -m pytest -q -n 0 tests/kernels/test_gpu.py -k "moe_at_real or route or paged_attention_at_real" 2>&1 | tail -3

stamp "the CTA form with x staged in shared memory (ctx) against q4_cta, 1 and 8 rows"
timeout 90 python -m bench.row_modes --ms 1,8 --ts "" --tiles "" --weights qkv,o --cuda --cold 24 \
  --json "$OUT/rows.json" 2>&1 | grep -E "cta 16c d8|cta 16c d4|ctx|plan"

# the engine, side by side: PDL for the CUDA kernels, then their L2 prefetch, then the route,
# then x staged
KERNEL_TESTS= BENCH= ENGINE_TESTS= TAIL=${TAIL:-5} T_ENGINE=${T_ENGINE:-90} \
  ENGINE_MODES="${MODES_SMALL-pdl pdl_cudapdl pdl_cudapdl_cudal2 pdl_cudapdl_cudal2_cudatopk pdl_cudapdl_cudal2_fusedroute pdl_cudapdl_cudal2_fusedroute_ctx16 pdl_cudapdl_cudal2_fusedroute_ctx8 pdl}" \
  CONTEXT=128 STREAMS=1,4,8 TAG=_small bash bench/gpu_ab.sh 2>&1 | grep -v "^context\|^KV pool"
KERNEL_TESTS= BENCH= ENGINE_TESTS= TAIL=${TAIL:-5} T_ENGINE=${T_ENGINE:-120} \
  ENGINE_MODES="${MODES_BIG-pdl pdl_cudapdl_cudal2_fusedroute}" CONTEXT=128,2048 STREAMS=1,64 \
  TAG=_big bash bench/gpu_ab.sh 2>&1 | grep -v "^context\|^KV pool"
# the attention's K / V prefetched into L2 before its PDL wait, at long contexts
KERNEL_TESTS= BENCH= ENGINE_TESTS= TAIL=${TAIL:-5} T_ENGINE=${T_ENGINE:-120} \
  ENGINE_MODES="${MODES_ATTN-pdl pdl_kvpf}" CONTEXT=2048,8192 STREAMS=1,4 \
  TAG=_attn bash bench/gpu_ab.sh 2>&1 | grep -v "^context\|^KV pool"
# BITWISE_MODES="pdl_cudapdl_cudal2_fusedroute ...": the engine's bitwise alone-vs-among sets
# under each (the judge before a mode becomes a default); none by default
for m in ${BITWISE_MODES-}; do
  KERNEL_TESTS= BENCH= ENGINE_TESTS=1 ENGINE_TEST_MODE=$m ENGINE_MODES="" T_ENGINE_TESTS=240 \
    bash bench/gpu_ab.sh 2>&1 | grep -v "^NVIDIA\|^torch" | tail -3
done
stamp done
