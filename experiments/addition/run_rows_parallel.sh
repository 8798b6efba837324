#!/usr/bin/env bash
# Several addition rows at once on one GPU, each its own process with its own SQLite MLflow store
# (merged afterwards with `python -m falcon_lab.training.mlflow_merge`), all under one deadline.
# The small h200-scale models leave most of an H200 idle, so rows share it (ours; see PLAN.md).
#
#   DEADLINE_S=480 RESULTS=/path/to/tarball.tgz experiments/addition/run_rows_parallel.sh \
#       falcon_1a_3:0 transformer:0 transformer:0:h200-var ...
#
# Each argument is ROW:SEED or ROW:SEED:SCALE (the scale of run_addition.py; default $SCALE).
# A row still running at the deadline is stopped; its row JSON is then written from the history its
# evaluation callback saved after every evaluation, marked "complete": false (--salvage). Calling the
# script again on the same machine (same WORK) resumes every unfinished row from its last checkpoint
# (written at each validation, every 100 steps at the h200 scale): a row may span several calls.
# EXTRA: more Hydra overrides for every row (space-separated).
# Everything (row JSONs, MLflow stores with artifacts, logs; no checkpoints) goes into $RESULTS,
# written once as soon as the deadline passes and again after the salvage.
set -u
PY=${PYTHON:-python3}
DEADLINE=${DEADLINE_S:-480}
SCALE=${SCALE:-h200}
WORK=${WORK:-/tmp/addition_rows}
RESULTS=${RESULTS:-$WORK/results.tgz}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$WORK/res" "$WORK/ml" "$WORK/logs" "$WORK/runs"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1
# many processes compile at once: keep Inductor's worker pool per process small
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-2}
# ROW:SEED[:SCALE] -> row, seed, scale, name (the name keys logs, run dirs and MLflow stores)
parse() { IFS=: read -r row seed sc <<<"$1"; sc=${sc:-$SCALE}; name=${sc}_${row}_seed${seed}; }
t0=$(date +%s)
if "$PY" -c "import mlflow, sqlalchemy, alembic" >/dev/null 2>&1; then
  mlflow_for() { echo "logger.tracking_uri=sqlite:///$WORK/ml/$1/mlflow.db"; }
else
  echo "[rows] MLflow is not importable here: rows run with logger=none (their JSONs still hold every evaluation)"
  mlflow_for() { echo "logger=none"; }
fi
pack() { tar czf "$RESULTS" -C "$WORK" res ml logs $(cd "$WORK" && ls runs/*/addition_history.json 2>/dev/null); }
pids=()
for rs in "$@"; do
  parse "$rs"
  if [ -f "$WORK/res/$sc/${row}_seed$seed.json" ] && grep -q '"complete": true' "$WORK/res/$sc/${row}_seed$seed.json"; then
    echo "[rows] $name already complete"; continue
  fi
  resume=()
  ck="$WORK/runs/$name/checkpoints/last.ckpt"
  [ -f "$ck" ] && resume=("ckpt_path=$ck") && echo "[rows] $name resumes from $ck"
  timeout --signal=TERM --kill-after=15 "$DEADLINE" "$PY" "$HERE/run_addition.py" "$row" --seed "$seed" \
    --scale "$sc" --out "$WORK/res" "run_dir=$WORK/runs/$name" \
    "$(mlflow_for "$name")" "${resume[@]}" ${EXTRA:-} >>"$WORK/logs/$name.log" 2>&1 &
  pids+=($!)
  sleep 2  # stagger start-up (imports, Triton compiles share one cache)
done
# progress: the last evaluation of each row (step/ID val %/OOD mean %/capped OOD mean %), every 60 s
n=0
while [ ${#pids[@]} -gt 0 ] && kill -0 "${pids[@]}" 2>/dev/null; do
  sleep 5; n=$((n + 1)); [ $((n % 12)) -eq 0 ] || continue
  line="[rows +$(( $(date +%s) - t0 ))s]"
  for rs in "$@"; do
    parse "$rs"; h="$WORK/runs/$name/addition_history.json"
    if [ -f "$h" ]; then
      line+=" $name:$("$PY" -c "import json,sys;h=json.load(open(sys.argv[1]))['history'][-1];print(f\"{h['step']}/{100*h['addition/val_acc']:.0f}/{100*h.get('addition/ood_mean',0):.0f}/{100*h.get('addition/ood_cap_mean',0):.0f}\")" "$h" 2>/dev/null)"
    else
      line+=" $name:-"
    fi
  done
  echo "$line"
done
wait
pack
for rs in "$@"; do
  parse "$rs"
  if ! { [ -f "$WORK/res/$sc/${row}_seed$seed.json" ] && grep -q '"complete": true' "$WORK/res/$sc/${row}_seed$seed.json"; }; then
    echo "[rows] $name did not finish (end of its log):"; tail -c 600 "$WORK/logs/$name.log"; echo
    if [ -f "$WORK/runs/$name/addition_history.json" ]; then
      "$PY" "$HERE/run_addition.py" "$row" --seed "$seed" --scale "$sc" --out "$WORK/res" \
        --salvage "$WORK/runs/$name" 2>&1 | tail -n 1 &
    fi
  fi
done
wait
echo "[rows] wall $(( $(date +%s) - t0 )) s"
pack
ls -la "$RESULTS"
