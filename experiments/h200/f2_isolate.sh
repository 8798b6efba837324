#!/usr/bin/env bash
# Falcon-2's blocked solves isolated (issue 15; the attempt FAILED on the H200 at 81ff606: K = 128, C = 64 bf16
# gradients ~0.4 off, fp32 K = 64, C = 64 an illegal address). Run on the GPU machine from the repo root:
#   bash experiments/h200/f2_isolate.sh OUTDIR
# It copies the tree to /tmp/f2tree, applies experiments/h200/f2_blocked_solve.patch there (the package in the repo
# root stays the proven one, so steps running beside this one are not affected) and runs `bench check --variants 2`
# on the rows that failed (1, 10: bf16 K = 128, C = 64; 17: fp32 K = 64, C = 64) plus their neighbours (7: bf16 K = 64,
# C = 64; 11: fp32 K = 128, C = 64 at T = 8192; 20: fp32 K = 128, C = 64), three ways, one process each, in parallel:
#   refactor   FALCON_TRITON_2_SOLVE=rows    FALCON_TRITON_2_BWD_SOLVE=exact    the patched file, proven algorithms
#   fwdblk     FALCON_TRITON_2_SOLVE=blocked FALCON_TRITON_2_BWD_SOLVE=exact    the state passes by sub-blocks alone
#   bwdblk     FALCON_TRITON_2_SOLVE=rows    FALCON_TRITON_2_BWD_SOLVE=blocked  the solve's gradients by blocks alone
# then, for every way with a failing or erroring row, compute-sanitizer (memcheck on fp32 K = 64, C = 64; racecheck on
# bf16 K = 128, C = 64) on experiments/h200/falcon2_crash.py --kernel-only at a short T.
set -u
O=${1:?usage: f2_isolate.sh OUTDIR}; mkdir -p "$O"
ROOT=$(pwd); T2=/tmp/f2tree
rm -rf "$T2"; mkdir -p "$T2"
tar cf - --exclude=./.tcache --exclude=./.whl --exclude=./.venv . | (cd "$T2" && tar xf -)
cd "$T2" || exit 2
export PYTHONPATH="$T2${PYTHONPATH:+:$PYTHONPATH}"  # the patched package first
if command -v patch > /dev/null; then patch -p1 < experiments/h200/f2_blocked_solve.patch > "$O/patch.log" 2>&1
else env -u GIT_DIR git apply experiments/h200/f2_blocked_solve.patch > "$O/patch.log" 2>&1; fi
echo "patch rc=$?" >> "$O/patch.log"
grep -q '_pcd_fwd_state_blk' falcon_lab/kernels/triton/percol_delta.py || { echo "patch not applied" >> "$O/patch.log"; exit 2; }
ROWS=${F2ISO_ROWS:-1,7,10,11,17,20}
declare -A MODE=([refactor]="rows exact" [fwdblk]="blocked exact" [bwdblk]="rows blocked")
for w in refactor fwdblk bwdblk; do
  set -- ${MODE[$w]}
  ( FALCON_TRITON_2_SOLVE=$1 FALCON_TRITON_2_BWD_SOLVE=$2 TRITON_CACHE_DIR=/tmp/f2cache_$w timeout 200 \
      python3 -m falcon_lab.bench check --variants 2 --rows "$ROWS" --out "$O/check_$w" > "$O/check_$w.log" 2>&1
    echo "$w rc=$?" >> "$O/summary.txt" ) &
done
wait
san() {  # san WAY SOLVE BWD_SOLVE: memcheck on fp32 K = 64, then racecheck on bf16 K = 128 (C = 64 both)
  FALCON_TRITON_2_SOLVE=$2 FALCON_TRITON_2_BWD_SOLVE=$3 TRITON_CACHE_DIR=/tmp/f2cache_$1 timeout 100 \
    compute-sanitizer --tool memcheck --print-limit 20 python3 experiments/h200/falcon2_crash.py --dtype float32 \
    --B 2 --T 200 --K 64 --C 64 --kernel-only --json "$O/memcheck_$1.json" > "$O/memcheck_$1.log" 2>&1
  echo "memcheck_$1 rc=$?" >> "$O/summary.txt"
  FALCON_TRITON_2_SOLVE=$2 FALCON_TRITON_2_BWD_SOLVE=$3 TRITON_CACHE_DIR=/tmp/f2cache_$1 timeout 120 \
    compute-sanitizer --tool racecheck --print-limit 20 python3 experiments/h200/falcon2_crash.py --dtype bfloat16 \
    --B 1 --T 128 --K 128 --C 64 --kernel-only --json "$O/racecheck_$1.json" > "$O/racecheck_$1.log" 2>&1
  echo "racecheck_$1 rc=$?" >> "$O/summary.txt"
}
command -v compute-sanitizer > /dev/null || echo "no compute-sanitizer on this machine" >> "$O/summary.txt"
for w in refactor fwdblk bwdblk; do  # the ways with a failing row, in parallel
  grep -qE '^\[.*\] (FAIL|ERROR)' "$O/check_$w.log" || continue
  command -v compute-sanitizer > /dev/null && san "$w" ${MODE[$w]} &
done
wait
cd "$ROOT"
rm -rf "$T2"
