#!/usr/bin/env bash
# One block of the issue-19 ablation study on one GPU (plan: experiments/ablation/PLAN.md).
#
#   On the GPU machine, from the repo root, $OUT set, after `. experiments/h200/device_env.sh`:
#     BLOCK=b1 DEADLINE_S=400 HARD_S=540 experiments/ablation/run_block.sh experiments/ablation/blocks/b1_*.txt
#   CPU smoke check (tiny model, 4 steps, trainer=cpu, 2 arms: one LM, one MQAR + its evaluation):
#     SMOKE=1 OUT=/tmp/abl_out experiments/ablation/run_block.sh
#
# Arm files: one arm per line, `NAME arm=LABEL seed=N hydra_override ...` (whitespace-separated, no shell
# quoting: the overrides reach Hydra verbatim, so write mixer.variant="3A"). `arm=` becomes the MLflow tag
# `arm` (not a Hydra key); `seed=` is passed to Hydra and also tagged. A line with `data=mqar` is an MQAR run:
# it gets the MQAR scale and, after training, `falcon_lab.evaluate suites=[mqar]` on its best checkpoint.
# Lines starting with # are comments.
#
# Runs go N at a time (PAR) as separate processes, each with its own SQLite MLflow store
# ($WORK/ml/NAME/mlflow.db, artifacts beside it) and run dir ($WORK/runs/NAME). No run is started after
# DEADLINE_S (seconds since this script started); every run is stopped with SIGINT at HARD_S, which makes
# falcon_lab write checkpoints/last.ckpt and end the MLflow run KILLED. Calling the script again on the same
# machine (same WORK, machine still warm) skips finished runs and resumes the others from last.ckpt
# (ckpt_path=, same overrides: the same MLflow run continues). At the end ONLY small files (MLflow stores +
# artifacts, metrics.jsonl, config.yaml, MQAR JSON, logs, status/summary) are packed into
# $OUT/ablation_$BLOCK.tgz (never checkpoints; split into .part00, .part01, ... when over RESULTS_MAX_BYTES, 15 MiB,
# since the device tool returns files of at most 16 MiB). Merge here with python -m falcon_lab.training.mlflow_merge.
# A run killed by a CUDA out-of-memory error is queued again (OOM_RETRIES, default 1), and on a GPU no run
# starts while less than GPU_MIN_FREE_MIB (default 16000) is free; POLL_S sets the scheduler's tick (5 s).
set -u
PY=${PYTHON:-python3}
SMOKE=${SMOKE:-0}
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/../h200/device_files.sh"  # split_for_device
if [ "$SMOKE" = 1 ]; then
  BLOCK=${BLOCK:-smoke}; PAR=${PAR:-2}; DEADLINE_S=${DEADLINE_S:-240}; HARD_S=${HARD_S:-300}
  WORK=${WORK:-/tmp/ablation_smoke}
  LM_SCALE=${LM_SCALE:-"model=tiny trainer=cpu debug=smoke"}
  MQAR_SCALE=${MQAR_SCALE:-"model=tiny trainer=cpu debug=smoke data.seq_len=64 data.num_kv_pairs=[4,8] data.val_examples=8"}
  MQAR_GRID=${MQAR_GRID:-"[[4,64],[8,64]]"}; MQAR_N=${MQAR_N:-16}
  [ $# -eq 0 ] && set -- "$HERE/blocks/smoke.txt"
else
  BLOCK=${BLOCK:?set BLOCK (e.g. b1)}; PAR=${PAR:-12}; DEADLINE_S=${DEADLINE_S:-400}; HARD_S=${HARD_S:-540}
  WORK=${WORK:-/tmp/ablation_$BLOCK}
  # LM scale (PLAN.md "Scale"): 4 x 256 (2 heads x 128), byte-level KJV, 512-token rows, batch 32 = 16,384 tokens/step,
  # 1000 steps = 16.4M tokens per arm; AdamW lr 2e-3, 100 warm-up steps; validation + checkpoint every 200 steps.
  LM_SCALE=${LM_SCALE:-"trainer=gpu model.name=l4d256 model.n_layers=4 model.d_model=256 model.n_heads=2 model.head_dim=128 data.seq_len=512 data.batch_size=32 trainer.max_steps=1000 trainer.val_check_interval=200 trainer.limit_val_batches=50 trainer.log_every_n_steps=20 trainer.enable_progress_bar=false optim.lr=2e-3 optim.warmup_steps=100"}
  # MQAR scale: 2 layers (width set per arm: model.d_model/head_dim), T=256, kv pairs {8,16,32,64}, batch 64, 1000 steps.
  MQAR_SCALE=${MQAR_SCALE:-"trainer=gpu model.name=l2_mqar model.n_layers=2 model.n_heads=2 data.seq_len=256 data.num_kv_pairs=[8,16,32,64] data.batch_size=64 trainer.max_steps=1000 trainer.val_check_interval=200 trainer.limit_val_batches=20 trainer.log_every_n_steps=20 trainer.enable_progress_bar=false optim.lr=1e-3 optim.warmup_steps=100 checks.shuffle=false"}
  MQAR_GRID=${MQAR_GRID:-"[[8,256],[16,256],[32,256],[64,256],[32,512],[64,512],[96,512]]"}; MQAR_N=${MQAR_N:-128}
fi
RESULTS=${RESULTS:-${OUT:?set OUT}/ablation_$BLOCK.tgz}
mkdir -p "$WORK/ml" "$WORK/runs" "$WORK/logs" "$(dirname "$RESULTS")"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor} TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton}
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
if command -v nvidia-smi >/dev/null 2>&1; then  # GPU utilisation/memory every 15 s: sizes PAR for later blocks
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -l 15 >> "$WORK/gpu.csv" 2>/dev/null &
  SMI=$!; trap 'kill $SMI 2>/dev/null' EXIT
