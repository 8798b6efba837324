#!/usr/bin/env bash
# The next H200 session's kernel proofs and timings (issues 14 and 15), each step in its own process (a kernel fault
# poisons the CUDA context) with a timeout cut to end by PROVE_DEADLINE_S + 30. On the GPU machine, from the repo root:
#   . experiments/h200/device_env.sh > $OUT/env.log 2>&1; STEPS="f2 f2_warps4 banded" PROVE_DEADLINE_S=480 \
#     bash experiments/h200/prove_kernels.sh          # call 1 (~8 min)
#   STEPS="kernels" PROVE_DEADLINE_S=500 bash experiments/h200/prove_kernels.sh     # call 2 (timings)
# Steps:
#   f2         Falcon-2's full `bench check --variants 2` (fp32 rows, public op, CUDA-graph decode), alone on the GPU:
#              with every row passing, add "2" to PROVEN_CHUNK (falcon_lab/kernels/triton/__init__.py);
#   f2_warps4  control: the old 4-warp launch of _pcd_bwd_state on the row that crashed, expected to crash (exit 3);
#   banded     FALCON_TRITON_3A=banded `bench check --variants 3A,1A,3`: the one-scan Falcon-3A kernel's core rows
#              and public op, plus the CUDA-graph decode rows of 1A, 3 (mu_t without cuSOLVER) and 3A, so that
#              PROVEN_DECODE can grow (banded is the default since 2026-12-03; the variable pins it);
#   kernels    `bench kernels` for the Falcon ops incl. falcon-3A (the banded default) beside falcon-3A-scans (its W
#              scans) and SDPA (a partial run: kernels_h200_partial.*), FALCON_TRITON_UNPROVEN=1 so that Falcon-2 is
#              timed;
#   prep       `bench check --quick --variants 1,1A,2A,3A,3 --rows 1-60` with FALCON_TRITON_UNPROVEN=1: the window-1
#              fused prep (its IR changed since 9549d0c: benchmarks/results/ptx_fingerprints/) and Falcon-3A's fused
#              prep through the public-op rows; all pass -> "3A" into PROVEN_PREP;
#   f3gather   Falcon-3 with its pseudo-tokens read in place (FALCON_TRITON_3=gather): `bench check --variants 3`, then
#              `bench kernels --ops falcon-3` with and without it (peak memory and time, one process each);
#   host       experiments/h200/host_bound.py (host submit time against GPU busy time per op);
#   varlen     native packed sequences (the chunk kernels read cu_seqlens, window 1): `bench check --variants
#              1,1A,2A,2,3A --kinds varlen-native` (float64 reference, bf16 and fp32, C = 16 and 64; a variant whose rows
#              all pass goes into PROVEN_VARLEN, Falcon-2 once its chunk kernels are proven too), then experiments/h200/varlen_bench.py (native against padded, fwd+bwd time and peak);
#   f2a_blocked  FALCON_TRITON_2A=blocked (Falcon-2A / -2 intra-chunk term by 16-row sub-blocks, tensor-core dots below
#              the diagonal): `bench check --variants 2A,2` with it, then `bench kernels --ops falcon-1,falcon-2A,falcon-2`
#              with and without it (one process each); all 2A rows pass and it is faster -> make it the default;
#   sweep      `bench check --variants V` for each of the six, whole default sweeps, one process each;
#   statebv    FALCON_TRITON_STATE_BV=auto (smaller value tiles in the state passes where they run few programs):
#              `bench check --quick` of 1, 1A, 3A, 3 with it, then `bench kernels` of falcon-1, -1A, -3A without and
#              with it (one process each): faster at (4, 8192, 12, 64) and (1, 32768, 6, 128) -> make it the default;
#   f2torch    `bench kernels --quick` of Falcon-2 and -2A against the PyTorch chunk forms the Triton kernels replaced
#              as the CUDA default (Falcon-2 since 2026-12-02), one process;
#   f2solve    Falcon-2's solves by 16-row sub-blocks (percol_delta.py): `bench check --variants 2` with
#              FALCON_TRITON_2_SOLVE=fwd FALCON_TRITON_2_BWD_SOLVE=blocked, then `bench kernels --ops falcon-1,falcon-2`
#              for each SOLVE:BWD_SOLVE pair of F2_MODES (default "rows:exact fwd:blocked"), one process each;
#   f2iso      experiments/h200/f2_isolate.sh: the blocked ways one at a time on Falcon-2's rows that failed;
#   f2blk      Falcon-2's whole sweep with both passes by blocks (FALCON_TRITON_2_BLK_BWD=$F2_BLK, default 4,0,x32);
#   switch_ab  experiments/h200/switch_ab.py: a switch's values (AB_SWITCH) timed interleaved in one process;
#   XCHECKS    (a variable, not a step) row ranges of any check under given switches, one process each (below);
#   ainput     A stored in the inputs' dtype (FALCON_TRITON_A_DTYPE=input): sweeps of 1 and 3, then timed vs fp32;
#   f3gather_rest  rows 24-29 of Falcon-3-gather's sweep;
#   stages     chunk.py's state passes at FALCON_TRITON_STATE_STAGES=$STAGES_TRY (default 4): quick rows, then timings;
#   eig        Falcon-3's mu_t squarings in one Triton kernel (triton/eig.py): rows 23-29 of `bench check --variants 3`
#              (the public op, decode, varlen-native: the rows whose prep runs it) with FALCON_TRITON_UNPROVEN=1, then
#              `bench kernels --quick --ops falcon-3` with the PyTorch squarings (FALCON_TRITON_PREP=torch) and with it;
#   f3prep     Falcon-3's fused prep (prep_window.py with eig: the Gram, mu_t and the gates in Triton): rows 23-29 of
#              `bench check --variants 3` with FALCON_TRITON_UNPROVEN=1, then `bench kernels --quick --ops
#              falcon-1,falcon-3` with the proven default (PyTorch prep + eig.py) and with it;
#   fla_warm   experiments/h200/fla_warm.py with TRITON_CACHE_AUTOTUNING=1 and TRITON_CACHE_DIR=$TC (below): fla's
#              autotuning cached (the *.autotune.json files are packed) so the next call's default `bench kernels`
#              fits its 10 minutes.
# The sixth session's plan (experiments/h200/NEXT.md): call 1 STEPS="f2 prep banded", call 2 STEPS="f3gather fla_warm
# host".
# Everything lands in $OUT/prove.tgz (split into .part00... over 15 MiB: the device tool returns files <= 16 MiB);
# summary.txt has one line per step with its exit code.
set -u
W=${PROVE_WORK:-/tmp/prove}; mkdir -p "$W"
# The Triton cache of the steps that name one (warm, kernels_full, timings): machine-local, seeded from the carried
# .tcache (fla's autotuning). A call that carries .tcache replaces it on the machine, so on 2026-12-03 (thirteenth
# session) a full run after a warm call compiled everything again and ran out of time; /tmp keeps between calls.
export TC=${PROVE_TCACHE:-/tmp/falcon_tcache}; mkdir -p "$TC"; [ -d .tcache ] && cp -rn .tcache/. "$TC/"
DL=${PROVE_DEADLINE_S:-480}
# The device tool stops a command at 600 s, set-up (device_env.sh, ~20 s) and packing included, and then nothing comes
# back: on 2026-12-03 a deadline of 545 (+30 s of grace for the last step) lost a whole call's results. Capped here.
if [ "$DL" -gt 515 ]; then echo "PROVE_DEADLINE_S=$DL capped at 515 (the device tool's 600 s)" >&2; DL=515; fi
# Unset: the old default steps; set but empty (STEPS="", e.g. with XCHECKS alone): none (on 2026-12-03, fifteenth
# session, STEPS="" ran the defaults beside the XCHECKS: ${STEPS:-...} treated empty as unset)
STEPS=${STEPS-"f2 f2_warps4 banded"}
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
want() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 to=$2; shift 2
  want "$name" || return 0
  if [ "$(el)" -ge "$DL" ]; then echo "$name skipped (deadline)" >> "$W/summary.txt"; return; fi
  local cap=$(( DL + 30 - $(el) )); [ "$to" -gt "$cap" ] && to=$cap
  echo "== +$(el)s $name (timeout ${to}s): $*" >> "$W/summary.txt"
  timeout --kill-after=10 "$to" "$@" > "$W/$name.log" 2>&1
  echo "$name rc=$? +$(el)s" >> "$W/summary.txt"
}
# cstep: a correctness-only step (bench check). With PROVE_PARALLEL=1 these all start together in the background,
# capped at PROVE_CHECK_S (they compile on separate CPU cores and their small kernels barely load the GPU), and the
# timing steps after `wait` run one at a time, alone on the GPU. Without it, cstep is step. warm_bg (the compiles
# beside the checks) keeps its own cap: at PROVE_CHECK_S=200 it was cut short (2026-12-04, eighteenth session).
PAR=${PROVE_PARALLEL:-0}
CHK=${PROVE_CHECK_S:-360}
cstep() {
  if [ "$PAR" = 1 ]; then
    local name=$1 to=$2; shift 2; want "$name" || return 0
    [ "$name" != warm_bg ] && [ "$to" -gt "$CHK" ] && to=$CHK
    step "$name" "$to" "$@" &
  else step "$@"; fi
}
nvidia-smi > "$W/nvidia-smi.txt" 2>&1
cstep f2 300 env FALCON_TRITON_UNPROVEN=1 python3 -m falcon_lab.bench check --variants 2 --out "$W/check_f2"
cstep f2_warps4 120 env FALCON_TRITON_UNPROVEN=1 python3 experiments/h200/falcon2_crash.py --dtype bfloat16 \
  --state-warps 4 --json "$W/f2_warps4.json"
