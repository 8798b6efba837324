"""Sweeps over the real training stack (falcon_lab.training.run, tiny model, a few CPU steps):
the smoke space end to end, the report, a SIGKILLed sweep that resumes from the killed trial's
checkpoint, and search-space keys checked against the composed fit config."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from falcon_lab.sweep import main as sweep_main
from falcon_lab.sweeps import driver
from falcon_lab.sweeps.space import SearchSpaceError, available, check_keys, load_space
from falcon_lab.sweeps.storage import RETRY_ATTR


def _client(tmp_path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlruns/mlflow.db")


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


def test_smoke_sweep_end_to_end_and_report(in_tmp, capsys):
    tmp_path = in_tmp
    t0 = time.time()
    assert sweep_main(["ablation=smoke", "logger.experiment_name=sweep_smoke"]) == 0
    elapsed = time.time() - t0
    study = optuna.load_study(study_name="smoke", storage=f"sqlite:///{tmp_path}/sweeps/optuna.db")
    assert len(study.trials) == 3
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in study.trials)
    assert study.trials[0].state == TrialState.COMPLETE  # the median pruner needs a first trial
    for t in study.trials:
        steps = sorted(t.intermediate_values)
        assert steps and steps[0] == 2  # reported at global_step of each validation (debug=smoke)
        assert t.user_attrs["mlflow_run_id"]
        assert (tmp_path / "sweeps" / "smoke" / "trials" / f"{t.number:04d}" / "config.yaml").exists()

    client = _client(tmp_path)
    exp = client.get_experiment_by_name("sweep_smoke")
    parent_id = study.user_attrs["falcon_lab:mlflow_parent_run_id"]
    children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    assert sorted(r.info.run_id for r in children) == sorted(t.user_attrs["mlflow_run_id"] for t in study.trials)
    for r in children:
        n = int(r.data.tags["optuna.trial"])
        t = study.trials[n]
        assert r.data.tags["optuna.state"] == t.state.name
        assert r.data.tags["optuna.param.mixer.gate"] == t.params["mixer.gate"]
        assert float(r.data.params["optim.lr"]) == pytest.approx(t.params["optim.lr"])  # the trial's config
        assert len(client.get_metric_history(r.info.run_id, "val/loss")) == len(t.intermediate_values)
        last_train_step = max(m.step for m in client.get_metric_history(r.info.run_id, "train/loss"))
        if t.state == TrialState.PRUNED:  # it really stopped: no training past the pruned step
            assert last_train_step < t.user_attrs["pruned_at_step"] < 4
        else:
            assert last_train_step == 3  # debug=smoke: 4 steps, logged at 0..3
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["best_value"] == pytest.approx(study.best_value)
    assert parent.data.tags["best.trial"] == str(study.best_trial.number)
    arts = {a.path for a in client.list_artifacts(parent_id, "plots")}
    assert {"plots/optimization_history.png", "plots/parallel_coordinate.png"} <= arts

    capsys.readouterr()
    assert sweep_main(["ablation=smoke", "report=true"]) == 0
    out = capsys.readouterr().out
    assert "trial" in out and "state" in out and "mixer.gate" in out
    for t in study.trials:
        assert f"{t.state.name}" in out
    rep = tmp_path / "sweeps" / "smoke" / "report"  # beside the sweep, not in the tracked ablations/reports/
    assert not (tmp_path / "ablations").exists()
    md = (rep / "README.md").read_text()
    assert "## Best trial" in md and "![optimization_history](optimization_history.png)" in md
    assert (rep / "optimization_history.png").stat().st_size > 1000
    assert (rep / "trials.csv").read_text().count("\n") == 4
    # re-running a finished study trains nothing more
    capsys.readouterr()
    assert sweep_main(["ablation=smoke", "logger.experiment_name=sweep_smoke"]) == 0
    assert "nothing to train" in capsys.readouterr().out
    assert len(optuna.load_study(study_name="smoke",
                                 storage=f"sqlite:///{tmp_path}/sweeps/optuna.db").trials) == 3
    print(f"smoke sweep: {elapsed:.1f} s")
    assert elapsed < 180


def test_shipped_spaces_match_the_fit_config():
    """Every searched key exists, and every corner of every shipped space is a valid fit config."""
    from falcon_lab.sweeps.runner import compose_fit, validate_fit

    for name in available():
        s = load_space(name)
        cfg = compose_fit(list(s.overrides))
        check_keys(s, cfg)
        driver.check_corners(s, list(s.overrides), compose_fit, validate_fit)


def _space_file(path, key, choices):
    """A two-trial search space over one categorical key, written to `path`."""
    path.write_text(yaml.safe_dump({
        "metric": "val/loss", "direction": "minimize", "n_trials": 2,
        "parameters": {key: {"type": "categorical", "choices": choices}}}))
    return path


def test_invalid_trial_config_fails_before_training(in_tmp):
    p = _space_file(in_tmp / "window_on_1a.yaml", "mixer.window", [2, 4])
    with pytest.raises(SearchSpaceError, match=r"the trial config with mixer.window=2 is invalid: "
                                               r"mixer.window: applies only to the sliding-window"):
        driver.prepare(load_space(str(p)), [], workdir=in_tmp, tracking=False)
    # with the variant fixed to 3A the same space is fine
    driver.prepare(load_space(str(p)), ["mixer.variant=3A"], workdir=in_tmp, tracking=False)
    assert not (in_tmp / "mlruns").exists()


def test_unknown_fit_key_is_named(in_tmp):
    p = _space_file(in_tmp / "bad.yaml", "mixer.windw", [1, 2])
    with pytest.raises(SearchSpaceError, match=r"parameters\.mixer\.windw: no such key in the fit "
                                               r"config \(did you mean mixer\.window"):
        driver.prepare(load_space(str(p)), [], workdir=in_tmp, tracking=False)
    assert sweep_main([f"ablation={p}"]) == 2  # the CLI reports it as a usage error


def _schema_stamped(db) -> bool:
    """Whether Optuna has finished creating a SQLite storage (read-only peek; writes nothing)."""
    if not db.exists():
        return False
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)
        try:
            return con.execute("SELECT count(*) FROM alembic_version").fetchone()[0] > 0
        finally:
            con.close()
    except sqlite3.Error:
        return False


def test_sigkill_mid_trial_resumes_from_checkpoint(in_tmp):
    """Kill the sweep process while its second trial trains; the restarted sweep marks that trial
    FAIL, reruns its parameters from its last checkpoint, and never retrains finished trials."""
    tmp_path = in_tmp
    space = tmp_path / "killme.yaml"
    space.write_text(yaml.safe_dump({
        "metric": "val/loss", "direction": "minimize", "n_trials": 2,
        "sampler": {"name": "random", "seed": 1}, "pruner": {"name": "nop"},
        # batches large enough that the 50 steps after the first validation leave a wide window
        # for the kill to land mid-training
        "overrides": ["debug=smoke", "trainer.max_steps=60", "trainer.val_check_interval=10",
                      "data.seq_len=128", "data.batch_size=16"],
        "parameters": {"optim.lr": {"type": "log", "low": 1e-3, "high": 1e-2}}}))
    cmd = [sys.executable, "-m", "falcon_lab.sweep", f"ablation={space}", "heartbeat=1", "grace=120",
           "logger.experiment_name=killme"]
    storage = f"sqlite:///{tmp_path}/sweeps/optuna.db"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}

    stor = None

    def checkpointed_second_trial():
        nonlocal stor
        try:
            if stor is None:
                # an observer must not open Optuna's storage before the sweep has stamped the new
                # SQLite file's schema: even with skip_table_creation, RDBStorage stamps the schema
                # version itself and races the sweep ("UNIQUE constraint failed: alembic_version")
                if not _schema_stamped(tmp_path / "sweeps" / "optuna.db"):
                    return None
                stor = optuna.storages.RDBStorage(storage, skip_compatibility_check=True,
                                                  skip_table_creation=True)
            ts = stor.get_all_trials(stor.get_study_id_from_name("killme"), deepcopy=False)
        except Exception:
            return None
        if not any(t.state == TrialState.COMPLETE for t in ts):
            return None
        for t in ts:
            ck = tmp_path / "sweeps" / "killme" / "trials" / f"{t.number:04d}" / "checkpoints" / "last.ckpt"
            if t.state == TrialState.RUNNING and t.intermediate_values and ck.exists():
                return t.number
        return None

    with open(tmp_path / "run1.log", "wb") as log1:
        p = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log1, stderr=subprocess.STDOUT)
        try:
            t0 = time.time()
            while checkpointed_second_trial() is None:
                assert p.poll() is None, (tmp_path / "run1.log").read_text()[-3000:]
                assert time.time() - t0 < 240, "the sweep never reached its second trial"
                time.sleep(0.2)
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
    before = optuna.load_study(study_name="killme", storage=storage).trials
    finished = {t.number: (t.params, t.value, t.datetime_complete) for t in before
                if t.state == TrialState.COMPLETE}
    killed = [t for t in before if t.state == TrialState.RUNNING]
    assert len(killed) == 1 and finished
    k = killed[0]

    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert f"trial {k.number} was left RUNNING by a dead worker" in out.stdout
    assert f"resumes trial {k.number} from" in out.stdout
    after = optuna.load_study(study_name="killme", storage=storage).trials
    assert sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in after) == 2
    for n, (params, value, dt) in finished.items():  # finished trials were not redone
        assert (after[n].params, after[n].value, after[n].datetime_complete) == (params, value, dt)
    assert out.stdout.count(" start: ") == 2 - len(finished)
    assert after[k.number].state == TrialState.FAIL
    assert after[k.number].user_attrs["fail_reason"].startswith("stale: worker pid")
    retry = [t for t in after if t.system_attrs.get(RETRY_ATTR) == k.number]
    assert len(retry) == 1 and retry[0].params == k.params and retry[0].state == TrialState.COMPLETE
    r = retry[0]
    # carried-over values of the killed run, then the resumed run's own validations up to step 60
    assert set(k.intermediate_values) <= set(r.intermediate_values) and max(r.intermediate_values) == 60
    # MLflow: the resumed training continued the killed trial's run (its checkpoint names it),
    # which now carries the retry's trial number; no run is left RUNNING
    client = _client(tmp_path)
    exp = client.get_experiment_by_name("killme")
    runs = client.search_runs([exp.experiment_id], "tags.`optuna.study` = 'killme'")
    assert all(x.info.status in ("FINISHED", "KILLED") for x in runs)
    resumed = client.get_run(r.user_attrs["mlflow_run_id"])
    assert resumed.info.status == "FINISHED" and resumed.info.run_name == f"killme-t{r.number:03d}"
    assert resumed.data.tags["optuna.trial"] == str(r.number)
    assert resumed.data.tags["optuna.retry_of"] == str(k.number)
    steps = [m.step for m in client.get_metric_history(resumed.info.run_id, "val/loss")]
    assert len(steps) == len(set(steps)) == 6  # one point per validation: it did not start over
