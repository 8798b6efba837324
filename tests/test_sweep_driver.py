"""Sweep-driver mechanics on a toy objective (a real Lightning Trainer, real MLflow, real Optuna
SQLite storage; see sweep_helpers.py): pruning stops early, two worker processes share one
study, failures are recorded. The SIGKILL/resume test runs real training: test_sweep_smoke.py."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from falcon_lab.sweeps import driver
from falcon_lab.sweeps.space import load_space
from falcon_lab.sweeps.storage import HOST_ATTR, PID_ATTR

TESTS = Path(__file__).resolve().parent
RUNNER = "sweep_helpers:toy_runner"


def _space(tmp_path, name="toy", **kw) -> str:
    d = {"metric": "val/loss", "direction": "minimize", "n_trials": 3,
         "sampler": {"name": "random", "seed": 0}, "pruner": {"name": "nop"},
         "parameters": {"toy.lr": {"type": "log", "low": 0.01, "high": 0.4}}}
    d.update(kw)
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(d, sort_keys=False))
    return str(p)


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    return env


def _mlflow_children(tmp_path, parent):
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    exp = c.get_experiment_by_name("falcon_lab")
    return c, c.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")


def test_pruned_trial_stops_early_and_runs_group_under_parent(tmp_path, monkeypatch):
    """A threshold pruner stops the lr=0 arm at its first checked step; the lr=0.4 arm runs all
    6 steps. Fewer val/loss points are logged for the pruned child run in MLflow."""
    monkeypatch.chdir(tmp_path)
    path = _space(tmp_path, n_trials=None, sampler={"name": "grid"},
                  pruner={"name": "threshold", "upper": 3.0, "n_warmup_steps": 2},
                  overrides=["toy.steps=6"],
                  parameters={"toy.lr": {"type": "categorical", "choices": [0.0, 0.4]}})
    space = load_space(path)
    assert space.n_trials == 2
    ctx = driver.prepare(space, [], runner=RUNNER, workdir=tmp_path)
    counts = driver.worker_loop(ctx)
    assert counts["COMPLETE"] == 1 and counts["PRUNED"] == 1
    _, study = driver.load(ctx)
    by_lr = {t.params["toy.lr"]: t for t in study.trials}
    pruned, full = by_lr[0.0], by_lr[0.4]
    assert pruned.state == TrialState.PRUNED and full.state == TrialState.COMPLETE
    assert max(pruned.intermediate_values) == 2 < max(full.intermediate_values) == 6
    assert pruned.user_attrs["pruned_at_step"] == 2
    # the objective value is the best validation value seen, as logged
    assert full.value == pytest.approx(min(full.intermediate_values.values()))

    driver.finalize(ctx)
    client, children = _mlflow_children(tmp_path, ctx.parent_run_id)
    assert len(children) == 2
    steps = {}
    for r in children:
        hist = client.get_metric_history(r.info.run_id, "val/loss")
        steps[r.data.tags["optuna.state"]] = len(hist)
        assert r.data.tags["optuna.study"] == ctx.study_name
        assert r.data.tags["optuna.trial"] in ("0", "1")
        assert "optuna.param.toy.lr" in r.data.tags
    assert steps["PRUNED"] == 2 and steps["COMPLETE"] == 6
    parent = client.get_run(ctx.parent_run_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["best_value"] == pytest.approx(full.value)
    assert parent.data.tags["best.toy.lr"] == "0.4"
    arts = {a.path for a in client.list_artifacts(ctx.parent_run_id, "plots")}
    assert "plots/optimization_history.png" in arts


def test_failed_trial_is_recorded_and_the_study_continues(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _space(tmp_path, n_trials=2, max_failed=10, sampler={"name": "random", "seed": 0},
                  parameters={"toy.fail": {"type": "categorical", "choices": [True, False]},
                              "toy.lr": {"type": "categorical", "choices": [0.1, 0.2]}})
    space = load_space(path)
    ctx = driver.prepare(space, [], runner=RUNNER, workdir=tmp_path, tracking=False)
    _, study = driver.load(ctx)
    study.enqueue_trial({"toy.fail": True, "toy.lr": 0.1})  # the first trial raises
    counts = driver.worker_loop(ctx)
    _, study = driver.load(ctx)
    first = study.trials[0]
    assert first.state == TrialState.FAIL
    assert "RuntimeError: toy.fail=true: this trial fails on purpose" in first.user_attrs["error"]
    # the budget counts COMPLETE + PRUNED only: the study went on until 2 trials completed
    assert counts["COMPLETE"] == 2
    assert all(t.params["toy.fail"] is False for t in study.trials if t.state == TrialState.COMPLETE)
    assert all(t.params["toy.fail"] is True for t in study.trials if t.state == TrialState.FAIL)


def test_max_failed_stops_a_hopeless_sweep(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _space(tmp_path, n_trials=3, max_failed=2, overrides=["toy.fail=true"])
    ctx = driver.prepare(load_space(path), [], runner=RUNNER, workdir=tmp_path, tracking=False)
    counts = driver.worker_loop(ctx)
    assert counts == {"COMPLETE": 0, "PRUNED": 0, "FAIL": 2, "RUNNING": 0, "WAITING": 0,
                      "stopped": "max_failed"}


def test_two_workers_share_one_sqlite_study(tmp_path):
    path = _space(tmp_path, n_trials=4, overrides=["toy.steps=3", "toy.sleep=1.0"])  # ~4 s a trial
    cmd = [sys.executable, "-m", "falcon_lab.sweep", f"ablation={path}", f"runner={RUNNER}",
           "workers=2"]
    out = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    study = optuna.load_study(study_name="toy", storage=f"sqlite:///{tmp_path}/sweeps/optuna.db")
    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert len(done) == 4
    numbers = [t.number for t in study.trials]
    assert len(numbers) == len(set(numbers))
    # both workers trained, with different parameters (per-worker sampler seeds)
    assert len({t.system_attrs[PID_ATTR] for t in done}) == 2
    assert len({t.params["toy.lr"] for t in done}) == 4
    assert all(t.system_attrs[HOST_ATTR] for t in done)
    for i in range(2):
        assert (tmp_path / "sweeps" / "toy" / f"worker-{i}.log").exists()


def test_grid_sampler_under_ask_tell_leaves_stopping_to_the_loop():
    """GridSampler.after_trial calls study.stop() once every point was asked, which raises outside
    study.optimize; the sweep's sampler wrapper makes it a no-op, and the outcome is recorded."""
    from falcon_lab.sweeps.study import LoopDecidesStop

    def ask_tell(study, state, value=None):
        t = study.ask()
        t.suggest_categorical("x", [0, 1])
        study.tell(t, value, state=state)

    plain = optuna.create_study(sampler=optuna.samplers.GridSampler({"x": [0, 1]}, seed=0))
    ask_tell(plain, TrialState.FAIL)
    with pytest.raises(RuntimeError, match="stop"):  # the grid is exhausted: Optuna's own stop()
        ask_tell(plain, TrialState.COMPLETE, 1.0)
    study = optuna.create_study(sampler=LoopDecidesStop(optuna.samplers.GridSampler({"x": [0, 1]}, seed=0)))
    ask_tell(study, TrialState.FAIL)
    ask_tell(study, TrialState.COMPLETE, 1.0)
    ask_tell(study, TrialState.COMPLETE, 2.0)  # the loop goes on: a failed point does not count
    assert [t.state for t in study.trials] == [TrialState.FAIL, TrialState.COMPLETE, TrialState.COMPLETE]
    assert {t.params["x"] for t in study.trials[:2]} == {0, 1}


def test_sweeps_use_no_private_optuna_attribute():
    """The sweep code reaches Optuna through its public API only (issue 13): no attribute access such
    as study._storage, trial._trial_id, study._thread_local or study._stop_flag."""
    import ast

    import falcon_lab.sweep
    import falcon_lab.sweeps

    private = {"_storage", "_trial_id", "_study_id", "_thread_local", "_stop_flag", "_directions",
               "_get_trials", "_cached_frozen_trial"}
    files = [Path(falcon_lab.sweep.__file__), *Path(falcon_lab.sweeps.__file__).parent.glob("*.py")]
    found = [f"{f.name}:{n.lineno} .{n.attr}" for f in files for n in ast.walk(ast.parse(f.read_text()))
             if isinstance(n, ast.Attribute) and n.attr in private]
    assert len(files) > 10 and not found, found