cstep banded 360 env FALCON_TRITON_3A=banded FALCON_TRITON_UNPROVEN=1 python3 -m falcon_lab.bench check \
  --variants 3A,1A,3 --out "$W/check_3a_banded"
cstep prep 300 env FALCON_TRITON_UNPROVEN=1 python3 -m falcon_lab.bench check --quick --variants 1,1A,2A,3A,3 \
  --rows 1-60 --out "$W/check_prep"
want f3gather && STEPS="$STEPS f3gather_check f3gather_time"
want varlen && STEPS="$STEPS varlen_check varlen_time"
want f2a_blocked && STEPS="$STEPS f2a_check f2a_time"
# sweep: every variant's whole default check, one process per variant (with PROVE_PARALLEL=1 all at once): the
# re-proof after a change to shared code (e.g. c69b041's "ieee" dots for fp32 tiles <= 16); sweep_3A's core rows run
# the banded scan (the default since 2026-12-03), its varlen-native rows the W scans (packed calls always do)
want sweep && STEPS="$STEPS sweep_1 sweep_1A sweep_2A sweep_2 sweep_3 sweep_3A"
for v in 1 1A 2A 2 3 3A; do
  cstep "sweep_$v" 330 env FALCON_TRITON_UNPROVEN=1 python3 -m falcon_lab.bench check --variants "$v" \
    --out "$W/check_sweep_$v"
