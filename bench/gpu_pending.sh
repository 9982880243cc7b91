#!/usr/bin/env bash
# The next session's first device call (kernels/GPU_NOTES.md, "Left undone" item 0), printing
# as it goes; every step has its own timeout so a hang costs that step only. Built and
# unmeasured as of v20: the paged attention's merge fused into its split programs (ab mode
# attnmerge), the one-pass top-k (topkpack) and older inputs loaded before the PDL wait
# (early; eidsfirst: the one-token down's expert ids and first weights). Their bits are in the
# GPU tests below (paged_attention_at_real, moe_at_real...packed_top_k, norms_rope;
# test_cuda_q4's direct experts), and they run beside the defaults unless MODES says
# otherwise. This call re-checks the bits on whatever machine comes, takes the defaults'
# baseline there (compare new variants only against numbers from the same call), Nsight
# Compute over the one-token kernels (what holds gate_up at 48% of copy: v20) and the kernel
# profile at 1 and 64 streams. Update it when the list changes.
# Usage (on the GPU machine, repo root):   OUT=/some/dir bash bench/gpu_pending.sh
# (MODES= names ab modes to run beside the defaults, default the fused merge alone and with
# 256-key splits — with no merge kernel a shorter split may no longer lose at 64 streams, v16 —
# the packed top-k and the early inputs; BITWISE_MODES adds the bitwise sets)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fedserve-gpu}
mkdir -p "$OUT"
stamp() { echo "=== $(date +%T) $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader

stamp "bits: cuda_q4 (CTA form, PDL chain in a graph, direct experts), the MoE, paged attention"
timeout 200 python -m pytest -q -n 0 tests/kernels/test_cuda_q4.py 2>&1 | tail -4
timeout 150 python -m pytest -q -n 0 tests/kernels/test_gpu.py -k "moe_at_real or paged_attention_at_real or norms_rope" 2>&1 | tail -3

# the defaults (pdl), then any MODES beside them, at the contexts and stream counts of the targets
KERNEL_TESTS= BENCH= ENGINE_TESTS= TAIL=${TAIL:-5} T_ENGINE=${T_ENGINE:-150} \
  ENGINE_MODES="pdl ${MODES-pdl_early_eidsfirst}" CONTEXT=128,2048 STREAMS=1,8,64 TAG=_base \
  bash bench/gpu_ab.sh 2>&1 | grep -v "^context\|^KV pool"

stamp "Nsight Compute: the one-token kernels (gate_up, down, qkv, o, the router)"
PROBE_ARGS="--ms 1 --ts 1" NCU_KERNELS="q4_e|q4_cta" T_NCU=180 bash bench/ncu_probe.sh 2>&1 | tail -24

stamp "kernel time per step by kernel (eager, CUPTI, plain launches), 1 and 64 streams"
timeout 200 python -m bench.gpu_profile --prompts 8 --prompt-len 512 --no-pdl --json "$OUT/profile.json" 2>&1 \
  | grep -v Warning | grep -A14 "== decode"

# BITWISE_MODES="...": the engine's bitwise alone-vs-among sets under each (the judge before a
# mode becomes a default); none by default
for m in ${BITWISE_MODES-}; do
  KERNEL_TESTS= BENCH= ENGINE_TESTS=1 ENGINE_TEST_MODE=$m ENGINE_MODES="" T_ENGINE_TESTS=240 \
    bash bench/gpu_ab.sh 2>&1 | grep -v "^NVIDIA\|^torch" | tail -3
done
stamp done
