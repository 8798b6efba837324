"""The sweep driver: prepare a study once, run worker loops (ask -> train -> tell), finalize.

Flow of ``python -m falcon_lab.sweep ablation=NAME workers=N``:

1. :func:`prepare` (main process, once): load and check the search space (every searched key must
   exist in the composed fit config), create or load the Optuna study in its storage
   (``load_if_exists``), create the MLflow store and the study's parent run. Nothing here races:
   it happens before any worker starts.
2. :func:`worker_loop` (in-process for ``workers=1``, else N processes, one per GPU): fail stale
   trials and re-enqueue them, stop when COMPLETE + PRUNED reaches the budget, else ask a trial,
   train it (in-process, or as a separate job for multi-GPU trials), tell the outcome.
3. :func:`finalize` (main process): parent run gets best value/params, table and plots.

Every trial is one ``falcon_lab.training.run``; the Optuna loop never lives inside a DDP process
tree: a multi-GPU trial is launched as a separate job (``python -m falcon_lab.sweeps.job``) whose
rank 0 reports intermediate values to the trial through the storage.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from . import storage as st
from .runner import DEFAULT_RUNNER, load_runner
from .space import SearchSpace, check_keys, load_space, trial_overrides


def log(msg: str) -> None:
    print(f"[sweep] {msg}", flush=True)


@dataclasses.dataclass
class SweepContext:
    """Everything a worker needs; written as JSON for worker processes."""

    space_path: str
    n_trials: int
    study_name: str
    storage: str
    fit_overrides: list[str]
    runner: str = DEFAULT_RUNNER
    launch: str = "inprocess"          # inprocess | subprocess (separate job per trial)
    tracking_uri: str | None = None
    experiment_name: str | None = None
    parent_run_id: str | None = None
    sweep_dir: str = "sweeps"
    heartbeat: float = 15.0
    grace: float = 90.0
    poll: float = 2.0
    max_retry: int = 2
    devices: int = 1                   # devices one trial uses (GPUs given to each worker)

    def space(self) -> SearchSpace:
        return load_space(self.space_path, n_trials=self.n_trials)

    def dump(self, path: Path) -> Path:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "SweepContext":
        return cls(**json.loads(Path(path).read_text()))


class SweepMismatch(ValueError):
    pass


def _space_signature(space: SearchSpace, fit_overrides: list[str]) -> str:
    d = space.as_dict()
    for k in ("n_trials", "max_failed", "description"):
        d.pop(k, None)
    d["fit_overrides"] = list(fit_overrides)
    return json.dumps(d, sort_keys=True, default=str)


def prepare(space: SearchSpace, fit_overrides: list[str], *, study_name: str | None = None,
            storage: str | None = None, runner: str | None = None, launch: str = "auto",
            workdir: str | Path | None = None, tracking: bool = True, check: bool = True,
            command: str | None = None, **timing: Any) -> SweepContext:
    """Create (or load) the study and the MLflow parent run; validate the space against the config."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    workdir = Path(workdir or os.getcwd()).resolve()
    study_name = study_name or space.name
    for o in list(space.overrides) + list(fit_overrides):
        key = o.split("=", 1)[0].lstrip("+~")
        if key in ("run_dir", "ckpt_path", "logger.run_id", "logger.parent_run_id"):
            raise ValueError(
                f"{o}: a sweep sets {key} per trial (trial folders under sweeps/<study>/trials/, "
                f"retries resume from their checkpoints, child runs under the study's parent run); "
                f"remove this override")
    run_fn = load_runner(runner)
    composer = getattr(run_fn, "compose", None)
    cfg = None
    if composer is not None and check:
        try:
            cfg = composer(list(space.overrides) + list(fit_overrides))
        except Exception as e:  # Hydra's composition errors name the override
            if isinstance(e, ValueError):
                raise
            msg = str(e).strip().replace("\n", " ")
            raise ValueError(f"cannot compose the fit config with the space's overrides "
                             f"{list(space.overrides)} and {list(fit_overrides)}: {msg}") from e
        check_keys(space, cfg)
        validator = getattr(run_fn, "validate", None)
        if validator is not None:
            _check_corners(space, list(space.overrides) + list(fit_overrides), composer, validator)
    # MLflow settings: the fit config's logger section wins, then MLFLOW_TRACKING_URI, then ./mlruns
    from .tracking import default_tracking_uri, open_parent

    lg = cfg.get("logger") if cfg is not None else None
    tracking_uri = (os.environ.get("MLFLOW_TRACKING_URI")
                    or (lg.get("tracking_uri") if lg is not None else None)
                    or default_tracking_uri(workdir))
    if lg is not None and lg.get("name", "mlflow") in (None, "none", False):
        tracking = False  # logger=none: the trials log nothing, so no parent run either
    experiment = (lg.get("experiment_name") if lg is not None else None) or "falcon_lab"
    if launch == "auto":
        launch = "subprocess" if _devices_per_trial(cfg) > 1 else "inprocess"
    if launch not in ("inprocess", "subprocess"):
        raise ValueError(f"launch={launch}: one of auto, inprocess, subprocess")

    url = st.resolve_storage(storage, workdir)
    stor = st.open_storage(url)
    study = optuna.create_study(study_name=study_name, storage=stor, direction=space.direction,
                                load_if_exists=True)
    if study.direction.name.lower() != space.direction:
        raise SweepMismatch(
            f"study {study_name!r} in {st.describe(url)} was created to {study.direction.name.lower()}; "
            f"the space says {space.direction}. Use study=NEW_NAME.")
    sig = _space_signature(space, fit_overrides)
    old = study.user_attrs.get("falcon_lab:signature")
    if old is not None and old != sig:
        raise SweepMismatch(
            f"study {study_name!r} in {st.describe(url)} exists with a different search space or "
            f"fit overrides; resuming it would mix two experiments. Use study=NEW_NAME, or the "
            f"same space and overrides as before (stored: {old})")
    if old is None:
        study.set_user_attr("falcon_lab:signature", sig)
        study.set_user_attr("falcon_lab:space_path", space.path)
        study.set_user_attr("falcon_lab:metric", space.metric)
        study.set_user_attr("falcon_lab:description", space.description)
        study.set_user_attr("falcon_lab:fit_overrides", list(fit_overrides))
        if command:
            study.set_user_attr("falcon_lab:command", command)
    study.set_user_attr("falcon_lab:n_trials", space.n_trials)
    parent = None
    if tracking:
        parent = open_parent(tracking_uri, experiment, study_name,
                             study.user_attrs.get("falcon_lab:mlflow_parent_run_id"),
                             {"ablation": space.name, "metric": space.metric,
                              "direction": space.direction, "n_trials": space.n_trials,
                              "sampler": space.sampler, "pruner": space.pruner,
                              "storage": st.describe(url),
                              "overrides": list(space.overrides) + list(fit_overrides),
                              "parameters": {p.key: p.type for p in space.params}})
        study.set_user_attr("falcon_lab:mlflow_parent_run_id", parent)
        study.set_user_attr("falcon_lab:tracking_uri", tracking_uri)
    sweep_dir = workdir / "sweeps" / study_name
    sweep_dir.mkdir(parents=True, exist_ok=True)
    ctx = SweepContext(space_path=space.path, n_trials=space.n_trials, study_name=study_name,
                       storage=url, fit_overrides=list(fit_overrides),
                       runner=runner or DEFAULT_RUNNER, launch=launch,
                       tracking_uri=tracking_uri if tracking else None,
                       experiment_name=experiment, parent_run_id=parent, sweep_dir=str(sweep_dir),
                       devices=_devices_per_trial(cfg), **timing)
    return ctx