fi
say() { echo "[ablation $BLOCK +$(el)s] $*" | tee -a "$WORK/block.log"; }

if "$PY" -c "import mlflow, sqlalchemy, alembic" >/dev/null 2>&1; then HAVE_MLFLOW=1; else
  HAVE_MLFLOW=0; say "MLflow is not importable: runs use logger=none (metrics.jsonl still holds every validation)"; fi

# ---- read the arms -------------------------------------------------------------------------------------------
names=(); lines=()
for f in "$@"; do
  while read -r name rest; do
    [ -z "${name:-}" ] && continue; case "$name" in \#*) continue ;; esac
    names+=("$name"); lines+=("$rest")
  done < "$f"
done
say "${#names[@]} arms from $*, PAR=$PAR DEADLINE_S=$DEADLINE_S HARD_S=$HARD_S WORK=$WORK"

launch() {  # launch INDEX: one arm in the background (train, then MQAR evaluation), writing runs/NAME/{done,rc}
  local name=${names[$1]} arm="" seed="" study="" ov=() is_mqar=0 w
  for w in ${lines[$1]}; do
    case "$w" in
      arm=*) arm=${w#arm=} ;;
      seed=*) seed=${w#seed=}; ov+=("$w") ;;
      data=mqar) is_mqar=1; ov+=("$w") ;;
      *) ov+=("$w") ;;
    esac
  done
  local rd="$WORK/runs/$name" log="$WORK/logs/$name.log" db="$WORK/ml/$name/mlflow.db"
  mkdir -p "$rd" "$WORK/ml/$name"
  local scale=$LM_SCALE; [ $is_mqar = 1 ] && scale=$MQAR_SCALE
  local ml=("logger.tracking_uri=sqlite:///$db")
  [ $HAVE_MLFLOW = 0 ] && ml=("logger=none")
  local resume=()
  [ -f "$rd/checkpoints/last.ckpt" ] && resume=("ckpt_path=$rd/checkpoints/last.ckpt") && say "$name resumes from last.ckpt"
  local left=$(( HARD_S - $(el) ))
  # shellcheck disable=SC2086
  local cmd=("$PY" -m falcon_lab.fit $scale "${ov[@]}" "logger.tags={arm:\"${arm:-$name}\",seed:\"${seed:-}\",block:\"$BLOCK\"}"
             "logger.run_name=$name" "${ml[@]}" "+callbacks.history=experiments.ablation.history_cb:make"
             "run_dir=$rd" "hydra.run.dir=$rd" "hydra.mode=RUN" "${resume[@]}")
  (
    echo "== $(date +%T) $name (timeout ${left}s): ${cmd[*]}" >> "$log"
    ts=$(date +%s)
    timeout --signal=INT --kill-after=30 "$left" "${cmd[@]}" >> "$log" 2>&1; rc=$?
    echo "train_rc=$rc wall_s=$(( $(date +%s) - ts ))" >> "$rd/rc"
    if [ $rc = 0 ] && [ $is_mqar = 1 ]; then
      ck=$(ls "$rd"/checkpoints/best-step*.ckpt 2>/dev/null | tail -n 1); ck=${ck:-$rd/checkpoints/last.ckpt}
      left=$(( HARD_S - $(el) ))
      emf=("mlflow.tracking_uri=sqlite:///$db"); [ $HAVE_MLFLOW = 0 ] && emf=("mlflow.enabled=false")
      echo "== $(date +%T) mqar eval of $ck" >> "$log"
      timeout --signal=INT --kill-after=15 "$left" "$PY" -m falcon_lab.evaluate "ckpt=$ck" "suites=[mqar]" \
        "mqar.grid=$MQAR_GRID" "mqar.n_examples=$MQAR_N" "out_dir=$rd/eval" "${emf[@]}" >> "$log" 2>&1; rc=$?
      echo "eval_rc=$rc" >> "$rd/rc"
    fi
    [ $rc = 0 ] && touch "$rd/done"
  ) &
}

