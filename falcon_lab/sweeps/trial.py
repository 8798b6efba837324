"""One trial of a sweep: :func:`run_trial` takes an asked trial, trains it (in this process, or as a
separate job for a multi-device trial), and tells Optuna its outcome; a retry of a killed trial resumes
from that trial's last checkpoint, and the trial's MLflow child run is tagged with the outcome."""
from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from . import storage as st
from .context import SweepContext
from .runner import load_runner
from .space import SearchSpace, trial_overrides
from .study import SweepStudy

log = logging.getLogger(__name__)


def trial_dir(ctx: SweepContext, number: int) -> Path:
    """Each trial's run folder (checkpoints, config): <sweep_dir>/trials/<number>."""
    return Path(ctx.sweep_dir) / "trials" / f"{number:04d}"


def surplus(study, trial, n_trials: int) -> bool:
    """True if trials asked before this one already cover the budget (another worker won)."""
    from optuna.trial import TrialState

    ahead = 0
    for t in study.get_trials(deepcopy=False):
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
            ahead += 1
        elif t.state == TrialState.RUNNING and t.number < trial.number:
            ahead += 1
    return ahead >= n_trials


def _tracking(ctx: SweepContext, sweep: SweepStudy, trial, params: dict) -> dict:
    tags = {"optuna.study": ctx.study_name, "optuna.trial": str(trial.number),
            "falcon_lab.sweep": "trial"}
    tags.update({f"optuna.param.{k}": str(v) for k, v in params.items()})
    sys_attrs = sweep.system_attrs(trial.number)
    retry = sys_attrs.get(st.RETRY_ATTR)
    out = {"experiment_name": ctx.experiment_name, "tracking_uri": ctx.tracking_uri,
           "run_name": f"{ctx.study_name}-t{trial.number:03d}",
           "parent_run_id": ctx.parent_run_id, "tags": tags,
           "trial_dir": str(trial_dir(ctx, trial.number))}
    if retry is not None:
        tags["optuna.retry_of"] = str(retry)
        prev = sys_attrs.get(st.RETRY_FROM_ATTR, retry)
        last = trial_dir(ctx, prev) / "checkpoints" / "last.ckpt"
        if _readable_checkpoint(last):  # continue the killed trial from its last checkpoint
            out["resume_ckpt"] = str(last)
    return out


def _take_over(sweep: SweepStudy, trial, tracking: dict) -> int | None:
    """A retry of a killed trial that resumes from the killed trial's checkpoint carries over the
    values that trial reported. Returns the killed trial's number."""
    prev_n = sweep.system_attrs(trial.number)[st.RETRY_FROM_ATTR]
    trials = sweep.study.trials
    prev = trials[prev_n] if prev_n < len(trials) else None
    if prev is None:
        return None
    if tracking.get("resume_ckpt"):
        log.info("trial %d resumes trial %d from %s", trial.number, prev_n, tracking["resume_ckpt"])
        for step, value in sorted(prev.intermediate_values.items()):
            trial.report(value, step)
    return prev_n


def _close_mlflow(ctx: SweepContext, trial, prev_n: int | None, run_id: str | None,
                  tags: dict) -> None:
    """Tag the trial's child run with its outcome. For a retry: the training continues the killed
    trial's MLflow run when it resumes from its checkpoint (then that run is re-tagged and renamed
    as the retry's); any run of the killed trial still RUNNING is closed as KILLED."""
    from .tracking import kill_stale_children, tag_child

    try:
        if prev_n is not None:
            origin = tags.get("optuna.retry_of", prev_n)
            kill_stale_children(ctx.tracking_uri, ctx.experiment_name, ctx.study_name,
                                {prev_n, origin}, exclude=run_id)
        if run_id:
            tag_child(ctx.tracking_uri, run_id, tags,
                      name=f"{ctx.study_name}-t{trial.number:03d}" if prev_n is not None else None)
    except Exception as e:  # bookkeeping only
        log.warning("could not tag MLflow run %s: %s", run_id, e)