done
want statebv && STEPS="$STEPS statebv_check statebv_time"
cstep statebv_check 300 env FALCON_TRITON_STATE_BV=auto FALCON_TRITON_UNPROVEN=1 python3 -m falcon_lab.bench check \
  --variants 1,1A,3A,3 --quick --out "$W/check_statebv"
cstep f3gather_check 300 env FALCON_TRITON_3=gather FALCON_TRITON_UNPROVEN=1 python3 -m falcon_lab.bench check \
  --variants 3 --out "$W/check_f3gather"
cstep varlen_check 240 env FALCON_TRITON_UNPROVEN=1 python3 -m falcon_lab.bench check --variants 1,1A,2A,2,3A,3 \
  --kinds varlen-native --out "$W/check_varlen"
cstep f2a_check 300 env FALCON_TRITON_2A=blocked FALCON_TRITON_UNPROVEN=1 python3 -m falcon_lab.bench check \
  --variants 2A,2 --quick --out "$W/check_2a_blocked"
# The ninth session's call 2 (2026-12-03): what the whole sweeps of call 1 did not reach within their cap
cstep f3varlen 240 env FALCON_TRITON_UNPROVEN=1 python3 -m falcon_lab.bench check --variants 3 --kinds varlen-native \
  --out "$W/check_f3varlen"
