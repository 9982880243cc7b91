#!/usr/bin/env bash
# Nsight Compute on bench/ncu_probe.py: per kernel duration, grid, registers, occupancy, issue
# activity, DRAM and SM throughput and the top stall reasons. Usage (GPU machine): OUT=dir bash bench/ncu_probe.sh
# (NCU_TARGET: another python target, e.g. "-m bench.attn_timeline --contexts 128 --tokens 1
# --layers 2" with NCU_KERNELS=_attn_split; NCU_ARGS: more ncu options, e.g. "-c 8" to profile
# only the first 8 matching launches; the second half of the profiled launches is printed)
set -u
export OUT=${OUT:-/tmp/fedserve-ncu}
mkdir -p "$OUT"
R="long_scoreboard short_scoreboard wait math_pipe_throttle mio_throttle lg_throttle barrier membar dispatch_stall no_instruction not_selected selected branch_resolving imc_miss misc sleeping tex_throttle drain"
export R
M="gpu__time_duration.sum,launch__grid_size,launch__block_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,launch__occupancy_limit_blocks"
for r in $R; do M="$M,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"; done
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
timeout "${T_NCU:-400}" "$NCU" --clock-control none -k regex:"${NCU_KERNELS:-q4|moe|expert}" --csv ${NCU_ARGS-} --metrics "$M" python ${NCU_TARGET:--m bench.ncu_probe ${PROBE_ARGS-}} > $OUT/ncu.csv 2> $OUT/ncu.err
echo rc $?; tail -3 $OUT/ncu.err; wc -l $OUT/ncu.csv
python - <<'PY'
import csv, os, collections
rows = list(csv.reader(open(os.environ["OUT"] + "/ncu.csv")))
hdr_i = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
hdr = rows[hdr_i]; data = rows[hdr_i + 1:]
ki, ni, mi, vi = hdr.index("ID"), hdr.index("Kernel Name"), hdr.index("Metric Name"), hdr.index("Metric Value")
by = collections.OrderedDict()
for r in data:
    by.setdefault((r[ki], r[ni][:40]), {})[r[mi]] = r[vi]
ids = list(by)
for (i, name) in ids[len(ids) // 2:]:
    m = by[(i, name)]
    short = {k.replace("smsp__average_warps_issue_stalled_", "").replace("_per_issue_active.ratio", ""): v for k, v in m.items()}
    stalls = sorted(((float(v.replace(",", "")), k) for k, v in short.items() if k in os.environ["R"].split()), reverse=True)[:6]
    print(f"{i} {name} t={m['gpu__time_duration.sum']} grid={m['launch__grid_size']} blk={m['launch__block_size']} regs={m['launch__registers_per_thread']} occ={m['sm__warps_active.avg.pct_of_peak_sustained_active']} issue={m['smsp__issue_active.avg.pct_of_peak_sustained_active']} dram={m['dram__throughput.avg.pct_of_peak_sustained_elapsed']} sm={m['sm__throughput.avg.pct_of_peak_sustained_elapsed']} inst={m['smsp__inst_executed.sum']} lim r/s/b={m['launch__occupancy_limit_registers']}/{m['launch__occupancy_limit_shared_mem']}/{m['launch__occupancy_limit_blocks']}")
    print("    stalls/issue: " + ", ".join(f"{k} {v:.2f}" for v, k in stalls))
PY
