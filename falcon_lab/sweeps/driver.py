"""The sweep driver: prepare a study once, run worker loops (ask -> train -> tell), finalize.

Flow of ``python -m falcon_lab.sweep ablation=NAME workers=N``:

1. :func:`~falcon_lab.sweeps.context.prepare` (main process, once): load and check the search space
   (every searched key must exist in the composed fit config), create or load the Optuna study in its
   storage (``load_if_exists``), create the MLflow store and the study's parent run. Nothing here
   races: it happens before any worker starts.
2. :func:`worker_loop` (in-process for ``workers=1``, else N processes, one per GPU): fail stale
   trials and re-enqueue them, stop when COMPLETE + PRUNED reaches the budget, else ask a trial,
   train it and tell the outcome (:func:`~falcon_lab.sweeps.trial.run_trial`: in-process, or as a
   separate job for multi-GPU trials).
3. :func:`finalize` (main process): parent run gets best value/params, table and plots.

Every trial is one ``falcon_lab.training.run``; the Optuna loop never lives inside a DDP process
tree: a multi-GPU trial is launched as a separate job (``python -m falcon_lab.sweeps.job``) whose
rank 0 reports intermediate values to the trial through the storage. Optuna is used through its
public API only (:mod:`falcon_lab.sweeps.study`).

Modules: ``context`` (prepare, SweepContext), ``study`` (the study and its storage), ``trial`` (one
trial), ``storage`` (storage strings, heartbeats, stale trials), ``tracking`` (MLflow), this one
(the loops and the end).
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from . import storage as st
from .context import SweepContext, SweepMismatch, check_corners, prepare, visible_gpus
from .study import SweepStudy, open_study
from .trial import run_trial, surplus, trial_dir

__all__ = ["SweepContext", "SweepMismatch", "check_corners", "prepare", "load", "open_sweep",
           "worker_loop", "main_worker", "gpu_groups", "run_workers", "finalize", "run_trial",
           "trial_dir"]

log = logging.getLogger(__name__)


def open_sweep(ctx: SweepContext, seed_offset: int = 0, storage=None) -> SweepStudy:
    """The study with the space's sampler (seed + ``seed_offset``) and pruner, and its storage
    (``storage``: an already opened one)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = ctx.space()
    return open_study(ctx.storage, ctx.study_name, sampler=space.make_sampler(seed_offset),
                      pruner=space.make_pruner(), storage=storage)


def load(ctx: SweepContext, seed_offset: int = 0):
    """``(space, optuna.Study)`` of a prepared sweep."""
    return ctx.space(), open_sweep(ctx, seed_offset).study


# ---- the worker loop ------------------------------------------------------------------------------
def worker_loop(ctx: SweepContext, worker: int = 0, runner=None, max_trials: int | None = None) -> dict:
    """Run trials until the budget (COMPLETE + PRUNED) is reached; returns the final counts.

    ``max_trials`` stops this worker after that many trials of its own (used by tests and by
    users who want to cap one node's share).
    """
    from optuna.trial import TrialState

    space, sweep = ctx.space(), None
    mine = 0
    stopped = None
    while True:
        if sweep is None:
            # per-worker sampler seed offset (ours): otherwise N workers with the same seed would
            # propose the same parameters; it also moves on after a restart
            storage = st.open_storage(ctx.storage)
            n0 = storage.get_n_trials(storage.get_study_id_from_name(ctx.study_name))
            sweep = open_sweep(ctx, seed_offset=7919 * worker + n0, storage=storage)
        study = sweep.study
        for n in st.recover_stale(sweep, ctx.grace, ctx.max_retry):
            log.info("trial %d was left RUNNING by a dead worker: marked FAIL, parameters re-enqueued", n)
        c = st.counts(study)
        done = c["COMPLETE"] + c["PRUNED"]
        if done >= ctx.n_trials:
            break
        real_fail = sum(1 for t in study.get_trials(deepcopy=False)
                        if t.state == TrialState.FAIL
                        and not str(t.user_attrs.get("fail_reason", "")).startswith("surplus"))
        if real_fail >= space.max_failed:
            log.info("stopping: %d failed trials reached max_failed=%d; see the 'error' of the "
                     "failed trials (report=true)", real_fail, space.max_failed)
            stopped = "max_failed"
            break
        if max_trials is not None and mine >= max_trials:
            break
        if done + c["RUNNING"] >= ctx.n_trials:
            time.sleep(ctx.poll)  # the rest of the budget is running elsewhere; wait for it
            continue
        trial = study.ask()
        if surplus(study, trial, ctx.n_trials):
            trial.set_user_attr("fail_reason", "surplus: the budget was taken by other workers")
            study.tell(trial, state=TrialState.FAIL)
            continue
        run_trial(ctx, space, sweep, trial, runner=runner)
        mine += 1
        c = st.counts(study)
        log.info("progress: %d/%d trials done (%d complete, %d pruned, %d failed, %d running)",
                 c["COMPLETE"] + c["PRUNED"], ctx.n_trials, c["COMPLETE"], c["PRUNED"], c["FAIL"],
                 c["RUNNING"])
    out = st.counts(sweep.study)
    if stopped:
        out["stopped"] = stopped
    return out


