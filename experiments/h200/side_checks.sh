#!/usr/bin/env bash
# Checks that ride along with a long device call (e.g. an ablation block), in the background:
#   issue 15: Falcon-2's H200 crash, each configuration in its own process (an illegal access poisons the
#             CUDA context): the steps below, then the full `bench check --variants 2` sweep.
#   (issue 20's fla_layer_check.py ran here on 2026-12-02 and passed; it runs alone in ~150 s.)
# No step starts after SIDE_DEADLINE_S; each step's timeout is cut to end by SIDE_DEADLINE_S + 60.
# Everything lands in $SIDE_RESULTS (default $OUT/side.tgz); summary.txt has one line per step with its exit code.
#   bash experiments/h200/side_checks.sh &   (after . experiments/h200/device_env.sh)
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
# 2026-12-02 (commit 3cd4ce4): the check row crashed in bf16 (also with num_stages=1 and under CUDA_LAUNCH_BLOCKING=1,
# which placed it in the launch of _pcd_bwd_state); fp32 and Falcon-2A bf16 passed; kernel-only under
# compute-sanitizer ran clean, but with PyTorch's caching allocator the sanitizer cannot see an access that stays
# inside a cached segment. Next: the sanitizer on the check row with caching off, kernel-only without it, and the
# state kernel on fp32 copies of q and x (the workaround candidate: fp32 passed), at 8 warps, at chunk 32.
step f2_sanitizer_nocache 300 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --print-limit 30 \
  "${R[@]}" --dtype bfloat16 --json "$W/f2_sanitizer_nocache.json"
step f2_state_fp32 120 "${R[@]}" --dtype bfloat16 --state-fp32 --json "$W/f2_state_fp32.json"
step f2_kernel_only 120 "${R[@]}" --dtype bfloat16 --kernel-only --json "$W/f2_kernel_only.json"
step f2_state_warps8 120 "${R[@]}" --dtype bfloat16 --state-warps 8 --json "$W/f2_state_warps8.json"
step f2_c32 120 "${R[@]}" --dtype bfloat16 --C 32 --json "$W/f2_c32.json"
step f2_bf16 120 "${R[@]}" --dtype bfloat16 --json "$W/f2_bf16.json"
step f2_sweep 400 python3 -m falcon_lab.bench check --variants 2 --out "$W/check_variant2"
tar czf "${SIDE_RESULTS:-${OUT:?}/side.tgz}" -C "$W" .
echo "side checks packed after $(el)s"