cstep varlen3a 240 env FALCON_TRITON_UNPROVEN=1 python3 -m falcon_lab.bench check --variants 3A --kinds varlen-native \
  --out "$W/check_varlen3a"
# Falcon-3A's public-op rows padded, so that its fused windowed prep (prep_window.py) prepares them (the packed path
# uses the PyTorch prep): the proof PROVEN_PREP "3A" waits for
cstep prep3a 240 env FALCON_TRITON_VARLEN=pad FALCON_TRITON_UNPROVEN=1 python3 -m falcon_lab.bench check \
  --variants 3A --kinds api-varlen-continuation --out "$W/check_prep3a"
cstep banded_api 240 env FALCON_TRITON_3A=banded FALCON_TRITON_UNPROVEN=1 python3 -m falcon_lab.bench check \
  --variants 3A --kinds api-varlen-continuation,decode-cuda-graph --out "$W/check_banded_api"
# Falcon-2's solves by 16-row sub-blocks (percol_delta.py, opt-in since 2026-12-03): f2solve_check, the whole
# sweep with the candidate pair (the forward state pass by blocks, FALCON_TRITON_2_SOLVE=fwd, and the solve's
# gradients by blocks, FALCON_TRITON_2_BWD_SOLVE=blocked; both passed the rows tried at 5e0a3b1, the reverse state pass
# by blocks did not); f2solve_time: `bench kernels` of falcon-1, -2 for each SOLVE:BWD_SOLVE pair of F2_MODES.
# Falcon-3-gather's rows the earlier calls did not reach: f3gather_rest
want f2solve && STEPS="$STEPS f2solve_check f2solve_time"
cstep f2solve_check 330 env FALCON_TRITON_2_SOLVE=fwd FALCON_TRITON_2_BWD_SOLVE=blocked python3 -m falcon_lab.bench \
  check --variants 2 --out "$W/check_f2solve"
cstep f3gather_rest 240 env FALCON_TRITON_3=gather FALCON_TRITON_UNPROVEN=1 python3 -m falcon_lab.bench check \
  --variants 3 --rows 24-29 --out "$W/check_f3gather_rest"
# Falcon-3's mu_t squarings in one Triton kernel (triton/eig.py, FALCON_TRITON_UNPROVEN=1 turns it on): the rows of
# Falcon-3's sweep that run the prep (public op, decode, varlen-native)
want eig && STEPS="$STEPS eig_check eig_time"
cstep eig_check 240 env FALCON_TRITON_UNPROVEN=1 python3 -m falcon_lab.bench check --variants 3 --rows 23-29 \
  --out "$W/check_eig"
# Falcon-3's fused prep (prep_window.py with eig; FALCON_TRITON_UNPROVEN=1 turns it on for unpacked calls): the same
# rows; all pass -> "3" into PROVEN_PREP
# f2iso: Falcon-2's blocked solves one way at a time on the rows that failed (experiments/h200/f2_isolate.sh: the
# candidate pair, and the failing reverse pass at other warps / value tiles, compute-sanitizer on what fails);
# warm_bg: the warm step's compiles in the background beside the checks
cstep f2iso 330 bash experiments/h200/f2_isolate.sh "$W/f2iso"
# f2blk: Falcon-2's whole sweep with both passes by sub-blocks and the reverse pass's launch F2_BLK (default "4,0,x32":
# every dot of it on fp32 operands, written 2026-12-03 after that day's calls) — run it once an f2iso way passes its
# six rows; then time it with F2_MODES="fwd:blocked blocked:blocked" and FALCON_TRITON_2_BLK_BWD,
# FALCON_TRITON_UNPROVEN=1 exported (step f2solve_time)
cstep f2blk 330 env FALCON_TRITON_2_SOLVE=blocked FALCON_TRITON_2_BLK_BWD=${F2_BLK:-4,0,x32} FALCON_TRITON_UNPROVEN=1 \
  python3 -m falcon_lab.bench check --variants 2 --out "$W/check_f2blk"