def _check_corners(space: SearchSpace, base: list[str], composer, validator) -> None:
    """Fail before any training if a corner of the space gives an invalid fit config (e.g. a
    window for a variant without one): the message names the parameters and the bad key."""
    from .space import SearchSpaceError, corner_params

    for combo in corner_params(space):
        try:
            validator(composer(base + trial_overrides(combo)))
        except Exception as e:
            shown = " ".join(trial_overrides(combo))
            raise SearchSpaceError(
                f"{space.path}: the trial config with {shown} is invalid: {e}") from e


def _devices_per_trial(cfg) -> int:
    if cfg is None:
        return 1
    tr = cfg.get("trainer") or {}
    dev, nodes = tr.get("devices", 1), tr.get("num_nodes", 1) or 1
    if isinstance(dev, int):
        n = dev
    elif isinstance(dev, (list, tuple)) or (hasattr(dev, "__len__") and not isinstance(dev, str)):
        n = len(dev)
    elif isinstance(dev, str) and dev.isdigit():
        n = int(dev)
    elif dev in ("auto", -1, "-1"):
        n = _visible_gpus() or 1
    else:
        n = 1
    return max(1, n) * max(1, int(nodes))


def _visible_gpus() -> int:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return len([d for d in env.split(",") if d.strip() and d.strip() != "-1"])
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def load(ctx: SweepContext, seed_offset: int = 0):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = ctx.space()
    study = optuna.load_study(study_name=ctx.study_name, storage=st.open_storage(ctx.storage),
                              sampler=space.make_sampler(seed_offset), pruner=space.make_pruner())
    return space, study