pack() {  # small files only: no checkpoints
  (cd "$WORK" && find ml runs logs block.log gpu.csv summary.csv summary.json status.tsv -type f \
      ! -name '*.ckpt' ! -path '*/checkpoints/*' ! -path '*/.hydra/*' 2>/dev/null) > "$WORK/.packlist"
  tar czf "$RESULTS" -C "$WORK" -T "$WORK/.packlist"
  # a larger archive goes back in parts (join: `cat ablation_bN.tgz.part* | tar xz`); block 9's 23 MB archive was
  # left out whole by the device tool (2026-12-02)
  split_for_device "$RESULTS" "${RESULTS_MAX_BYTES:-15728640}"
}

# ---- schedule: PAR at a time, nothing new after DEADLINE_S --------------------------------------------------
# A run that dies of a CUDA out-of-memory error (its last attempt's log says so) is queued again, at the end,
# up to OOM_RETRIES times; on a GPU no run starts while less than GPU_MIN_FREE_MIB is free (block 6 lost three
# Falcon-3 starts to OOM at 14 runs at once). Both are ours.
OOM_RETRIES=${OOM_RETRIES:-1}; POLL_S=${POLL_S:-5}
if [ "$SMOKE" != 1 ] && command -v nvidia-smi >/dev/null 2>&1; then GPU_MIN_FREE_MIB=${GPU_MIN_FREE_MIB:-16000}; else GPU_MIN_FREE_MIB=${GPU_MIN_FREE_MIB:-0}; fi
gpu_room() {  # is there GPU_MIN_FREE_MIB free on the GPU (always, when the gate is off)?
  [ "$GPU_MIN_FREE_MIB" -le 0 ] && return 0
  local free; free=$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits 2>/dev/null | head -n 1)
  [ -z "$free" ] || [ "$free" -ge "$GPU_MIN_FREE_MIB" ]
}
oom_last_attempt() {  # did the last attempt of run INDEX end in a CUDA out-of-memory error?
  awk '/^== /{b=""} {b=b $0 "\n"} END{printf "%s", b}' "$WORK/logs/${names[$1]}.log" 2>/dev/null |
    grep -q "OutOfMemoryError\|CUDA out of memory"
}
declare -A pid_of=() tries=()
queue=("${!names[@]}"); n=0; waited=0
while :; do
  for i in "${!pid_of[@]}"; do kill -0 "${pid_of[$i]}" 2>/dev/null || { wait "${pid_of[$i]}" 2>/dev/null; unset "pid_of[$i]";
    say "${names[$i]} ended: $(tr '\n' ' ' < "$WORK/runs/${names[$i]}/rc" 2>/dev/null)$( [ -f "$WORK/runs/${names[$i]}/done" ] && echo done || echo NOT-done)"
    if [ ! -f "$WORK/runs/${names[$i]}/done" ] && [ "${tries[$i]}" -le "$OOM_RETRIES" ] && oom_last_attempt "$i"; then
      queue+=("$i"); say "${names[$i]} ran out of GPU memory: queued again (attempt ${tries[$i]} of $((OOM_RETRIES + 1)))"; fi; }; done
  while [ ${#pid_of[@]} -lt "$PAR" ] && [ ${#queue[@]} -gt 0 ] && [ "$(el)" -lt "$DEADLINE_S" ]; do
    i=${queue[0]}
    if [ -f "$WORK/runs/${names[$i]}/done" ]; then say "${names[$i]} already done"; queue=("${queue[@]:1}"); continue; fi
    if ! gpu_room; then
      [ $((waited % 12)) -eq 0 ] && say "waiting for GPU memory (< $GPU_MIN_FREE_MIB MiB free) before ${names[$i]}"
      waited=$((waited + 1)); break; fi
    queue=("${queue[@]:1}"); tries[$i]=$(( ${tries[$i]:-0} + 1 ))
    launch "$i"; pid_of[$i]=$!; say "started ${names[$i]} (pid ${pid_of[$i]})"
    sleep "${STAGGER_S:-2}"
  done
  [ ${#pid_of[@]} -eq 0 ] && { [ ${#queue[@]} -eq 0 ] || [ "$(el)" -ge "$DEADLINE_S" ]; } && break
  sleep "$POLL_S"; n=$((n + 1))
  if [ $((n % 12)) -eq 0 ]; then  # every 12 polls (a minute by default): the last logged step of each running arm
    line="running:"; for i in "${!pid_of[@]}"; do
      s=$(tail -n 1 "$WORK/runs/${names[$i]}/metrics.jsonl" 2>/dev/null | sed -n 's/.*"step": \([0-9]*\).*/\1/p')
      line+=" ${names[$i]}@${s:--}"; done; say "$line"
  fi
done
[ ${#queue[@]} -gt 0 ] && say "deadline: ${#queue[@]} arm(s) not started"

# ---- status + summary, then pack ----------------------------------------------------------------------------
{ printf 'name\tstate\trc\n'
  for nm in "${names[@]}"; do
    st=pending; [ -f "$WORK/runs/$nm/rc" ] && st=stopped; [ -f "$WORK/runs/$nm/done" ] && st=done
    printf '%s\t%s\t%s\n' "$nm" "$st" "$(tr '\n' ' ' < "$WORK/runs/$nm/rc" 2>/dev/null)"
  done; } > "$WORK/status.tsv"
"$PY" "$HERE/summarize.py" "$WORK" "${names[@]}" 2>&1 | tail -n 40 | tee -a "$WORK/block.log"
pack
say "done: $(grep -c $'\tdone\t' "$WORK/status.tsv") of ${#names[@]} arms finished; packed $(wc -l < "$WORK/.packlist") files into $RESULTS ($(du -ch "$RESULTS"* | tail -n 1 | cut -f1)$([ -f "$RESULTS" ] || echo ", in parts"))"
