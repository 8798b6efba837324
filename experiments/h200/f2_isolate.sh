#!/usr/bin/env bash
# Falcon-2's per-column solves by 16-row sub-blocks on the H200 (issue 15; percol_delta.py's FALCON_TRITON_2_SOLVE,
# FALCON_TRITON_2_BWD_SOLVE and FALCON_TRITON_2_BLK_BWD). Run on the GPU machine from the repo root:
#   bash experiments/h200/f2_isolate.sh OUTDIR
# History: on 2026-12-03 (5e0a3b1, benchmarks/results/h200_logs/kernels_2026-12-03c/call1_5e0a3b1/f2iso/) this script
# ran the then-separate patch in a copy of the tree: the refactor alone and the solve's gradients by blocks passed rows
# 1, 7, 10, 11, 17, 20; the state passes by blocks failed them with right forward outputs (the reverse pass,
# _pcd_bwd_state_blk: compute-sanitizer "out-of-range shared or local address" in _bwd_solve_blocked's loop). The
# kernels are in the package since, opt-in. Now, `bench check --variants 2 --rows $F2ISO_ROWS`, one process per way,
# all in parallel:
#   fwd          FALCON_TRITON_2_SOLVE=fwd                    the forward state pass by sub-blocks
#   fwd_bwdblk   ..._SOLVE=fwd ..._BWD_SOLVE=blocked          and the solve's gradients by sub-blocks: the candidate
#   blk_w4       ..._SOLVE=blocked ..._BLK_BWD=4,0             the failing reverse pass at 4 warps
#   blk_bv16     ..._SOLVE=blocked ..._BLK_BWD=8,16            ... at 8 warps with 16-column value tiles
#   blk_w4_bv16  ..._SOLVE=blocked ..._BLK_BWD=4,16            ... both
#   blk_w4_s1    ..._SOLVE=blocked ..._BLK_BWD=4,0,s1          at 4 warps and one pipeline stage (as fp32 builds)
#   blk_w4_f32   ..._SOLVE=blocked ..._BLK_BWD=4,0,f32         at 4 warps, its transposed solve's dots on fp32 operands
#   blk_w4_f32_s1 ..._BLK_BWD=4,0,f32,s1                       both
#   blk_s1       ..._SOLVE=blocked ..._BLK_BWD=8,0,s1          one stage at 8 warps
#   blk_w4_x32   ..._SOLVE=blocked ..._BLK_BWD=4,0,x32         at 4 warps, every dot of the reverse pass on fp32
#                                                              operands (q, x cast up on load): the fp32 builds' code
#   blk_w4_x32_s1  ..._BLK_BWD=4,0,x32,s1                      and one stage, as fp32 launches compile
#   blk_w4_bv64_x32 ..._BLK_BWD=4,64,x32                       with 64-column value tiles (one tile at K = V = 64)
# then compute-sanitizer memcheck on each blocked way that failed, at $F2ISO_MEMCHECK (default bf16 K = 128, C = 64,
# the shape whose gradients were wrong at 4 warps on 2026-12-03 at 12b0470; fp32 K = 64, C = 64, which faulted at 8
# warps on 2026-12-03 at 5e0a3b1, was clean at 4 warps and with 16-column tiles: "--dtype float32 --K 64").
# Results of 2026-12-03 (12b0470, kernels_2026-12-03d/call2/f2iso/): fwd and fwd_bwdblk pass all six rows; blk_w4
# fails rows 1, 10 (bf16 K = 128: dx, dv, deta, dg ~0.4 off) and passes the fp32 rows; memcheck clean at fp32 K = 64.
# fp32 launches compile with one pipeline stage (common._stages), 16-bit ones with Triton's 3: hence the s1 ways.
# Results of 2026-12-03 (c84b0ad, kernels_2026-12-03e/call1/f2iso/): blk_w4_s1, blk_w4_f32, blk_w4_f32_s1 fail rows 1
# and 10 (bf16 K = 128) as before and pass the rest, memcheck clean each; blk_s1 poisons the context at row 17 (fp32
# K = 64). Hence the x32 ways: the dsu and dH-update dots outside the solve on fp32 operands too.
set -u
O=${1:?usage: f2_isolate.sh OUTDIR}; mkdir -p "$O"
ROWS=${F2ISO_ROWS:-1,7,10,11,17,20}
declare -A MODE=([fwd]="fwd exact 8,0" [fwd_bwdblk]="fwd blocked 8,0" [blk_w4]="blocked exact 4,0"
                 [blk_bv16]="blocked exact 8,16" [blk_w4_bv16]="blocked exact 4,16"
                 [blk_w4_f32]="blocked exact 4,0,f32" [blk_f32]="blocked exact 8,0,f32"
                 [blk_w4_s1]="blocked exact 4,0,s1" [blk_w4_f32_s1]="blocked exact 4,0,f32,s1"
                 [blk_s1]="blocked exact 8,0,s1" [blk_w4_x32]="blocked exact 4,0,x32"
                 [blk_w4_x32_s1]="blocked exact 4,0,x32,s1" [blk_w4_bv64_x32]="blocked exact 4,64,x32")
WAYS=${F2ISO_WAYS:-"blk_w4_x32 blk_w4_x32_s1 blk_w4_bv64_x32"}
MEMCHECK=${F2ISO_MEMCHECK:-"--dtype bfloat16 --K 128"}
for w in $WAYS; do
  set -- ${MODE[$w]}
  ( FALCON_TRITON_2_SOLVE=$1 FALCON_TRITON_2_BWD_SOLVE=$2 FALCON_TRITON_2_BLK_BWD=$3 FALCON_TRITON_UNPROVEN=1 \
      TRITON_CACHE_DIR=/tmp/f2cache_$w timeout 220 python3 -m falcon_lab.bench check --variants 2 --rows "$ROWS" \
      --out "$O/check_$w" > "$O/check_$w.log" 2>&1
    echo "$w rc=$?" >> "$O/summary.txt" ) &
done
wait
command -v compute-sanitizer > /dev/null || echo "no compute-sanitizer on this machine" >> "$O/summary.txt"
for w in $WAYS; do  # the blocked ways with a failing row, in parallel
  case $w in blk*) ;; *) continue ;; esac
  grep -qE '^\[.*\] (FAIL|ERROR)' "$O/check_$w.log" || continue
  command -v compute-sanitizer > /dev/null || continue
  set -- ${MODE[$w]}
  ( FALCON_TRITON_2_SOLVE=$1 FALCON_TRITON_2_BWD_SOLVE=$2 FALCON_TRITON_2_BLK_BWD=$3 FALCON_TRITON_UNPROVEN=1 \
      TRITON_CACHE_DIR=/tmp/f2cache_$w timeout 100 compute-sanitizer --tool memcheck --print-limit 10 \
      python3 experiments/h200/falcon2_crash.py $MEMCHECK --B 2 --T 200 --C 64 --kernel-only \
      --json "$O/memcheck_$w.json" > "$O/memcheck_$w.log" 2>&1
    echo "memcheck_$w rc=$?" >> "$O/summary.txt" ) &
done
wait