# ---- one trial ------------------------------------------------------------------------------------
def _surplus(study, trial, n_trials: int) -> bool:
    """True if trials asked before this one already cover the budget (another worker won)."""
    from optuna.trial import TrialState

    ahead = 0
    for t in study.get_trials(deepcopy=False):
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
            ahead += 1
        elif t.state == TrialState.RUNNING and t.number < trial.number:
            ahead += 1
    return ahead >= n_trials


def _tell(study, trial, values=None, state=None, **kw):
    """study.tell, tolerating samplers that call study.stop() from after_trial (Grid, BruteForce
    do when their grid is exhausted; Study.stop raises outside study.optimize). Our own loop
    decides when to stop (the budget), so the stop flag is simply ignored."""
    tl = study._thread_local
    prev = getattr(tl, "in_optimize_loop", False)
    tl.in_optimize_loop = True
    try:
        return study.tell(trial, values, state=state, **kw)
    finally:
        tl.in_optimize_loop = prev
        study._stop_flag = False


def _sys_attrs(study, trial) -> dict:
    return study._storage.get_trial_system_attrs(trial._trial_id)


def _tracking(ctx: SweepContext, study, trial, params: dict) -> dict:
    tags = {"optuna.study": ctx.study_name, "optuna.trial": str(trial.number),
            "falcon_lab.sweep": "trial"}
    tags.update({f"optuna.param.{k}": str(v) for k, v in params.items()})
    sys_attrs = _sys_attrs(study, trial)
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


def _take_over(ctx: SweepContext, study, trial, tracking: dict) -> int | None:
    """A retry of a killed trial that resumes from the killed trial's checkpoint carries over the
    values that trial reported. Returns the killed trial's number."""
    prev_n = _sys_attrs(study, trial)[st.RETRY_FROM_ATTR]
    prev = study.trials[prev_n] if prev_n < len(study.trials) else None
    if prev is None:
        return None
    if tracking.get("resume_ckpt"):
        log(f"trial {trial.number} resumes trial {prev_n} from {tracking['resume_ckpt']}")
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
        log(f"could not tag MLflow run {run_id}: {e}")


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


def trial_dir(ctx: SweepContext, number: int) -> Path:
    """Each trial's run folder (checkpoints, config): <sweep_dir>/trials/<number>."""
    return Path(ctx.sweep_dir) / "trials" / f"{number:04d}"


