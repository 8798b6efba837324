"""Multi-device trials as separate jobs (2-process CPU DDP, pruning decided on rank 0 and broadcast),
the journal-file storage for several hosts, and the GPU assignment of worker processes."""
from __future__ import annotations

import os

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from falcon_lab.sweeps import driver
from falcon_lab.sweeps.space import load_space
from falcon_lab.sweeps.storage import resolve_storage, stale_reason

RUNNER = "sweep_helpers:toy_runner"


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tests = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    return tmp_path


def test_ddp_trial_runs_as_a_separate_job_and_is_pruned_on_all_ranks(in_tmp):
    """trainer.devices=2 makes the driver launch the trial as `python -m falcon_lab.sweeps.job`
    (its own Lightning DDP process tree). Rank 0 reports to Optuna; the threshold pruner stops the
    run at step 4 and both ranks stop (a rank that kept training would hang the job)."""
    p = in_tmp / "ddp.yaml"
    p.write_text(yaml.safe_dump({
        "metric": "val/loss", "direction": "minimize", "n_trials": 1,
        "sampler": {"name": "random", "seed": 0},
        "pruner": {"name": "threshold", "upper": 0.5, "n_warmup_steps": 4},
        "overrides": ["debug=smoke", "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
                      "trainer.precision=32-true", "trainer.max_steps=12", "trainer.cpu_threads=1",
                      "trainer.val_check_interval=2", "trainer.enable_progress_bar=false",
                      "logger.experiment_name=ddp_sweep"],
        "parameters": {"optim.lr": {"type": "log", "low": 1e-3, "high": 1e-2}}}))
    ctx = driver.prepare(load_space(str(p)), [], workdir=in_tmp)
    assert ctx.launch == "subprocess" and ctx.devices == 2
    counts = driver.worker_loop(ctx)
    assert counts["PRUNED"] == 1, counts
    _, study = driver.load(ctx)
    t = study.trials[0]
    assert t.state == TrialState.PRUNED and t.user_attrs["pruned_at_step"] == 4
    assert sorted(t.intermediate_values) == [2, 4]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{in_tmp}/mlruns/mlflow.db")
    run = client.get_run(t.user_attrs["mlflow_run_id"])
    assert run.data.tags["mlflow.parentRunId"] == ctx.parent_run_id
    assert run.data.tags["optuna.state"] == "PRUNED"
    # two validations logged, then the run stopped (Lightning puts validation points at step - 1)
    assert len(client.get_metric_history(run.info.run_id, "val/loss")) == 2
    assert run.info.status == "FINISHED"


def test_journal_storage_sweep_and_resume(in_tmp):
    p = in_tmp / "toy.yaml"
    p.write_text(yaml.safe_dump({
        "metric": "val/loss", "direction": "minimize", "n_trials": 2,
        "sampler": {"name": "random", "seed": 0}, "pruner": {"name": "nop"},
        "overrides": ["toy.steps=2"],
        "parameters": {"toy.lr": {"type": "log", "low": 0.01, "high": 0.4}}}))
    kw = dict(storage="journal:shared/optuna.journal", runner=RUNNER, workdir=in_tmp, tracking=False)
    ctx = driver.prepare(load_space(str(p)), [], **kw)
    assert ctx.storage == f"journal:{in_tmp}/shared/optuna.journal"
    assert driver.worker_loop(ctx, max_trials=1)["COMPLETE"] == 1   # a worker stopped early
    ctx = driver.prepare(load_space(str(p)), [], **kw)               # and the sweep resumes
    assert driver.worker_loop(ctx)["COMPLETE"] == 2
    assert (in_tmp / "shared" / "optuna.journal").stat().st_size > 0
    ctx = driver.prepare(load_space(str(p), n_trials=3), [], **kw)  # a bigger budget extends it
    assert driver.worker_loop(ctx)["COMPLETE"] == 3
    _, study = driver.load(ctx)
    assert [t.number for t in study.trials] == [0, 1, 2]


def test_storage_strings(tmp_path):
    assert resolve_storage(None, tmp_path) == f"sqlite:///{tmp_path}/sweeps/optuna.db"
    assert resolve_storage("sqlite:///x.db", tmp_path) == f"sqlite:///{tmp_path}/x.db"
    assert resolve_storage("runs.log", tmp_path) == f"journal:{tmp_path}/runs.log"
    assert resolve_storage("postgresql://u:p@db:5432/optuna") == "postgresql://u:p@db:5432/optuna"
    with pytest.raises(ValueError, match="storage=redis://x: not understood"):
        resolve_storage("redis://x")


