#!/usr/bin/env bash
# One device call: compare the q4 inner loops, then check and benchmark the engine with the
# engine's tiles and with the fastest loop found. Usage (on the GPU machine, repo root):
#   OUT=/some/dir bash kernels/gpu_run.sh
# Everything lands in $OUT (log, kernels.json, engine_*.json, picked.env).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fedserve-gpu}
mkdir -p "$OUT"
stamp() { echo "=== $(date +%T) $*"; }
MODEL=synthetic:qwen3-30b-a3b-int4
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader

stamp "kernel variants"
timeout 120 python -m kernels.bench_gpu --no-attention --no-splitk --ms 1,8,64 \
  --tiles ${TILES:-16x32x128w4s2,16x32x128w4s2p4,16x32x256w4s2,16x64x128w8s2p4} \
  --moe-tiles ${MOE_TILES:-16x32x128w4s2,16x32x128w4s2p4,16x32x256w4s2} \
  --json "$OUT/kernels.json"

stamp "pick"
python - "$OUT" <<'PY'
import json, math, sys
out = sys.argv[1]
try:
    rows = json.load(open(f"{out}/kernels.json"))["rows"]
except Exception as e:
    rows = []
    print("no kernel results:", e)
# engine weight per step: qkv and o once per layer (48), lm_head once; MoE once per layer
count = {"qkv": 48, "o": 48, "lm_head": 1}
def best(kernel, weight):
    cost = {}
    for r in rows:
        if r["kernel"] != kernel:
            continue
        cost.setdefault(r["variant"], 0.0)
        cost[r["variant"]] += r["ms"] * weight(r)
    ok = {v: c for v, c in cost.items() if not math.isnan(c)}
    for v, c in sorted(cost.items(), key=lambda kv: kv[1]):
        print(f"{kernel:10s} {v:24s} weighted ms {c:9.3f}")
    return min(ok, key=ok.get) if ok else "16x32x128w4s2"
lin = best("linear_q4", lambda r: count[r["shape"]])
moe = best("moe", lambda r: 48)
with open(f"{out}/picked.env", "w") as f:
    f.write(f"export FEDSERVE_LINEAR_TILE={lin}\nexport FEDSERVE_EXPERT_TILE={moe}\n")
print("picked", lin, moe)
PY
cat "$OUT/picked.env"

stamp "engine, the engine's own tiles (GPU-side greedy sampling)"
timeout 100 python -m federation.cli bench engine --model $MODEL --streams 1,8,32,64 \
  --max-tokens 64 --device cuda --json "$OUT/engine_default.json"

stamp "GPU tests with the picked tiles"
( source "$OUT/picked.env"; timeout 150 python -m pytest -q -x tests/kernels/test_gpu.py \
  tests/replica/test_runner.py 2>&1 | tail -25 )

if grep -q "=16x32x128w4s2$" "$OUT/picked.env" && [ "$(grep -c '=16x32x128w4s2$' "$OUT/picked.env")" = 2 ]; then
  stamp "picked tiles are the engine's own: no second engine run"
else
  stamp "engine, the picked tiles"
  ( source "$OUT/picked.env"; timeout 100 python -m federation.cli bench engine --model $MODEL \
    --streams 1,8,32,64 --max-tokens 64 --device cuda --json "$OUT/engine_picked.json" )
fi
stamp "host profile of the step loop, 64 streams, picked tiles"
( source "$OUT/picked.env"; timeout 100 python -m federation.cli bench engine --model $MODEL \
  --streams 64 --max-tokens 64 --device cuda --profile 2>&1 | head -45 )
stamp done
