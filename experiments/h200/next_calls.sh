# The next H200 session's check and A/B lists for prove_kernels.sh, spelled out once here (a device command is at most
# 2000 characters; sixteen spelled-out checks are about 1800). Source it with the call's name, then run the prover:
#
#   . experiments/h200/next_calls.sh call1 && PROVE_PARALLEL=1 PROVE_CHECK_S=330 PROVE_DEADLINE_S=480 \
#       bash experiments/h200/prove_kernels.sh > $OUT/prove_stdout.log 2>&1
#
# call1: the check sweeps (one process each, rows 1-15 / 16-29) of every opt-in form written without a GPU
#        (twenty-second and twenty-third sessions, experiments/h200/NEXT.md): Falcon-2A's / -2's fused backward intra
#        pass with the folded forward inter term (fa*, fb*), the product inverses (pr*), the linear split (sp*), the
#        delta split (ds*). STEPS="" (no other step beside them).
# call2: the A/Bs of the same forms, alone on the GPU (AB_REPS=2).
# call4: the dU dtype and gate fold checks (Falcon-1, -1A, -3), Falcon-3's lean form's (ln*) and its prep's gates from
#        the statistic (gs1: the fused-prep rows 23-29), then their A/Bs (the lean form's: time and peak, against
#        Falcon-1 in the same process).
# srows: Falcon-3's step rows (chunk.py STEP_ROWS, twenty-fourth session): its check sweep in two halves (sr1, sr2),
#        then the A/B against the pseudo-token rows (Falcon-1 in the same process as the ratio's base).
# Each sets STEPS, XCHECKS, ABS, AB_REPS (exported); the set-up (device_env.sh, the mlflow folders moved aside) is the
# caller's.

_u="FALCON_TRITON_UNPROVEN=1"
_f2="FALCON_TRITON_2A_BWD_INTRA=fused FALCON_TRITON_2A_FWD_INTER=fold $_u"
_pr="FALCON_TRITON_A_INV=prod $_u"
_sp="FALCON_TRITON_LINEAR_SPLIT=on FALCON_TRITON_LINEAR_SPLIT_LEN=4 $_u"
_ds="FALCON_TRITON_DELTA_SPLIT=on FALCON_TRITON_DELTA_SPLIT_LEN=2 $_u"
_dg="FALCON_TRITON_DU_DTYPE=input FALCON_TRITON_GATE_FOLD=on $_u"
_ln="FALCON_TRITON_3_LEAN=on $_u"
_gs="FALCON_TRITON_3_PREP_GATES=stat $_u"

_halves() {  # name prefix, env, variants (one each) -> "p1|env|v|1-15;p2|env|v|16-29;..." (numbered from 1)
  local p=$1 e=$2 i=0 v out=""
  shift 2
  for v in "$@"; do
    i=$((i + 1)); out="$out${p}$i|$e|$v|1-15;"
    i=$((i + 1)); out="$out${p}$i|$e|$v|16-29;"
  done
  printf '%s' "${out%;}"
}

case "${1:-}" in
  call1)
    export STEPS="" AB_REPS=2 ABS=""
    XCHECKS="$(_halves fa "$_f2" 2A);$(_halves fb "$_f2" 2);$(_halves pr "$_pr" 1 3)"
    export XCHECKS="$XCHECKS;$(_halves sp "$_sp" 1A 3A);$(_halves ds "$_ds" 1 3)"
    ;;
  call2)
    export STEPS="" AB_REPS=2 XCHECKS=""
    ABS="f2a|percol.BWD_INTRA=split,fused percol.FWD_INTER=kernel,fold|falcon-2A,falcon-2||_pc_"
    ABS="$ABS;ainv|chunk.A_INV=subst,prod|falcon-1,falcon-3||_fwd_prep"
    ABS="$ABS;split|state_split.LINEAR_SPLIT=off,on|falcon-1A,falcon-3A,falcon-2A|1,2|_state|_split"
    export ABS="$ABS;dsplit|delta_split.DELTA_SPLIT=off,on|falcon-1,falcon-3|1,2|_state|_dsplit"
    ;;
  call4)
    export STEPS="" AB_REPS=2
    export XCHECKS="$(_halves dg "$_dg" 1 1A 3);$(_halves ln "$_ln" 3);gs1|$_gs|3|23-29"
    ABS="du|chunk.DU_DTYPE=fp32,input|falcon-1,falcon-1A,falcon-3||"
    ABS="$ABS;gate|chunk.GATE_FOLD=off,on|falcon-1,falcon-1A,falcon-3A|0,2|"
    ABS="$ABS;lean|lean.LEAN=off,on|falcon-1,falcon-3||"
    export ABS="$ABS;gates3|prep_window.GATES=recompute,stat|falcon-3||_win_bwd_gates"
    ;;
  srows)  # twenty-fourth session: Falcon-3's step rows (FALCON_TRITON_3_STEP_ROWS=on): its sweep, then its A/B
    export STEPS="" AB_REPS=2
    export XCHECKS="$(_halves sr "FALCON_TRITON_3_STEP_ROWS=on $_u" 3)"
    export ABS="srows|chunk.STEP_ROWS=off,on|falcon-1,falcon-3||_fwd_out|_bwd_dul|_bwd_cc|_bwd_dqdx"
    ;;
  *)
    echo "usage: . experiments/h200/next_calls.sh call1|call2|call4|srows" >&2
    return 2 2>/dev/null || exit 2
    ;;
esac