# ainput's checks (its timing, ainput_time, below): Falcon-1's and -3's whole sweeps with A in the inputs' dtype
want ainput && STEPS="$STEPS ainput_1 ainput_3 ainput_time"
for v in 1 3; do
  cstep "ainput_$v" 330 env FALCON_TRITON_A_DTYPE=input python3 -m falcon_lab.bench check --variants "$v" \
    --out "$W/check_ainput_$v"
done
# stages: chunk.py's state passes at FALCON_TRITON_STATE_STAGES=$STAGES_TRY (default 4; "" is Triton's 3 for 16-bit):
# quick rows of 1 and 1A with it, then falcon-1, -1A and fla timed with the default and with it (one process each)
SGT=${STAGES_TRY:-4}
want stages && STEPS="$STEPS stages_check stages_time"
cstep stages_check 300 env FALCON_TRITON_STATE_STAGES=$SGT python3 -m falcon_lab.bench check --quick --variants 1,1A \
  --out "$W/check_stages_$SGT"
# xcheck: row ranges of any check under given switches, one process each (what an earlier call's capped check did not
# reach, or one sweep split in two): XCHECKS="name|VAR=v VAR2=v|variants|rows;..." -> steps x_<name> (written
# 2026-12-03, fourteenth session: call 1's four parallel sweeps stopped at rows 20-23 at their 300 s cap)
if [ -n "${XCHECKS:-}" ]; then
  IFS=';' read -ra _xs <<< "$XCHECKS"
  for _x in "${_xs[@]}"; do
    IFS='|' read -r _xn _xe _xv _xr <<< "$_x"
    STEPS="$STEPS x_$_xn"
    # shellcheck disable=SC2086  # _xe: several VAR=v words
    cstep "x_$_xn" 330 env $_xe python3 -m falcon_lab.bench check --variants "$_xv" --rows "$_xr" \
      --out "$W/check_x_$_xn"
  done
fi
warm_cmd() {
  python3 -c 'from falcon_lab.benchmarking.kernels import OPS, SHAPES
for o in OPS:
    for i in range(len(SHAPES)): print(o, i)' | xargs -P "${WARM_P:-12}" -n 2 sh -c 'TRITON_CACHE_AUTOTUNING=1 \
  TRITON_CACHE_DIR=$TC python3 -m falcon_lab.bench kernels --warm --ops $0 \
  --shapes $1 2>&1 | tail -2'
}
export -f warm_cmd
cstep warm_bg 330 bash -c warm_cmd
want f3prep && STEPS="$STEPS f3prep_check f3prep_time"
cstep f3prep_check 240 env FALCON_TRITON_UNPROVEN=1 python3 -m falcon_lab.bench check --variants 3 --rows 23-29 \
  --out "$W/check_f3prep"
wait
# timing steps, alone on the GPU
step f3prep_time 150 bash -c "python3 -m falcon_lab.bench kernels --quick --ops falcon-1,falcon-3 \
  --out $W/kernels_f3prep_eig; FALCON_TRITON_UNPROVEN=1 python3 -m falcon_lab.bench kernels --quick --ops \
  falcon-1,falcon-3 --out $W/kernels_f3prep_fused"
step f2solve_time 300 bash -c "for m in \${F2_MODES:-rows:exact fwd:blocked}; do FALCON_TRITON_2_SOLVE=\${m%:*} \
  FALCON_TRITON_2_BWD_SOLVE=\${m#*:} python3 -m falcon_lab.bench kernels --ops \${F2_OPS:-falcon-1,falcon-2} \
  --out $W/kernels_f2solve_\${m%:*}_\${m#*:}; done"