def _readable_checkpoint(path: Path) -> bool:
    """A complete torch checkpoint (a zip whose central directory is intact): a SIGKILL while
    writing leaves a truncated file, which must not be resumed from."""
    import zipfile

    if not path.is_file():
        return False
    try:
        with zipfile.ZipFile(path) as z:
            return bool(z.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def _requeue(sweep: SweepStudy, trial) -> None:
    """Enqueue the parameters of an interrupted trial again, as a retry resuming from it."""
    import optuna
    from optuna.trial import TrialState

    attrs = sweep.system_attrs(trial.number)
    sweep.study.add_trial(optuna.trial.create_trial(
        state=TrialState.WAITING, params=trial.params, distributions=trial.distributions,
        system_attrs={st.RETRY_ATTR: attrs.get(st.RETRY_ATTR, trial.number),
                      st.RETRY_FROM_ATTR: trial.number}))


def run_trial(ctx: SweepContext, space: SearchSpace, sweep: SweepStudy, trial, runner=None) -> str:
    """Train one asked trial and tell its outcome; returns the final state name."""
    from optuna.trial import TrialState

    study = sweep.study
    params = space.suggest(trial)
    overrides = list(space.overrides) + list(ctx.fit_overrides) + trial_overrides(params)
    trial.set_user_attr("overrides", overrides)
    tracking = _tracking(ctx, sweep, trial, params)
    t0 = time.time()
    log.info("trial %d start: %s", trial.number, " ".join(trial_overrides(params)))
    prev_n = None
    if st.RETRY_FROM_ATTR in sweep.system_attrs(trial.number):
        prev_n = _take_over(sweep, trial, tracking)
    try:
        with st.Heartbeat(sweep.storage, sweep.trial_id(trial.number), ctx.heartbeat):
            if ctx.launch == "subprocess":
                out = _run_job(ctx, space, trial, overrides, tracking)
            else:
                out = _run_inprocess(ctx, space, trial, overrides, tracking, runner)
    except BaseException as e:  # KeyboardInterrupt / SystemExit: mark, re-enqueue, re-raise
        trial.set_user_attr("fail_reason", f"interrupted ({type(e).__name__})")
        study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
        _requeue(sweep, trial)
        raise
    result, history = out.get("result") or {}, out.get("history") or []
    run_id = result.get("run_id")
    for k in ("run_id", "ckpt_path", "run_dir"):
        if result.get(k):
            trial.set_user_attr("mlflow_run_id" if k == "run_id" else k, str(result[k]))
    trial.set_user_attr("seconds", round(time.time() - t0, 2))
    trial.set_user_attr("steps_validated", [s for s, _ in history])
    if out.get("error"):
        trial.set_user_attr("error", out["error"][-2000:])
        study.tell(trial, state=TrialState.FAIL)
        state, value = "FAIL", None
        err = out["error"].strip().splitlines()[-1] if out["error"].strip() else "?"
        log.info("trial %d FAILED: %s  (full traceback: trial user attr 'error')", trial.number, err)
    elif out.get("pruned"):
        trial.set_user_attr("pruned_at_step", out.get("pruned_at_step"))
        study.tell(trial, state=TrialState.PRUNED)
        state, value = "PRUNED", history[-1][1] if history else None
        log.info("trial %d PRUNED at step %s", trial.number, out.get("pruned_at_step"))
    else:
        # the best validation value: reported now, or carried over from a resumed killed trial
        carried = sweep.frozen(trial.number).intermediate_values
        value = _best(list(carried.items()) + list(history), space.direction)
        if value is None:
            if history:
                msg = f"metric {space.metric!r} was NaN at every validation (the run diverged)"
            else:
                msg = (f"metric {space.metric!r} was never logged at a validation; logged "
                       f"metrics: {', '.join(out.get('available_metrics') or []) or 'none'}")
            trial.set_user_attr("error", msg)
            study.tell(trial, state=TrialState.FAIL)
            state = "FAIL"
            log.info("trial %d FAILED: %s", trial.number, msg)
        else:
            study.tell(trial, value)
            state = "COMPLETE"
            log.info("trial %d COMPLETE %s=%.6g (%.1f s)", trial.number, space.metric, value,
                     time.time() - t0)
    if ctx.tracking_uri:
        tags = {"optuna.state": state, "optuna.trial": str(trial.number),
                **({"optuna.value": value} if value is not None else {}),
                **{k: v for k, v in tracking["tags"].items() if k.startswith("optuna.retry")}}
        _close_mlflow(ctx, trial, prev_n, run_id, tags)
    return state


def _best(history, direction: str):
    vals = [v for _, v in history if not math.isnan(v)]
    if not vals:
        return None
    return min(vals) if direction == "minimize" else max(vals)


def _run_inprocess(ctx, space, trial, overrides, tracking, runner) -> dict:
    from .pruning import StepPruningCallback

    runner = runner or load_runner(ctx.runner)
    cb = StepPruningCallback(trial, space.metric, space.direction)
    out: dict[str, Any] = {}
    try:
        out["result"] = runner(overrides, [cb], tracking)
    except Exception:
        out["error"] = traceback.format_exc()
    out.update(history=cb.history, pruned=cb.pruned, pruned_at_step=cb.pruned_at_step,
               available_metrics=cb.available_metrics)
    return out


def _run_job(ctx, space, trial, overrides, tracking) -> dict:
    """A separate process (the root of a possibly multi-GPU Lightning job) trains the trial."""
    d = Path(ctx.sweep_dir) / "jobs"
    d.mkdir(parents=True, exist_ok=True)
    spec = d / f"trial-{trial.number:04d}.json"
    result = d / f"trial-{trial.number:04d}.result.json"
    result.unlink(missing_ok=True)
    spec.write_text(json.dumps({
        "storage": ctx.storage, "study_name": ctx.study_name, "trial_number": trial.number,
        "space_path": ctx.space_path,
        "metric": space.metric, "direction": space.direction, "runner": ctx.runner,
        "overrides": overrides, "tracking": tracking, "result_path": str(result)}))
    proc = subprocess.run([sys.executable, "-m", "falcon_lab.sweeps.job", str(spec)])
    if not result.exists():
        return {"error": f"trial job exited with code {proc.returncode} and wrote no result "
                         f"(spec {spec})"}
    out = json.loads(result.read_text())
    out["history"] = [tuple(h) for h in out.get("history", [])]
    return out