def test_gpu_groups(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5,7")
    assert driver.gpu_groups(4, 1) == ["2", "3", "5", "7"]
    assert driver.gpu_groups(2, 2) == ["2,3", "5,7"]
    with pytest.raises(ValueError, match="workers=3 x 2 GPU"):
        driver.gpu_groups(3, 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert driver.gpu_groups(2, 1) == [None, None]  # CPU: no assignment


def test_stale_reason_by_pid_and_by_heartbeat(tmp_path):
    import socket
    import subprocess
    import sys
    import time

    from falcon_lab.sweeps.study import SweepStudy

    st = optuna.storages.RDBStorage(f"sqlite:///{tmp_path}/s.db")
    study = optuna.create_study(study_name="s", storage=st)
    t = study.ask()
    tid = SweepStudy(study, st, st.get_study_id_from_name("s")).trial_id(t.number)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    st.set_trial_system_attr(tid, "falcon_lab:host", socket.gethostname())
    st.set_trial_system_attr(tid, "falcon_lab:pid", dead.pid)
    st.set_trial_system_attr(tid, "falcon_lab:heartbeat", time.time())
    assert "is gone" in stale_reason(study.trials[0], grace=60)
    st.set_trial_system_attr(tid, "falcon_lab:host", "another-host")
    assert stale_reason(study.trials[0], grace=60) is None           # fresh heartbeat elsewhere
    assert "no heartbeat" in stale_reason(study.trials[0], grace=60, now=time.time() + 120)
    st.set_trial_system_attr(tid, "falcon_lab:host", socket.gethostname())
    st.set_trial_system_attr(tid, "falcon_lab:pid", os.getpid())
    assert stale_reason(study.trials[0], grace=60) is None           # our own live process


def test_open_storage_survives_the_schema_creation_race(tmp_path, monkeypatch):
    """The loser of two processes creating one new SQLite storage sees Optuna's schema stamp fail
    (this broke a CI run); open_storage opens again instead of failing, and other errors still
    raise at once."""
    import sqlalchemy.exc

    from falcon_lab.sweeps import storage as st

    real, calls = optuna.storages.RDBStorage, []

    class Racing(real):
        def __init__(self, url, **kw):
            calls.append(url)
            if len(calls) == 1:
                real(url, **kw)  # the winner creates and stamps the schema ...
                raise sqlalchemy.exc.IntegrityError(  # ... and this process loses the stamp
                    "INSERT INTO alembic_version", {},
                    Exception("UNIQUE constraint failed: alembic_version.version_num"))
            super().__init__(url, **kw)

    monkeypatch.setattr(optuna.storages, "RDBStorage", Racing)
    url = resolve_storage(f"sqlite:///{tmp_path}/new/optuna.db")
    stor = st.open_storage(url)
    assert len(calls) == 2
    optuna.create_study(study_name="s", storage=stor).optimize(lambda t: t.suggest_float("x", 0, 1),
                                                               n_trials=2)
    assert len(optuna.load_study(study_name="s", storage=url).trials) == 2

    class Broken(real):
        def __init__(self, url, **kw):
            calls.append(url)
            raise sqlalchemy.exc.OperationalError("connect", {},
                                                  Exception("unable to open database file"))

    monkeypatch.setattr(optuna.storages, "RDBStorage", Broken)
    calls.clear()
    with pytest.raises(sqlalchemy.exc.OperationalError, match="unable to open"):
        st.open_storage(url)
    assert len(calls) == 1


def test_processes_opening_one_new_sqlite_storage_at_once(tmp_path):
    """Four processes open the same new SQLite file together and each adds a study: none fails."""
    import subprocess
    import sys

    url = resolve_storage(f"sqlite:///{tmp_path}/race/optuna.db")
    code = ("import sys, optuna; from falcon_lab.sweeps.storage import open_storage; "
            "optuna.create_study(study_name='s'+sys.argv[2], storage=open_storage(sys.argv[1]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, url, str(i)], stderr=subprocess.PIPE,
                              text=True) for i in range(4)]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(errs)[-3000:]
    assert sorted(s.study_name for s in optuna.get_all_study_summaries(url)) == ["s0", "s1", "s2", "s3"]