step stages_time 240 bash -c "for m in default $SGT; do FALCON_TRITON_STATE_STAGES=\$([ \$m = default ] || echo \$m) \
  TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=$TC python3 -m falcon_lab.bench kernels --ops \
  falcon-1,falcon-1A,fla_chunk_delta_rule --out $W/kernels_stages_\$m; done"
# ainput: the triangular inverse A stored in the inputs' dtype (FALCON_TRITON_A_DTYPE=input, opt-in since 2026-12-03,
# thirteenth session): the whole sweeps of Falcon-1 and -3 (the families that store A) with it, then both values timed
# in one process (switch_ab.py: GPU time, peak) for falcon-1 and falcon-3 (the checks are above, before `wait`)
step ainput_time 300 env TRITON_CACHE_DIR="$TC" python3 experiments/h200/switch_ab.py --switch \
  chunk.A_DTYPE=fp32,input --ops falcon-1,falcon-3 --reps 2 --out "$W/switch_ab_ainput"
# switch_ab: a kernel switch's values timed in one process, interleaved (experiments/h200/switch_ab.py; GPU time from
# the profiler, do_bench, host time, peak): AB_SWITCH (default chunk.A_DTYPE=input,fp32; several, space-separated:
# every combination), AB_OPS, AB_SHAPES, AB_REPS, AB_KERNELS (a regex: those kernels' device time too), AB_ENV (VAR=v
# words for its process: e.g. FALCON_TRITON_UNPROVEN=1 for an unproven value)
AB_ARGS=(); for _s in ${AB_SWITCH:-chunk.A_DTYPE=input,fp32}; do AB_ARGS+=(--switch "$_s"); done
step switch_ab 300 env ${AB_ENV:-} TRITON_CACHE_DIR="$TC" python3 experiments/h200/switch_ab.py "${AB_ARGS[@]}" \
  --ops "${AB_OPS:-falcon-1,falcon-3}" --shapes "${AB_SHAPES:-0,1,2,3}" --reps "${AB_REPS:-3}" \
  ${AB_KERNELS:+--kernels "$AB_KERNELS"} --out "$W/switch_ab"
# ABS (a variable, not a step; 2026-12-04, twenty-second session): several A/Bs in one call, each its own timed step
# ab_<name> after the checks, one process each: ABS="name|MOD.ATTR=v1,v2 [MOD2.ATTR2=w1,w2]|ops|shapes|kernel regex;..."
# (empty shapes: all four; empty regex: none), with AB_REPS rounds and FALCON_TRITON_UNPROVEN=1 (the values under test
# are unproven until their checks pass; read the checks' verdicts before the timings)
if [ -n "${ABS:-}" ]; then
  IFS=';' read -ra _abs <<< "$ABS"
  for _a in "${_abs[@]}"; do
    IFS='|' read -r _an _asw _aops _ash _akr <<< "$_a"
    STEPS="$STEPS ab_$_an"
    _aargs=(); for _s in $_asw; do _aargs+=(--switch "$_s"); done
    step "ab_$_an" 300 env FALCON_TRITON_UNPROVEN=1 TRITON_CACHE_DIR="$TC" python3 experiments/h200/switch_ab.py \
      "${_aargs[@]}" --ops "$_aops" --shapes "${_ash:-0,1,2,3}" --reps "${AB_REPS:-2}" ${_akr:+--kernels "$_akr"} \
      --out "$W/ab_$_an"
  done
fi
# warm: compile every (op, shape) of the full run first, one process each, 12 at a time, into the shared $TC (on
# a fresh machine the full run alone spent its 440 s mostly compiling, fla's kernels above all: 2026-12-03 call 2)
step warm 240 bash -c warm_cmd
# kernels_full: the default `bench kernels` (every op, the four shapes, fla at each; fla's autotuning from .tcache);
# no FALCON_TRITON_UNPROVEN since every variant's kernels are proven (it would time Falcon-3's unproven fused prep)
step kernels_full 440 env TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR="$TC" \
  python3 -m falcon_lab.bench kernels --out "$W/kernels_full"