def main_worker(argv: list[str] | None = None) -> int:
    """Entry of a worker process: ``python -m falcon_lab.sweeps.worker CONTEXT.json INDEX``."""
    from falcon_lab import logs

    logs.setup()
    argv = sys.argv[1:] if argv is None else argv
    ctx = SweepContext.load(argv[0])
    worker = int(argv[1]) if len(argv) > 1 else 0
    counts = worker_loop(ctx, worker)
    return 1 if counts.get("stopped") else 0


# ---- many workers ---------------------------------------------------------------------------------
def gpu_groups(workers: int, per_trial: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each worker: per_trial GPUs each, or None without GPUs."""
    n = visible_gpus()
    if n == 0:
        return [None] * workers
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in env.split(",")] if env else [str(i) for i in range(n)]
    if workers * per_trial > len(ids):
        raise ValueError(f"workers={workers} x {per_trial} GPU(s) per trial needs "
                         f"{workers * per_trial} GPUs; {len(ids)} visible")
    return [",".join(ids[i * per_trial:(i + 1) * per_trial]) for i in range(workers)]


def run_workers(ctx: SweepContext, workers: int, per_trial: int = 1) -> int:
    """Spawn worker processes against one study, show progress, wait; returns the worst exit code."""
    groups = gpu_groups(workers, per_trial)
    path = ctx.dump(Path(ctx.sweep_dir) / "context.json")
    procs = []
    for i, g in enumerate(groups):
        env = dict(os.environ)
        if g is not None:
            env["CUDA_VISIBLE_DEVICES"] = g
        logf = open(Path(ctx.sweep_dir) / f"worker-{i}.log", "ab")
        p = subprocess.Popen([sys.executable, "-m", "falcon_lab.sweeps.worker", str(path), str(i)],
                             env=env, stdout=logf, stderr=subprocess.STDOUT)
        procs.append((p, logf))
        log.info("worker %d pid %d%s, log %s", i, p.pid, f" on GPU(s) {g}" if g else "",
                 Path(ctx.sweep_dir) / f"worker-{i}.log")
    _, study = load(ctx)
    seen: set[int] = set()
    try:
        from tqdm import tqdm

        bar = tqdm(total=ctx.n_trials, desc=f"sweep {ctx.study_name}", unit="trial")
        while True:
            alive = [p for p, _ in procs if p.poll() is None]
            for t in study.get_trials(deepcopy=False):
                if t.state.is_finished() and t.number not in seen:
                    seen.add(t.number)
                    if t.state.name in ("COMPLETE", "PRUNED"):
                        bar.update(1)
                    bar.write(f"[sweep] trial {t.number} {t.state.name}"
                              + (f" value={t.value:.6g}" if t.value is not None else "")
                              + f" {t.params}")
            if not alive:
                break
            time.sleep(ctx.poll)
        bar.close()
    except KeyboardInterrupt:
        log.info("interrupted: stopping workers (their running trials are re-enqueued on resume)")
        for p, _ in procs:
            p.terminate()
        for p, _ in procs:
            p.wait()
        raise
    finally:
        for _, f in procs:
            f.close()
    return max(p.returncode for p, _ in procs)


# ---- finish ---------------------------------------------------------------------------------------
def finalize(ctx: SweepContext, *, interrupted: bool = False) -> dict:
    """Print the table and a summary (user-facing output); give the MLflow parent run its summary
    and plots; return the counts."""
    from .report import format_table, make_plots, write_csv

    _, study = load(ctx)
    c = st.counts(study)
    print(format_table(study), flush=True)
    files = []
    out = Path(ctx.sweep_dir)
    try:
        plots, skipped = make_plots(study, out / "plots")
        files = [*plots, write_csv(study, out / "trials.csv")]
        for k, why in skipped.items():
            log.info("plot %s skipped: %s", k, why)
    except Exception as e:
        log.warning("plots failed: %s", e)
    done = c["COMPLETE"] + c["PRUNED"]
    status = "KILLED" if interrupted else ("FINISHED" if done >= ctx.n_trials else "FAILED")
    if ctx.parent_run_id and ctx.tracking_uri:
        from .tracking import finalize_parent

        finalize_parent(ctx.tracking_uri, ctx.parent_run_id, study, files=files, status=status)
    lines = []
    try:
        best = study.best_trial
        lines.append(f"best trial {best.number}: value={best.value:.6g} params={best.params}")
    except ValueError:
        lines.append("no COMPLETE trial")
    lines.append(f"{done}/{ctx.n_trials} trials done ({c['COMPLETE']} complete, {c['PRUNED']} pruned, "
                 f"{c['FAIL']} failed); storage {st.describe(ctx.storage)}, study {ctx.study_name}")
    if ctx.tracking_uri:
        lines.append(f"MLflow: parent run {ctx.parent_run_id} in experiment {ctx.experiment_name!r}; "
                     f"open with: mlflow ui --backend-store-uri {ctx.tracking_uri}")
    print("\n".join(f"[sweep] {line}" for line in lines), flush=True)
    return c
