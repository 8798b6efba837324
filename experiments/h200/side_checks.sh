#!/usr/bin/env bash
# Issue 15, proving the candidate fix for Falcon-2's H200 crash: percol_delta_backward now launches
# _pcd_bwd_state with num_warps=8 (it crashed at Triton's default 4 in bf16, K=V=128, C=64). Steps, each
# configuration in its own process (an illegal access poisons the CUDA context):
#   f2_default    falcon2_crash.py on the row that crashed, default (now 8-warp) launch: must pass (exit 0);
#   f2_sanitizer  the same under compute-sanitizer memcheck, caching allocator off: must report 0 errors;
#   f2_sweep      the full `bench check --variants 2` sweep: every row must pass (exit 0). Only with
#                 SIDE_ALONE=1, i.e. nothing else on the GPU (beside training runs its T=8192 row ran out of
#                 memory on 2026-12-02); without it the step is skipped and says so in summary.txt;
#   f2_warps4     control: the old 4-warp launch (--state-warps 4), expected to crash again (exit 3), which
#                 shows the launch change is what made the difference.
# Falcon-2 is proven only when f2_default, f2_sanitizer and f2_sweep all pass; then add "2" to PROVEN_CHUNK.
# No step starts after SIDE_DEADLINE_S; each step's timeout is cut to end by SIDE_DEADLINE_S + 60.
# Everything lands in $SIDE_RESULTS (default $OUT/side.tgz); summary.txt has one line per step with its exit code.
#   SIDE_ALONE=1 SIDE_DEADLINE_S=480 bash experiments/h200/side_checks.sh   (its own device call, after
#   . experiments/h200/device_env.sh; ~6-8 min). Earlier results: benchmarks/results/h200_logs/falcon2_crash_*.
set -u
W=${SIDE_WORK:-/tmp/side}; mkdir -p "$W"
DL=${SIDE_DEADLINE_S:-420}
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 to=$2; shift 2
  if [ "$(el)" -ge "$DL" ]; then echo "$name skipped (deadline)" >> "$W/summary.txt"; return; fi
  local cap=$(( DL + 60 - $(el) )); [ "$to" -gt "$cap" ] && to=$cap
  echo "== +$(el)s $name (timeout ${to}s): $*" >> "$W/summary.txt"
  timeout --kill-after=10 "$to" "$@" > "$W/$name.log" 2>&1
  echo "$name rc=$? +$(el)s" >> "$W/summary.txt"
}
R=(python3 experiments/h200/falcon2_crash.py)
export FALCON_TRITON_UNPROVEN=1
nvidia-smi > "$W/nvidia-smi.txt" 2>&1
# 2026-12-02 (e5909d9, the 4-warp launch): memcheck placed the crash at an out-of-range shared/local address at
# the dH update of _pcd_bwd_state; 8 warps, fp32 q/x and C=32 passed; `check --variants 2` passed every bf16
# row but K=V=128 C=64 (benchmarks/results/h200_logs/falcon2_crash_2026-12-02b/).
step f2_default 120 "${R[@]}" --dtype bfloat16 --json "$W/f2_default.json"
step f2_sanitizer 300 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --print-limit 30 \
  "${R[@]}" --dtype bfloat16 --json "$W/f2_sanitizer.json"
if [ "${SIDE_ALONE:-0}" = 1 ]; then
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv > "$W/gpu_apps_before_sweep.txt" 2>&1
  step f2_sweep 400 python3 -m falcon_lab.bench check --variants 2 --out "$W/check_variant2"
else
  echo "f2_sweep skipped (SIDE_ALONE!=1: the proving sweep runs alone on the GPU)" >> "$W/summary.txt"
fi
step f2_warps4 120 "${R[@]}" --dtype bfloat16 --state-warps 4 --json "$W/f2_warps4.json"
tar czf "${SIDE_RESULTS:-${OUT:?}/side.tgz}" -C "$W" .
echo "side checks packed after $(el)s"