# profile1: Falcon-1 and fla's chunk_delta_rule at the four shapes with torch.profiler tables (where F1 loses to fla)
step profile1 300 env TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR="$TC" \
  python3 -m falcon_lab.bench kernels --ops ${PROFILE_OPS:-falcon-1,fla_chunk_delta_rule} --shapes ${PROFILE_SHAPES:-0,1,2,3} \
  --profile --out "$W/profile1"
step kernels 480 env FALCON_TRITON_UNPROVEN=1 python3 -m falcon_lab.bench kernels --out "$W/kernels" \
  --ops falcon-1,falcon-1A,falcon-2,falcon-3,falcon-3A,falcon-3A-scans,falcon-2A,sdpa_flash
step eig_time 150 bash -c "FALCON_TRITON_PREP=torch python3 -m falcon_lab.bench kernels --quick --ops falcon-3 \
  --out $W/kernels_eig_torch; FALCON_TRITON_UNPROVEN=1 python3 -m falcon_lab.bench kernels --quick --ops falcon-3 \
  --out $W/kernels_eig_triton"
step f2a_time 240 bash -c "for m in exact blocked; do FALCON_TRITON_2A=\$m FALCON_TRITON_UNPROVEN=1 python3 -m \
  falcon_lab.bench kernels --ops \${F2A_OPS:-falcon-1,falcon-2A,falcon-2} --out $W/kernels_2a_\$m; done"
step statebv_time 240 bash -c "for m in off auto; do FALCON_TRITON_STATE_BV=\$m \
  python3 -m falcon_lab.bench kernels --ops falcon-1,falcon-1A,falcon-3A --out $W/kernels_statebv_\$m; done"
step varlen_time 150 env FALCON_TRITON_UNPROVEN=1 python3 experiments/h200/varlen_bench.py --out "$W/varlen_bench"
# varlen3a_ab: packed Falcon-3A on the banded scan against the delayed form (FALCON_TRITON_3A_PACKED), one process
# each, same batch (2026-12-04, twenty-first session: the delayed packed form's timing before it may be the default)
step varlen3a_ab 240 bash -c "for m in banded delayed; do FALCON_TRITON_3A_PACKED=\$m FALCON_TRITON_UNPROVEN=1 \
  python3 experiments/h200/varlen_bench.py --variants 3A,1A --out $W/varlen3a_\$m; done"
step f3gather_time 200 bash -c "for m in expand gather; do FALCON_TRITON_3=\$m python3 -m falcon_lab.bench \
  kernels --ops ${F3G_OPS:-falcon-3,falcon-1} --out $W/kernels_f3_\$m; done"
step f2torch 150 python3 -m falcon_lab.bench kernels --quick --out "$W/kernels_f2torch" \
  --ops falcon-2,torch_chunk_falcon-2,falcon-2A,torch_chunk_falcon-2A
step host 240 env FALCON_TRITON_UNPROVEN=1 python3 experiments/h200/host_bound.py --out "$W/host_bound"
# host_profile: cProfile of back-to-back fwd+bwd calls (experiments/h200/host_profile.py): where the host time of the
# host-bound small-shape ops goes (HP_OPS, default falcon-1A,falcon-1; HP_SHAPE, default 0)
step host_profile 120 python3 experiments/h200/host_profile.py --ops "${HP_OPS:-falcon-1A,falcon-1}" \
  --shape "${HP_SHAPE:-0}" --out "$W/host_profile"
step fla_warm 420 env TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR="$TC" python3 experiments/h200/fla_warm.py
case " $STEPS " in *" fla_warm "*) (cd "$TC" && find . -name "*.autotune.json" | \
  tar czf "$W/fla_autotune.tgz" --transform "s,^\./,.tcache/," -T -) ;;
esac
R=${PROVE_RESULTS:-${OUT:?}/prove.tgz}
tar czf "$R" -C "$W" .
. "$(dirname "$0")/device_files.sh" && split_for_device "$R"
echo "prove steps [$STEPS] packed after $(el)s"