def run_trial(ctx: SweepContext, space: SearchSpace, study, trial, runner=None) -> str:
    """Train one asked trial and tell its outcome; returns the final state name."""
    from optuna.trial import TrialState

    params = space.suggest(trial)
    overrides = list(space.overrides) + list(ctx.fit_overrides) + trial_overrides(params)
    trial.set_user_attr("overrides", overrides)
    tracking = _tracking(ctx, study, trial, params)
    t0 = time.time()
    log(f"trial {trial.number} start: " + " ".join(trial_overrides(params)))
    prev_n = None
    if st.RETRY_FROM_ATTR in _sys_attrs(study, trial):
        prev_n = _take_over(ctx, study, trial, tracking)
    try:
        with st.Heartbeat(study, trial._trial_id, ctx.heartbeat):
            if ctx.launch == "subprocess":
                out = _run_job(ctx, space, trial, overrides, tracking)
            else:
                out = _run_inprocess(ctx, space, trial, overrides, tracking, runner)
    except BaseException as e:  # KeyboardInterrupt / SystemExit: mark, re-enqueue, re-raise
        trial.set_user_attr("fail_reason", f"interrupted ({type(e).__name__})")
        _tell(study, trial, state=TrialState.FAIL, skip_if_finished=True)
        import optuna

        study.add_trial(optuna.trial.create_trial(
            state=TrialState.WAITING, params=trial.params, distributions=trial.distributions,
            system_attrs={st.RETRY_ATTR: _sys_attrs(study, trial).get(st.RETRY_ATTR, trial.number),
                          st.RETRY_FROM_ATTR: trial.number}))
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
        _tell(study, trial, state=TrialState.FAIL)
        state, value = "FAIL", None
        err = out["error"].strip().splitlines()[-1] if out["error"].strip() else "?"
        log(f"trial {trial.number} FAILED: {err}  (full traceback: trial user attr 'error')")
    elif out.get("pruned"):
        trial.set_user_attr("pruned_at_step", out.get("pruned_at_step"))
        _tell(study, trial, state=TrialState.PRUNED)
        state, value = "PRUNED", history[-1][1] if history else None
        log(f"trial {trial.number} PRUNED at step {out.get('pruned_at_step')}")
    else:
        # the best validation value: reported now, or carried over from a resumed killed trial
        carried = study._storage.get_trial(trial._trial_id).intermediate_values
        value = _best(list(carried.items()) + list(history), space.direction)
        if value is None:
            if history:
                msg = f"metric {space.metric!r} was NaN at every validation (the run diverged)"
            else:
                msg = (f"metric {space.metric!r} was never logged at a validation; logged "
                       f"metrics: {', '.join(out.get('available_metrics') or []) or 'none'}")
            trial.set_user_attr("error", msg)
            _tell(study, trial, state=TrialState.FAIL)
            state = "FAIL"
            log(f"trial {trial.number} FAILED: {msg}")
        else:
            _tell(study, trial, value)
            state = "COMPLETE"
            log(f"trial {trial.number} COMPLETE {space.metric}={value:.6g} "
                f"({time.time() - t0:.1f} s)")
    if ctx.tracking_uri:
        tags = {"optuna.state": state, "optuna.trial": str(trial.number),
                **({"optuna.value": value} if value is not None else {}),
                **{k: v for k, v in tracking["tags"].items() if k.startswith("optuna.retry")}}
        _close_mlflow(ctx, trial, prev_n, run_id, tags)
    return state


def _best(history, direction: str):
    import math

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
        "storage": ctx.storage, "study_name": ctx.study_name, "trial_id": trial._trial_id,
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


