#!/usr/bin/env bash
# Checks that ride along with a long device call (e.g. an ablation block), in the background:
#   issue 15: Falcon-2's H200 crash, each configuration in its own process (an illegal access poisons the
#             CUDA context): the crashing row, the same under CUDA_LAUNCH_BLOCKING, compute-sanitizer memcheck,
#             num_stages=1, fp32, Falcon-2A; then the full `bench check --variants 2` sweep;
#   issue 20: experiments/h200/fla_layer_check.py (FalconAttention inside an fla model).
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
step f2_bf16 150 "${R[@]}" --dtype bfloat16 --json "$W/f2_bf16.json"
step f2_sanitizer 240 compute-sanitizer --tool memcheck --print-limit 30 "${R[@]}" --dtype bfloat16 --kernel-only \
  --json "$W/f2_sanitizer.json"
step f2_bf16_stages1 150 "${R[@]}" --dtype bfloat16 --stages 1 --json "$W/f2_bf16_stages1.json"
step f2_fp32 150 "${R[@]}" --dtype float32 --json "$W/f2_fp32.json"
step f2a_bf16 150 "${R[@]}" --variant 2A --dtype bfloat16 --json "$W/f2a_bf16.json"
step f2_bf16_blocking 150 env CUDA_LAUNCH_BLOCKING=1 "${R[@]}" --dtype bfloat16 --json "$W/f2_bf16_blocking.json"
step fla_layer 240 env -u FALCON_TRITON_UNPROVEN python3 experiments/h200/fla_layer_check.py --out "$W/fla_layer_check.json"
step f2_sweep 400 python3 -m falcon_lab.bench check --variants 2 --out "$W/check_variant2"
tar czf "${SIDE_RESULTS:-${OUT:?}/side.tgz}" -C "$W" .
echo "side checks packed after $(el)s"
