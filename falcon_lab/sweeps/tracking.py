"""MLflow side of a sweep: one parent run per study; trials are child runs (``mlflow.parentRunId``).

The children are created by the training run itself (``logger.parent_run_id``); the driver only
creates/reopens the parent, tags each child with its Optuna outcome once the trial is told, and
finally gives the parent the best value, best parameters, the trial table and the plots.
All calls go through ``MlflowClient`` (no global active run), so a Lightning ``MLFlowLogger`` in
the same process is never disturbed.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def default_tracking_uri(workdir: str | Path | None = None) -> str:
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    root = Path(workdir or os.getcwd()).resolve() / "mlruns"
    return f"sqlite:///{root / 'mlflow.db'}"


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    return MlflowClient(tracking_uri=uri)


def ensure_experiment(uri: str, name: str) -> str:
    """Get or create the experiment (creating the SQLite store once, before workers start)."""
    client = _client(uri)
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = None
    if uri.startswith("sqlite:///"):
        location = Path(uri[len("sqlite:///"):]).parent.joinpath("artifacts").as_uri()
    from falcon_lab.training.mlflow import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG

    try:  # training runs: the UI opens it on the runs table, not MLflow 3's GenAI overview
        return client.create_experiment(name, artifact_location=location, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
    except Exception:  # created concurrently by someone else
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def _short(v: Any, n: int = 5000) -> str:
    s = v if isinstance(v, str) else json.dumps(v, default=str)
    return s if len(s) <= n else s[: n - 3] + "..."


def _parent_lock(uri: str, lock_path: str | Path | None):
    """The file lock the processes of one sweep take around finding-or-creating the parent: next to a SQLite store
    (whatever folder each process runs in), else ``lock_path`` (the sweep's folder, which processes started
    together share); none for a remote store without one (then only the convergence in ``_open_parent``)."""
    import contextlib

    from filelock import FileLock

    if uri.startswith("sqlite:///"):
        lock_path = Path(uri[len("sqlite:///"):]).parent / ".falcon_lab-sweep-parent.lock"
    if lock_path is None:
        return contextlib.nullcontext()
    Path(lock_path).parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(lock_path), timeout=300)


def open_parent(uri: str, experiment: str, study_name: str, run_id: str | None,
                info: dict[str, Any], lock_path: str | Path | None = None) -> str:
    """Reopen the study's parent run (resume) or create it; returns its run id."""
    with _parent_lock(uri, lock_path):
        return _open_parent(uri, experiment, study_name, run_id, info)


def _open_parent(uri: str, experiment: str, study_name: str, run_id: str | None, info: dict[str, Any]) -> str:
    client = _client(uri)
    if run_id:
        try:
            run = client.get_run(run_id)
            if run.info.lifecycle_stage == "active":
                client.update_run(run_id, status="RUNNING")
                return run_id
        except Exception:
            pass  # the study was moved to a new MLflow store: start a fresh parent
    exp_id = ensure_experiment(uri, experiment)
    # Several processes of one sweep can start together, each before any has recorded the parent in the study.
    # Under the lock (a local store or a shared sweep folder) the first creates it and the others find it. Without
    # one they converge on the earliest created and a process whose own parent lost removes it; that is only
    # best-effort: start times are taken by each client before its insert, so a run made later can sort first.
    existing = _study_parents(client, exp_id, study_name)
    if existing:
        client.update_run(existing[0], status="RUNNING")
        return existing[0]
    tags = {"falcon_lab.sweep": "parent", "optuna.study": study_name,
            **{f"sweep.{k}": _short(v) for k, v in info.items()}}
    mine = client.create_run(exp_id, tags=tags, run_name=f"sweep-{study_name}").info.run_id
    chosen = _study_parents(client, exp_id, study_name)[0]
    if chosen != mine:
        client.delete_run(mine)
    return chosen


def _study_parents(client, exp_id: str, study_name: str) -> list[str]:
    """Active parent runs of a study, earliest first (ties broken by run id, the same order everywhere)."""
    runs = client.search_runs([exp_id], f"tags.`falcon_lab.sweep` = 'parent' and tags.`optuna.study` = '{study_name}'")
    runs = [r for r in runs if r.info.lifecycle_stage == "active"]
    return [r.info.run_id for r in sorted(runs, key=lambda r: (r.info.start_time or 0, r.info.run_id))]


def tag_child(uri: str, run_id: str | None, tags: dict[str, Any], name: str | None = None) -> None:
    if not run_id:
        return
    from mlflow.entities import RunTag

    client = _client(uri)
    client.log_batch(run_id, tags=[RunTag(k, _short(v)) for k, v in tags.items()])
    if name:
        client.update_run(run_id, name=name)


def kill_stale_children(uri: str, experiment: str, study_name: str, numbers,
                        exclude: str | None = None) -> list[str]:
    """Mark the still-RUNNING child run(s) of killed trials as KILLED; returns their ids."""
    client = _client(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    runs = []
    for number in sorted({int(n) for n in numbers}):
        runs += client.search_runs(
            [exp.experiment_id],
            f"tags.`optuna.study` = '{study_name}' and tags.`optuna.trial` = '{number}' "
            f"and attributes.status = 'RUNNING'")
    runs = [r for r in runs if r.info.run_id != exclude]
    for r in runs:
        client.set_tag(r.info.run_id, "optuna.state", "FAIL")
        client.set_terminated(r.info.run_id, status="KILLED")
    return [r.info.run_id for r in runs]


def finalize_parent(uri: str, run_id: str, study, *, files: list[Path], status: str) -> None:
    """Best value/params, counts and artifacts on the parent run; then end it with ``status``."""
    from mlflow.entities import Metric, RunTag
    from optuna.trial import TrialState

    client = _client(uri)
    trials = study.get_trials(deepcopy=False)
    now = int(time.time() * 1000)
    n = {s: sum(t.state == s for t in trials) for s in TrialState}
    metrics = [Metric(f"n_{s.name.lower()}", float(c), now, 0) for s, c in n.items()
               if s in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)]
    tags = []
    best = _best(study)
    if best is not None:
        done = n[TrialState.COMPLETE] + n[TrialState.PRUNED]
        metrics.append(Metric("best_value", float(best.value), now, done))
        tags.append(RunTag("best.trial", str(best.number)))
        tags += [RunTag(f"best.{k}", _short(v)) for k, v in best.params.items()]
        mlrun = best.user_attrs.get("mlflow_run_id")
        if mlrun:
            tags.append(RunTag("best.mlflow_run_id", mlrun))
    client.log_batch(run_id, metrics=metrics, tags=tags)
    for f in files:
        client.log_artifact(run_id, str(f), artifact_path="plots" if f.suffix == ".png" else None)
    client.set_terminated(run_id, status=status)


def _best(study):
    try:
        return study.best_trial
    except ValueError:
        return None