# ---- the worker loop ------------------------------------------------------------------------------
def worker_loop(ctx: SweepContext, worker: int = 0, runner=None, max_trials: int | None = None) -> dict:
    """Run trials until the budget (COMPLETE + PRUNED) is reached; returns the final counts.

    ``max_trials`` stops this worker after that many trials of its own (used by tests and by
    users who want to cap one node's share).
    """
    import optuna

    space, study = None, None
    offset = 0
    mine = 0
    stopped = None
    while True:
        if study is None:
            # per-worker sampler seed offset (ours): otherwise N workers with the same seed would
            # propose the same parameters; it also moves on after a restart
            import optuna as _o

            n0 = len(_o.load_study(study_name=ctx.study_name,
                                   storage=st.open_storage(ctx.storage)).trials)
            offset = 7919 * worker + n0
            space, study = load(ctx, seed_offset=offset)
        stale = st.recover_stale(study, ctx.grace, ctx.max_retry)
        for n in stale:
            log(f"trial {n} was left RUNNING by a dead worker: marked FAIL, parameters re-enqueued")
        c = st.counts(study)
        done = c["COMPLETE"] + c["PRUNED"]
        if done >= ctx.n_trials:
            break
        real_fail = sum(1 for t in study.get_trials(deepcopy=False)
                        if t.state == optuna.trial.TrialState.FAIL
                        and not str(t.user_attrs.get("fail_reason", "")).startswith("surplus"))
        if real_fail >= space.max_failed:
            log(f"stopping: {real_fail} failed trials reached max_failed={space.max_failed}; "
                f"see the 'error' of the failed trials (report=true)")
            stopped = "max_failed"
            break
        if max_trials is not None and mine >= max_trials:
            break
        if done + c["RUNNING"] >= ctx.n_trials:
            time.sleep(ctx.poll)  # the rest of the budget is running elsewhere; wait for it
            continue
        trial = study.ask()
        if _surplus(study, trial, ctx.n_trials):
            trial.set_user_attr("fail_reason", "surplus: the budget was taken by other workers")
            _tell(study, trial, state=optuna.trial.TrialState.FAIL)
            continue
        run_trial(ctx, space, study, trial, runner=runner)
        mine += 1
        c = st.counts(study)
        log(f"progress: {c['COMPLETE'] + c['PRUNED']}/{ctx.n_trials} trials done "
            f"({c['COMPLETE']} complete, {c['PRUNED']} pruned, {c['FAIL']} failed, "
            f"{c['RUNNING']} running)")
    out = st.counts(study)
    if stopped:
        out["stopped"] = stopped
    return out


def main_worker(argv: list[str] | None = None) -> int:
    """Entry of a worker process: ``python -m falcon_lab.sweeps.worker CONTEXT.json INDEX``."""
    argv = sys.argv[1:] if argv is None else argv
    ctx = SweepContext.load(argv[0])
    worker = int(argv[1]) if len(argv) > 1 else 0
    counts = worker_loop(ctx, worker)
    return 1 if counts.get("stopped") else 0


# ---- many workers ---------------------------------------------------------------------------------
def gpu_groups(workers: int, per_trial: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each worker: per_trial GPUs each, or None without GPUs."""
    n = _visible_gpus()
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
        log(f"worker {i} pid {p.pid}" + (f" on GPU(s) {g}" if g else "") +
            f", log {Path(ctx.sweep_dir) / f'worker-{i}.log'}")
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
        log("interrupted: stopping workers (their running trials are re-enqueued on resume)")
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
    """Print the table; give the MLflow parent run its summary and plots; return the counts."""
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
            log(f"plot {k} skipped: {why}")
    except Exception as e:
        log(f"plots failed: {e}")
    done = c["COMPLETE"] + c["PRUNED"]
    status = "KILLED" if interrupted else ("FINISHED" if done >= ctx.n_trials else "FAILED")
    if ctx.parent_run_id and ctx.tracking_uri:
        from .tracking import finalize_parent

        finalize_parent(ctx.tracking_uri, ctx.parent_run_id, study, files=files, status=status)
    try:
        best = study.best_trial
        log(f"best trial {best.number}: value={best.value:.6g} params={best.params}")
    except ValueError:
        log("no COMPLETE trial")
    log(f"{done}/{ctx.n_trials} trials done ({c['COMPLETE']} complete, {c['PRUNED']} pruned, "
        f"{c['FAIL']} failed); storage {st.describe(ctx.storage)}, study {ctx.study_name}")
    if ctx.tracking_uri:
        log(f"MLflow: parent run {ctx.parent_run_id} in experiment {ctx.experiment_name!r}; "
            f"open with: mlflow ui --backend-store-uri {ctx.tracking_uri}")
    return c
