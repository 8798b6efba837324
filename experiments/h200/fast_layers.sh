#!/usr/bin/env bash
# The fast-layers issue's H200 runs, in stages that each fit one device call (10 min):
#   experiments/h200/fast_layers.sh a|a2|b|c|d|e|f      (on the GPU machine, from the repo root, $OUT set)
# Every step has its own timeout and writes under $OUT as it goes, so a stage that runs long still
# returns what finished. Needs .whl (hydra-core, omegaconf, antlr4, fla-core, flash-linear-attention).
set -u
. experiments/h200/device_env.sh > $OUT/env_$1.log 2>&1
export FALCON_COMMIT=${FALCON_COMMIT:-unknown} TORCHINDUCTOR_CACHE_DIR=/tmp/inductor TRITON_CACHE_DIR=/tmp/triton
W=/tmp/work_$1; mkdir -p $W
case "$1" in d|e|f|g|h) M=$W/m ;; *) M=$OUT/m ;; esac
B="python3 -m falcon_lab.bench model --size small --contexts= --steps 6 --out $M"
run() { local t=$1; shift; echo "== $(date +%T) $*" | tee -a $OUT/stage_$STAGE.log
        timeout "$t" "$@" >> $OUT/stage_$STAGE.log 2>&1; echo "== rc $?" | tee -a $OUT/stage_$STAGE.log; }
STAGE=$1
case "$1" in
  a)
    run 120 python3 -m falcon_lab.benchmarking.modules_check --out $OUT
    run 150 python3 experiments/h200/op_check.py --out $OUT
    run 330 $B --mixers transformer,falcon-1A --profile
    ;;
  a2)
    run 480 $B --mixers transformer,falcon-1A --profile
    ;;
  b)
    run 200 $B --mixers falcon-1 --profile
    run 100 $B --mixers falcon-1A --seq-lens 2048 --override mixer.module_backend=torch --tag torchmodules --profile
    run 240 $B --mixers fla_deltanet --profile
    ;;
  c)
    run 200 $B --mixers falcon-2A,falcon-3A,falcon-3,falcon-2 --seq-lens 2048 --profile
    run 120 $B --mixers transformer --seq-lens 2048,32768 --loss-impl materialized
    run 200 python3 experiments/h200/train_small.py --out $OUT/train --steps 300 --models 1a_3,1a_3_unfused
    ;;
  # second round (the Triton loss body, mixer.recompute, fused q/k/v and gate projections); results are
  # packed into $OUT/res_<stage>.tgz (the device tool returns at most 8 files)
  d)
    run 60 python3 experiments/h200/loss_check.py --out $W
    run 480 $B --mixers transformer,falcon-1A --profile
    ;;
  e)
    run 190 $B --mixers falcon-1 --profile
    run 110 $B --mixers falcon-1A --seq-lens 2048 --override mixer.recompute=false --tag norecompute --profile
    run 240 $B --mixers fla_deltanet
    ;;
  f)
    run 180 $B --mixers falcon-2A,falcon-3A,falcon-3 --seq-lens 2048 --profile
    run 180 python3 experiments/h200/train_small.py --out $W/train --steps 300 --models 1a_3,1a_3_unfused
    run 170 $B --mixers transformer,falcon-1A --seq-lens 2048 --loss-impl chunked_torch
    ;;
  # third round (the short conv's two-pass backward and its split q|k|v output)
  g)
    run 70 python3 -m falcon_lab.benchmarking.modules_check --out $W
    run 200 $B --mixers transformer,falcon-1A,falcon-1 --profile
    run 80 $B --mixers falcon-1A --override mixer.recompute=false --tag norecompute --profile
    run 90 $B --mixers falcon-2A,falcon-3A,falcon-3 --seq-lens 2048 --profile
    run 70 $B --mixers falcon-2A,falcon-3A,falcon-3 --seq-lens 2048 --override mixer.recompute=false --tag norecompute
    ;;
  h)
    run 240 $B --mixers fla_deltanet
    run 150 python3 experiments/h200/train_small.py --out $W/train --steps 300 --models 1a_3,1a_3_unfused
    rm -rf $W/train/1a_3 $W/train/1a_3_unfused  # checkpoints: too large to bring back
    ;;
esac
case "$1" in d|e|f|g|h) tar czf $OUT/res_$1.tgz -C $W . ;; esac
tail -n 25 $OUT/stage_$STAGE.log
